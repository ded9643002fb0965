// Ops: the local tensor operations a GPT and its optimizer need, on CPU and CUDA.
//
//   DT_ASSIGN_OR_RETURN(Tensor w, RandomNormal({768, 3072}, DType::kFloat32, /*seed=*/42, 0.0, 0.02));
//   DT_ASSIGN_OR_RETURN(Tensor h, Matmul(x, w));                  // [B*T, 768] @ [768, 3072]
//   DT_ASSIGN_OR_RETURN(Tensor g, Gelu(h));
//   DT_ASSIGN_OR_RETURN(Tensor s, Sum(g, {-1}, /*keepdim=*/true));
//   DT_ASSIGN_OR_RETURN(Tensor g_cuda, To(g, Device::Cuda(0)));   // copy to a GPU
//
// Each function validates its arguments (shape, dtype, device, dims) and returns
// InvalidArgument naming the op and the offending shapes; FailedPrecondition for a device
// that is not available. Outputs are new contiguous tensors on the inputs' device unless the
// name ends in an underscore (in place on the first argument). Inputs may be non-contiguous
// views. float32, bfloat16 and float16 are computed in float32.
#ifndef DTENSOR_OPS_OPS_H_
#define DTENSOR_OPS_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/kernels/kernels.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

// ---- Creation ----
absl::StatusOr<Tensor> Zeros(IntSpan shape, DType dtype, Device device = Device::Cpu());
absl::StatusOr<Tensor> Ones(IntSpan shape, DType dtype, Device device = Device::Cpu());
absl::StatusOr<Tensor> Full(IntSpan shape, double value, DType dtype, Device device = Device::Cpu());
// [0, 1, ..., n-1]
absl::StatusOr<Tensor> Arange(int64_t n, DType dtype, Device device = Device::Cpu());
// Seeded, counter-based random tensors: element with linear index i depends only on (seed, i).
absl::StatusOr<Tensor> RandomNormal(IntSpan shape, DType dtype, uint64_t seed, double mean = 0.0, double stddev = 1.0,
                                    Device device = Device::Cpu());
absl::StatusOr<Tensor> RandomUniform(IntSpan shape, DType dtype, uint64_t seed, double low = 0.0, double high = 1.0,
                                     Device device = Device::Cpu());
// Fills `dst` in place as the block at `global_offset` of a random tensor of `global_shape`:
// every rank gets exactly the values of its shard of the full tensor, whatever the sharding.
absl::Status FillRandom_(const Tensor& dst, const RandomSpec& spec, IntSpan global_shape, IntSpan global_offset);

// ---- Copies, casts, layout ----
// dst = src (broadcasting src to dst's shape), converting dtype and crossing devices as needed.
absl::Status Copy_(const Tensor& dst, const Tensor& src);
// Copy_ for equal-shaped views of one dtype (the blocks that collectives and redistributions
// move): on the CPU, when both have unit stride along the last dim, one memcpy per row on the
// calling thread. Ranks that are threads of one process copy at once, and the parallel
// Copy_ would start one OpenMP team per rank and oversubscribe the cores. Else Copy_.
absl::Status CopyBlock(const Tensor& dst, const Tensor& src);
absl::Status Fill_(const Tensor& dst, double value);
// A contiguous tensor with the same values (returns `x` itself when already contiguous).
absl::StatusOr<Tensor> Contiguous(const Tensor& x);
// A contiguous copy, always new memory.
absl::StatusOr<Tensor> Clone(const Tensor& x);
// View when strides allow, else a contiguous copy. One size may be -1.
absl::StatusOr<Tensor> Reshape(const Tensor& x, IntSpan shape);
// Copy to another device (returns `x` when already there).
//   non_blocking (torch's x.to(device, non_blocking=True)): a host -> GPU copy from pinned
//   memory (Tensor::EmptyPinned), contiguous, returns once it is queued on the calling thread's
//   stream; the caller leaves the source unchanged until that stream has passed the copy (any
//   later read of device memory on this thread waits for it). Every other copy waits, as without.
struct ToOptions {
  bool non_blocking = false;
};
absl::StatusOr<Tensor> To(const Tensor& x, Device device, ToOptions options = {});
// Cast to another dtype (returns `x` when already of it).
absl::StatusOr<Tensor> Cast(const Tensor& x, DType dtype);
// torch.cat / torch.stack. Inputs must share dtype and device; all but `dim` sizes must agree.
absl::StatusOr<Tensor> Cat(absl::Span<const Tensor> xs, int64_t dim);
absl::StatusOr<Tensor> Stack(absl::Span<const Tensor> xs, int64_t dim);
// Host copy of all elements as float64 / int64 (any dtype, any device). For tests and debugging.
absl::StatusOr<std::vector<double>> ToDoubleVector(const Tensor& x);
absl::StatusOr<std::vector<int64_t>> ToInt64Vector(const Tensor& x);

// ---- Elementwise (broadcasting; both operands of one dtype and device) ----
absl::StatusOr<Tensor> Add(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Sub(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Mul(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Div(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Maximum(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Minimum(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Binary(BinaryOp op, const Tensor& a, const Tensor& b);
// a (op) s, or s (op) a when scalar_first.
absl::StatusOr<Tensor> BinaryScalar(BinaryOp op, const Tensor& a, double s, bool scalar_first = false);
absl::StatusOr<Tensor> AddScalar(const Tensor& a, double s);
// a * s
absl::StatusOr<Tensor> Scale(const Tensor& a, double s);
// a += b, a *= b (b broadcast to a's shape) in place.
absl::Status Add_(const Tensor& a, const Tensor& b);
absl::Status Mul_(const Tensor& a, const Tensor& b);
// a *= s in place.
absl::Status Scale_(const Tensor& a, double s);

absl::StatusOr<Tensor> Unary(UnaryOp op, const Tensor& x);
absl::StatusOr<Tensor> Neg(const Tensor& x);
absl::StatusOr<Tensor> Exp(const Tensor& x);
absl::StatusOr<Tensor> Log(const Tensor& x);
absl::StatusOr<Tensor> Sqrt(const Tensor& x);
absl::StatusOr<Tensor> Relu(const Tensor& x);
// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
absl::StatusOr<Tensor> Gelu(const Tensor& x);
absl::StatusOr<Tensor> Tanh(const Tensor& x);
// dx = dy * f'(x) for op in {kGelu, kRelu, kTanh, kExp, kLog, kSqrt}.
absl::StatusOr<Tensor> UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x);

// ---- Reductions over `dims` (empty = all dims; negative dims allowed) ----
absl::StatusOr<Tensor> Sum(const Tensor& x, IntSpan dims = {}, bool keepdim = false);
// The sum of the squares of all of x's elements (a float dtype), float32 [1]: what
// Sum(Mul(x, x)) gives, without the temporary of x's size (CPU and CUDA sum the squares in
// float64 in a fixed order, so the low bits can differ from Sum's, and not between calls).
absl::StatusOr<Tensor> SumOfSquares(const Tensor& x);
absl::StatusOr<Tensor> Mean(const Tensor& x, IntSpan dims = {}, bool keepdim = false);
// Max/Min over an empty dim -> InvalidArgument.
absl::StatusOr<Tensor> Max(const Tensor& x, IntSpan dims = {}, bool keepdim = false);
absl::StatusOr<Tensor> Min(const Tensor& x, IntSpan dims = {}, bool keepdim = false);
absl::StatusOr<Tensor> Reduce(ReduceOp op, const Tensor& x, IntSpan dims = {}, bool keepdim = false);

// ---- Softmax ----
absl::StatusOr<Tensor> Softmax(const Tensor& x, int64_t dim = -1);
absl::StatusOr<Tensor> LogSoftmax(const Tensor& x, int64_t dim = -1);
// Gradients from dy and the forward output y.
absl::StatusOr<Tensor> SoftmaxBackward(const Tensor& dy, const Tensor& y, int64_t dim = -1);
absl::StatusOr<Tensor> LogSoftmaxBackward(const Tensor& dy, const Tensor& y, int64_t dim = -1);

// ---- Normalisation over the last dim ----
struct NormOutput {
  Tensor y;     // x's shape and dtype
  Tensor mean;  // float32 [rows] (LayerNorm only), rows = numel / C
  Tensor rstd;  // float32 [rows]
};
struct NormGrads {
  Tensor dx, dweight, dbias;  // dbias undefined when the forward had no bias / for RmsNorm
};
// bias may be an undefined Tensor (no bias).
absl::StatusOr<NormOutput> LayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps = 1e-5f);
absl::StatusOr<NormGrads> LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                            const NormOutput& saved, bool has_bias = true);
// The residual add and the LayerNorm after it, in one backend call (llm.c's
// fused_residual_forward): residual = x + h and norm = LayerNorm(residual, weight, bias, eps),
// reading x and h once. x and h of one shape, dtype and device. Equals Add then LayerNorm (on
// the CPU bit for bit: the sum is rounded to x's dtype before it is normalised); the backward is
// LayerNormBackwardAdd below (LayerNormBackward plus the gradient reaching `residual` directly).
struct AddNormOutput {
  Tensor residual;  // x + h: x's shape and dtype
  NormOutput norm;  // of residual
};
absl::StatusOr<AddNormOutput> AddLayerNorm(const Tensor& x, const Tensor& h, const Tensor& weight, const Tensor& bias,
                                           float eps = 1e-5f);
// AddLayerNorm's backward: LayerNormBackward of residual (x here) with `dresidual`, the gradient
// reaching the residual directly (x's shape and dtype), added to dx in the same pass; equal to
// LayerNormBackward then Add (dx rounded to x's dtype before the add).
absl::StatusOr<NormGrads> LayerNormBackwardAdd(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                               const NormOutput& saved, const Tensor& dresidual, bool has_bias = true);
absl::StatusOr<NormOutput> RmsNorm(const Tensor& x, const Tensor& weight, float eps = 1e-6f);
absl::StatusOr<NormGrads> RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                          const NormOutput& saved);

// ---- Matrix multiply ----
// torch.matmul for 2-d and batched (>= 3-d, batch dims broadcast) operands; 1-d operands are
// not supported. trans_a / trans_b transpose the last two dims of a / b first (a view, free).
absl::StatusOr<Tensor> Matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
// out = alpha * op(a) @ op(b) + beta * out, in place on a contiguous `out` of the right shape.
absl::Status MatmulInto(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a = false, bool trans_b = false,
                        float alpha = 1.0f, float beta = 0.0f);

// nn.Linear on rows: x [M, K] @ w [N, K]^T + bias [N] -> [M, N] in one backend call
// (Kernels::GemmBias: cuBLASLt's bias epilogue on CUDA). With gelu: gelu(x w^T + bias) (tanh
// approximation), and *pre (when not null) receives x w^T + bias, which the backward needs.
// On the CPU the result equals Add(Matmul(x, w, false, true), bias) (then Gelu) bit for bit.
absl::StatusOr<Tensor> LinearBias(const Tensor& x, const Tensor& w, const Tensor& bias, bool gelu = false,
                                  Tensor* pre = nullptr);
// nn.Linear's weight and bias gradients from one matrix multiply (Kernels::GemmBiasGrad:
// cuBLASLt's BGRADB epilogue on CUDA): dy [M, N], x [M, K] -> dw = dy^T x [N, K], and *db (not
// null) receives the column sums of dy [N]. On the CPU equal to Matmul(dy, x, true, false) and
// Sum(dy, {0}) bit for bit.
absl::StatusOr<Tensor> LinearWeightBiasGrad(const Tensor& dy, const Tensor& x, Tensor* db);
// The input gradient of nn.Linear through the GELU before it (an MLP's second Linear: its input
// was gelu(pre)), with the first Linear's bias gradient (Kernels::GemmDgelu: cuBLASLt's
// DGELU_BGRAD epilogue on CUDA): dy [M, N], w [N, K], pre [M, K] -> dpre = (dy w) * gelu'(pre)
// [M, K] (tanh approximation), and *db (not null) receives the column sums of dpre [K]. On the
// CPU equal to UnaryBackward(kGelu, Matmul(dy, w), pre) and Sum(dpre, {0}) bit for bit.
absl::StatusOr<Tensor> LinearInputGradGelu(const Tensor& dy, const Tensor& w, const Tensor& pre, Tensor* db);

// ---- Embedding ----
// weight [V, C]; ids any shape, int32/int64 -> [*ids.shape, C]. Out-of-range ids -> error (CPU).
absl::StatusOr<Tensor> Embedding(const Tensor& weight, const Tensor& ids);
// dweight += scatter of dout rows by ids (dweight [V, C], in place).
absl::Status EmbeddingBackward_(const Tensor& dweight, const Tensor& dout, const Tensor& ids);

// ---- Cross-entropy ----
struct CrossEntropyOutput {
  Tensor loss;   // float32 0-d: mean over targets != ignore_index (NaN when all are ignored)
  Tensor lse;    // float32 [N]: logsumexp per row (saved for backward)
  Tensor count;  // float32 0-d: number of targets != ignore_index
};
// logits [..., V]; targets [...] int32/int64 with the same leading shape.
absl::StatusOr<CrossEntropyOutput> CrossEntropy(const Tensor& logits, const Tensor& targets,
                                                int64_t ignore_index = -100);
// dlogits for a scalar upstream gradient dloss (0-d float32 tensor on the logits' device).
absl::StatusOr<Tensor> CrossEntropyBackward(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                                            const CrossEntropyOutput& saved, int64_t ignore_index = -100);

// The cross-entropy and its gradient from one pass over the logits, for training (llm.c's
// fused classifier). loss is CrossEntropy's; dlogits is CrossEntropyBackward's for the upstream
// gradient `dloss` (float32 0-d), which the caller knows before the backward (1 for a loss
// that is backpropagated as is). `count` (float32 0-d) divides both: every batch shard's
// targets != ignore_index (CountTargets, summed over the shards); undefined: this call's own.
struct CrossEntropyWithGradOutput {
  Tensor loss;     // float32 0-d: the sum of this call's losses / count
  Tensor dlogits;  // logits' shape and dtype
  Tensor count;    // float32 0-d: the count used
};
absl::StatusOr<CrossEntropyWithGradOutput> CrossEntropyWithGrad(const Tensor& logits, const Tensor& targets,
                                                                const Tensor& dloss, int64_t ignore_index = -100,
                                                                const Tensor& count = Tensor());
// float32 0-d on targets' device: the number of targets that are not ignore_index (a target
// outside [0, num_classes): InvalidArgument on the CPU, not counted on a GPU).
absl::StatusOr<Tensor> CountTargets(const Tensor& targets, int64_t num_classes, int64_t ignore_index = -100);
// x *= num / den in place (num, den float32 scalars on x's device; x contiguous float). x is
// not touched when num == den; on a GPU that check runs there: the host does not wait.
absl::Status ScaleByRatio_(const Tensor& x, const Tensor& num, const Tensor& den);

// ---- Causal attention ----
struct AttentionOutput {
  Tensor out;  // [B, H, T, D]
  Tensor lse;  // float32 [B, H, T]
};
struct AttentionGrads {
  Tensor dq, dk, dv;
};
// q, k, v [B, H, T, D] of one float dtype; scale defaults to 1/sqrt(D) when <= 0.
// As PyTorch's fused attention does, the results take their inputs' memory layout where the
// backend reads views in place (CPU, CUDA): with q's rows laid out as [B, T, H, D] (the heads of
// a [B, T, C] projection, transposed), out is laid out as [B, T, H, D] too, so that its
// transpose back to [B, T, C] is a view; dq, dk, dv likewise, and where q, k, v are the heads of
// one [B, T, 3, H, D] buffer (a fused qkv projection split in three) dq, dk, dv are those of one
// new buffer, whose concatenation is then a view. Else they are contiguous.
absl::StatusOr<AttentionOutput> CausalAttention(const Tensor& q, const Tensor& k, const Tensor& v, float scale = 0.0f);
absl::StatusOr<AttentionGrads> CausalAttentionBackward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                       const Tensor& v, const AttentionOutput& saved,
                                                       float scale = 0.0f);

// ---- Optimizer ----
// One fused AdamW step in place on param, m and v (see Kernels::AdamW for dtypes).
absl::Status AdamWStep_(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                        const AdamWParams& p);
// AdamWStep_ on every entry of `list`, each with its own step (p.step is not used): the same
// checks and results, with the entries of one device updated by one backend call
// (Kernels::AdamWMulti: on CUDA, one launch per 64 parameters of one dtype pair). An entry's
// grad_square_sum, where defined (float32 [1] on grad's device), receives SumOfSquares(grad):
// on the CPU read in the update's own pass, with the same bits. An entry's grad_scale, where
// defined (float32 [1] on grad's device), multiplies its gradient as the update reads it (grad
// is not written). An error names the entry; nothing is updated when any entry is invalid.
absl::Status AdamWStepMulti_(absl::Span<const AdamWTensors> list, const AdamWParams& p);

// Waits for the device work this thread issued (no-op on CPU).
absl::Status Synchronize(Device device);

}  // namespace dtensor

#endif  // DTENSOR_OPS_OPS_H_
