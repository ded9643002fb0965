// Embedding lookup and its scatter-add backward (CPU).
//
// Legend: weight, dweight [V, C]; ids [N] int32/int64; out, dout [N, C]; all contiguous.
// The forward copies rows (any dtype, by bytes). The backward is deterministic without atomics:
// threads own disjoint column blocks and each walks the ids in order, so repeated ids are summed
// in the same order whatever the thread count.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// Columns per backward work item.
constexpr int64_t kColBlock = 64;

template <typename F>
absl::Status VisitIndex(const char* op, DType t, F&& f) {
  switch (t) {
    case DType::kInt32:
      return f(int32_t{});
    case DType::kInt64:
      return f(int64_t{});
    default:
      return InvalidArg(op, "ids must be int32 or int64, got ", DTypeName(t));
  }
}

// dweight[ids[n], c0:c1] += dout[n, c0:c1] for every n, in order of n.
template <typename W, typename G, typename I>
void ScatterAddColumns(const G* dout, const I* ids, int64_t n, int64_t v, int64_t c, int64_t c0, int64_t c1,
                       W* dweight) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= v) continue;
    W* dst = dweight + id * c;
    const G* src = dout + i * c;
    if constexpr (std::is_same_v<W, float> && std::is_same_v<G, float>) {
#pragma omp simd
      for (int64_t j = c0; j < c1; ++j) dst[j] += src[j];
    } else {
      for (int64_t j = c0; j < c1; ++j) dst[j] = FromFloat<W>(ToFloat(dst[j]) + ToFloat(src[j]));
    }
  }
}

}  // namespace

absl::Status CpuBackend::Embedding(const Tensor& weight, const Tensor& ids, const Tensor& out) {
  const int64_t n = ids.numel();
  const int64_t v = weight.size(0);
  const int64_t c = weight.size(-1);
  return VisitIndex("Embedding", ids.dtype(), [&](auto tag) -> absl::Status {
    using I = decltype(tag);
    const I* idp = ids.data<I>();  // [N]
    for (int64_t i = 0; i < n; ++i) {
      if (idp[i] < 0 || static_cast<int64_t>(idp[i]) >= v) {
        return InvalidArg("Embedding", "id ", static_cast<int64_t>(idp[i]), " at position ", i, " is outside [0, ", v,
                          ")");
      }
    }
    if (n == 0 || c == 0) return absl::OkStatus();
    const size_t row_bytes = static_cast<size_t>(c) * ElementSize(weight.dtype());
    const char* wp = static_cast<const char*>(weight.raw_data());  // [V, C]
    char* op = static_cast<char*>(out.raw_data());                 // [N, C]
#pragma omp parallel for schedule(static) if (n * c >= kParallelGrain)
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(op + static_cast<size_t>(i) * row_bytes, wp + static_cast<size_t>(idp[i]) * row_bytes, row_bytes);
    }
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::EmbeddingBackward(const Tensor& dout, const Tensor& ids, const Tensor& dweight) {
  const int64_t n = ids.numel();
  const int64_t v = dweight.size(0);
  const int64_t c = dweight.size(-1);
  if (n == 0 || c == 0) return absl::OkStatus();
  const int64_t nblocks = (c + kColBlock - 1) / kColBlock;
  return VisitIndex("EmbeddingBackward", ids.dtype(), [&](auto itag) {
    using I = decltype(itag);
    return DispatchFloat("EmbeddingBackward", dweight.dtype(), [&](auto wtag) {
      using W = decltype(wtag);
      return DispatchFloat("EmbeddingBackward", dout.dtype(), [&](auto gtag) {
        using G = decltype(gtag);
        const G* dop = dout.data<G>();  // [N, C]
        const I* idp = ids.data<I>();   // [N]
        W* dwp = dweight.data<W>();     // [V, C]
#pragma omp parallel for schedule(static) if (n * c >= kParallelGrain)
        for (int64_t b = 0; b < nblocks; ++b) {
          ScatterAddColumns(dop, idp, n, v, c, b * kColBlock, std::min(c, (b + 1) * kColBlock), dwp);
        }
        return absl::OkStatus();
      });
    });
  });
}

}  // namespace dtensor::internal
