// DeviceGuard (dtensor/kernels/cuda/cuda_device_guard.h): it must not create a CUDA context on the
// device it restores. Each case runs in a fresh process (a death-test child), the only place
// where "no context exists yet" can be checked. Needs 1 GPU for the context check itself and
// 2 for the guard; skips with the reason otherwise.
#include <cstdlib>
#include <thread>

#include "dtensor/tensor/device.h"
#include "gtest/gtest.h"

#ifdef DTENSOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "dtensor/kernels/cuda/cuda_device_guard.h"
#endif

namespace dtensor {
namespace {

#ifdef DTENSOR_WITH_CUDA

// The check the guard relies on, against what CUDA documents: no context in a fresh process,
// one after cudaSetDevice + cudaFree(nullptr).
TEST(DeviceGuardDeathTest, PrimaryContextCheckSeesContextsAppear) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device visible";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (internal::CudaPrimaryContextActive(0)) std::_Exit(3);
        if (cudaSetDevice(0) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) std::_Exit(4);
        std::_Exit(internal::CudaPrimaryContextActive(0) ? 0 : 5);
      },
      ::testing::ExitedWithCode(0), "");
}

// A thread that never chose a device reads device 0; the guard for cuda:1 must not set device
// 0 back (that would create a context there), and must restore it where it has a context.
TEST(DeviceGuardDeathTest, RestoresOnlyADeviceWithAContext) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << CudaDeviceCount() << " visible";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        int code = 0;
        std::thread([&code] {
          {
            internal::DeviceGuard guard(1);
            if (!guard.ok() || cudaFree(nullptr) != cudaSuccess) code = 4;
          }
          if (internal::CudaPrimaryContextActive(0)) code = 1;  // the bug: a context on GPU 0
          if (!internal::CudaPrimaryContextActive(1)) code = 5;
          // Now device 0 has a context: the guard goes back to it.
          if (cudaSetDevice(0) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) code = 4;
          { internal::DeviceGuard guard(1); }
          int now = -1;
          if (cudaGetDevice(&now) != cudaSuccess || now != 0) code = 6;
        }).join();
        std::_Exit(code);
      },
      ::testing::ExitedWithCode(0), "");
}

#else

TEST(DeviceGuardTest, NeedsCuda) { GTEST_SKIP() << "built without CUDA: no DeviceGuard"; }

#endif

}  // namespace
}  // namespace dtensor
