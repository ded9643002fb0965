#include "dtensor/nn/optim.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {
namespace {

bool HasShard(const Layout& l) {
  for (const Placement& p : l.placements()) {
    if (p.is_shard()) return true;
  }
  return false;
}

// Whether the layouts differ only on mesh dims of size 1 (where every placement holds the same
// data), with the same shard order elsewhere.
bool OnlySizeOneDimsDiffer(const DeviceMesh& mesh, const Layout& a, const Layout& b) {
  for (int m = 0; m < a.ndim(); ++m) {
    if (mesh.size(m) > 1 && (a[m] != b[m] || a.nest_level(m) != b.nest_level(m))) return false;
  }
  return true;
}

// The gradient of `p` laid out as p (collective when it must move).
absl::StatusOr<Value> GradInParamLayout(const Variable& p) {
  const Value& g = p.grad();
  const Value& v = p.value();
  if (!g.defined() || !v.is_dtensor()) return g;
  if (!g.is_dtensor()) {
    return absl::InvalidArgumentError(
        absl::StrCat("[Optimizer] parameter ", p.name(), " is a DTensor but its gradient is a plain tensor"));
  }
  if (g.dtensor().layout() == v.dtensor().layout()) return g;
  DT_ASSIGN_OR_RETURN(DTensor r, g.dtensor().Redistribute(v.dtensor().layout()));
  return Value(r);
}

// `g`: p's gradient in p's layout (GradInParamLayout), checked against p's local shape.
absl::StatusOr<Tensor> LocalGrad(const Variable& p, const Value& g) {
  if (g.local().shape() != p.value().local().shape()) {
    return absl::InvalidArgumentError(absl::StrCat("[Optimizer] gradient of ", p.name(), " has local shape ",
                                                   ShapeString(g.local().shape()), ", the parameter ",
                                                   ShapeString(p.value().local().shape())));
  }
  return g.local();
}

}  // namespace

absl::Status ReduceGradients(const std::vector<Variable*>& params, int64_t bucket_bytes) {
  // Bucket: consecutive parameters with the same mesh, gradient layout and dtype, whose
  // gradient only needs Partial -> Replicate (no Shard on either side).
  std::vector<Variable*> bucket;
  int64_t bucket_numel = 0;
  auto flush = [&]() -> absl::Status {
    if (bucket.empty()) return absl::OkStatus();
    const DTensor& g0 = bucket[0]->grad().dtensor();
    const Layout target = bucket[0]->value().dtensor().layout();
    DT_ASSIGN_OR_RETURN(Tensor flat, Tensor::Empty({bucket_numel}, g0.dtype(), g0.ToLocal().device()));
    int64_t off = 0;
    for (Variable* p : bucket) {
      const Tensor& l = p->grad().local();
      DT_ASSIGN_OR_RETURN(Tensor dst, flat.Narrow(0, off, l.numel()));
      DT_ASSIGN_OR_RETURN(Tensor src, Reshape(l, {l.numel()}));
      DT_RETURN_IF_ERROR(Copy_(dst, src));
      off += l.numel();
    }
    DT_ASSIGN_OR_RETURN(DTensor fd,
                        DTensor::FromLocal(flat, g0.mesh(), g0.layout(), {.global_shape = Shape{bucket_numel}}));
    DT_ASSIGN_OR_RETURN(DTensor reduced, fd.Redistribute(target));
    off = 0;
    for (Variable* p : bucket) {
      const Value& pv = p->value();
      const int64_t n = pv.local().numel();
      DT_ASSIGN_OR_RETURN(Tensor piece, reduced.ToLocal().Narrow(0, off, n));
      DT_ASSIGN_OR_RETURN(Tensor shaped, piece.View(pv.local().shape()));
      p->set_grad(Value(
          DTensor::WrapTrusted(shaped, pv.dtensor().mesh(), target, Shape(pv.shape().begin(), pv.shape().end()))));
      off += n;
    }
    bucket.clear();
    bucket_numel = 0;
    return absl::OkStatus();
  };
  for (Variable* p : params) {
    const Value& g = p->grad();
    const Value& v = p->value();
    if (!g.defined() || !v.is_dtensor() || !g.is_dtensor()) continue;
    const Layout& gl = g.dtensor().layout();
    const Layout& vl = v.dtensor().layout();
    if (gl == vl) continue;
    if (OnlySizeOneDimsDiffer(g.dtensor().mesh(), gl, vl)) {  // nothing moves: relabel
      p->set_grad(
          Value(DTensor::WrapTrusted(g.local(), g.dtensor().mesh(), vl, Shape(g.shape().begin(), g.shape().end()))));
      continue;
    }
    const bool bucketable = !HasShard(gl) && !HasShard(vl) && gl.is_default_order();
    if (!bucketable) {
      DT_ASSIGN_OR_RETURN(DTensor r, g.dtensor().Redistribute(vl));
      p->set_grad(Value(r));
      continue;
    }
    if (!bucket.empty()) {
      const Value& b0 = bucket[0]->grad();
      const bool same = b0.dtensor().mesh().SameAs(g.dtensor().mesh()) && b0.dtensor().layout() == gl &&
                        b0.dtype() == g.dtype() && bucket[0]->value().dtensor().layout() == vl;
      if (!same) DT_RETURN_IF_ERROR(flush());
    }
    bucket.push_back(p);
    bucket_numel += g.local().numel();
    if (bucket_numel * static_cast<int64_t>(ElementSize(g.dtype())) >= bucket_bytes) DT_RETURN_IF_ERROR(flush());
  }
  return flush();
}

// The gradients' sums of squares, ready to add up: float32 [k] tensors, one per device for
// parameters every rank holds whole, and one per group of ranks that share parameters' shards
// (the communicator of their sharded mesh dims), all-reduced over that group. Groups are
// taken in the order the parameters first name them, the same on every rank (so are their
// all-reduces). Each parameter's sum stays on its device: no host synchronisation here.
class SquareSumGroups {
 public:
  // `sum`: the float32 [1] (on g's device) that holds, or will hold by Finish(), the sum of
  // squares of g, a gradient in its parameter's layout.
  absl::Status Add(const Value& g, Tensor sum) {
    std::vector<int> dims;
    if (g.is_dtensor()) {
      const DTensor& d = g.dtensor();
      for (int m = 0; m < d.layout().ndim(); ++m) {
        if (d.layout()[m].is_shard() && d.mesh().size(m) > 1) dims.push_back(m);
      }
    }
    if (dims.empty()) {  // every rank holds all of it: a local sum
      const Device dev = sum.device();
      plain_[{static_cast<int>(dev.type), dev.index}].push_back(std::move(sum));
      return absl::OkStatus();
    }
    DT_ASSIGN_OR_RETURN(Communicator * comm, g.dtensor().mesh().comm(dims));
    auto it = std::find_if(groups_.begin(), groups_.end(), [&](const Group& grp) { return grp.comm == comm; });
    if (it == groups_.end()) it = groups_.insert(groups_.end(), Group{comm, {}, CommCounterOf(g.dtensor().mesh())});
    it->sums.push_back(std::move(sum));
    return absl::OkStatus();
  }

  // The sums per device and group (the groups' all-reduced).
  absl::StatusOr<std::vector<Tensor>> Finish() {
    std::vector<Tensor> out;
    for (auto& [device, sums] : plain_) {
      DT_ASSIGN_OR_RETURN(Tensor all, Cat(sums, 0));
      out.push_back(std::move(all));
    }
    for (Group& grp : groups_) {  // the sharded pieces' sums, added over their groups
      DT_ASSIGN_OR_RETURN(Tensor all, Cat(grp.sums, 0));
      DT_ASSIGN_OR_RETURN(all, To(all, grp.comm->device()));
      DT_RETURN_IF_ERROR(grp.comm->AllReduce(all, all, CommReduceOp::kSum));
      if (grp.counter != nullptr) grp.counter->Record(CommKind::kAllReduce, static_cast<int64_t>(all.nbytes()));
      out.push_back(std::move(all));
    }
    return out;
  }

 private:
  struct Group {
    Communicator* comm = nullptr;    // owned by the mesh, which the parameter keeps alive
    std::vector<Tensor> sums;        // float32 [1] per parameter, on the parameter's device
    CommCounter* counter = nullptr;  // the mesh's, if any: the all_reduce is recorded there
  };
  std::vector<Group> groups_;
  std::map<std::pair<int, int>, std::vector<Tensor>> plain_;  // plain Tensors, by device
};

namespace {

// Parameters a transform holds in another form (FSDP's gathered groups) become their own
// again before anything reads them for an update (Variable::Settle).
absl::Status SettleParams(const std::vector<Variable*>& params) {
  for (Variable* p : params) DT_RETURN_IF_ERROR(p->Settle());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Tensor>> GradSquareSums(const std::vector<Variable*>& params) {
  DT_RETURN_IF_ERROR(SettleParams(params));
  SquareSumGroups sums;
  for (Variable* p : params) {
    if (!p->grad().defined()) continue;
    DT_ASSIGN_OR_RETURN(Value g, GradInParamLayout(*p));
    if (p->grad().is_dtensor() && p->grad().dtensor().layout().has_partial()) p->set_grad(g);
    DT_ASSIGN_OR_RETURN(Tensor s, SumOfSquares(g.local()));  // float32 [1]
    DT_RETURN_IF_ERROR(sums.Add(g, std::move(s)));
  }
  return sums.Finish();
}

// The norm from the sums: read at once per device or group (one host sync each, not one per
// parameter: on a GPU that is the difference between ~9 ms and ~1 ms), added in float64 on the
// host.
absl::StatusOr<double> NormOnHost(const std::vector<Tensor>& sums) {
  double total = 0;
  for (const Tensor& t : sums) {
    DT_ASSIGN_OR_RETURN(std::vector<double> v, ToDoubleVector(t));
    for (double x : v) total += x;
  }
  return std::sqrt(total);
}

// The norm from the sums as a float32 [1] on their device (added in float32 there).
absl::StatusOr<Tensor> NormOnDevice(const std::vector<Tensor>& sums, const char* op) {
  if (sums.empty()) return Zeros({1}, DType::kFloat32);
  const Device device = sums[0].device();
  DT_ASSIGN_OR_RETURN(Tensor total, Zeros({1}, DType::kFloat32, device));
  for (const Tensor& t : sums) {
    if (t.device() != device) {
      return absl::InvalidArgumentError(absl::StrCat("[", op, "] gradients on ", device.ToString(), " and ",
                                                     t.device().ToString(),
                                                     ": one device only (ClipGradNorm takes several)"));
    }
    DT_ASSIGN_OR_RETURN(Tensor s, Sum(t, {0}, /*keepdim=*/true));
    DT_RETURN_IF_ERROR(Add_(total, s));
  }
  return Sqrt(total);
}

// torch.nn.utils.clip_grad_norm_'s factor, min(1, max_norm / (norm + 1e-6)), computed where
// norm (float32 [1]) is.
absl::StatusOr<Tensor> ClipFactorOnDevice(const Tensor& norm, double max_norm) {
  DT_ASSIGN_OR_RETURN(Tensor coef, AddScalar(norm, 1e-6));
  DT_ASSIGN_OR_RETURN(coef, BinaryScalar(BinaryOp::kDiv, coef, max_norm, /*scalar_first=*/true));
  return BinaryScalar(BinaryOp::kMin, coef, 1.0);
}

}  // namespace

absl::StatusOr<double> ClipGradNorm(const std::vector<Variable*>& params, double max_norm) {
  DT_ASSIGN_OR_RETURN(std::vector<Tensor> sums, GradSquareSums(params));
  DT_ASSIGN_OR_RETURN(const double norm, NormOnHost(sums));
  // A NaN norm scales too (every gradient becomes NaN, as in torch's clip_grad_norm_).
  if (max_norm > 0 && !(norm <= max_norm)) {
    const double scale = max_norm / (norm + 1e-6);
    for (Variable* p : params) {
      if (p->grad().defined()) DT_RETURN_IF_ERROR(Scale_(p->grad().local(), scale));
    }
  }
  return norm;
}

absl::StatusOr<Tensor> ClipGradNormAsync(const std::vector<Variable*>& params, double max_norm) {
  DT_ASSIGN_OR_RETURN(std::vector<Tensor> sums, GradSquareSums(params));
  DT_ASSIGN_OR_RETURN(Tensor norm, NormOnDevice(sums, "ClipGradNormAsync"));
  if (max_norm <= 0) return norm;
  // Every gradient times the factor.
  DT_ASSIGN_OR_RETURN(Tensor coef, ClipFactorOnDevice(norm, max_norm));
  std::map<DType, Tensor> coef_as;  // the factor in each gradient dtype
  for (Variable* p : params) {
    if (!p->grad().defined()) continue;
    const Tensor& g = p->grad().local();
    Tensor& c = coef_as[g.dtype()];
    if (!c.defined()) {
      DT_ASSIGN_OR_RETURN(c, Cast(coef, g.dtype()));
    }
    DT_RETURN_IF_ERROR(Mul_(g, c));
  }
  return norm;
}

AdamW::AdamW(std::vector<Variable*> params, const AdamWOptions& options)
    : params_(std::move(params)), options_(options) {}

absl::Status AdamW::InitState() {
  if (!m_.empty()) return absl::OkStatus();
  DT_RETURN_IF_ERROR(SettleParams(params_));  // the shards' shapes, not a gathered group's
  for (Variable* p : params_) {
    const Tensor& l = p->value().local();
    DT_ASSIGN_OR_RETURN(Tensor m, Zeros(l.shape(), DType::kFloat32, l.device()));
    DT_ASSIGN_OR_RETURN(Tensor v, Zeros(l.shape(), DType::kFloat32, l.device()));
    m_.push_back(m);
    v_.push_back(v);
  }
  return absl::OkStatus();
}

std::vector<int64_t> AdamW::param_steps() const {
  return steps_.size() == params_.size() ? steps_ : std::vector<int64_t>(params_.size(), 0);
}

absl::Status AdamW::set_steps(int64_t step_count, const std::vector<int64_t>& param_steps) {
  if (param_steps.size() != params_.size() || step_count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("[AdamW] set_steps: ", param_steps.size(), " parameter counts for ",
                                                   params_.size(), " parameters, step ", step_count));
  }
  for (size_t i = 0; i < param_steps.size(); ++i) {  // (a checkpoint's values: checked, not trusted)
    if (param_steps[i] < 0 || param_steps[i] > step_count) {
      return absl::InvalidArgumentError(absl::StrCat("[AdamW] set_steps: parameter ", i, "'s step count ",
                                                     param_steps[i], " is outside [0, ", step_count, "]"));
    }
  }
  step_ = step_count;
  steps_ = param_steps;
  return absl::OkStatus();
}

absl::Status AdamW::Step() { return StepImpl(nullptr); }

absl::StatusOr<double> AdamW::StepWithGradNorm() {
  DT_ASSIGN_OR_RETURN(std::vector<Tensor> sums, StepWithSquareSums());
  return NormOnHost(sums);
}

absl::StatusOr<Tensor> AdamW::StepWithGradNormAsync() {
  DT_ASSIGN_OR_RETURN(std::vector<Tensor> sums, StepWithSquareSums());
  return NormOnDevice(sums, "StepWithGradNormAsync");
}

absl::StatusOr<double> AdamW::StepWithClip(double max_norm) {
  if (!(max_norm > 0)) return StepWithGradNorm();
  DT_ASSIGN_OR_RETURN(std::vector<Tensor> sums, GradSquareSums(params_));
  DT_ASSIGN_OR_RETURN(const double norm, NormOnHost(sums));
  DeviceFactors factors;      // ClipGradNorm's, on each gradient's device
  if (!(norm <= max_norm)) {  // NaN too, as ClipGradNorm
    const double factor = max_norm / (norm + 1e-6);
    for (Variable* p : params_) {
      if (!p->grad().defined()) continue;
      const Device d = p->grad().local().device();
      if (std::none_of(factors.begin(), factors.end(), [&](const auto& f) { return f.first == d; })) {
        DT_ASSIGN_OR_RETURN(Tensor t, Full({1}, factor, DType::kFloat32, d));
        factors.emplace_back(d, std::move(t));
      }
    }
  }
  DT_RETURN_IF_ERROR(StepImpl(nullptr, &factors));
  return norm;
}

absl::StatusOr<Tensor> AdamW::StepWithClipAsync(double max_norm) {
  if (!(max_norm > 0)) return StepWithGradNormAsync();
  DT_ASSIGN_OR_RETURN(std::vector<Tensor> sums, GradSquareSums(params_));
  DT_ASSIGN_OR_RETURN(Tensor norm, NormOnDevice(sums, "StepWithClipAsync"));
  DT_ASSIGN_OR_RETURN(Tensor factor, ClipFactorOnDevice(norm, max_norm));
  const DeviceFactors factors = {{factor.device(), factor}};
  DT_RETURN_IF_ERROR(StepImpl(nullptr, &factors));
  return norm;
}

absl::StatusOr<std::vector<Tensor>> AdamW::StepWithSquareSums() {
  SquareSumGroups sums;
  DT_RETURN_IF_ERROR(StepImpl(&sums));
  return sums.Finish();
}

absl::Status AdamW::StepImpl(SquareSumGroups* sums, const DeviceFactors* grad_scales) {
  DT_RETURN_IF_ERROR(SettleParams(params_));
  DT_RETURN_IF_ERROR(InitState());
  AdamWParams hp;
  hp.lr = static_cast<float>(options_.lr);
  hp.beta1 = static_cast<float>(options_.beta1);
  hp.beta2 = static_cast<float>(options_.beta2);
  hp.eps = static_cast<float>(options_.eps);
  hp.weight_decay = static_cast<float>(options_.weight_decay);
  if (steps_.size() != params_.size()) steps_.assign(params_.size(), 0);
  // Every parameter with a gradient, updated together (one multi-tensor kernel per 64
  // parameters on CUDA). Bias correction counts this parameter's own updates (as PyTorch's
  // state['step']): one that first gets a gradient at step 5 takes a first step of full size.
  // With `sums`, each gradient's sum of squares comes out of the update's pass (the CPU) in the
  // order ClipGradNorm takes them, so the norm is the same.
  std::vector<AdamWTensors> list;
  std::vector<size_t> updated;
  for (size_t i = 0; i < params_.size(); ++i) {
    Variable* p = params_[i];
    if (!p->grad().defined()) continue;
    DT_ASSIGN_OR_RETURN(Value gv, GradInParamLayout(*p));
    DT_ASSIGN_OR_RETURN(Tensor g, LocalGrad(*p, gv));
    // As ClipGradNorm leaves it: a Partial gradient replaced by its reduction.
    if (sums != nullptr && p->grad().is_dtensor() && p->grad().dtensor().layout().has_partial()) p->set_grad(gv);
    AdamWTensors t{.param = p->value().local(), .grad = g, .m = m_[i], .v = v_[i], .step = steps_[i] + 1};
    if (grad_scales != nullptr) {
      for (const auto& [device, factor] : *grad_scales) {
        if (device == g.device()) t.grad_scale = factor;
      }
    }
    if (sums != nullptr) {
      DT_ASSIGN_OR_RETURN(t.grad_square_sum, Tensor::Empty({1}, DType::kFloat32, g.device()));
      DT_RETURN_IF_ERROR(sums->Add(gv, t.grad_square_sum));
    }
    list.push_back(std::move(t));
    updated.push_back(i);
  }
  const absl::Status s = AdamWStepMulti_(list, hp);
  if (!s.ok()) {
    // Refused (an invalid entry): nothing moved. The norm's all_reduces still run, so that
    // ranks whose update went through are not left waiting in them.
    if (sums != nullptr) (void)sums->Finish();
    return s;
  }
  ++step_;
  for (size_t i : updated) ++steps_[i];
  return absl::OkStatus();
}

int64_t AdamW::StateBytes() const {
  int64_t n = 0;
  for (const Tensor& t : m_) n += static_cast<int64_t>(t.nbytes());
  for (const Tensor& t : v_) n += static_cast<int64_t>(t.nbytes());
  return n;
}

void AdamW::ZeroGrad() {
  for (Variable* p : params_) p->reset_grad();
}

SGD::SGD(std::vector<Variable*> params, const SgdOptions& options) : params_(std::move(params)), options_(options) {}

absl::Status SGD::Step() {
  DT_RETURN_IF_ERROR(SettleParams(params_));
  if (buf_.empty()) buf_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    Variable* p = params_[i];
    if (!p->grad().defined()) continue;
    DT_ASSIGN_OR_RETURN(Value gv, GradInParamLayout(*p));
    DT_ASSIGN_OR_RETURN(Tensor g, LocalGrad(*p, gv));
    const Tensor& w = p->value().local();
    if (options_.weight_decay != 0) {
      DT_ASSIGN_OR_RETURN(Tensor wd, Scale(w, options_.weight_decay));
      DT_ASSIGN_OR_RETURN(g, Add(g, wd));
    }
    if (options_.momentum != 0) {
      if (!buf_[i].defined()) {
        DT_ASSIGN_OR_RETURN(buf_[i], Clone(g));
      } else {
        DT_RETURN_IF_ERROR(Scale_(buf_[i], options_.momentum));
        DT_RETURN_IF_ERROR(Add_(buf_[i], g));
      }
      g = buf_[i];
    }
    DT_ASSIGN_OR_RETURN(Tensor step, Scale(g, -options_.lr));
    DT_RETURN_IF_ERROR(Add_(w, step));
  }
  return absl::OkStatus();
}

void SGD::ZeroGrad() {
  for (Variable* p : params_) p->reset_grad();
}

double WarmupCosineLr(int64_t step, const CosineSchedule& s) {
  if (s.warmup > 0 && step < s.warmup) return s.max_lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup);
  if (step >= s.total) return s.min_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, s.total - s.warmup));
  const double ratio = static_cast<double>(step - s.warmup) / span;
  return s.min_lr + 0.5 * (1.0 + std::cos(M_PI * ratio)) * (s.max_lr - s.min_lr);
}

}  // namespace dtensor::nn
