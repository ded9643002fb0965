// sgemm_rate: OpenBLAS's float32 GEMM rate on the matrix multiplies of one GPT-2 training step,
// and the step's sgemm floor: the time those multiplies alone take at that rate (what no CPU
// trainer built on this OpenBLAS can beat; benchmarks/nn/cpu_step_compare.sh sets the trainer
// beside it).
//   - Per Linear (c_attn, attn c_proj, mlp c_fc, mlp c_proj, the tied lm_head) at M = B*T rows,
//     weight W [out, in]: forward Y = X W^T, backward dX = dY W and dW = dY^T X, as cblas_sgemm
//     calls in those orientations; n_layer of each block Linear per step, one lm_head.
//   - Attention per (batch, head), [T, D] problems (D = C / n_head): forward S = Q K^T and
//     O = P V, backward dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q; the B*H problems
//     split over OpenMP threads (OpenBLAS runs on one thread inside a parallel region), as the
//     trainer's attention kernel does. Counted whole (no causal saving), as the FLOP formula
//     6 N + 12 L C T counts them.
// Each shape is timed alone (median of --trials runs of ~--min-seconds each, in-cache operands
// reused), two ways: cblas_sgemm with beta = 0, and C cleared by memset then beta = 1 (the same
// values; OpenBLAS's own clearing pass is slow, so the trainer clears C itself: gemm.cc). The
// faster way counts; its time per step is calls x time per call; the floor is their sum and the
// rate the step's GEMM FLOPs over it (the flop-weighted harmonic mean of the shapes' rates).
//   sgemm_rate [--batch 4] [--seq 64] [--n-layer 12] [--n-head 12] [--n-embd 768] [--vocab 50304]
//              [--trials 5] [--min-seconds 0.2] [--quick]
// The last line is for scripts: "floor: step_gflop G rate_gflops R floor_ms F".
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/ops/time_once.h"
#include "dtensor/kernels/cpu/blas_core.h"

namespace {

struct Config {
  int64_t batch = 4, seq = 64, n_layer = 12, n_head = 12, n_embd = 768, vocab = 50304;
  int trials = 5;
  double min_seconds = 0.2;
};

// One GEMM shape of the step: C[m, n] = op(A) op(B) with inner dimension k, `batch` independent
// problems per call (split over threads when > 1), `calls` calls per step.
struct GemmShape {
  std::string name;
  bool trans_a, trans_b;
  int64_t m, n, k;
  int64_t batch;
  int64_t calls;
  double Flops() const { return 2.0 * static_cast<double>(m * n * k) * static_cast<double>(batch * calls); }
};

std::vector<GemmShape> StepShapes(const Config& c) {
  const int64_t rows = c.batch * c.seq, ch = c.n_embd, hd = c.n_embd / c.n_head, bh = c.batch * c.n_head;
  std::vector<GemmShape> shapes;
  // A Linear of `in` -> `out` channels applied to `rows` rows, `calls` times per step.
  auto linear = [&](const std::string& name, int64_t in, int64_t out, int64_t calls) {
    shapes.push_back({name + " fwd   X W^T", false, true, rows, out, in, 1, calls});
    shapes.push_back({name + " bwd  dY W", false, false, rows, in, out, 1, calls});
    shapes.push_back({name + " bwd  dY^T X", true, false, out, in, rows, 1, calls});
  };
  linear("c_attn ", ch, 3 * ch, c.n_layer);
  linear("c_proj ", ch, ch, c.n_layer);
  linear("c_fc   ", ch, 4 * ch, c.n_layer);
  linear("mlp_prj", 4 * ch, ch, c.n_layer);
  linear("lm_head", ch, c.vocab, 1);
  // Attention, per layer: B*H problems of [T, D] queries, keys, values.
  shapes.push_back({"attn    fwd   Q K^T", false, true, c.seq, c.seq, hd, bh, c.n_layer});
  shapes.push_back({"attn    fwd   P V", false, false, c.seq, hd, c.seq, bh, c.n_layer});
  shapes.push_back({"attn    bwd  dO V^T", false, true, c.seq, c.seq, hd, bh, c.n_layer});
  shapes.push_back({"attn    bwd  P^T dO", true, false, c.seq, hd, c.seq, bh, c.n_layer});
  shapes.push_back({"attn    bwd  dS K", false, false, c.seq, hd, c.seq, bh, c.n_layer});
  shapes.push_back({"attn    bwd  dS^T Q", true, false, c.seq, hd, c.seq, bh, c.n_layer});
  return shapes;
}

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(gen);
  return v;
}

// Median seconds per call of one shape (all `batch` problems of it); `clear`: memset C, then
// beta = 1, else beta = 0.
double TimeShape(const GemmShape& s, const Config& c, bool clear) {
  const int64_t a_size = s.m * s.k, b_size = s.k * s.n, c_size = s.m * s.n;
  const std::vector<float> a = Random(a_size * s.batch, 1), b = Random(b_size * s.batch, 2);
  std::vector<float> out(static_cast<size_t>(c_size * s.batch));
  const int lda = static_cast<int>(s.trans_a ? s.m : s.k), ldb = static_cast<int>(s.trans_b ? s.k : s.n);
  auto one = [&](int64_t i) {
    if (clear) std::memset(out.data() + i * c_size, 0, static_cast<size_t>(c_size) * sizeof(float));
    cblas_sgemm(CblasRowMajor, s.trans_a ? CblasTrans : CblasNoTrans, s.trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(s.m), static_cast<int>(s.n), static_cast<int>(s.k), 1.0f, a.data() + i * a_size, lda,
                b.data() + i * b_size, ldb, clear ? 1.0f : 0.0f, out.data() + i * c_size, static_cast<int>(s.n));
  };
  auto call = [&] {
    if (s.batch == 1) {
      one(0);
      return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < s.batch; ++i) one(i);
  };
  std::vector<double> t;
  for (int trial = 0; trial < c.trials; ++trial) t.push_back(dtensor::bench::TimeOnce(call, c.min_seconds));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

bool Parse(int argc, char** argv, Config* c) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      c->trials = 1;
      c->min_seconds = 0.02;
      continue;
    }
    if (i + 1 >= argc) return false;
    const char* v = argv[++i];
    if (a == "--batch") {
      c->batch = std::atoll(v);
    } else if (a == "--seq") {
      c->seq = std::atoll(v);
    } else if (a == "--n-layer") {
      c->n_layer = std::atoll(v);
    } else if (a == "--n-head") {
      c->n_head = std::atoll(v);
    } else if (a == "--n-embd") {
      c->n_embd = std::atoll(v);
    } else if (a == "--vocab") {
      c->vocab = std::atoll(v);
    } else if (a == "--trials") {
      c->trials = std::max(1, std::atoi(v));
    } else if (a == "--min-seconds") {
      c->min_seconds = std::atof(v);
    } else {
      return false;
    }
  }
  return c->batch > 0 && c->seq > 0 && c->n_layer > 0 && c->n_head > 0 && c->n_embd > 0 && c->vocab > 0 &&
         c->n_embd % c->n_head == 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The kernels the trainer runs: OpenBLAS's fastest for this CPU (see blas_core.h).
  if (absl::Status blas = dtensor::ReexecWithFasterBlasCore(argv); !blas.ok()) {
    std::fprintf(stderr, "sgemm_rate: %s\n", blas.ToString().c_str());
  }
  Config c;
  if (!Parse(argc, argv, &c)) {
    std::fprintf(stderr,
                 "usage: sgemm_rate [--batch 4] [--seq 64] [--n-layer 12] [--n-head 12] [--n-embd 768] "
                 "[--vocab 50304] [--trials 5] [--min-seconds 0.2] [--quick]\n");
    return 2;
  }
  const std::vector<GemmShape> shapes = StepShapes(c);
  std::printf(
      "# sgemm_rate: one GPT training step's GEMMs, B=%lld T=%lld L=%lld H=%lld C=%lld V=%lld; float32, OpenBLAS %s "
      "kernels, %d threads; median of %d trials\n",
      static_cast<long long>(c.batch), static_cast<long long>(c.seq), static_cast<long long>(c.n_layer),
      static_cast<long long>(c.n_head), static_cast<long long>(c.n_embd), static_cast<long long>(c.vocab),
      dtensor::BlasCoreName().c_str(), omp_get_max_threads(), c.trials);
  std::printf("%-22s %2s %2s %6s %6s %6s %5s %5s %10s %10s %10s %10s\n", "gemm", "tA", "tB", "m", "n", "k", "batch",
              "calls", "GFLOP/step", "beta0 GF/s", "clear GF/s", "ms/step");
  double flops = 0, seconds = 0;
  for (const GemmShape& s : shapes) {
    const double t0 = TimeShape(s, c, /*clear=*/false), t1 = TimeShape(s, c, /*clear=*/true);
    const double t = std::min(t0, t1);
    const double per_call = s.Flops() / static_cast<double>(s.calls);
    flops += s.Flops();
    seconds += t * static_cast<double>(s.calls);
    std::printf("%-22s %2s %2s %6lld %6lld %6lld %5lld %5lld %10.3f %10.1f %10.1f %10.2f\n", s.name.c_str(),
                s.trans_a ? "T" : "N", s.trans_b ? "T" : "N", static_cast<long long>(s.m), static_cast<long long>(s.n),
                static_cast<long long>(s.k), static_cast<long long>(s.batch), static_cast<long long>(s.calls),
                s.Flops() * 1e-9, per_call / t0 * 1e-9, per_call / t1 * 1e-9, t * static_cast<double>(s.calls) * 1e3);
  }
  std::printf("floor: step_gflop %.2f rate_gflops %.1f floor_ms %.1f\n", flops * 1e-9, flops / seconds * 1e-9,
              seconds * 1e3);
  return 0;
}
