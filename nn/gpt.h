// GPT: the GPT-2 architecture (learned position embeddings, pre-LN blocks, tanh-GELU MLP,
// LM head tied to the token embedding) with PyTorch/nanoGPT state_dict names.
//
//   GPTConfig cfg{.vocab_size = 256, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128};
//   GPT model(cfg);
//   DT_RETURN_IF_ERROR(model.InitWeights(/*seed=*/1337));          // GPT-2's init
//   DT_RETURN_IF_ERROR(DistributeModule(model, mesh));              // parameters Replicate
//   DT_ASSIGN_OR_RETURN(GPT::Output out, model.Forward(ids, targets));  // ids, targets [B, T]
//   DT_RETURN_IF_ERROR(Backward(out.loss));
//
// Generation with a KV cache (kv_cache.h): ForwardCached feeds new tokens only.
//   KvCache cache(model.config());
//   DT_ASSIGN_OR_RETURN(Variable logits, model.ForwardCached(prompt_ids, cache));  // [B, T, V]
//   DT_ASSIGN_OR_RETURN(logits, model.ForwardCached(next_ids, cache));            // [B, 1, V]
#ifndef DTENSOR_NN_GPT_H_
#define DTENSOR_NN_GPT_H_

#include <cstdint>
#include <vector>

#include "dtensor/nn/layers.h"

namespace dtensor::nn {

struct GPTConfig {
  int64_t vocab_size = 50257;
  int64_t block_size = 1024;  // max sequence length
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  double dropout = 0.0;
  uint64_t dropout_seed = 0;
  DType dtype = DType::kFloat32;
};

// Holds children named "0", "1", ... (torch.nn.ModuleList).
class ModuleList : public Module {
 public:
  template <typename M>
  M* Append(std::unique_ptr<M> m) {
    M* raw = RegisterModule(std::to_string(size_++), std::move(m));
    items_.push_back(raw);
    return raw;
  }
  int64_t size() const { return size_; }
  Module* operator[](int64_t i) { return items_[static_cast<size_t>(i)]; }

 private:
  int64_t size_ = 0;
  std::vector<Module*> items_;
};

class GPT : public Module {
 public:
  // InvalidArgument (from Create) for sizes that do not fit: n_embd % n_head != 0, etc.
  static absl::StatusOr<std::unique_ptr<GPT>> Create(const GPTConfig& config);
  explicit GPT(const GPTConfig& config);

  const GPTConfig& config() const { return config_; }
  // Transformer block i (transformer.h.<i>), 0 <= i < n_layer: what FSDP and TP wrap.
  Block* block(int64_t i) { return static_cast<Block*>((*h_)[i]); }
  // The LM head (lm_head): a Linear tied to transformer.wte.weight (no parameter of its own).
  Linear* lm_head() { return lm_head_; }
  int64_t NumParameters();

  // GPT-2's initialisation from `seed`: Linear and Embedding weights N(0, 0.02), residual
  // projections (c_proj) N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weights 1. Each
  // parameter's values depend only on (seed, name, element index), so every rank and every
  // sharding draws the same model.
  absl::Status InitWeights(uint64_t seed);

  struct Output {
    Variable logits;  // [B, T, V]
    Variable loss;    // 0-d mean cross-entropy (undefined without targets)
  };
  // ids, targets: int32/int64 [B, T] with T <= block_size. loss_grad: the gradient the loss
  // will be backpropagated with (1/K when K micro-batches' losses are scaled by 1/K): the
  // fused loss computes the logits' gradient for it in the forward, and the backward then
  // rescales nothing (any other gradient is still right, at one pass over the logits).
  absl::StatusOr<Output> Forward(const Variable& ids, const Variable& targets = Variable(), double loss_grad = 1.0);

  // Inference with a KV cache: ids int32/int64 [B, T_new] are the tokens at positions
  // [cache.length(), cache.length() + T_new); returns their logits [B, T_new, V] (laid out as
  // Forward's: under tensor parallelism vocab-sharded, FullTensor() gathers them) and advances
  // the cache by T_new. Each new query attends every cached position and the new ones up to
  // its own, so feeding a sequence in pieces gives Forward's logits for it (up to rounding).
  // Records no autograd graph; applies no dropout; runs the module hooks as Forward does (so
  // tensor parallelism works: each rank caches its own heads). No sliding window:
  // OutOfRange when the context would pass block_size or the cache's max_len (nothing is
  // written then); InvalidArgument for a bad shape or a cache of another layer count, batch
  // size or parallelism. Collective under tensor parallelism, like Forward.
  absl::StatusOr<Variable> ForwardCached(const Variable& ids, KvCache& cache);

 private:
  // Positions [start, start + t) on `device`, int64: a view of one arange(block_size) made
  // there on first use, so that a forward copies nothing from the host (on a GPU such a copy
  // would wait for the device).
  absl::StatusOr<Tensor> Positions(int64_t start, int64_t t, Device device);

  GPTConfig config_;
  Tensor positions_;  // int64 [block_size] on the device Positions was last asked for
  Module* transformer_;
  Embedding* wte_;
  Embedding* wpe_;
  ModuleList* h_;
  LayerNorm* ln_f_;
  Linear* lm_head_;
};

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_GPT_H_
