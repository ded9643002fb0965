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
// What the graphs compute is checked here by interpreting them on the CPU in float64 (see
// CudnnSdpaGraphTest below); cuDNN's kernels' numbers only on a GPU.
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

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

// The driver API cuDNN will use: the installed driver's, else the toolkit's stub (see above),
// loaded once per process (the stub, once loaded, answers to libcuda.so.1 itself). Sets *stub
// when it is the stub; returns "" or why neither loads.
std::string LoadDriverApi(bool* stub) {
  static bool is_stub = false;
  static const std::string why = [] {
    if (dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL) != nullptr) return std::string();
    const std::string path = absl::StrCat(DTENSOR_CUDA_STUBS_DIR, "/libcuda.so");
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) {
      is_stub = true;
      return std::string();
    }
    const char* err = dlerror();
    return absl::StrCat("neither libcuda.so.1 nor ", path, " loads: ", err != nullptr ? err : "no reason given");
  }();
  *stub = is_stub;
  return why;
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

// GPT's attention hands q, k, v over as heads of the fused qkv projection [B, T, 3, H, D] and
// out and dout as heads of [B, T, H, D], uncopied, and takes dq, dk, dv as heads of one
// [B, T, 3, H, D]: cuDNN takes those strides (GPT-2 124M, B = 16).
TEST_F(CudnnSdpaPlanTest, FusedProjectionStridesHaveAnEngine) {
  const int64_t b = 16, h = 12, t = 1024, d = 64, c = h * d;
  for (bool backward : {false, true}) {
    SdpaProblem p{backward, DType::kBFloat16, b, h, t, d};
    p.q_strides = p.k_strides = p.v_strides = {t * 3 * c, d, 3 * c, 1};
    p.o_strides = p.do_strides = {t * c, d, c, 1};
    if (backward) p.dq_strides = p.dk_strides = p.dv_strides = p.q_strides;
    const absl::StatusOr<SdpaPlanCheck> check = CheckCudnnSdpaPlan(p, kH100);
    ASSERT_TRUE(check.ok()) << check.status();
    EXPECT_GE(check->configs, 1) << (backward ? "backward" : "forward");
    EXPECT_TRUE(PlanBuilt(*check, stub_)) << (backward ? "backward" : "forward") << ": " << check->plan;
  }
  // Rows that do not start 16-byte aligned (a row stride of 3 * c + 1 elements) are declined
  // before cuDNN is asked: dtensor's own kernels then read copies.
  SdpaProblem odd{false, DType::kBFloat16, b, h, t, d};
  odd.q_strides = {t * (3 * c + 1), d, 3 * c + 1, 1};
  const absl::StatusOr<SdpaPlanCheck> check = CheckCudnnSdpaPlan(odd, kH100);
  ASSERT_FALSE(check.ok());
  EXPECT_TRUE(internal::IsCudnnDecline(check.status())) << check.status();
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

// ---- The graphs' meaning, on the CPU ----
// An interpreter of SdpaGraph (DescribeSdpaGraph: the same calls that build the cuDNN graph) in
// float64, after cuDNN's documented semantics of each operation: it runs the forward and
// backward graphs on small random problems, and their outputs must be attention, computed
// directly below. This checks what the plan test above cannot: the mask's direction, the
// transposed views (K^T, V^T, E^T, dS^T), which operand each subtraction takes, where the
// scale goes. (Rounding to the io type is not modelled: cuDNN's own numbers are checked on a
// GPU, CudaKernelsTest.CudnnAttentionMatchesCpu.)
using internal::DescribeSdpaGraph;
using internal::SdpaGraph;
using internal::SdpaGraphOp;
using internal::SdpaGraphTensor;
using Dims = std::array<int64_t, 4>;

// A tensor's values by logical index (row-major over its dims), with its dims and strides.
struct Values {
  Dims dims{}, strides{};
  std::vector<double> v;
  int64_t Count() const { return dims[0] * dims[1] * dims[2] * dims[3]; }
};

Dims Unravel(int64_t i, const Dims& dims) {
  Dims idx{};
  for (int k = 3; k >= 0; --k) {
    idx[static_cast<size_t>(k)] = i % dims[static_cast<size_t>(k)];
    i /= dims[static_cast<size_t>(k)];
  }
  return idx;
}
int64_t Offset(const Dims& idx, const Dims& strides) {
  int64_t o = 0;
  for (size_t k = 0; k < 4; ++k) o += idx[k] * strides[k];
  return o;
}
// The logical index of `src` that element `idx` of another tensor reads (broadcasting dims of
// extent 1); an index past one of src's dims is a graph error (reported, read as element 0).
int64_t Broadcast(const Dims& idx, const Values& src) {
  int64_t i = 0;
  for (size_t k = 0; k < 4; ++k) {
    if (src.dims[k] != 1 && idx[k] >= src.dims[k]) {
      ADD_FAILURE() << "index " << idx[k] << " past dim " << k << " of extent " << src.dims[k];
      return 0;
    }
    i = i * src.dims[k] + (src.dims[k] == 1 ? 0 : idx[k]);
  }
  return i;
}

class GraphInterpreter {
 public:
  explicit GraphInterpreter(const SdpaGraph& g) : g_(g) {
    for (const SdpaGraphTensor& t : g.tensors) meta_[t.uid] = &t;
  }
  // Binds a non-virtual tensor to `storage` from element `base` on (read through the tensor's
  // strides), or a scalar.
  void Bind(int64_t uid, const std::vector<double>& storage, int64_t base = 0) {
    const SdpaGraphTensor& t = *meta_.at(uid);
    Values x{t.dims, t.strides, {}};
    x.v.resize(static_cast<size_t>(x.Count()));
    for (int64_t i = 0; i < x.Count(); ++i) {
      x.v[static_cast<size_t>(i)] = storage.at(static_cast<size_t>(base + Offset(Unravel(i, t.dims), t.strides)));
    }
    vals_[uid] = std::move(x);
  }
  void Run() {
    for (const SdpaGraphOp& op : g_.ops) Step(op);
  }
  // A tensor's values by logical index.
  const Values& Get(int64_t uid) const { return vals_.at(uid); }
  // Writes a non-virtual tensor's values where the graph puts them: into `storage` from element
  // `base` on, through the tensor's strides.
  void Store(int64_t uid, std::vector<double>& storage, int64_t base = 0) const {
    const SdpaGraphTensor& t = *meta_.at(uid);
    const Values& x = vals_.at(uid);
    for (int64_t i = 0; i < x.Count(); ++i) {
      storage.at(static_cast<size_t>(base + Offset(Unravel(i, t.dims), t.strides))) = x.v[static_cast<size_t>(i)];
    }
  }

 private:
  void Step(const SdpaGraphOp& op) {
    const SdpaGraphTensor& yt = *meta_.at(op.y);
    Values y{yt.dims, yt.strides,
             std::vector<double>(static_cast<size_t>(yt.dims[0] * yt.dims[1] * yt.dims[2] * yt.dims[3]))};
    const Values& x = vals_.at(op.x);
    using K = SdpaGraphOp::Kind;
    switch (op.kind) {
      case K::kMatmul: {
        const Values& b = vals_.at(op.b);
        const int64_t kk = x.dims[3];
        if (b.dims[2] != kk || y.dims[2] != x.dims[2] || y.dims[3] != b.dims[3]) {
          ADD_FAILURE() << "matmul " << op.x << " @ " << op.b << " -> " << op.y << ": shapes do not chain";
          break;
        }
        for (int64_t i = 0; i < y.Count(); ++i) {
          const Dims idx = Unravel(i, y.dims);
          double acc = 0;
          for (int64_t k = 0; k < kk; ++k) {
            acc += x.v[static_cast<size_t>(Broadcast({idx[0], idx[1], idx[2], k}, x))] *
                   b.v[static_cast<size_t>(Broadcast({idx[0], idx[1], k, idx[3]}, b))];
          }
          y.v[static_cast<size_t>(i)] = acc;
        }
        break;
      }
      case K::kReduceAdd:
      case K::kReduceMax: {
        std::fill(y.v.begin(), y.v.end(), op.kind == K::kReduceAdd ? 0.0 : -std::numeric_limits<double>::infinity());
        for (int64_t i = 0; i < x.Count(); ++i) {
          double& acc = y.v[static_cast<size_t>(Broadcast(Unravel(i, x.dims), y))];
          const double xv = x.v[static_cast<size_t>(i)];
          acc = op.kind == K::kReduceAdd ? acc + xv : std::max(acc, xv);
        }
        break;
      }
      case K::kReshape: {
        // y's element at offset o (by y's strides) is x's element at offset o (by x's).
        std::map<int64_t, double> memory;
        for (int64_t i = 0; i < x.Count(); ++i)
          memory[Offset(Unravel(i, x.dims), x.strides)] = x.v[static_cast<size_t>(i)];
        for (int64_t i = 0; i < y.Count(); ++i) {
          y.v[static_cast<size_t>(i)] = memory.at(Offset(Unravel(i, y.dims), y.strides));
        }
        break;
      }
      default:
        for (int64_t i = 0; i < y.Count(); ++i) {
          const Dims idx = Unravel(i, y.dims);
          const double a = x.v[static_cast<size_t>(Broadcast(idx, x))];
          const double b = op.b != 0 ? vals_.at(op.b).v[static_cast<size_t>(Broadcast(idx, vals_.at(op.b)))] : 0.0;
          const double t = op.t != 0 ? vals_.at(op.t).v[static_cast<size_t>(Broadcast(idx, vals_.at(op.t)))] : 0.0;
          double r = 0;
          switch (op.kind) {
            case K::kMul:
              r = a * b;
              break;
            case K::kSub:
              r = a - b;
              break;
            case K::kAdd:
              r = a + b;
              break;
            case K::kDiv:
              r = a / b;
              break;
            case K::kExp:
              r = std::exp(a);
              break;
            case K::kLog:
              r = std::log(a);
              break;
            case K::kIdentity:
              r = a;
              break;
            case K::kGenIndex:
              r = static_cast<double>(idx.at(static_cast<size_t>(op.axis)));
              break;
            case K::kCmpGe:
              r = a >= b ? 1.0 : 0.0;
              break;
            case K::kSelect:
              r = t != 0.0 ? a : b;
              break;
            default:
              ADD_FAILURE() << "unhandled op kind " << static_cast<int>(op.kind);
          }
          y.v[static_cast<size_t>(i)] = r;
        }
    }
    vals_[op.y] = std::move(y);
  }

  const SdpaGraph& g_;
  std::map<int64_t, const SdpaGraphTensor*> meta_;
  std::map<int64_t, Values> vals_;
};

// Causal attention of one problem, computed directly in float64 (all tensors [b, h, t, d]
// row-major; lse, delta [b, h, t]).
struct Reference {
  std::vector<double> out, lse, dq, dk, dv, delta;
};
Reference Attention(int64_t b, int64_t h, int64_t t, int64_t d, double scale, const std::vector<double>& q,
                    const std::vector<double>& k, const std::vector<double>& v, const std::vector<double>& dout) {
  Reference r;
  const size_t n = static_cast<size_t>(b * h * t * d);
  r.out.assign(n, 0.0), r.dq.assign(n, 0.0), r.dk.assign(n, 0.0), r.dv.assign(n, 0.0);
  r.lse.assign(static_cast<size_t>(b * h * t), 0.0), r.delta.assign(static_cast<size_t>(b * h * t), 0.0);
  for (int64_t bh = 0; bh < b * h; ++bh) {
    auto at = [&](const std::vector<double>& x, int64_t row, int64_t c) {
      return x[static_cast<size_t>((bh * t + row) * d + c)];
    };
    auto ref = [&](std::vector<double>& x, int64_t row, int64_t c) -> double& {
      return x[static_cast<size_t>((bh * t + row) * d + c)];
    };
    std::vector<double> p(static_cast<size_t>(t * t), 0.0);
    for (int64_t i = 0; i < t; ++i) {
      double m = -std::numeric_limits<double>::infinity();
      std::vector<double> s(static_cast<size_t>(i + 1));
      for (int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += at(q, i, c) * at(k, j, c);
        s[static_cast<size_t>(j)] = dot * scale;
        m = std::max(m, dot * scale);
      }
      double sum = 0;
      for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[static_cast<size_t>(j)] - m);
      r.lse[static_cast<size_t>(bh * t + i)] = m + std::log(sum);
      for (int64_t j = 0; j <= i; ++j)
        p[static_cast<size_t>(i * t + j)] = std::exp(s[static_cast<size_t>(j)] - m) / sum;
      for (int64_t c = 0; c < d; ++c) {
        for (int64_t j = 0; j <= i; ++j) ref(r.out, i, c) += p[static_cast<size_t>(i * t + j)] * at(v, j, c);
      }
    }
    for (int64_t i = 0; i < t; ++i) {
      double delta = 0;
      for (int64_t c = 0; c < d; ++c) delta += at(dout, i, c) * ref(r.out, i, c);
      r.delta[static_cast<size_t>(bh * t + i)] = delta;
      for (int64_t j = 0; j <= i; ++j) {
        const double pij = p[static_cast<size_t>(i * t + j)];
        double dp = 0;
        for (int64_t c = 0; c < d; ++c) dp += at(dout, i, c) * at(v, j, c);
        const double ds = pij * (dp - delta) * scale;
        for (int64_t c = 0; c < d; ++c) {
          ref(r.dv, j, c) += pij * at(dout, i, c);
          ref(r.dq, i, c) += ds * at(k, j, c);
          ref(r.dk, j, c) += ds * at(q, i, c);
        }
      }
    }
  }
  return r;
}

void ExpectClose(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 1e-10 * (1.0 + std::fabs(want[i]))) && bad++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: graph " << got[i] << ", attention " << want[i];
    }
  }
}

// Runs both graphs of `p` on q, k, v, dout (row-major [b, h, t, d] values), each bound from
// `storage` at `base` through `strides` (all zero: the values as they are), and holds the
// outputs to attention. The outputs are also stored through their strides, as cuDNN writes
// them: out into a buffer of b*h*t*d (which the backward then reads as O), dq, dk, dv into one
// of 3*b*h*t*d at elements 0, dk_base and dv_base; both are returned.
struct Operand {
  const std::vector<double>* storage;
  int64_t base;
};
struct Stored {
  std::vector<double> out, grads;
};
Stored CheckGraphs(const internal::SdpaProblem& fwd_p, const std::vector<double>& q, const std::vector<double>& k,
                   const std::vector<double>& v, const std::vector<double>& dout, Operand sq, Operand sk, Operand sv,
                   Operand sdo, const std::string& what, int64_t dk_base = -1, int64_t dv_base = -1) {
  const int64_t n = fwd_p.b * fwd_p.h * fwd_p.t * fwd_p.d;
  Stored stored{std::vector<double>(static_cast<size_t>(n), std::nan("")),
                std::vector<double>(static_cast<size_t>(3 * n), std::nan(""))};
  const double scale = 1.0 / std::sqrt(static_cast<double>(fwd_p.d));
  const Reference want = Attention(fwd_p.b, fwd_p.h, fwd_p.t, fwd_p.d, scale, q, k, v, dout);
  const double inf = std::numeric_limits<double>::infinity();

  const SdpaGraph fwd = DescribeSdpaGraph(fwd_p);
  GraphInterpreter f(fwd);
  f.Bind(internal::kSdpaQ, *sq.storage, sq.base);
  f.Bind(internal::kSdpaK, *sk.storage, sk.base);  // K's storage, which the graph reads as K^T
  f.Bind(internal::kSdpaV, *sv.storage, sv.base);
  f.Bind(internal::kSdpaScale, {scale});
  f.Bind(internal::kSdpaNegInf, {-inf});
  f.Run();
  ExpectClose(f.Get(internal::kSdpaO).v, want.out, "forward out" + what);
  ExpectClose(f.Get(internal::kSdpaStats).v, want.lse, "forward stats" + what);
  f.Store(internal::kSdpaO, stored.out);

  internal::SdpaProblem bwd_p = fwd_p;
  bwd_p.backward = true;
  const SdpaGraph bwd = DescribeSdpaGraph(bwd_p);
  GraphInterpreter g(bwd);
  g.Bind(internal::kSdpaQ, *sq.storage, sq.base);
  g.Bind(internal::kSdpaK, *sk.storage, sk.base);
  g.Bind(internal::kSdpaV, *sv.storage, sv.base);  // V's storage, which the backward reads as V^T
  g.Bind(internal::kSdpaO, stored.out);            // where the forward put it
  g.Bind(internal::kSdpaDO, *sdo.storage, sdo.base);
  g.Bind(internal::kSdpaStats, want.lse);
  g.Bind(internal::kSdpaScale, {scale});
  g.Bind(internal::kSdpaNegInf, {-inf});
  g.Bind(internal::kSdpaOne, {1.0});
  g.Run();
  ExpectClose(g.Get(internal::kSdpaSoftmaxSum).v, want.delta, "backward softmax_sum" + what);
  ExpectClose(g.Get(internal::kSdpaDQ).v, want.dq, "backward dq" + what);
  ExpectClose(g.Get(internal::kSdpaDK).v, want.dk, "backward dk" + what);
  ExpectClose(g.Get(internal::kSdpaDV).v, want.dv, "backward dv" + what);
  g.Store(internal::kSdpaDQ, stored.grads, 0);
  g.Store(internal::kSdpaDK, stored.grads, dk_base >= 0 ? dk_base : n);
  g.Store(internal::kSdpaDV, stored.grads, dv_base >= 0 ? dv_base : 2 * n);
  return stored;
}

std::vector<double> RandomValues(int64_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(-2.0, 2.0);
  std::vector<double> x(static_cast<size_t>(n));
  for (double& e : x) e = dist(gen);
  return x;
}

TEST(CudnnSdpaGraphTest, ForwardAndBackwardGraphsComputeCausalAttention) {
  struct Case {
    int64_t b, h, t, d;
  };
  for (const Case& c : {Case{1, 1, 1, 4}, Case{1, 2, 5, 3}, Case{2, 3, 7, 4}}) {
    const int64_t n = c.b * c.h * c.t * c.d;
    const std::vector<double> q = RandomValues(n, 1), k = RandomValues(n, 2), v = RandomValues(n, 3),
                              dout = RandomValues(n, 4);
    CheckGraphs({false, DType::kBFloat16, c.b, c.h, c.t, c.d}, q, k, v, dout, {&q, 0}, {&k, 0}, {&v, 0}, {&dout, 0},
                absl::StrCat(" [", c.b, ", ", c.h, ", ", c.t, ", ", c.d, "]"));
  }
}

// q, k, v read in place from a fused projection's output [b, t, 3, h, d] (as GPT's attention
// hands them over), dout from [b, t, h, d]: the strides the trainer passes.
TEST(CudnnSdpaGraphTest, HeadsReadInPlaceFromTheFusedProjection) {
  const int64_t b = 2, h = 3, t = 6, d = 4, c = h * d;
  const std::vector<double> qkv = RandomValues(b * t * 3 * c, 5), dy = RandomValues(b * t * c, 6);
  // The same values as contiguous [b, h, t, d] tensors, for the reference.
  std::vector<double> q, k, v, dout;
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t hi = 0; hi < h; ++hi) {
      for (int64_t ti = 0; ti < t; ++ti) {
        for (int64_t di = 0; di < d; ++di) {
          const int64_t row = (bi * t + ti) * 3 * c + hi * d + di;
          q.push_back(qkv[static_cast<size_t>(row)]);
          k.push_back(qkv[static_cast<size_t>(row + c)]);
          v.push_back(qkv[static_cast<size_t>(row + 2 * c)]);
          dout.push_back(dy[static_cast<size_t>((bi * t + ti) * c + hi * d + di)]);
        }
      }
    }
  }
  internal::SdpaProblem p{false, DType::kBFloat16, b, h, t, d};
  p.q_strides = p.k_strides = p.v_strides = {t * 3 * c, d, 3 * c, 1};
  p.do_strides = {t * c, d, c, 1};
  CheckGraphs(p, q, k, v, dout, {&qkv, 0}, {&qkv, c}, {&qkv, 2 * c}, {&dy, 0}, " (fused qkv strides)");

  // The outputs where dtensor puts them (ops.h): out as [b, t, h, d], dq, dk, dv as the heads of
  // one [b, t, 3, h, d] buffer, laid out as q, k, v are.
  p.o_strides = {t * c, d, c, 1};
  p.dq_strides = p.dk_strides = p.dv_strides = p.q_strides;
  const Stored stored =
      CheckGraphs(p, q, k, v, dout, {&qkv, 0}, {&qkv, c}, {&qkv, 2 * c}, {&dy, 0}, " (outputs in place)", c, 2 * c);
  const Reference want = Attention(b, h, t, d, 1.0 / std::sqrt(static_cast<double>(d)), q, k, v, dout);
  std::vector<double> out_btHd, dqkv;  // the expected memory: [b, t, h, d] and [b, t, 3, h, d]
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t ti = 0; ti < t; ++ti) {
      for (const std::vector<double>* x : {&want.out, &want.dq, &want.dk, &want.dv}) {
        for (int64_t hi = 0; hi < h; ++hi) {
          for (int64_t di = 0; di < d; ++di) {
            const double e = (*x)[static_cast<size_t>(((bi * h + hi) * t + ti) * d + di)];
            (x == &want.out ? out_btHd : dqkv).push_back(e);
          }
        }
      }
    }
  }
  ExpectClose(stored.out, out_btHd, "out stored as [b, t, h, d]");
  ExpectClose(stored.grads, dqkv, "dq, dk, dv stored as [b, t, 3, h, d]");
}

#else

TEST(CudnnSdpaPlanTest, GptShapesHaveAnEngineForwardAndBackward) {
  GTEST_SKIP() << "dtensor was built without cuDNN's headers (or without CUDA): attention runs dtensor's own kernels";
}

#endif

}  // namespace
}  // namespace dtensor
