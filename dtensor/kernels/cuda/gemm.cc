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
// The GEMMs with an epilogue run on cuBLASLt (LtMatmul), in the same column-major terms: D = c^T
// is [N, M], cuBLAS's A is our b and its B our a.
//   GemmBias      CUBLASLT_EPILOGUE_BIAS / GELU_AUX_BIAS: the bias is a vector over D's rows
//                 (our columns); the pre-GELU values go to the aux matrix (laid out as D, ld N).
//   GemmBiasGrad  CUBLASLT_EPILOGUE_BGRADB: the sums of cuBLAS's B (our a = dy^T) over the k
//                 dimension, one per column of D (our rows of c = dW): db.
//   GemmDgelu     CUBLASLT_EPILOGUE_DGELU_BGRAD: the product times gelu'(aux) (aux = pre, laid
//                 out as D, ld N), and its sums over D's columns (our rows), one per row of D: db.
// Per (thread, device): a cuBLASLt handle, a 32 MiB workspace from dtensor's allocator, and the
// chosen algorithm per problem (shapes, layouts, dtype, epilogue and the pointers' alignments),
// so cuBLASLt's heuristic runs once per problem. Where cuBLASLt is missing or declines a problem
// (no algorithm, an aux leading dim not a multiple of 8, a size over 32 bits), each falls back
// to Kernels' unfused default (Gemm, then the bias / GELU / reduction kernels).
//
// cuBLAS is loaded on first use (cublas_api.h). One handle per (thread, device), created on first use, bound to the
// thread's stream (cudaStreamPerThread) and destroyed when the thread exits.
#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <type_traits>

#include "dtensor/kernels/cuda/cublas_api.h"
#include "dtensor/kernels/cuda/cublaslt_api.h"
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

// ---- cuBLASLt (GemmBias, GemmBiasGrad, GemmDgelu) ----

// One problem's cuBLASLt objects and chosen algorithm (pointers are set per call).
struct LtPlan {
  const CublasLtApi* lt = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo = {};
  bool usable = false;  // false: cuBLASLt declined; the caller runs unfused
  bool ran = false;     // a matmul with it succeeded (a failing first one declines the plan)
  ~LtPlan() {
    if (lt == nullptr) return;
    if (desc != nullptr) lt->desc_destroy(desc);
    for (cublasLtMatrixLayout_t l : {a, b, d}) {
      if (l != nullptr) lt->layout_destroy(l);
    }
  }
};

// (m, n, k, trans a, trans b, ld a, ld b, dtype, epilogue, alignments of a, b, d, bias, aux)
using LtKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int, int, int, int, int, int, int>;

// Whether `epilogue` reads or writes the aux matrix (the pre-GELU values, [n, m] with ld n).
bool HasAux(cublasLtEpilogue_t epilogue) {
  return epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}

// This thread's cuBLASLt state for one device.
struct LtState {
  const CublasLtApi* lt = nullptr;
  cublasLtHandle_t handle = nullptr;
  Tensor workspace;
  std::map<LtKey, std::unique_ptr<LtPlan>> plans;
  ~LtState() {
    plans.clear();
    if (handle != nullptr) lt->destroy(handle);
  }
};

constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

// The largest power of two (up to 256) that divides the address.
int Alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && (v % static_cast<uintptr_t>(2 * a)) == 0) a *= 2;
  return a;
}

absl::StatusOr<LtState*> ThreadLt(int device) {
  thread_local std::array<std::unique_ptr<LtState>, kMaxDevices> states;
  if (device < 0 || device >= kMaxDevices) {
    return absl::InvalidArgumentError(absl::StrCat("[LtMatmul] cuda:", device, " is outside [0, ", kMaxDevices, ")"));
  }
  std::unique_ptr<LtState>& st = states[static_cast<size_t>(device)];
  if (!st) {
    auto fresh = std::make_unique<LtState>();
    DT_ASSIGN_OR_RETURN(fresh->lt, CublasLt());
    DT_RETURN_IF_ERROR(ToStatus(fresh->lt->create(&fresh->handle), "LtMatmul", device));
    DT_ASSIGN_OR_RETURN(fresh->workspace, Tensor::Empty({static_cast<int64_t>(kLtWorkspaceBytes / 4)}, DType::kInt32,
                                                        Device::Cuda(device)));
    st = std::move(fresh);
  }
  return st.get();
}

// Makes the plan for a problem: descriptors, then cuBLASLt's best algorithm (usable stays false
// when there is none).
absl::Status MakeLtPlan(const LtState& st, int device, const Operand& oa, const Operand& ob, int64_t m, int64_t n,
                        int64_t k, cudaDataType_t type, cublasLtEpilogue_t epilogue, const void* a_ptr,
                        const void* b_ptr, const void* d_ptr, const void* bias, const void* aux, LtPlan* plan) {
  const CublasLtApi* lt = st.lt;
  plan->lt = lt;
  auto ok = [&](cublasStatus_t s) { return ToStatus(s, "LtMatmul", device); };
  DT_RETURN_IF_ERROR(ok(lt->desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)));
  // cuBLAS's A is our b (N x K after op), its B our a (K x M after op), D is N x M (ld N).
  const cublasOperation_t ta = ob.layout.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = oa.layout.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))));
  DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb))));
  DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue))));
  // The bias (or bias gradient) vector is of the output's type.
  const int32_t bias_type = type;
  DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type))));
  // The heuristic reads the alignment of these pointers (LtMatmul sets them again per call).
  DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias))));
  if (HasAux(epilogue)) {  // the aux matrix is laid out as D: n rows (our columns), ld n
    const int64_t aux_ld = n;
    DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux))));
    DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld))));
  }
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  // A stored as op N: [N rows, K cols]; op T: [K rows, N cols] (column-major, leading dim ld).
  DT_RETURN_IF_ERROR(ok(
      lt->layout_create(&plan->a, type, ob.layout.trans ? u(k) : u(n), ob.layout.trans ? u(n) : u(k), ob.layout.ld)));
  DT_RETURN_IF_ERROR(ok(
      lt->layout_create(&plan->b, type, oa.layout.trans ? u(m) : u(k), oa.layout.trans ? u(k) : u(m), oa.layout.ld)));
  DT_RETURN_IF_ERROR(ok(lt->layout_create(&plan->d, type, u(n), u(m), n)));
  cublasLtMatmulPreference_t pref = nullptr;
  DT_RETURN_IF_ERROR(ok(lt->pref_create(&pref)));
  const uint64_t ws = kLtWorkspaceBytes;
  const uint32_t align_a = static_cast<uint32_t>(Alignment(b_ptr)), align_b = static_cast<uint32_t>(Alignment(a_ptr)),
                 align_d = static_cast<uint32_t>(Alignment(d_ptr));
  cublasStatus_t s = lt->pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (s == CUBLAS_STATUS_SUCCESS) s = lt->pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, 4);
  if (s == CUBLAS_STATUS_SUCCESS) s = lt->pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, 4);
  if (s == CUBLAS_STATUS_SUCCESS) s = lt->pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, 4);
  if (s == CUBLAS_STATUS_SUCCESS) s = lt->pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, 4);
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = lt->heuristic(st.handle, plan->desc, plan->a, plan->b, plan->d, plan->d, pref, 1, &result, &found);
  }
  lt->pref_destroy(pref);
  // Whatever the heuristic answers but an algorithm, cuBLASLt declines and the caller runs
  // unfused: NOT_SUPPORTED, no algorithm, or an error (support for an epilogue depends on the
  // operands' transposes and alignments, and a combination cuBLASLt lacks may be answered with
  // INVALID_VALUE). A fused GEMM is a speed-up, never worth failing the step for; a broken
  // context fails the unfused path as well.
  if (s == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    plan->algo = result.algo;
    plan->usable = true;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<bool> CudaBackend::LtMatmul(const char* op, const Tensor& a, const Tensor& b, const Tensor& c,
                                           int epilogue_value, const void* bias, const void* aux) {
  const auto epilogue = static_cast<cublasLtEpilogue_t>(epilogue_value);
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  if (m == 0 || n == 0 || k == 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) return false;
  // The aux leading dim (n) must be a multiple of 8 (cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD).
  if (HasAux(epilogue) && n % 8 != 0) return false;
  DeviceGuard guard(index_);
  if (!guard.ok()) return ToStatus(guard.error(), op, index_);
  absl::StatusOr<LtState*> st = ThreadLt(index_);
  if (!st.ok()) return false;  // no cuBLASLt: unfused
  DT_ASSIGN_OR_RETURN(Tensor a3, a.Unsqueeze(0));
  DT_ASSIGN_OR_RETURN(Tensor b3, b.Unsqueeze(0));
  Operand oa, ob;
  DT_RETURN_IF_ERROR(MakeOperand(a3, index_, &oa));
  DT_RETURN_IF_ERROR(MakeOperand(b3, index_, &ob));
  if (oa.layout.ld > INT_MAX || ob.layout.ld > INT_MAX) return false;
  const cudaDataType_t type = CudaType(c.dtype());
  const LtKey key{m,
                  n,
                  k,
                  oa.layout.trans,
                  ob.layout.trans,
                  oa.layout.ld,
                  ob.layout.ld,
                  static_cast<int>(type),
                  static_cast<int>(epilogue),
                  Alignment(oa.data),
                  Alignment(ob.data),
                  Alignment(c.raw_data()),
                  Alignment(bias),
                  HasAux(epilogue) ? Alignment(aux) : 0};
  std::unique_ptr<LtPlan>& plan = (*st)->plans[key];
  if (!plan) {
    auto fresh = std::make_unique<LtPlan>();
    DT_RETURN_IF_ERROR(MakeLtPlan(**st, index_, oa, ob, m, n, k, type, epilogue, oa.data, ob.data, c.raw_data(), bias,
                                  aux, fresh.get()));
    plan = std::move(fresh);
  }
  if (!plan->usable) return false;
  const CublasLtApi* lt = (*st)->lt;
  auto ok = [&](cublasStatus_t s) { return ToStatus(s, op, index_); };
  DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias))));
  if (HasAux(epilogue)) {
    DT_RETURN_IF_ERROR(ok(lt->desc_set(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux))));
  }
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t s = lt->matmul((*st)->handle, plan->desc, &alpha, ob.data, plan->a, oa.data, plan->b, &beta,
                                      c.raw_data(), plan->d, c.raw_data(), plan->d, &plan->algo,
                                      (*st)->workspace.raw_data(), kLtWorkspaceBytes, cudaStreamPerThread);
  if (s != CUBLAS_STATUS_SUCCESS && !plan->ran) {  // the plan's first call: declined from now on
    plan->usable = false;
    return false;
  }
  DT_RETURN_IF_ERROR(ok(s));
  plan->ran = true;
  return true;
}

absl::Status CudaBackend::GemmBias(const Tensor& a, const Tensor& b, const Tensor& bias, bool gelu, const Tensor& c,
                                   const Tensor& pre) {
  constexpr const char* op = "GemmBias";
  if (a.dim() != 2 || b.dim() != 2 || c.dim() != 2 || bias.dim() != 1) {
    return InvalidArg(op, "expects 2-d a, b, c and a 1-d bias; got ", ShapeString(a.shape()), ", ",
                      ShapeString(b.shape()), ", ", ShapeString(c.shape()), ", ", ShapeString(bias.shape()));
  }
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  if (a.size(0) != m || b.size(0) != k || b.size(1) != n || bias.size(0) != n ||
      (gelu && (!pre.defined() || pre.dim() != 2 || pre.size(0) != m || pre.size(1) != n))) {
    return InvalidArg(op, "shapes do not match: a ", ShapeString(a.shape()), ", b ", ShapeString(b.shape()), ", bias ",
                      ShapeString(bias.shape()), ", c ", ShapeString(c.shape()));
  }
  if (!IsComputeFloat(c.dtype()) || a.dtype() != c.dtype() || b.dtype() != c.dtype() || bias.dtype() != c.dtype() ||
      !c.is_contiguous() || !bias.is_contiguous() || (gelu && (!pre.is_contiguous() || pre.dtype() != c.dtype()))) {
    return Kernels::GemmBias(a, b, bias, gelu, c, pre);  // Gemm's checks and errors, or unfused
  }
  DT_ASSIGN_OR_RETURN(bool ran, LtMatmul(op, a, b, c, gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS,
                                         bias.raw_data(), gelu ? pre.raw_data() : nullptr));
  return ran ? absl::OkStatus() : Kernels::GemmBias(a, b, bias, gelu, c, pre);
}

absl::Status CudaBackend::GemmBiasGrad(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias_grad) {
  constexpr const char* op = "GemmBiasGrad";
  if (a.dim() != 2 || b.dim() != 2 || c.dim() != 2 || bias_grad.dim() != 1) {
    return InvalidArg(op, "expects 2-d a, b, c and a 1-d bias_grad; got ", ShapeString(a.shape()), ", ",
                      ShapeString(b.shape()), ", ", ShapeString(c.shape()), ", ", ShapeString(bias_grad.shape()));
  }
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  if (a.size(0) != m || b.size(0) != k || b.size(1) != n || bias_grad.size(0) != m) {
    return InvalidArg(op, "shapes do not match: a ", ShapeString(a.shape()), ", b ", ShapeString(b.shape()), ", c ",
                      ShapeString(c.shape()), ", bias_grad ", ShapeString(bias_grad.shape()));
  }
  if (!IsComputeFloat(c.dtype()) || a.dtype() != c.dtype() || b.dtype() != c.dtype() ||
      bias_grad.dtype() != c.dtype() || !c.is_contiguous() || !bias_grad.is_contiguous()) {
    return Kernels::GemmBiasGrad(a, b, c, bias_grad);  // Gemm's checks and errors, or unfused
  }
  // cuBLAS's B is our a (D = c^T is [n, m]): BGRADB sums B over k for each of D's m columns.
  DT_ASSIGN_OR_RETURN(bool ran, LtMatmul(op, a, b, c, CUBLASLT_EPILOGUE_BGRADB, bias_grad.raw_data(), nullptr));
  return ran ? absl::OkStatus() : Kernels::GemmBiasGrad(a, b, c, bias_grad);
}

absl::Status CudaBackend::GemmDgelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& c,
                                    const Tensor& bias_grad) {
  constexpr const char* op = "GemmDgelu";
  if (a.dim() != 2 || b.dim() != 2 || c.dim() != 2 || pre.dim() != 2 || bias_grad.dim() != 1) {
    return InvalidArg(op, "expects 2-d a, b, pre, c and a 1-d bias_grad; got ", ShapeString(a.shape()), ", ",
                      ShapeString(b.shape()), ", ", ShapeString(pre.shape()), ", ", ShapeString(c.shape()), ", ",
                      ShapeString(bias_grad.shape()));
  }
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  if (a.size(0) != m || b.size(0) != k || b.size(1) != n || pre.size(0) != m || pre.size(1) != n ||
      bias_grad.size(0) != n) {
    return InvalidArg(op, "shapes do not match: a ", ShapeString(a.shape()), ", b ", ShapeString(b.shape()), ", pre ",
                      ShapeString(pre.shape()), ", c ", ShapeString(c.shape()), ", bias_grad ",
                      ShapeString(bias_grad.shape()));
  }
  if (!IsComputeFloat(c.dtype()) || a.dtype() != c.dtype() || b.dtype() != c.dtype() || pre.dtype() != c.dtype() ||
      bias_grad.dtype() != c.dtype() || !c.is_contiguous() || !pre.is_contiguous() || !bias_grad.is_contiguous()) {
    return Kernels::GemmDgelu(a, b, pre, c, bias_grad);  // Gemm's checks and errors, or unfused
  }
  // D = c^T is [n, m]; DGELU_BGRAD reads pre as the aux matrix laid out as D and sums the
  // result over D's columns (our rows) for each of its n rows.
  DT_ASSIGN_OR_RETURN(bool ran,
                      LtMatmul(op, a, b, c, CUBLASLT_EPILOGUE_DGELU_BGRAD, bias_grad.raw_data(), pre.raw_data()));
  return ran ? absl::OkStatus() : Kernels::GemmDgelu(a, b, pre, c, bias_grad);
}

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
