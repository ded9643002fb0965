#include "dtensor/nn/kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "dtensor/nn/gpt.h"

namespace dtensor::nn {

KvCache::KvCache(const GPTConfig& config, int64_t max_len)
    : KvCache(config.n_layer, max_len <= 0 ? config.block_size : std::min(max_len, config.block_size)) {}

KvCache::KvCache(int64_t n_layer, int64_t max_len)
    : max_len_(std::max<int64_t>(0, max_len)), layers_(static_cast<size_t>(std::max<int64_t>(0, n_layer))) {
  for (Layer& l : layers_) l.max_len = max_len_;
}

int64_t KvCache::nbytes() const {
  int64_t n = 0;
  for (const Layer& l : layers_) {
    if (l.k.defined()) n += static_cast<int64_t>(l.k.nbytes() + l.v.nbytes());
  }
  return n;
}

absl::Status KvCache::Advance(int64_t n) {
  if (n < 0 || length_ + n > max_len_) {
    return absl::OutOfRangeError(
        absl::StrCat("[KvCache] ", n, " more positions after ", length_, " exceed its ", max_len_, " positions"));
  }
  length_ += n;
  return absl::OkStatus();
}

}  // namespace dtensor::nn
