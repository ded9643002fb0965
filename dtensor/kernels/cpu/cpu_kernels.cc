// CPU backend: the singleton, copies, fills and counter-based random fills.
#include "dtensor/kernels/cpu/cpu_kernels.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "dtensor/kernels/cpu/cpu_backend.h"
#include "dtensor/kernels/cpu/cpu_internal.h"
#include "dtensor/kernels/philox.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// An unsigned integer of `Bytes` bytes: same-dtype copies move bits, never values.
template <size_t Bytes>
struct BitsOf;
template <>
struct BitsOf<1> {
  using type = uint8_t;
};
template <>
struct BitsOf<2> {
  using type = uint16_t;
};
template <>
struct BitsOf<4> {
  using type = uint32_t;
};
template <>
struct BitsOf<8> {
  using type = uint64_t;
};

constexpr int64_t kTile = 32;

// True when the copy reads across the source's memory order: dst is walked contiguously but
// src jumps by a large stride along the row and a small one down the column (a transpose).
bool IsTransposeLike(const StridedLoop<2>& loop) {
  const int nd = loop.ndim();
  if (nd < 2 || loop.stride(0, nd - 1) != 1) return false;
  const int64_t row_step = std::abs(loop.stride(1, nd - 1)), col_step = std::abs(loop.stride(1, nd - 2));
  return row_step > 1 && col_step < row_step && loop.size(nd - 1) >= kTile / 2 && loop.size(nd - 2) >= kTile / 2;
}

// Transpose-like copies in kTile x kTile tiles of the two innermost dims, so that both the
// reads and the writes of a tile stay within a few cache lines.
template <typename D, typename S>
void TiledCopy(const StridedLoop<2>& loop, const S* src, D* dst) {
  const int nd = loop.ndim();
  const int64_t rows = loop.size(nd - 2), cols = loop.size(nd - 1);
  const int64_t d_row = loop.stride(0, nd - 2), s_row = loop.stride(1, nd - 2), s_col = loop.stride(1, nd - 1);
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  const int64_t tasks = loop.numel() / (rows * cols) * row_tiles;
  ParallelFor(tasks, std::max<int64_t>(1, kParallelGrain / (kTile * cols)), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      // Offsets of the outer (batch) index of this task.
      int64_t outer = task / row_tiles, d_off = 0, s_off = 0;
      for (int d = nd - 3; d >= 0; --d) {
        const int64_t c = outer % loop.size(d);
        outer /= loop.size(d);
        d_off += c * loop.stride(0, d);
        s_off += c * loop.stride(1, d);
      }
      const int64_t r0 = task % row_tiles * kTile, r1 = std::min(rows, r0 + kTile);
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t c1 = std::min(cols, c0 + kTile);
        for (int64_t r = r0; r < r1; ++r) {
          D* d = dst + d_off + r * d_row;
          const S* s = src + s_off + r * s_row;
          for (int64_t c = c0; c < c1; ++c) d[c] = CastElement<D>(s[c * s_col]);
        }
      }
    }
  });
}

// dst = cast(src) over a StridedLoop whose operand 0 is dst and operand 1 is src.
template <typename D, typename S>
void CopyLoop(const StridedLoop<2>& loop, const S* src, D* dst) {
  if (IsTransposeLike(loop)) {
    TiledCopy(loop, src, dst);
    return;
  }
  loop.Run(kParallelGrain, [&](const int64_t* off, const int64_t* st, int64_t n) {
    D* d = dst + off[0];
    const S* s = src + off[1];
    const int64_t sd = st[0], ss = st[1];
    if (sd == 1 && ss == 1) {
      if constexpr (std::is_same_v<D, S>) {
        std::memcpy(d, s, static_cast<size_t>(n) * sizeof(D));
      } else {
        for (int64_t i = 0; i < n; ++i) d[i] = CastElement<D>(s[i]);
      }
    } else if (ss == 0) {  // broadcast source
      const D v = CastElement<D>(s[0]);
      if (sd == 1) {
        std::fill(d, d + n, v);
      } else {
        for (int64_t i = 0; i < n; ++i) d[i * sd] = v;
      }
    } else if (sd == 1) {
      for (int64_t i = 0; i < n; ++i) d[i] = CastElement<D>(s[i * ss]);
    } else {
      for (int64_t i = 0; i < n; ++i) d[i * sd] = CastElement<D>(s[i * ss]);
    }
  });
}

template <size_t Bytes>
void CopyBits(const StridedLoop<2>& loop, const Tensor& src, const Tensor& dst) {
  using B = typename BitsOf<Bytes>::type;
  CopyLoop<B, B>(loop, static_cast<const B*>(src.raw_data()), static_cast<B*>(dst.raw_data()));
}

}  // namespace

Device CpuBackend::device() const { return Device::Cpu(); }

absl::Status CpuBackend::Copy(const Tensor& src, const Tensor& dst) {
  if (dst.numel() == 0) return absl::OkStatus();
  if (src.shape() != dst.shape()) {
    return InvalidArg("Copy", "src ", ShapeString(src.shape()), " and dst ", ShapeString(dst.shape()),
                      " differ in shape");
  }
  const StridedLoop<2> loop(dst.shape(), {dst.strides(), src.strides()});
  if (src.dtype() == dst.dtype()) {
    switch (ElementSize(dst.dtype())) {
      case 1:
        CopyBits<1>(loop, src, dst);
        break;
      case 2:
        CopyBits<2>(loop, src, dst);
        break;
      case 4:
        CopyBits<4>(loop, src, dst);
        break;
      default:
        CopyBits<8>(loop, src, dst);
        break;
    }
    return absl::OkStatus();
  }
  VisitDType(src.dtype(), [&](auto s_tag) {
    using S = decltype(s_tag);
    VisitDType(dst.dtype(), [&](auto d_tag) {
      using D = decltype(d_tag);
      CopyLoop<D, S>(loop, static_cast<const S*>(src.raw_data()), static_cast<D*>(dst.raw_data()));
    });
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::Fill(const Tensor& dst, double value) {
  if (dst.numel() == 0) return absl::OkStatus();
  const StridedLoop<1> loop(dst.shape(), {dst.strides()});
  VisitDType(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T v = FromDouble<T>(value);
    T* base = static_cast<T*>(dst.raw_data());
    loop.Run(kParallelGrain, [&](const int64_t* off, const int64_t* st, int64_t n) {
      T* d = base + off[0];
      if (st[0] == 1) {
        std::fill(d, d + n, v);
      } else {
        for (int64_t i = 0; i < n; ++i) d[i * st[0]] = v;
      }
    });
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::FillRandom(const Tensor& dst, const RandomSpec& spec, IntSpan global_shape,
                                    IntSpan global_offset) {
  if (dst.numel() == 0) return absl::OkStatus();
  const int64_t nd = dst.dim();
  if (static_cast<int64_t>(global_shape.size()) != nd || static_cast<int64_t>(global_offset.size()) != nd) {
    return InvalidArg("FillRandom", "dst ", ShapeString(dst.shape()), ", global_shape ", ShapeString(global_shape),
                      " and global_offset ", ShapeString(global_offset), " differ in rank");
  }
  for (int64_t d = 0; d < nd; ++d) {
    if (global_offset[d] < 0 || global_offset[d] + dst.size(d) > global_shape[d]) {
      return InvalidArg("FillRandom", "block ", ShapeString(dst.shape()), " at offset ", ShapeString(global_offset),
                        " does not fit in global shape ", ShapeString(global_shape));
    }
  }
  const Shape gstrides = ContiguousStrides(global_shape);
  int64_t base = 0;
  for (int64_t d = 0; d < nd; ++d) base += global_offset[d] * gstrides[d];
  const IntSpan shape = dst.shape();
  const int64_t row = nd == 0 ? 1 : shape[nd - 1];
  const bool normal = spec.kind == RandomSpec::Kind::kNormal;

  VisitDType(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(dst.raw_data());
    ParallelFor(dst.numel(), kParallelGrainExpensive, [&](int64_t begin, int64_t end) {
      int64_t coord[kMaxDims] = {};
      int64_t rem = begin;
      for (int64_t d = nd; d-- > 0;) {
        coord[d] = rem % shape[d];
        rem /= shape[d];
      }
      int64_t pos = begin;
      while (pos < end) {
        int64_t g = base;
        for (int64_t d = 0; d < nd; ++d) g += coord[d] * gstrides[d];
        const int64_t col = nd == 0 ? 0 : coord[nd - 1];
        const int64_t n = std::min(row - col, end - pos);
        T* o = out + pos;
        const auto g0 = static_cast<uint64_t>(g);
        if (normal) {
          for (int64_t j = 0; j < n; ++j) {
            o[j] = FromDouble<T>(RandomNormalAt(spec.seed, g0 + static_cast<uint64_t>(j), spec.a, spec.b));
          }
        } else {
          for (int64_t j = 0; j < n; ++j) {
            o[j] = FromDouble<T>(RandomUniformAt(spec.seed, g0 + static_cast<uint64_t>(j), spec.a, spec.b));
          }
        }
        pos += n;
        if (nd == 0) break;
        coord[nd - 1] += n;
        for (int64_t d = nd - 1; d > 0 && coord[d] == shape[d]; --d) {
          coord[d] = 0;
          ++coord[d - 1];
        }
      }
    });
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::MemcpyToDevice(void* /*dst*/, const void* /*src*/, size_t nbytes, bool /*wait*/) {
  return absl::UnimplementedError(
      absl::StrCat("[MemcpyToDevice] the cpu backend has no device memory (", nbytes, " bytes requested)"));
}

absl::Status CpuBackend::MemcpyToHost(void* /*dst*/, const void* /*src*/, size_t nbytes) {
  return absl::UnimplementedError(
      absl::StrCat("[MemcpyToHost] the cpu backend has no device memory (", nbytes, " bytes requested)"));
}

absl::Status CpuBackend::Synchronize() { return absl::OkStatus(); }

}  // namespace dtensor::internal

namespace dtensor {

Kernels* CpuKernels() {
  static internal::CpuBackend* const backend = new internal::CpuBackend();
  return backend;
}

}  // namespace dtensor
