// Embedding lookup: forward, backward and sharding rules.
//
//   embedding (w [V, C], ids [...]) -> [..., C]
//     R, S(d) -> S(d)          ids sharded (data parallel)
//     S(0), R -> P(sum)        vocab-sharded table: each rank looks up the ids in its rows and
//                              gives zeros for the others (TP's rowwise embedding)
//     S(1), R -> S(-1)         channel-sharded table
//   embedding_backward (dout [..., C], ids [...]) -> dw [V, C]
//     S(d), S(d) -> P(sum)     R, R -> S(0) (each rank scatters into its own rows; only on
//     S(-1), R -> S(1)         P(sum), R -> P(sum)    the mesh dims where the table is S(0))
// Ids are checked against the vocabulary on each rank; where they may differ by rank (sharded,
// or plain per-rank tensors), a rank whose ids fail makes the ranks fail together
// (op_util::TogetherIfPerRank).
// The row split is limited to the table's vocab-sharded mesh dims (args.ints[1], a mask: TP's
// rowwise embedding) because on a dim where the table is Replicate "replicated" dout and ids
// may be plain per-rank data (FSDP's unsharded table, each rank its own batch, PyTorch's FSDP
// way): split by rows, each rank's rows would hold its own batch's gradient alone, and FSDP's
// average would never see the others'.
#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/ops/op_util.h"

namespace dtensor {
namespace {

const Placement kP = Partial(PartialOp::kSum);

bool IsIntDType(DType t) { return t == DType::kInt32 || t == DType::kInt64; }

// The rows [begin, end) of the vocabulary this rank's table piece holds.
std::pair<int64_t, int64_t> LocalRows(const LocalCall& c, int input, const TensorMeta& table, int64_t local_rows) {
  if (c.mesh == nullptr) return {0, table.shape[0]};
  const Shape off =
      LocalBoxOf(table.shape, c.mesh->shape(), c.input_layouts[static_cast<size_t>(input)], c.mesh->coordinate())
          .offset;
  return {off[0], off[0] + local_rows};
}

// ids shifted into [0, rows) (ids of other ranks' rows clamped to 0) and a float mask
// [..., 1] of the ids that were in range. Ids outside [0, vocab) are InvalidArgument, as on
// one rank (every rank of the vocab group holds the same ids, so all of them refuse).
absl::StatusOr<std::pair<Tensor, Tensor>> LocalIds(const Tensor& ids, int64_t begin, int64_t end, int64_t vocab,
                                                   DType dtype) {
  DT_ASSIGN_OR_RETURN(std::vector<int64_t> v, ToInt64Vector(ids));
  std::vector<int64_t> local(v.size());
  std::vector<float> mask(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 0 || v[i] >= vocab) {
      return InvalidArg("Embedding", "id ", v[i], " at position ", i, " is outside [0, ", vocab, ")");
    }
    const bool in = v[i] >= begin && v[i] < end;
    local[i] = in ? v[i] - begin : 0;
    mask[i] = in ? 1.0f : 0.0f;
  }
  Shape ms(ids.shape().begin(), ids.shape().end());
  ms.push_back(1);
  DT_ASSIGN_OR_RETURN(Tensor lt, Tensor::FromVector<int64_t>(local, ids.shape()));
  DT_ASSIGN_OR_RETURN(Tensor mt, Tensor::FromVector<float>(mask, ms));
  DT_ASSIGN_OR_RETURN(mt, Cast(mt, dtype));
  DT_ASSIGN_OR_RETURN(lt, To(lt, ids.device()));
  DT_ASSIGN_OR_RETURN(mt, To(mt, ids.device()));
  return std::make_pair(lt, mt);
}

bool VocabSharded(const LocalCall& c, int input) { return !op_util::ShardingMeshDims(c, input, 0).empty(); }

absl::StatusOr<std::vector<TensorMeta>> EmbMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  if (in[0].shape.size() != 2 || !IsIntDType(in[1].dtype)) {
    return op_util::Invalid("Embedding", absl::StrCat("weight must be [V, C] (got ", ShapeString(in[0].shape),
                                                      ") and ids int32/int64 (got ", DTypeName(in[1].dtype), ")"));
  }
  Shape out = in[1].shape;
  out.push_back(in[0].shape[1]);
  return std::vector<TensorMeta>{{out, in[0].dtype}};
}
void EmbRule(absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
  const int64_t nd = static_cast<int64_t>(in[1].shape.size());
  for (int64_t d = 0; d < nd; ++d) s->push_back({{Replicate(), Shard(d)}, {Shard(d)}});
  s->push_back({{Shard(0), Replicate()}, {kP}});
  s->push_back({{Shard(1), Replicate()}, {Shard(nd)}});
}
absl::StatusOr<std::vector<Tensor>> EmbLocal(const LocalCall& c) {
  const Tensor& w = c.inputs[0];
  if (!VocabSharded(c, 0)) return op_util::One(dtensor::Embedding(w, c.inputs[1]));
  if (w.size(0) == 0) {  // an empty vocab piece (6 rows over 4 ranks): contributes zeros
    Shape out(c.inputs[1].shape().begin(), c.inputs[1].shape().end());
    out.push_back(w.size(1));
    return op_util::One(Zeros(out, w.dtype(), w.device()));
  }
  auto [begin, end] = LocalRows(c, 0, c.input_meta[0], w.size(0));
  DT_ASSIGN_OR_RETURN(auto lm, LocalIds(c.inputs[1], begin, end, c.input_meta[0].shape[0], w.dtype()));
  DT_ASSIGN_OR_RETURN(Tensor rows, dtensor::Embedding(w, lm.first));
  return op_util::One(dtensor::Mul(rows, lm.second));
}
const OpDef kEmbedding = {"embedding", EmbRule, EmbMeta, op_util::TogetherIfPerRank<EmbLocal, 1>};

// args.ints = {V} or {V, mask of the mesh dims where the table is Shard(0)}
absl::StatusOr<std::vector<TensorMeta>> EmbBwdMeta(absl::Span<const TensorMeta> in, const OpArgs& args) {
  const Shape& dout = in[0].shape;
  const Shape& ids = in[1].shape;
  if (dout.size() != ids.size() + 1 || !std::equal(ids.begin(), ids.end(), dout.begin())) {
    return op_util::Invalid("EmbeddingBackward",
                            absl::StrCat("dout ", ShapeString(dout), " does not fit ids ", ShapeString(ids)));
  }
  return std::vector<TensorMeta>{{Shape{args.ints[0], dout.back()}, in[0].dtype}};
}
void EmbBwdRule(absl::Span<const TensorMeta> in, const OpArgs& args, IntSpan, std::vector<DimStrategy>* s) {
  const int64_t nd = static_cast<int64_t>(in[1].shape.size());
  for (int64_t d = 0; d < nd; ++d) s->push_back({{Shard(d), Shard(d)}, {kP}});
  DimStrategy rows{{Replicate(), Replicate()}, {Shard(0)}};
  if (args.ints.size() > 1) rows.mesh_dims = static_cast<uint64_t>(args.ints[1]);
  s->push_back(std::move(rows));
  s->push_back({{Shard(nd), Replicate()}, {Shard(1)}});
  s->push_back({{kP, Replicate()}, {kP}});
}
absl::StatusOr<std::vector<Tensor>> EmbBwdLocal(const LocalCall& c) {
  const Tensor& dout = c.inputs[0];
  const Shape out = op_util::LocalOutShape(c, 0, Shape{c.args.ints[0], dout.size(-1)});
  DT_ASSIGN_OR_RETURN(Tensor dw, Zeros(out, dout.dtype(), dout.device()));
  const bool vocab_sharded = c.mesh != nullptr && out[0] != c.args.ints[0];
  if (out[0] == 0 || out[1] == 0) return std::vector<Tensor>{dw};  // an empty piece: nothing to scatter
  if (!vocab_sharded) {
    DT_RETURN_IF_ERROR(EmbeddingBackward_(dw, dout, c.inputs[1]));
    return std::vector<Tensor>{dw};
  }
  const Shape off = c.OutputOffset(0);
  DT_ASSIGN_OR_RETURN(auto lm, LocalIds(c.inputs[1], off[0], off[0] + out[0], c.args.ints[0], dout.dtype()));
  DT_ASSIGN_OR_RETURN(Tensor masked, dtensor::Mul(dout, lm.second));
  DT_RETURN_IF_ERROR(EmbeddingBackward_(dw, masked, lm.first));
  return std::vector<Tensor>{dw};
}
const OpDef kEmbeddingBackward = {"embedding_backward", EmbBwdRule, EmbBwdMeta,
                                  op_util::TogetherIfPerRank<EmbBwdLocal, 1>};

}  // namespace

namespace fn {
absl::StatusOr<Value> Embedding(const Value& weight, const Value& ids) {
  return op_util::First(Dispatch(kEmbedding, {weight, ids}));
}
absl::StatusOr<Value> EmbeddingBackward(const Value& dout, const Value& ids, int64_t vocab, uint64_t row_split_dims) {
  OpArgs args;
  args.ints.push_back(vocab);
  if (row_split_dims != ~uint64_t{0}) args.ints.push_back(static_cast<int64_t>(row_split_dims));
  return op_util::First(Dispatch(kEmbeddingBackward, {dout, ids}, args));
}
}  // namespace fn

absl::StatusOr<Variable> Embedding(const Variable& weight, const Variable& ids) {
  DT_ASSIGN_OR_RETURN(Value y, fn::Embedding(weight.value(), ids.value()));
  if (!AnyRequiresGrad({weight, ids})) return Variable::Leaf(std::move(y));  // no tape: skip the captures
  const int64_t vocab = weight.value().shape()[0];
  uint64_t row_split_dims = 0;  // the mesh dims where the table is vocab-sharded
  if (weight.value().is_dtensor()) {
    const Layout& l = weight.value().dtensor().layout();
    for (int m = 0; m < l.ndim() && m < 64; ++m) {
      if (l[m].is_shard() && l[m].shard_dim() == 0) row_split_dims |= uint64_t{1} << m;
    }
  }
  auto dense = [idv = ids.value(), vocab, row_split_dims](const Value& g) -> absl::StatusOr<std::vector<Value>> {
    DT_ASSIGN_OR_RETURN(Value dw, fn::EmbeddingBackward(g, idv, vocab, row_split_dims));
    return std::vector<Value>{dw, Value()};
  };
  Variable out = op_util::Result1("Embedding", {weight, ids}, std::move(y), dense);
  // Where the table's gradient already waits for it (a tied table: the head's [V, C] gradient
  // arrives first), the rows are added into that one in place: no [V, C] of zeros to scatter
  // into and add (on GPT-2 124M, 154 MB zeroed and 462 MB read and written less). Plain tensors
  // only; a distributed table keeps its rules. The sum is the same up to the order of additions
  // (dw + (r1 + r2) becomes (dw + r1) + r2 where an id repeats).
  if (auto* node = dynamic_cast<FunctionNode*>(out.grad_fn().get()); node != nullptr) {
    node->set_into(
        [idv = ids.value(), vocab, dense](
            std::vector<Value>& g, absl::Span<const Tensor* const> pending) -> absl::StatusOr<std::vector<Value>> {
          const Tensor* into = pending.empty() ? nullptr : pending[0];
          const Value& dout = g[0];
          if (into != nullptr && dout.defined() && !dout.is_dtensor() && !idv.is_dtensor() && dout.dim() >= 1 &&
              into->dim() == 2 && into->size(0) == vocab && into->size(1) == dout.shape().back() &&
              into->dtype() == dout.dtype() && into->device() == dout.device() && into->is_contiguous()) {
            DT_RETURN_IF_ERROR(EmbeddingBackward_(*into, dout.local(), idv.local()));
            return std::vector<Value>{Value(), Value()};
          }
          return dense(dout);
        });
  }
  return out;
}

namespace op_defs {
const OpDef& Embedding() { return kEmbedding; }
const OpDef& EmbeddingBackward() { return kEmbeddingBackward; }
}  // namespace op_defs

}  // namespace dtensor
