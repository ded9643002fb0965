// Functional ops on Values (no autograd): each runs locally on plain Tensors and through the
// sharding dispatcher (dispatch.h) on DTensors. The differentiable versions on Variables are
// in ops.h; both are defined together per op family in autograd/ops/*.cc, next to the op's
// sharding rule and backward.
//
//   DT_ASSIGN_OR_RETURN(Value y, fn::Linear(x, w));   // x S(0), w R on a 1-d mesh -> y S(0)
//   DT_ASSIGN_OR_RETURN(Value s, fn::Sum(y, {0}));     // sum over the sharded dim -> P(sum)
//
// Shapes and semantics follow the local ops of dtensor/ops/ops.h (PyTorch's); errors name the
// op and the offending shapes.
#ifndef DTENSOR_AUTOGRAD_FUNCTIONAL_H_
#define DTENSOR_AUTOGRAD_FUNCTIONAL_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/autograd/dispatch.h"
#include "dtensor/autograd/value.h"
#include "dtensor/kernels/kernels.h"

namespace dtensor::fn {

// ---- Pointwise (broadcasting) ----
absl::StatusOr<Value> Binary(BinaryOp op, const Value& a, const Value& b);
inline absl::StatusOr<Value> Add(const Value& a, const Value& b) { return Binary(BinaryOp::kAdd, a, b); }
inline absl::StatusOr<Value> Sub(const Value& a, const Value& b) { return Binary(BinaryOp::kSub, a, b); }
inline absl::StatusOr<Value> Mul(const Value& a, const Value& b) { return Binary(BinaryOp::kMul, a, b); }
inline absl::StatusOr<Value> Div(const Value& a, const Value& b) { return Binary(BinaryOp::kDiv, a, b); }
// a (op) s, or s (op) a when scalar_first.
absl::StatusOr<Value> BinaryScalar(BinaryOp op, const Value& a, double s, bool scalar_first = false);
inline absl::StatusOr<Value> Scale(const Value& a, double s) { return BinaryScalar(BinaryOp::kMul, a, s); }
inline absl::StatusOr<Value> AddScalar(const Value& a, double s) { return BinaryScalar(BinaryOp::kAdd, a, s); }
absl::StatusOr<Value> Unary(UnaryOp op, const Value& x);
// dy * f'(x) for op in {kGelu, kRelu, kTanh, kExp, kLog, kSqrt}.
absl::StatusOr<Value> UnaryBackward(UnaryOp op, const Value& dy, const Value& x);
// x in another dtype (x itself when already of it); a DTensor keeps its layout.
absl::StatusOr<Value> Cast(const Value& x, DType dtype);
// Ones of x's shape and dtype; a DTensor keeps x's layout with Partial replaced by Replicate.
absl::StatusOr<Value> OnesLike(const Value& x);
absl::StatusOr<Value> ZerosLike(const Value& x);

// ---- Reductions (dims empty = all; negative dims allowed) ----
absl::StatusOr<Value> Reduce(ReduceOp op, const Value& x, std::vector<int64_t> dims = {}, bool keepdim = false);
inline absl::StatusOr<Value> Sum(const Value& x, std::vector<int64_t> dims = {}, bool keepdim = false) {
  return Reduce(ReduceOp::kSum, x, std::move(dims), keepdim);
}
inline absl::StatusOr<Value> Mean(const Value& x, std::vector<int64_t> dims = {}, bool keepdim = false) {
  return Reduce(ReduceOp::kMean, x, std::move(dims), keepdim);
}
inline absl::StatusOr<Value> Max(const Value& x, std::vector<int64_t> dims = {}, bool keepdim = false) {
  return Reduce(ReduceOp::kMax, x, std::move(dims), keepdim);
}
// Broadcasts `g` (the result of a reduction of a tensor of `shape` over `dims` with `keepdim`)
// back to `shape`.
absl::StatusOr<Value> ExpandReduced(const Value& g, std::vector<int64_t> shape, std::vector<int64_t> dims,
                                    bool keepdim);
// Sums `g` down to `shape` (the inverse of broadcasting `shape` to g's shape).
absl::StatusOr<Value> SumTo(const Value& g, std::vector<int64_t> shape);
// Gradient of a max/min reduction: dy (reduced shape, expanded back) routed to the elements
// equal to the result y, split evenly between ties (torch.amax's rule).
absl::StatusOr<Value> ReduceMaxBackward(const Value& dy, const Value& x, const Value& y, std::vector<int64_t> dims,
                                        bool keepdim);

// ---- Linear algebra ----
// x [..., in] @ w[out, in]^T -> [..., out] (nn.Linear without bias).
absl::StatusOr<Value> Linear(const Value& x, const Value& w);
// dy [..., out] @ w [out, in] -> dx [..., in].
absl::StatusOr<Value> LinearInputGrad(const Value& dy, const Value& w);
// sum over leading dims of dy[..., out]^T x[..., in] -> dw [out, in].
absl::StatusOr<Value> LinearWeightGrad(const Value& dy, const Value& x);
// LinearWeightGrad and the bias gradient (dy summed over its leading dims) from one kernel ->
// {dw [out, in], db [out]}.
absl::StatusOr<std::vector<Value>> LinearWeightBiasGrad(const Value& dy, const Value& x);
// The gradient through a Linear (w [out, in]) whose input was gelu(pre) (pre [..., in]), and of
// the bias that made pre: {dpre = (dy @ w) * gelu'(pre), db = dpre summed over leading dims [in]}.
absl::StatusOr<std::vector<Value>> LinearInputGradGelu(const Value& dy, const Value& w, const Value& pre);
// torch.matmul on >= 2-d operands with equal batch dims (b may be 2-d); trans flags transpose
// the last two dims first.
absl::StatusOr<Value> Matmul(const Value& a, const Value& b, bool trans_a = false, bool trans_b = false);

// ---- Normalisation over the last dim ----
struct NormResult {
  Value y, mean, rstd;  // mean/rstd: x.shape[:-1], float32 (mean undefined for RmsNorm)
};
absl::StatusOr<NormResult> LayerNorm(const Value& x, const Value& w, const Value& b, double eps = 1e-5);
// -> {dx, dw, db}
absl::StatusOr<std::vector<Value>> LayerNormBackward(const Value& dy, const Value& x, const Value& w,
                                                     const NormResult& saved);
// The residual add and the LayerNorm after it in one op (a GPT block's x + attn, then ln_2):
// residual = x + h, norm = LayerNorm(residual). x and h of one shape (no broadcast) and, as
// DTensors, one layout: any dim but the last may be sharded (LayerNorm's rule); Partial inputs
// are reduced first. The backward is AddLayerNormBackward, for both x and h.
struct AddNormResult {
  Value residual;
  NormResult norm;
};
absl::StatusOr<AddNormResult> AddLayerNorm(const Value& x, const Value& h, const Value& w, const Value& b,
                                           double eps = 1e-5);
// -> {dresidual + LayerNormBackward's dx, dw, db}: the gradient dy of norm.y through the norm,
// plus dresidual, the gradient reaching residual directly, added in the same pass (saved.norm.y
// is not used).
absl::StatusOr<std::vector<Value>> AddLayerNormBackward(const Value& dy, const Value& dresidual, const Value& w,
                                                        const AddNormResult& saved);
absl::StatusOr<NormResult> RmsNorm(const Value& x, const Value& w, double eps = 1e-6);
// -> {dx, dw}
absl::StatusOr<std::vector<Value>> RmsNormBackward(const Value& dy, const Value& x, const Value& w,
                                                   const NormResult& saved);

// ---- Softmax ----
absl::StatusOr<Value> Softmax(const Value& x, int64_t dim = -1);
absl::StatusOr<Value> LogSoftmax(const Value& x, int64_t dim = -1);
absl::StatusOr<Value> SoftmaxBackward(const Value& dy, const Value& y, int64_t dim, bool log);

// ---- Embedding ----
// weight [V, C], ids int32/int64 [...] -> [..., C]. A vocab-sharded weight (Shard(0)) gives a
// Partial(sum) result (each rank looks up its rows, zeros elsewhere), as TP's rowwise embedding.
absl::StatusOr<Value> Embedding(const Value& weight, const Value& ids);
// d weight [V, C] from dout [..., C]. row_split_dims: the mesh dims (a bit mask) on which the
// gradient may come out split by rows from replicated dout and ids; Embedding's backward
// passes those where the table is Shard(0) (see embedding.cc).
absl::StatusOr<Value> EmbeddingBackward(const Value& dout, const Value& ids, int64_t vocab,
                                        uint64_t row_split_dims = ~uint64_t{0});

// ---- Loss ----
struct CrossEntropyResult {
  Value loss;   // 0-d float32: mean over targets != ignore_index
  Value lse;    // float32 [...]: logsumexp per row
  Value count;  // float32 0-d: the global number of targets != ignore_index
};
// logits [..., V], targets [...] int. Batch-sharded inputs give a Partial(sum) loss; a
// vocab-sharded logits (Shard(last)) with replicated targets is computed without gathering
// the logits (loss parallel).
absl::StatusOr<CrossEntropyResult> CrossEntropy(const Value& logits, const Value& targets, int64_t ignore_index = -100);
absl::StatusOr<Value> CrossEntropyBackward(const Value& dloss, const Value& logits, const Value& targets,
                                           const CrossEntropyResult& saved, int64_t ignore_index = -100);
// Training form: the loss and, from the same pass over the logits, dlogits for an upstream
// gradient `expected_dloss` (float32 0-d dloss_seen holds it; a normal float32, else
// InvalidArgument: the backward divides by it). Batch-sharded or replicated
// inputs only (a vocab-sharded logits is gathered: use CrossEntropy for loss parallel).
struct CrossEntropyFusedResult {
  Value loss;        // as CrossEntropyResult::loss
  Value dlogits;     // logits' shape, dtype and layout
  Value count;       // as CrossEntropyResult::count
  Value dloss_seen;  // float32 0-d: the upstream gradient dlogits are for
};
absl::StatusOr<CrossEntropyFusedResult> CrossEntropyFused(const Value& logits, const Value& targets,
                                                          int64_t ignore_index = -100, double expected_dloss = 1.0);

// ---- Attention ----
struct AttentionResult {
  Value out;  // [B, H, T, D]
  Value lse;  // float32 [B, H, T]
};
// Causal attention on q, k, v [B, H, T, D]; batch- or head-sharded inputs stay sharded.
absl::StatusOr<AttentionResult> CausalAttention(const Value& q, const Value& k, const Value& v, double scale = 0);
absl::StatusOr<std::vector<Value>> CausalAttentionBackward(const Value& dout, const Value& q, const Value& k,
                                                           const Value& v, const AttentionResult& saved,
                                                           double scale = 0);

// ---- Views and copies (the result may be a copy: these ops never alias for DTensors) ----
// One size may be -1. A sharded dim keeps its shard when it is the first of the dims it
// merges into or splits from and the sizes divide evenly; otherwise it is gathered first.
absl::StatusOr<Value> Reshape(const Value& x, std::vector<int64_t> shape);
absl::StatusOr<Value> Transpose(const Value& x, int64_t dim0, int64_t dim1);
absl::StatusOr<Value> Permute(const Value& x, std::vector<int64_t> dims);
// Elements [start, start + length) of dim (sharded dims are gathered first).
absl::StatusOr<Value> Narrow(const Value& x, int64_t dim, int64_t start, int64_t length);
// Gradient of Narrow: g placed at [start, start+length) of dim in zeros of `shape`.
absl::StatusOr<Value> NarrowBackward(const Value& g, std::vector<int64_t> shape, int64_t dim, int64_t start);
// Gradient of a split: the pieces' gradients (all defined) concatenated along dim.
absl::StatusOr<Value> SplitBackward(const std::vector<Value>& grads, int64_t dim);
absl::StatusOr<Value> Contiguous(const Value& x);

// ---- Random ----
// Inverted dropout with probability p: the mask of element i depends only on (seed, global
// index i), so every sharding of x drops the same elements. p == 0 returns x.
absl::StatusOr<Value> Dropout(const Value& x, double p, uint64_t seed);

}  // namespace dtensor::fn

#endif  // DTENSOR_AUTOGRAD_FUNCTIONAL_H_
