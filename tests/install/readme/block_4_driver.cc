// Driver for README ```cpp block 4: a tensor-parallel plan applied with ParallelizeModule.
// Context the fragment assumes: `model` (an nn::GPT, whose names are GPT-2's
// "transformer.h.<i>.mlp.c_fc", ...) and a `mesh` with a "tp" dim of 2 thread ranks; the
// statements run inside a function returning absl::Status.
// readme-block-sha256: 8764b34345607c5f183af4aa5301a5055f999dbb2e9ea55545d0c282643d5502
// readme-block-run: yes
#include <memory>

#include "block_4_head.inc"  // the README block's includes
#include "dtensor/nn/gpt.h"
#include "dtensor/tensor/status.h"
#include "run_ranks.h"
using namespace dtensor;

absl::Status Block4(Communicator& world) {
  nn::GPTConfig cfg{.vocab_size = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
  DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> gpt, nn::GPT::Create(cfg));
  DT_RETURN_IF_ERROR(gpt->InitWeights(/*seed=*/1));
  nn::GPT& model = *gpt;
  DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {2}, {"tp"}));
#include "block_4_body.inc"  // the README block's statements, verbatim
  return absl::OkStatus();
}

int main() {
  return RunRanks(2, [](Communicator& world) { return Block4(world); });
}
