// Causal scaled-dot-product attention on cuDNN's fused flash-attention engines (internal).
//
//   SdpaProblem p{.backward = false, .dtype = DType::kBFloat16, .b = 8, .h = 12, .t = 1024, .d = 64};
//   absl::Status s = CudnnCausalAttention(device, p, q, k, v, scale, out, lse);
//   if (IsCudnnDecline(s)) { ...run dtensor's own kernels... }
//
// Legend: q, k, v, out, dout, dq, dk, dv [b, h, t, d], bfloat16 or float16, of any strides with
// stride 1 along d (SdpaProblem); lse
// float32 [b, h, t], the natural-log sum of exp(scale q.k) over the keys a query sees, which is
// cuDNN's "Stats" and what dtensor's own kernels write and read: a forward on one and a backward
// on the other agree.
//
// cuDNN's backend API takes attention as an operation graph that its runtime-fusion engines
// match as a whole. The graphs here are the ones cuDNN's frontend (cudnn-frontend's SDPA nodes,
// non-paged, no dropout, top-left causal mask) builds for this case, written against the backend
// API directly because the frontend's headers are not on these machines:
//   forward:  S = (Q K^T) * scale; S = row >= col ? S : -inf; M = max(S); E = exp(S - M);
//             L = sum(E); Stats = M + log(L); O = (E / L) V                (P cast to the io type)
//   backward: D = sum(dO * O) * 1; E = exp(causal((Q K^T) * scale - Stats)); dV = E^T dO;
//             dS = (dO V^T - D) * E * scale; dK = dS^T Q; dQacc = dS K (float32); dQ = dQacc
// D ("softmax_sum") and dQacc live in the workspace after the engine's own.
//
// Plans are built once per (direction, dtype, b, h, t, d, strides) and per (thread, device), on a cuDNN
// handle bound to the thread's stream (cudaStreamPerThread), as gemm.cc does for cuBLASLt; the
// scale is passed by value on each call. A problem cuDNN declines is remembered and answered
// with the same decline.
#ifndef DTENSOR_KERNELS_CUDA_CUDNN_SDPA_H_
#define DTENSOR_KERNELS_CUDA_CUDNN_SDPA_H_

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dtensor/tensor/dtype.h"

namespace dtensor::internal {

struct SdpaProblem {
  bool backward = false;
  DType dtype = DType::kBFloat16;
  int64_t b = 0, h = 0, t = 0, d = 0;
  // The strides (in elements) of the [b, h, t, d] operands: all zero means contiguous. Row
  // views (stride 1 along d) are read and written in place: e.g. heads split out of a fused qkv
  // projection [b, t, 3, h, d] have strides {t*3*h*d, d, 3*h*d, 1}, an output laid out as
  // [b, t, h, d] {t*h*d, d, h*d, 1}. lse is contiguous. The forward reads o_strides too (out).
  std::array<int64_t, 4> q_strides{}, k_strides{}, v_strides{}, o_strides{};
  std::array<int64_t, 4> do_strides{}, dq_strides{}, dk_strides{}, dv_strides{};  // backward
};

// Whether a status from the functions below means "cuDNN is missing or does not take this
// problem" (FailedPrecondition, Unimplemented): the caller then runs its own kernels. Any other
// error is a failure of a problem cuDNN took.
bool IsCudnnDecline(const absl::Status& s);

// Forward, on the current thread's stream of cuda:`device` (which must be current).
absl::Status CudnnCausalAttention(int device, const SdpaProblem& p, const void* q, const void* k, const void* v,
                                  float scale, void* out, float* lse);

// Backward: dq, dk, dv from dout and the forward's q, k, v, out and lse.
absl::Status CudnnCausalAttentionBackward(int device, const SdpaProblem& p, const void* dout, const void* q,
                                          const void* k, const void* v, const void* out, const float* lse, float scale,
                                          void* dq, void* dk, void* dv);

// The tensors a graph's caller binds, by unique id (virtual tensors get ids from 100 up).
enum SdpaTensorId : int64_t {
  kSdpaQ = 1,
  kSdpaK = 2,  // K's storage seen as K^T [b, h, d, t]
  kSdpaV = 3,  // forward: V [b, h, t, d]; backward: V's storage seen as V^T [b, h, d, t]
  kSdpaO = 4,
  kSdpaStats = 5,
  kSdpaDO = 6,
  kSdpaDQ = 7,
  kSdpaDK = 8,
  kSdpaDV = 9,
  kSdpaScale = 10,       // by value (float)
  kSdpaNegInf = 11,      // by value (float): the masked scores
  kSdpaOne = 12,         // by value (float): the backward's dropout-scale slot, 1 without dropout
  kSdpaSoftmaxSum = 13,  // backward, in the workspace: sum(dO * O) per row, float32 [b, h, t, 1]
  kSdpaDQAccum = 14,     // backward, in the workspace: dQ in float32 [b, h, t, d]
  kSdpaFirstVirtual = 100,
};

// A problem's graph as data: what the builder hands cuDNN, for tests to interpret on the CPU
// (tests/kernels/cudnn_sdpa_test.cc evaluates it against attention computed directly).
struct SdpaGraphTensor {
  enum class Type { kFloat32, kIo, kInt32, kBool };
  int64_t uid = 0;
  Type type = Type::kFloat32;
  std::array<int64_t, 4> dims{}, strides{};
  bool is_virtual = false, by_value = false;
};
struct SdpaGraphOp {
  enum class Kind {
    kMatmul,     // y = x @ b over the last two dims
    kMul,        // y = x * b (b broadcast over its dims of extent 1; likewise below)
    kSub,        // y = x - b
    kAdd,        // y = x + b
    kDiv,        // y = x / b
    kExp,        // y = exp(x)
    kLog,        // y = log(x)
    kIdentity,   // y = x
    kGenIndex,   // y = the index of each element along `axis` (x gives the shape)
    kCmpGe,      // y = x >= b
    kSelect,     // y = t ? x : b
    kReduceAdd,  // y = sum of x over the dims where y has extent 1
    kReduceMax,  // y = max of x over those dims
    kReshape,    // y = x's elements seen through y's dims and strides
  };
  Kind kind = Kind::kIdentity;
  int64_t x = 0, b = 0, t = 0, y = 0;  // tensor uids (0: none)
  int64_t axis = -1;
};
struct SdpaGraph {
  std::vector<SdpaGraphTensor> tensors;
  std::vector<SdpaGraphOp> ops;
};
SdpaGraph DescribeSdpaGraph(const SdpaProblem& p);

// Device-less check, for tests: builds p's graph and asks cuDNN's heuristics for engine
// configurations on the GPU that `device_json` describes (cuDNN's device-property JSON, the
// form CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION reads), then finalizes execution plans from
// them in turn until one succeeds. Needs no GPU; cuDNN compiles runtime-fused kernels with NVRTC
// and loads them through the driver, so without a driver `plan` reports that load failing.
struct SdpaPlanCheck {
  int64_t configs = 0;  // engine configurations the heuristics returned
  int64_t tried = 0;    // plans finalized before `plan` (the first success, or the last failure)
  absl::Status plan;    // that finalize's status
};
absl::StatusOr<SdpaPlanCheck> CheckCudnnSdpaPlan(const SdpaProblem& p, std::string_view device_json);

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CUDA_CUDNN_SDPA_H_
