// Driver for README ```cpp block 2: the function Rank(world, full) each of 4 ranks runs.
// Runs it on 4 threads (MakeThreadGroup(4)) with the same [7, 5] tensor on every rank and
// checks that the block's FullTensor round trip returned without error on every rank.
// readme-block-sha256: 5f309d349ed04edfab54b787510c1164fcf1a301e1cc4e0cfe8b7815c5242096
// readme-block-run: yes
#include "block_2.cc"  // the README block, verbatim, at file scope
#include "dtensor/ops/ops.h"
#include "run_ranks.h"

int main() {
  auto full = RandomNormal({7, 5}, DType::kFloat32, /*seed=*/1);
  if (!full.ok()) return 1;
  return RunRanks(4, [&](Communicator& world) { return Rank(world, *full); });
}
