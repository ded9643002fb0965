// Optimizers and gradient utilities over parameters that are Tensors or DTensors.
//
//   nn::AdamW opt(model.Parameters(), {.lr = 6e-4, .weight_decay = 0.1});
//   DT_RETURN_IF_ERROR(Backward(loss));
//   DT_RETURN_IF_ERROR(nn::ReduceGradients(model.Parameters()));     // Partial -> parameter layout
//   opt.set_lr(nn::WarmupCosineLr(step, {.max_lr = 6e-4, .warmup = 100, .total = 5000}));
//   DT_ASSIGN_OR_RETURN(double norm, opt.StepWithClip(1.0));  // = ClipGradNorm(params, 1.0), Step()
//   opt.ZeroGrad();
//
// Updates run on each rank's local pieces: a parameter's gradient must be laid out as the
// parameter (ReduceGradients does it: the Partial(sum) gradient of a replicated parameter, as
// data parallelism produces, becomes Replicate through bucketed all_reduces). Optimizer state
// has the parameter's layout.
#ifndef DTENSOR_NN_OPTIM_H_
#define DTENSOR_NN_OPTIM_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/autograd/variable.h"

namespace dtensor::nn {

// Brings every gradient to its parameter's layout. Gradients that only need a Partial ->
// Replicate reduction and share mesh, layout and dtype are packed into buckets of about
// `bucket_bytes` so that a model's reduction is a few large all_reduces (DDP's buckets);
// others are redistributed one by one. Collective over the parameters' meshes.
absl::Status ReduceGradients(const std::vector<Variable*>& params, int64_t bucket_bytes = 25 << 20);

// Scales gradients so that their global L2 norm is at most max_norm; returns the norm before
// clipping. Correct for any placements: Shard pieces are summed over their mesh dims,
// Replicate ones counted once, Partial gradients reduced first. max_norm <= 0: no clipping.
// A NaN norm makes every gradient NaN (torch's clip_grad_norm_ scales by its NaN factor).
// One all_reduce of a float32 [k] per group of ranks that shard gradients (k: its parameters),
// recorded in the mesh's CommCounter.
absl::StatusOr<double> ClipGradNorm(const std::vector<Variable*>& params, double max_norm);
// ClipGradNorm without waiting for the device: returns the norm as a float32 [1] tensor on the
// gradients' device (read it when convenient: gpt_train reads it a step later on GPUs), and
// clips as torch.nn.utils.clip_grad_norm_ does, multiplying every gradient by
// min(1, max_norm / (norm + 1e-6)) computed on the device. The sums add up in float32 here
// (ClipGradNorm adds them in float64 on the host). Gradients on one device per rank.
absl::StatusOr<Tensor> ClipGradNormAsync(const std::vector<Variable*>& params, double max_norm);

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

class SquareSumGroups;  // optim.cc's: the norm's sums, grouped as ClipGradNorm groups them

// torch.optim.AdamW: decoupled weight decay (p -= lr * wd * p), bias-corrected moments.
class AdamW {
 public:
  AdamW(std::vector<Variable*> params, const AdamWOptions& options);
  absl::Status Step();
  // Step, returning the gradients' global L2 norm before it: the value ClipGradNorm(params, 0)
  // returns, with the same all_reduces, but read in the update's own pass over the gradients
  // where the backend can (the CPU: one read of every gradient less per step) rather than in a
  // pass of its own. For training without clipping (clipping needs the norm before the update).
  // An error from the update (an invalid gradient) moves nothing; the norm's all_reduces run
  // regardless, as on the ranks that did update.
  absl::StatusOr<double> StepWithGradNorm();
  // The same as ClipGradNormAsync(params, 0) gives it: a float32 [1] on the gradients' device.
  absl::StatusOr<Tensor> StepWithGradNormAsync();
  // ClipGradNorm(params, max_norm) then Step, with one pass over the gradients less: the norm
  // first (the same sums and all_reduces), then the update reads every gradient times
  // ClipGradNorm's factor, max_norm / (norm + 1e-6) where norm > max_norm or NaN (llm.c's AdamW takes
  // its grad_scale so). The gradients themselves are left unscaled. Returns the norm before
  // clipping; max_norm <= 0: StepWithGradNorm.
  absl::StatusOr<double> StepWithClip(double max_norm);
  // The same without waiting for the device, as ClipGradNormAsync clips: the factor
  // min(1, max_norm / (norm + 1e-6)) is computed on the device and read there by the update.
  // Returns the norm as a float32 [1] on the gradients' device (one device per rank).
  absl::StatusOr<Tensor> StepWithClipAsync(double max_norm);
  void ZeroGrad();  // drops the gradients (set_to_none)
  void set_lr(double lr) { options_.lr = lr; }
  double lr() const { return options_.lr; }
  int64_t step_count() const { return step_; }
  // Bytes of this rank's optimizer state (m and v; 0 before the first step).
  int64_t StateBytes() const;

  // For checkpoints. InitState makes the moments (zeros, float32, the parameter's local shape
  // and device; a gathered FSDP group is sharded first, Variable::Settle) when no step has
  // made them yet, so that a resume can load into them.
  // exp_avg(i) / exp_avg_sq(i): parameter i's m and v on this rank (views: loading into them
  // restores the state); param_steps(): each parameter's update count (bias correction);
  // set_steps restores it and step_count().
  absl::Status InitState();
  const Tensor& exp_avg(size_t i) const { return m_[i]; }
  const Tensor& exp_avg_sq(size_t i) const { return v_[i]; }
  std::vector<int64_t> param_steps() const;
  absl::Status set_steps(int64_t step_count, const std::vector<int64_t>& param_steps);

 private:
  // The update; with `sums`, each gradient's sum of squares from the update's pass; with
  // `grad_scales`, each gradient read times the factor on its device (AdamWTensors::grad_scale).
  using DeviceFactors = std::vector<std::pair<Device, Tensor>>;
  absl::Status StepImpl(SquareSumGroups* sums, const DeviceFactors* grad_scales = nullptr);
  absl::StatusOr<std::vector<Tensor>> StepWithSquareSums();

  std::vector<Variable*> params_;
  AdamWOptions options_;
  std::vector<Tensor> m_, v_;   // local pieces, created on the first step
  int64_t step_ = 0;            // Step() calls
  std::vector<int64_t> steps_;  // updates of each parameter (those with a gradient)
};

struct SgdOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double weight_decay = 0.0;
};

// torch.optim.SGD with momentum (buf = momentum * buf + g; p -= lr * buf).
class SGD {
 public:
  SGD(std::vector<Variable*> params, const SgdOptions& options);
  absl::Status Step();
  void ZeroGrad();
  void set_lr(double lr) { options_.lr = lr; }

 private:
  std::vector<Variable*> params_;
  SgdOptions options_;
  std::vector<Tensor> buf_;
};

struct CosineSchedule {
  double max_lr = 6e-4;
  double min_lr = 0.0;
  int64_t warmup = 0;  // linear warmup steps
  int64_t total = 1;   // steps over which to decay to min_lr
};
// Linear warmup to max_lr over `warmup` steps (step 0 gets max_lr / warmup), then cosine decay
// to min_lr at `total`; min_lr afterwards.
double WarmupCosineLr(int64_t step, const CosineSchedule& s);

}  // namespace dtensor::nn

#endif  // DTENSOR_NN_OPTIM_H_
