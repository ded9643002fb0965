// Causal scaled-dot-product attention on cuDNN's fused flash-attention engines (internal).
//
//   SdpaProblem p{.backward = false, .dtype = DType::kBFloat16, .b = 8, .h = 12, .t = 1024, .d = 64};
//   absl::Status s = CudnnCausalAttention(device, p, q, k, v, scale, out, lse);
//   if (IsCudnnDecline(s)) { ...run dtensor's own kernels... }
//
// Legend: q, k, v, out, dout, dq, dk, dv [b, h, t, d] contiguous, bfloat16 or float16; lse
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
// Plans are built once per (direction, dtype, b, h, t, d) and per (thread, device), on a cuDNN
// handle bound to the thread's stream (cudaStreamPerThread), as gemm.cc does for cuBLASLt; the
// scale is passed by value on each call. A problem cuDNN declines is remembered and answered
// with the same decline.
#ifndef DTENSOR_KERNELS_CUDA_CUDNN_SDPA_H_
#define DTENSOR_KERNELS_CUDA_CUDNN_SDPA_H_

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dtensor/tensor/dtype.h"

namespace dtensor::internal {

struct SdpaProblem {
  bool backward = false;
  DType dtype = DType::kBFloat16;
  int64_t b = 0, h = 0, t = 0, d = 0;
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
