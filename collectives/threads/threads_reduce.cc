#include "dtensor/collectives/threads/threads_reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dtensor/collectives/cpu_primitives.h"
#include "dtensor/tensor/dtype.h"

namespace dtensor::internal {
namespace {

// Reductions: out[i] = in_0[i] (op) in_1[i] (op) ... in rank order, so every rank that reads a
// block gets the same bits. Every element is loaded from every source before it is stored,
// which makes dst == one of the sources (in place) safe.
//
// A left fold fused so that two to four sources take one pass, and more take one pass each
// through a cache-resident accumulator whose first pass combines two sources and whose last
// stores. (Four sources through the accumulator, 2 KiB of each at a time, kept the memory
// streams from ramping up: 4 ranks on 2 cores, reduce_scatter 4 MiB 380-450 against 197 us
// fused, 64 MiB 12.7-12.9 against 8.1-8.4 ms, 0.78x ucx before.)
// (The earlier loop copied the first source into the accumulator, which GCC made a `rep movsq`
// per 2 KiB chunk: two threads reducing 128 KiB each from two sources took 32 us against 14 us
// fused, 1 MiB of inputs 151-160 against 45-57 us, on this 2-core AMD EPYC VM.)

constexpr int64_t kChunk = 512;

template <typename T, typename A, typename Load, typename Combine, typename Store>
void ReduceChunks(absl::Span<const char* const> srcs, int64_t begin, int64_t n, char* dst, Load load, Combine combine,
                  Store store) {
  T* d = reinterpret_cast<T*>(dst);
  auto src = [&](size_t j) { return reinterpret_cast<const T*>(srcs[j]) + begin; };
  const T* s0 = src(0);
  if (srcs.size() == 1) {
    for (int64_t i = 0; i < n; ++i) d[i] = store(load(s0[i]));
    return;
  }
  const T* s1 = src(1);
  // Two to four sources in one pass, 8 elements folded before any is stored
  // (StoreFoldsInBlocksOf8): the plain loop moved 16 bytes per iteration and reloaded the
  // destination pointer from the stack in each (2 ranks, reduce_scatter 64 KiB 1.88 -> 1.59 us,
  // 256 KiB 6.3-6.5 -> 5.0-5.7, 1 MiB 24.4-31 -> 20.9-22.4).
  auto fused = [&](auto fold) {
    const void* from[4] = {s0, s1, srcs.size() > 2 ? src(2) : s0, srcs.size() > 3 ? src(3) : s0};
    StoreFoldsInBlocksOf8<A>(d, from, srcs.size(), n, fold, store);
  };
  if (srcs.size() == 2) {
    fused([&](int64_t i) { return combine(load(s0[i]), load(s1[i])); });
    return;
  }
  const T* s2 = src(2);
  if (srcs.size() == 3) {
    fused([&](int64_t i) { return combine(combine(load(s0[i]), load(s1[i])), load(s2[i])); });
    return;
  }
  if (srcs.size() == 4) {
    const T* s3 = src(3);
    fused([&](int64_t i) { return combine(combine(combine(load(s0[i]), load(s1[i])), load(s2[i])), load(s3[i])); });
    return;
  }
  A acc[kChunk];
  const T* last = src(srcs.size() - 1);
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t m = std::min(kChunk, n - c);
    for (int64_t i = 0; i < m; ++i) acc[i] = combine(load(s0[c + i]), load(s1[c + i]));
    for (size_t j = 2; j + 1 < srcs.size(); ++j) {
      const T* s = src(j) + c;
      for (int64_t i = 0; i < m; ++i) acc[i] = combine(acc[i], load(s[i]));
    }
    for (int64_t i = 0; i < m; ++i) d[c + i] = store(combine(acc[i], load(last[c + i])));
  }
}

template <typename T>
void ReduceFloat(CommReduceOp op, absl::Span<const char* const> srcs, int64_t begin, int64_t n, char* dst) {
  auto load = [](T v) { return static_cast<float>(v); };
  auto store = [](float v) { return T(v); };
  switch (op) {
    case CommReduceOp::kSum:
      ReduceChunks<T, float>(
          srcs, begin, n, dst, load, [](float a, float b) { return a + b; }, store);
      return;
    case CommReduceOp::kAvg: {
      const float size = static_cast<float>(srcs.size());
      ReduceChunks<T, float>(
          srcs, begin, n, dst, load, [](float a, float b) { return a + b; }, [&](float v) { return T(v / size); });
      return;
    }
    case CommReduceOp::kMax:  // NaN wins, as torch.maximum
      ReduceChunks<T, float>(
          srcs, begin, n, dst, load, [](float a, float b) { return (std::isnan(a) || a > b) ? a : b; }, store);
      return;
    case CommReduceOp::kMin:
      ReduceChunks<T, float>(
          srcs, begin, n, dst, load, [](float a, float b) { return (std::isnan(a) || a < b) ? a : b; }, store);
      return;
    case CommReduceOp::kProduct:
      ReduceChunks<T, float>(
          srcs, begin, n, dst, load, [](float a, float b) { return a * b; }, store);
      return;
  }
}

// Integers: sums and products wrap (computed in uint64, then truncated to T), avg divides the
// wrapped sum and truncates (as the ucx backend and NCCL, which sum in T).
template <typename T>
void ReduceInt(CommReduceOp op, absl::Span<const char* const> srcs, int64_t begin, int64_t n, char* dst) {
  auto load_u = [](T v) { return static_cast<uint64_t>(static_cast<int64_t>(v)); };
  auto store_u = [](uint64_t v) { return static_cast<T>(static_cast<int64_t>(v)); };
  auto load_s = [](T v) { return static_cast<int64_t>(v); };
  auto store_s = [](int64_t v) { return static_cast<T>(v); };
  switch (op) {
    case CommReduceOp::kSum:
      ReduceChunks<T, uint64_t>(
          srcs, begin, n, dst, load_u, [](uint64_t a, uint64_t b) { return a + b; }, store_u);
      return;
    case CommReduceOp::kAvg: {
      const int64_t size = static_cast<int64_t>(srcs.size());
      ReduceChunks<T, uint64_t>(
          srcs, begin, n, dst, load_u, [](uint64_t a, uint64_t b) { return a + b; },
          [&](uint64_t v) { return static_cast<T>(static_cast<int64_t>(static_cast<T>(v)) / size); });
      return;
    }
    case CommReduceOp::kMax:
      ReduceChunks<T, int64_t>(
          srcs, begin, n, dst, load_s, [](int64_t a, int64_t b) { return std::max(a, b); }, store_s);
      return;
    case CommReduceOp::kMin:
      ReduceChunks<T, int64_t>(
          srcs, begin, n, dst, load_s, [](int64_t a, int64_t b) { return std::min(a, b); }, store_s);
      return;
    case CommReduceOp::kProduct:
      ReduceChunks<T, uint64_t>(
          srcs, begin, n, dst, load_u, [](uint64_t a, uint64_t b) { return a * b; }, store_u);
      return;
  }
}

// bool: sum / max are "or", min / product are "and" (avg is rejected before).
void ReduceBool(CommReduceOp op, absl::Span<const char* const> srcs, int64_t begin, int64_t n, char* dst) {
  auto id = [](bool v) { return v; };
  if (op == CommReduceOp::kMin || op == CommReduceOp::kProduct) {
    ReduceChunks<bool, bool>(
        srcs, begin, n, dst, id, [](bool a, bool b) { return a && b; }, id);
  } else {
    ReduceChunks<bool, bool>(
        srcs, begin, n, dst, id, [](bool a, bool b) { return a || b; }, id);
  }
}

}  // namespace

void ReduceInRankOrder(DType dtype, CommReduceOp op, absl::Span<const char* const> srcs, int64_t begin, int64_t n,
                       char* dst) {
  if (n <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return ReduceFloat<float>(op, srcs, begin, n, dst);
    case DType::kBFloat16:
      return ReduceFloat<BFloat16>(op, srcs, begin, n, dst);
    case DType::kFloat16:
      return ReduceFloat<Float16>(op, srcs, begin, n, dst);
    case DType::kInt32:
      return ReduceInt<int32_t>(op, srcs, begin, n, dst);
    case DType::kInt64:
      return ReduceInt<int64_t>(op, srcs, begin, n, dst);
    case DType::kBool:
      return ReduceBool(op, srcs, begin, n, dst);
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return;
  }
}

}  // namespace dtensor::internal
