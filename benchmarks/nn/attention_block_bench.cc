// attention_block_bench: one GPT-2 attention block (nn::CausalSelfAttention: the fused qkv
// projection, its split into heads, causal attention, the heads merged back, the output
// projection), forward + backward on the CPU, at GPT-2 124M's width (C = 768, 12 heads) and a
// few (B, T). Prints the median and the fastest milliseconds of a forward + backward (the
// fastest is the steadier on a shared machine) and the allocations per step (each copy between
// layouts allocates its result). For comparing builds of two commits on one machine: run them in
// turn.
//
//   build/benchmarks/attention_block_bench [--reps=N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/nn/layers.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/allocator.h"
#include "dtensor/tensor/status.h"

ABSL_FLAG(int, reps, 20, "timed forward + backward steps per shape (after 3 warmup steps)");

namespace dtensor {
namespace {

struct Row {
  double ms = 0, min_ms = 0;
  int64_t allocs = 0;
};

absl::StatusOr<Row> Measure(int64_t b, int64_t t, int64_t c, int64_t heads, int reps) {
  nn::CausalSelfAttention attn(c, heads);
  uint64_t seed = 1;
  for (Variable* p : attn.Parameters()) {
    DT_ASSIGN_OR_RETURN(Tensor r, RandomNormal(p->value().local().shape(), DType::kFloat32, seed++, 0.0, 0.02));
    DT_RETURN_IF_ERROR(Copy_(p->value().local(), r));
  }
  DT_ASSIGN_OR_RETURN(Tensor xt, RandomNormal({b, t, c}, DType::kFloat32, 99));
  DT_ASSIGN_OR_RETURN(Tensor gy, RandomNormal({b, t, c}, DType::kFloat32, 98));
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  std::vector<double> ms;
  int64_t allocs = 0;
  for (int i = 0; i < reps + 3; ++i) {
    Variable x = Variable::Leaf(xt, /*requires_grad=*/true);
    const int64_t before = alloc.Stats().num_allocs;
    const auto t0 = std::chrono::steady_clock::now();
    DT_ASSIGN_OR_RETURN(Variable y, attn.Forward(x));
    const Value g(gy);
    DT_RETURN_IF_ERROR(Backward(absl::MakeConstSpan(&y, 1), absl::MakeConstSpan(&g, 1)));
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 3) {  // after warm-up
      ms.push_back(dt);
      allocs = alloc.Stats().num_allocs - before;
    }
    for (Variable* p : attn.Parameters()) p->reset_grad();
  }
  std::sort(ms.begin(), ms.end());
  return Row{ms[ms.size() / 2], ms[0], allocs};
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const int64_t c = 768, heads = 12;
  struct Shape2 {
    int64_t b, t;
  };
  std::printf("attention block fwd+bwd, C=%lld, %lld heads, float32, CPU; median of %d\n", static_cast<long long>(c),
              static_cast<long long>(heads), reps);
  std::printf("%-12s %10s %10s %12s\n", "B x T", "ms", "min ms", "allocations");
  for (const Shape2 s : {Shape2{4, 64}, Shape2{4, 256}, Shape2{1, 1024}}) {
    absl::StatusOr<Row> r = Measure(s.b, s.t, c, heads, reps);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return 1;
    }
    std::printf("%4lld x %-5lld %10.3f %10.3f %12lld\n", static_cast<long long>(s.b), static_cast<long long>(s.t),
                r->ms, r->min_ms, static_cast<long long>(r->allocs));
  }
  return 0;
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) { return dtensor::Main(argc, argv); }
