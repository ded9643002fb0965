// CUDA backend: CudaKernels() and the host side of every Kernels method except Gemm
// (gemm.cc); the kernels themselves are in the .cu files, behind launch.h. Each method checks what it cheaply can
// (dtypes, ranks: a mistake here would be a wild device write, not an exception), turns Tensors into pointers and
// layouts, allocates device scratch where a kernel needs some, and calls one launcher of launch.h with the backend's
// device current. Nothing here synchronises except Memcpy* and Synchronize.
//
// Scratch tensors are freed when a method returns, while its kernels may still run: the
// caching allocator hands the block out again only to work ordered after them on this thread's
// stream (see allocator.h).
#include "dtensor/kernels/cuda/cuda_kernels.h"

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/cuda_backend.h"
#include "dtensor/kernels/cuda/cuda_common.h"
#include "dtensor/kernels/cuda/launch.h"
#include "dtensor/tensor/status.h"
#if defined(DTENSOR_WITH_CUDNN)
#include "dtensor/kernels/cuda/cudnn_sdpa.h"
#endif

namespace dtensor::internal {
namespace {

// launch.h mirrors kernels.h's op enums.
static_assert(static_cast<int>(gpu::BinOp::kAdd) == static_cast<int>(BinaryOp::kAdd) &&
              static_cast<int>(gpu::BinOp::kSub) == static_cast<int>(BinaryOp::kSub) &&
              static_cast<int>(gpu::BinOp::kMul) == static_cast<int>(BinaryOp::kMul) &&
              static_cast<int>(gpu::BinOp::kDiv) == static_cast<int>(BinaryOp::kDiv) &&
              static_cast<int>(gpu::BinOp::kMax) == static_cast<int>(BinaryOp::kMax) &&
              static_cast<int>(gpu::BinOp::kMin) == static_cast<int>(BinaryOp::kMin));
static_assert(static_cast<int>(gpu::UnOp::kNeg) == static_cast<int>(UnaryOp::kNeg) &&
              static_cast<int>(gpu::UnOp::kExp) == static_cast<int>(UnaryOp::kExp) &&
              static_cast<int>(gpu::UnOp::kLog) == static_cast<int>(UnaryOp::kLog) &&
              static_cast<int>(gpu::UnOp::kSqrt) == static_cast<int>(UnaryOp::kSqrt) &&
              static_cast<int>(gpu::UnOp::kRsqrt) == static_cast<int>(UnaryOp::kRsqrt) &&
              static_cast<int>(gpu::UnOp::kRelu) == static_cast<int>(UnaryOp::kRelu) &&
              static_cast<int>(gpu::UnOp::kGelu) == static_cast<int>(UnaryOp::kGelu) &&
              static_cast<int>(gpu::UnOp::kTanh) == static_cast<int>(UnaryOp::kTanh) &&
              static_cast<int>(gpu::UnOp::kAbs) == static_cast<int>(UnaryOp::kAbs) &&
              static_cast<int>(gpu::UnOp::kSquare) == static_cast<int>(UnaryOp::kSquare));
static_assert(static_cast<int>(gpu::RedOp::kSum) == static_cast<int>(ReduceOp::kSum) &&
              static_cast<int>(gpu::RedOp::kMean) == static_cast<int>(ReduceOp::kMean) &&
              static_cast<int>(gpu::RedOp::kMax) == static_cast<int>(ReduceOp::kMax) &&
              static_cast<int>(gpu::RedOp::kMin) == static_cast<int>(ReduceOp::kMin));

gpu::BinOp ToGpu(BinaryOp op) { return static_cast<gpu::BinOp>(op); }
gpu::UnOp ToGpu(UnaryOp op) { return static_cast<gpu::UnOp>(op); }
gpu::RedOp ToGpu(ReduceOp op) { return static_cast<gpu::RedOp>(op); }

absl::Status Unsupported(const char* op, DType t) {
  return absl::UnimplementedError(absl::StrCat("[", op, "] dtype ", DTypeName(t), " is not supported on cuda"));
}
absl::Status CheckFloat(const char* op, DType t) { return IsComputeFloat(t) ? absl::OkStatus() : Unsupported(op, t); }
absl::Status CheckNumeric(const char* op, DType t) {
  return IsComputeFloat(t) || IsInteger(t) ? absl::OkStatus() : Unsupported(op, t);
}
absl::Status CheckIndex(const char* op, const char* what, DType t) {
  if (IsInteger(t)) return absl::OkStatus();
  return InvalidArg(op, what, " must be int32 or int64, got ", DTypeName(t));
}
absl::Status CheckSameDType(const char* op, const Tensor& a, const Tensor& b, const Tensor& out) {
  if (a.dtype() == out.dtype() && b.dtype() == out.dtype()) return absl::OkStatus();
  return InvalidArg(op, "dtypes differ: a ", DTypeName(a.dtype()), ", b ", DTypeName(b.dtype()), ", out ",
                    DTypeName(out.dtype()));
}
absl::Status CheckContiguous(const char* op, const Tensor& t, const char* what) {
  if (t.is_contiguous()) return absl::OkStatus();
  return InvalidArg(op, what, " ", t.ToString(), " must be contiguous");
}

// double -> the element bits of `t`, as the CPU's FromDouble: float types through float,
// integers truncated with saturation (NaN -> 0), bool != 0.
template <typename I>
I SaturateToInt(double d) {
  constexpr double kHi = -static_cast<double>(std::numeric_limits<I>::min());
  if (!(d == d)) return 0;
  if (d >= kHi) return std::numeric_limits<I>::max();
  if (d < -kHi) return std::numeric_limits<I>::min();
  return static_cast<I>(d);
}
uint64_t FillBits(DType t, double v) {
  const auto f = static_cast<float>(v);
  switch (t) {
    case DType::kFloat32: {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return u;
    }
    case DType::kBFloat16:
      return BFloat16(f).bits;
    case DType::kFloat16:
      return Float16(f).bits;
    case DType::kFloat8E4M3:
      return Float8E4M3(f).bits;
    case DType::kFloat8E5M2:
      return Float8E5M2(f).bits;
    case DType::kInt32:
      return static_cast<uint32_t>(SaturateToInt<int32_t>(v));
    case DType::kInt64:
      return static_cast<uint64_t>(SaturateToInt<int64_t>(v));
    case DType::kBool:
      return v != 0.0 ? 1 : 0;
  }
  return 0;
}

// Device scratch of `n` elements of `dtype` (n may be 0).
absl::StatusOr<Tensor> Scratch(int64_t n, DType dtype, int device) {
  const int64_t shape[1] = {n};
  return Tensor::Empty(shape, dtype, Device::Cuda(device));
}

// [rows, n] view of a tensor whose last dim is the row (a 0-d tensor is one row of one).
void RowsAndCols(const Tensor& t, int64_t* rows, int64_t* n) {
  *n = t.dim() == 0 ? 1 : t.size(-1);
  *rows = *n == 0 ? 0 : t.numel() / *n;
}

const void* DataOrNull(const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; }
void* MutableDataOrNull(const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; }

}  // namespace

Device CudaBackend::device() const { return Device::Cuda(index_); }

// ---- Copies and fills ----

absl::Status CudaBackend::Copy(const Tensor& src, const Tensor& dst) {
  constexpr const char* op = "Copy";
  if (src.shape() != dst.shape()) {
    return InvalidArg(op, "src ", ShapeString(src.shape()), " and dst ", ShapeString(dst.shape()), " differ in shape");
  }
  if (dst.numel() == 0) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(auto l, Layouts<2>(op, dst.shape(), {dst.strides(), src.strides()}));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchCopy(dst.dtype(), dst.raw_data(), l[0], src.dtype(), src.raw_data(), l[1], dst.numel());
  });
}

absl::Status CudaBackend::Fill(const Tensor& dst, double value) {
  constexpr const char* op = "Fill";
  if (dst.numel() == 0) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(auto l, Layouts<1>(op, dst.shape(), {dst.strides()}));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchFill(dst.raw_data(), l[0], dst.numel(), ElementSize(dst.dtype()), FillBits(dst.dtype(), value));
  });
}

absl::Status CudaBackend::FillRandom(const Tensor& dst, const RandomSpec& spec, IntSpan global_shape,
                                     IntSpan global_offset) {
  constexpr const char* op = "FillRandom";
  const int64_t nd = dst.dim();
  if (static_cast<int64_t>(global_shape.size()) != nd || static_cast<int64_t>(global_offset.size()) != nd) {
    return InvalidArg(op, "dst ", ShapeString(dst.shape()), ", global_shape ", ShapeString(global_shape),
                      " and global_offset ", ShapeString(global_offset), " differ in rank");
  }
  for (int64_t d = 0; d < nd; ++d) {
    if (global_offset[d] < 0 || global_offset[d] + dst.size(d) > global_shape[d]) {
      return InvalidArg(op, "block ", ShapeString(dst.shape()), " at offset ", ShapeString(global_offset),
                        " does not fit in global shape ", ShapeString(global_shape));
    }
  }
  DT_RETURN_IF_ERROR(CheckContiguous(op, dst, "dst"));
  if (dst.numel() == 0) return absl::OkStatus();
  const Shape gstrides = ContiguousStrides(global_shape);
  int64_t base = 0;
  for (int64_t d = 0; d < nd; ++d) base += global_offset[d] * gstrides[d];
  // Element i of dst (row-major over its shape) is global element base + sum idx_d * gstride_d.
  DT_ASSIGN_OR_RETURN(auto l, Layouts<1>(op, dst.shape(), {IntSpan(gstrides)}));
  const bool normal = spec.kind == RandomSpec::Kind::kNormal;
  return OnDevice(index_, op, [&] {
    return gpu::LaunchFillRandom(dst.dtype(), dst.raw_data(), l[0], base, dst.numel(), normal, spec.seed, spec.a,
                                 spec.b);
  });
}

// ---- Elementwise ----

absl::Status CudaBackend::Binary(BinaryOp bop, const Tensor& a, const Tensor& b, const Tensor& out) {
  constexpr const char* op = "Binary";
  if (out.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, a, b, out));
  DT_RETURN_IF_ERROR(CheckNumeric(op, out.dtype()));
  DT_RETURN_IF_ERROR(CheckContiguous(op, out, "out"));
  DT_ASSIGN_OR_RETURN(auto l, Layouts<3>(op, out.shape(), {out.strides(), a.strides(), b.strides()}));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchBinary(ToGpu(bop), out.dtype(), out.raw_data(), a.raw_data(), l[1], b.raw_data(), l[2],
                             out.numel());
  });
}

absl::Status CudaBackend::BinaryScalar(BinaryOp bop, const Tensor& a, double scalar, bool scalar_first,
                                       const Tensor& out) {
  constexpr const char* op = "BinaryScalar";
  if (out.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, a, a, out));
  DT_RETURN_IF_ERROR(CheckNumeric(op, out.dtype()));
  DT_RETURN_IF_ERROR(CheckContiguous(op, out, "out"));
  DT_ASSIGN_OR_RETURN(auto l, Layouts<2>(op, out.shape(), {out.strides(), a.strides()}));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchBinaryScalar(ToGpu(bop), out.dtype(), out.raw_data(), a.raw_data(), l[1], out.numel(), scalar,
                                   scalar_first);
  });
}

absl::Status CudaBackend::Unary(UnaryOp uop, const Tensor& a, const Tensor& out) {
  constexpr const char* op = "Unary";
  if (out.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, a, a, out));
  DT_RETURN_IF_ERROR(CheckNumeric(op, out.dtype()));
  DT_RETURN_IF_ERROR(CheckContiguous(op, out, "out"));
  if (IsInteger(out.dtype()) && uop != UnaryOp::kNeg && uop != UnaryOp::kAbs && uop != UnaryOp::kSquare &&
      uop != UnaryOp::kRelu) {
    return absl::UnimplementedError(absl::StrCat("[Unary] op ", static_cast<int>(uop),
                                                 " is not defined for integer dtype ", DTypeName(out.dtype())));
  }
  DT_ASSIGN_OR_RETURN(auto l, Layouts<2>(op, out.shape(), {out.strides(), a.strides()}));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchUnary(ToGpu(uop), out.dtype(), out.raw_data(), a.raw_data(), l[1], out.numel());
  });
}

absl::Status CudaBackend::UnaryBackward(UnaryOp uop, const Tensor& dy, const Tensor& x, const Tensor& dx) {
  constexpr const char* op = "UnaryBackward";
  if (dx.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, dy, x, dx));
  DT_RETURN_IF_ERROR(CheckFloat(op, dx.dtype()));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchUnaryBackward(ToGpu(uop), dx.dtype(), dx.raw_data(), dy.raw_data(), x.raw_data(), dx.numel());
  });
}

// ---- Reductions and softmax ----

absl::Status CudaBackend::Reduce(ReduceOp rop, const Tensor& x, int64_t outer, int64_t reduce, int64_t inner,
                                 const Tensor& out) {
  constexpr const char* op = "Reduce";
  if (outer < 0 || reduce < 0 || inner < 0 || x.numel() != outer * reduce * inner || out.numel() != outer * inner) {
    return InvalidArg(op, "x ", ShapeString(x.shape()), " and out ", ShapeString(out.shape()),
                      " do not match [outer, reduce, inner] = [", outer, ", ", reduce, ", ", inner, "]");
  }
  if (out.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, x, out));
  DT_RETURN_IF_ERROR(CheckNumeric(op, x.dtype()));
  const int64_t scratch_bytes = gpu::ReduceScratchBytes(outer, reduce, inner);
  DT_ASSIGN_OR_RETURN(Tensor scratch, Scratch(scratch_bytes / 8, DType::kInt64, index_));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchReduce(ToGpu(rop), x.dtype(), x.raw_data(), out.raw_data(), outer, reduce, inner,
                             scratch_bytes > 0 ? scratch.raw_data() : nullptr);
  });
}

absl::Status CudaBackend::SumOfSquares(const Tensor& x, const Tensor& out) {
  constexpr const char* op = "SumOfSquares";
  if (!x.is_contiguous() || out.dtype() != DType::kFloat32 || out.numel() != 1) {
    return InvalidArg(op, "wants a contiguous x and a float32 out of one element; got x ", ShapeString(x.shape()),
                      x.is_contiguous() ? "" : " (strided)", ", out ", DTypeName(out.dtype()), " ",
                      ShapeString(out.shape()));
  }
  DT_RETURN_IF_ERROR(CheckFloat(op, x.dtype()));
  // The partial sums (at least one double, so that an empty x still gets a pointer).
  const int64_t partials = std::max<int64_t>(1, gpu::SumOfSquaresPartials(x.numel()));
  DT_ASSIGN_OR_RETURN(Tensor scratch, Scratch(partials, DType::kInt64, index_));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchSumOfSquares(x.dtype(), x.raw_data(), x.numel(), static_cast<double*>(scratch.raw_data()),
                                   out.data<float>());
  });
}

absl::Status CudaBackend::Softmax(const Tensor& x, const Tensor& y, bool log) {
  constexpr const char* op = "Softmax";
  if (y.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, x, y));
  DT_RETURN_IF_ERROR(CheckFloat(op, y.dtype()));
  int64_t rows, n;
  RowsAndCols(y, &rows, &n);
  return OnDevice(index_, op, [&] { return gpu::LaunchSoftmax(y.dtype(), x.raw_data(), y.raw_data(), rows, n, log); });
}

absl::Status CudaBackend::SoftmaxBackward(const Tensor& dy, const Tensor& y, const Tensor& dx, bool log) {
  constexpr const char* op = "SoftmaxBackward";
  if (dx.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, dy, y, dx));
  DT_RETURN_IF_ERROR(CheckFloat(op, dx.dtype()));
  int64_t rows, n;
  RowsAndCols(dx, &rows, &n);
  return OnDevice(index_, op, [&] {
    return gpu::LaunchSoftmaxBackward(dx.dtype(), dy.raw_data(), y.raw_data(), dx.raw_data(), rows, n, log);
  });
}

// ---- Normalisation ----

absl::Status CudaBackend::LayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                                    const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  constexpr const char* op = "LayerNorm";
  if (x.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, x, y));
  DT_RETURN_IF_ERROR(CheckFloat(op, x.dtype()));
  int64_t rows, c;
  RowsAndCols(x, &rows, &c);
  return OnDevice(index_, op, [&] {
    return gpu::LaunchNorm(false, x.dtype(), x.raw_data(), DataOrNull(weight), DataOrNull(bias), eps, y.raw_data(),
                           mean.data<float>(), rstd.data<float>(), rows, c);
  });
}

absl::Status CudaBackend::AddLayerNorm(const Tensor& x, const Tensor& h, const Tensor& weight, const Tensor& bias,
                                       float eps, const Tensor& x1, const Tensor& y, const Tensor& mean,
                                       const Tensor& rstd) {
  constexpr const char* op = "AddLayerNorm";
  if (x.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, h, x1));
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, x, y));
  DT_RETURN_IF_ERROR(CheckFloat(op, x.dtype()));
  int64_t rows, c;
  RowsAndCols(x, &rows, &c);
  return OnDevice(index_, op, [&] {
    return gpu::LaunchAddNorm(x.dtype(), x.raw_data(), h.raw_data(), DataOrNull(weight), DataOrNull(bias), eps,
                              x1.raw_data(), y.raw_data(), mean.data<float>(), rstd.data<float>(), rows, c);
  });
}

absl::Status CudaBackend::LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                            const Tensor& rstd, const Tensor& dx, const Tensor& dweight,
                                            const Tensor& dbias) {
  return LayerNormBackwardAdd(dy, x, weight, mean, rstd, Tensor(), dx, dweight, dbias);
}

absl::Status CudaBackend::LayerNormBackwardAdd(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                               const Tensor& mean, const Tensor& rstd, const Tensor& dresidual,
                                               const Tensor& dx, const Tensor& dweight, const Tensor& dbias) {
  const char* op = dresidual.defined() ? "LayerNormBackwardAdd" : "LayerNormBackward";
  DT_RETURN_IF_ERROR(CheckFloat(op, x.dtype()));
  if (dresidual.defined()) {
    DT_RETURN_IF_ERROR(CheckSameDType(op, dresidual, dresidual, x));
  }
  const int64_t c = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = c == 0 ? 0 : x.numel() / c;
  const bool params = dweight.defined() || dbias.defined();
  DT_ASSIGN_OR_RETURN(Tensor partial, Scratch(params ? gpu::NormPartialFloats(rows, c) : 0, DType::kFloat32, index_));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchNormBackward(false, x.dtype(), DataOrNull(dy), DataOrNull(x), DataOrNull(weight),
                                   rows > 0 ? mean.data<float>() : nullptr, rows > 0 ? rstd.data<float>() : nullptr,
                                   DataOrNull(dresidual), MutableDataOrNull(dx), MutableDataOrNull(dweight),
                                   MutableDataOrNull(dbias), params ? partial.data<float>() : nullptr, rows, c);
  });
}

absl::Status CudaBackend::RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y,
                                  const Tensor& rstd) {
  constexpr const char* op = "RmsNorm";
  if (x.numel() == 0) return absl::OkStatus();
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, x, y));
  DT_RETURN_IF_ERROR(CheckFloat(op, x.dtype()));
  int64_t rows, c;
  RowsAndCols(x, &rows, &c);
  return OnDevice(index_, op, [&] {
    return gpu::LaunchNorm(true, x.dtype(), x.raw_data(), DataOrNull(weight), nullptr, eps, y.raw_data(), nullptr,
                           rstd.data<float>(), rows, c);
  });
}

absl::Status CudaBackend::RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                          const Tensor& dx, const Tensor& dweight) {
  constexpr const char* op = "RmsNormBackward";
  DT_RETURN_IF_ERROR(CheckFloat(op, x.dtype()));
  const int64_t c = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = c == 0 ? 0 : x.numel() / c;
  const bool params = dweight.defined();
  DT_ASSIGN_OR_RETURN(Tensor partial, Scratch(params ? gpu::NormPartialFloats(rows, c) : 0, DType::kFloat32, index_));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchNormBackward(true, x.dtype(), DataOrNull(dy), DataOrNull(x), DataOrNull(weight), nullptr,
                                   rows > 0 ? rstd.data<float>() : nullptr, nullptr, MutableDataOrNull(dx),
                                   MutableDataOrNull(dweight), nullptr, params ? partial.data<float>() : nullptr, rows,
                                   c);
  });
}

// ---- Embedding ----

absl::Status CudaBackend::Embedding(const Tensor& weight, const Tensor& ids, const Tensor& out) {
  constexpr const char* op = "Embedding";
  DT_RETURN_IF_ERROR(CheckIndex(op, "ids", ids.dtype()));
  if (out.numel() == 0) return absl::OkStatus();
  if (weight.dim() != 2) return InvalidArg(op, "weight must be [V, C], got ", ShapeString(weight.shape()));
  const int64_t n = ids.numel(), v = weight.size(0), c = weight.size(1);
  return OnDevice(index_, op, [&] {
    return gpu::LaunchEmbedding(weight.dtype(), weight.raw_data(), ids.dtype(), ids.raw_data(), out.raw_data(), n, v,
                                c);
  });
}

absl::Status CudaBackend::EmbeddingBackward(const Tensor& dout, const Tensor& ids, const Tensor& dweight) {
  constexpr const char* op = "EmbeddingBackward";
  DT_RETURN_IF_ERROR(CheckIndex(op, "ids", ids.dtype()));
  DT_RETURN_IF_ERROR(CheckFloat(op, dweight.dtype()));
  DT_RETURN_IF_ERROR(CheckFloat(op, dout.dtype()));
  if (dweight.dim() != 2) return InvalidArg(op, "dweight must be [V, C], got ", ShapeString(dweight.shape()));
  const int64_t n = ids.numel(), v = dweight.size(0), c = dweight.size(1);
  if (n == 0 || dweight.numel() == 0) return absl::OkStatus();
  const bool wide = dweight.dtype() == DType::kFloat32;
  DT_ASSIGN_OR_RETURN(Tensor scratch, Scratch(wide ? 0 : v * c, DType::kFloat32, index_));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchEmbeddingBackward(dout.dtype(), dout.raw_data(), ids.dtype(), ids.raw_data(), dweight.dtype(),
                                        dweight.raw_data(), wide ? nullptr : scratch.data<float>(), n, v, c);
  });
}

// ---- Cross-entropy ----

absl::Status CudaBackend::CrossEntropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                       const Tensor& losses, const Tensor& valid, const Tensor& lse) {
  constexpr const char* op = "CrossEntropy";
  DT_RETURN_IF_ERROR(CheckIndex(op, "targets", targets.dtype()));
  DT_RETURN_IF_ERROR(CheckFloat(op, logits.dtype()));
  const int64_t n = targets.numel();
  const int64_t v = logits.dim() == 0 ? 1 : logits.size(-1);
  if (n == 0) return absl::OkStatus();
  return OnDevice(index_, op, [&] {
    return gpu::LaunchCrossEntropy(logits.dtype(), logits.raw_data(), targets.dtype(), targets.raw_data(), ignore_index,
                                   losses.data<float>(), valid.data<float>(), lse.data<float>(), n, v);
  });
}

absl::Status CudaBackend::CrossEntropyBackward(const Tensor& logits, const Tensor& targets, const Tensor& /*lse*/,
                                               const Tensor& grad, int64_t ignore_index, const Tensor& dlogits) {
  constexpr const char* op = "CrossEntropyBackward";
  DT_RETURN_IF_ERROR(CheckIndex(op, "targets", targets.dtype()));
  DT_RETURN_IF_ERROR(CheckFloat(op, logits.dtype()));
  if (grad.dtype() != DType::kFloat32) return InvalidArg(op, "grad must be float32, got ", DTypeName(grad.dtype()));
  const int64_t n = targets.numel();
  const int64_t v = logits.dim() == 0 ? 1 : logits.size(-1);
  if (n == 0 || v == 0) return absl::OkStatus();
  const int64_t grad_stride = grad.dim() == 0 ? 0 : grad.stride(0);
  return OnDevice(index_, op, [&] {
    return gpu::LaunchCrossEntropyBackward(logits.dtype(), logits.raw_data(), targets.dtype(), targets.raw_data(),
                                           grad.data<float>(), grad_stride, ignore_index, dlogits.raw_data(), n, v);
  });
}

absl::Status CudaBackend::CrossEntropyWithGrad(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                               const Tensor& grad, const Tensor& losses, const Tensor& dlogits) {
  constexpr const char* op = "CrossEntropyWithGrad";
  DT_RETURN_IF_ERROR(CheckIndex(op, "targets", targets.dtype()));
  DT_RETURN_IF_ERROR(CheckFloat(op, logits.dtype()));
  if (grad.dtype() != DType::kFloat32) return InvalidArg(op, "grad must be float32, got ", DTypeName(grad.dtype()));
  const int64_t n = targets.numel();
  const int64_t v = logits.dim() == 0 ? 1 : logits.size(-1);
  if (n == 0) return absl::OkStatus();
  const int64_t grad_stride = grad.dim() == 0 ? 0 : grad.stride(0);
  return OnDevice(index_, op, [&] {
    return gpu::LaunchCrossEntropyWithGrad(logits.dtype(), logits.raw_data(), targets.dtype(), targets.raw_data(),
                                           ignore_index, grad.data<float>(), grad_stride, losses.data<float>(),
                                           dlogits.raw_data(), n, v);
  });
}

absl::Status CudaBackend::CountTargets(const Tensor& targets, int64_t ignore_index, int64_t v, const Tensor& count) {
  constexpr const char* op = "CountTargets";
  DT_RETURN_IF_ERROR(CheckIndex(op, "targets", targets.dtype()));
  if (count.dtype() != DType::kFloat32 || count.numel() != 1) {
    return InvalidArg(op, "count must be one float32, got ", count.ToString());
  }
  return OnDevice(index_, op, [&] {
    return gpu::LaunchCountTargets(targets.dtype(), targets.raw_data(), ignore_index, v, count.data<float>(),
                                   targets.numel());
  });
}

absl::Status CudaBackend::ScaleByRatio(const Tensor& x, const Tensor& num, const Tensor& den) {
  constexpr const char* op = "ScaleByRatio";
  DT_RETURN_IF_ERROR(CheckFloat(op, x.dtype()));
  return OnDevice(index_, op, [&] {
    return gpu::LaunchScaleByRatio(x.dtype(), x.raw_data(), num.data<float>(), den.data<float>(), x.numel());
  });
}

// ---- Attention ----

namespace {
absl::Status CheckAttentionShape(const char* op, const Tensor& q) {
  if (q.dim() != 4) return InvalidArg(op, "q must be [B, H, T, D], got ", ShapeString(q.shape()));
  const int64_t t = q.size(2), d = q.size(3);
  if (d > gpu::kMaxAttentionHeadDim) {
    return InvalidArg(op, "head dim D = ", d, " is not supported on cuda (at most ", gpu::kMaxAttentionHeadDim,
                      "); q is ", ShapeString(q.shape()));
  }
  if (t > int64_t{65535} * 16 || q.size(0) * q.size(1) > std::numeric_limits<int32_t>::max()) {
    return InvalidArg(op, "q ", ShapeString(q.shape()), " exceeds the cuda kernel's grid (T <= 1048560, B*H < 2^31)");
  }
  return CheckFloat(op, q.dtype());
}
}  // namespace

namespace {

// Which attention kernels run (DTENSOR_CUDA_ATTENTION, read on each call):
//   unset or "auto": cuDNN's fused attention where it is built in, installed and takes the
//                    problem (cudnn_sdpa.h), else dtensor's own (flash where it applies)
//   "cudnn":         cuDNN's or an error saying why not (for tests and benchmarks)
//   "flash":         dtensor's own, tensor-core flash kernels where they apply
//   "simple":        dtensor's own simple float32 kernels only (attention.cu)
enum class AttentionKernels { kAuto, kCudnn, kOwn };
absl::StatusOr<AttentionKernels> AttentionChoice(const char* op) {
  const char* e = std::getenv("DTENSOR_CUDA_ATTENTION");
  if (e == nullptr || *e == '\0' || std::strcmp(e, "auto") == 0) return AttentionKernels::kAuto;
  if (std::strcmp(e, "cudnn") == 0) return AttentionKernels::kCudnn;
  if (std::strcmp(e, "flash") == 0 || std::strcmp(e, "simple") == 0) return AttentionKernels::kOwn;
  return InvalidArg(op, "DTENSOR_CUDA_ATTENTION='", e, "' is not one of auto, cudnn, flash, simple");
}

// Runs `cudnn` (a cuDNN attention call) unless the choice rules it out. *ran: whether it ran.
// A decline (cuDNN missing or not taking the problem) is OK with *ran false under kAuto, and an
// error under kCudnn.
template <typename F>
absl::Status TryCudnnAttention(const char* op, DType dtype, int device, bool* ran, F&& cudnn) {
  *ran = false;
  DT_ASSIGN_OR_RETURN(AttentionKernels choice, AttentionChoice(op));
  if (choice == AttentionKernels::kOwn) return absl::OkStatus();
#if defined(DTENSOR_WITH_CUDNN)
  if (dtype == DType::kBFloat16 || dtype == DType::kFloat16) {
    DeviceGuard guard(device);
    if (!guard.ok()) return ToStatus(guard.error(), op, device);
    absl::Status s = cudnn();
    if (s.ok() || !IsCudnnDecline(s) || choice == AttentionKernels::kCudnn) {
      *ran = true;
      return s.ok() ? s : absl::Status(s.code(), absl::StrCat("[", op, "] ", s.message()));
    }
    return absl::OkStatus();
  }
  if (choice == AttentionKernels::kCudnn) {
    return absl::FailedPreconditionError(absl::StrCat("[", op, "] DTENSOR_CUDA_ATTENTION=cudnn but cuDNN's fused ",
                                                      "attention takes bfloat16 or float16, not ", DTypeName(dtype)));
  }
  return absl::OkStatus();
#else
  (void)dtype;
  (void)device;
  (void)cudnn;
  if (choice == AttentionKernels::kCudnn) {
    return absl::FailedPreconditionError(
        absl::StrCat("[", op, "] DTENSOR_CUDA_ATTENTION=cudnn but dtensor was built without cuDNN's headers"));
  }
  return absl::OkStatus();
#endif
}

#if defined(DTENSOR_WITH_CUDNN)
// The cuDNN problem of an attention call: q's [B, H, T, D] and dtype, and every operand's strides.
std::array<int64_t, 4> StridesOf(const Tensor& x) { return {x.stride(0), x.stride(1), x.stride(2), x.stride(3)}; }
SdpaProblem ForwardProblemOf(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out) {
  SdpaProblem p{false, q.dtype(), q.size(0), q.size(1), q.size(2), q.size(3)};
  p.q_strides = StridesOf(q), p.k_strides = StridesOf(k), p.v_strides = StridesOf(v), p.o_strides = StridesOf(out);
  return p;
}
SdpaProblem BackwardProblemOf(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  SdpaProblem p = ForwardProblemOf(q, k, v, out);
  p.backward = true;
  p.do_strides = StridesOf(dout), p.dq_strides = StridesOf(dq), p.dk_strides = StridesOf(dk);
  p.dv_strides = StridesOf(dv);
  return p;
}
#endif

}  // namespace

absl::StatusOr<Tensor> CudaBackend::ContiguousHere(const Tensor& t) {
  if (t.is_contiguous()) return t;
  DT_ASSIGN_OR_RETURN(Tensor c, Tensor::Empty(t.shape(), t.dtype(), Device::Cuda(index_)));
  DT_RETURN_IF_ERROR(Copy(t, c));
  return c;
}

absl::StatusOr<Tensor> CudaBackend::ContiguousOutputHere(const Tensor& t) {
  if (t.is_contiguous()) return t;
  return Tensor::Empty(t.shape(), t.dtype(), Device::Cuda(index_));
}

absl::Status CudaBackend::CopyBackTo(const Tensor& computed, const Tensor& t) {
  if (computed.raw_data() == t.raw_data()) return absl::OkStatus();
  return Copy(computed, t);
}

absl::Status CudaBackend::CausalAttention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, float scale,
                                          const Tensor& out, const Tensor& lse) {
  constexpr const char* op = "CausalAttention";
  DT_RETURN_IF_ERROR(CheckAttentionShape(op, q_in));
  if (q_in.numel() == 0) return absl::OkStatus();
  const int64_t t = q_in.size(2), d = q_in.size(3), bh = q_in.size(0) * q_in.size(1);
  bool ran = false;
  DT_RETURN_IF_ERROR(TryCudnnAttention(op, q_in.dtype(), index_, &ran, [&] {
#if defined(DTENSOR_WITH_CUDNN)
    return CudnnCausalAttention(index_, ForwardProblemOf(q_in, k_in, v_in, out), q_in.raw_data(), k_in.raw_data(),
                                v_in.raw_data(), scale, out.raw_data(), lse.data<float>());
#else
    return absl::OkStatus();
#endif
  }));
  if (ran) return absl::OkStatus();
  // dtensor's own kernels read and write [B, H, T, D] contiguous: copies of row views.
  DT_ASSIGN_OR_RETURN(Tensor q, ContiguousHere(q_in));
  DT_ASSIGN_OR_RETURN(Tensor k, ContiguousHere(k_in));
  DT_ASSIGN_OR_RETURN(Tensor v, ContiguousHere(v_in));
  DT_ASSIGN_OR_RETURN(Tensor o, ContiguousOutputHere(out));
  DT_RETURN_IF_ERROR(OnDevice(index_, op, [&] {
    return gpu::LaunchAttention(q.dtype(), q.raw_data(), k.raw_data(), v.raw_data(), scale, o.raw_data(),
                                lse.data<float>(), bh, t, d);
  }));
  return CopyBackTo(o, out);
}

absl::Status CudaBackend::CausalAttentionBackward(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                                  const Tensor& v_in, const Tensor& out_in, const Tensor& lse,
                                                  float scale, const Tensor& dq_out, const Tensor& dk_out,
                                                  const Tensor& dv_out) {
  constexpr const char* op = "CausalAttentionBackward";
  DT_RETURN_IF_ERROR(CheckAttentionShape(op, q_in));
  if (q_in.numel() == 0) return absl::OkStatus();
  const int64_t t = q_in.size(2), d = q_in.size(3), bh = q_in.size(0) * q_in.size(1);
  bool ran = false;
  DT_RETURN_IF_ERROR(TryCudnnAttention(op, q_in.dtype(), index_, &ran, [&] {
#if defined(DTENSOR_WITH_CUDNN)
    return CudnnCausalAttentionBackward(
        index_, BackwardProblemOf(dout_in, q_in, k_in, v_in, out_in, dq_out, dk_out, dv_out), dout_in.raw_data(),
        q_in.raw_data(), k_in.raw_data(), v_in.raw_data(), out_in.raw_data(), lse.data<float>(), scale,
        dq_out.raw_data(), dk_out.raw_data(), dv_out.raw_data());
#else
    return absl::OkStatus();
#endif
  }));
  if (ran) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(Tensor dout, ContiguousHere(dout_in));
  DT_ASSIGN_OR_RETURN(Tensor q, ContiguousHere(q_in));
  DT_ASSIGN_OR_RETURN(Tensor k, ContiguousHere(k_in));
  DT_ASSIGN_OR_RETURN(Tensor v, ContiguousHere(v_in));
  DT_ASSIGN_OR_RETURN(Tensor o, ContiguousHere(out_in));
  DT_ASSIGN_OR_RETURN(Tensor dq, ContiguousOutputHere(dq_out));
  DT_ASSIGN_OR_RETURN(Tensor dk, ContiguousOutputHere(dk_out));
  DT_ASSIGN_OR_RETURN(Tensor dv, ContiguousOutputHere(dv_out));
  DT_ASSIGN_OR_RETURN(Tensor delta, Scratch(bh * t, DType::kFloat32, index_));
  DT_RETURN_IF_ERROR(OnDevice(index_, op, [&] {
    return gpu::LaunchAttentionBackward(q.dtype(), dout.raw_data(), q.raw_data(), k.raw_data(), v.raw_data(),
                                        o.raw_data(), lse.data<float>(), scale, dq.raw_data(), dk.raw_data(),
                                        dv.raw_data(), delta.data<float>(), bh, t, d);
  }));
  DT_RETURN_IF_ERROR(CopyBackTo(dq, dq_out));
  DT_RETURN_IF_ERROR(CopyBackTo(dk, dk_out));
  return CopyBackTo(dv, dv_out);
}

// ---- Optimizer ----

namespace {
// AdamW's checks of one parameter's tensors (the kernels' own contract).
absl::Status CheckAdamWTensors(const char* op, const Tensor& param, const Tensor& grad, const Tensor& m,
                               const Tensor& v, int64_t step) {
  if (step < 1) return InvalidArg(op, "step must be >= 1 (1-based), got ", step);
  if (m.dtype() != DType::kFloat32 || v.dtype() != DType::kFloat32) {
    return InvalidArg(op, "m and v must be float32, got ", DTypeName(m.dtype()), " and ", DTypeName(v.dtype()));
  }
  DT_RETURN_IF_ERROR(CheckFloat(op, param.dtype()));
  DT_RETURN_IF_ERROR(CheckFloat(op, grad.dtype()));
  const int64_t n = param.numel();
  if (grad.numel() != n || m.numel() != n || v.numel() != n) {
    return InvalidArg(op, "numel differs: param ", n, ", grad ", grad.numel(), ", m ", m.numel(), ", v ", v.numel());
  }
  return absl::OkStatus();
}

// The shared scalars; bias corrections as the CPU backend computes them (in double, rounded
// to float once).
gpu::AdamWArgs AdamWScalars(const AdamWParams& p) {
  gpu::AdamWArgs args;
  args.lr = p.lr;
  args.beta1 = p.beta1;
  args.beta2 = p.beta2;
  args.eps = p.eps;
  args.decay = 1.0f - p.lr * p.weight_decay;
  args.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step))));
  // sqrt(v) / sqrt(1 - beta2^step), as torch: v / (1 - beta2^step) overflows once |g| > ~1.8e19.
  args.inv_sqrt_bc2 =
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step))));
  return args;
}
}  // namespace

absl::Status CudaBackend::AdamW(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                                const AdamWParams& p) {
  constexpr const char* op = "AdamW";
  DT_RETURN_IF_ERROR(CheckAdamWTensors(op, param, grad, m, v, p.step));
  const int64_t n = param.numel();
  if (n == 0) return absl::OkStatus();
  const gpu::AdamWArgs args = AdamWScalars(p);
  return OnDevice(index_, op, [&] {
    return gpu::LaunchAdamW(param.dtype(), param.raw_data(), grad.dtype(), grad.raw_data(), m.data<float>(),
                            v.data<float>(), n, args);
  });
}

// Parameters of one (param, grad) dtype pair and one grad_scale go kAdamWMultiMax per launch,
// in list order.
absl::Status CudaBackend::AdamWMulti(absl::Span<const AdamWTensors> list, const AdamWParams& p) {
  constexpr const char* op = "AdamW";
  for (const AdamWTensors& t : list) DT_RETURN_IF_ERROR(CheckAdamWTensors(op, t.param, t.grad, t.m, t.v, t.step));
  // The gradients' sums of squares first, each by SumOfSquares (the update leaves grad as it is;
  // folding them into the multi-tensor kernel is left for a session with a GPU).
  for (const AdamWTensors& t : list) {
    if (t.grad_square_sum.defined()) DT_RETURN_IF_ERROR(SumOfSquares(t.grad, t.grad_square_sum));
  }
  for (const AdamWTensors& t : list) {
    const Tensor& gs = t.grad_scale;
    if (gs.defined() && (gs.dtype() != DType::kFloat32 || gs.numel() != 1 || gs.device() != Device::Cuda(index_))) {
      return InvalidArg(op, "grad_scale must be a float32 of one element on cuda:", index_, ", got ",
                        DTypeName(gs.dtype()), " ", ShapeString(gs.shape()), " on ", gs.device().ToString());
    }
  }
  std::vector<bool> done(list.size(), false);
  for (size_t first = 0; first < list.size(); ++first) {
    if (done[first]) continue;
    // One launch takes parameters of one (param, grad) dtype pair and one grad_scale.
    const DType pd = list[first].param.dtype(), gd = list[first].grad.dtype();
    const Tensor& scale = list[first].grad_scale;
    const float* scale_ptr = scale.defined() ? scale.data<float>() : nullptr;
    gpu::AdamWMultiList batch;
    auto launch = [&]() -> absl::Status {
      gpu::AdamWArgs args = AdamWScalars(p);
      args.grad_scale = scale_ptr;
      absl::Status s = OnDevice(index_, op, [&] { return gpu::LaunchAdamWMulti(pd, gd, batch, args); });
      batch.count = 0;
      return s;
    };
    for (size_t i = first; i < list.size(); ++i) {
      const AdamWTensors& t = list[i];
      const float* ptr = t.grad_scale.defined() ? t.grad_scale.data<float>() : nullptr;
      if (done[i] || t.param.dtype() != pd || t.grad.dtype() != gd || ptr != scale_ptr) continue;
      done[i] = true;
      if (t.param.numel() == 0) continue;
      AdamWParams one = p;
      one.step = t.step;
      const gpu::AdamWArgs a = AdamWScalars(one);
      const int k = batch.count++;
      batch.param[k] = t.param.raw_data();
      batch.grad[k] = t.grad.raw_data();
      batch.m[k] = t.m.data<float>();
      batch.v[k] = t.v.data<float>();
      batch.n[k] = t.param.numel();
      batch.inv_bc1[k] = a.inv_bc1;
      batch.inv_sqrt_bc2[k] = a.inv_sqrt_bc2;
      if (batch.count == gpu::kAdamWMultiMax) DT_RETURN_IF_ERROR(launch());
    }
    if (batch.count > 0) DT_RETURN_IF_ERROR(launch());
  }
  return absl::OkStatus();
}

// ---- Host <-> device ----

absl::Status CudaBackend::MemcpyToDevice(void* dst, const void* src, size_t nbytes, bool wait) {
  if (nbytes == 0) return absl::OkStatus();
  return OnDevice(index_, "MemcpyToDevice", [&] {
    const cudaError_t err = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, cudaStreamPerThread);
    return err != cudaSuccess || !wait ? err : cudaStreamSynchronize(cudaStreamPerThread);
  });
}

absl::Status CudaBackend::MemcpyToHost(void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return absl::OkStatus();
  return OnDevice(index_, "MemcpyToHost", [&] {
    const cudaError_t err = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, cudaStreamPerThread);
    return err != cudaSuccess ? err : cudaStreamSynchronize(cudaStreamPerThread);
  });
}

absl::Status CudaBackend::Synchronize() {
  return OnDevice(index_, "Synchronize", [] { return cudaStreamSynchronize(cudaStreamPerThread); });
}

}  // namespace dtensor::internal

namespace dtensor {

absl::StatusOr<Kernels*> CudaKernels(int index) {
  constexpr int kMaxDevices = 16;  // as the allocator (allocator.h)
  const int count = CudaDeviceCount();
  if (index < 0 || index >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("[CudaKernels] cuda:", index, " requested but ", count, " CUDA devices are visible"));
  }
  if (index >= kMaxDevices) {
    return absl::InvalidArgumentError(
        absl::StrCat("[CudaKernels] cuda:", index, ": dtensor supports device indices below ", kMaxDevices));
  }
  // One backend per device, created on first use and never destroyed (tensors may outlive
  // static destruction).
  static internal::CudaBackend* backends[kMaxDevices] = {};
  static std::once_flag once[kMaxDevices];
  std::call_once(once[index], [index] { backends[index] = new internal::CudaBackend(index); });
  return backends[index];
}

}  // namespace dtensor
