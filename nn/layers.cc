#include "dtensor/nn/layers.h"

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

RMSNorm::RMSNorm(int64_t c, double eps, DType dtype) : eps_(eps) {
  weight_ = RegisterParameter("weight", OnesOrUndefined({c}, dtype));
}

absl::StatusOr<Variable> RMSNorm::Forward(const Variable& x) {
  return WithHooks(x,
                   [&](const Variable& x) -> absl::StatusOr<Variable> { return dtensor::RmsNorm(x, *weight_, eps_); });
}

absl::StatusOr<Variable> Dropout::Forward(const Variable& x) {
  if (!training() || p_ == 0) return x;
  const uint64_t seed = seed_ * 0x9E3779B97F4A7C15ull + (calls_++);
  return dtensor::Dropout(x, p_, seed, true);
}

CausalSelfAttention::CausalSelfAttention(int64_t c, int64_t heads, double dropout, uint64_t seed)
    : c_(c), heads_(heads) {
  c_attn_ = RegisterModule("c_attn", std::make_unique<Linear>(c, 3 * c));
  c_proj_ = RegisterModule("c_proj", std::make_unique<Linear>(c, c));
  resid_dropout_ = RegisterModule("resid_dropout", std::make_unique<Dropout>(dropout, seed));
}

absl::StatusOr<Variable> CausalSelfAttention::Forward(const Variable& x) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    const int64_t b = x.value().shape()[0], t = x.value().shape()[1], d = c_ / heads_;
    std::vector<Variable> parts;  // q, k, v: [B, T, C]
    const Variable& w = *c_attn_->weight();
    if (w.value().dim() == 3) {
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
    DT_ASSIGN_OR_RETURN(Variable y, dtensor::CausalAttention(heads[0], heads[1], heads[2]));  // [B, H, T, D]
    DT_ASSIGN_OR_RETURN(y, dtensor::Transpose(y, 1, 2));                                      // [B, T, H, D]
    DT_ASSIGN_OR_RETURN(y, dtensor::Reshape(y, {b, t, c_}));
    DT_ASSIGN_OR_RETURN(y, c_proj_->Forward(y));
    return resid_dropout_->Forward(y);
  });
}

MLP::MLP(int64_t c, double dropout, uint64_t seed) {
  c_fc_ = RegisterModule("c_fc", std::make_unique<Linear>(c, 4 * c));
  c_proj_ = RegisterModule("c_proj", std::make_unique<Linear>(4 * c, c));
  dropout_ = RegisterModule("dropout", std::make_unique<Dropout>(dropout, seed));
}

absl::StatusOr<Variable> MLP::Forward(const Variable& x) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    DT_ASSIGN_OR_RETURN(Variable h, c_fc_->Forward(x));  // [B, T, 4C]
    DT_ASSIGN_OR_RETURN(h, dtensor::Gelu(h));
    DT_ASSIGN_OR_RETURN(h, c_proj_->Forward(h));  // [B, T, C]
    return dropout_->Forward(h);
  });
}

Block::Block(int64_t c, int64_t heads, double dropout, uint64_t seed) {
  ln_1_ = RegisterModule("ln_1", std::make_unique<LayerNorm>(c));
  attn_ = RegisterModule("attn", std::make_unique<CausalSelfAttention>(c, heads, dropout, seed * 2 + 1));
  ln_2_ = RegisterModule("ln_2", std::make_unique<LayerNorm>(c));
  mlp_ = RegisterModule("mlp", std::make_unique<MLP>(c, dropout, seed * 2 + 2));
}

absl::StatusOr<Variable> Block::Forward(const Variable& x) {
  return WithHooks(x, [&](const Variable& x) -> absl::StatusOr<Variable> {
    DT_ASSIGN_OR_RETURN(Variable h, ln_1_->Forward(x));
    DT_ASSIGN_OR_RETURN(h, attn_->Forward(h));
    DT_ASSIGN_OR_RETURN(Variable x1, dtensor::Add(x, h));
    DT_ASSIGN_OR_RETURN(h, ln_2_->Forward(x1));
    DT_ASSIGN_OR_RETURN(h, mlp_->Forward(h));
    return dtensor::Add(x1, h);
  });
}

}  // namespace dtensor::nn
