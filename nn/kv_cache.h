// KvCache: the keys and values a GPT has computed for the positions it has seen, so that
// generating one more token costs one position's forward instead of the whole context's.
//
//   nn::KvCache cache(model.config());                       // every layer empty, length 0
//   DT_ASSIGN_OR_RETURN(Variable logits, model.ForwardCached(prompt, cache));  // [B, T, V]
//   ... pick the next token from logits[:, -1] ...
//   DT_ASSIGN_OR_RETURN(logits, model.ForwardCached(next, cache));  // [B, 1, V], position T
//
// Per layer it holds K and V buffers [B, H_local, T_max, D] (B batch, H_local this rank's
// heads, T_max the longest context, D = C / H) and one length shared by all layers: positions
// [0, length()) are filled. The buffers are allocated by the first forward that writes them,
// in the dtype and on the device of that layer's keys; under tensor parallelism (heads sharded
// over ranks, nn/parallel/gpt_plan.h) each rank's cache holds only its own heads' keys and
// values, so it is the rank's piece of a [B, H, T_max, D] tensor, and the cache never
// communicates. A cache belongs to one model, one batch size and one parallelism: Reset() empties
// it for another prompt of the same batch size.
#ifndef DTENSOR_NN_KV_CACHE_H_
#define DTENSOR_NN_KV_CACHE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::nn {

struct GPTConfig;

class KvCache {
 public:
  // One layer's buffers: [B, H_local, T_max, D] each, undefined until first written.
  struct Layer {
    Tensor k;
    Tensor v;
    int64_t max_len = 0;  // T_max, the buffers' dim 2
  };

  // `max_len` positions per layer (0: the config's block_size; never more than it).
  explicit KvCache(const GPTConfig& config, int64_t max_len = 0);
  KvCache(int64_t n_layer, int64_t max_len);

  int64_t length() const { return length_; }    // positions cached (the next position's index)
  int64_t max_len() const { return max_len_; }  // T_max
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  Layer& layer(int64_t i) { return layers_[static_cast<size_t>(i)]; }
  // Bytes held by the buffers on this rank.
  int64_t nbytes() const;

  // Forgets every position (length 0); the buffers are kept for the next prompt.
  void Reset() { length_ = 0; }
  // Marks `n` more positions filled (GPT::ForwardCached, after every layer wrote them).
  // OutOfRange when that would pass max_len().
  absl::Status Advance(int64_t n);

 private:
  int64_t max_len_ = 0;
  int64_t length_ = 0;
  std::vector<Layer> layers_;
};

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_KV_CACHE_H_
