// The CUDA implementation of Kernels, one object per device (CudaKernels() in cuda_kernels.cc).
// Methods are defined in cuda_kernels.cc and gemm.cc (host side: checks, layouts, scratch,
// device guard, error mapping), which call the launchers of launch.h implemented in the .cu
// files of this folder, one per op family. Internal (not installed).
#ifndef DTENSOR_KERNELS_CUDA_CUDA_BACKEND_H_
#define DTENSOR_KERNELS_CUDA_CUDA_BACKEND_H_

#include "dtensor/kernels/kernels.h"

namespace dtensor::internal {

class CudaBackend final : public Kernels {
 public:
  explicit CudaBackend(int index) : index_(index) {}
  int index() const { return index_; }

  Device device() const override;
  absl::Status Copy(const Tensor& src, const Tensor& dst) override;
  absl::Status Fill(const Tensor& dst, double value) override;
  absl::Status FillRandom(const Tensor& dst, const RandomSpec& spec, IntSpan global_shape,
                          IntSpan global_offset) override;
  absl::Status Binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) override;
  absl::Status BinaryScalar(BinaryOp op, const Tensor& a, double scalar, bool scalar_first, const Tensor& out) override;
  absl::Status Unary(UnaryOp op, const Tensor& a, const Tensor& out) override;
  absl::Status UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x, const Tensor& dx) override;
  absl::Status SumOfSquares(const Tensor& x, const Tensor& out) override;
  absl::Status Reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduce, int64_t inner,
                      const Tensor& out) override;
  absl::Status Softmax(const Tensor& x, const Tensor& y, bool log) override;
  absl::Status SoftmaxBackward(const Tensor& dy, const Tensor& y, const Tensor& dx, bool log) override;
  absl::Status LayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y,
                         const Tensor& mean, const Tensor& rstd) override;
  absl::Status AddLayerNorm(const Tensor& x, const Tensor& h, const Tensor& weight, const Tensor& bias, float eps,
                            const Tensor& x1, const Tensor& y, const Tensor& mean, const Tensor& rstd) override;
  absl::Status LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& dx, const Tensor& dweight,
                                 const Tensor& dbias) override;
  absl::Status LayerNormBackwardAdd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                    const Tensor& rstd, const Tensor& dresidual, const Tensor& dx,
                                    const Tensor& dweight, const Tensor& dbias) override;
  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const Tensor& rstd) override;
  absl::Status RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                               const Tensor& dx, const Tensor& dweight) override;
  absl::Status Gemm(const Tensor& a, const Tensor& b, const Tensor& c, float alpha, float beta) override;
  absl::Status GemmBias(const Tensor& a, const Tensor& b, const Tensor& bias, bool gelu, const Tensor& c,
                        const Tensor& pre) override;
  absl::Status GemmBiasGrad(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias_grad) override;
  absl::Status GemmDgelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& c,
                         const Tensor& bias_grad) override;
  absl::Status Embedding(const Tensor& weight, const Tensor& ids, const Tensor& out) override;
  absl::Status EmbeddingBackward(const Tensor& dout, const Tensor& ids, const Tensor& dweight) override;
  absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& losses,
                            const Tensor& valid, const Tensor& lse) override;
  absl::Status CrossEntropyBackward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& grad,
                                    int64_t ignore_index, const Tensor& dlogits) override;
  absl::Status CountTargets(const Tensor& targets, int64_t ignore_index, int64_t v, const Tensor& count) override;
  absl::Status CrossEntropyWithGrad(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                    const Tensor& grad, const Tensor& losses, const Tensor& dlogits) override;
  absl::Status ScaleByRatio(const Tensor& x, const Tensor& num, const Tensor& den) override;
  absl::Status CausalAttention(const Tensor& q, const Tensor& k, const Tensor& v, float scale, const Tensor& out,
                               const Tensor& lse) override;
  absl::Status CausalAttentionBackward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& lse, float scale, const Tensor& dq,
                                       const Tensor& dk, const Tensor& dv) override;
  bool AttentionTakesRowViews() const override { return true; }
  absl::Status AdamW(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                     const AdamWParams& p) override;
  absl::Status AdamWMulti(absl::Span<const AdamWTensors> list, const AdamWParams& p) override;
  absl::Status MemcpyToDevice(void* dst, const void* src, size_t nbytes, bool wait) override;
  absl::Status MemcpyToHost(void* dst, const void* src, size_t nbytes) override;
  absl::Status Synchronize() override;

 private:
  // t itself where contiguous, else a contiguous copy on this device (Copy reads any strides).
  absl::StatusOr<Tensor> ContiguousHere(const Tensor& t);
  // Where a kernel that writes contiguous tensors computes output t: t itself where contiguous,
  // else a new contiguous tensor, which CopyBackTo(computed, t) then copies into t (a no-op
  // where computed is t).
  absl::StatusOr<Tensor> ContiguousOutputHere(const Tensor& t);
  absl::Status CopyBackTo(const Tensor& computed, const Tensor& t);
  // c = a @ b on cuBLASLt with `epilogue` (gemm.cc): true when it ran, false when cuBLASLt is
  // missing or declines the problem (the caller then runs Kernels' unfused default): its
  // heuristic offers no algorithm or fails, or a problem's first matmul fails.
  absl::StatusOr<bool> LtMatmul(const char* op, const Tensor& a, const Tensor& b, const Tensor& c, int epilogue,
                                const void* bias, const void* aux);
  int index_;
};

}  // namespace dtensor::internal

#endif  // DTENSOR_KERNELS_CUDA_CUDA_BACKEND_H_
