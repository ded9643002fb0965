// The main() of every test binary: GoogleTest's, after ReexecWithFasterBlasCore, so that tests
// run the OpenBLAS kernels the trainer runs (and not generic ones where OpenBLAS does not know
// this CPU model).
#include <cstdio>

#include "dtensor/kernels/cpu/blas_core.h"
#include "gtest/gtest.h"

int main(int argc, char** argv) {
  if (absl::Status blas = dtensor::ReexecWithFasterBlasCore(argv); !blas.ok()) {
    std::fprintf(stderr, "%s\n", blas.ToString().c_str());
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
