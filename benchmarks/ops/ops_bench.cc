// ops_bench: dtensor's local kernels beside the best a plain program can do on this machine,
// measured side by side in one run.
//   - Matmul GFLOP/s beside a direct cblas_sgemm of the same shape (target: within 3%).
//   - Elementwise, softmax and layernorm GB/s beside a memcpy moving the same number of bytes
//     (target: at least 50%), with the working set in cache and beyond it.
// Each row interleaves the two contenders for several trials and reports medians.
//   ops_bench [--trials N] [--quick]
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "benchmarks/ops/time_once.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/ops/ops.h"

namespace {

using namespace dtensor;

template <typename T>
T Must(absl::StatusOr<T> v) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s\n", v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}
void Must(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::exit(1);
  }
}

// Median seconds per call of a and b, measured alternately over `trials` trials.
std::pair<double, double> SideBySide(const std::function<void()>& a, const std::function<void()>& b, int trials,
                                     double min_seconds) {
  std::vector<double> ta, tb;
  for (int t = 0; t < trials; ++t) {
    ta.push_back(bench::TimeOnce(a, min_seconds));
    tb.push_back(bench::TimeOnce(b, min_seconds));
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  return {ta[ta.size() / 2], tb[tb.size() / 2]};
}

struct GemmCase {
  const char* name;
  int64_t m, k, n;
};

void MatmulTable(int trials, double min_seconds) {
  // GPT-2 124M shapes at B*T = 256 (B=4, T=64): qkv, attn proj, fc, fc proj, lm head; plus square.
  const GemmCase cases[] = {
      {"qkv      256x768 @ 768x2304", 256, 768, 2304},   {"proj     256x768 @ 768x768", 256, 768, 768},
      {"fc       256x768 @ 768x3072", 256, 768, 3072},   {"fcproj   256x3072 @ 3072x768", 256, 3072, 768},
      {"lm_head  256x768 @ 768x50257", 256, 768, 50257}, {"square   1024x1024 @ 1024x1024", 1024, 1024, 1024},
  };
  std::printf(
      "\nMatmul, float32 (GFLOP/s, median of %d trials, OpenBLAS %s kernels; target: dtensor >= 0.97 x OpenBLAS)\n",
      trials, BlasCoreName().c_str());
  std::printf("%-34s %12s %12s %8s %s\n", "shape", "dtensor", "openblas", "ratio", "");
  for (const GemmCase& c : cases) {
    Tensor a = Must(RandomNormal({c.m, c.k}, DType::kFloat32, 1));
    Tensor b = Must(RandomNormal({c.k, c.n}, DType::kFloat32, 2));
    Tensor out = Must(Tensor::Empty({c.m, c.n}, DType::kFloat32));
    std::vector<float> ref(static_cast<size_t>(c.m * c.n));
    auto ours = [&] { Must(MatmulInto(a, b, out)); };
    auto blas = [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(c.m), static_cast<int>(c.n),
                  static_cast<int>(c.k), 1.0f, a.data<float>(), static_cast<int>(c.k), b.data<float>(),
                  static_cast<int>(c.n), 0.0f, ref.data(), static_cast<int>(c.n));
    };
    auto [t_ours, t_blas] = SideBySide(ours, blas, trials, min_seconds);
    const double flops = 2.0 * c.m * c.k * c.n;
    const double ratio = t_blas / t_ours;
    std::printf("%-34s %12.1f %12.1f %8.3f %s\n", c.name, flops / t_ours * 1e-9, flops / t_blas * 1e-9, ratio,
                ratio >= 0.97 ? "ok" : "BELOW TARGET");
  }
}

struct BandwidthCase {
  std::string name;
  double bytes;  // bytes read + written by one call
  std::function<void()> run;
};

// Memory-bound ops at one working-set size: `n` elements for the elementwise ops, `rows` rows of
// GPT-2's vocabulary (50257) for softmax and `norm_rows` rows of 768 for layernorm.
void BandwidthTable(const char* regime, int64_t n, int64_t rows, int64_t norm_rows, int trials, double min_seconds) {
  std::printf("\nMemory-bound ops, %s (GB/s = bytes read+written per second, median of %d trials;\n", regime, trials);
  std::printf("memcpy moves the same number of bytes; target: dtensor >= 0.5 x memcpy)\n");
  std::printf("%-44s %10s %10s %10s %8s %s\n", "op", "MB moved", "dtensor", "memcpy", "ratio", "");
  Tensor x = Must(RandomNormal({n}, DType::kFloat32, 3));
  Tensor y = Must(RandomNormal({n}, DType::kFloat32, 4));
  Tensor out = Must(Tensor::Empty({n}, DType::kFloat32));
  Tensor xb = Must(Cast(x, DType::kBFloat16));
  Tensor logits = Must(RandomNormal({rows, 50257}, DType::kFloat32, 5));
  Tensor act = Must(RandomNormal({norm_rows, 768}, DType::kFloat32, 6));
  Tensor act2 = Must(RandomNormal({norm_rows, 768}, DType::kFloat32, 7));
  Tensor w = Must(Ones({768}, DType::kFloat32));
  Tensor bias = Must(Zeros({768}, DType::kFloat32));
  const double f4 = 4.0, nn = static_cast<double>(n);
  const std::string ns = std::to_string(n >> 20) + "M";
  const std::string ls = "[" + std::to_string(rows) + ", 50257]";
  const std::string as = "[" + std::to_string(norm_rows) + ", 768]";
  std::vector<BandwidthCase> cases = {
      {"add        f32 [" + ns + "] + [" + ns + "]", 3 * nn * f4, [&] { Must(Binary(BinaryOp::kAdd, x, y).status()); }},
      {"add_       f32 [" + ns + "] += [" + ns + "]", 3 * nn * f4, [&] { Must(Add_(out, y)); }},
      {"scale      f32 [" + ns + "] * s", 2 * nn * f4, [&] { Must(Scale(x, 0.5).status()); }},
      {"gelu       f32 [" + ns + "]", 2 * nn * f4, [&] { Must(Gelu(x).status()); }},
      {"gelu       bf16 [" + ns + "]", 2 * nn * 2.0, [&] { Must(Gelu(xb).status()); }},
      {"sum        f32 " + as + " over dim 0", norm_rows * 768 * f4, [&] { Must(Sum(act, {0}).status()); }},
      {"softmax    f32 " + ls, 2.0 * rows * 50257 * f4, [&] { Must(Softmax(logits).status()); }},
      {"layernorm  f32 " + as, 2.0 * norm_rows * 768 * f4, [&] { Must(LayerNorm(act, w, bias).status()); }},
      // A block's residual add and ln_2: x, h read and x + h, y written (4 [rows, 768] tensors),
      // fused (one pass) and as the two ops it replaces (which move 7).
      {"add+layernorm f32 " + as + " fused", 4.0 * norm_rows * 768 * f4,
       [&] { Must(AddLayerNorm(act, act2, w, bias).status()); }},
      {"add, layernorm f32 " + as + " unfused", 4.0 * norm_rows * 768 * f4,
       [&] { Must(LayerNorm(Must(Add(act, act2)), w, bias).status()); }},
  };
  for (const BandwidthCase& c : cases) {
    const size_t half = static_cast<size_t>(c.bytes / 2);  // memcpy reads and writes `half` bytes
    std::vector<char> src(half, 1), dst(half, 0);
    auto copy = [&] { std::memcpy(dst.data(), src.data(), half); };
    auto [t_ours, t_copy] = SideBySide(c.run, copy, trials, min_seconds);
    const double ratio = t_copy / t_ours;
    std::printf("%-44s %10.1f %10.2f %10.2f %8.3f %s\n", c.name.c_str(), c.bytes * 1e-6, c.bytes / t_ours * 1e-9,
                c.bytes / t_copy * 1e-9, ratio, ratio >= 0.5 ? "ok" : "BELOW TARGET");
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The kernels the trainer runs: OpenBLAS's fastest for this CPU (see blas_core.h).
  if (absl::Status blas = dtensor::ReexecWithFasterBlasCore(argv); !blas.ok()) {
    std::fprintf(stderr, "ops_bench: %s\n", blas.ToString().c_str());
  }
  int trials = 5;
  double min_seconds = 0.2;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--trials") == 0 && i + 1 < argc) {
      trials = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      trials = 1;
      min_seconds = 0.02;
    } else {
      std::fprintf(stderr, "usage: ops_bench [--trials N] [--quick]\n");
      return 2;
    }
  }
  MatmulTable(trials, min_seconds);
  // In cache: GPT-2 124M activations at B*T = 256 are this size. Beyond cache: DRAM-bound.
  BandwidthTable("working set in cache (4M floats)", int64_t{1} << 22, 256, 4096, trials, min_seconds);
  BandwidthTable("working set beyond cache (64M floats)", int64_t{1} << 26, 1024, 65536, trials, min_seconds);
  return 0;
}
