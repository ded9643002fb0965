// clip_step_bench: the optimizer step with gradient clipping, two ways, side by side in one run
// on GPT-2 124M's parameters (float32, CPU, one process):
//   separate  nn::ClipGradNorm(params, max_norm) then AdamW::Step(): the norm's pass over the
//             gradients, a pass scaling them in place, the update's pass;
//   fused     AdamW::StepWithClip(max_norm): the norm's pass, then the update reading every
//             gradient times the factor (AdamWTensors::grad_scale).
// The gradients are drawn so that their norm is above max_norm (every step clips) and restored
// before each separate step (which scales them), untimed. Prints the median and fastest ms of
// each and fused / separate.
//
//   build/benchmarks/clip_step_bench [--reps=N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "dtensor/autograd/variable.h"
#include "dtensor/nn/optim.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

ABSL_FLAG(int, reps, 10, "timed steps of each way (after 2 warmup steps)");

namespace dtensor {
namespace {

// GPT-2 124M's parameter shapes (V = 50304, T = 1024, 12 layers, C = 768).
std::vector<Shape> Gpt2Shapes() {
  const int64_t c = 768;
  std::vector<Shape> s = {{50304, c}, {1024, c}};
  for (int l = 0; l < 12; ++l) {
    for (const Shape& x : std::vector<Shape>{
             {c}, {c}, {3 * c, c}, {3 * c}, {c, c}, {c}, {c}, {c}, {4 * c, c}, {4 * c}, {c, 4 * c}, {c}}) {
      s.push_back(x);
    }
  }
  s.push_back({c});
  s.push_back({c});
  return s;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

absl::Status Run(int reps) {
  std::vector<std::unique_ptr<Variable>> owned[2];
  std::vector<Variable*> params[2];
  std::vector<Tensor> grads;  // the drawn gradients, restored before each separate step
  int64_t numel = 0;
  uint64_t seed = 1;
  for (const Shape& shape : Gpt2Shapes()) {
    DT_ASSIGN_OR_RETURN(Tensor w, RandomNormal(shape, DType::kFloat32, seed++, 0.0, 0.02));
    DT_ASSIGN_OR_RETURN(Tensor g, RandomNormal(shape, DType::kFloat32, seed++, 0.0, 1e-3));
    grads.push_back(g);
    numel += w.numel();
    for (int k = 0; k < 2; ++k) {
      DT_ASSIGN_OR_RETURN(Tensor wk, Clone(w));
      DT_ASSIGN_OR_RETURN(Tensor gk, Clone(g));
      owned[k].push_back(std::make_unique<Variable>(Variable::Leaf(wk, /*requires_grad=*/true)));
      owned[k].back()->set_grad(Value(gk));
      params[k].push_back(owned[k].back().get());
    }
  }
  DT_ASSIGN_OR_RETURN(const double norm, nn::ClipGradNorm(params[1], 0.0));
  const double max_norm = norm / 4;  // every step clips
  nn::AdamW separate(params[0], {.lr = 1e-4, .weight_decay = 0.1});
  nn::AdamW fused(params[1], {.lr = 1e-4, .weight_decay = 0.1});
  std::vector<double> ms[2];
  for (int i = 0; i < reps + 2; ++i) {
    for (size_t j = 0; j < grads.size(); ++j) DT_RETURN_IF_ERROR(Copy_(params[0][j]->grad().local(), grads[j]));
    auto t0 = std::chrono::steady_clock::now();
    DT_RETURN_IF_ERROR(nn::ClipGradNorm(params[0], max_norm).status());
    DT_RETURN_IF_ERROR(separate.Step());
    auto t1 = std::chrono::steady_clock::now();
    DT_RETURN_IF_ERROR(fused.StepWithClip(max_norm).status());
    auto t2 = std::chrono::steady_clock::now();
    if (i >= 2) {  // after warm-up (the first step makes the moments)
      ms[0].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      ms[1].push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
  }
  // Both ways moved the parameters alike (the same bits on the CPU).
  int64_t differ = 0;
  for (size_t j = 0; j < grads.size(); ++j) {
    const Tensor& a = params[0][j]->value().local();
    const Tensor& b = params[1][j]->value().local();
    differ += std::memcmp(a.data<float>(), b.data<float>(), a.nbytes()) != 0;
  }
  std::printf(
      "AdamW step with clipping, GPT-2 124M parameters (%lld, float32, CPU), grad norm %.4f clipped to %.4f; "
      "%d steps\n",
      static_cast<long long>(numel), norm, max_norm, reps);
  std::printf("%-40s %10s %10s\n", "", "median ms", "min ms");
  std::printf("%-40s %10.1f %10.1f\n", "separate: ClipGradNorm, then Step", Median(ms[0]),
              *std::min_element(ms[0].begin(), ms[0].end()));
  std::printf("%-40s %10.1f %10.1f\n", "fused: StepWithClip", Median(ms[1]),
              *std::min_element(ms[1].begin(), ms[1].end()));
  std::printf("fused / separate: %.3f (median), %.3f (min); parameters that differ: %lld\n",
              Median(ms[1]) / Median(ms[0]),
              *std::min_element(ms[1].begin(), ms[1].end()) / *std::min_element(ms[0].begin(), ms[0].end()),
              static_cast<long long>(differ));
  return absl::OkStatus();
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const absl::Status s = dtensor::Run(reps);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
