// CUDA embedding lookup and its scatter-add backward.
//
// Legend: weight, dweight [V, C]; ids [N] int32/int64; out, dout [N, C]; all contiguous.
// Forward: rows are copied as bytes; an id outside [0, V) gives a zero row (no device assert).
// Backward: float32 atomicAdd. A float32 dweight is accumulated in place. A bfloat16/float16
// dweight is widened into a float32 scratch [V, C], accumulated there and rounded back once,
// so repeated ids are summed in float32 as on the CPU (atomics on 16-bit values would round
// after every add). The order of the float additions, and so the last bits, may vary from run
// to run.
#include "dtensor/kernels/cuda/device_common.cuh"

namespace dtensor::internal::gpu {
namespace {

template <typename B, typename I>
__global__ void EmbeddingKernel(const B* weight, const I* ids, B* out, int64_t n, int64_t v, int64_t c) {
  const int64_t total = n * c;
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t r = i / c;
    const int64_t id = static_cast<int64_t>(ids[r]);
    out[i] = (id >= 0 && id < v) ? weight[id * c + (i - r * c)] : B{0};
  }
}

template <typename G, typename I>
__global__ void ScatterAddKernel(const G* dout, const I* ids, float* dweight, int64_t n, int64_t v, int64_t c) {
  const int64_t total = n * c;
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t r = i / c;
    const int64_t id = static_cast<int64_t>(ids[r]);
    if (id >= 0 && id < v) atomicAdd(dweight + id * c + (i - r * c), ToFloat(dout[i]));
  }
}

template <typename W>
__global__ void WidenKernel(const W* src, float* dst, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) dst[i] = ToFloat(src[i]);
}
template <typename W>
__global__ void NarrowKernel(const float* src, W* dst, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) dst[i] = FromFloat<W>(src[i]);
}

template <typename B>
cudaError_t EmbeddingBits(const void* weight, DType ids_dtype, const void* ids, void* out, int64_t n, int64_t v,
                          int64_t c) {
  return DispatchIndex(ids_dtype, [&](auto itag) {
    using I = typename decltype(itag)::type;
    EmbeddingKernel<B, I><<<GridFor(n * c), kThreads, 0, cudaStreamPerThread>>>(
        static_cast<const B*>(weight), static_cast<const I*>(ids), static_cast<B*>(out), n, v, c);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t LaunchEmbedding(DType weight_dtype, const void* weight, DType ids_dtype, const void* ids, void* out,
                            int64_t n, int64_t v, int64_t c) {
  if (n <= 0 || c <= 0) return cudaSuccess;
  switch (ElementSize(weight_dtype)) {
    case 1:
      return EmbeddingBits<uint8_t>(weight, ids_dtype, ids, out, n, v, c);
    case 2:
      return EmbeddingBits<uint16_t>(weight, ids_dtype, ids, out, n, v, c);
    case 4:
      return EmbeddingBits<uint32_t>(weight, ids_dtype, ids, out, n, v, c);
    case 8:
      return EmbeddingBits<uint64_t>(weight, ids_dtype, ids, out, n, v, c);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchEmbeddingBackward(DType dout_dtype, const void* dout, DType ids_dtype, const void* ids,
                                    DType weight_dtype, void* dweight, float* scratch, int64_t n, int64_t v,
                                    int64_t c) {
  if (n <= 0 || c <= 0 || v <= 0) return cudaSuccess;
  const bool wide = weight_dtype == DType::kFloat32;
  if (!wide && scratch == nullptr) return cudaErrorInvalidValue;
  float* acc = wide ? static_cast<float*>(dweight) : scratch;
  const int64_t vc = v * c;
  cudaError_t err = cudaSuccess;
  if (!wide) {
    err = DispatchFloat(weight_dtype, [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      WidenKernel<W><<<GridFor(vc), kThreads, 0, cudaStreamPerThread>>>(static_cast<const W*>(dweight), acc, vc);
      return cudaGetLastError();
    });
    if (err != cudaSuccess) return err;
  }
  err = DispatchFloat(dout_dtype, [&](auto gtag) {
    using G = typename decltype(gtag)::type;
    return DispatchIndex(ids_dtype, [&](auto itag) {
      using I = typename decltype(itag)::type;
      ScatterAddKernel<G, I><<<GridFor(n * c), kThreads, 0, cudaStreamPerThread>>>(
          static_cast<const G*>(dout), static_cast<const I*>(ids), acc, n, v, c);
      return cudaGetLastError();
    });
  });
  if (err != cudaSuccess || wide) return err;
  return DispatchFloat(weight_dtype, [&](auto wtag) {
    using W = typename decltype(wtag)::type;
    NarrowKernel<W><<<GridFor(vc), kThreads, 0, cudaStreamPerThread>>>(acc, static_cast<W*>(dweight), vc);
    return cudaGetLastError();
  });
}

}  // namespace dtensor::internal::gpu
