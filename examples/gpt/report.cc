#include "examples/gpt/report.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/device_info.h"
#include "dtensor/tensor/status.h"

namespace dtensor::gpt {

double FlopsPerToken(const nn::GPTConfig& cfg, int64_t num_params, int64_t seq) {
  const double position = static_cast<double>(cfg.block_size) * static_cast<double>(cfg.n_embd);
  return 6.0 * (static_cast<double>(num_params) - position) +
         12.0 * static_cast<double>(cfg.n_layer) * static_cast<double>(cfg.n_embd) * static_cast<double>(seq);
}

double GpuPeakFlops(const std::string& name, bool bf16) {
  struct Peak {
    const char* match;
    double bf16, fp32;
  };
  // Dense (no sparsity) tensor-core bf16 and plain fp32, per the vendor's data sheets.
  static constexpr Peak kPeaks[] = {
      {"H200", 989e12, 67e12}, {"H100 PCIe", 756e12, 51e12}, {"H100", 989e12, 67e12}, {"A100", 312e12, 19.5e12}};
  for (const Peak& p : kPeaks) {
    if (absl::StrContains(name, p.match)) return bf16 ? p.bf16 : p.fp32;
  }
  return 0;
}

absl::StatusOr<double> PeakFlops(Device device, bool bf16, int cpu_threads) {
  if (device.is_cuda()) return GpuPeakFlops(CudaDeviceName(device.index), bf16);
  constexpr int64_t n = 1024;
  const int saved = omp_get_max_threads();
  omp_set_num_threads(std::max(1, cpu_threads));
  DT_ASSIGN_OR_RETURN(Tensor a, Full({n, n}, 0.5, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(Tensor b, Full({n, n}, 0.25, DType::kFloat32));
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {  // the first warms the caches and the thread team
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<Tensor> c = Matmul(a, b);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!c.ok()) {
      omp_set_num_threads(saved);
      return c.status();
    }
    if (rep > 0) best = std::min(best, s);
  }
  omp_set_num_threads(saved);
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / best;
}

std::string FormatDuration(double seconds) {
  const int64_t s = std::max<int64_t>(0, static_cast<int64_t>(std::llround(seconds)));
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

std::string ProgressBar(int64_t done, int64_t total, double elapsed_s, int width) {
  done = std::clamp<int64_t>(done, 0, std::max<int64_t>(total, 0));
  const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  const int filled = static_cast<int>(frac * width);
  std::string bar = absl::StrCat("[", std::string(static_cast<size_t>(filled), '#'),
                                 std::string(static_cast<size_t>(width - filled), '-'), "]");
  const std::string left =
      done > 0 ? FormatDuration(elapsed_s / static_cast<double>(done) * static_cast<double>(total - done)) : "?";
  return absl::StrFormat("%s %*d/%d  %s elapsed  %s left", bar, static_cast<int>(absl::StrCat(total).size()), done,
                         total, FormatDuration(elapsed_s), left);
}

int64_t DeviceMemoryBytes(Device device) {
  if (device.is_cuda()) return CudaDeviceTotalMemory(device.index);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

}  // namespace dtensor::gpt
