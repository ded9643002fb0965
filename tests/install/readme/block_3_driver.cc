// Driver for README ```cpp block 3: FullyShard of a GPT's blocks and root, then AdamW.
// Context the fragment assumes: `model` (std::unique_ptr<nn::GPT>), `cfg` (its
// nn::GPTConfig) and a 1-D `mesh` of 2 thread ranks; the statements run inside a function
// returning absl::Status, run on both ranks.
// readme-block-sha256: 6e97fac1d14dae16ba9a471412512239003028b42fc6e0147a073f8efa5e8140
// readme-block-run: yes
#include <memory>

#include "block_3_head.inc"  // the README block's includes
#include "dtensor/nn/gpt.h"
#include "dtensor/tensor/status.h"
#include "run_ranks.h"
using namespace dtensor;

absl::Status Block3(Communicator& world) {
  nn::GPTConfig cfg{.vocab_size = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
  DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> model, nn::GPT::Create(cfg));
  DT_RETURN_IF_ERROR(model->InitWeights(/*seed=*/1));
  DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {2}, {"dp_shard"}));
#include "block_3_body.inc"  // the README block's statements, verbatim
  (void)opt;
  return absl::OkStatus();
}

int main() {
  return RunRanks(2, [](Communicator& world) { return Block3(world); });
}
