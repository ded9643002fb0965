#include "dtensor/kernels/cuda/cudnn_sdpa.h"

#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/kernels/cuda/cuda_common.h"
#include "dtensor/kernels/cuda/cudnn_api.h"
#include "dtensor/tensor/device.h"
#include "dtensor/tensor/status.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::internal {
namespace {

constexpr int kMaxDevices = 16;
using Dims = std::array<int64_t, 4>;

// Short names for the tensor ids (cudnn_sdpa.h).
constexpr int64_t kQ = kSdpaQ, kK = kSdpaK, kV = kSdpaV, kO = kSdpaO, kStats = kSdpaStats, kDO = kSdpaDO, kDQ = kSdpaDQ,
                  kDK = kSdpaDK, kDV = kSdpaDV, kScale = kSdpaScale, kNegInf = kSdpaNegInf, kOne = kSdpaOne,
                  kSoftmaxSum = kSdpaSoftmaxSum, kDQAccum = kSdpaDQAccum, kFirstVirtual = kSdpaFirstVirtual;

// Owns backend descriptors; destroys them in reverse order of creation.
class Descriptors {
 public:
  explicit Descriptors(const CudnnApi& api) : api_(api) {}
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  ~Descriptors() {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api_.destroy_desc(*it);
  }
  absl::StatusOr<cudnnBackendDescriptor_t> Create(cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t d = nullptr;
    DT_RETURN_IF_ERROR(api_.Check(api_.create_desc(type, &d), "cudnnBackendCreateDescriptor"));
    owned_.push_back(d);
    return d;
  }
  const CudnnApi& api() const { return api_; }

 private:
  const CudnnApi& api_;
  std::vector<cudnnBackendDescriptor_t> owned_;
};

// Builds one operation graph: tensors, then operations on them, always as data (graph()) and,
// given descriptors, in cuDNN. The first error sticks; every later call is a no-op, so a graph
// reads as a list of calls with one check at the end.
class GraphBuilder {
 public:
  explicit GraphBuilder(Descriptors* descs) : descs_(descs) {}

  // A tensor; `uid` 0 allocates the next virtual id. Returns the uid.
  int64_t Tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides, bool is_virtual,
                 bool by_value = false) {
    if (uid == 0) uid = next_virtual_++;
    graph_.tensors.push_back(SdpaGraphTensor{uid, Describe(type), dims, strides, is_virtual, by_value});
    cudnnBackendDescriptor_t d = Create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    Set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor data type");
    Set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dims");
    Set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides");
    Set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    Set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    Set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor is_virtual");
    if (by_value) Set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor is_by_value");
    Finalize(d, "tensor");
    tensors_[uid] = TensorInfo{d, dims, strides};
    return uid;
  }
  // A virtual tensor like `like` (dims, strides), of `type`.
  int64_t VirtualLike(int64_t like, cudnnDataType_t type) {
    const TensorInfo& t = tensors_[like];
    return Tensor(0, type, t.dims, t.strides, /*is_virtual=*/true);
  }
  // A float scalar passed by value at execution.
  int64_t Scalar(int64_t uid) { return Tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

  // c = a @ b over the last two dims (float32 accumulation).
  void Matmul(int64_t a, int64_t b, int64_t c) {
    graph_.ops.push_back(SdpaGraphOp{SdpaGraphOp::Kind::kMatmul, a, b, 0, c});
    cudnnBackendDescriptor_t md = Create(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    Set(md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "matmul compute type");
    Finalize(md, "matmul descriptor");
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    SetTensor(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    SetTensor(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    SetTensor(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md, "matmul desc");
    AddOp(op, "matmul");
  }
  // y = mode(x[, b[, t]]), computed in `compute`; `axis` for GEN_INDEX.
  void Pointwise(cudnnPointwiseMode_t mode, int64_t x, int64_t y, int64_t b = 0, int64_t t = 0,
                 cudnnDataType_t compute = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    graph_.ops.push_back(SdpaGraphOp{Describe(mode), x, b, t, y, axis});
    cudnnBackendDescriptor_t pw = Create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute, "pointwise precision");
    if (mode == CUDNN_POINTWISE_GEN_INDEX) Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "axis");
    Finalize(pw, "pointwise descriptor");
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, "pw desc");
    SetTensor(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b != 0) SetTensor(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t != 0) SetTensor(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    SetTensor(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    AddOp(op, "pointwise");
  }
  // y = reduce(x) over the dims where y has extent 1.
  void Reduction(cudnnReduceTensorOp_t mode, int64_t x, int64_t y) {
    graph_.ops.push_back(SdpaGraphOp{
        mode == CUDNN_REDUCE_TENSOR_MAX ? SdpaGraphOp::Kind::kReduceMax : SdpaGraphOp::Kind::kReduceAdd, x, 0, 0, y});
    cudnnBackendDescriptor_t rd = Create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    const bool deterministic = false;
    Set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "reduction compute type");
    Set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction operator");
    // The attribute exists from cuDNN 9.11 (9.8-9.10 refuse it; cudnn-frontend sets it only there).
    if (Live() && descs_->api().version() >= 91100) {
      Set(rd, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &deterministic, "reduction determinism");
    }
    Finalize(rd, "reduction descriptor");
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd, "reduction desc");
    SetTensor(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    SetTensor(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    AddOp(op, "reduction");
  }
  // y = x seen through y's dims and strides (a transpose, here).
  void Reshape(int64_t x, int64_t y) {
    graph_.ops.push_back(SdpaGraphOp{SdpaGraphOp::Kind::kReshape, x, 0, 0, y});
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    SetTensor(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    SetTensor(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    AddOp(op, "reshape");
  }

  // The finalized operation graph (with descriptors).
  absl::StatusOr<cudnnBackendDescriptor_t> Build(cudnnHandle_t handle) {
    if (descs_ == nullptr) return absl::InternalError("[cuDNN] GraphBuilder::Build without descriptors");
    cudnnBackendDescriptor_t g = Create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    Set(g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()), ops_.data(),
        "graph ops");
    if (handle != nullptr) Set(g, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "graph handle");
    Finalize(g, "operation graph");
    DT_RETURN_IF_ERROR(status_);
    return g;
  }
  const SdpaGraph& graph() const { return graph_; }

 private:
  struct TensorInfo {
    cudnnBackendDescriptor_t desc = nullptr;
    Dims dims{}, strides{};
  };
  static SdpaGraphTensor::Type Describe(cudnnDataType_t t) {
    switch (t) {
      case CUDNN_DATA_FLOAT:
        return SdpaGraphTensor::Type::kFloat32;
      case CUDNN_DATA_INT32:
        return SdpaGraphTensor::Type::kInt32;
      case CUDNN_DATA_BOOLEAN:
        return SdpaGraphTensor::Type::kBool;
      default:
        return SdpaGraphTensor::Type::kIo;
    }
  }
  static SdpaGraphOp::Kind Describe(cudnnPointwiseMode_t m) {
    switch (m) {
      case CUDNN_POINTWISE_MUL:
        return SdpaGraphOp::Kind::kMul;
      case CUDNN_POINTWISE_SUB:
        return SdpaGraphOp::Kind::kSub;
      case CUDNN_POINTWISE_ADD:
        return SdpaGraphOp::Kind::kAdd;
      case CUDNN_POINTWISE_DIV:
        return SdpaGraphOp::Kind::kDiv;
      case CUDNN_POINTWISE_EXP:
        return SdpaGraphOp::Kind::kExp;
      case CUDNN_POINTWISE_LOG:
        return SdpaGraphOp::Kind::kLog;
      case CUDNN_POINTWISE_GEN_INDEX:
        return SdpaGraphOp::Kind::kGenIndex;
      case CUDNN_POINTWISE_CMP_GE:
        return SdpaGraphOp::Kind::kCmpGe;
      case CUDNN_POINTWISE_BINARY_SELECT:
        return SdpaGraphOp::Kind::kSelect;
      default:
        return SdpaGraphOp::Kind::kIdentity;
    }
  }
  void Fail(absl::Status s) {
    if (status_.ok()) status_ = std::move(s);
  }
  bool Live() const { return descs_ != nullptr && status_.ok(); }
  cudnnBackendDescriptor_t Create(cudnnBackendDescriptorType_t type) {
    if (!Live()) return nullptr;
    absl::StatusOr<cudnnBackendDescriptor_t> d = descs_->Create(type);
    if (!d.ok()) return Fail(d.status()), nullptr;
    return *d;
  }
  void Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void* value, const char* what) {
    if (!Live()) return;
    Fail(descs_->api().Check(descs_->api().set(d, name, type, count, value), what));
  }
  void SetTensor(cudnnBackendDescriptor_t op, cudnnBackendAttributeName_t name, int64_t uid) {
    auto it = tensors_.find(uid);
    if (it == tensors_.end()) {
      return Fail(absl::InternalError(absl::StrCat("[cuDNN] graph uses tensor ", uid, " before creating it")));
    }
    Set(op, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &it->second.desc, "operation tensor");
  }
  void Finalize(cudnnBackendDescriptor_t d, const char* what) {
    if (!Live()) return;
    Fail(descs_->api().Check(descs_->api().finalize(d), absl::StrCat("finalize ", what).c_str()));
  }
  void AddOp(cudnnBackendDescriptor_t op, const char* what) {
    Finalize(op, what);
    ops_.push_back(op);
  }

  Descriptors* descs_;
  absl::Status status_;
  int64_t next_virtual_ = kFirstVirtual;
  std::map<int64_t, TensorInfo> tensors_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  SdpaGraph graph_;
};

Dims Contiguous(const Dims& d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }
// A [b, h, t, d] operand's strides: given, or contiguous where all zero.
Dims StridesOf(const Dims& given, const Dims& dims) { return given == Dims{} ? Contiguous(dims) : given; }
// The strides of that operand seen as its transpose [b, h, d, t].
Dims Transposed(const Dims& s) { return {s[0], s[1], s[3], s[2]}; }

// The causal mask (cudnn-frontend's diagonal band with right bound 0, top-left aligned):
// s where row >= col, else -inf. Returns the masked scores' uid.
int64_t CausalMask(GraphBuilder& g, int64_t s) {
  const int64_t row = g.VirtualLike(s, CUDNN_DATA_INT32);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, s, row, 0, 0, CUDNN_DATA_FLOAT, /*axis=*/2);
  const int64_t col = g.VirtualLike(s, CUDNN_DATA_INT32);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, s, col, 0, 0, CUDNN_DATA_FLOAT, /*axis=*/3);
  const int64_t keep = g.VirtualLike(s, CUDNN_DATA_BOOLEAN);
  g.Pointwise(CUDNN_POINTWISE_CMP_GE, row, keep, col, 0, CUDNN_DATA_BOOLEAN);
  const int64_t out = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, out, kNegInf, keep);
  return out;
}

cudnnDataType_t IoType(DType t) { return t == DType::kFloat16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16; }

void ForwardGraph(GraphBuilder& g, const SdpaProblem& p) {
  const int64_t b = p.b, h = p.h, t = p.t, d = p.d;
  const cudnnDataType_t io = IoType(p.dtype);
  const Dims bhtd{b, h, t, d}, bhtt{b, h, t, t}, bht1{b, h, t, 1};
  g.Tensor(kQ, io, bhtd, StridesOf(p.q_strides, bhtd), false);
  g.Tensor(kK, io, {b, h, d, t}, Transposed(StridesOf(p.k_strides, bhtd)), false);  // K^T: K's storage
  g.Tensor(kV, io, bhtd, StridesOf(p.v_strides, bhtd), false);
  g.Tensor(kO, io, bhtd, StridesOf(p.o_strides, bhtd), false);
  g.Tensor(kStats, CUDNN_DATA_FLOAT, bht1, Contiguous(bht1), false);
  g.Scalar(kScale);
  g.Scalar(kNegInf);

  const int64_t s = g.Tensor(0, CUDNN_DATA_FLOAT, bhtt, Contiguous(bhtt), true);
  g.Matmul(kQ, kK, s);
  const int64_t scaled = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, s, scaled, kScale);
  const int64_t masked = CausalMask(g, scaled);
  // Softmax, with the row statistics out (cudnn-frontend's composite softmax).
  const int64_t max = g.Tensor(0, CUDNN_DATA_FLOAT, bht1, Contiguous(bht1), true);
  g.Reduction(CUDNN_REDUCE_TENSOR_MAX, masked, max);
  const int64_t centered = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_SUB, masked, centered, max);
  const int64_t e = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_EXP, centered, e);
  const int64_t sum = g.Tensor(0, CUDNN_DATA_FLOAT, bht1, Contiguous(bht1), true);
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const int64_t log_sum = g.VirtualLike(sum, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_LOG, sum, log_sum);
  g.Pointwise(CUDNN_POINTWISE_ADD, max, kStats, log_sum);
  const int64_t probs = g.VirtualLike(s, io);  // P in the io type: the second matmul's operand
  g.Pointwise(CUDNN_POINTWISE_DIV, e, probs, sum);
  g.Matmul(probs, kV, kO);
}

void BackwardGraph(GraphBuilder& g, const SdpaProblem& p) {
  const int64_t b = p.b, h = p.h, t = p.t, d = p.d;
  const cudnnDataType_t io = IoType(p.dtype);
  const Dims bhtd{b, h, t, d}, bhtt{b, h, t, t}, bht1{b, h, t, 1};
  g.Tensor(kQ, io, bhtd, StridesOf(p.q_strides, bhtd), false);
  g.Tensor(kK, io, {b, h, d, t}, Transposed(StridesOf(p.k_strides, bhtd)), false);  // K^T
  g.Tensor(kV, io, {b, h, d, t}, Transposed(StridesOf(p.v_strides, bhtd)), false);  // V^T
  g.Tensor(kO, io, bhtd, StridesOf(p.o_strides, bhtd), false);
  g.Tensor(kDO, io, bhtd, StridesOf(p.do_strides, bhtd), false);
  g.Tensor(kStats, CUDNN_DATA_FLOAT, bht1, Contiguous(bht1), false);
  g.Tensor(kDQ, io, bhtd, StridesOf(p.dq_strides, bhtd), false);
  g.Tensor(kDK, io, bhtd, StridesOf(p.dk_strides, bhtd), false);
  g.Tensor(kDV, io, bhtd, StridesOf(p.dv_strides, bhtd), false);
  g.Tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, bht1, Contiguous(bht1), false);
  g.Tensor(kDQAccum, CUDNN_DATA_FLOAT, bhtd, Contiguous(bhtd), false);
  g.Scalar(kScale);
  g.Scalar(kNegInf);
  g.Scalar(kOne);

  // D = sum(dO * O) per row (times the dropout scale's inverse, 1 here).
  const int64_t prod = g.Tensor(0, CUDNN_DATA_FLOAT, bhtd, {h * t * d, t * d, h * d, 1}, true);
  g.Pointwise(CUDNN_POINTWISE_MUL, kDO, prod, kO);
  const int64_t rowsum = g.Tensor(0, CUDNN_DATA_FLOAT, bht1, Contiguous(bht1), true);
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, prod, rowsum);
  g.Pointwise(CUDNN_POINTWISE_MUL, rowsum, kSoftmaxSum, kOne);

  // E = exp(causal(scale Q K^T - Stats)), the probabilities again.
  const int64_t s = g.Tensor(0, CUDNN_DATA_FLOAT, bhtt, Contiguous(bhtt), true);
  g.Matmul(kQ, kK, s);
  const int64_t scaled = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, s, scaled, kScale);
  const int64_t centered = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_SUB, scaled, centered, kStats);
  const int64_t masked = CausalMask(g, centered);
  const int64_t e = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_EXP, masked, e);

  // dV = E^T dO.
  const Dims t_view{h * t * t, t * t, 1, t};  // a [b, h, t, t] matrix read transposed
  const int64_t e_t = g.Tensor(0, io, bhtt, t_view, true);
  g.Reshape(e, e_t);
  g.Matmul(e_t, kDO, kDV);

  // dS = (dO V^T - D) * E * scale.
  const int64_t dp = g.Tensor(0, CUDNN_DATA_FLOAT, bhtt, Contiguous(bhtt), true);
  g.Matmul(kDO, kV, dp);
  const int64_t dp_centered = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_SUB, dp, dp_centered, kSoftmaxSum);
  const int64_t ds_unscaled = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, dp_centered, ds_unscaled, e);
  const int64_t ds = g.VirtualLike(s, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, ds, kScale);

  // dK = dS^T Q.
  const int64_t ds_t = g.Tensor(0, io, bhtt, t_view, true);
  g.Reshape(ds, ds_t);
  g.Matmul(ds_t, kQ, kDK);

  // dQ = dS K, accumulated in float32, then cast.
  const int64_t k = g.Tensor(0, io, bhtd, StridesOf(p.k_strides, bhtd), true);  // K^T's memory seen as K
  g.Reshape(kK, k);
  g.Matmul(ds, k, kDQAccum);
  g.Pointwise(CUDNN_POINTWISE_IDENTITY, kDQAccum, kDQ);
}

// Bytes of the backward's tensors in the workspace, after cuDNN's own (256-byte aligned).
int64_t Align256(int64_t n) { return (n + 255) / 256 * 256; }
int64_t SoftmaxSumBytes(const SdpaProblem& p) { return Align256(p.b * p.h * p.t * 4); }
int64_t DQAccumBytes(const SdpaProblem& p) { return Align256(p.b * p.h * p.t * p.d * 4); }

// A finalized execution plan with everything it refers to.
struct Plan {
  explicit Plan(const CudnnApi& api) : descs(api) {}
  Descriptors descs;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t engine_workspace = 0;  // cuDNN's own, at the start of the workspace
};

// Where a plan is built for: a live handle (to execute it) or a described device (no GPU).
struct Target {
  cudnnHandle_t handle = nullptr;
  cudnnBackendDescriptor_t device = nullptr;
};

absl::Status CheckProblem(const SdpaProblem& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) {
    return absl::UnimplementedError(
        absl::StrCat("[cuDNN] fused attention takes bfloat16 or float16, not ", DTypeName(p.dtype)));
  }
  if (p.b < 1 || p.h < 1 || p.t < 1 || p.d < 1) {
    return absl::UnimplementedError(
        absl::StrCat("[cuDNN] empty attention problem b=", p.b, " h=", p.h, " t=", p.t, " d=", p.d));
  }
  for (const Dims* st : {&p.q_strides, &p.k_strides, &p.v_strides, &p.o_strides, &p.do_strides, &p.dq_strides,
                         &p.dk_strides, &p.dv_strides}) {
    if (*st == Dims{}) continue;
    // Rows of 16 bytes or more, each starting 16-byte aligned: stride 1 along d, the others
    // multiples of 8 elements (bfloat16 / float16).
    if ((*st)[3] != 1 || (*st)[0] % 8 != 0 || (*st)[1] % 8 != 0 || (*st)[2] % 8 != 0) {
      return absl::UnimplementedError(
          absl::StrCat("[cuDNN] fused attention reads row views with 16-byte aligned rows; "
                       "strides ",
                       (*st)[0], ", ", (*st)[1], ", ", (*st)[2], ", ", (*st)[3]));
    }
  }
  return absl::OkStatus();
}

// Builds p's graph, asks the heuristics (mode A) for configurations and finalizes plans from
// them in order until one succeeds; `check` (if given) records the attempt.
absl::StatusOr<std::unique_ptr<Plan>> BuildPlan(const CudnnApi& api, const SdpaProblem& p, Target target,
                                                SdpaPlanCheck* check) {
  DT_RETURN_IF_ERROR(CheckProblem(p));
  auto plan = std::make_unique<Plan>(api);
  GraphBuilder g(&plan->descs);
  if (p.backward) {
    BackwardGraph(g, p);
  } else {
    ForwardGraph(g, p);
  }
  DT_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t graph, g.Build(target.handle));
  DT_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t heur, plan->descs.Create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR));
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  DT_RETURN_IF_ERROR(api.Check(
      api.set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph), "heuristics"));
  DT_RETURN_IF_ERROR(
      api.Check(api.set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode), "heuristics"));
  if (target.device != nullptr) {
    DT_RETURN_IF_ERROR(
        api.Check(api.set(heur, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &target.device),
                  "heuristics device"));
  }
  DT_RETURN_IF_ERROR(api.Check(api.finalize(heur), "heuristics"));
  int64_t count = 0;
  DT_RETURN_IF_ERROR(
      api.Check(api.get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
                "heuristics results"));
  std::vector<cudnnBackendDescriptor_t> configs(static_cast<size_t>(count));
  for (auto& c : configs) {
    DT_ASSIGN_OR_RETURN(c, plan->descs.Create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
  }
  int64_t got = 0;
  if (count > 0) {
    DT_RETURN_IF_ERROR(api.Check(
        api.get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, configs.data()),
        "heuristics results"));
  }
  if (check != nullptr) check->configs = got;
  absl::Status last = absl::UnimplementedError(absl::StrCat("[cuDNN] no engine takes causal attention ",
                                                            p.backward ? "backward" : "forward", " b=", p.b, " h=", p.h,
                                                            " t=", p.t, " d=", p.d, " ", DTypeName(p.dtype)));
  for (int64_t i = 0; i < got; ++i) {
    DT_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t ep, plan->descs.Create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR));
    DT_RETURN_IF_ERROR(api.Check(api.set(ep, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                         &configs[static_cast<size_t>(i)]),
                                 "plan config"));
    if (target.handle != nullptr) {
      DT_RETURN_IF_ERROR(api.Check(api.set(ep, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &target.handle),
                                   "plan handle"));
    }
    if (target.device != nullptr) {
      DT_RETURN_IF_ERROR(
          api.Check(api.set(ep, CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &target.device),
                    "plan device"));
    }
    last = api.Check(api.finalize(ep), "finalize execution plan");
    if (check != nullptr) {
      check->tried = i + 1;
      check->plan = last;
    }
    if (!last.ok()) continue;
    int64_t n = 0;
    DT_RETURN_IF_ERROR(api.Check(
        api.get(ep, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &plan->engine_workspace),
        "plan workspace size"));
    plan->plan = ep;
    return plan;
  }
  if (check != nullptr && got == 0) check->plan = last;
  return last;
}

// This thread's cuDNN state for one device: a handle on the thread's stream, and the plan (or
// the decline) per problem.
using PlanKey = std::tuple<bool, int, int64_t, int64_t, int64_t, int64_t, std::array<Dims, 8>>;
PlanKey KeyOf(const SdpaProblem& p) {
  return {p.backward,
          static_cast<int>(p.dtype),
          p.b,
          p.h,
          p.t,
          p.d,
          {p.q_strides, p.k_strides, p.v_strides, p.o_strides, p.do_strides, p.dq_strides, p.dk_strides, p.dv_strides}};
}
struct DnnState {
  const CudnnApi* api = nullptr;
  cudnnHandle_t handle = nullptr;
  std::map<PlanKey, absl::StatusOr<std::unique_ptr<Plan>>> plans;
  ~DnnState() {
    plans.clear();
    if (handle != nullptr) api->destroy(handle);
  }
};

absl::StatusOr<DnnState*> ThreadDnn(int device) {
  thread_local std::array<std::unique_ptr<DnnState>, kMaxDevices> states;
  thread_local std::array<absl::Status, kMaxDevices> failed;
  if (device < 0 || device >= kMaxDevices) {
    return absl::InvalidArgumentError(absl::StrCat("[cuDNN] cuda:", device, " is outside [0, ", kMaxDevices, ")"));
  }
  const size_t i = static_cast<size_t>(device);
  DT_RETURN_IF_ERROR(failed[i]);
  if (!states[i]) {
    auto fresh = std::make_unique<DnnState>();
    absl::Status s = [&]() -> absl::Status {
      DT_ASSIGN_OR_RETURN(fresh->api, Cudnn());
      // A handle that cannot be made (no usable device for cuDNN) is a decline: dtensor's own
      // kernels then report what is wrong with the device, if anything.
      absl::Status made = fresh->api->Check(fresh->api->create(&fresh->handle), "cudnnCreate");
      if (!made.ok()) return absl::FailedPreconditionError(made.message());
      absl::Status bound =
          fresh->api->Check(fresh->api->set_stream(fresh->handle, cudaStreamPerThread), "cudnnSetStream");
      if (!bound.ok()) return absl::FailedPreconditionError(bound.message());
      return absl::OkStatus();
    }();
    if (!s.ok()) {
      failed[i] = s;
      return s;
    }
    states[i] = std::move(fresh);
  }
  return states[i].get();
}

absl::StatusOr<Plan*> PlanFor(DnnState& st, const SdpaProblem& p) {
  const PlanKey key = KeyOf(p);
  auto it = st.plans.find(key);
  if (it == st.plans.end()) {
    it = st.plans.emplace(key, BuildPlan(*st.api, p, Target{st.handle, nullptr}, nullptr)).first;
  }
  if (!it->second.ok()) {
    // Whatever stopped the plan (no engine, a kernel that does not compile or load here) means
    // cuDNN does not take this problem on this machine: a decline.
    const absl::Status& s = it->second.status();
    if (IsCudnnDecline(s)) return s;
    return absl::UnimplementedError(absl::StrCat(s.message(), " (no plan: cuDNN declines the problem here)"));
  }
  return it->second->get();
}

bool Aligned16(std::initializer_list<const void*> ps) {
  for (const void* p : ps) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Runs `plan` with the tensors uids[i] at ptrs[i] and a workspace of `ws`.
absl::Status Execute(DnnState& st, const Plan& plan, std::vector<int64_t> uids, std::vector<void*> ptrs, void* ws) {
  const CudnnApi& api = *st.api;
  Descriptors descs(api);
  DT_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t pack, descs.Create(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR));
  DT_RETURN_IF_ERROR(api.Check(api.set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                       static_cast<int64_t>(uids.size()), uids.data()),
                               "variant pack ids"));
  DT_RETURN_IF_ERROR(api.Check(api.set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                       static_cast<int64_t>(ptrs.size()), ptrs.data()),
                               "variant pack pointers"));
  DT_RETURN_IF_ERROR(api.Check(api.set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws),
                               "variant pack workspace"));
  DT_RETURN_IF_ERROR(api.Check(api.finalize(pack), "variant pack"));
  return api.Check(api.execute(st.handle, plan.plan, pack), "cudnnBackendExecute");
}

absl::StatusOr<Tensor> Workspace(int64_t bytes, int device) {
  const int64_t shape[1] = {std::max<int64_t>(1, (bytes + 7) / 8)};
  return Tensor::Empty(shape, DType::kInt64, Device::Cuda(device));
}

// The score the causal mask gives a masked position: -inf, or below cuDNN 9.10 the lowest
// float, as cudnn-frontend does ("older cuDNN prefers lowest for the softmax mask").
float MaskedScore(const CudnnApi& api) {
  return api.version() >= 91000 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::lowest();
}

}  // namespace

bool IsCudnnDecline(const absl::Status& s) { return absl::IsFailedPrecondition(s) || absl::IsUnimplemented(s); }

absl::Status CudnnCausalAttention(int device, const SdpaProblem& p, const void* q, const void* k, const void* v,
                                  float scale, void* out, float* lse) {
  if (p.backward) return absl::InvalidArgumentError("[cuDNN] CudnnCausalAttention given a backward problem");
  if (!Aligned16({q, k, v, out, lse}))
    return absl::UnimplementedError("[cuDNN] attention operands not 16-byte aligned");
  DT_ASSIGN_OR_RETURN(DnnState * st, ThreadDnn(device));
  DT_ASSIGN_OR_RETURN(Plan * plan, PlanFor(*st, p));
  // Scratch is freed when this returns, while the kernels may still run: the allocator hands a
  // block back only in this thread's stream order (cuda_kernels.cc).
  DT_ASSIGN_OR_RETURN(Tensor ws, Workspace(plan->engine_workspace, device));
  float neg_inf = MaskedScore(*st->api);
  return Execute(*st, *plan, {kQ, kK, kV, kO, kStats, kScale, kNegInf},
                 {const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), out, lse, &scale, &neg_inf},
                 ws.raw_data());
}

absl::Status CudnnCausalAttentionBackward(int device, const SdpaProblem& p, const void* dout, const void* q,
                                          const void* k, const void* v, const void* out, const float* lse, float scale,
                                          void* dq, void* dk, void* dv) {
  if (!p.backward) return absl::InvalidArgumentError("[cuDNN] CudnnCausalAttentionBackward given a forward problem");
  if (!Aligned16({dout, q, k, v, out, lse, dq, dk, dv})) {
    return absl::UnimplementedError("[cuDNN] attention operands not 16-byte aligned");
  }
  DT_ASSIGN_OR_RETURN(DnnState * st, ThreadDnn(device));
  DT_ASSIGN_OR_RETURN(Plan * plan, PlanFor(*st, p));
  const int64_t engine = Align256(plan->engine_workspace);
  DT_ASSIGN_OR_RETURN(Tensor ws, Workspace(engine + DQAccumBytes(p) + SoftmaxSumBytes(p), device));
  char* base = static_cast<char*>(ws.raw_data());
  // cuDNN adds dS K into the float32 dQ accumulator, so it must start at zero on every run
  // (cudnn-frontend memsets it before each execution: its workspace modification of type 1).
  // The workspace is a reused block, e.g. the previous layer's: left as it was, dQ would carry
  // that layer's. Ordered before the plan on the handle's stream.
  DT_RETURN_IF_ERROR(
      ToStatus(cudaMemsetAsync(base + engine, 0, static_cast<size_t>(DQAccumBytes(p)), cudaStreamPerThread),
               "cuDNN dQ accumulator", device));
  float neg_inf = MaskedScore(*st->api);
  float one = 1.0f;
  return Execute(*st, *plan, {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kScale, kNegInf, kOne},
                 {const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<void*>(out),
                  const_cast<void*>(dout), const_cast<float*>(lse), dq, dk, dv, base + engine + DQAccumBytes(p),
                  base + engine, &scale, &neg_inf, &one},
                 base);
}

SdpaGraph DescribeSdpaGraph(const SdpaProblem& p) {
  GraphBuilder g(nullptr);
  if (p.backward) {
    BackwardGraph(g, p);
  } else {
    ForwardGraph(g, p);
  }
  return g.graph();
}

absl::StatusOr<SdpaPlanCheck> CheckCudnnSdpaPlan(const SdpaProblem& p, std::string_view device_json) {
  DT_ASSIGN_OR_RETURN(const CudnnApi* api, Cudnn());
  Descriptors descs(*api);
  DT_ASSIGN_OR_RETURN(cudnnBackendDescriptor_t dev, descs.Create(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR));
  DT_RETURN_IF_ERROR(api->Check(api->set(dev, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                         static_cast<int64_t>(device_json.size()), device_json.data()),
                                "device properties"));
  DT_RETURN_IF_ERROR(api->Check(api->finalize(dev), "device properties"));
  SdpaPlanCheck check;
  absl::StatusOr<std::unique_ptr<Plan>> plan = BuildPlan(*api, p, Target{nullptr, dev}, &check);
  if (!plan.ok() && check.tried == 0 && check.configs == 0 && check.plan.ok()) return plan.status();
  return check;
}

}  // namespace dtensor::internal
