// STUB: to be implemented (split per op family into several .cu files).
#include "dtensor/kernels/cuda/cuda_backend.h"
#include "dtensor/kernels/cuda/cuda_kernels.h"

#include <cuda_runtime.h>

#include <mutex>

#include "absl/strings/str_cat.h"

namespace dtensor::internal {

Device CudaBackend::device() const { return Device::Cuda(index_); }

absl::Status CudaBackend::Copy(const Tensor& /*src*/, const Tensor& /*dst*/) {
  return absl::UnimplementedError("[Copy] cuda kernel not written yet");
}

absl::Status CudaBackend::Fill(const Tensor& /*dst*/, double /*value*/) {
  return absl::UnimplementedError("[Fill] cuda kernel not written yet");
}

absl::Status CudaBackend::FillRandom(const Tensor& /*dst*/, const RandomSpec& /*spec*/, IntSpan /*global_shape*/, IntSpan /*global_offset*/) {
  return absl::UnimplementedError("[FillRandom] cuda kernel not written yet");
}

absl::Status CudaBackend::Binary(BinaryOp /*op*/, const Tensor& /*a*/, const Tensor& /*b*/, const Tensor& /*out*/) {
  return absl::UnimplementedError("[Binary] cuda kernel not written yet");
}

absl::Status CudaBackend::BinaryScalar(BinaryOp /*op*/, const Tensor& /*a*/, double /*scalar*/, bool /*scalar_first*/, const Tensor& /*out*/) {
  return absl::UnimplementedError("[BinaryScalar] cuda kernel not written yet");
}

absl::Status CudaBackend::Unary(UnaryOp /*op*/, const Tensor& /*a*/, const Tensor& /*out*/) {
  return absl::UnimplementedError("[Unary] cuda kernel not written yet");
}

absl::Status CudaBackend::UnaryBackward(UnaryOp /*op*/, const Tensor& /*dy*/, const Tensor& /*x*/, const Tensor& /*dx*/) {
  return absl::UnimplementedError("[UnaryBackward] cuda kernel not written yet");
}

absl::Status CudaBackend::Reduce(ReduceOp /*op*/, const Tensor& /*x*/, int64_t /*outer*/, int64_t /*reduce*/, int64_t /*inner*/, const Tensor& /*out*/) {
  return absl::UnimplementedError("[Reduce] cuda kernel not written yet");
}

absl::Status CudaBackend::Softmax(const Tensor& /*x*/, const Tensor& /*y*/, bool /*log*/) {
  return absl::UnimplementedError("[Softmax] cuda kernel not written yet");
}

absl::Status CudaBackend::SoftmaxBackward(const Tensor& /*dy*/, const Tensor& /*y*/, const Tensor& /*dx*/, bool /*log*/) {
  return absl::UnimplementedError("[SoftmaxBackward] cuda kernel not written yet");
}

absl::Status CudaBackend::LayerNorm(const Tensor& /*x*/, const Tensor& /*weight*/, const Tensor& /*bias*/, float /*eps*/, const Tensor& /*y*/, const Tensor& /*mean*/, const Tensor& /*rstd*/) {
  return absl::UnimplementedError("[LayerNorm] cuda kernel not written yet");
}

absl::Status CudaBackend::LayerNormBackward(const Tensor& /*dy*/, const Tensor& /*x*/, const Tensor& /*weight*/, const Tensor& /*mean*/, const Tensor& /*rstd*/, const Tensor& /*dx*/, const Tensor& /*dweight*/, const Tensor& /*dbias*/) {
  return absl::UnimplementedError("[LayerNormBackward] cuda kernel not written yet");
}

absl::Status CudaBackend::RmsNorm(const Tensor& /*x*/, const Tensor& /*weight*/, float /*eps*/, const Tensor& /*y*/, const Tensor& /*rstd*/) {
  return absl::UnimplementedError("[RmsNorm] cuda kernel not written yet");
}

absl::Status CudaBackend::RmsNormBackward(const Tensor& /*dy*/, const Tensor& /*x*/, const Tensor& /*weight*/, const Tensor& /*rstd*/, const Tensor& /*dx*/, const Tensor& /*dweight*/) {
  return absl::UnimplementedError("[RmsNormBackward] cuda kernel not written yet");
}

absl::Status CudaBackend::Gemm(const Tensor& /*a*/, const Tensor& /*b*/, const Tensor& /*c*/, float /*alpha*/, float /*beta*/) {
  return absl::UnimplementedError("[Gemm] cuda kernel not written yet");
}

absl::Status CudaBackend::Embedding(const Tensor& /*weight*/, const Tensor& /*ids*/, const Tensor& /*out*/) {
  return absl::UnimplementedError("[Embedding] cuda kernel not written yet");
}

absl::Status CudaBackend::EmbeddingBackward(const Tensor& /*dout*/, const Tensor& /*ids*/, const Tensor& /*dweight*/) {
  return absl::UnimplementedError("[EmbeddingBackward] cuda kernel not written yet");
}

absl::Status CudaBackend::CrossEntropy(const Tensor& /*logits*/, const Tensor& /*targets*/, int64_t /*ignore_index*/, const Tensor& /*losses*/, const Tensor& /*valid*/, const Tensor& /*lse*/) {
  return absl::UnimplementedError("[CrossEntropy] cuda kernel not written yet");
}

absl::Status CudaBackend::CrossEntropyBackward(const Tensor& /*logits*/, const Tensor& /*targets*/, const Tensor& /*lse*/, const Tensor& /*grad*/, int64_t /*ignore_index*/, const Tensor& /*dlogits*/) {
  return absl::UnimplementedError("[CrossEntropyBackward] cuda kernel not written yet");
}

absl::Status CudaBackend::CausalAttention(const Tensor& /*q*/, const Tensor& /*k*/, const Tensor& /*v*/, float /*scale*/, const Tensor& /*out*/, const Tensor& /*lse*/) {
  return absl::UnimplementedError("[CausalAttention] cuda kernel not written yet");
}

absl::Status CudaBackend::CausalAttentionBackward(const Tensor& /*dout*/, const Tensor& /*q*/, const Tensor& /*k*/, const Tensor& /*v*/, const Tensor& /*out*/, const Tensor& /*lse*/, float /*scale*/, const Tensor& /*dq*/, const Tensor& /*dk*/, const Tensor& /*dv*/) {
  return absl::UnimplementedError("[CausalAttentionBackward] cuda kernel not written yet");
}

absl::Status CudaBackend::AdamW(const Tensor& /*param*/, const Tensor& /*grad*/, const Tensor& /*m*/, const Tensor& /*v*/, const AdamWParams& /*p*/) {
  return absl::UnimplementedError("[AdamW] cuda kernel not written yet");
}

absl::Status CudaBackend::MemcpyToDevice(void* /*dst*/, const void* /*src*/, size_t /*nbytes*/) {
  return absl::UnimplementedError("[MemcpyToDevice] cuda kernel not written yet");
}

absl::Status CudaBackend::MemcpyToHost(void* /*dst*/, const void* /*src*/, size_t /*nbytes*/) {
  return absl::UnimplementedError("[MemcpyToHost] cuda kernel not written yet");
}

absl::Status CudaBackend::Synchronize() {
  return absl::UnimplementedError("[Synchronize] cuda kernel not written yet");
}

}  // namespace dtensor::internal

namespace dtensor {

absl::StatusOr<Kernels*> CudaKernels(int index) {
  const int count = CudaDeviceCount();
  if (index < 0 || index >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("[CudaKernels] cuda:", index, " requested but ", count, " CUDA devices are visible"));
  }
  static internal::CudaBackend* backends[16] = {};
  static std::once_flag once[16];
  if (index >= 16) return absl::InvalidArgumentError(absl::StrCat("[CudaKernels] device index ", index, " >= 16"));
  std::call_once(once[index], [&] { backends[index] = new internal::CudaBackend(index); });
  return backends[index];
}

}  // namespace dtensor
