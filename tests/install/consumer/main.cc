// Uses the installed dtensor: a matmul checked against a naive loop; exits non-zero on error.
#include <cmath>
#include <cstdio>
#include <vector>

#include "dtensor/ops/ops.h"

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
  std::printf("consumer OK: %s, bad input says: %s\n", c->ToString().c_str(), bad.status().ToString().c_str());
  return 0;
}
