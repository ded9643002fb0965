// The OpDefs behind the fn:: ops (internal; for tests and benchmarks that enumerate and run
// every sharding strategy of an op with EnumerateStrategies / DispatchWith). Each comment gives
// the inputs and the OpArgs encoding the op's fn:: wrapper uses.
#ifndef DTENSOR_AUTOGRAD_OPS_OP_DEFS_H_
#define DTENSOR_AUTOGRAD_OPS_OP_DEFS_H_

#include "dtensor/autograd/dispatch.h"

namespace dtensor::op_defs {

const OpDef& Attention();             // attention.cc: (q, k, v) -> (out, lse); args.floats = {scale}
const OpDef& AttentionBackward();     // attention.cc: (dout, q, k, v, out, lse) -> (dq, dk, dv); args.floats = {scale}
const OpDef& Embedding();             // embedding.cc: (w [V, C], ids)
const OpDef& EmbeddingBackward();     // embedding.cc: (dout, ids); args.ints = {V}
const OpDef& CrossEntropy();          // loss.cc: (logits, targets) -> (loss, lse, count); args.ints = {ignore_index}
const OpDef& CrossEntropyBackward();  // loss.cc: (dloss, logits, targets, lse, count); args.ints = {ignore_index}
const OpDef& CrossEntropyFused();     // loss.cc: (logits, targets) -> (loss, dlogits, count, dloss_seen)
const OpDef& Linear();                // matmul.cc: (x [..., in], w [out, in])
const OpDef& LinearBias();            // matmul.cc: (x, w, b [out]) -> y; args.ints = {0}
const OpDef& LinearBiasGelu();        // matmul.cc: (x, w, b [out]) -> (gelu(y), y); args.ints = {1}
const OpDef& LinearDx();              // matmul.cc: (dy, w)
const OpDef& LinearDw();              // matmul.cc: (dy, x)
const OpDef& LinearDwBias();          // matmul.cc: (dy, x) -> (dw, db)
const OpDef& LinearDxGelu();          // matmul.cc: (dy, w, pre) -> (dpre, db)
const OpDef& MlpGelu();               // matmul.cc: (x, w_fc, b_fc, w_proj, b_proj) -> (y, pre)
const OpDef& Matmul();                // matmul.cc: args.ints = {trans_a, trans_b}
const OpDef& LayerNorm();             // norm.cc: (x, w, b) -> (y, mean, rstd); args.floats = {eps}
const OpDef& LayerNormBackward();     // norm.cc: (dy, x, w, mean, rstd) -> (dx, dw, db)
const OpDef& AddLayerNorm();          // norm.cc: (x, h, w, b) -> (x + h, y, mean, rstd); args.floats = {eps}
const OpDef& AddLayerNormBackward();  // norm.cc: (dy, x1, w, mean, rstd, dx1) -> (dx1 + dx, dw, db)
const OpDef& RmsNorm();               // norm.cc: (x, w) -> (y, rstd); args.floats = {eps}
const OpDef& RmsNormBackward();       // norm.cc: (dy, x, w, rstd) -> (dx, dw)
const OpDef& Softmax();               // norm.cc: args.ints = {dim (normalised), log}
const OpDef& SoftmaxBackward();       // norm.cc: (dy, y); args.ints = {dim, log}
const OpDef& Binary();                // pointwise.cc: args.ints = {BinaryOp}
const OpDef& Scalar();                // pointwise.cc: args.ints = {BinaryOp, scalar_first}, floats = {s}
const OpDef& Unary();                 // pointwise.cc: args.ints = {UnaryOp}
const OpDef& UnaryBackward();         // pointwise.cc: (dy, x); args.ints = {UnaryOp}
const OpDef& Dropout();               // pointwise.cc: args.ints = {seed}, floats = {p}; outputs (y, mask)
const OpDef& Reduce();                // reduce.cc: args.ints = {ReduceOp, keepdim, dims (sorted, normalised)...}
const OpDef& Expand();                // reduce.cc: args.ints = {keepdim, ndim, shape..., dims...}
const OpDef& Equal();                 // reduce.cc: (x, y) -> 1.0 where equal
const OpDef& Reshape();               // view.cc: args.ints = the new shape (resolved)
const OpDef& Permute();               // view.cc: args.ints = the permutation
const OpDef& Narrow();                // view.cc: args.ints = {dim, start, length}
const OpDef& NarrowBackward();        // view.cc: args.ints = {dim, start, ndim, shape...}
const OpDef& SplitBackward();         // view.cc: (g0, g1, ...) -> their concatenation; args.ints = {dim}
const OpDef& Contiguous();            // view.cc: (x)

}  // namespace dtensor::op_defs

#endif  // DTENSOR_AUTOGRAD_OPS_OP_DEFS_H_
