// CPU reductions over the middle dim of a contiguous [outer, reduce, inner] tensor.
//
// Accumulators: float dtypes sum (and mean) in double and take max/min in float with NaN
// propagating (as torch.max); int32/int64 sum in wrapping int64, mean truncates toward zero
// (an empty mean of ints gives 0). The work is cut into tasks by shape only — never by
// thread count — and partial results are combined in a fixed order, so results are
// bit-identical whatever OMP_NUM_THREADS is.
#include <algorithm>
#include <limits>
#include <vector>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

constexpr int64_t kColBlock = 256;     // columns of `inner` per task
constexpr int64_t kTaskElems = 32768;  // elements per task when the reduce dim is split
constexpr int64_t kEnoughTasks = 64;   // no reduce-dim split when outer x column blocks >= this

template <typename T, ReduceOp Op>
struct Reducer {
  static constexpr bool kSum = Op == ReduceOp::kSum || Op == ReduceOp::kMean;
  static constexpr bool kMax = Op == ReduceOp::kMax;
  using Acc = std::conditional_t<kIsComputeFloat<T>, std::conditional_t<kSum, double, float>, int64_t>;

  static Acc Init() {
    if constexpr (kSum) {
      return Acc{0};
    } else if constexpr (kIsComputeFloat<T>) {
      return kMax ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
    } else {
      return kMax ? static_cast<Acc>(std::numeric_limits<T>::lowest())
                  : static_cast<Acc>(std::numeric_limits<T>::max());
    }
  }
  static Acc Load(T v) {
    if constexpr (kIsComputeFloat<T>) {
      return static_cast<Acc>(ToFloat(v));
    } else {
      return static_cast<Acc>(v);
    }
  }
  static Acc Merge(Acc a, Acc v) {
    if constexpr (kSum) {
      if constexpr (std::is_integral_v<Acc>) {
        return static_cast<Acc>(static_cast<uint64_t>(a) + static_cast<uint64_t>(v));
      } else {
        return a + v;
      }
    } else if constexpr (std::is_integral_v<Acc>) {
      return kMax ? (v > a ? v : a) : (v < a ? v : a);
    } else if constexpr (kMax) {
      return MaxPropagateNaN(v, a);  // a NaN accumulator stays NaN
    } else {
      return MinPropagateNaN(v, a);
    }
  }
  static T Finish(Acc a, int64_t reduce) {
    if constexpr (kIsComputeFloat<T>) {
      if constexpr (Op == ReduceOp::kMean) {
        return FromFloat<T>(static_cast<float>(a / static_cast<double>(reduce)));
      } else {
        return FromFloat<T>(static_cast<float>(a));
      }
    } else {
      if constexpr (Op == ReduceOp::kMean) {
        return static_cast<T>(reduce == 0 ? 0 : a / reduce);
      } else {
        return static_cast<T>(a);
      }
    }
  }

  // Fold of a contiguous run; eight independent accumulators so the loop vectorizes
  // without reassociating a single chain.
  static Acc Contiguous(const T* p, int64_t n) {
    if constexpr (!kSum && kIsComputeFloat<T>) return ExtremeOf<kMax>(p, n);
    Acc acc[8];
    for (Acc& a : acc) a = Init();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) acc[j] = Merge(acc[j], Load(p[i + j]));
    }
    for (; i < n; ++i) acc[0] = Merge(acc[0], Load(p[i]));
    Acc r = acc[0];
    for (int j = 1; j < 8; ++j) r = Merge(r, acc[j]);
    return r;
  }
};

template <typename T, ReduceOp Op>
void ReduceTyped(const T* x, int64_t outer, int64_t reduce, int64_t inner, T* out) {
  using R = Reducer<T, Op>;
  using Acc = typename R::Acc;
  const int64_t cb = std::min(inner, kColBlock);
  const int64_t ncb = (inner + cb - 1) / cb;
  int64_t rb = reduce;  // rows of the reduce dim per task
  if (outer * ncb < kEnoughTasks) rb = std::max<int64_t>(1, kTaskElems / cb);
  rb = std::max<int64_t>(1, std::min(rb, reduce));
  const int64_t nrb = (reduce + rb - 1) / rb;
  const int64_t tasks = outer * nrb * ncb;

  // Partial results [outer, nrb, inner] when the reduce dim is split; none otherwise.
  std::vector<Acc> partial(nrb > 1 ? static_cast<size_t>(outer * nrb * inner) : 0);

  auto run_task = [&](int64_t task) {
    const int64_t c = task % ncb;
    const int64_t r = (task / ncb) % nrb;
    const int64_t o = task / (ncb * nrb);
    const int64_t c0 = c * cb, nc = std::min(cb, inner - c0);
    const int64_t r0 = r * rb, nr = std::min(rb, reduce - r0);
    const T* base = x + (o * reduce + r0) * inner + c0;
    Acc acc[kColBlock];
    if (inner == 1) {
      acc[0] = R::Contiguous(base, nr);
    } else {
      for (int64_t j = 0; j < nc; ++j) acc[j] = R::Init();
      for (int64_t i = 0; i < nr; ++i) {
        const T* row = base + i * inner;
        for (int64_t j = 0; j < nc; ++j) acc[j] = R::Merge(acc[j], R::Load(row[j]));
      }
    }
    if (nrb == 1) {
      T* dst = out + o * inner + c0;
      for (int64_t j = 0; j < nc; ++j) dst[j] = R::Finish(acc[j], reduce);
    } else {
      Acc* dst = partial.data() + (o * nrb + r) * inner + c0;
      for (int64_t j = 0; j < nc; ++j) dst[j] = acc[j];
    }
  };
  const int64_t task_cost = std::max<int64_t>(1, rb * cb);
  ParallelFor(tasks, std::max<int64_t>(1, kParallelGrain / task_cost), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) run_task(t);
  });

  if (nrb > 1) {  // combine partials in block order
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t j = 0; j < inner; ++j) {
        Acc a = partial[static_cast<size_t>(o * nrb * inner + j)];
        for (int64_t r = 1; r < nrb; ++r) a = R::Merge(a, partial[static_cast<size_t>((o * nrb + r) * inner + j)]);
        out[o * inner + j] = R::Finish(a, reduce);
      }
    }
  }
}

template <typename T, ReduceOp Op>
void ReduceEmpty(int64_t n, T* out) {
  using R = Reducer<T, Op>;
  const T v = R::Finish(R::Init(), 0);  // sum 0, mean NaN (float) / 0 (int), max -inf, min +inf
  std::fill(out, out + n, v);
}

}  // namespace

absl::Status CpuBackend::Reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduce, int64_t inner,
                                const Tensor& out) {
  if (outer < 0 || reduce < 0 || inner < 0 || x.numel() != outer * reduce * inner || out.numel() != outer * inner) {
    return InvalidArg("Reduce", "x ", ShapeString(x.shape()), " and out ", ShapeString(out.shape()),
                      " do not match [outer, reduce, inner] = [", outer, ", ", reduce, ", ", inner, "]");
  }
  if (out.numel() == 0) return absl::OkStatus();
  return DispatchNumeric("Reduce", x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = static_cast<const T*>(x.raw_data());
    T* po = static_cast<T*>(out.raw_data());
    auto run = [&](auto op_tag) {
      constexpr ReduceOp kOp = decltype(op_tag)::value;
      if (reduce == 0) {
        ReduceEmpty<T, kOp>(out.numel(), po);
      } else {
        ReduceTyped<T, kOp>(px, outer, reduce, inner, po);
      }
    };
    switch (op) {
      case ReduceOp::kSum:
        run(std::integral_constant<ReduceOp, ReduceOp::kSum>{});
        break;
      case ReduceOp::kMean:
        run(std::integral_constant<ReduceOp, ReduceOp::kMean>{});
        break;
      case ReduceOp::kMax:
        run(std::integral_constant<ReduceOp, ReduceOp::kMax>{});
        break;
      case ReduceOp::kMin:
        run(std::integral_constant<ReduceOp, ReduceOp::kMin>{});
        break;
    }
    return absl::OkStatus();
  });
}

absl::Status CpuBackend::SumOfSquares(const Tensor& x, const Tensor& out) {
  if (!x.is_contiguous() || out.dtype() != DType::kFloat32 || out.numel() != 1) {
    return InvalidArg("SumOfSquares", "wants a contiguous x and a float32 out of one element; got x ",
                      ShapeString(x.shape()), x.is_contiguous() ? "" : " (strided)", ", out ", DTypeName(out.dtype()),
                      " ", ShapeString(out.shape()));
  }
  return DispatchFloat("SumOfSquares", x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = static_cast<const T*>(x.raw_data());
    const int64_t n = x.numel(), chunks = (n + kSquareChunk - 1) / kSquareChunk;
    std::vector<double> partial(static_cast<size_t>(chunks));
    ParallelFor(chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        partial[static_cast<size_t>(c)] =
            SquareSumChunk(px + c * kSquareChunk, std::min(kSquareChunk, n - c * kSquareChunk));
      }
    });
    out.data<float>()[0] = AddSquareSumChunks(partial);
    return absl::OkStatus();
  });
}

}  // namespace dtensor::internal
