// CUDA batched matrix multiply on cuBLAS (cublasGemmStridedBatchedEx, float32 compute for
// float32, bfloat16 and float16 operands; no TF32).
//
// cuBLAS is column-major and dtensor row-major: a row-major [R, C] matrix is, to cuBLAS, its
// transpose. So c = a @ b is computed as c^T = b^T a^T with the operands swapped
// (m = N, n = M, k = K) and ldc = N. An operand whose last dim has stride 1 is "row-major"
// (cuBLAS op N, leading dim = stride of the middle dim); one whose middle dim has stride 1 is a
// transposed view (op T, leading dim = stride of the last dim). An operand neither describes
// (e.g. a stride-0 row dim) is first packed into a contiguous scratch. Batch strides pass
// through as they are (0 broadcasts).
//
// cuBLAS is loaded on first use (cublas_api.h). One handle per (thread, device), created on first use, bound to the
// thread's stream (cudaStreamPerThread) and destroyed when the thread exits.
#include <algorithm>
#include <array>
#include <climits>
#include <memory>
#include <type_traits>

#include "dtensor/kernels/cuda/cublas_api.h"
#include "dtensor/kernels/cuda/cuda_backend.h"
#include "dtensor/kernels/cuda/cuda_common.h"
#include "dtensor/kernels/cuda/launch.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

constexpr int kMaxDevices = 16;

struct CublasDeleter {
  int device = 0;
  const CublasApi* cublas = nullptr;
  void operator()(cublasHandle_t h) const {
    DeviceGuard guard(device);
    cublas->destroy(h);
  }
};
using CublasHandle = std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, CublasDeleter>;

// This thread's handle for `device` (which must be current).
absl::StatusOr<cublasHandle_t> ThreadHandle(int device) {
  thread_local std::array<CublasHandle, kMaxDevices> handles;
  if (device < 0 || device >= kMaxDevices) {
    return absl::InvalidArgumentError(absl::StrCat("[Gemm] cuda:", device, " is outside [0, ", kMaxDevices, ")"));
  }
  CublasHandle& h = handles[static_cast<size_t>(device)];
  if (!h) {
    DT_ASSIGN_OR_RETURN(const CublasApi* cublas, Cublas());
    cublasHandle_t raw = nullptr;
    DT_RETURN_IF_ERROR(ToStatus(cublas->create(&raw), "Gemm", device));
    CublasHandle owned(raw, CublasDeleter{device, cublas});
    DT_RETURN_IF_ERROR(ToStatus(cublas->set_stream(raw, cudaStreamPerThread), "Gemm", device));
    h = std::move(owned);
  }
  return h.get();
}

// How a [rows, cols] operand with strides (sr, sc) looks to BLAS in row-major terms.
struct BlasLayout {
  bool ok = false;     // describable in place
  bool trans = false;  // element (i, j) at j * ld + i
  int64_t ld = 1;
};

BlasLayout Describe(int64_t rows, int64_t cols, int64_t sr, int64_t sc) {
  const int64_t min_row = std::max<int64_t>(cols, 1), min_col = std::max<int64_t>(rows, 1);
  if ((sc == 1 || cols == 1) && (rows == 1 || sr >= min_row)) return {true, false, rows == 1 ? min_row : sr};
  if ((sr == 1 || rows == 1) && (cols == 1 || sc >= min_col)) return {true, true, cols == 1 ? min_col : sc};
  return {};
}

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// An operand as cuBLAS will read it: data, layout, batch stride (and the scratch it may live in).
struct Operand {
  const void* data = nullptr;
  BlasLayout layout;
  int64_t batch_stride = 0;
  Tensor packed;  // keeps a packed copy alive until the gemm is enqueued
};

// x [batch, R, C] as an Operand, packing it into contiguous scratch when BLAS cannot read it.
// (An out-parameter rather than StatusOr<Operand>: g++ 12 reports a false "maybe
// uninitialized" in absl::InlinedVector when a StatusOr of a Tensor-holding struct is moved.)
absl::Status MakeOperand(const Tensor& x, int device, Operand* o) {
  o->layout = Describe(x.size(1), x.size(2), x.stride(1), x.stride(2));
  o->batch_stride = x.stride(0);
  o->data = x.raw_data();
  if (o->layout.ok) return absl::OkStatus();
  // Pack; a broadcast batch (stride 0) is packed once and stays broadcast.
  const int64_t batch = x.stride(0) == 0 ? 1 : x.size(0);
  const int64_t shape[3] = {batch, x.size(1), x.size(2)};
  DT_ASSIGN_OR_RETURN(o->packed, Tensor::Empty(shape, x.dtype(), Device::Cuda(device)));
  DT_ASSIGN_OR_RETURN(Tensor src, x.Narrow(0, 0, batch));
  DT_ASSIGN_OR_RETURN(auto l, Layouts<2>("Gemm", o->packed.shape(), {o->packed.strides(), src.strides()}));
  DT_RETURN_IF_ERROR(ToStatus(
      gpu::LaunchCopy(x.dtype(), o->packed.raw_data(), l[0], x.dtype(), src.raw_data(), l[1], o->packed.numel()),
      "Gemm", device));
  o->data = o->packed.raw_data();
  o->layout = BlasLayout{true, false, std::max<int64_t>(x.size(2), 1)};
  o->batch_stride = batch == 1 ? 0 : x.size(1) * x.size(2);
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaBackend::Gemm(const Tensor& a, const Tensor& b, const Tensor& c, float alpha, float beta) {
  constexpr const char* op = "Gemm";
  if (a.dim() != 3 || b.dim() != 3 || c.dim() != 3) {
    return InvalidArg(op, "expects 3-d a, b, c; got ", ShapeString(a.shape()), ", ", ShapeString(b.shape()), ", ",
                      ShapeString(c.shape()));
  }
  const int64_t batch = c.size(0), m = c.size(1), n = c.size(2), k = a.size(2);
  if (a.size(0) != batch || b.size(0) != batch || a.size(1) != m || b.size(1) != k || b.size(2) != n) {
    return InvalidArg(op, "shapes do not match: a ", ShapeString(a.shape()), ", b ", ShapeString(b.shape()), ", c ",
                      ShapeString(c.shape()));
  }
  if (a.dtype() != c.dtype() || b.dtype() != c.dtype()) {
    return InvalidArg(op, "dtypes differ: a ", DTypeName(a.dtype()), ", b ", DTypeName(b.dtype()), ", c ",
                      DTypeName(c.dtype()));
  }
  if (!IsComputeFloat(c.dtype())) {
    return absl::UnimplementedError(absl::StrCat("[Gemm] dtype ", DTypeName(c.dtype()), " is not supported on cuda"));
  }
  if (!c.is_contiguous()) return InvalidArg(op, "c ", c.ToString(), " must be contiguous");
  if (c.numel() == 0) return absl::OkStatus();

  DeviceGuard guard(index_);
  if (!guard.ok()) return ToStatus(guard.error(), op, index_);
  if (k == 0) {  // empty product: c = beta * c, and beta == 0 writes zeros even over NaN
    const gpu::Layout l = ContiguousLayout(c.numel());
    if (beta == 0.0f)
      return ToStatus(gpu::LaunchFill(c.raw_data(), l, c.numel(), ElementSize(c.dtype()), 0), op, index_);
    return ToStatus(
        gpu::LaunchBinaryScalar(gpu::BinOp::kMul, c.dtype(), c.raw_data(), c.raw_data(), l, c.numel(), beta, false), op,
        index_);
  }
  Operand oa, ob;
  DT_RETURN_IF_ERROR(MakeOperand(a, index_, &oa));
  DT_RETURN_IF_ERROR(MakeOperand(b, index_, &ob));
  for (int64_t v : {m, n, k, batch, oa.layout.ld, ob.layout.ld}) {
    if (v > INT_MAX) {
      return InvalidArg(op, "a size or leading dim (", v, ") exceeds cuBLAS's 32-bit limit: a ", ShapeString(a.shape()),
                        ", b ", ShapeString(b.shape()));
    }
  }
  DT_ASSIGN_OR_RETURN(cublasHandle_t handle, ThreadHandle(index_));
  DT_ASSIGN_OR_RETURN(const CublasApi* cublas, Cublas());  // loaded by ThreadHandle
  const cudaDataType_t type = CudaType(c.dtype());
  // c^T [N, M] = op(b) [N, K] @ op(a) [K, M] in cuBLAS's column-major terms.
  const cublasStatus_t st = cublas->gemm_strided_batched_ex(
      handle, ob.layout.trans ? CUBLAS_OP_T : CUBLAS_OP_N, oa.layout.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, ob.data, type,
      static_cast<int>(ob.layout.ld), static_cast<long long>(ob.batch_stride), oa.data, type,
      static_cast<int>(oa.layout.ld), static_cast<long long>(oa.batch_stride), &beta, c.raw_data(), type,
      static_cast<int>(n), static_cast<long long>(m * n), static_cast<int>(batch), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT);
  return ToStatus(st, op, index_);
}

}  // namespace dtensor::internal
