// Kernels: the one interface every compute backend (CPU, CUDA) implements.
//
// Callers go through dtensor/ops/ops.h, which validates shapes, dtypes and devices, allocates
// outputs and then calls a backend:
//
//   DT_ASSIGN_OR_RETURN(Kernels* k, KernelsFor(x.device()));
//   DT_RETURN_IF_ERROR(k->Unary(UnaryOp::kGelu, x, out));
//
// Contract for every method (the ops layer guarantees it; kernels do not re-validate):
// - all tensors are defined and on this backend's device;
// - "contiguous" arguments are row-major with no gaps; other arguments may have any strides
//   (including 0 for broadcast) and at most kMaxDims dims;
// - outputs never alias inputs, except that the elementwise methods (Binary, BinaryScalar,
//   Unary) accept `out` being exactly the contiguous input `a` (same storage and offset), which
//   the ops layer uses for in-place updates;
// - float32/bfloat16/float16 compute in float32 and round once on store;
// - an empty tensor (numel 0) is a no-op.
// Kernels return a non-OK status only for conditions the ops layer cannot check cheaply
// (an unsupported dtype combination, a CUDA launch failure, an index out of range on CPU).
// CUDA kernels run asynchronously on the calling thread's stream (cudaStreamPerThread).
#ifndef DTENSOR_KERNELS_KERNELS_H_
#define DTENSOR_KERNELS_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

enum class BinaryOp : uint8_t { kAdd, kSub, kMul, kDiv, kMax, kMin };
enum class UnaryOp : uint8_t { kNeg, kExp, kLog, kSqrt, kRsqrt, kRelu, kGelu, kTanh, kAbs, kSquare };
enum class ReduceOp : uint8_t { kSum, kMean, kMax, kMin };

// A random distribution for FillRandom. Values depend only on (seed, global element index).
struct RandomSpec {
  enum class Kind : uint8_t { kUniform, kNormal } kind = Kind::kNormal;
  uint64_t seed = 0;
  double a = 0.0;  // uniform: low;  normal: mean
  double b = 1.0;  // uniform: high; normal: std
};

struct AdamWParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  int64_t step = 1;  // 1-based step count, for bias correction
};

// One parameter of a multi-tensor AdamW step (Kernels::AdamWMulti): the tensors AdamW takes,
// and this parameter's own 1-based update count for its bias correction.
struct AdamWTensors {
  Tensor param, grad, m, v;
  int64_t step = 1;
  // Optional: a float32 [1] on grad's device that receives SumOfSquares(grad), the value
  // Kernels::SumOfSquares gives, read in the update's own pass where the backend can (the CPU):
  // the gradient norm without a pass of its own (nn::AdamW::StepWithGradNorm).
  Tensor grad_square_sum = Tensor();
  // Optional: a float32 [1] on grad's device, by which the update multiplies the gradient as it
  // reads it (gradient clipping's factor, computed where the norm is: nn::AdamW::StepWithClip);
  // grad itself is not written. grad_square_sum, where asked too, sums the squares of grad as
  // stored.
  Tensor grad_scale = Tensor();
};

class Kernels {
 public:
  virtual ~Kernels() = default;
  virtual Device device() const = 0;

  // ---- Copies and fills ----
  // dst[i] = cast(src[i]). Same shape; any strides for both (src may broadcast); any dtypes.
  // dst must not overlap src.
  virtual absl::Status Copy(const Tensor& src, const Tensor& dst) = 0;
  // dst[i] = value (cast to dst's dtype). Any strides.
  virtual absl::Status Fill(const Tensor& dst, double value) = 0;
  // Fills contiguous `dst`, which is the block at `global_offset` (one entry per dim) of a
  // tensor of `global_shape`, with the values that tensor would get from `spec`: element at
  // global linear index g uses Philox4x32-10 counter g and key spec.seed.
  virtual absl::Status FillRandom(const Tensor& dst, const RandomSpec& spec, IntSpan global_shape,
                                  IntSpan global_offset) = 0;

  // ---- Elementwise ----
  // out = a (op) b. a and b already have out's shape (broadcast dims have stride 0); same
  // dtype as out; out contiguous. Integer dtypes support every op (kDiv truncates; division by
  // zero gives 0).
  virtual absl::Status Binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  // out = a (op) scalar, or scalar (op) a when scalar_first. a any strides, out contiguous.
  virtual absl::Status BinaryScalar(BinaryOp op, const Tensor& a, double scalar, bool scalar_first,
                                    const Tensor& out) = 0;
  // out = f(a). a any strides, out contiguous, same dtype. kGelu is the tanh approximation.
  // Integer dtypes support kNeg, kAbs, kSquare, kRelu only.
  virtual absl::Status Unary(UnaryOp op, const Tensor& a, const Tensor& out) = 0;
  // dx = dy * f'(x) for f in {kGelu (tanh approx), kRelu, kTanh, kExp, kLog, kSqrt}; all
  // contiguous, same shape and dtype.
  virtual absl::Status UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x, const Tensor& dx) = 0;

  // ---- Reductions ----
  // x contiguous, viewed as [outer, reduce, inner]; out contiguous [outer, inner], same dtype.
  // kMean divides by `reduce`. An empty reduction gives 0 for sum, NaN for mean, -inf/+inf
  // for max/min (float) — the ops layer rejects max/min over an empty dim.
  virtual absl::Status Reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduce, int64_t inner,
                              const Tensor& out) = 0;
  // out (float32, one element) = the sum of the squares of x's elements (x contiguous, a float
  // dtype; 0 when empty): a gradient norm's piece. This default squares into a float32
  // temporary of x's size (Copy, Binary) and sums it (Reduce); the CPU and CUDA read x once
  // and accumulate the squares in float64 (CUDA: in a fixed order, the same bits every call).
  virtual absl::Status SumOfSquares(const Tensor& x, const Tensor& out);

  // ---- Softmax over the last dim ----
  // x, y contiguous [rows, n]. log: log_softmax.
  virtual absl::Status Softmax(const Tensor& x, const Tensor& y, bool log) = 0;
  // dx from dy and the forward output y (softmax: dx = y*(dy - sum(dy*y));
  // log_softmax: dx = dy - exp(y)*sum(dy)). All contiguous [rows, n].
  virtual absl::Status SoftmaxBackward(const Tensor& dy, const Tensor& y, const Tensor& dx, bool log) = 0;

  // ---- Normalisation over the last dim ----
  // x, y contiguous [rows, C]; weight [C] (and bias [C], which may be undefined) of x's dtype;
  // mean and rstd float32 [rows] (saved for backward). Biased variance, as PyTorch.
  virtual absl::Status LayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y,
                                 const Tensor& mean, const Tensor& rstd) = 0;
  // The residual add and the LayerNorm after it (llm.c's fused_residual_forward): x1 = x + h,
  // rounded once to x's dtype, and LayerNorm's y, mean and rstd of that rounded x1, so every
  // output equals Binary(kAdd) then LayerNorm. x, h, x1, y contiguous [rows, C] of one dtype;
  // weight, bias, mean, rstd as LayerNorm. x1 and y overlap nothing else. This default is
  // Binary then LayerNorm on this backend; CPU does both in one loop over the rows, CUDA in one
  // kernel (one block per row, reading x and h once).
  virtual absl::Status AddLayerNorm(const Tensor& x, const Tensor& h, const Tensor& weight, const Tensor& bias,
                                    float eps, const Tensor& x1, const Tensor& y, const Tensor& mean,
                                    const Tensor& rstd);
  // dx [rows, C]; dweight, dbias [C] in weight's dtype (dbias may be undefined). dweight and
  // dbias are overwritten (not accumulated).
  virtual absl::Status LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                         const Tensor& rstd, const Tensor& dx, const Tensor& dweight,
                                         const Tensor& dbias) = 0;
  // LayerNormBackward with the gradient that reaches x by another path added (AddLayerNorm's
  // backward: the residual's own gradient): dx = LayerNormBackward's dx, rounded to x's dtype,
  // plus dresidual (contiguous [rows, C], x's dtype), rounded again, so the values are those of
  // LayerNormBackward then Binary(kAdd), which this default runs. CPU and CUDA add dresidual
  // in the pass that writes dx.
  virtual absl::Status LayerNormBackwardAdd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                            const Tensor& rstd, const Tensor& dresidual, const Tensor& dx,
                                            const Tensor& dweight, const Tensor& dbias);
  // y = x * rstd * weight with rstd = 1/sqrt(mean(x^2) + eps), rstd float32 [rows].
  virtual absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y,
                               const Tensor& rstd) = 0;
  virtual absl::Status RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                       const Tensor& dx, const Tensor& dweight) = 0;

  // ---- Matrix multiply ----
  // c[i] = alpha * a[i] @ b[i] + beta * c[i] for i in [0, batch). a is [batch, M, K], b is
  // [batch, K, N], c is [batch, M, N] contiguous; all of one float dtype. In a and b either
  // the last dim has stride 1 (row-major) or the middle dim has stride 1 (a transposed view);
  // the batch stride may be anything, 0 included. beta = 0 ignores c's old contents (NaN too).
  virtual absl::Status Gemm(const Tensor& a, const Tensor& b, const Tensor& c, float alpha, float beta) = 0;
  // nn.Linear's forward with its epilogue: c = a @ b + bias (bias [N] added to every row); with
  // `gelu`, c = gelu(a @ b + bias) (tanh approximation) and `pre` receives a @ b + bias, for the
  // backward (`pre` is ignored, and may be undefined, without gelu). a [M, K] and b [K, N] with
  // Gemm's operand layouts (row-major or a transposed view); bias, c and pre contiguous; all of
  // one float dtype; c and pre do not overlap the inputs. This default is Copy (the bias), Gemm
  // accumulating onto it (the sum rounded once, as torch's addmm), then Unary on this backend; CUDA
  // applies the epilogue inside cuBLASLt's matmul (bias added in float32 before the result's one
  // rounding) where cuBLASLt takes the problem, and falls back to this default where not.
  virtual absl::Status GemmBias(const Tensor& a, const Tensor& b, const Tensor& bias, bool gelu, const Tensor& c,
                                const Tensor& pre);
  // nn.Linear's weight and bias gradients from one product: c = a @ b (Gemm's operand layouts,
  // c [M, N] contiguous) and bias_grad[i] = sum over k of a[i, k] (bias_grad [M] contiguous).
  // With a = dy^T (dy [rows, out] row-major, so a [out, rows] is a transposed view) and b = x
  // [rows, in]: c = dW and bias_grad = db. All of one float dtype; K >= 1; outputs do not
  // overlap the inputs. This default is Gemm, then Reduce (sum) over the rows of a^T made
  // contiguous (a copy where a^T is not), as Matmul and Sum would; CUDA sums a inside the
  // matrix multiply (cuBLASLt's BGRADB epilogue) where cuBLASLt takes the problem.
  virtual absl::Status GemmBiasGrad(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias_grad);
  // The input gradient of a Linear through the GELU that follows the previous one, with that
  // GELU's bias gradient: c = (a @ b) * gelu'(pre) (the tanh approximation's derivative) and
  // bias_grad[j] = sum over rows i of c[i, j]. a [M, K], b [K, N] with Gemm's operand layouts;
  // pre and c contiguous [M, N]; bias_grad contiguous [N]; one float dtype; K >= 1. In an MLP:
  // a = dy of the second Linear, b its weight, pre the first Linear's pre-activation (GemmBias
  // with gelu): c = the gradient of that pre-activation, bias_grad the first bias's gradient.
  // This default is Gemm into a scratch (rounded to the dtype), UnaryBackward(kGelu), then
  // Reduce, as the unfused ops would; CUDA does it in the matrix multiply's epilogue
  // (cuBLASLt's DGELU_BGRAD: gelu' applied in float32 before the result's one rounding) where
  // cuBLASLt takes the problem.
  virtual absl::Status GemmDgelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& c,
                                 const Tensor& bias_grad);

  // ---- Embedding ----
  // out[n, :] = weight[ids[n], :]. weight contiguous [V, C]; ids contiguous [N] int32/int64;
  // out contiguous [N, C]. An id outside [0, V): CPU returns InvalidArgument naming it; CUDA
  // writes zeros for that row (no device assert).
  virtual absl::Status Embedding(const Tensor& weight, const Tensor& ids, const Tensor& out) = 0;
  // dweight[ids[n], :] += dout[n, :] (scatter-add; dweight is accumulated, not overwritten).
  // Out-of-range ids are skipped.
  virtual absl::Status EmbeddingBackward(const Tensor& dout, const Tensor& ids, const Tensor& dweight) = 0;

  // ---- Cross-entropy over the last dim ----
  // logits contiguous [N, V] (float); targets contiguous [N] int32/int64. Writes float32 [N]
  // per-row losses (logsumexp - logit[target]; 0 where target == ignore_index), float32 [N]
  // `valid` (1 or 0) and float32 [N] logsumexp. A target outside [0, V) that is not
  // ignore_index: CPU returns InvalidArgument; CUDA treats the row as ignored.
  virtual absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                    const Tensor& losses, const Tensor& valid, const Tensor& lse) = 0;
  // dlogits[n, :] = grad[n] * (softmax(logits[n]) - onehot(targets[n])), zero rows for
  // ignored targets. grad is float32 [N] with any stride (0 to broadcast one value). lse is
  // CrossEntropy's; the CPU and CUDA kernels recompute each row's max and sum instead (a float32
  // logsumexp is rounded at the magnitude of the row max: ~1e-3 at 2e4, in every probability).
  virtual absl::Status CrossEntropyBackward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                            const Tensor& grad, int64_t ignore_index, const Tensor& dlogits) = 0;
  // count (float32 0-d) = the number of targets [N] that are not ignore_index. A target
  // outside [0, v) that is not ignore_index: CPU returns InvalidArgument; CUDA does not count
  // it (CrossEntropy treats it as ignored).
  virtual absl::Status CountTargets(const Tensor& targets, int64_t ignore_index, int64_t v, const Tensor& count) = 0;
  // CrossEntropy's losses and CrossEntropyBackward's dlogits for `grad` in one pass over the
  // logits (llm.c's fused classifier: each row is read for its logsumexp and then, still in
  // cache, for its gradient). dlogits must not overlap logits. The default runs the two above
  // (valid and lse in scratch tensors).
  virtual absl::Status CrossEntropyWithGrad(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                            const Tensor& grad, const Tensor& losses, const Tensor& dlogits);
  // x *= num / den in place (x contiguous float; num, den float32 0-d on x's device). When
  // num == den, x is not touched: the check runs where the values are (on a GPU every block
  // returns after reading them), so the host never waits for them.
  virtual absl::Status ScaleByRatio(const Tensor& x, const Tensor& num, const Tensor& den) = 0;

  // ---- Causal scaled-dot-product attention ----
  // q, k, v, out [B, H, T, D]; lse float32 [B, H, T] contiguous (logsumexp of each score row,
  // saved for backward). out[t] = softmax(scale * q[t].k[s] for s <= t) @ v. The tensors are
  // contiguous, or, for a backend whose AttentionTakesRowViews() is true, row views: stride 1
  // along D and any strides elsewhere (heads split out of a fused qkv projection read uncopied;
  // out laid out as [B, T, H, D], so that the transpose back to [B, T, C] is a view). Outputs
  // do not overlap inputs.
  virtual absl::Status CausalAttention(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                                       const Tensor& out, const Tensor& lse) = 0;
  // dq, dk, dv [B, H, T, D] overwritten; as above, contiguous or row views (dq, dk, dv in one
  // [B, T, 3, H, D] buffer where q, k, v are the heads of one).
  virtual absl::Status CausalAttentionBackward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& out, const Tensor& lse, float scale, const Tensor& dq,
                                               const Tensor& dk, const Tensor& dv) = 0;
  // See CausalAttention. Default: no (ops.cc hands such a backend contiguous tensors).
  virtual bool AttentionTakesRowViews() const { return false; }

  // ---- Optimizer ----
  // Fused AdamW (decoupled weight decay, bias correction), in place on param, m and v.
  // All contiguous with equal numel; m and v float32; param float32/bfloat16/float16; grad
  // float32 or param's dtype.
  virtual absl::Status AdamW(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                             const AdamWParams& p) = 0;
  // AdamW on every entry of `list` (each with its own step; p.step is not used), with AdamW's
  // contract per entry and the same results, the gradient read times grad_scale where defined,
  // and SumOfSquares(grad) into the entries' grad_square_sum where defined. This default calls
  // SumOfSquares, then AdamW (on a scaled float32 copy of grad where there is a grad_scale), once
  // per entry; the CPU reads each gradient once, CUDA updates many parameters per launch.
  virtual absl::Status AdamWMulti(absl::Span<const AdamWTensors> list, const AdamWParams& p);

  // ---- Host <-> device (CUDA only; CPU returns Unimplemented) ----
  // Copies nbytes between host memory and this device (or within it); synchronous w.r.t. the
  // calling thread's stream. MemcpyToDevice with wait = false returns once the copy is queued on
  // that stream: the source must be pinned host memory (else the driver waits anyway), left
  // unchanged until the stream has passed the copy.
  virtual absl::Status MemcpyToDevice(void* dst, const void* src, size_t nbytes, bool wait) = 0;
  virtual absl::Status MemcpyToHost(void* dst, const void* src, size_t nbytes) = 0;
  // Waits for the kernels and copies this thread issued on the device (its stream). Not for
  // collectives: they run on their communicator's stream; wait on their Work.
  virtual absl::Status Synchronize() = 0;
};

// The backend for `device`: CPU always; CUDA when built and the device exists
// (FailedPrecondition otherwise, saying which).
absl::StatusOr<Kernels*> KernelsFor(Device device);

}  // namespace dtensor

#endif  // DTENSOR_KERNELS_KERNELS_H_
