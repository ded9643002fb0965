#include "dtensor/ops/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

// ---- Argument checks shared by the ops below ----

absl::Status CheckDefined(const char* op, const Tensor& t, const char* name) {
  if (!t.defined()) return InvalidArg(op, name, " is an undefined tensor");
  return absl::OkStatus();
}

// The backend of `t`'s device.
absl::StatusOr<Kernels*> Backend(const char* op, const Tensor& t) {
  DT_RETURN_IF_ERROR(CheckDefined(op, t, "input"));
  auto k = KernelsFor(t.device());
  if (!k.ok()) {
    return absl::Status(k.status().code(), absl::StrCat("[", op, "] ", k.status().message()));
  }
  return *k;
}

absl::Status CheckSameDevice(const char* op, const Tensor& a, const Tensor& b) {
  if (a.device() != b.device()) {
    return InvalidArg(op, "tensors on different devices: ", a.device().ToString(), " and ", b.device().ToString());
  }
  return absl::OkStatus();
}

absl::Status CheckSameDType(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) {
    return InvalidArg(op, "dtypes differ: ", DTypeName(a.dtype()), " ", ShapeString(a.shape()), " and ",
                      DTypeName(b.dtype()), " ", ShapeString(b.shape()));
  }
  return absl::OkStatus();
}

absl::Status CheckFloat(const char* op, const Tensor& t) {
  if (!IsComputeFloat(t.dtype())) {
    return InvalidArg(op, "expects a float32, bfloat16 or float16 tensor, got ", DTypeName(t.dtype()));
  }
  return absl::OkStatus();
}

absl::Status CheckArithmetic(const char* op, const Tensor& t) {
  if (IsFloat8(t.dtype())) {
    return absl::UnimplementedError(
        absl::StrCat("[", op, "] ", DTypeName(t.dtype()), " is a storage type: cast to a compute dtype first"));
  }
  if (t.dtype() == DType::kBool) return InvalidArg(op, "arithmetic on bool tensors is not supported");
  return absl::OkStatus();
}

absl::Status CheckIndex(const char* op, const Tensor& t, const char* name) {
  if (!IsInteger(t.dtype())) return InvalidArg(op, name, " must be int32 or int64, got ", DTypeName(t.dtype()));
  return absl::OkStatus();
}

absl::Status CheckShapeEq(const char* op, const Tensor& a, const Tensor& b, const char* na, const char* nb) {
  if (a.shape() != b.shape()) {
    return InvalidArg(op, na, " is ", ShapeString(a.shape()), " but ", nb, " is ", ShapeString(b.shape()));
  }
  return absl::OkStatus();
}

absl::Status PrefixStatus(const char* op, const absl::Status& s) {
  if (s.ok() || absl::StartsWith(s.message(), "[")) return s;
  return absl::Status(s.code(), absl::StrCat("[", op, "] ", s.message()));
}

Tensor Undefined() { return Tensor(); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Creation
// ---------------------------------------------------------------------------------------------

absl::StatusOr<Tensor> Full(IntSpan shape, double value, DType dtype, Device device) {
  DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(shape, dtype, device));
  DT_RETURN_IF_ERROR(Fill_(t, value));
  return t;
}

absl::StatusOr<Tensor> Zeros(IntSpan shape, DType dtype, Device device) { return Full(shape, 0.0, dtype, device); }
absl::StatusOr<Tensor> Ones(IntSpan shape, DType dtype, Device device) { return Full(shape, 1.0, dtype, device); }

absl::StatusOr<Tensor> Arange(int64_t n, DType dtype, Device device) {
  if (n < 0) return InvalidArg("Arange", "n must be >= 0, got ", n);
  const int64_t shape[1] = {n};
  DT_ASSIGN_OR_RETURN(Tensor host, Tensor::Empty(shape, DType::kInt64, Device::Cpu()));
  int64_t* p = host.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  DT_ASSIGN_OR_RETURN(Tensor cast, Cast(host, dtype));
  return To(cast, device);
}

absl::Status FillRandom_(const Tensor& dst, const RandomSpec& spec, IntSpan global_shape, IntSpan global_offset) {
  constexpr const char* op = "FillRandom";
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, dst));
  DT_RETURN_IF_ERROR(CheckFloat(op, dst));
  if (!dst.is_contiguous()) return InvalidArg(op, "destination ", dst.ToString(), " must be contiguous");
  if (global_shape.size() != static_cast<size_t>(dst.dim()) || global_offset.size() != global_shape.size()) {
    return InvalidArg(op, "block ", ShapeString(dst.shape()), " at offset ", ShapeString(global_offset),
                      " does not match global shape ", ShapeString(global_shape));
  }
  for (size_t i = 0; i < global_shape.size(); ++i) {
    if (global_offset[i] < 0 || global_offset[i] + dst.shape()[i] > global_shape[i]) {
      return InvalidArg(op, "block ", ShapeString(dst.shape()), " at offset ", ShapeString(global_offset),
                        " lies outside global shape ", ShapeString(global_shape));
    }
  }
  if (spec.kind == RandomSpec::Kind::kUniform && !(spec.a <= spec.b)) {
    return InvalidArg(op, "uniform range [", spec.a, ", ", spec.b, ") is empty");
  }
  if (spec.kind == RandomSpec::Kind::kNormal && !(spec.b >= 0)) {
    return InvalidArg(op, "normal stddev ", spec.b, " must be >= 0");
  }
  if (dst.numel() == 0) return absl::OkStatus();
  return PrefixStatus(op, k->FillRandom(dst, spec, global_shape, global_offset));
}

namespace {
absl::StatusOr<Tensor> RandomTensor(IntSpan shape, DType dtype, const RandomSpec& spec, Device device) {
  DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(shape, dtype, device));
  const Shape zeros(shape.size(), 0);
  DT_RETURN_IF_ERROR(FillRandom_(t, spec, shape, zeros));
  return t;
}
}  // namespace

absl::StatusOr<Tensor> RandomNormal(IntSpan shape, DType dtype, uint64_t seed, double mean, double stddev,
                                    Device device) {
  return RandomTensor(shape, dtype, RandomSpec{RandomSpec::Kind::kNormal, seed, mean, stddev}, device);
}

absl::StatusOr<Tensor> RandomUniform(IntSpan shape, DType dtype, uint64_t seed, double low, double high,
                                     Device device) {
  return RandomTensor(shape, dtype, RandomSpec{RandomSpec::Kind::kUniform, seed, low, high}, device);
}

// ---------------------------------------------------------------------------------------------
// Copies, casts, layout
// ---------------------------------------------------------------------------------------------

absl::Status Fill_(const Tensor& dst, double value) {
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend("Fill", dst));
  if (dst.numel() == 0) return absl::OkStatus();
  return PrefixStatus("Fill", k->Fill(dst, value));
}

absl::Status Copy_(const Tensor& dst, const Tensor& src) {
  constexpr const char* op = "Copy";
  DT_RETURN_IF_ERROR(CheckDefined(op, dst, "destination"));
  DT_RETURN_IF_ERROR(CheckDefined(op, src, "source"));
  auto expanded = src.Expand(dst.shape());
  if (!expanded.ok()) {
    return InvalidArg(op, "source ", ShapeString(src.shape()), " does not broadcast to destination ",
                      ShapeString(dst.shape()));
  }
  if (dst.numel() == 0) return absl::OkStatus();
  Tensor s = *std::move(expanded);
  if (src.device() == dst.device()) {
    DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, dst));
    if (s.storage() == dst.storage()) {  // overlapping views: copy through a temporary
      DT_ASSIGN_OR_RETURN(s, Clone(s));
    }
    return PrefixStatus(op, k->Copy(s, dst));
  }
  // Across devices: move contiguous bytes in the source dtype, then cast/scatter on the
  // destination device.
  if (src.device().is_cpu()) {  // host -> GPU
    DT_ASSIGN_OR_RETURN(Kernels * gpu, Backend(op, dst));
    DT_ASSIGN_OR_RETURN(Tensor host, Contiguous(s));
    const bool direct = dst.is_contiguous() && dst.dtype() == src.dtype();
    Tensor staged = dst;
    if (!direct) {
      DT_ASSIGN_OR_RETURN(staged, Tensor::Empty(dst.shape(), src.dtype(), dst.device()));
    }
    DT_RETURN_IF_ERROR(
        PrefixStatus(op, gpu->MemcpyToDevice(staged.raw_data(), host.raw_data(), host.nbytes(), /*wait=*/true)));
    if (!direct) return PrefixStatus(op, gpu->Copy(staged, dst));
    return absl::OkStatus();
  }
  // GPU -> host (or GPU -> another GPU, staged through the host).
  DT_ASSIGN_OR_RETURN(Kernels * gpu, Backend(op, src));
  DT_ASSIGN_OR_RETURN(Tensor dev, Contiguous(src));
  DT_ASSIGN_OR_RETURN(Tensor host, Tensor::Empty(src.shape(), src.dtype(), Device::Cpu()));
  DT_RETURN_IF_ERROR(PrefixStatus(op, gpu->MemcpyToHost(host.raw_data(), dev.raw_data(), dev.nbytes())));
  return Copy_(dst, host);
}

absl::StatusOr<Tensor> Clone(const Tensor& x) {
  DT_RETURN_IF_ERROR(CheckDefined("Clone", x, "input"));
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  DT_RETURN_IF_ERROR(Copy_(out, x));
  return out;
}

absl::StatusOr<Tensor> Contiguous(const Tensor& x) {
  DT_RETURN_IF_ERROR(CheckDefined("Contiguous", x, "input"));
  if (x.is_contiguous()) return x;
  return Clone(x);
}

absl::StatusOr<Tensor> Reshape(const Tensor& x, IntSpan shape) {
  DT_RETURN_IF_ERROR(CheckDefined("Reshape", x, "input"));
  auto v = x.View(shape);
  if (v.ok()) return v;
  DT_ASSIGN_OR_RETURN(Shape target, InferViewShape("Reshape", shape, x.numel()));
  DT_ASSIGN_OR_RETURN(Tensor c, Clone(x));
  return c.View(target);
}

absl::StatusOr<Tensor> To(const Tensor& x, Device device, ToOptions options) {
  DT_RETURN_IF_ERROR(CheckDefined("To", x, "input"));
  if (x.device() == device) return x;
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), x.dtype(), device));
  if (options.non_blocking && x.is_pinned() && x.is_contiguous() && device.is_cuda() && x.numel() > 0) {
    DT_ASSIGN_OR_RETURN(Kernels * gpu, Backend("To", out));
    DT_RETURN_IF_ERROR(
        PrefixStatus("To", gpu->MemcpyToDevice(out.raw_data(), x.raw_data(), x.nbytes(), /*wait=*/false)));
    return out;
  }
  DT_RETURN_IF_ERROR(Copy_(out, x));
  return out;
}

absl::StatusOr<Tensor> Cast(const Tensor& x, DType dtype) {
  DT_RETURN_IF_ERROR(CheckDefined("Cast", x, "input"));
  if (x.dtype() == dtype) return x;
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), dtype, x.device()));
  DT_RETURN_IF_ERROR(Copy_(out, x));
  return out;
}

absl::StatusOr<Tensor> Cat(absl::Span<const Tensor> xs, int64_t dim) {
  constexpr const char* op = "Cat";
  if (xs.empty()) return InvalidArg(op, "needs at least one tensor");
  const Tensor& first = xs[0];
  DT_RETURN_IF_ERROR(CheckDefined(op, first, "input 0"));
  if (first.dim() == 0) return InvalidArg(op, "cannot concatenate 0-d tensors; use Stack");
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim(op, dim, first.dim()));
  Shape out_shape(first.shape().begin(), first.shape().end());
  out_shape[d] = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    DT_RETURN_IF_ERROR(CheckDefined(op, x, "input"));
    DT_RETURN_IF_ERROR(CheckSameDType(op, first, x));
    DT_RETURN_IF_ERROR(CheckSameDevice(op, first, x));
    bool ok = x.dim() == first.dim();
    for (int64_t j = 0; ok && j < x.dim(); ++j) ok = j == d || x.shape()[j] == first.shape()[j];
    if (!ok) {
      return InvalidArg(op, "tensor ", i, " has shape ", ShapeString(x.shape()), ", incompatible with ",
                        ShapeString(first.shape()), " along dim ", d);
    }
    out_shape[d] += x.shape()[d];
  }
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(out_shape, first.dtype(), first.device()));
  int64_t start = 0;
  for (const Tensor& x : xs) {
    DT_ASSIGN_OR_RETURN(Tensor piece, out.Narrow(d, start, x.shape()[d]));
    DT_RETURN_IF_ERROR(Copy_(piece, x));
    start += x.shape()[d];
  }
  return out;
}

absl::StatusOr<Tensor> Stack(absl::Span<const Tensor> xs, int64_t dim) {
  constexpr const char* op = "Stack";
  if (xs.empty()) return InvalidArg(op, "needs at least one tensor");
  DT_RETURN_IF_ERROR(CheckDefined(op, xs[0], "input 0"));
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim(op, dim, xs[0].dim() + 1));
  std::vector<Tensor> expanded;
  expanded.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    DT_RETURN_IF_ERROR(CheckDefined(op, xs[i], "input"));
    if (xs[i].shape() != xs[0].shape()) {
      return InvalidArg(op, "tensor ", i, " has shape ", ShapeString(xs[i].shape()), " but tensor 0 has ",
                        ShapeString(xs[0].shape()));
    }
    DT_ASSIGN_OR_RETURN(Tensor u, xs[i].Unsqueeze(d));
    expanded.push_back(std::move(u));
  }
  return Cat(expanded, d);
}

absl::Status CopyBlock(const Tensor& dst, const Tensor& src) {
  const int64_t nd = dst.dim();
  if (dst.device() != Device::Cpu() || src.device() != Device::Cpu() || nd == 0 || dst.stride(nd - 1) != 1 ||
      src.stride(nd - 1) != 1 || dst.dtype() != src.dtype() || dst.shape() != src.shape()) {
    return Copy_(dst, src);
  }
  if (dst.numel() == 0) return absl::OkStatus();
  // Trailing dims contiguous in both views merge into one run of `run` elements: dims [k, nd).
  int64_t run = dst.size(nd - 1), k = nd - 1;
  while (k > 0 && (dst.size(k - 1) == 1 || (dst.stride(k - 1) == run && src.stride(k - 1) == run))) {
    run *= dst.size(k - 1);
    --k;
  }
  const int64_t es = static_cast<int64_t>(ElementSize(dst.dtype()));
  const size_t run_bytes = static_cast<size_t>(run * es);
  char* d = static_cast<char*>(dst.raw_data());
  const char* s = static_cast<const char*>(src.raw_data());
  const int64_t runs = dst.numel() / run;
  if (k <= 1) {  // one outer dim (the column blocks of a matrix): step the pointers
    const int64_t ds = k == 1 ? dst.stride(0) * es : 0, ss = k == 1 ? src.stride(0) * es : 0;
    for (int64_t r = 0; r < runs; ++r, d += ds, s += ss) std::memcpy(d, s, run_bytes);
    return absl::OkStatus();
  }
  Shape index(static_cast<size_t>(k), 0);
  for (int64_t r = 0; r < runs; ++r) {
    int64_t doff = 0, soff = 0;
    for (int64_t i = 0; i < k; ++i) {
      doff += index[static_cast<size_t>(i)] * dst.stride(i);
      soff += index[static_cast<size_t>(i)] * src.stride(i);
    }
    std::memcpy(d + doff * es, s + soff * es, run_bytes);
    for (int64_t i = k - 1; i >= 0; --i) {  // next run, row-major
      if (++index[static_cast<size_t>(i)] < dst.size(i)) break;
      index[static_cast<size_t>(i)] = 0;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> ToDoubleVector(const Tensor& x) {
  DT_RETURN_IF_ERROR(CheckDefined("ToDoubleVector", x, "input"));
  DT_ASSIGN_OR_RETURN(Tensor host, To(x, Device::Cpu()));
  DT_ASSIGN_OR_RETURN(host, Contiguous(host));
  std::vector<double> out(static_cast<size_t>(host.numel()));
  VisitDType(host.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = host.data<T>();
    for (size_t i = 0; i < out.size(); ++i) {
      if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, int32_t>) {
        out[i] = static_cast<double>(p[i]);
      } else if constexpr (std::is_same_v<T, bool>) {
        out[i] = p[i] ? 1.0 : 0.0;
      } else {
        out[i] = static_cast<double>(static_cast<float>(p[i]));
      }
    }
  });
  return out;
}

absl::StatusOr<std::vector<int64_t>> ToInt64Vector(const Tensor& x) {
  DT_RETURN_IF_ERROR(CheckDefined("ToInt64Vector", x, "input"));
  DT_ASSIGN_OR_RETURN(Tensor host, To(x, Device::Cpu()));
  DT_ASSIGN_OR_RETURN(host, Cast(host, DType::kInt64));
  DT_ASSIGN_OR_RETURN(host, Contiguous(host));
  const int64_t* p = host.data<int64_t>();
  return std::vector<int64_t>(p, p + host.numel());
}

// ---------------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------------

namespace {
const char* BinaryName(BinaryOp op) {
  switch (op) {
    case BinaryOp::kAdd:
      return "Add";
    case BinaryOp::kSub:
      return "Sub";
    case BinaryOp::kMul:
      return "Mul";
    case BinaryOp::kDiv:
      return "Div";
    case BinaryOp::kMax:
      return "Maximum";
    case BinaryOp::kMin:
      return "Minimum";
  }
  return "Binary";
}

const char* UnaryName(UnaryOp op) {
  switch (op) {
    case UnaryOp::kNeg:
      return "Neg";
    case UnaryOp::kExp:
      return "Exp";
    case UnaryOp::kLog:
      return "Log";
    case UnaryOp::kSqrt:
      return "Sqrt";
    case UnaryOp::kRsqrt:
      return "Rsqrt";
    case UnaryOp::kRelu:
      return "Relu";
    case UnaryOp::kGelu:
      return "Gelu";
    case UnaryOp::kTanh:
      return "Tanh";
    case UnaryOp::kAbs:
      return "Abs";
    case UnaryOp::kSquare:
      return "Square";
  }
  return "Unary";
}
}  // namespace

absl::StatusOr<Tensor> Binary(BinaryOp bop, const Tensor& a, const Tensor& b) {
  const char* op = BinaryName(bop);
  DT_RETURN_IF_ERROR(CheckDefined(op, a, "a"));
  DT_RETURN_IF_ERROR(CheckDefined(op, b, "b"));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, a, b));
  DT_RETURN_IF_ERROR(CheckSameDType(op, a, b));
  DT_RETURN_IF_ERROR(CheckArithmetic(op, a));
  DT_ASSIGN_OR_RETURN(Shape shape, BroadcastShapes(op, a.shape(), b.shape()));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, a));
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(shape, a.dtype(), a.device()));
  if (out.numel() == 0) return out;
  if (a.shape() == IntSpan(shape) && b.shape() == IntSpan(shape)) {  // no broadcast: skip the views
    DT_RETURN_IF_ERROR(PrefixStatus(op, k->Binary(bop, a, b, out)));
    return out;
  }
  DT_ASSIGN_OR_RETURN(Tensor ea, a.Expand(shape));
  DT_ASSIGN_OR_RETURN(Tensor eb, b.Expand(shape));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->Binary(bop, ea, eb, out)));
  return out;
}

absl::StatusOr<Tensor> Add(const Tensor& a, const Tensor& b) { return Binary(BinaryOp::kAdd, a, b); }
absl::StatusOr<Tensor> Sub(const Tensor& a, const Tensor& b) { return Binary(BinaryOp::kSub, a, b); }
absl::StatusOr<Tensor> Mul(const Tensor& a, const Tensor& b) { return Binary(BinaryOp::kMul, a, b); }
absl::StatusOr<Tensor> Div(const Tensor& a, const Tensor& b) { return Binary(BinaryOp::kDiv, a, b); }
absl::StatusOr<Tensor> Maximum(const Tensor& a, const Tensor& b) { return Binary(BinaryOp::kMax, a, b); }
absl::StatusOr<Tensor> Minimum(const Tensor& a, const Tensor& b) { return Binary(BinaryOp::kMin, a, b); }

absl::StatusOr<Tensor> BinaryScalar(BinaryOp bop, const Tensor& a, double s, bool scalar_first) {
  const char* op = BinaryName(bop);
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, a));
  DT_RETURN_IF_ERROR(CheckArithmetic(op, a));
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(a.shape(), a.dtype(), a.device()));
  if (out.numel() == 0) return out;
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->BinaryScalar(bop, a, s, scalar_first, out)));
  return out;
}

absl::StatusOr<Tensor> AddScalar(const Tensor& a, double s) { return BinaryScalar(BinaryOp::kAdd, a, s); }
absl::StatusOr<Tensor> Scale(const Tensor& a, double s) { return BinaryScalar(BinaryOp::kMul, a, s); }

namespace {
// a (op)= b with b broadcast to a's shape (Add_, Mul_).
absl::Status BinaryInPlace(const char* op, BinaryOp bop, const Tensor& a, const Tensor& b) {
  DT_RETURN_IF_ERROR(CheckDefined(op, a, "a"));
  DT_RETURN_IF_ERROR(CheckDefined(op, b, "b"));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, a, b));
  DT_RETURN_IF_ERROR(CheckSameDType(op, a, b));
  DT_RETURN_IF_ERROR(CheckArithmetic(op, a));
  auto eb = b.Expand(a.shape());
  if (!eb.ok()) {
    return InvalidArg(op, "b ", ShapeString(b.shape()), " does not broadcast to a ", ShapeString(a.shape()));
  }
  if (a.numel() == 0) return absl::OkStatus();
  Tensor bb = *std::move(eb);
  if (bb.storage() == a.storage()) {
    DT_ASSIGN_OR_RETURN(bb, Clone(bb));
  }
  if (!a.is_contiguous()) {
    DT_ASSIGN_OR_RETURN(Tensor r, Binary(bop, a, bb));
    return Copy_(a, r);
  }
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, a));
  return PrefixStatus(op, k->Binary(bop, a, bb, a));
}
}  // namespace

absl::Status Add_(const Tensor& a, const Tensor& b) { return BinaryInPlace("Add_", BinaryOp::kAdd, a, b); }
absl::Status Mul_(const Tensor& a, const Tensor& b) { return BinaryInPlace("Mul_", BinaryOp::kMul, a, b); }

absl::Status Scale_(const Tensor& a, double s) {
  constexpr const char* op = "Scale_";
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, a));
  DT_RETURN_IF_ERROR(CheckArithmetic(op, a));
  if (a.numel() == 0) return absl::OkStatus();
  if (!a.is_contiguous()) {
    DT_ASSIGN_OR_RETURN(Tensor scaled, Scale(a, s));
    return Copy_(a, scaled);
  }
  return PrefixStatus(op, k->BinaryScalar(BinaryOp::kMul, a, s, false, a));
}

absl::StatusOr<Tensor> Unary(UnaryOp uop, const Tensor& x) {
  const char* op = UnaryName(uop);
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_RETURN_IF_ERROR(CheckArithmetic(op, x));
  const bool int_ok = uop == UnaryOp::kNeg || uop == UnaryOp::kAbs || uop == UnaryOp::kSquare || uop == UnaryOp::kRelu;
  if (IsInteger(x.dtype()) && !int_ok) {
    return InvalidArg(op, "not defined for ", DTypeName(x.dtype()), " tensors; cast to a float dtype first");
  }
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  if (out.numel() == 0) return out;
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->Unary(uop, x, out)));
  return out;
}

absl::StatusOr<Tensor> Neg(const Tensor& x) { return Unary(UnaryOp::kNeg, x); }
absl::StatusOr<Tensor> Exp(const Tensor& x) { return Unary(UnaryOp::kExp, x); }
absl::StatusOr<Tensor> Log(const Tensor& x) { return Unary(UnaryOp::kLog, x); }
absl::StatusOr<Tensor> Sqrt(const Tensor& x) { return Unary(UnaryOp::kSqrt, x); }
absl::StatusOr<Tensor> Relu(const Tensor& x) { return Unary(UnaryOp::kRelu, x); }
absl::StatusOr<Tensor> Gelu(const Tensor& x) { return Unary(UnaryOp::kGelu, x); }
absl::StatusOr<Tensor> Tanh(const Tensor& x) { return Unary(UnaryOp::kTanh, x); }

absl::StatusOr<Tensor> UnaryBackward(UnaryOp uop, const Tensor& dy, const Tensor& x) {
  constexpr const char* op = "UnaryBackward";
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_RETURN_IF_ERROR(CheckDefined(op, dy, "dy"));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dy, x));
  DT_RETURN_IF_ERROR(CheckSameDType(op, dy, x));
  DT_RETURN_IF_ERROR(CheckFloat(op, x));
  DT_RETURN_IF_ERROR(CheckShapeEq(op, dy, x, "dy", "x"));
  switch (uop) {
    case UnaryOp::kGelu:
    case UnaryOp::kRelu:
    case UnaryOp::kTanh:
    case UnaryOp::kExp:
    case UnaryOp::kLog:
    case UnaryOp::kSqrt:
      break;
    default:
      return absl::UnimplementedError(absl::StrCat("[", op, "] no backward kernel for ", UnaryName(uop)));
  }
  DT_ASSIGN_OR_RETURN(Tensor cdy, Contiguous(dy));
  DT_ASSIGN_OR_RETURN(Tensor cx, Contiguous(x));
  DT_ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  if (dx.numel() == 0) return dx;
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->UnaryBackward(uop, cdy, cx, dx)));
  return dx;
}

// ---------------------------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------------------------

absl::StatusOr<Tensor> Reduce(ReduceOp rop, const Tensor& x, IntSpan dims, bool keepdim) {
  const char* op = rop == ReduceOp::kSum    ? "Sum"
                   : rop == ReduceOp::kMean ? "Mean"
                   : rop == ReduceOp::kMax  ? "Max"
                                            : "Min";
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_RETURN_IF_ERROR(CheckArithmetic(op, x));
  if (rop == ReduceOp::kMean) DT_RETURN_IF_ERROR(CheckFloat(op, x));
  const int64_t n = x.dim();
  // Which dims are reduced.
  absl::InlinedVector<bool, kMaxDims> reduced(static_cast<size_t>(std::max<int64_t>(n, 1)), dims.empty());
  for (int64_t d : dims) {
    DT_ASSIGN_OR_RETURN(int64_t nd, NormalizeDim(op, d, n));
    if (reduced[nd]) return InvalidArg(op, "dim ", nd, " appears more than once in ", ShapeString(dims));
    reduced[nd] = true;
  }
  Shape out_shape, kept_dims, red_dims;
  int64_t r = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (reduced[i]) {
      red_dims.push_back(i);
      r *= x.shape()[i];
      if (keepdim) out_shape.push_back(1);
    } else {
      kept_dims.push_back(i);
      out_shape.push_back(x.shape()[i]);
    }
  }
  // Before the empty-output return: PyTorch refuses max over an empty dim whatever the output.
  if (r == 0 && (rop == ReduceOp::kMax || rop == ReduceOp::kMin)) {
    return InvalidArg(op, "reduction over an empty dim of ", ShapeString(x.shape()), " has no identity");
  }
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(out_shape, x.dtype(), x.device()));
  if (out.numel() == 0) return out;
  // Reduced dims forming one consecutive block reduce in place as [outer, r, inner];
  // otherwise the kept dims are permuted to the front.
  bool block = true;
  for (size_t i = 1; i < red_dims.size(); ++i) block = block && red_dims[i] == red_dims[i - 1] + 1;
  Tensor src;
  int64_t outer = 1, inner = 1;
  if (block) {
    DT_ASSIGN_OR_RETURN(src, Contiguous(x));
    const int64_t first = red_dims.empty() ? n : red_dims.front();
    const int64_t last = red_dims.empty() ? n : red_dims.back() + 1;
    for (int64_t i = 0; i < first; ++i) outer *= x.shape()[i];
    for (int64_t i = last; i < n; ++i) inner *= x.shape()[i];
  } else {
    Shape perm = kept_dims;
    perm.insert(perm.end(), red_dims.begin(), red_dims.end());
    DT_ASSIGN_OR_RETURN(Tensor p, x.Permute(perm));
    DT_ASSIGN_OR_RETURN(src, Contiguous(p));
    for (int64_t d : kept_dims) outer *= x.shape()[d];
  }
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->Reduce(rop, src, outer, r, inner, out)));
  return out;
}

absl::StatusOr<Tensor> Sum(const Tensor& x, IntSpan dims, bool keepdim) {
  return Reduce(ReduceOp::kSum, x, dims, keepdim);
}
absl::StatusOr<Tensor> SumOfSquares(const Tensor& x) {
  constexpr const char* op = "SumOfSquares";
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_RETURN_IF_ERROR(CheckFloat(op, x));
  DT_ASSIGN_OR_RETURN(Tensor xc, Contiguous(x));
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({1}, DType::kFloat32, x.device()));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->SumOfSquares(xc, out)));
  return out;
}
absl::StatusOr<Tensor> Mean(const Tensor& x, IntSpan dims, bool keepdim) {
  return Reduce(ReduceOp::kMean, x, dims, keepdim);
}
absl::StatusOr<Tensor> Max(const Tensor& x, IntSpan dims, bool keepdim) {
  return Reduce(ReduceOp::kMax, x, dims, keepdim);
}
absl::StatusOr<Tensor> Min(const Tensor& x, IntSpan dims, bool keepdim) {
  return Reduce(ReduceOp::kMin, x, dims, keepdim);
}

// ---------------------------------------------------------------------------------------------
// Softmax
// ---------------------------------------------------------------------------------------------

namespace {

// Runs `fn` on contiguous [rows, n] views of `inputs` with `dim` moved last, and returns the
// output in the original layout (contiguous).
template <typename Fn>
absl::StatusOr<Tensor> OnLastDim(const char* op, std::initializer_list<const Tensor*> inputs, int64_t dim, Fn&& fn) {
  const Tensor& x = **inputs.begin();
  DT_ASSIGN_OR_RETURN(int64_t d, NormalizeDim(op, dim, x.dim()));
  const int64_t last = std::max<int64_t>(x.dim() - 1, 0);
  std::vector<Tensor> moved;
  for (const Tensor* t : inputs) {
    DT_ASSIGN_OR_RETURN(Tensor v, t->Transpose(d, last));
    DT_ASSIGN_OR_RETURN(v, Contiguous(v));
    moved.push_back(std::move(v));
  }
  const int64_t cols = x.dim() == 0 ? 1 : moved[0].shape().back();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(moved[0].shape(), x.dtype(), x.device()));
  if (x.numel() > 0) {
    std::vector<Tensor> flat;
    const int64_t shape2[2] = {rows, cols};
    for (const Tensor& m : moved) {
      DT_ASSIGN_OR_RETURN(Tensor v, m.View(shape2));
      flat.push_back(std::move(v));
    }
    DT_ASSIGN_OR_RETURN(Tensor out2, out.View(shape2));
    DT_RETURN_IF_ERROR(PrefixStatus(op, fn(flat, out2)));
  }
  DT_ASSIGN_OR_RETURN(Tensor back, out.Transpose(d, last));
  return Contiguous(back);
}

absl::StatusOr<Tensor> SoftmaxImpl(const char* op, const Tensor& x, int64_t dim, bool log) {
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_RETURN_IF_ERROR(CheckFloat(op, x));
  return OnLastDim(op, {&x}, dim,
                   [&](const std::vector<Tensor>& in, const Tensor& out) { return k->Softmax(in[0], out, log); });
}

absl::StatusOr<Tensor> SoftmaxBackwardImpl(const char* op, const Tensor& dy, const Tensor& y, int64_t dim, bool log) {
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, y));
  DT_RETURN_IF_ERROR(CheckDefined(op, dy, "dy"));
  DT_RETURN_IF_ERROR(CheckFloat(op, y));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dy, y));
  DT_RETURN_IF_ERROR(CheckSameDType(op, dy, y));
  DT_RETURN_IF_ERROR(CheckShapeEq(op, dy, y, "dy", "y"));
  return OnLastDim(op, {&dy, &y}, dim, [&](const std::vector<Tensor>& in, const Tensor& out) {
    return k->SoftmaxBackward(in[0], in[1], out, log);
  });
}

}  // namespace

absl::StatusOr<Tensor> Softmax(const Tensor& x, int64_t dim) { return SoftmaxImpl("Softmax", x, dim, false); }
absl::StatusOr<Tensor> LogSoftmax(const Tensor& x, int64_t dim) { return SoftmaxImpl("LogSoftmax", x, dim, true); }
absl::StatusOr<Tensor> SoftmaxBackward(const Tensor& dy, const Tensor& y, int64_t dim) {
  return SoftmaxBackwardImpl("SoftmaxBackward", dy, y, dim, false);
}
absl::StatusOr<Tensor> LogSoftmaxBackward(const Tensor& dy, const Tensor& y, int64_t dim) {
  return SoftmaxBackwardImpl("LogSoftmaxBackward", dy, y, dim, true);
}

// ---------------------------------------------------------------------------------------------
// Normalisation
// ---------------------------------------------------------------------------------------------

namespace {

struct NormShapes {
  int64_t rows = 0;
  int64_t cols = 0;
};

absl::StatusOr<NormShapes> CheckNormArgs(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  DT_RETURN_IF_ERROR(CheckDefined(op, x, "x"));
  DT_RETURN_IF_ERROR(CheckDefined(op, weight, "weight"));
  DT_RETURN_IF_ERROR(CheckFloat(op, x));
  if (x.dim() < 1) return InvalidArg(op, "x must have at least 1 dim, got ", ShapeString(x.shape()));
  const int64_t c = x.shape().back();
  if (weight.dim() != 1 || weight.shape()[0] != c) {
    return InvalidArg(op, "weight ", ShapeString(weight.shape()), " does not match the last dim of x ",
                      ShapeString(x.shape()));
  }
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, weight));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, x, weight));
  if (bias.defined()) {
    if (bias.shape() != weight.shape()) {
      return InvalidArg(op, "bias ", ShapeString(bias.shape()), " does not match weight ", ShapeString(weight.shape()));
    }
    DT_RETURN_IF_ERROR(CheckSameDType(op, x, bias));
    DT_RETURN_IF_ERROR(CheckSameDevice(op, x, bias));
  }
  if (c == 0 && x.numel() == 0 && NumElements(x.shape().subspan(0, x.dim() - 1)) > 0) {
    return InvalidArg(op, "cannot normalise over an empty last dim of ", ShapeString(x.shape()));
  }
  return NormShapes{c == 0 ? 0 : x.numel() / c, c};
}

absl::StatusOr<Tensor> Rows2D(const Tensor& x, NormShapes s) {
  DT_ASSIGN_OR_RETURN(Tensor c, Contiguous(x));
  const int64_t shape[2] = {s.rows, s.cols};
  return c.View(shape);
}

}  // namespace

absl::StatusOr<NormOutput> LayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps) {
  constexpr const char* op = "LayerNorm";
  DT_ASSIGN_OR_RETURN(NormShapes s, CheckNormArgs(op, x, weight, bias));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_ASSIGN_OR_RETURN(Tensor x2, Rows2D(x, s));
  DT_ASSIGN_OR_RETURN(Tensor w, Contiguous(weight));
  Tensor b;
  if (bias.defined()) {
    DT_ASSIGN_OR_RETURN(b, Contiguous(bias));
  }
  NormOutput o;
  DT_ASSIGN_OR_RETURN(o.y, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  const int64_t rows[1] = {s.rows};
  DT_ASSIGN_OR_RETURN(o.mean, Tensor::Empty(rows, DType::kFloat32, x.device()));
  DT_ASSIGN_OR_RETURN(o.rstd, Tensor::Empty(rows, DType::kFloat32, x.device()));
  if (x.numel() == 0) return o;
  DT_ASSIGN_OR_RETURN(Tensor y2, Rows2D(o.y, s));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->LayerNorm(x2, w, b, eps, y2, o.mean, o.rstd)));
  return o;
}

absl::StatusOr<AddNormOutput> AddLayerNorm(const Tensor& x, const Tensor& h, const Tensor& weight, const Tensor& bias,
                                           float eps) {
  constexpr const char* op = "AddLayerNorm";
  DT_ASSIGN_OR_RETURN(NormShapes s, CheckNormArgs(op, x, weight, bias));
  DT_RETURN_IF_ERROR(CheckDefined(op, h, "h"));
  DT_RETURN_IF_ERROR(CheckShapeEq(op, x, h, "x", "h"));
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, h));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, x, h));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_ASSIGN_OR_RETURN(Tensor x2, Rows2D(x, s));
  DT_ASSIGN_OR_RETURN(Tensor h2, Rows2D(h, s));
  DT_ASSIGN_OR_RETURN(Tensor w, Contiguous(weight));
  Tensor b;
  if (bias.defined()) {
    DT_ASSIGN_OR_RETURN(b, Contiguous(bias));
  }
  AddNormOutput o;
  DT_ASSIGN_OR_RETURN(o.residual, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  DT_ASSIGN_OR_RETURN(o.norm.y, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  const int64_t rows[1] = {s.rows};
  DT_ASSIGN_OR_RETURN(o.norm.mean, Tensor::Empty(rows, DType::kFloat32, x.device()));
  DT_ASSIGN_OR_RETURN(o.norm.rstd, Tensor::Empty(rows, DType::kFloat32, x.device()));
  if (x.numel() == 0) return o;
  DT_ASSIGN_OR_RETURN(Tensor r2, Rows2D(o.residual, s));
  DT_ASSIGN_OR_RETURN(Tensor y2, Rows2D(o.norm.y, s));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->AddLayerNorm(x2, h2, w, b, eps, r2, y2, o.norm.mean, o.norm.rstd)));
  return o;
}

namespace {

// LayerNormBackward, and with a defined `dres` LayerNormBackwardAdd.
absl::StatusOr<NormGrads> LayerNormBackwardImpl(const char* op, const Tensor& dy, const Tensor& x, const Tensor& weight,
                                                const NormOutput& saved, const Tensor& dres, bool has_bias) {
  DT_ASSIGN_OR_RETURN(NormShapes s, CheckNormArgs(op, x, weight, Undefined()));
  DT_RETURN_IF_ERROR(CheckDefined(op, dy, "dy"));
  DT_RETURN_IF_ERROR(CheckShapeEq(op, dy, x, "dy", "x"));
  DT_RETURN_IF_ERROR(CheckSameDType(op, dy, x));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dy, x));
  Tensor dres2;
  if (dres.defined()) {
    DT_RETURN_IF_ERROR(CheckShapeEq(op, dres, x, "dresidual", "x"));
    DT_RETURN_IF_ERROR(CheckSameDType(op, dres, x));
    DT_RETURN_IF_ERROR(CheckSameDevice(op, dres, x));
    DT_ASSIGN_OR_RETURN(dres2, Rows2D(dres, s));
  }
  if (!saved.mean.defined() || !saved.rstd.defined() || saved.mean.numel() != s.rows || saved.rstd.numel() != s.rows) {
    return InvalidArg(op, "saved mean/rstd do not match ", s.rows, " rows of x ", ShapeString(x.shape()));
  }
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_ASSIGN_OR_RETURN(Tensor x2, Rows2D(x, s));
  DT_ASSIGN_OR_RETURN(Tensor dy2, Rows2D(dy, s));
  DT_ASSIGN_OR_RETURN(Tensor w, Contiguous(weight));
  NormGrads g;
  DT_ASSIGN_OR_RETURN(g.dx, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  DT_ASSIGN_OR_RETURN(g.dweight, Zeros(weight.shape(), weight.dtype(), weight.device()));
  if (has_bias) {
    DT_ASSIGN_OR_RETURN(g.dbias, Zeros(weight.shape(), weight.dtype(), weight.device()));
  }
  if (x.numel() == 0) return g;
  DT_ASSIGN_OR_RETURN(Tensor dx2, Rows2D(g.dx, s));
  if (dres.defined()) {
    DT_RETURN_IF_ERROR(
        PrefixStatus(op, k->LayerNormBackwardAdd(dy2, x2, w, saved.mean, saved.rstd, dres2, dx2, g.dweight, g.dbias)));
  } else {
    DT_RETURN_IF_ERROR(
        PrefixStatus(op, k->LayerNormBackward(dy2, x2, w, saved.mean, saved.rstd, dx2, g.dweight, g.dbias)));
  }
  return g;
}

}  // namespace

absl::StatusOr<NormGrads> LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                            const NormOutput& saved, bool has_bias) {
  return LayerNormBackwardImpl("LayerNormBackward", dy, x, weight, saved, Tensor(), has_bias);
}

absl::StatusOr<NormGrads> LayerNormBackwardAdd(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                               const NormOutput& saved, const Tensor& dresidual, bool has_bias) {
  constexpr const char* op = "LayerNormBackwardAdd";
  if (!dresidual.defined()) return InvalidArg(op, "dresidual is undefined");
  return LayerNormBackwardImpl(op, dy, x, weight, saved, dresidual, has_bias);
}

absl::StatusOr<NormOutput> RmsNorm(const Tensor& x, const Tensor& weight, float eps) {
  constexpr const char* op = "RmsNorm";
  DT_ASSIGN_OR_RETURN(NormShapes s, CheckNormArgs(op, x, weight, Undefined()));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_ASSIGN_OR_RETURN(Tensor x2, Rows2D(x, s));
  DT_ASSIGN_OR_RETURN(Tensor w, Contiguous(weight));
  NormOutput o;
  DT_ASSIGN_OR_RETURN(o.y, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  const int64_t rows[1] = {s.rows};
  DT_ASSIGN_OR_RETURN(o.rstd, Tensor::Empty(rows, DType::kFloat32, x.device()));
  if (x.numel() == 0) return o;
  DT_ASSIGN_OR_RETURN(Tensor y2, Rows2D(o.y, s));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->RmsNorm(x2, w, eps, y2, o.rstd)));
  return o;
}

absl::StatusOr<NormGrads> RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                          const NormOutput& saved) {
  constexpr const char* op = "RmsNormBackward";
  DT_ASSIGN_OR_RETURN(NormShapes s, CheckNormArgs(op, x, weight, Undefined()));
  DT_RETURN_IF_ERROR(CheckDefined(op, dy, "dy"));
  DT_RETURN_IF_ERROR(CheckShapeEq(op, dy, x, "dy", "x"));
  DT_RETURN_IF_ERROR(CheckSameDType(op, dy, x));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dy, x));
  if (!saved.rstd.defined() || saved.rstd.numel() != s.rows) {
    return InvalidArg(op, "saved rstd does not match ", s.rows, " rows of x ", ShapeString(x.shape()));
  }
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  DT_ASSIGN_OR_RETURN(Tensor x2, Rows2D(x, s));
  DT_ASSIGN_OR_RETURN(Tensor dy2, Rows2D(dy, s));
  DT_ASSIGN_OR_RETURN(Tensor w, Contiguous(weight));
  NormGrads g;
  DT_ASSIGN_OR_RETURN(g.dx, Tensor::Empty(x.shape(), x.dtype(), x.device()));
  DT_ASSIGN_OR_RETURN(g.dweight, Zeros(weight.shape(), weight.dtype(), weight.device()));
  if (x.numel() == 0) return g;
  DT_ASSIGN_OR_RETURN(Tensor dx2, Rows2D(g.dx, s));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->RmsNormBackward(dy2, x2, w, saved.rstd, dx2, g.dweight)));
  return g;
}

// ---------------------------------------------------------------------------------------------
// Matrix multiply
// ---------------------------------------------------------------------------------------------

namespace {

// A [batch, rows, cols] view of `t` (whose last two dims are the matrix) broadcast to
// `batch_shape`, with one unit stride in the matrix (copying only when no view works).
absl::StatusOr<Tensor> AsBatchedMatrix(const Tensor& t, IntSpan batch_shape) {
  Shape full(batch_shape.begin(), batch_shape.end());
  full.push_back(t.shape()[t.dim() - 2]);
  full.push_back(t.shape()[t.dim() - 1]);
  DT_ASSIGN_OR_RETURN(Tensor e, t.Expand(full));
  const int64_t batch = NumElements(batch_shape);
  const int64_t shape3[3] = {batch, full[full.size() - 2], full.back()};
  auto unit_stride = [](const Tensor& m) {
    return m.stride(-1) == 1 || m.stride(-2) == 1 || m.size(-1) <= 1 || m.size(-2) <= 1;
  };
  if (unit_stride(e)) {
    // Batch dims collapse when they are one uniform stride (or all broadcast).
    auto v = e.View(shape3);
    if (v.ok()) {
      Tensor m = *std::move(v);
      if (unit_stride(m)) return m;
    }
  }
  DT_ASSIGN_OR_RETURN(Tensor c, Contiguous(e));
  return c.View(shape3);
}

// Gives 1-sized matrix dims a stride of 1 so the kernel always sees a unit stride.
absl::StatusOr<Tensor> FixDegenerateStrides(const Tensor& m) {
  if (m.stride(-1) == 1 || m.stride(-2) == 1) return m;
  Shape strides(m.strides().begin(), m.strides().end());
  if (m.size(-1) <= 1) {
    strides[2] = 1;
  } else {
    strides[1] = 1;
  }
  return m.AsStrided(m.shape(), strides, m.storage_offset());
}

struct MatmulPlan {
  Tensor a3, b3;  // [batch, M, K], [batch, K, N]
  Shape out_shape;
  int64_t batch = 1, m = 0, n = 0;
};

absl::StatusOr<MatmulPlan> PlanMatmul(const char* op, const Tensor& a_in, const Tensor& b_in, bool trans_a,
                                      bool trans_b) {
  DT_RETURN_IF_ERROR(CheckDefined(op, a_in, "a"));
  DT_RETURN_IF_ERROR(CheckDefined(op, b_in, "b"));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, a_in, b_in));
  DT_RETURN_IF_ERROR(CheckSameDType(op, a_in, b_in));
  DT_RETURN_IF_ERROR(CheckFloat(op, a_in));
  if (a_in.dim() < 2 || b_in.dim() < 2) {
    return InvalidArg(op, "operands must have at least 2 dims, got a ", ShapeString(a_in.shape()), " and b ",
                      ShapeString(b_in.shape()));
  }
  Tensor a = a_in, b = b_in;
  if (trans_a) {
    DT_ASSIGN_OR_RETURN(a, a.Transpose(-1, -2));
  }
  if (trans_b) {
    DT_ASSIGN_OR_RETURN(b, b.Transpose(-1, -2));
  }
  const int64_t m = a.size(-2), k = a.size(-1), k2 = b.size(-2), n = b.size(-1);
  if (k != k2) {
    return InvalidArg(op, "inner dims differ: a is ", ShapeString(a.shape()), ", b is ", ShapeString(b.shape()),
                      trans_a || trans_b ? " (after transposes)" : "");
  }
  DT_ASSIGN_OR_RETURN(Shape batch,
                      BroadcastShapes(op, a.shape().subspan(0, a.dim() - 2), b.shape().subspan(0, b.dim() - 2)));
  MatmulPlan p;
  p.m = m;
  p.n = n;
  p.out_shape = batch;
  p.out_shape.push_back(m);
  p.out_shape.push_back(n);
  // Linear layers: [..., M, K] @ [K, N] folds the batch into M when a's rows allow it.
  if (b.dim() == 2 && a.dim() > 2 && a.stride(-1) == 1) {
    const int64_t rows = NumElements(a.shape()) / std::max<int64_t>(k, 1);
    const int64_t shape3[3] = {1, k == 0 ? NumElements(a.shape().subspan(0, a.dim() - 1)) : rows, k};
    auto folded = a.View(shape3);
    if (folded.ok()) {
      p.a3 = *std::move(folded);
      DT_ASSIGN_OR_RETURN(p.b3, b.Unsqueeze(0));
      p.m = p.a3.size(1);
      p.batch = 1;
      DT_ASSIGN_OR_RETURN(p.a3, FixDegenerateStrides(p.a3));
      DT_ASSIGN_OR_RETURN(p.b3, FixDegenerateStrides(p.b3));
      return p;
    }
  }
  DT_ASSIGN_OR_RETURN(p.a3, AsBatchedMatrix(a, batch));
  DT_ASSIGN_OR_RETURN(p.b3, AsBatchedMatrix(b, batch));
  DT_ASSIGN_OR_RETURN(p.a3, FixDegenerateStrides(p.a3));
  DT_ASSIGN_OR_RETURN(p.b3, FixDegenerateStrides(p.b3));
  p.batch = NumElements(batch);
  return p;
}

absl::Status RunGemm(const char* op, const MatmulPlan& p, const Tensor& out, float alpha, float beta) {
  if (out.numel() == 0) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, out));
  const int64_t shape3[3] = {p.batch, p.m, p.n};
  DT_ASSIGN_OR_RETURN(Tensor c3, out.View(shape3));
  if (p.a3.size(2) == 0) {  // K == 0: the product is all zeros
    if (beta == 0.0f) return Fill_(out, 0.0);
    return Scale_(out, beta);
  }
  return PrefixStatus(op, k->Gemm(p.a3, p.b3, c3, alpha, beta));
}

}  // namespace

absl::StatusOr<Tensor> Matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  constexpr const char* op = "Matmul";
  DT_ASSIGN_OR_RETURN(MatmulPlan p, PlanMatmul(op, a, b, trans_a, trans_b));
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(p.out_shape, a.dtype(), a.device()));
  DT_RETURN_IF_ERROR(RunGemm(op, p, out, 1.0f, 0.0f));
  return out;
}

absl::Status MatmulInto(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a, bool trans_b, float alpha,
                        float beta) {
  constexpr const char* op = "MatmulInto";
  DT_ASSIGN_OR_RETURN(MatmulPlan p, PlanMatmul(op, a, b, trans_a, trans_b));
  DT_RETURN_IF_ERROR(CheckDefined(op, out, "out"));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, a, out));
  DT_RETURN_IF_ERROR(CheckSameDType(op, a, out));
  if (out.shape() != IntSpan(p.out_shape) || !out.is_contiguous()) {
    return InvalidArg(op, "out must be a contiguous ", ShapeString(p.out_shape), " tensor, got ",
                      ShapeString(out.shape()), out.is_contiguous() ? "" : " (non-contiguous)");
  }
  if (out.storage() == p.a3.storage() || out.storage() == p.b3.storage()) {
    return InvalidArg(op, "out must not share memory with a or b");
  }
  return RunGemm(op, p, out, alpha, beta);
}

absl::StatusOr<Tensor> LinearBias(const Tensor& x, const Tensor& w, const Tensor& bias, bool gelu, Tensor* pre) {
  constexpr const char* op = "LinearBias";
  DT_RETURN_IF_ERROR(CheckDefined(op, bias, "bias"));
  if (x.dim() != 2 || w.dim() != 2 || bias.dim() != 1) {
    return InvalidArg(op, "expects x [M, K], w [N, K] and bias [N], got ", ShapeString(x.shape()), ", ",
                      ShapeString(w.shape()), " and ", ShapeString(bias.shape()));
  }
  DT_ASSIGN_OR_RETURN(MatmulPlan p, PlanMatmul(op, x, w, false, true));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, x, bias));
  DT_RETURN_IF_ERROR(CheckSameDType(op, x, bias));
  if (bias.size(0) != w.size(0)) {
    return InvalidArg(op, "bias ", ShapeString(bias.shape()), " does not fit w ", ShapeString(w.shape()),
                      " (bias must be [N] for w [N, K])");
  }
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(p.out_shape, x.dtype(), x.device()));
  Tensor before;
  if (gelu) {
    DT_ASSIGN_OR_RETURN(before, Tensor::Empty(p.out_shape, x.dtype(), x.device()));
  }
  if (out.numel() > 0) {
    if (x.size(1) == 0) {  // K == 0: the product is zeros, the result the bias (through GELU)
      DT_RETURN_IF_ERROR(Fill_(gelu ? before : out, 0.0));
      DT_RETURN_IF_ERROR(Add_(gelu ? before : out, bias));
      if (gelu) {
        DT_ASSIGN_OR_RETURN(out, Gelu(before));
      }
    } else {
      DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
      DT_ASSIGN_OR_RETURN(Tensor b, Contiguous(bias));
      DT_ASSIGN_OR_RETURN(Tensor a2, p.a3.Select(0, 0));
      DT_ASSIGN_OR_RETURN(Tensor w2, p.b3.Select(0, 0));
      DT_RETURN_IF_ERROR(PrefixStatus(op, k->GemmBias(a2, w2, b, gelu, out, before)));
    }
  }
  if (pre != nullptr) *pre = before;
  return out;
}

absl::StatusOr<Tensor> LinearWeightBiasGrad(const Tensor& dy, const Tensor& x, Tensor* db) {
  constexpr const char* op = "LinearWeightBiasGrad";
  if (db == nullptr) return InvalidArg(op, "db must not be null");
  DT_RETURN_IF_ERROR(CheckDefined(op, dy, "dy"));
  DT_RETURN_IF_ERROR(CheckDefined(op, x, "x"));
  if (dy.dim() != 2 || x.dim() != 2) {
    return InvalidArg(op, "expects dy [M, N] and x [M, K], got ", ShapeString(dy.shape()), " and ",
                      ShapeString(x.shape()));
  }
  DT_ASSIGN_OR_RETURN(MatmulPlan p, PlanMatmul(op, dy, x, true, false));
  if (dy.numel() == 0 || x.numel() == 0) {  // no rows, or an empty output: the unfused ops' zeros
    DT_ASSIGN_OR_RETURN(*db, Sum(dy, {0}));
    return Matmul(dy, x, true, false);
  }
  DT_ASSIGN_OR_RETURN(Tensor dw, Tensor::Empty(p.out_shape, dy.dtype(), dy.device()));
  DT_ASSIGN_OR_RETURN(Tensor sums, Tensor::Empty({dy.size(1)}, dy.dtype(), dy.device()));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, dy));
  DT_ASSIGN_OR_RETURN(Tensor a2, p.a3.Select(0, 0));
  DT_ASSIGN_OR_RETURN(Tensor x2, p.b3.Select(0, 0));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->GemmBiasGrad(a2, x2, dw, sums)));
  *db = std::move(sums);
  return dw;
}

absl::StatusOr<Tensor> LinearInputGradGelu(const Tensor& dy, const Tensor& w, const Tensor& pre, Tensor* db) {
  constexpr const char* op = "LinearInputGradGelu";
  if (db == nullptr) return InvalidArg(op, "db must not be null");
  DT_RETURN_IF_ERROR(CheckDefined(op, dy, "dy"));
  DT_RETURN_IF_ERROR(CheckDefined(op, w, "w"));
  DT_RETURN_IF_ERROR(CheckDefined(op, pre, "pre"));
  if (dy.dim() != 2 || w.dim() != 2 || pre.dim() != 2) {
    return InvalidArg(op, "expects dy [M, N], w [N, K] and pre [M, K], got ", ShapeString(dy.shape()), ", ",
                      ShapeString(w.shape()), " and ", ShapeString(pre.shape()));
  }
  DT_ASSIGN_OR_RETURN(MatmulPlan p, PlanMatmul(op, dy, w, false, false));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dy, pre));
  DT_RETURN_IF_ERROR(CheckSameDType(op, dy, pre));
  if (pre.shape() != IntSpan(p.out_shape)) {
    return InvalidArg(op, "pre ", ShapeString(pre.shape()), " does not fit dy ", ShapeString(dy.shape()), " w ",
                      ShapeString(w.shape()), " (pre must be [M, K])");
  }
  if (pre.numel() == 0 || dy.size(1) == 0) {  // empty: the unfused ops
    DT_ASSIGN_OR_RETURN(Tensor dh, Matmul(dy, w));
    DT_ASSIGN_OR_RETURN(Tensor dpre, UnaryBackward(UnaryOp::kGelu, dh, pre));
    DT_ASSIGN_OR_RETURN(*db, Sum(dpre, {0}));
    return dpre;
  }
  DT_ASSIGN_OR_RETURN(Tensor cpre, Contiguous(pre));
  DT_ASSIGN_OR_RETURN(Tensor dpre, Tensor::Empty(p.out_shape, dy.dtype(), dy.device()));
  DT_ASSIGN_OR_RETURN(Tensor sums, Tensor::Empty({w.size(1)}, dy.dtype(), dy.device()));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, dy));
  DT_ASSIGN_OR_RETURN(Tensor a2, p.a3.Select(0, 0));
  DT_ASSIGN_OR_RETURN(Tensor w2, p.b3.Select(0, 0));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->GemmDgelu(a2, w2, cpre, dpre, sums)));
  *db = std::move(sums);
  return dpre;
}

// ---------------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------------

absl::StatusOr<Tensor> Embedding(const Tensor& weight, const Tensor& ids) {
  constexpr const char* op = "Embedding";
  DT_RETURN_IF_ERROR(CheckDefined(op, weight, "weight"));
  DT_RETURN_IF_ERROR(CheckDefined(op, ids, "ids"));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, weight, ids));
  DT_RETURN_IF_ERROR(CheckIndex(op, ids, "ids"));
  DT_RETURN_IF_ERROR(CheckFloat(op, weight));
  if (weight.dim() != 2) return InvalidArg(op, "weight must be [V, C], got ", ShapeString(weight.shape()));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, weight));
  Shape out_shape(ids.shape().begin(), ids.shape().end());
  out_shape.push_back(weight.size(1));
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(out_shape, weight.dtype(), weight.device()));
  if (out.numel() == 0) return out;
  DT_ASSIGN_OR_RETURN(Tensor w, Contiguous(weight));
  DT_ASSIGN_OR_RETURN(Tensor flat_ids, Reshape(ids, {ids.numel()}));
  DT_ASSIGN_OR_RETURN(flat_ids, Contiguous(flat_ids));
  const int64_t shape2[2] = {ids.numel(), weight.size(1)};
  DT_ASSIGN_OR_RETURN(Tensor out2, out.View(shape2));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->Embedding(w, flat_ids, out2)));
  return out;
}

absl::Status EmbeddingBackward_(const Tensor& dweight, const Tensor& dout, const Tensor& ids) {
  constexpr const char* op = "EmbeddingBackward";
  DT_RETURN_IF_ERROR(CheckDefined(op, dweight, "dweight"));
  DT_RETURN_IF_ERROR(CheckDefined(op, dout, "dout"));
  DT_RETURN_IF_ERROR(CheckDefined(op, ids, "ids"));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dweight, dout));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dweight, ids));
  DT_RETURN_IF_ERROR(CheckSameDType(op, dweight, dout));
  DT_RETURN_IF_ERROR(CheckIndex(op, ids, "ids"));
  DT_RETURN_IF_ERROR(CheckFloat(op, dweight));
  if (dweight.dim() != 2 || !dweight.is_contiguous()) {
    return InvalidArg(op, "dweight must be a contiguous [V, C] tensor, got ", ShapeString(dweight.shape()));
  }
  Shape want(ids.shape().begin(), ids.shape().end());
  want.push_back(dweight.size(1));
  if (dout.shape() != IntSpan(want)) {
    return InvalidArg(op, "dout is ", ShapeString(dout.shape()), " but ids ", ShapeString(ids.shape()), " and dweight ",
                      ShapeString(dweight.shape()), " need ", ShapeString(want));
  }
  if (dout.numel() == 0) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, dweight));
  const int64_t shape2[2] = {ids.numel(), dweight.size(1)};
  DT_ASSIGN_OR_RETURN(Tensor d2, Reshape(dout, shape2));
  DT_ASSIGN_OR_RETURN(d2, Contiguous(d2));
  DT_ASSIGN_OR_RETURN(Tensor flat_ids, Reshape(ids, {ids.numel()}));
  DT_ASSIGN_OR_RETURN(flat_ids, Contiguous(flat_ids));
  return PrefixStatus(op, k->EmbeddingBackward(d2, flat_ids, dweight));
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------------------------

namespace {

struct CeShapes {
  Tensor logits2;   // [N, V] contiguous
  Tensor targets1;  // [N] contiguous
  int64_t n = 0;
};

absl::StatusOr<CeShapes> CheckCrossEntropyArgs(const char* op, const Tensor& logits, const Tensor& targets) {
  DT_RETURN_IF_ERROR(CheckDefined(op, logits, "logits"));
  DT_RETURN_IF_ERROR(CheckDefined(op, targets, "targets"));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, logits, targets));
  DT_RETURN_IF_ERROR(CheckFloat(op, logits));
  DT_RETURN_IF_ERROR(CheckIndex(op, targets, "targets"));
  if (logits.dim() < 1 || targets.dim() != logits.dim() - 1 ||
      targets.shape() != logits.shape().subspan(0, logits.dim() - 1)) {
    return InvalidArg(op, "logits ", ShapeString(logits.shape()), " and targets ", ShapeString(targets.shape()),
                      " must be [..., V] and [...]");
  }
  if (logits.size(-1) == 0 && targets.numel() > 0) {
    return InvalidArg(op, "logits ", ShapeString(logits.shape()), " have no classes");
  }
  CeShapes s;
  s.n = targets.numel();
  const int64_t shape2[2] = {s.n, logits.size(-1)};
  DT_ASSIGN_OR_RETURN(s.logits2, Reshape(logits, shape2));
  DT_ASSIGN_OR_RETURN(s.logits2, Contiguous(s.logits2));
  DT_ASSIGN_OR_RETURN(s.targets1, Reshape(targets, {s.n}));
  DT_ASSIGN_OR_RETURN(s.targets1, Contiguous(s.targets1));
  return s;
}

}  // namespace

absl::StatusOr<CrossEntropyOutput> CrossEntropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  constexpr const char* op = "CrossEntropy";
  DT_ASSIGN_OR_RETURN(CeShapes s, CheckCrossEntropyArgs(op, logits, targets));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, logits));
  const int64_t n1[1] = {s.n};
  DT_ASSIGN_OR_RETURN(Tensor losses, Tensor::Empty(n1, DType::kFloat32, logits.device()));
  DT_ASSIGN_OR_RETURN(Tensor valid, Tensor::Empty(n1, DType::kFloat32, logits.device()));
  CrossEntropyOutput o;
  DT_ASSIGN_OR_RETURN(o.lse, Tensor::Empty(n1, DType::kFloat32, logits.device()));
  if (s.n > 0) {
    DT_RETURN_IF_ERROR(PrefixStatus(op, k->CrossEntropy(s.logits2, s.targets1, ignore_index, losses, valid, o.lse)));
  }
  DT_ASSIGN_OR_RETURN(Tensor total, Sum(losses));
  DT_ASSIGN_OR_RETURN(o.count, Sum(valid));
  DT_ASSIGN_OR_RETURN(o.loss, Div(total, o.count));
  return o;
}

absl::StatusOr<Tensor> CrossEntropyBackward(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                                            const CrossEntropyOutput& saved, int64_t ignore_index) {
  constexpr const char* op = "CrossEntropyBackward";
  DT_ASSIGN_OR_RETURN(CeShapes s, CheckCrossEntropyArgs(op, logits, targets));
  DT_RETURN_IF_ERROR(CheckDefined(op, dloss, "dloss"));
  if (dloss.numel() != 1 || dloss.dtype() != DType::kFloat32) {
    return InvalidArg(op, "dloss must be a float32 scalar, got ", dloss.ToString());
  }
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dloss, logits));
  if (!saved.lse.defined() || saved.lse.numel() != s.n || !saved.count.defined()) {
    return InvalidArg(op, "saved forward outputs do not match ", s.n, " rows");
  }
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, logits));
  DT_ASSIGN_OR_RETURN(Tensor d0, Reshape(dloss, {}));
  DT_ASSIGN_OR_RETURN(Tensor grad0, Div(d0, saved.count));  // mean reduction
  const int64_t n1[1] = {s.n};
  DT_ASSIGN_OR_RETURN(Tensor grad, grad0.Expand(n1));
  DT_ASSIGN_OR_RETURN(Tensor dlogits, Tensor::Empty(logits.shape(), logits.dtype(), logits.device()));
  if (s.n == 0) return dlogits;
  const int64_t shape2[2] = {s.n, logits.size(-1)};
  DT_ASSIGN_OR_RETURN(Tensor d2, dlogits.View(shape2));
  DT_RETURN_IF_ERROR(
      PrefixStatus(op, k->CrossEntropyBackward(s.logits2, s.targets1, saved.lse, grad, ignore_index, d2)));
  return dlogits;
}

absl::StatusOr<Tensor> CountTargets(const Tensor& targets, int64_t num_classes, int64_t ignore_index) {
  constexpr const char* op = "CountTargets";
  DT_RETURN_IF_ERROR(CheckDefined(op, targets, "targets"));
  DT_RETURN_IF_ERROR(CheckIndex(op, targets, "targets"));
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, targets));
  DT_ASSIGN_OR_RETURN(Tensor t, Contiguous(targets));
  DT_ASSIGN_OR_RETURN(Tensor count, Tensor::Empty({}, DType::kFloat32, targets.device()));
  DT_RETURN_IF_ERROR(PrefixStatus(op, k->CountTargets(t, ignore_index, num_classes, count)));
  return count;
}

absl::StatusOr<CrossEntropyWithGradOutput> CrossEntropyWithGrad(const Tensor& logits, const Tensor& targets,
                                                                const Tensor& dloss, int64_t ignore_index,
                                                                const Tensor& count) {
  constexpr const char* op = "CrossEntropyWithGrad";
  DT_ASSIGN_OR_RETURN(CeShapes s, CheckCrossEntropyArgs(op, logits, targets));
  DT_RETURN_IF_ERROR(CheckDefined(op, dloss, "dloss"));
  if (dloss.numel() != 1 || dloss.dtype() != DType::kFloat32) {
    return InvalidArg(op, "dloss must be a float32 scalar, got ", dloss.ToString());
  }
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dloss, logits));
  CrossEntropyWithGradOutput o;
  if (count.defined()) {
    if (count.numel() != 1 || count.dtype() != DType::kFloat32) {
      return InvalidArg(op, "count must be a float32 scalar, got ", count.ToString());
    }
    DT_RETURN_IF_ERROR(CheckSameDevice(op, count, logits));
    DT_ASSIGN_OR_RETURN(o.count, Reshape(count, {}));
  } else {
    DT_ASSIGN_OR_RETURN(o.count, CountTargets(s.targets1, logits.dim() == 0 ? 1 : logits.size(-1), ignore_index));
  }
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, logits));
  // The gradient's weight per row, as CrossEntropyBackward computes it (mean reduction).
  DT_ASSIGN_OR_RETURN(Tensor d0, Reshape(dloss, {}));
  DT_ASSIGN_OR_RETURN(Tensor grad0, Div(d0, o.count));
  const int64_t n1[1] = {s.n};
  DT_ASSIGN_OR_RETURN(Tensor grad, grad0.Expand(n1));
  DT_ASSIGN_OR_RETURN(Tensor losses, Tensor::Empty(n1, DType::kFloat32, logits.device()));
  DT_ASSIGN_OR_RETURN(o.dlogits, Tensor::Empty(logits.shape(), logits.dtype(), logits.device()));
  if (s.n > 0) {
    const int64_t shape2[2] = {s.n, logits.size(-1)};
    DT_ASSIGN_OR_RETURN(Tensor d2, o.dlogits.View(shape2));
    DT_RETURN_IF_ERROR(
        PrefixStatus(op, k->CrossEntropyWithGrad(s.logits2, s.targets1, ignore_index, grad, losses, d2)));
  }
  DT_ASSIGN_OR_RETURN(Tensor total, Sum(losses));
  DT_ASSIGN_OR_RETURN(o.loss, Div(total, o.count));
  return o;
}

absl::Status ScaleByRatio_(const Tensor& x, const Tensor& num, const Tensor& den) {
  constexpr const char* op = "ScaleByRatio_";
  DT_RETURN_IF_ERROR(CheckDefined(op, x, "x"));
  DT_RETURN_IF_ERROR(CheckFloat(op, x));
  for (const Tensor* t : {&num, &den}) {
    DT_RETURN_IF_ERROR(CheckDefined(op, *t, "num/den"));
    if (t->numel() != 1 || t->dtype() != DType::kFloat32) {
      return InvalidArg(op, "num and den must be float32 scalars, got ", t->ToString());
    }
    DT_RETURN_IF_ERROR(CheckSameDevice(op, x, *t));
  }
  if (!x.is_contiguous()) return InvalidArg(op, "x must be contiguous, got ", x.ToString());
  if (x.numel() == 0) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, x));
  return PrefixStatus(op, k->ScaleByRatio(x, num, den));
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

namespace {

absl::Status CheckQkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  DT_RETURN_IF_ERROR(CheckDefined(op, q, "q"));
  DT_RETURN_IF_ERROR(CheckDefined(op, k, "k"));
  DT_RETURN_IF_ERROR(CheckDefined(op, v, "v"));
  DT_RETURN_IF_ERROR(CheckFloat(op, q));
  if (q.dim() != 4) return InvalidArg(op, "q must be [B, H, T, D], got ", ShapeString(q.shape()));
  DT_RETURN_IF_ERROR(CheckShapeEq(op, q, k, "q", "k"));
  DT_RETURN_IF_ERROR(CheckShapeEq(op, q, v, "q", "v"));
  DT_RETURN_IF_ERROR(CheckSameDType(op, q, k));
  DT_RETURN_IF_ERROR(CheckSameDType(op, q, v));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, q, k));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, q, v));
  return absl::OkStatus();
}

// What the backend gets for an attention operand: `t` itself where the backend takes row views
// and `t` is one (stride 1 along D, rows at least D apart), else a contiguous copy (t itself
// where contiguous).
absl::StatusOr<Tensor> AttentionOperand(const Kernels& kern, const Tensor& t) {
  if (kern.AttentionTakesRowViews() && t.stride(3) == 1 && (t.size(2) == 1 || t.stride(2) >= t.size(3))) return t;
  return Contiguous(t);
}

// Whether `like`'s rows lie as [B, T, H, D]: the heads of a [B, T, C] tensor, transposed.
bool RowsLieTimeMajor(const Tensor& like) {
  return like.size(1) > 1 && like.size(2) > 1 && like.stride(3) == 1 && like.stride(2) > like.stride(1);
}

// A [B, H, T, D] result laid out as `like` is (Kernels::AttentionTakesRowViews): as [B, T, H, D]
// where like's rows lie so, else contiguous.
absl::StatusOr<Tensor> AttentionResultLike(const Kernels& kern, const Tensor& like) {
  if (!kern.AttentionTakesRowViews() || !RowsLieTimeMajor(like)) {
    return Tensor::Empty(like.shape(), like.dtype(), like.device());
  }
  DT_ASSIGN_OR_RETURN(
      Tensor t, Tensor::Empty({like.size(0), like.size(2), like.size(1), like.size(3)}, like.dtype(), like.device()));
  return t.Transpose(1, 2);
}

// Whether q, k, v are the heads of one [B, T, 3, H, D] buffer: q's, k's and v's rows one after
// another (a fused qkv projection [B, T, 3C] split in three, each seen as [B, H, T, D]).
bool HeadsOfOneQkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t t = q.size(2), d = q.size(3), c = q.size(1) * d;
  const Shape want_shape = {t * 3 * c, d, 3 * c, 1};
  const IntSpan want(want_shape);
  return q.storage() == k.storage() && q.storage() == v.storage() && q.strides() == want && k.strides() == want &&
         v.strides() == want && k.storage_offset() == q.storage_offset() + c &&
         v.storage_offset() == k.storage_offset() + c;
}

float DefaultScale(const Tensor& q, float scale) {
  return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(q.size(3), 1)));
}

}  // namespace

absl::StatusOr<AttentionOutput> CausalAttention(const Tensor& q, const Tensor& k, const Tensor& v, float scale) {
  constexpr const char* op = "CausalAttention";
  DT_RETURN_IF_ERROR(CheckQkv(op, q, k, v));
  DT_ASSIGN_OR_RETURN(Kernels * kern, Backend(op, q));
  DT_ASSIGN_OR_RETURN(Tensor cq, AttentionOperand(*kern, q));
  DT_ASSIGN_OR_RETURN(Tensor ck, AttentionOperand(*kern, k));
  DT_ASSIGN_OR_RETURN(Tensor cv, AttentionOperand(*kern, v));
  AttentionOutput o;
  DT_ASSIGN_OR_RETURN(o.out, AttentionResultLike(*kern, q));
  DT_ASSIGN_OR_RETURN(o.lse, Tensor::Empty(q.shape().subspan(0, 3), DType::kFloat32, q.device()));
  if (q.numel() == 0) return o;
  DT_RETURN_IF_ERROR(PrefixStatus(op, kern->CausalAttention(cq, ck, cv, DefaultScale(q, scale), o.out, o.lse)));
  return o;
}

absl::StatusOr<AttentionGrads> CausalAttentionBackward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                       const Tensor& v, const AttentionOutput& saved, float scale) {
  constexpr const char* op = "CausalAttentionBackward";
  DT_RETURN_IF_ERROR(CheckQkv(op, q, k, v));
  DT_RETURN_IF_ERROR(CheckDefined(op, dout, "dout"));
  DT_RETURN_IF_ERROR(CheckShapeEq(op, dout, q, "dout", "q"));
  DT_RETURN_IF_ERROR(CheckSameDType(op, dout, q));
  DT_RETURN_IF_ERROR(CheckSameDevice(op, dout, q));
  if (!saved.out.defined() || saved.out.shape() != q.shape() || !saved.lse.defined() ||
      saved.lse.shape() != q.shape().subspan(0, 3)) {
    return InvalidArg(op, "saved forward outputs do not match q ", ShapeString(q.shape()));
  }
  DT_ASSIGN_OR_RETURN(Kernels * kern, Backend(op, q));
  DT_ASSIGN_OR_RETURN(Tensor cq, AttentionOperand(*kern, q));
  DT_ASSIGN_OR_RETURN(Tensor ck, AttentionOperand(*kern, k));
  DT_ASSIGN_OR_RETURN(Tensor cv, AttentionOperand(*kern, v));
  DT_ASSIGN_OR_RETURN(Tensor cdo, AttentionOperand(*kern, dout));
  DT_ASSIGN_OR_RETURN(Tensor co, AttentionOperand(*kern, saved.out));
  DT_ASSIGN_OR_RETURN(Tensor clse, Contiguous(saved.lse));
  AttentionGrads g;
  if (kern->AttentionTakesRowViews() && HeadsOfOneQkv(q, k, v)) {
    const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
    DT_ASSIGN_OR_RETURN(Tensor dqkv, Tensor::Empty({b, t, 3, h, d}, q.dtype(), q.device()));
    Tensor* grads[] = {&g.dq, &g.dk, &g.dv};
    for (int64_t j = 0; j < 3; ++j) {
      DT_ASSIGN_OR_RETURN(Tensor part, dqkv.Select(2, j));  // [B, T, H, D]
      DT_ASSIGN_OR_RETURN(*grads[j], part.Transpose(1, 2));
    }
  } else {
    DT_ASSIGN_OR_RETURN(g.dq, AttentionResultLike(*kern, q));
    DT_ASSIGN_OR_RETURN(g.dk, AttentionResultLike(*kern, k));
    DT_ASSIGN_OR_RETURN(g.dv, AttentionResultLike(*kern, v));
  }
  if (q.numel() == 0) return g;
  DT_RETURN_IF_ERROR(PrefixStatus(
      op, kern->CausalAttentionBackward(cdo, cq, ck, cv, co, clse, DefaultScale(q, scale), g.dq, g.dk, g.dv)));
  return g;
}

// ---------------------------------------------------------------------------------------------
// Optimizer
// ---------------------------------------------------------------------------------------------

namespace {
// AdamWStep_'s checks of one parameter's tensors and the hyperparameters.
absl::Status CheckAdamW(const char* op, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                        const AdamWParams& p) {
  DT_RETURN_IF_ERROR(CheckDefined(op, param, "param"));
  DT_RETURN_IF_ERROR(CheckDefined(op, grad, "grad"));
  DT_RETURN_IF_ERROR(CheckDefined(op, m, "m"));
  DT_RETURN_IF_ERROR(CheckDefined(op, v, "v"));
  DT_RETURN_IF_ERROR(CheckFloat(op, param));
  for (const Tensor* t : {&grad, &m, &v}) DT_RETURN_IF_ERROR(CheckSameDevice(op, param, *t));
  if (m.dtype() != DType::kFloat32 || v.dtype() != DType::kFloat32) {
    return InvalidArg(op, "optimizer state must be float32, got m ", DTypeName(m.dtype()), " and v ",
                      DTypeName(v.dtype()));
  }
  if (grad.dtype() != param.dtype() && grad.dtype() != DType::kFloat32) {
    return InvalidArg(op, "grad dtype ", DTypeName(grad.dtype()), " must be float32 or the param's ",
                      DTypeName(param.dtype()));
  }
  if (grad.numel() != param.numel() || m.numel() != param.numel() || v.numel() != param.numel()) {
    return InvalidArg(op, "sizes differ: param ", ShapeString(param.shape()), ", grad ", ShapeString(grad.shape()),
                      ", m ", ShapeString(m.shape()), ", v ", ShapeString(v.shape()));
  }
  if (!param.is_contiguous() || !m.is_contiguous() || !v.is_contiguous()) {
    return InvalidArg(op, "param, m and v must be contiguous (they are updated in place)");
  }
  if (p.step < 1) return InvalidArg(op, "step must be >= 1, got ", p.step);
  if (!(p.beta1 >= 0.0f && p.beta1 < 1.0f) || !(p.beta2 >= 0.0f && p.beta2 < 1.0f)) {
    return InvalidArg(op, "betas must lie in [0, 1), got ", p.beta1, " and ", p.beta2);
  }
  if (!(p.lr >= 0.0f) || !(p.eps >= 0.0f) || !(p.weight_decay >= 0.0f)) {
    return InvalidArg(op, "lr ", p.lr, ", eps ", p.eps, " and weight_decay ", p.weight_decay, " must be >= 0");
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status AdamWStep_(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                        const AdamWParams& p) {
  constexpr const char* op = "AdamW";
  DT_RETURN_IF_ERROR(CheckAdamW(op, param, grad, m, v, p));
  if (param.numel() == 0) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, param));
  DT_ASSIGN_OR_RETURN(Tensor g, Contiguous(grad));
  return PrefixStatus(op, k->AdamW(param, g, m, v, p));
}

absl::Status AdamWStepMulti_(absl::Span<const AdamWTensors> list, const AdamWParams& p) {
  constexpr const char* op = "AdamW";
  // Checked first, all of them: nothing moves when one entry is bad.
  std::vector<AdamWTensors> todo;
  todo.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    AdamWParams one = p;
    one.step = list[i].step;
    absl::Status s = CheckAdamW(op, list[i].param, list[i].grad, list[i].m, list[i].v, one);
    // grad_square_sum and grad_scale, where given: a float32 of one element on grad's device.
    for (const auto& [name, x] : {std::pair<const char*, const Tensor*>{"grad_square_sum", &list[i].grad_square_sum},
                                  {"grad_scale", &list[i].grad_scale}}) {
      if (!s.ok() || !x->defined()) continue;
      s = CheckSameDevice(op, list[i].grad, *x);
      if (s.ok() && (x->dtype() != DType::kFloat32 || x->numel() != 1)) {
        s = InvalidArg(op, name, " must be a float32 of one element, got ", DTypeName(x->dtype()), " ",
                       ShapeString(x->shape()));
      }
    }
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(s.message(), " (entry ", i, " of ", list.size(), ")"));
  }
  for (const AdamWTensors& t : list) {
    if (t.param.numel() > 0) {
      todo.push_back(t);
    } else if (t.grad_square_sum.defined()) {
      DT_RETURN_IF_ERROR(Fill_(t.grad_square_sum, 0.0));  // an empty gradient's sum
    }
  }
  // One backend call per device, in the order the devices first appear.
  std::vector<Device> devices;
  for (const AdamWTensors& t : todo) {
    if (std::find(devices.begin(), devices.end(), t.param.device()) == devices.end())
      devices.push_back(t.param.device());
  }
  for (const Device& d : devices) {
    std::vector<AdamWTensors> group;
    for (const AdamWTensors& t : todo) {
      if (t.param.device() != d) continue;
      AdamWTensors c = t;
      DT_ASSIGN_OR_RETURN(c.grad, Contiguous(t.grad));
      group.push_back(std::move(c));
    }
    DT_ASSIGN_OR_RETURN(Kernels * k, Backend(op, group.front().param));
    DT_RETURN_IF_ERROR(PrefixStatus(op, k->AdamWMulti(group, p)));
  }
  return absl::OkStatus();
}

absl::Status Synchronize(Device device) {
  DT_ASSIGN_OR_RETURN(Kernels * k, KernelsFor(device));
  return k->Synchronize();
}

}  // namespace dtensor
