// Driver for README ```cpp block 5: save a checkpoint, find the latest, load it back.
// Context the fragment assumes: `world` (2 thread ranks), `wte` (a DTensor Shard(0) over
// them), `step` (a Tensor every rank holds) and `target` (a CheckpointState of zeroed
// tensors of the same shapes); the statements run inside a function returning absl::Status in
// a scratch directory ("ckpt" is relative), which then checks target holds the saved values.
// readme-block-sha256: 8502a34fa70aaf0514fe98fffedb026c4b5f63beb6228e0015a630595c7ad168
// readme-block-run: yes
#include <string>

#include "block_5_head.inc"  // the README block's includes
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "run_ranks.h"
using namespace dtensor;

absl::Status SameValues(const Tensor& a, const Tensor& b, const char* what) {
  if (a.numel() != b.numel()) return absl::InternalError(std::string(what) + ": sizes differ");
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (a.data<float>()[i] != b.data<float>()[i]) {
      return absl::InternalError(std::string(what) + ": element " + std::to_string(i) + " differs");
    }
  }
  return absl::OkStatus();
}

absl::Status Block5(Communicator& world) {
  DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {2}, {"dp"}));
  DT_ASSIGN_OR_RETURN(Tensor wte_full, RandomNormal({6, 4}, DType::kFloat32, /*seed=*/1));
  DT_ASSIGN_OR_RETURN(DTensor wte, DTensor::Distribute(wte_full, mesh, {Shard(0)}));
  DT_ASSIGN_OR_RETURN(Tensor step, Full({1}, 10.0, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(Tensor zeros, Zeros({6, 4}, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(DTensor wte_loaded, DTensor::Distribute(zeros, mesh, {Shard(0)}));
  DT_ASSIGN_OR_RETURN(Tensor step_loaded, Zeros({1}, DType::kFloat32));
  CheckpointState target = {{"wte", wte_loaded}, {"step", step_loaded}};
#include "block_5_body.inc"  // the README block's statements, verbatim
  DT_ASSIGN_OR_RETURN(Tensor got, wte_loaded.FullTensor());
  DT_RETURN_IF_ERROR(SameValues(got, wte_full, "wte"));
  return SameValues(step_loaded, step, "step");
}

int main() {
  return RunRanks(2, [](Communicator& world) { return Block5(world); });
}
