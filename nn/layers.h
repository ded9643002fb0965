// The layers of a GPT: Linear, Embedding, LayerNorm, RMSNorm, GELU, Dropout,
// CausalSelfAttention, MLP and Block. Shapes use llm.c's legend: B batch, T time, C channels,
// H heads, D = C / H.
//
//   Linear fc(768, 3072);                         // weight [3072, 768], bias [3072]
//   DT_ASSIGN_OR_RETURN(Variable h, fc.Forward(x));
//
// Parameters start as zeros (LayerNorm weights as ones); GPT::InitWeights gives GPT-2's init.
// Every Forward works on Variables of plain Tensors or DTensors of any layout. ForwardCached
// (CausalSelfAttention, Block) is inference with a KV cache (kv_cache.h): see GPT::ForwardCached.
#ifndef DTENSOR_NN_LAYERS_H_
#define DTENSOR_NN_LAYERS_H_

#include <cstdint>
#include <vector>

#include "dtensor/autograd/ops.h"
#include "dtensor/nn/kv_cache.h"
#include "dtensor/nn/module.h"

namespace dtensor::nn {

class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, bool bias = true, DType dtype = DType::kFloat32);
  // A bias-free Linear whose weight is another module's parameter (a tied LM head: GPT's
  // lm_head uses transformer.wte.weight, listed under that first name).
  explicit Linear(Variable* tied_weight);
  absl::StatusOr<Variable> Forward(const Variable& x);  // [..., in] -> [..., out]
  // Gelu(Forward(x)), with the bias and GELU applied by the matrix multiply (LinearGelu) when
  // the layer has a bias. The layer's hooks see x and the activated output.
  absl::StatusOr<Variable> ForwardGelu(const Variable& x);
  Variable* weight() { return weight_; }  // [out, in]
  Variable* bias() { return bias_; }      // [out] or nullptr

 private:
  Variable* weight_;
  Variable* bias_ = nullptr;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num, int64_t dim, DType dtype = DType::kFloat32);
  absl::StatusOr<Variable> Forward(const Variable& ids);  // int [...] -> [..., dim]
  Variable* weight() { return weight_; }                  // [num, dim]

 private:
  Variable* weight_;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t c, double eps = 1e-5, DType dtype = DType::kFloat32);
  absl::StatusOr<Variable> Forward(const Variable& x);
  // residual = x + h and y = Forward(residual) (a block's residual add and the norm after it).
  // Without hooks on this module: one fused op (dtensor::AddLayerNorm), the same values and
  // gradients. With any (has_hooks(): tensor parallelism's SequenceParallel, FSDP, a wrapper):
  // Add, then Forward, so that the hooks see the sum as this module's input.
  absl::StatusOr<ResidualNorm> ForwardAddResidual(const Variable& x, const Variable& h);

 private:
  Variable* weight_;
  Variable* bias_;
  double eps_;
};

class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t c, double eps = 1e-6, DType dtype = DType::kFloat32);
  absl::StatusOr<Variable> Forward(const Variable& x);

 private:
  Variable* weight_;
  double eps_;
};

class GELU : public Module {
 public:
  absl::StatusOr<Variable> Forward(const Variable& x) { return dtensor::Gelu(x); }  // tanh approximation
};

// Inverted dropout; each call draws a new mask from (seed, call count), the same on every rank
// and for every sharding.
class Dropout : public Module {
 public:
  Dropout(double p, uint64_t seed) : p_(p), seed_(seed) {}
  absl::StatusOr<Variable> Forward(const Variable& x);
  // The call count that picks the next mask (activation checkpointing saves it and puts it
  // back, so that a recomputed forward draws the same masks).
  uint64_t calls() const { return calls_; }
  void set_calls(uint64_t calls) { calls_ = calls; }

 private:
  double p_;
  uint64_t seed_;
  uint64_t calls_ = 0;
};

class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(int64_t c, int64_t heads, double dropout = 0, uint64_t seed = 0, DType dtype = DType::kFloat32);
  absl::StatusOr<Variable> Forward(const Variable& x);  // [B, T, C] -> [B, T, C]
  // Inference on x [B, T_new, C] at positions [past, past + T_new): writes the new keys and
  // values into `kv` (this rank's heads) at those positions, and attends each new query over
  // the cached positions up to its own (the causal mask). No dropout; records no graph. The
  // heads may be sharded (tensor parallelism) or the batch; any other layout of q, k, v is
  // redistributed to one of those first.
  absl::StatusOr<Variable> ForwardCached(const Variable& x, KvCache::Layer& kv, int64_t past);
  int64_t heads() const { return heads_; }

 private:
  // q, k, v of x [B, T, C], each [B, H, T, D].
  absl::StatusOr<std::vector<Variable>> QkvHeads(const Variable& x);
  int64_t c_, heads_;
  Linear* c_attn_;  // [3C, C]: q, k, v in that order
  Linear* c_proj_;
  Dropout* resid_dropout_;
};

class MLP : public Module {
 public:
  MLP(int64_t c, double dropout = 0, uint64_t seed = 0, DType dtype = DType::kFloat32);
  // c_proj(gelu(c_fc(x))), then dropout. As one op (MlpGelu) when neither Linear has hooks
  // (Module::has_hooks) and both have biases; otherwise through the Linears' own Forwards.
  absl::StatusOr<Variable> Forward(const Variable& x);

 private:
  Linear* c_fc_;
  Linear* c_proj_;
  Dropout* dropout_;
};

// Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
class Block : public Module {
 public:
  Block(int64_t c, int64_t heads, double dropout = 0, uint64_t seed = 0, DType dtype = DType::kFloat32);
  absl::StatusOr<Variable> Forward(const Variable& x);
  // Forward with the attention reading and extending `kv` (CausalSelfAttention::ForwardCached).
  absl::StatusOr<Variable> ForwardCached(const Variable& x, KvCache::Layer& kv, int64_t past);

 private:
  LayerNorm* ln_1_;
  CausalSelfAttention* attn_;
  LayerNorm* ln_2_;
  MLP* mlp_;
};

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_LAYERS_H_
