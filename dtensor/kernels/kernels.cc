#include "dtensor/kernels/kernels.h"

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/tensor/cuda_hooks.h"

namespace dtensor {

absl::Status Kernels::GemmBias(const Tensor& a, const Tensor& b, const Tensor& bias, bool gelu, const Tensor& c,
                               const Tensor& pre) {
  const Tensor& target = gelu ? pre : c;  // a @ b + bias goes here
  const int64_t m = c.size(0), n = c.size(1);
  auto three_d = [](const Tensor& t) { return t.Unsqueeze(0); };
  absl::StatusOr<Tensor> a3 = three_d(a), b3 = three_d(b), t3 = three_d(target);
  if (!a3.ok()) return a3.status();
  if (!b3.ok()) return b3.status();
  if (!t3.ok()) return t3.status();
  const int64_t rows_cols[2] = {m, n};
  absl::StatusOr<Tensor> rows = bias.Unsqueeze(0);
  if (rows.ok()) rows = rows->Expand(rows_cols);  // [M, N], row stride 0
  if (!rows.ok()) return rows.status();
  // The bias first, then the product accumulated onto it (beta = 1): Gemm sums in float32 and
  // rounds a 16-bit result once, as torch's addmm and cuBLASLt's epilogue. Adding the bias to
  // a product already rounded to bfloat16 would round twice (~1 ulp off).
  absl::Status s = Copy(*rows, target);
  if (s.ok() && a.size(1) > 0) s = Gemm(*a3, *b3, *t3, 1.0f, 1.0f);  // K = 0: the bias alone
  if (!s.ok() || !gelu) return s;
  return Unary(UnaryOp::kGelu, pre, c);
}

absl::Status Kernels::SumOfSquares(const Tensor& x, const Tensor& out) {
  absl::StatusOr<Tensor> sq = Tensor::Empty(x.shape(), DType::kFloat32, x.device());
  if (!sq.ok()) return sq.status();
  absl::Status s;
  if (x.dtype() == DType::kFloat32) {
    s = Binary(BinaryOp::kMul, x, x, *sq);
  } else {  // squared in float32 (a float16 sum of squares overflows past 65504)
    s = Copy(x, *sq);
    if (s.ok()) s = Binary(BinaryOp::kMul, *sq, *sq, *sq);
  }
  if (s.ok()) s = Reduce(ReduceOp::kSum, *sq, 1, x.numel(), 1, out);
  return s;
}

absl::Status Kernels::CrossEntropyWithGrad(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                           const Tensor& grad, const Tensor& losses, const Tensor& dlogits) {
  const int64_t n1[1] = {targets.numel()};
  absl::StatusOr<Tensor> valid = Tensor::Empty(n1, DType::kFloat32, logits.device());
  if (!valid.ok()) return valid.status();
  absl::StatusOr<Tensor> lse = Tensor::Empty(n1, DType::kFloat32, logits.device());
  if (!lse.ok()) return lse.status();
  absl::Status s = CrossEntropy(logits, targets, ignore_index, losses, *valid, *lse);
  if (!s.ok()) return s;
  return CrossEntropyBackward(logits, targets, *lse, grad, ignore_index, dlogits);
}

absl::Status Kernels::GemmBiasGrad(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias_grad) {
  absl::StatusOr<Tensor> a3 = a.Unsqueeze(0), b3 = b.Unsqueeze(0), c3 = c.Unsqueeze(0);
  if (!a3.ok()) return a3.status();
  if (!b3.ok()) return b3.status();
  if (!c3.ok()) return c3.status();
  absl::Status s = Gemm(*a3, *b3, *c3, 1.0f, 0.0f);
  if (!s.ok()) return s;
  // The sums over a's rows, read from a^T ([K, M]) as Sum reads a contiguous tensor.
  absl::StatusOr<Tensor> rows = a.Transpose(0, 1);
  if (!rows.ok()) return rows.status();
  Tensor dense = *rows;
  if (!dense.is_contiguous()) {
    absl::StatusOr<Tensor> copy = Tensor::Empty(rows->shape(), rows->dtype(), rows->device());
    if (!copy.ok()) return copy.status();
    s = Copy(*rows, *copy);
    if (!s.ok()) return s;
    dense = *copy;
  }
  return Reduce(ReduceOp::kSum, dense, 1, a.size(1), a.size(0), bias_grad);
}

absl::Status Kernels::GemmDgelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& c,
                                const Tensor& bias_grad) {
  absl::StatusOr<Tensor> product = Tensor::Empty(c.shape(), c.dtype(), c.device());
  if (!product.ok()) return product.status();
  absl::StatusOr<Tensor> a3 = a.Unsqueeze(0), b3 = b.Unsqueeze(0), p3 = product->Unsqueeze(0);
  if (!a3.ok()) return a3.status();
  if (!b3.ok()) return b3.status();
  if (!p3.ok()) return p3.status();
  absl::Status s = Gemm(*a3, *b3, *p3, 1.0f, 0.0f);
  if (s.ok()) s = UnaryBackward(UnaryOp::kGelu, *product, pre, c);
  if (!s.ok()) return s;
  return Reduce(ReduceOp::kSum, c, 1, c.size(0), c.size(1), bias_grad);
}

absl::Status Kernels::AddLayerNorm(const Tensor& x, const Tensor& h, const Tensor& weight, const Tensor& bias,
                                   float eps, const Tensor& x1, const Tensor& y, const Tensor& mean,
                                   const Tensor& rstd) {
  absl::Status s = Binary(BinaryOp::kAdd, x, h, x1);
  if (!s.ok()) return s;
  return LayerNorm(x1, weight, bias, eps, y, mean, rstd);
}

absl::Status Kernels::LayerNormBackwardAdd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                           const Tensor& rstd, const Tensor& dresidual, const Tensor& dx,
                                           const Tensor& dweight, const Tensor& dbias) {
  absl::Status s = LayerNormBackward(dy, x, weight, mean, rstd, dx, dweight, dbias);
  if (!s.ok() || x.numel() == 0) return s;
  return Binary(BinaryOp::kAdd, dx, dresidual, dx);  // in place: out is exactly `a`
}

absl::Status Kernels::AdamWMulti(absl::Span<const AdamWTensors> list, const AdamWParams& p) {
  for (const AdamWTensors& t : list) {
    if (t.grad_square_sum.defined()) {
      absl::Status s = SumOfSquares(t.grad, t.grad_square_sum);
      if (!s.ok()) return s;
    }
    AdamWParams one = p;
    one.step = t.step;
    Tensor grad = t.grad;
    if (t.grad_scale.defined()) {  // a scaled float32 copy: the caller's gradient stays as it is
      absl::StatusOr<Tensor> scaled = Tensor::Empty(t.grad.shape(), DType::kFloat32, t.grad.device());
      if (!scaled.ok()) return scaled.status();
      absl::StatusOr<Tensor> factor = t.grad_scale.View(Shape(static_cast<size_t>(t.grad.dim()), 1));
      if (factor.ok()) factor = factor->Expand(t.grad.shape());
      if (!factor.ok()) return factor.status();
      absl::Status s = Copy(t.grad, *scaled);
      if (s.ok()) s = Binary(BinaryOp::kMul, *scaled, *factor, *scaled);
      if (!s.ok()) return s;
      grad = *scaled;
    }
    absl::Status s = AdamW(t.param, grad, t.m, t.v, one);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<Kernels*> KernelsFor(Device device) {
  if (device.is_cpu()) return CpuKernels();
  // The CUDA backend comes from the cuda component when it is linked in (cuda_hooks.h).
  const internal::CudaHooks* cuda = internal::GetCudaHooks();
  if (cuda == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("[KernelsFor] ", device.ToString(), " requested but ", internal::CudaNotLinkedMessage()));
  }
  return cuda->kernels(device.index);
}

}  // namespace dtensor
