#include "dtensor/nn/gpt.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {
namespace {
class Container : public Module {
 public:
  template <typename M>
  M* Add(const std::string& name, std::unique_ptr<M> m) {
    return RegisterModule(name, std::move(m));
  }
};
}  // namespace

absl::StatusOr<std::unique_ptr<GPT>> GPT::Create(const GPTConfig& c) {
  if (c.vocab_size <= 0 || c.block_size <= 0 || c.n_layer < 0 || c.n_head <= 0 || c.n_embd <= 0 ||
      c.n_embd % c.n_head != 0) {
    return absl::InvalidArgumentError(absl::StrCat("[GPT] bad config: vocab_size ", c.vocab_size, ", block_size ",
                                                   c.block_size, ", n_layer ", c.n_layer, ", n_head ", c.n_head,
                                                   ", n_embd ", c.n_embd, " (n_embd must be a multiple of n_head)"));
  }
  if (c.dropout < 0 || c.dropout >= 1) {
    return absl::InvalidArgumentError(absl::StrCat("[GPT] dropout must be in [0, 1), got ", c.dropout));
  }
  // The parameter count, in double so that it cannot wrap: wte, wpe, ln_f, then per block
  // 12 C^2 + 13 C. Past 2^50 elements no machine holds the model (and the modules alone of
  // 10^8 layers would exhaust memory before any check could run).
  const double cd = static_cast<double>(c.n_embd);
  const double params = (static_cast<double>(c.vocab_size) + static_cast<double>(c.block_size) + 2) * cd +
                        static_cast<double>(c.n_layer) * (12 * cd * cd + 13 * cd);
  if (params > std::ldexp(1.0, 50) || c.n_layer > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("[GPT] vocab_size ", c.vocab_size, ", block_size ", c.block_size,
                                                   ", n_layer ", c.n_layer, ", n_embd ", c.n_embd, " make ", params,
                                                   " parameters: too many to allocate"));
  }
  auto model = std::make_unique<GPT>(c);
  // A layer whose parameter could not be allocated holds an undefined tensor (constructors
  // return no status): name the first one.
  for (auto& [name, p] : model->NamedParameters()) {
    if (!p->value().defined()) {
      return absl::ResourceExhaustedError(absl::StrCat("[GPT] parameter ", name, " could not be allocated (model of ",
                                                       params, " parameters in ", DTypeName(c.dtype), ")"));
    }
  }
  return model;
}

GPT::GPT(const GPTConfig& c) : config_(c) {
  auto t = std::make_unique<Container>();
  wte_ = t->Add("wte", std::make_unique<Embedding>(c.vocab_size, c.n_embd, c.dtype));
  wpe_ = t->Add("wpe", std::make_unique<Embedding>(c.block_size, c.n_embd, c.dtype));
  h_ = t->Add("h", std::make_unique<ModuleList>());
  for (int64_t i = 0; i < c.n_layer; ++i) {
    h_->Append(std::make_unique<Block>(c.n_embd, c.n_head, c.dropout, c.dropout_seed * 1000 + static_cast<uint64_t>(i),
                                       c.dtype));
  }
  ln_f_ = t->Add("ln_f", std::make_unique<LayerNorm>(c.n_embd, 1e-5, c.dtype));
  transformer_ = RegisterModule("transformer", std::move(t));
  lm_head_ = RegisterModule("lm_head", std::make_unique<Linear>(wte_->weight()));  // tied
}

int64_t GPT::NumParameters() {
  int64_t n = 0;
  for (Variable* p : Parameters()) n += p->value().numel();
  return n;
}

absl::Status GPT::InitWeights(uint64_t seed) {
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  uint64_t index = 0;
  for (auto& [name, p] : NamedParameters()) {
    ++index;
    const Tensor& local = p->value().local();
    const bool is_ln = absl::StrContains(name, "ln_");
    if (absl::EndsWith(name, ".bias")) {
      DT_RETURN_IF_ERROR(Fill_(local, 0.0));
    } else if (is_ln) {
      DT_RETURN_IF_ERROR(Fill_(local, 1.0));
    } else {
      RandomSpec spec;
      spec.kind = RandomSpec::Kind::kNormal;
      spec.seed = seed * 0x100000001B3ull + index;
      spec.a = 0.0;
      spec.b = absl::EndsWith(name, "c_proj.weight") ? proj_std : 0.02;
      Shape offset(static_cast<size_t>(local.dim()), 0);
      if (p->value().is_dtensor()) offset = p->value().dtensor().local_box().offset;
      DT_RETURN_IF_ERROR(FillRandom_(local, spec, p->value().shape(), offset));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> GPT::Positions(int64_t start, int64_t t, Device device) {
  if (!positions_.defined() || positions_.device() != device) {
    DT_ASSIGN_OR_RETURN(positions_, Arange(config_.block_size, DType::kInt64, device));
  }
  return positions_.Narrow(0, start, t);
}

absl::StatusOr<GPT::Output> GPT::Forward(const Variable& ids, const Variable& targets, double loss_grad) {
  IntSpan s = ids.value().shape();
  if (s.size() != 2 || s[1] > config_.block_size || s[1] <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("[GPT] ids must be [B, T] with 0 < T <= block_size ",
                                                   config_.block_size, "; got ", ShapeString(s)));
  }
  const int64_t t = s[1];
  Variable in = ids;
  DT_RETURN_IF_ERROR(RunForwardPreHooks(in));
  DT_ASSIGN_OR_RETURN(Tensor pos, Positions(0, t, ids.value().device()));
  DT_ASSIGN_OR_RETURN(Variable tok_emb, wte_->Forward(in));                       // [B, T, C]
  DT_ASSIGN_OR_RETURN(Variable pos_emb, wpe_->Forward(Variable::Constant(pos)));  // [T, C]
  DT_ASSIGN_OR_RETURN(Variable x, dtensor::Add(tok_emb, pos_emb));
  for (int64_t i = 0; i < h_->size(); ++i) {
    DT_ASSIGN_OR_RETURN(x, static_cast<Block*>((*h_)[i])->Forward(x));
  }
  DT_ASSIGN_OR_RETURN(x, ln_f_->Forward(x));
  Output out;
  DT_ASSIGN_OR_RETURN(out.logits, lm_head_->Forward(x));  // tied to wte: [B, T, V]
  // The model's hooks see the logits as its output (FSDP's root casts them, e.g.).
  DT_RETURN_IF_ERROR(RunForwardHooks(out.logits));
  AttachBackwardPreHooks(out.logits);
  if (targets.defined()) {
    // Training reads the logits once for the loss and its gradient (CrossEntropyFused) and
    // keeps only the gradient; vocab-sharded logits (loss parallel) keep the sharded op.
    bool vocab_sharded = false;
    const Value& lv = out.logits.value();
    if (lv.is_dtensor()) {
      for (const Placement& p : lv.dtensor().placements()) {
        vocab_sharded = vocab_sharded || (p.is_shard() && (p.shard_dim() == lv.dim() - 1 || p.shard_dim() == -1));
      }
    }
    if (vocab_sharded) {
      DT_ASSIGN_OR_RETURN(out.loss, dtensor::CrossEntropy(out.logits, targets));
    } else {
      DT_ASSIGN_OR_RETURN(out.loss, dtensor::CrossEntropyFused(out.logits, targets, -100, loss_grad));
    }
  }
  return out;
}

absl::StatusOr<Variable> GPT::ForwardCached(const Variable& ids, KvCache& cache) {
  NoGradGuard no_grad;
  IntSpan s = ids.value().shape();
  if (s.size() != 2 || s[1] <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("[GPT::ForwardCached] ids must be [B, T_new] with T_new > 0; got ", ShapeString(s)));
  }
  if (cache.num_layers() != config_.n_layer) {
    return absl::InvalidArgumentError(absl::StrCat("[GPT::ForwardCached] the cache has ", cache.num_layers(),
                                                   " layers, the model ", config_.n_layer));
  }
  const int64_t past = cache.length(), t = s[1];
  const int64_t limit = std::min(config_.block_size, cache.max_len());
  if (past + t > limit) {
    return absl::OutOfRangeError(absl::StrCat("[GPT::ForwardCached] ", t, " new positions after ", past,
                                              " cached exceed the context of ", limit, " (block_size ",
                                              config_.block_size, ", cache max_len ", cache.max_len(), ")"));
  }
  Variable in = ids;
  DT_RETURN_IF_ERROR(RunForwardPreHooks(in));
  DT_ASSIGN_OR_RETURN(Tensor pos, Positions(past, t, ids.value().device()));
  DT_ASSIGN_OR_RETURN(Variable tok_emb, wte_->Forward(in));                       // [B, T, C]
  DT_ASSIGN_OR_RETURN(Variable pos_emb, wpe_->Forward(Variable::Constant(pos)));  // [T, C]
  DT_ASSIGN_OR_RETURN(Variable x, dtensor::Add(tok_emb, pos_emb));
  for (int64_t i = 0; i < h_->size(); ++i) {
    DT_ASSIGN_OR_RETURN(x, block(i)->ForwardCached(x, cache.layer(i), past));
  }
  DT_ASSIGN_OR_RETURN(x, ln_f_->Forward(x));
  DT_ASSIGN_OR_RETURN(Variable logits, lm_head_->Forward(x));  // [B, T, V]
  DT_RETURN_IF_ERROR(RunForwardHooks(logits));
  DT_RETURN_IF_ERROR(cache.Advance(t));
  return logits;
}

}  // namespace dtensor::nn
