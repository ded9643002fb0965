// Differentiable ops on Variables: each records its backward on the tape (variable.h) when a
// input requires grad, and runs forward through the dispatcher (functional.h), so it works on
// plain Tensors and on DTensors of any layout. Forward, backward and sharding rule of each op
// sit together in autograd/ops/<family>.cc.
//
//   Variable x = Variable::Constant(batch);                    // DTensor S(0)
//   DT_ASSIGN_OR_RETURN(Variable h, Linear(x, w, b));          // w, b: parameters (R)
//   DT_ASSIGN_OR_RETURN(Variable a, Gelu(h));
//   DT_ASSIGN_OR_RETURN(Variable loss, Mean(a));               // P(sum) over the batch shards
//   DT_RETURN_IF_ERROR(Backward(loss));                        // w.grad(): P(sum)
#ifndef DTENSOR_AUTOGRAD_OPS_H_
#define DTENSOR_AUTOGRAD_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/variable.h"

namespace dtensor {

// ---- Pointwise ----
absl::StatusOr<Variable> Add(const Variable& a, const Variable& b);
absl::StatusOr<Variable> Sub(const Variable& a, const Variable& b);
absl::StatusOr<Variable> Mul(const Variable& a, const Variable& b);
absl::StatusOr<Variable> Div(const Variable& a, const Variable& b);
absl::StatusOr<Variable> Scale(const Variable& a, double s);
absl::StatusOr<Variable> AddScalar(const Variable& a, double s);
// x in `dtype` (the gradient is cast back to x's dtype); x itself when already of it.
absl::StatusOr<Variable> Cast(const Variable& x, DType dtype);
absl::StatusOr<Variable> Unary(UnaryOp op, const Variable& x);  // neg, exp, log, sqrt, relu, gelu, tanh
inline absl::StatusOr<Variable> Gelu(const Variable& x) { return Unary(UnaryOp::kGelu, x); }

// ---- Reductions ----
absl::StatusOr<Variable> Sum(const Variable& x, std::vector<int64_t> dims = {}, bool keepdim = false);
absl::StatusOr<Variable> Mean(const Variable& x, std::vector<int64_t> dims = {}, bool keepdim = false);
absl::StatusOr<Variable> Max(const Variable& x, std::vector<int64_t> dims = {}, bool keepdim = false);

// ---- Linear algebra ----
// x [..., in], w [out, in], b [out] or undefined -> [..., out]
absl::StatusOr<Variable> Linear(const Variable& x, const Variable& w, const Variable& b = Variable());
// gelu(x w^T + b) (tanh approximation) in one kernel (the matrix multiply's GELU epilogue on
// CUDA): Gelu(Linear(x, w, b)) with the same values and gradients. b must be defined.
absl::StatusOr<Variable> LinearGelu(const Variable& x, const Variable& w, const Variable& b);
// The GPT MLP as one op: gelu(x w_fc^T + b_fc) w_proj^T + b_proj (x [..., C], w_fc [H, C],
// w_proj [C', H]), with the values and gradients of Linear(LinearGelu(x, w_fc, b_fc), w_proj,
// b_proj) (bit for bit on the CPU). Its backward runs the GELU backward and b_fc's gradient in
// c_proj's input-gradient matrix multiply and each bias gradient with its weight gradient
// (cuBLASLt epilogues on CUDA). Biases must be defined.
absl::StatusOr<Variable> MlpGelu(const Variable& x, const Variable& w_fc, const Variable& b_fc, const Variable& w_proj,
                                 const Variable& b_proj);
absl::StatusOr<Variable> Matmul(const Variable& a, const Variable& b, bool trans_a = false, bool trans_b = false);

// ---- Normalisation, softmax ----
absl::StatusOr<Variable> LayerNorm(const Variable& x, const Variable& w, const Variable& b, double eps = 1e-5);
// residual = x + h and y = LayerNorm(residual, w, b) in one op (fn::AddLayerNorm): the values
// and gradients of Add then LayerNorm (on the CPU bit for bit), with x and h read once.
struct ResidualNorm {
  Variable residual, y;
};
absl::StatusOr<ResidualNorm> AddLayerNorm(const Variable& x, const Variable& h, const Variable& w, const Variable& b,
                                          double eps = 1e-5);
absl::StatusOr<Variable> RmsNorm(const Variable& x, const Variable& w, double eps = 1e-6);
absl::StatusOr<Variable> Softmax(const Variable& x, int64_t dim = -1);
absl::StatusOr<Variable> LogSoftmax(const Variable& x, int64_t dim = -1);

// ---- Embedding, loss, attention ----
absl::StatusOr<Variable> Embedding(const Variable& weight, const Variable& ids);
absl::StatusOr<Variable> CrossEntropy(const Variable& logits, const Variable& targets, int64_t ignore_index = -100);
// CrossEntropy's value and gradient, for training (llm.c's fused classifier): the forward
// reads the logits once for the loss and the gradient and keeps only the gradient (the logits
// may be freed at once); the backward scales it in place by dloss / expected_dloss, on the
// device, a no-op pass when they are equal (grad accumulation over K micro-batches: pass
// 1/K; expected_dloss must be a normal float32: 0 is InvalidArgument, as there would be no
// gradient to rescale). Not for vocab-sharded logits (loss parallel): it would gather them; use
// CrossEntropy.
// Without a gradient to compute it is CrossEntropy.
absl::StatusOr<Variable> CrossEntropyFused(const Variable& logits, const Variable& targets, int64_t ignore_index = -100,
                                           double expected_dloss = 1.0);
absl::StatusOr<Variable> CausalAttention(const Variable& q, const Variable& k, const Variable& v, double scale = 0);

// ---- Views ----
absl::StatusOr<Variable> Reshape(const Variable& x, std::vector<int64_t> shape);
absl::StatusOr<Variable> Transpose(const Variable& x, int64_t dim0, int64_t dim1);
absl::StatusOr<Variable> Narrow(const Variable& x, int64_t dim, int64_t start, int64_t length);
absl::StatusOr<std::vector<Variable>> Split(const Variable& x, int64_t split_size, int64_t dim);

// ---- Random ----
absl::StatusOr<Variable> Dropout(const Variable& x, double p, uint64_t seed, bool training = true);

// ---- DTensor boundaries ----
// The same values laid out as `layout`. Backward: the gradient goes back to the input's
// layout, with a Partial input treated as Replicate (PyTorch's rule).
absl::StatusOr<Variable> Redistribute(const Variable& x, const Layout& layout);
// A DTensor from this rank's piece (Variable of a plain Tensor); backward: the gradient's
// local piece (after redistributing it to `layout`, Partial treated as Replicate).
absl::StatusOr<Variable> FromLocal(const Variable& local, const DeviceMesh& mesh, const Layout& layout,
                                   const DTensor::FromLocalOptions& options = {});
// The local piece of a DTensor Variable; backward wraps the gradient with the same layout.
absl::StatusOr<Variable> ToLocal(const Variable& x);

}  // namespace dtensor

#endif  // DTENSOR_AUTOGRAD_OPS_H_
