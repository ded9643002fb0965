// cuDNN's fused attention graphs (dtensor/kernels/cuda/cudnn_sdpa.h), checked with no GPU: each
// graph is handed to cuDNN's heuristics for an H100 described by device properties (cuDNN's
// device-less compilation, 9.8 and newer), and an execution plan is finalized from what they
// offer. cuDNN only offers an engine for a graph its fused-attention engines match, and a plan
// finalizes only after its kernels compiled: so this catches a graph cuDNN would decline on the
// GPU (a wrong attribute, type, layout or pattern), which the GPU tests
// (CudaKernelsTest.CudnnAttentionMatchesCpu) can only run where a GPU is lent.
//
// Where no driver is installed, the driver API that cuDNN loads is the CUDA Toolkit's stub
// library (lib64/stubs/libcuda.so, loaded here first under its soname libcuda.so.1): its
// functions fail with CUDA_ERROR_STUB_LIBRARY, so the last step, loading the compiled kernels,
// fails there, and that failure (after compilation) is what a plan's status must then be.
// Numbers are not checked here: only a GPU runs the kernels.
#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#if defined(DTENSOR_WITH_CUDNN)
#include "dtensor/kernels/cuda/cudnn_sdpa.h"
#endif

namespace dtensor {
namespace {

#if defined(DTENSOR_WITH_CUDNN)

using internal::CheckCudnnSdpaPlan;
using internal::SdpaPlanCheck;
using internal::SdpaProblem;

// An H100 SXM (80 GB) as cuDNN's device properties describe it: sm_90, 132 SMs, 227 KiB of
// shared memory per block, 50 MiB of L2.
constexpr const char* kH100 =
    R"({"deviceName":"NVIDIA H100 80GB HBM3","deviceVer":900,"driverVer":13000,"cudaDeviceId":0,)"
    R"("multiProcessorCount":132,"maxGridSize":[2147483647,65535,65535],"maxBlockSize":[1024,1024,64],)"
    R"("regsPerBlock":65536,"warpSize":32,"maxSharedMemoryPerBlock":49152,"maxSharedMemoryPerBlockOptin":232448,)"
    R"("reservedSharedMemoryPerBlock":1024,"maxRegistersPerSM":65536,"maxCtasPerSM":32,"maxThreadsPerBlock":1024,)"
    R"("maxThreadsPerSM":2048,"pciDeviceId":0,"isTccDriver":0,"supportCoopLaunch":1,"totalGlobalMem":84987740160,)"
    R"("smClockRateKHz":1980000,"memClockRateKHz":2619000,"l2CacheSize":52428800})";

// The driver API cuDNN will use: the installed driver's, else the toolkit's stub (see above).
// Sets *stub when it is the stub; "" or why neither loads.
std::string LoadDriverApi(bool* stub) {
  *stub = false;
  if (dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL) != nullptr) return "";
  const std::string path = absl::StrCat(DTENSOR_CUDA_STUBS_DIR, "/libcuda.so");
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) {
    *stub = true;
    return "";
  }
  const char* why = dlerror();
  return absl::StrCat("neither libcuda.so.1 nor ", path, " loads: ", why != nullptr ? why : "no reason given");
}

// Whether `check` shows a plan cuDNN built: finalized, or (with the stub driver) compiled and
// only then failing to load.
bool PlanBuilt(const SdpaPlanCheck& check, bool stub) {
  if (check.plan.ok()) return true;
  return stub && check.plan.message().find("EXECUTION_FAILED_CUDA_DRIVER") != std::string::npos;
}

class CudnnSdpaPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = LoadDriverApi(&stub_);
    if (!why.empty()) GTEST_SKIP() << why;
    // Loads libcudnn; skip where it is not installed (the build found only its headers).
    const absl::StatusOr<SdpaPlanCheck> probe = CheckCudnnSdpaPlan({false, DType::kBFloat16, 1, 1, 64, 64}, kH100);
    if (!probe.ok() && absl::IsFailedPrecondition(probe.status())) GTEST_SKIP() << probe.status();
  }
  bool stub_ = false;
};

TEST_F(CudnnSdpaPlanTest, GptShapesHaveAnEngineForwardAndBackward) {
  struct Case {
    DType dtype;
    int64_t b, h, t, d;
  };
  // The shapes CudaKernelsTest.CudnnAttentionMatchesCpu runs on a GPU (one query, one 64-row
  // tile, a ragged end, GPT-2's T = 1024 with 12 heads at B = 16, D = 128), then float16 once.
  const Case cases[] = {{DType::kBFloat16, 1, 1, 1, 64},    {DType::kBFloat16, 1, 2, 64, 64},
                        {DType::kBFloat16, 2, 3, 130, 64},  {DType::kBFloat16, 16, 12, 1024, 64},
                        {DType::kBFloat16, 1, 2, 200, 128}, {DType::kFloat16, 2, 3, 130, 64}};
  for (const Case& c : cases) {
    for (bool backward : {false, true}) {
      const SdpaProblem p{backward, c.dtype, c.b, c.h, c.t, c.d};
      const std::string what = absl::StrCat(backward ? "backward " : "forward ", DTypeName(c.dtype), " [", c.b, ", ",
                                            c.h, ", ", c.t, ", ", c.d, "]");
      const absl::StatusOr<SdpaPlanCheck> check = CheckCudnnSdpaPlan(p, kH100);
      ASSERT_TRUE(check.ok()) << what << ": the graph itself was refused: " << check.status();
      EXPECT_GE(check->configs, 1) << what << ": cuDNN offers no engine for the graph";
      EXPECT_TRUE(PlanBuilt(*check, stub_))
          << what << ": " << check->tried << " of " << check->configs << " plans tried, the last: " << check->plan;
    }
  }
}

// The check can fail: a head dim that is not a multiple of 8 (cuDNN's fused attention reads
// heads in 16-byte vectors) gets no plan. (Large head dims are no such case: for D = 512 and up
// cuDNN 9.19 offers a generic forward engine.)
TEST_F(CudnnSdpaPlanTest, AHeadDimNotAMultipleOf8IsDeclined) {
  for (bool backward : {false, true}) {
    const absl::StatusOr<SdpaPlanCheck> check = CheckCudnnSdpaPlan({backward, DType::kBFloat16, 1, 2, 128, 33}, kH100);
    ASSERT_TRUE(check.ok()) << check.status();
    EXPECT_FALSE(PlanBuilt(*check, stub_))
        << (backward ? "backward" : "forward") << ": " << check->configs << " configs, plan " << check->plan;
  }
}

// float32 is declined before cuDNN is asked, as dtensor's own kernels take it.
TEST_F(CudnnSdpaPlanTest, Float32IsDeclinedUpFront) {
  const absl::StatusOr<SdpaPlanCheck> check = CheckCudnnSdpaPlan({false, DType::kFloat32, 1, 1, 64, 64}, kH100);
  ASSERT_FALSE(check.ok());
  EXPECT_TRUE(internal::IsCudnnDecline(check.status())) << check.status();
  EXPECT_NE(check.status().message().find("float32"), std::string::npos) << check.status();
}

#else

TEST(CudnnSdpaPlanTest, GptShapesHaveAnEngineForwardAndBackward) {
  GTEST_SKIP() << "dtensor was built without cuDNN's headers (or without CUDA): attention runs dtensor's own kernels";
}

#endif

}  // namespace
}  // namespace dtensor
