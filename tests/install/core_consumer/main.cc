// A consumer of the core and collectives components only (no nn, autograd, UCX, NCCL): 4 ranks
// as threads on a 2x2 mesh shard a [7, 5] tensor by rows, redistribute it to column shards and
// gather it back. Every local block is checked against the global tensor with torch.chunk's
// split written out here (rows 4 / 3, columns 3 / 2); exits non-zero on any mismatch or error.
// Built by tests/install with find_package(dtensor COMPONENTS core collectives) and with
// pkg-config and make (Makefile).
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

using namespace dtensor;

namespace {

constexpr int64_t kRows = 7, kCols = 5;

// Checks that `local` holds full[r0:r0+nr, c0:c0+nc].
absl::Status CheckBlock(const char* what, const Tensor& local, const std::vector<float>& full, int64_t r0, int64_t nr,
                        int64_t c0, int64_t nc) {
  if (local.shape().size() != 2 || local.shape()[0] != nr || local.shape()[1] != nc) {
    return absl::InternalError(absl::StrCat(what, ": local shape is not [", nr, ", ", nc, "]"));
  }
  DT_ASSIGN_OR_RETURN(Tensor c, Contiguous(local));
  const float* p = c.data<float>();
  for (int64_t i = 0; i < nr; ++i) {
    for (int64_t j = 0; j < nc; ++j) {
      if (p[i * nc + j] != full[(r0 + i) * kCols + c0 + j]) {
        return absl::InternalError(absl::StrCat(what, ": element (", i, ", ", j, ") differs"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Rank(Communicator& world, const std::vector<float>& values) {
  DT_ASSIGN_OR_RETURN(Tensor full, Tensor::FromVector<float>(values, {kRows, kCols}));
  DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {2, 2}, {"dp", "tp"}));
  const int64_t dp = world.rank() / 2, tp = world.rank() % 2;  // row-major mesh coordinate
  DT_ASSIGN_OR_RETURN(DTensor x, DTensor::Distribute(full, mesh, {Shard(0), Replicate()}));
  DT_RETURN_IF_ERROR(CheckBlock("S(0)R", x.ToLocal(), values, dp * 4, dp == 0 ? 4 : 3, 0, kCols));
  DT_ASSIGN_OR_RETURN(DTensor y, x.Redistribute({Replicate(), Shard(1)}));
  DT_RETURN_IF_ERROR(CheckBlock("RS(1)", y.ToLocal(), values, 0, kRows, tp * 3, tp == 0 ? 3 : 2));
  DT_ASSIGN_OR_RETURN(Tensor back, y.FullTensor());
  DT_RETURN_IF_ERROR(CheckBlock("FullTensor", back, values, 0, kRows, 0, kCols));
  return absl::OkStatus();
}

}  // namespace

int main() {
  std::vector<float> values(kRows * kCols);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * static_cast<float>(i) - 3.0f;
  auto comms = MakeThreadGroup(4);
  if (!comms.ok()) {
    std::fprintf(stderr, "MakeThreadGroup: %s\n", comms.status().ToString().c_str());
    return 1;
  }
  std::vector<absl::Status> status(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) threads.emplace_back([&, r] { status[r] = Rank(*(*comms)[r], values); });
  for (auto& t : threads) t.join();
  int rc = 0;
  for (int r = 0; r < 4; ++r) {
    if (!status[r].ok()) {
      std::fprintf(stderr, "rank %d: %s\n", r, status[r].ToString().c_str());
      rc = 1;
    }
  }
  if (rc == 0) std::printf("core consumer OK: [7, 5] S(0)R -> RS(1) -> full on 4 thread ranks, every block checked\n");
  return rc;
}
