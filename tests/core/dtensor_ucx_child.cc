// Rank program for tests/core/dtensor_ucx_test.cc, run under dtrun on the ucx backend: a
// representative slice of the redistribution suite as real processes. With --backend nccl the
// same on GPUs (scripts/gpu_bundle.sh runs it): each rank on cuda:LOCAL_RANK, or all on cuda:0
// where GPUs are fewer than ranks (each process then names itself a host of its own, as NCCL
// refuses two ranks of one host on one GPU, and the ranks meet over sockets on loopback). For each mesh that fits
// the world size, every pair of layouts drawn from {R, S(0), S(1), P(sum), P(max)} per mesh dim,
// on an even and an uneven shape, float32 and int64: Distribute the global tensor, Redistribute,
// and check FullTensor() against the global tensor bit for bit and the collectives this rank
// issued against the plan's prediction. Also a cross-mesh move (1-d -> 2-d). Prints each
// failure; exits 1 if there was one. With --abort K: ranks failing together (RunAbort).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dtensor/collectives/nccl/nccl_communicator.h"
#include "dtensor/collectives/store/rendezvous.h"
#include "dtensor/collectives/ucx/ucx_communicator.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/ops/ops.h"
#include "tests/testing/nccl_process_gpu.h"

namespace dtensor {
namespace {

int g_failures = 0;
int g_cases = 0;

void Fail(const std::string& what) {
  ++g_failures;
  if (g_failures <= 30) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
}

// Multiples of 24: dividing by any group size up to 8 (R -> P(sum)) and summing back is exact.
// On `device` (the mesh's).
absl::StatusOr<Tensor> Global(IntSpan shape, DType dtype, Device device) {
  std::vector<int64_t> v(static_cast<size_t>(NumElements(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = 24 * (static_cast<int64_t>(i * 7 + 3) % 17 - 8);
  auto t = Tensor::FromVector<int64_t>(v, shape);
  if (!t.ok()) return t.status();
  auto cast = Cast(*t, dtype);
  if (!cast.ok()) return cast.status();
  return To(*cast, device);
}

std::vector<Layout> Layouts(int mesh_ndim) {
  const std::vector<Placement> choices = {Replicate(), Shard(0), Shard(1), Partial(PartialOp::kSum),
                                          Partial(PartialOp::kMax)};
  std::vector<Layout> out;
  std::vector<size_t> idx(static_cast<size_t>(mesh_ndim), 0);
  while (true) {
    Placements ps;
    std::optional<PartialOp> op;
    bool mixed = false;
    for (size_t i : idx) {
      ps.push_back(choices[i]);
      if (choices[i].is_partial()) {
        mixed |= op && *op != choices[i].partial_op();
        op = choices[i].partial_op();
      }
    }
    if (!mixed) out.emplace_back(ps);
    size_t k = 0;
    while (k < idx.size() && ++idx[k] == choices.size()) idx[k++] = 0;
    if (k == idx.size()) break;
  }
  return out;
}

bool ShardToPartial(const Layout& a, const Layout& b, IntSpan mesh_shape) {
  for (int m = 0; m < a.ndim(); ++m) {
    if (mesh_shape[static_cast<size_t>(m)] > 1 && a[m].is_shard() && b[m].is_partial()) return true;
  }
  return false;
}

void RunMesh(Communicator& world, IntSpan mesh_shape) {
  auto mesh = DeviceMesh::Create(world, mesh_shape);
  if (!mesh.ok()) return Fail(mesh.status().ToString());
  CommCounter counter;
  SetCommCounter(*mesh, &counter);
  const std::vector<Layout> layouts = Layouts(mesh->ndim());
  for (const Shape& shape : {Shape{8, 4, 6}, Shape{7, 5, 3}}) {
    for (DType dtype : {DType::kFloat32, DType::kInt64}) {
      auto global = Global(shape, dtype, world.device());
      if (!global.ok()) return Fail(global.status().ToString());
      const std::vector<double> want = *ToDoubleVector(*global);
      for (const Layout& src : layouts) {
        auto x = DTensor::Distribute(*global, *mesh, src);
        if (!x.ok()) return Fail(absl::StrCat("Distribute ", src.ToString(), ": ", x.status().ToString()));
        for (const Layout& dst : layouts) {
          if (ShardToPartial(src, dst, mesh_shape)) continue;
          const std::string what = absl::StrCat(mesh->ToString(), " ", ShapeString(shape), " ", DTypeName(dtype), " ",
                                                src.ToString(), " -> ", dst.ToString());
          ++g_cases;
          counter.Reset();
          auto y = x->Redistribute(dst);
          if (!y.ok()) return Fail(absl::StrCat(what, ": ", y.status().ToString()));
          auto plan = PlanRedistribute(shape, mesh_shape, src, dst, static_cast<int64_t>(ElementSize(dtype)));
          CommCounter predicted;
          for (const CommRecord& r : plan->PredictComm(mesh->coordinate())) predicted.Record(r.kind, r.bytes);
          if (predicted.ToString() != counter.ToString()) {
            Fail(absl::StrCat(what, ": issued {", counter.ToString(), "} but the plan predicts {", predicted.ToString(),
                              "}"));
          }
          auto full = y->FullTensor();
          if (!full.ok()) return Fail(absl::StrCat(what, ": FullTensor: ", full.status().ToString()));
          if (*ToDoubleVector(*full) != want) Fail(absl::StrCat(what, ": FullTensor differs from the global tensor"));
        }
      }
    }
  }
}

void RunCrossMesh(Communicator& world) {
  const int p = world.size();
  if (p != 4) return;
  auto flat = DeviceMesh::Create(world, {4}, {"w"});
  auto grid = DeviceMesh::Create(world, {2, 2}, {"dp", "tp"});
  if (!flat.ok() || !grid.ok()) return Fail("cross-mesh: mesh creation failed");
  auto global = Global({9, 6}, DType::kFloat32, world.device());
  const std::vector<double> want = *ToDoubleVector(*global);
  for (const Layout& src : {Layout{Shard(0)}, Layout{Shard(1)}, Layout{Partial()}, Layout{Replicate()}}) {
    for (const Layout& dst : {Layout{Shard(0), Shard(0)}, Layout{Shard(1), Shard(0)}, Layout{Replicate(), Partial()},
                              Layout{Replicate(), Shard(1)}}) {
      ++g_cases;
      const std::string what = absl::StrCat("cross-mesh ", src.ToString(), " on [4] -> ", dst.ToString(), " on 2x2");
      auto x = DTensor::Distribute(*global, *flat, src);
      auto y = x.ok() ? x->Redistribute(*grid, dst) : x;
      if (!y.ok()) return Fail(absl::StrCat(what, ": ", y.status().ToString()));
      auto back = y->Redistribute(*flat, src);
      if (!back.ok()) return Fail(absl::StrCat(what, " and back: ", back.status().ToString()));
      auto full = y->FullTensor();
      auto full_back = back->FullTensor();
      if (!full.ok() || !full_back.ok()) return Fail(absl::StrCat(what, ": FullTensor failed"));
      if (*ToDoubleVector(*full) != want || *ToDoubleVector(*full_back) != want) {
        Fail(absl::StrCat(what, ": values differ"));
      }
    }
  }
}

// This process's rank of an NCCL group (see the top); `store` must outlive the communicator's
// users on rank 0, which serves it.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNccl(std::unique_ptr<StoreClient>* store) {
  absl::StatusOr<LaunchInfo> info = LaunchInfoFromEnv();
  if (!info.ok()) return info.status();
  const int device = testing::NcclProcessGpu(*info);
  auto s = ConnectStore(*info, absl::Seconds(60));
  if (!s.ok()) return s.status();
  *store = *std::move(s);
  return MakeNcclCommunicator(*info, **store, device, absl::Seconds(60));
}

int Run(bool nccl) {
  std::unique_ptr<StoreClient> store;
  auto comm = nccl ? MakeNccl(&store) : MakeUcxCommunicatorFromEnv(absl::Seconds(60));
  if (!comm.ok()) {
    std::fprintf(stderr, "making the %s communicator: %s\n", nccl ? "nccl" : "ucx", comm.status().ToString().c_str());
    return 2;
  }
  Communicator& world = **comm;
  const absl::Time start = absl::Now();
  const int p = world.size();
  RunMesh(world, {p});
  if (p == 4) RunMesh(world, {2, 2});
  if (p == 2) RunMesh(world, {1, 2});
  RunCrossMesh(world);
  std::printf("%d cases on %s (%s), %d failures, %.2f s\n", g_cases, world.backend(), world.device().ToString().c_str(),
              g_failures, absl::ToDoubleSeconds(absl::Now() - start));
  if (!world.Barrier().ok()) return 3;
  return g_failures == 0 ? 0 : 1;
}

// --abort K: ranks fail together. Rank K's FromLocal fails its shape check 200 ms after the
// others, past their own FromLocal, entered the next Redistribute; they must return Aborted
// naming rank K and its error within 1 s, and every rank's communicator refuses later calls
// saying it was aborted. Then the same at the communicator level on a 2x2 split (a fresh
// world): rank K aborts while its row peer waits in AllReduce on their row communicator and
// the other two wait in AllGather on their column communicators.
absl::StatusOr<Tensor> Zeros(IntSpan shape) {
  return Tensor::FromVector<float>(std::vector<float>(static_cast<size_t>(NumElements(shape)), 0.0f), shape);
}

int RunAbort(int k) {
  // Two worlds of the same ranks, one per part (an abort ends its world).
  absl::StatusOr<LaunchInfo> info = LaunchInfoFromEnv();
  if (!info.ok()) return 2;
  auto store = ConnectStore(*info, absl::Seconds(60));
  if (!store.ok()) return 2;
  auto made = MakeUcxCommunicator(*info, **store, absl::Seconds(60));
  auto made2 = MakeUcxCommunicator(*info, **store, absl::Seconds(60));
  if (!made.ok() || !made2.ok()) {
    std::fprintf(stderr, "making the ucx communicators: %s %s\n", made.status().ToString().c_str(),
                 made2.status().ToString().c_str());
    return 2;
  }
  Communicator& world = **made;
  const int rank = world.rank();
  if (world.size() != 4 || k < 0 || k >= 4) {
    std::fprintf(stderr, "--abort needs 4 ranks and 0 <= K < 4\n");
    return 2;
  }
  const std::string named = absl::StrCat("rank ", k, " aborted the communicator");
  auto expect_aborted = [&](const char* what, const absl::Status& s, absl::Duration took, const char* also) {
    if (s.code() != absl::StatusCode::kAborted || s.message().find(named) == std::string::npos ||
        (also != nullptr && s.message().find(also) == std::string::npos)) {
      Fail(absl::StrCat(what, ": expected Aborted naming rank ", k, ", got ", s.ToString()));
    } else if (took >= absl::Seconds(1)) {
      Fail(absl::StrCat(what, ": took ", absl::FormatDuration(took), " (>= 1 s)"));
    } else {
      std::printf("%s: Aborted after %.1f ms: %s\n", what, absl::ToDoubleMilliseconds(took),
                  std::string(s.message()).c_str());
    }
  };
  {
    auto m = DeviceMesh::Create(world, {4});
    if (!m.ok()) return 2;
    DTensor::FromLocalOptions o;
    o.global_shape = Shape{8, 6};
    if (rank == k) {
      absl::SleepFor(absl::Milliseconds(200));
      auto wrong = Zeros({3, 3});
      if (!wrong.ok()) return 2;
      const absl::StatusOr<DTensor> x = DTensor::FromLocal(*wrong, *m, Layout({Shard(0)}), o);
      if (x.ok() || x.status().code() != absl::StatusCode::kInvalidArgument) {
        Fail(absl::StrCat("FromLocal of a wrong piece: expected InvalidArgument, got ", x.status().ToString()));
      }
    } else {
      auto local = Zeros({2, 6});
      if (!local.ok()) return 2;
      const absl::StatusOr<DTensor> x = DTensor::FromLocal(*local, *m, Layout({Shard(0)}), o);
      if (!x.ok()) return 2;
      const absl::Time t0 = absl::Now();
      const absl::StatusOr<DTensor> y = x->Redistribute(Layout({Replicate()}));
      expect_aborted("Redistribute", y.status(), absl::Now() - t0, "is not this rank's piece");
    }
    const absl::Time t0 = absl::Now();
    expect_aborted("Barrier afterwards", world.Barrier(), absl::Now() - t0, nullptr);
  }
  // Communicator level, on the second world split as a 2x2 mesh: rows {0, 1}, {2, 3},
  // columns {0, 2}, {1, 3}.
  Communicator& w2 = **made2;
  auto row = w2.Split(rank / 2, rank);
  auto col = w2.Split(rank % 2, rank);
  if (!row.ok() || !col.ok()) return 2;
  auto buf = Zeros({4});
  auto all = Zeros({8});
  if (!buf.ok() || !all.ok()) return 2;
  if (rank == k) {
    absl::SleepFor(absl::Milliseconds(200));
    w2.Abort(absl::InvalidArgumentError("test: rank gives up"));
    const absl::Status s = (*col)->AllGather(*buf, *all);
    expect_aborted("AllGather after its own abort", s, absl::ZeroDuration(), nullptr);
  } else {
    const bool same_row = rank / 2 == k / 2;
    const absl::Time t0 = absl::Now();
    const absl::Status s = same_row ? (*row)->AllReduce(*buf, *buf, CommReduceOp::kSum) : (*col)->AllGather(*buf, *all);
    expect_aborted(same_row ? "AllReduce on the row" : "AllGather on the column", s, absl::Now() - t0,
                   "test: rank gives up");
  }
  std::printf("abort: %d failures\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--abort") == 0) return dtensor::RunAbort(std::atoi(argv[2]));
  const bool nccl = argc == 3 && std::strcmp(argv[1], "--backend") == 0 && std::strcmp(argv[2], "nccl") == 0;
  if (argc != 1 && !nccl) {
    std::fprintf(stderr, "usage: dtensor_ucx_child [--backend nccl]\n");
    return 2;
  }
  return dtensor::Run(nccl);
}
