// The boundary between the CUDA backend's host glue (cuda_backend.cc, gemm.cc: Tensors, absl)
// and its device code (*.cu): plain pointers, sizes and by-value layouts, one launcher per
// kernel family. Internal (not installed).
//
//   gpu::Layout a_layout = ...;                       // from cuda_common.h's Coalesce()
//   cudaError_t err = gpu::LaunchBinary(gpu::BinOp::kAdd, DType::kBFloat16, out, a, a_layout,
//                                       b, b_layout, numel);
//
// Why a separate header: the .cu files include only this, dtype.h and the CUDA headers.
// Parsing absl/<string>/<ostream> costs nvcc ~20 s of CPU per .cu file (front end + two
// device passes), more than the kernels themselves.
//
// Every launcher enqueues on cudaStreamPerThread of the *current* device (the caller sets it),
// never synchronises, and returns cudaGetLastError() after its launches (cudaSuccess for an
// empty problem). Unsupported dtypes give cudaErrorInvalidValue; the host glue checks dtypes
// first so that users get a named message instead.
#ifndef DTENSOR_KERNELS_CUDA_LAUNCH_H_
#define DTENSOR_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "dtensor/tensor/dtype.h"

namespace dtensor::internal::gpu {

// Same value as dtensor::kMaxDims (tensor.h; checked in cuda_backend.cc).
inline constexpr int kMaxDims = 8;

// Sizes and strides (in elements) of one operand, passed to kernels by value. Element i of a
// problem (row-major over `sizes`) lives at Offset(layout, i) (device_common.cuh).
struct Layout {
  int ndim = 1;
  int64_t sizes[kMaxDims] = {1};
  int64_t strides[kMaxDims] = {1};
};

// Mirrors of kernels.h's op enums, same order and values (static_asserts in cuda_backend.cc).
enum class BinOp : uint8_t { kAdd, kSub, kMul, kDiv, kMax, kMin };
enum class UnOp : uint8_t { kNeg, kExp, kLog, kSqrt, kRsqrt, kRelu, kGelu, kTanh, kAbs, kSquare };
enum class RedOp : uint8_t { kSum, kMean, kMax, kMin };

// ---- copy_fill.cu ----
// dst[dl(i)] = cast(src[sl(i)]) for i < n; any dtypes (same dtype copies bits).
cudaError_t LaunchCopy(DType dst_dtype, void* dst, const Layout& dl, DType src_dtype, const void* src, const Layout& sl,
                       int64_t n);
// dst[dl(i)] = the element whose bytes are the low `elem_bytes` bytes of `bits`.
cudaError_t LaunchFill(void* dst, const Layout& dl, int64_t n, size_t elem_bytes, uint64_t bits);
// Contiguous dst[i] = value of global element base + gl(i) (gl: dst's shape with the global
// tensor's strides); uniform in [a, b) or normal(a, b), converted as the CPU backend does.
cudaError_t LaunchFillRandom(DType dtype, void* dst, const Layout& gl, int64_t base, int64_t n, bool normal,
                             uint64_t seed, double a, double b);

// ---- elementwise.cu ----
// Contiguous out[i] = a[al(i)] (op) b[bl(i)]; float32/bfloat16/float16/int32/int64.
cudaError_t LaunchBinary(BinOp op, DType dtype, void* out, const void* a, const Layout& al, const void* b,
                         const Layout& bl, int64_t n);
// Contiguous out[i] = a[al(i)] (op) scalar, or scalar (op) a[al(i)] when scalar_first.
cudaError_t LaunchBinaryScalar(BinOp op, DType dtype, void* out, const void* a, const Layout& al, int64_t n,
                               double scalar, bool scalar_first);
// Contiguous out[i] = f(a[al(i)]). Integer dtypes: kNeg, kAbs, kSquare, kRelu only.
cudaError_t LaunchUnary(UnOp op, DType dtype, void* out, const void* a, const Layout& al, int64_t n);
// dx[i] = dy[i] * f'(x[i]), all contiguous, float dtypes.
cudaError_t LaunchUnaryBackward(UnOp op, DType dtype, void* dx, const void* dy, const void* x, int64_t n);
// Fused AdamW on n contiguous elements (see Kernels::AdamW); decay = 1 - lr * wd,
// inv_bc1 = 1 / (1 - beta1^step), inv_sqrt_bc2 = 1 / sqrt(1 - beta2^step); grad_scale: null,
// or one float32 on the device by which every gradient element is multiplied as it is read
// (AdamWTensors::grad_scale).
struct AdamWArgs {
  float lr, beta1, beta2, eps, decay, inv_bc1, inv_sqrt_bc2;
  const float* grad_scale = nullptr;
};
cudaError_t LaunchAdamW(DType param_dtype, void* param, DType grad_dtype, const void* grad, float* m, float* v,
                        int64_t n, const AdamWArgs& args);
// AdamW over up to kAdamWMultiMax parameters of one (param, grad) dtype pair in one launch,
// passed by value (about 3.6 KB, under the 4 KB kernel-parameter limit of older drivers):
// tensor i has n[i] elements and its own bias corrections; lr, betas, eps, decay and grad_scale
// are shared (those of `args`; its inv_bc1 and inv_sqrt_bc2 are unused).
inline constexpr int kAdamWMultiMax = 64;
struct AdamWMultiList {
  int count = 0;
  void* param[kAdamWMultiMax];
  const void* grad[kAdamWMultiMax];
  float* m[kAdamWMultiMax];
  float* v[kAdamWMultiMax];
  int64_t n[kAdamWMultiMax];
  float inv_bc1[kAdamWMultiMax];
  float inv_sqrt_bc2[kAdamWMultiMax];
};
cudaError_t LaunchAdamWMulti(DType param_dtype, DType grad_dtype, const AdamWMultiList& list, const AdamWArgs& args);

// ---- reduce.cu ----
// Contiguous x [outer, reduce, inner] -> out [outer, inner]. `scratch` holds
// ReduceScratchBytes(outer, reduce, inner) bytes of device memory (null when that is 0): a few
// very long rows are reduced in two passes through it.
int64_t ReduceScratchBytes(int64_t outer, int64_t reduce, int64_t inner);
cudaError_t LaunchReduce(RedOp op, DType dtype, const void* x, void* out, int64_t outer, int64_t reduce, int64_t inner,
                         void* scratch);
// out[0] = sum of x[i]^2 over contiguous x of n elements (float dtypes), as a float: each of
// SumOfSquaresPartials(n) blocks adds its grid-strided share in double into `partial` (that
// many doubles of device memory), then one block adds those in order: no atomics, so the same
// bits on every call. n = 0 writes 0.
int64_t SumOfSquaresPartials(int64_t n);
cudaError_t LaunchSumOfSquares(DType dtype, const void* x, int64_t n, double* partial, float* out);
// Softmax / log-softmax over the last dim of contiguous [rows, n], and its backward.
cudaError_t LaunchSoftmax(DType dtype, const void* x, void* y, int64_t rows, int64_t n, bool log);
cudaError_t LaunchSoftmaxBackward(DType dtype, const void* dy, const void* y, void* dx, int64_t rows, int64_t n,
                                  bool log);

// ---- norm.cu ----
// LayerNorm (rms = false) or RmsNorm (rms = true) over the last dim of contiguous [rows, c].
// weight/bias may be null (1 / 0); mean is unused (may be null) for rms.
cudaError_t LaunchNorm(bool rms, DType dtype, const void* x, const void* weight, const void* bias, float eps, void* y,
                       float* mean, float* rstd, int64_t rows, int64_t c);
// x1 = x + h (rounded to dtype) and LayerNorm of x1 into y, mean, rstd, in one kernel; all
// contiguous [rows, c]; weight/bias may be null.
cudaError_t LaunchAddNorm(DType dtype, const void* x, const void* h, const void* weight, const void* bias, float eps,
                          void* x1, void* y, float* mean, float* rstd, int64_t rows, int64_t c);
// Its backward. dweight/dbias may be null (not wanted); `partial` is float32 scratch of
// NormPartialFloats(rows, c) elements for the column sums. LayerNorm only: a non-null
// `dresidual` [rows, c] is added to dx after dx's rounding (AddLayerNorm's backward).
int64_t NormPartialFloats(int64_t rows, int64_t c);
cudaError_t LaunchNormBackward(bool rms, DType dtype, const void* dy, const void* x, const void* weight,
                               const float* mean, const float* rstd, const void* dresidual, void* dx, void* dweight,
                               void* dbias, float* partial, int64_t rows, int64_t c);

// ---- embedding.cu ----
// out[r, :] = weight[ids[r], :] for r < n, zeros for ids outside [0, v). weight [v, c] of any
// dtype (copied as bytes), ids int32/int64.
cudaError_t LaunchEmbedding(DType weight_dtype, const void* weight, DType ids_dtype, const void* ids, void* out,
                            int64_t n, int64_t v, int64_t c);
// dweight[ids[r], :] += dout[r, :], ids outside [0, v) skipped. float32 dweight: float atomics
// in place. bfloat16/float16 dweight: `scratch` (float32 [v, c]) gets dweight, the atomics,
// then is rounded back once (scratch unused, may be null, for float32).
cudaError_t LaunchEmbeddingBackward(DType dout_dtype, const void* dout, DType ids_dtype, const void* ids,
                                    DType weight_dtype, void* dweight, float* scratch, int64_t n, int64_t v, int64_t c);

// ---- cross_entropy.cu ----
// Per row of contiguous logits [n, v]: lse, loss = lse - logit[target] and valid (1/0);
// targets equal to ignore_index or outside [0, v) are ignored (loss 0, valid 0).
cudaError_t LaunchCrossEntropy(DType dtype, const void* logits, DType target_dtype, const void* targets,
                               int64_t ignore_index, float* losses, float* valid, float* lse, int64_t n, int64_t v);
// dlogits[r, :] = grad[r * grad_stride] * (softmax - onehot), zero rows for ignored targets
// (the row's max and sum recomputed: a saved float32 logsumexp is rounded at the max's magnitude).
cudaError_t LaunchCrossEntropyBackward(DType dtype, const void* logits, DType target_dtype, const void* targets,
                                       const float* grad, int64_t grad_stride, int64_t ignore_index, void* dlogits,
                                       int64_t n, int64_t v);

// CrossEntropy's losses (unless losses is null) and CrossEntropyBackward's dlogits from one visit
// of each row.
cudaError_t LaunchCrossEntropyWithGrad(DType dtype, const void* logits, DType target_dtype, const void* targets,
                                       int64_t ignore_index, const float* grad, int64_t grad_stride, float* losses,
                                       void* dlogits, int64_t n, int64_t v);
// *count = the number of targets in [0, v) that are not ignore_index (one block).
cudaError_t LaunchCountTargets(DType target_dtype, const void* targets, int64_t ignore_index, int64_t v, float* count,
                               int64_t n);
// x[0, n) *= *num / *den, untouched when they are equal (read on the device).
cudaError_t LaunchScaleByRatio(DType dtype, void* x, const float* num, const float* den, int64_t n);

// ---- attention.cu ----
// Largest head dim the attention kernels support.
inline constexpr int64_t kMaxAttentionHeadDim = 128;
// Causal attention on contiguous [bh, t, d] q, k, v, out; lse float32 [bh, t].
cudaError_t LaunchAttention(DType dtype, const void* q, const void* k, const void* v, float scale, void* out,
                            float* lse, int64_t bh, int64_t t, int64_t d);
// Its backward; `delta` is float32 scratch [bh, t] (rowwise dout . out).
// Both run the tensor-core kernels of flash_attention.cu where FlashAttentionSupported, else
// the simple float32 kernels; DTENSOR_CUDA_ATTENTION=simple in the environment (read on each
// call) forces the simple ones.
cudaError_t LaunchAttentionBackward(DType dtype, const void* dout, const void* q, const void* k, const void* v,
                                    const void* out, const float* lse, float scale, void* dq, void* dk, void* dv,
                                    float* delta, int64_t bh, int64_t t, int64_t d);

// ---- flash_attention.cu ----
// Whether the tensor-core kernels take this problem: bfloat16 / float16, D = 64 (D = 128 for
// the forward only), every pointer 16-byte aligned, a device of compute capability >= 8.
bool FlashAttentionSupported(DType dtype, int64_t bh, int64_t t, int64_t d, bool backward,
                             std::initializer_list<const void*> pointers);
// As LaunchAttention / LaunchAttentionBackward (same arguments; `delta` already computed).
cudaError_t LaunchFlashAttention(DType dtype, const void* q, const void* k, const void* v, float scale, void* out,
                                 float* lse, int64_t bh, int64_t t, int64_t d);
cudaError_t LaunchFlashAttentionBackward(DType dtype, const void* dout, const void* q, const void* k, const void* v,
                                         const float* lse, const float* delta, float scale, void* dq, void* dk,
                                         void* dv, int64_t bh, int64_t t, int64_t d);

}  // namespace dtensor::internal::gpu

#endif  // DTENSOR_KERNELS_CUDA_LAUNCH_H_
