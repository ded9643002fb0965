// dtensor_tour: DTensors on a 2x2 mesh of four ranks, top to bottom — distribute a matrix,
// look at who holds what, redistribute between layouts and read the plans, shard one dim over
// both mesh dims in either order (FSDP over TP needs TP first), move to another mesh.
//
//   dtensor_tour            four ranks as threads of this process (no launcher)
//
// Rank 0 prints; every rank runs the same calls (they are collectives).
#include <cstdio>
#include <thread>
#include <vector>

#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace {

using namespace dtensor;

absl::Status Tour(Communicator& world) {
  const bool talk = world.rank() == 0;
  auto say = [&](const std::string& s) {
    if (talk) std::printf("%s\n", s.c_str());
  };

  // 1. A 2x2 mesh: "dp" rows, "tp" columns. Rank r sits at coordinate (r / 2, r % 2).
  DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {2, 2}, {"dp", "tp"}));
  CommCounter counter;
  SetCommCounter(mesh, &counter);

  // 2. A [7, 5] matrix 0..34, rows over dp and columns over tp: uneven, as torch.chunk splits.
  DT_ASSIGN_OR_RETURN(Tensor flat, Arange(35, DType::kFloat32));
  DT_ASSIGN_OR_RETURN(Tensor full, Reshape(flat, {7, 5}));
  DT_ASSIGN_OR_RETURN(DTensor x, DTensor::Distribute(full, mesh, {Shard(0), Shard(1)}));
  say(x.ToString());
  say(VisualizeSharding(x));

  // 3. Redistribute: each call follows the plan that sends the fewest bytes.
  for (const Layout& target :
       {Layout{Replicate(), Shard(1)}, Layout{Shard(1), Shard(0)}, Layout{Replicate(), Replicate()}}) {
    DT_ASSIGN_OR_RETURN(auto plan, PlannerOf(mesh).Plan(x.shape(), mesh.shape(), x.layout(), target, 4));
    counter.Reset();
    DT_ASSIGN_OR_RETURN(DTensor y, x.Redistribute(target));
    say("\nplan " + plan->ToString() + "\n" + plan->DebugString() + "\nissued: " + counter.ToString());
    DT_ASSIGN_OR_RETURN(Tensor back, y.FullTensor());
    DT_ASSIGN_OR_RETURN(std::vector<double> got, ToDoubleVector(back));
    DT_ASSIGN_OR_RETURN(std::vector<double> want, ToDoubleVector(full));
    if (got != want) return absl::InternalError("full tensor differs after " + plan->ToString());
  }

  // 4. Rows over both mesh dims: dp first (the default) or tp first (FSDP over TP).
  DT_ASSIGN_OR_RETURN(Layout tp_first, Layout({Shard(0), Shard(0)}).WithShardOrder(0, {1, 0}));
  DT_ASSIGN_OR_RETURN(DTensor rows_dp, DTensor::Distribute(full, mesh, {Shard(0), Shard(0)}));
  DT_ASSIGN_OR_RETURN(DTensor rows_tp, rows_dp.Redistribute(tp_first));
  say("\n" + VisualizeSharding(rows_dp) + "\n" + VisualizeSharding(rows_tp));

  // 5. Another mesh over the same four ranks: the pieces go straight to their new owners.
  DT_ASSIGN_OR_RETURN(DeviceMesh line, DeviceMesh::Create(world, {4}, {"world"}));
  DT_ASSIGN_OR_RETURN(DTensor on_line, x.Redistribute(line, {Shard(1)}));
  say("\n" + VisualizeSharding(on_line));
  return absl::OkStatus();
}

}  // namespace

int main() {
  auto comms = MakeThreadGroup(4);
  if (!comms.ok()) {
    std::fprintf(stderr, "%s\n", comms.status().ToString().c_str());
    return 1;
  }
  std::vector<absl::Status> results(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back([&, r] { results[static_cast<size_t>(r)] = Tour(*(*comms)[static_cast<size_t>(r)]); });
  for (std::thread& t : ranks) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  return 0;
}
