#include "dtensor/nn/layers.h"

#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {
namespace {

// A constructor cannot return an error: bad sizes leave the parameter undefined, and the first
// Forward reports it (the dispatcher refuses undefined inputs).
Tensor ZerosOrUndefined(IntSpan shape, DType dtype) {
  auto t = Zeros(shape, dtype);
  return t.ok() ? *t : Tensor();
}
Tensor OnesOrUndefined(IntSpan shape, DType dtype) {
  auto t = Ones(shape, dtype);
  return t.ok() ? *t : Tensor();
}

// Whether each rank can attend its own piece of q, k, v [B, H, T, D] laid out as `l`: every
// mesh dim replicates them or shards the batch or the heads.
bool AttendsLocally(const Layout& l) {
  for (const Placement& p : l.placements()) {
    if (!p.is_replicate() && !(p.is_shard() && p.shard_dim() <= 1)) return false;
  }
  return true;
}

// `l` with every placement that AttendsLocally refuses made Replicate.
Layout LocalAttentionLayout(const Layout& l) {
  Layout out = l;
  for (int i = 0; i < l.ndim(); ++i) {
    const Placement& p = l.placements()[static_cast<size_t>(i)];
    if (!p.is_replicate() && !(p.is_shard() && p.shard_dim() <= 1)) out = out.WithPlacement(i, Replicate());
  }
  return out;
}

// Local attention with a cache: q, k, v [B, H, T_new, D] at positions [past, past + T_new);
// k and v are first written into kv's buffers (allocated [B, H, max_len, D] on first use), then
// each query attends the cached positions up to its own. With nothing cached before, this is
// the training kernel on q, k, v itself; else scores over the cache, -inf above the diagonal
// (T_new > 1: a prompt fed in pieces), softmax, weighted values, computed in float32.
absl::StatusOr<Tensor> CachedAttention(const Tensor& q, const Tensor& k, const Tensor& v, KvCache::Layer& kv,
                                       int64_t past) {
  const int64_t b = q.size(0), h = q.size(1), tn = q.size(2), d = q.size(3);
  if (!kv.k.defined()) {
    DT_ASSIGN_OR_RETURN(kv.k, Zeros({b, h, kv.max_len, d}, k.dtype(), k.device()));
    DT_ASSIGN_OR_RETURN(kv.v, Zeros({b, h, kv.max_len, d}, v.dtype(), v.device()));
  }
  if (kv.k.size(0) != b || kv.k.size(1) != h || kv.k.size(3) != d || kv.k.dtype() != k.dtype() ||
      kv.k.device() != k.device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "[KvCache] keys ", ShapeString(k.shape()), " ", DTypeName(k.dtype()), " on ", k.device().ToString(),
        " do not fit the cache's buffers ", ShapeString(kv.k.shape()), " ", DTypeName(kv.k.dtype()), " on ",
        kv.k.device().ToString(), " (another batch size or parallelism: use a new cache)"));
  }
  if (past < 0 || past + tn > kv.k.size(2)) {
    return absl::OutOfRangeError(absl::StrCat("[KvCache] positions [", past, ", ", past + tn,
                                              ") do not fit the cache's ", kv.k.size(2), " positions"));
  }
  DT_ASSIGN_OR_RETURN(Tensor k_new, kv.k.Narrow(2, past, tn));
  DT_ASSIGN_OR_RETURN(Tensor v_new, kv.v.Narrow(2, past, tn));
  DT_RETURN_IF_ERROR(Copy_(k_new, k));
  DT_RETURN_IF_ERROR(Copy_(v_new, v));
  if (past == 0) {
    DT_ASSIGN_OR_RETURN(AttentionOutput o, CausalAttention(q, k, v));
    return o.out;
  }
  const int64_t len = past + tn;
  DT_ASSIGN_OR_RETURN(Tensor k_all, kv.k.Narrow(2, 0, len));  // [B, H, len, D]
  DT_ASSIGN_OR_RETURN(Tensor v_all, kv.v.Narrow(2, 0, len));
  DT_ASSIGN_OR_RETURN(Tensor q32, Cast(q, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(k_all, Cast(k_all, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(v_all, Cast(v_all, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(Tensor s, Matmul(q32, k_all, false, true));  // [B, H, T_new, len]
  DT_RETURN_IF_ERROR(Scale_(s, 1.0 / std::sqrt(static_cast<double>(d))));
  if (tn > 1) {  // query i sits at position past + i: keys after it are masked
    std::vector<float> mask(static_cast<size_t>(tn * len), 0.0f);
    for (int64_t i = 0; i < tn; ++i) {
      for (int64_t j = past + i + 1; j < len; ++j) {
        mask[static_cast<size_t>(i * len + j)] = -std::numeric_limits<float>::infinity();
      }
    }
    DT_ASSIGN_OR_RETURN(Tensor m, Tensor::FromVector<float>(mask, {tn, len}));
    DT_ASSIGN_OR_RETURN(m, To(m, s.device()));
    DT_RETURN_IF_ERROR(Add_(s, m));
  }
  DT_ASSIGN_OR_RETURN(Tensor p, Softmax(s, -1));
  DT_ASSIGN_OR_RETURN(Tensor y, Matmul(p, v_all));  // [B, H, T_new, D]
  return Cast(y, q.dtype());
}

}  // namespace

Linear::Linear(int64_t in, int64_t out, bool bias, DType dtype) {
  weight_ = RegisterParameter("weight", ZerosOrUndefined({out, in}, dtype));
  if (bias) bias_ = RegisterParameter("bias", ZerosOrUndefined({out}, dtype));
}

Linear::Linear(Variable* tied_weight) { weight_ = RegisterSharedParameter("weight", tied_weight); }

absl::StatusOr<Variable> Linear::Forward(const Variable& x) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    return dtensor::Linear(x, *weight_, bias_ ? *bias_ : Variable());
  });
}

absl::StatusOr<Variable> Linear::ForwardGelu(const Variable& x) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    if (bias_ == nullptr) {
      DT_ASSIGN_OR_RETURN(Variable y, dtensor::Linear(x, *weight_));
      return dtensor::Gelu(y);
    }
    return dtensor::LinearGelu(x, *weight_, *bias_);
  });
}

Embedding::Embedding(int64_t num, int64_t dim, DType dtype) {
  weight_ = RegisterParameter("weight", ZerosOrUndefined({num, dim}, dtype));
}

absl::StatusOr<Variable> Embedding::Forward(const Variable& ids) {
  return WithHooks(ids,
                   [&](const Variable& ids) -> absl::StatusOr<Variable> { return dtensor::Embedding(*weight_, ids); });
}

LayerNorm::LayerNorm(int64_t c, double eps, DType dtype) : eps_(eps) {
  weight_ = RegisterParameter("weight", OnesOrUndefined({c}, dtype));
  bias_ = RegisterParameter("bias", ZerosOrUndefined({c}, dtype));
}

absl::StatusOr<Variable> LayerNorm::Forward(const Variable& x) {
  return WithHooks(
      x, [&](const Variable& x) -> absl::StatusOr<Variable> { return dtensor::LayerNorm(x, *weight_, *bias_, eps_); });
}

absl::StatusOr<ResidualNorm> LayerNorm::ForwardAddResidual(const Variable& x, const Variable& h) {
  if (!has_hooks()) return dtensor::AddLayerNorm(x, h, *weight_, *bias_, eps_);
  ResidualNorm r;
  DT_ASSIGN_OR_RETURN(r.residual, dtensor::Add(x, h));
  DT_ASSIGN_OR_RETURN(r.y, Forward(r.residual));
  return r;
}

RMSNorm::RMSNorm(int64_t c, double eps, DType dtype) : eps_(eps) {
  weight_ = RegisterParameter("weight", OnesOrUndefined({c}, dtype));
}

absl::StatusOr<Variable> RMSNorm::Forward(const Variable& x) {
  return WithHooks(x,
                   [&](const Variable& x) -> absl::StatusOr<Variable> { return dtensor::RmsNorm(x, *weight_, eps_); });
}

absl::StatusOr<Variable> Dropout::Forward(const Variable& x) {
  // Through the hooks also in eval and at p = 0 (a style's layouts apply either way).
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    if (!training() || p_ == 0) return x;
    const uint64_t seed = seed_ * 0x9E3779B97F4A7C15ull + (calls_++);
    return dtensor::Dropout(x, p_, seed, true);
  });
}

CausalSelfAttention::CausalSelfAttention(int64_t c, int64_t heads, double dropout, uint64_t seed, DType dtype)
    : c_(c), heads_(heads) {
  c_attn_ = RegisterModule("c_attn", std::make_unique<Linear>(c, 3 * c, true, dtype));
  c_proj_ = RegisterModule("c_proj", std::make_unique<Linear>(c, c, true, dtype));
  resid_dropout_ = RegisterModule("resid_dropout", std::make_unique<Dropout>(dropout, seed));
}

absl::StatusOr<std::vector<Variable>> CausalSelfAttention::QkvHeads(const Variable& x) {
  const int64_t b = x.value().shape()[0], t = x.value().shape()[1], d = c_ / heads_;
  std::vector<Variable> parts;  // q, k, v: [B, T, C]
  const Variable& w = *c_attn_->weight();
  if (w.value().dim() == 3) {
    if (c_attn_->has_hooks()) {
      return absl::FailedPreconditionError(
          "[CausalSelfAttention] c_attn is viewed as stacked q, k, v (tensor parallelism's fused=3), which the "
          "attention projects itself: hooks on c_attn (FullyShard, a wrapper, a style) would not run; put them on "
          "the attention module");
    }
    // The projection stacked as [3, C, C] (bias [3, C]): the same values as GPT-2's fused
    // [3C, C], laid out so that each of q, k and v can be split on its own (tensor
    // parallelism shards dim 1: each rank holds q, k and v of its heads; nn/parallel/).
    for (int64_t j = 0; j < 3; ++j) {
      DT_ASSIGN_OR_RETURN(Variable wj, dtensor::Narrow(w, 0, j, 1));
      DT_ASSIGN_OR_RETURN(wj, dtensor::Reshape(wj, {c_, c_}));
      DT_ASSIGN_OR_RETURN(Variable bj, dtensor::Narrow(*c_attn_->bias(), 0, j, 1));
      DT_ASSIGN_OR_RETURN(bj, dtensor::Reshape(bj, {c_}));
      DT_ASSIGN_OR_RETURN(Variable p, dtensor::Linear(x, wj, bj));
      parts.push_back(std::move(p));
    }
  } else {
    DT_ASSIGN_OR_RETURN(Variable qkv, c_attn_->Forward(x));  // [B, T, 3C]
    DT_ASSIGN_OR_RETURN(parts, dtensor::Split(qkv, c_, 2));
  }
  std::vector<Variable> heads;
  for (Variable& p : parts) {  // [B, T, C] -> [B, T, H, D] -> [B, H, T, D]
    DT_ASSIGN_OR_RETURN(Variable r, dtensor::Reshape(p, {b, t, heads_, d}));
    DT_ASSIGN_OR_RETURN(Variable h, dtensor::Transpose(r, 1, 2));
    heads.push_back(std::move(h));
  }
  return heads;
}

absl::StatusOr<Variable> CausalSelfAttention::Forward(const Variable& x) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    const int64_t b = x.value().shape()[0], t = x.value().shape()[1];
    DT_ASSIGN_OR_RETURN(std::vector<Variable> heads, QkvHeads(x));
    // y [B, H, T, D] lies as [B, T, H, D] (ops.h: results take the heads' layout), so merging
    // the heads back is a view, and in the backward the gradients of q, k, v are one [B, T, 3C]
    // buffer: Split's backward takes it as it is.
    DT_ASSIGN_OR_RETURN(Variable y, dtensor::CausalAttention(heads[0], heads[1], heads[2]));
    DT_ASSIGN_OR_RETURN(y, dtensor::Transpose(y, 1, 2));  // [B, T, H, D]
    DT_ASSIGN_OR_RETURN(y, dtensor::Reshape(y, {b, t, c_}));
    DT_ASSIGN_OR_RETURN(y, c_proj_->Forward(y));
    return resid_dropout_->Forward(y);
  });
}

absl::StatusOr<Variable> CausalSelfAttention::ForwardCached(const Variable& x, KvCache::Layer& kv, int64_t past) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    NoGradGuard no_grad;
    const int64_t b = x.value().shape()[0], t = x.value().shape()[1];
    DT_ASSIGN_OR_RETURN(std::vector<Variable> heads, QkvHeads(x));  // [B, H, T_new, D]
    // Each rank attends its own pieces: q, k, v sharded over batch or heads (or whole).
    std::vector<Value> qkv;
    for (const Variable& h : heads) {
      Value v = h.value();
      if (v.is_dtensor() && !AttendsLocally(v.dtensor().layout())) {
        DT_ASSIGN_OR_RETURN(DTensor r, v.dtensor().Redistribute(LocalAttentionLayout(v.dtensor().layout())));
        v = r;
      }
      qkv.push_back(std::move(v));
    }
    DT_ASSIGN_OR_RETURN(Tensor y_local,
                        CachedAttention(qkv[0].local(), qkv[1].local(), qkv[2].local(), kv, past));  // [B, H, T, D]
    Value y_value = y_local;
    if (qkv[0].is_dtensor()) {
      const DTensor& q = qkv[0].dtensor();
      y_value = DTensor::WrapTrusted(y_local, q.mesh(), q.layout(), Shape(q.shape().begin(), q.shape().end()));
    }
    Variable y = Variable::Constant(y_value);
    DT_ASSIGN_OR_RETURN(y, dtensor::Transpose(y, 1, 2));  // [B, T, H, D]
    DT_ASSIGN_OR_RETURN(y, dtensor::Reshape(y, {b, t, c_}));
    return c_proj_->Forward(y);  // no dropout: inference
  });
}

MLP::MLP(int64_t c, double dropout, uint64_t seed, DType dtype) {
  c_fc_ = RegisterModule("c_fc", std::make_unique<Linear>(c, 4 * c, true, dtype));
  c_proj_ = RegisterModule("c_proj", std::make_unique<Linear>(4 * c, c, true, dtype));
  dropout_ = RegisterModule("dropout", std::make_unique<Dropout>(dropout, seed));
}

absl::StatusOr<Variable> MLP::Forward(const Variable& x) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    // One op (MlpGelu: the GELU backward and the bias gradients inside the matrix multiplies)
    // when nothing runs around c_fc or c_proj (tensor parallelism's layouts are their hooks).
    if (!c_fc_->has_hooks() && !c_proj_->has_hooks() && c_fc_->bias() != nullptr && c_proj_->bias() != nullptr) {
      DT_ASSIGN_OR_RETURN(Variable y, dtensor::MlpGelu(x, *c_fc_->weight(), *c_fc_->bias(), *c_proj_->weight(),
                                                       *c_proj_->bias()));  // [B, T, C]
      return dropout_->Forward(y);
    }
    DT_ASSIGN_OR_RETURN(Variable h, c_fc_->ForwardGelu(x));  // [B, T, 4C], through GELU
    DT_ASSIGN_OR_RETURN(h, c_proj_->Forward(h));             // [B, T, C]
    return dropout_->Forward(h);
  });
}

Block::Block(int64_t c, int64_t heads, double dropout, uint64_t seed, DType dtype) {
  ln_1_ = RegisterModule("ln_1", std::make_unique<LayerNorm>(c, 1e-5, dtype));
  attn_ = RegisterModule("attn", std::make_unique<CausalSelfAttention>(c, heads, dropout, seed * 2 + 1, dtype));
  ln_2_ = RegisterModule("ln_2", std::make_unique<LayerNorm>(c, 1e-5, dtype));
  mlp_ = RegisterModule("mlp", std::make_unique<MLP>(c, dropout, seed * 2 + 2, dtype));
}

absl::StatusOr<Variable> Block::ForwardCached(const Variable& x, KvCache::Layer& kv, int64_t past) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    DT_ASSIGN_OR_RETURN(Variable h, ln_1_->Forward(x));
    DT_ASSIGN_OR_RETURN(h, attn_->ForwardCached(h, kv, past));
    DT_ASSIGN_OR_RETURN(ResidualNorm x1, ln_2_->ForwardAddResidual(x, h));  // x + h and ln_2 of it
    DT_ASSIGN_OR_RETURN(h, mlp_->Forward(x1.y));
    return dtensor::Add(x1.residual, h);
  });
}

absl::StatusOr<Variable> Block::Forward(const Variable& x) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    DT_ASSIGN_OR_RETURN(Variable h, ln_1_->Forward(x));
    DT_ASSIGN_OR_RETURN(h, attn_->Forward(h));
    DT_ASSIGN_OR_RETURN(ResidualNorm x1, ln_2_->ForwardAddResidual(x, h));  // x + h and ln_2 of it
    DT_ASSIGN_OR_RETURN(h, mlp_->Forward(x1.y));
    return dtensor::Add(x1.residual, h);
  });
}

}  // namespace dtensor::nn
