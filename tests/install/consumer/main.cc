// Uses the installed dtensor (everything, dtensor::dtensor): a matmul checked against a naive
// loop, what a CUDA request says on a machine without a GPU (or without the CUDA libraries),
// and a tensor-parallel style parsed and compared (a C++20 header: defaulted operator==, which
// this project, setting no C++ standard, compiles because the dtensor targets ask for C++20);
// exits non-zero on error.
#include <cmath>
#include <cstdio>
#include <vector>

#include "dtensor/nn/parallel/parallel_style.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/device.h"

int main() {
  using namespace dtensor;
  const int m = 3, k = 5, n = 4;
  auto a = RandomNormal({m, k}, DType::kFloat32, /*seed=*/1);
  auto b = RandomNormal({k, n}, DType::kFloat32, /*seed=*/2);
  if (!a.ok() || !b.ok()) return 1;
  auto c = Matmul(*a, *b);
  if (!c.ok()) {
    std::fprintf(stderr, "Matmul failed: %s\n", c.status().ToString().c_str());
    return 1;
  }
  const float* pa = a->data<float>();
  const float* pb = b->data<float>();
  const float* pc = c->data<float>();
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double ref = 0;
      for (int p = 0; p < k; ++p) ref += double(pa[i * k + p]) * pb[p * n + j];
      if (std::fabs(pc[i * n + j] - ref) > 1e-4 * (1 + std::fabs(ref))) {
        std::fprintf(stderr, "mismatch at (%d, %d): %f vs %f\n", i, j, pc[i * n + j], ref);
        return 1;
      }
    }
  }
  auto bad = Matmul(*a, *a);
  if (bad.ok()) return 1;
  // No GPU here (or no driver): a CUDA tensor is refused with a reason, never a crash.
  auto gpu = Tensor::Empty({2}, DType::kFloat32, Device::Cuda(0));
  if (CudaDeviceCount() == 0 && gpu.ok()) return 1;
  auto style = nn::ParseStyle("ColwiseParallel(output=R)");
  if (!style.ok() || !(*style == nn::ParallelStyle(nn::ColwiseParallel{.output_layout = Replicate()}))) return 1;
  std::printf("consumer OK: %s, bad input says: %s; CUDA built: %d, devices: %d, cuda:0 says: %s\n",
              c->ToString().c_str(), bad.status().ToString().c_str(), CudaBuilt() ? 1 : 0, CudaDeviceCount(),
              gpu.ok() ? "OK" : gpu.status().ToString().c_str());
  return 0;
}
