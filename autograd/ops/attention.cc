// Causal self-attention on q, k, v [B, H, T, D]: forward, backward and sharding rule.
// Sharding rule: batch (S(0)) or heads (S(1)) — every row of attention stays on one rank;
// TP shards heads, DP shards the batch.
#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

absl::Status CheckQkv(const char* op, absl::Span<const TensorMeta> in) {
  for (const TensorMeta& m : in) {
    if (m.shape.size() != 4 || m.shape != in[0].shape) {
      return op_util::Invalid(op, absl::StrCat("q, k, v (and dout) must be [B, H, T, D] of one shape; got ",
                                               ShapeString(in[0].shape), " and ", ShapeString(m.shape)));
    }
  }
  return absl::OkStatus();
}

// (q, k, v) -> (out, lse); args.floats = {scale}
absl::StatusOr<std::vector<TensorMeta>> AttnMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  DT_RETURN_IF_ERROR(CheckQkv("CausalAttention", in));
  const Shape& q = in[0].shape;
  return std::vector<TensorMeta>{in[0], {Shape{q[0], q[1], q[2]}, DType::kFloat32}};
}
void AttnRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < 2; ++d) {
    absl::InlinedVector<Placement, 5> ins(in.size(), Shard(d));
    s->push_back({ins, {Shard(d), Shard(d)}});
  }
}
// The inputs go as they are: dtensor::CausalAttention copies what its backend cannot read in
// place (on a GPU, heads split out of the fused qkv projection are read uncopied).
absl::StatusOr<std::vector<Tensor>> AttnLocal(const LocalCall& c) {
  DT_ASSIGN_OR_RETURN(AttentionOutput o, dtensor::CausalAttention(c.inputs[0], c.inputs[1], c.inputs[2],
                                                                  static_cast<float>(c.args.floats[0])));
  return std::vector<Tensor>{o.out, o.lse};
}
const OpDef kAttention = {"causal_attention", AttnRule, AttnMeta, AttnLocal};

// (dout, q, k, v, out, lse) -> (dq, dk, dv)
absl::StatusOr<std::vector<TensorMeta>> AttnBwdMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  DT_RETURN_IF_ERROR(CheckQkv("CausalAttentionBackward", in.subspan(0, 5)));
  return std::vector<TensorMeta>{in[1], in[2], in[3]};
}
// Besides batch and heads: with q, k, v and the saved out and lse fixed, the backward is
// linear in dout (dv = P^T dout; ds = P * (dout v^T - rowsum(dout * out))), so a Partial(sum)
// dout gives Partial dq, dk, dv (a replicated attention below a colwise consumer keeps the
// gradient partial, as the norms do).
void AttnBwdRule(absl::Span<const TensorMeta>, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  for (int64_t d = 0; d < 2; ++d) {
    absl::InlinedVector<Placement, 5> ins(6, Shard(d));
    s->push_back({ins, {Shard(d), Shard(d), Shard(d)}});
  }
  const Placement p = Partial(PartialOp::kSum);
  s->push_back({{p, Replicate(), Replicate(), Replicate(), Replicate(), Replicate()}, {p, p, p}});
}
absl::StatusOr<std::vector<Tensor>> AttnBwdLocal(const LocalCall& c) {
  const auto& in = c.inputs;  // as in AttnLocal: dtensor::CausalAttentionBackward copies what it must
  AttentionOutput saved{in[4], in[5]};
  DT_ASSIGN_OR_RETURN(AttentionGrads g, dtensor::CausalAttentionBackward(in[0], in[1], in[2], in[3], saved,
                                                                         static_cast<float>(c.args.floats[0])));
  return std::vector<Tensor>{g.dq, g.dk, g.dv};
}
const OpDef kAttentionBackward = {"causal_attention_backward", AttnBwdRule, AttnBwdMeta, AttnBwdLocal};

}  // namespace

namespace fn {
absl::StatusOr<AttentionResult> CausalAttention(const Value& q, const Value& k, const Value& v, double scale) {
  OpArgs args;
  args.floats.push_back(scale);
  DT_ASSIGN_OR_RETURN(std::vector<Value> r, Dispatch(kAttention, {q, k, v}, args));
  return AttentionResult{r[0], r[1]};
}
absl::StatusOr<std::vector<Value>> CausalAttentionBackward(const Value& dout, const Value& q, const Value& k,
                                                           const Value& v, const AttentionResult& saved, double scale) {
  OpArgs args;
  args.floats.push_back(scale);
  return Dispatch(kAttentionBackward, {dout, q, k, v, saved.out, saved.lse}, args);
}
}  // namespace fn

absl::StatusOr<Variable> CausalAttention(const Variable& q, const Variable& k, const Variable& v, double scale) {
  DT_ASSIGN_OR_RETURN(fn::AttentionResult r, fn::CausalAttention(q.value(), k.value(), v.value(), scale));
  if (!AnyRequiresGrad({q, k, v})) return Variable::Leaf(r.out);  // no tape: skip the captures
  return op_util::Result1(
      "CausalAttention", {q, k, v}, r.out,
      [qv = q.value(), kv = k.value(), vv = v.value(), r, scale](const Value& g) -> absl::StatusOr<std::vector<Value>> {
        return fn::CausalAttentionBackward(g, qv, kv, vv, r, scale);
      });
}

namespace op_defs {
const OpDef& Attention() { return kAttention; }
const OpDef& AttentionBackward() { return kAttentionBackward; }
}  // namespace op_defs

}  // namespace dtensor
