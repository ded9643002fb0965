// Focused tests of DTensor on the threads backend, each against expectations computed here:
// Distribute (scatter and broadcast from a source rank, local chunks without one), FromLocal's
// inference of the global shape, ToString, VisualizeSharding, RedistributeAsync, the plan
// cache, and redistribution across meshes over the same world (4 <-> 2x2).
#include "dtensor/core/dtensor.h"

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "dtensor/core/executor.h"
#include "dtensor/ops/ops.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/suite_util.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using suite::Spec;
using ::testing::HasSubstr;
using testing::Unwrap;

using suite::RunRanks;

// This rank's box of `values` (a global tensor of `shape`) under `spec`, as a tensor.
Tensor BoxTensor(const std::vector<double>& values, IntSpan shape, DType dtype, const Spec& spec, IntSpan mesh,
                 IntSpan coord) {
  const suite::Box b = suite::NaiveBox(shape, mesh, spec, coord);
  return suite::MakeTensor(suite::BoxValues(values, shape, b), b.shape, dtype);
}

std::vector<double> Scaled(std::vector<double> v, double f) {
  for (double& x : v) x *= f;
  return v;
}

Shape ShapeOf(IntSpan s) { return Shape(s.begin(), s.end()); }

const DType kDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kInt64};

// ---- Distribute ----

std::vector<Spec> DistributeSpecs() {
  return {
      {{Shard(0), Shard(1)}, {}},       {{Shard(1), Shard(0)}, {}},
      {{Shard(0), Shard(0)}, {}},       {{Shard(0), Shard(0)}, {{0, {1, 0}}}},
      {{Replicate(), Shard(1)}, {}},    {{Shard(1), Replicate()}, {}},
      {{Replicate(), Replicate()}, {}},
  };
}

// The source rank's values are scattered: every rank gets its box of them, whatever the
// others passed; the input is not modified.
TEST(DTensorDistribute, ScattersFromSourceRank) {
  for (DType dtype : kDTypes) {
    for (const Shape& shape : {Shape{7, 5}, Shape{8, 6}, Shape{1, 1}, Shape{0, 3}}) {
      const std::vector<double> src_vals = suite::GlobalValues(shape, dtype, false, 11);
      for (const Spec& spec : DistributeSpecs()) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", ShapeString(shape), " ", suite::SpecString(spec)));
        RunRanks(4, [&](int rank, Communicator& comm) {
          DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
          const std::vector<double> mine = rank == 2 ? src_vals : suite::GlobalValues(shape, dtype, false, 100 + rank);
          const Tensor input = suite::MakeTensor(mine, shape, dtype);
          CommCounter counter;
          SetCommCounter(mesh, &counter);
          DTensor x = Unwrap(DTensor::Distribute(input, mesh, Unwrap(suite::ToLayout(spec)), {2}));
          SetCommCounter(mesh, nullptr);
          EXPECT_EQ(suite::CompareBits(x.ToLocal(), BoxTensor(src_vals, shape, dtype, spec, {2, 2}, mesh.coordinate())),
                    "")
              << "rank " << rank;
          EXPECT_EQ(suite::CompareBits(input, suite::MakeTensor(mine, shape, dtype)), "") << "input modified";
          EXPECT_EQ(ShapeOf(x.shape()), shape);
          EXPECT_EQ(x.dtype(), dtype);
          EXPECT_EQ(x.layout(), Unwrap(suite::ToLayout(spec)));
          EXPECT_GE(counter.total_calls(), 1) << "rank " << rank << ": values moved without a recorded collective";
          Tensor full = Unwrap(x.FullTensor());
          EXPECT_EQ(suite::CompareBits(full, suite::MakeTensor(src_vals, shape, dtype)), "") << "rank " << rank;
        });
      }
    }
  }
}

// Replicate everywhere: one broadcast of the whole tensor from the source rank.
TEST(DTensorDistribute, BroadcastsReplicatedFromSourceRank) {
  for (DType dtype : kDTypes) {
    const Shape shape = {5, 3};
    const std::vector<double> src_vals = suite::GlobalValues(shape, dtype, false, 12);
    RunRanks(3, [&](int rank, Communicator& comm) {
      DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {3}));
      const Tensor input =
          suite::MakeTensor(rank == 1 ? src_vals : suite::GlobalValues(shape, dtype, false, rank), shape, dtype);
      CommCounter counter;
      SetCommCounter(mesh, &counter);
      DTensor x = Unwrap(DTensor::Distribute(input, mesh, Layout({Replicate()}), {1}));
      SetCommCounter(mesh, nullptr);
      EXPECT_EQ(suite::CompareBits(x.ToLocal(), suite::MakeTensor(src_vals, shape, dtype)), "") << "rank " << rank;
      EXPECT_EQ(counter.calls(CommKind::kBroadcast), 1);
      EXPECT_EQ(counter.bytes(CommKind::kBroadcast), 15 * static_cast<int64_t>(ElementSize(dtype)));
      // And the ranks' agreement on shape and dtype: 10 int64s from each of the 3.
      EXPECT_EQ(counter.calls(CommKind::kAllGather), 1);
      EXPECT_EQ(counter.bytes(CommKind::kAllGather), 3 * 10 * 8);
      EXPECT_EQ(counter.total_calls(), 2) << counter.ToString();
    });
  }
}

// Partial placements start from the full value: P(sum) divides by the mesh dim size, avg and
// max keep it.
TEST(DTensorDistribute, PartialPlacementsFromSourceRank) {
  for (DType dtype : kDTypes) {
    const Shape shape = {4, 6};
    const std::vector<double> v = suite::GlobalValues(shape, dtype, /*exact_partial=*/true, 13);
    struct Want {
      Spec spec;
      double factor;  // local = factor * box
    };
    const std::vector<Want> wants = {
        {{{Partial(PartialOp::kSum), Replicate()}, {}}, 0.5},
        {{{Partial(PartialOp::kSum), Partial(PartialOp::kSum)}, {}}, 0.25},
        {{{Shard(1), Partial(PartialOp::kSum)}, {}}, 0.5},
        {{{Partial(PartialOp::kAvg), Partial(PartialOp::kAvg)}, {}}, 1.0},
        {{{Partial(PartialOp::kMax), Shard(0)}, {}}, 1.0},
        {{{Partial(PartialOp::kMin), Shard(1)}, {}}, 1.0},
    };
    for (const Want& w : wants) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", suite::SpecString(w.spec)));
      RunRanks(4, [&](int rank, Communicator& comm) {
        DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
        const Tensor input =
            suite::MakeTensor(rank == 0 ? v : suite::GlobalValues(shape, dtype, true, 50), shape, dtype);
        DTensor x = Unwrap(DTensor::Distribute(input, mesh, Unwrap(suite::ToLayout(w.spec)), {0}));
        // Floating point values are divided over the P(sum) dims; others stay whole on the
        // ranks at coordinate 0 of those dims and are zero elsewhere (an exact sum).
        double factor = w.factor;
        if (!IsComputeFloat(dtype) && w.factor != 1.0) {
          bool first = true;
          for (size_t m = 0; m < 2; ++m) {
            const Placement& p = w.spec.placements[m];
            first &= !(p.is_partial() && p.partial_op() == PartialOp::kSum) || mesh.coordinate()[m] == 0;
          }
          factor = first ? 1.0 : 0.0;
        }
        EXPECT_EQ(suite::CompareBits(x.ToLocal(),
                                     BoxTensor(Scaled(v, factor), shape, dtype, w.spec, {2, 2}, mesh.coordinate())),
                  "")
            << "rank " << rank;
        Tensor full = Unwrap(x.FullTensor());
        EXPECT_EQ(suite::CompareBits(full, suite::MakeTensor(v, shape, dtype)), "") << "rank " << rank;
      });
    }
  }
}

// R -> P(sum) of integers is exact: odd values survive a round trip (dividing by the mesh
// size would truncate 5 / 2 to 2), through Distribute and through Redistribute, on one and on
// both dims of a 2x2 mesh.
TEST(DTensorDistribute, IntegerPartialSumIsExact) {
  const Shape shape = {5, 7};
  std::vector<double> v;
  for (int i = 0; i < 35; ++i) v.push_back(2 * i + 1 - 30);
  for (DType dtype : {DType::kInt64, DType::kInt32}) {
    RunRanks(4, [&](int rank, Communicator& comm) {
      DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
      const Tensor input = suite::MakeTensor(v, shape, dtype);
      for (const Layout& l :
           {Layout({Partial(), Replicate()}), Layout({Partial(), Partial()}), Layout({Shard(1), Partial()})}) {
        DTensor x = Unwrap(DTensor::Distribute(input, mesh, l, {std::nullopt}));
        EXPECT_EQ(suite::CompareBits(Unwrap(x.FullTensor()), input), "")
            << DTypeName(dtype) << " " << l.ToString() << " rank " << rank;
        DTensor r = Unwrap(DTensor::Distribute(input, mesh, Layout({Replicate(), Replicate()}), {std::nullopt}));
        DTensor y = Unwrap(r.Redistribute(l));
        EXPECT_EQ(suite::CompareBits(Unwrap(y.FullTensor()), input), "")
            << DTypeName(dtype) << " R -> " << l.ToString() << " rank " << rank;
      }
    });
  }
}

// src_rank = nullopt: every rank holds the full tensor and keeps its chunk, no communication.
TEST(DTensorDistribute, LocalChunkWithoutSourceRank) {
  const Shape shape = {7, 5};
  const std::vector<double> v = suite::GlobalValues(shape, DType::kFloat32, true, 14);
  std::vector<Spec> specs = DistributeSpecs();
  specs.push_back({{Partial(PartialOp::kSum), Shard(0)}, {}});
  for (const Spec& spec : specs) {
    SCOPED_TRACE(suite::SpecString(spec));
    RunRanks(4, [&](int rank, Communicator& comm) {
      DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
      CommCounter counter;
      SetCommCounter(mesh, &counter);
      DTensor x = Unwrap(DTensor::Distribute(suite::MakeTensor(v, shape, DType::kFloat32), mesh,
                                             Unwrap(suite::ToLayout(spec)), {std::nullopt}));
      SetCommCounter(mesh, nullptr);
      EXPECT_EQ(counter.total_calls(), 0) << counter.ToString();
      const double f = spec.placements[0].is_partial() ? 0.5 : 1.0;
      EXPECT_EQ(suite::CompareBits(x.ToLocal(),
                                   BoxTensor(Scaled(v, f), shape, DType::kFloat32, spec, {2, 2}, mesh.coordinate())),
                "")
          << "rank " << rank;
    });
  }
}

TEST(DTensorDistribute, SourceRankOutOfRangeIsAnError) {
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {4}));
    const Tensor t = suite::MakeTensor(suite::GlobalValues({4}, DType::kFloat32, false, 1), {4}, DType::kFloat32);
    for (int src : {4, -1}) {
      auto x = DTensor::Distribute(t, mesh, Layout({Shard(0)}), {src});
      EXPECT_TRUE(!x.ok() && absl::IsInvalidArgument(x.status()))
          << "rank " << rank << " src " << src << ": " << x.status();
    }
  });
}

// A rank whose tensor has another shape or dtype than the source's: every rank gets
// InvalidArgument naming it (before, the source returned OK from the broadcast while the
// others failed; a scatter sized the pieces by each rank's own shape), and the mesh stays
// usable.
TEST(DTensorDistribute, RanksThatDisagreeWithTheSourceFailEverywhere) {
  struct Case {
    Shape shape;
    DType dtype;
    Layout layout;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{4, 6}, DType::kFloat32, Layout({Replicate()}), "mesh rank 2 passes a tensor of shape [4, 6] but the source"},
      {{4, 6}, DType::kFloat32, Layout({Shard(0)}), "mesh rank 2 passes a tensor of shape [4, 6]"},
      {{24}, DType::kFloat32, Layout({Shard(0)}), "mesh rank 2 passes a 1-d float32 tensor but the source"},
      {{4, 6}, DType::kInt64, Layout({Replicate()}), "mesh rank 2 passes a 2-d int64 tensor"},
      // S(1) is out of range for rank 2's 1-d tensor alone: it once failed at once while the
      // others waited in the agreement for the timeout.
      {{24}, DType::kFloat32, Layout({Shard(1)}), "mesh rank 2 passes a 1-d float32 tensor but the source"},
  };
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {4}));
    for (const Case& c : cases) {
      const bool odd = rank == 2;
      const Shape shape = odd ? c.shape : Shape{6, 4};
      const DType dtype = odd ? c.dtype : DType::kFloat32;
      const Tensor t = suite::MakeTensor(suite::GlobalValues(shape, dtype, false, 1), shape, dtype);
      auto x = DTensor::Distribute(t, mesh, c.layout, {1});
      EXPECT_TRUE(absl::IsInvalidArgument(x.status())) << "rank " << rank << ": " << x.status();
      EXPECT_THAT(std::string(x.status().message()), ::testing::HasSubstr(c.want)) << "rank " << rank;
    }
    // Still usable: the ranks agree now.
    const Tensor t = suite::MakeTensor(suite::GlobalValues({6, 4}, DType::kFloat32, false, 1), {6, 4}, DType::kFloat32);
    EXPECT_TRUE(DTensor::Distribute(t, mesh, Layout({Shard(1)}), {3}).ok()) << "rank " << rank;
  });
}

// ---- FromLocal ----

// Without global_shape: each sharded dim's local size times its mesh dims' sizes; no
// communication without run_check.
TEST(DTensorFromLocal, InfersGlobalShape) {
  struct Case {
    std::vector<int64_t> mesh;
    Layout layout;
    Shape local;
    Shape global;
  };
  const std::vector<Case> cases = {
      {{4}, Layout({Shard(0)}), {2, 3}, {8, 3}},
      {{4}, Layout({Shard(-1)}), {2, 3}, {2, 12}},
      {{4}, Layout({Replicate()}), {2, 3}, {2, 3}},
      {{4}, Layout({Partial()}), {2, 3}, {2, 3}},
      {{2, 2}, Layout({Shard(0), Shard(1)}), {2, 3}, {4, 6}},
      {{2, 2}, Layout({Shard(1), Shard(1)}), {2, 3}, {2, 12}},
      {{2, 2}, Layout({Shard(0), Shard(0)}).WithShardOrder(0, {1, 0}).value(), {2, 3}, {8, 3}},
      {{2, 2}, Layout({Partial(PartialOp::kMax), Shard(0)}), {2, 3}, {4, 3}},
      {{1, 4}, Layout({Shard(0), Shard(1)}), {2, 3}, {2, 12}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(ShapeString(c.mesh), " ", c.layout.ToString()));
    RunRanks(4, [&](int, Communicator& comm) {
      DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, c.mesh));
      CommCounter counter;
      SetCommCounter(mesh, &counter);
      const Tensor local =
          suite::MakeTensor(suite::GlobalValues(c.local, DType::kFloat32, false, 1), c.local, DType::kFloat32);
      DTensor x = Unwrap(DTensor::FromLocal(local, mesh, c.layout));
      SetCommCounter(mesh, nullptr);
      EXPECT_EQ(ShapeOf(x.shape()), c.global);
      EXPECT_EQ(x.stride(), ContiguousStrides(c.global));
      EXPECT_EQ(x.ToLocal().raw_data(), local.raw_data()) << "FromLocal should wrap, not copy";
      EXPECT_EQ(counter.total_calls(), 0);
    });
  }
}

// run_check without global_shape finds uneven shapes from the pieces: 7x5 over 2x2 as
// [S(0), S(1)] gives rows 4, 3 and columns 3, 2.
TEST(DTensorFromLocal, RunCheckFindsUnevenGlobalShape) {
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
    const Shape local = {rank < 2 ? 4 : 3, rank % 2 == 0 ? 3 : 2};
    DTensor::FromLocalOptions o;
    o.run_check = true;
    DTensor x = Unwrap(DTensor::FromLocal(
        suite::MakeTensor(std::vector<double>(static_cast<size_t>(local[0] * local[1]), 1.0), local, DType::kFloat32),
        mesh, Layout({Shard(0), Shard(1)}), o));
    EXPECT_EQ(ShapeOf(x.shape()), (Shape{7, 5})) << "rank " << rank;
    EXPECT_EQ(x.local_box().offset, (Shape{rank < 2 ? 0 : 4, rank % 2 == 0 ? 0 : 3}));
  });
}

// run_check: ranks given different global shapes (or one given none) all get the same
// InvalidArgument; the rank whose shape fitted its piece returned OK and then waited in its
// next collective until the timeout.
TEST(DTensorFromLocal, RunCheckRefusesGlobalShapesThatDiffer) {
  struct Case {
    std::optional<Shape> rank1;
    std::string want;
  };
  for (const Case& c : {Case{Shape{5, 3}, "mesh rank 1 gives global shape [5, 3] but mesh rank 0 [4, 3]"},
                        Case{std::nullopt, "mesh rank 1 gives global shape none but mesh rank 0 [4, 3]"}}) {
    const auto t0 = std::chrono::steady_clock::now();
    RunRanks(2, [&](int rank, Communicator& comm) {
      DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2}));
      DTensor::FromLocalOptions o;
      o.run_check = true;
      o.global_shape = rank == 0 ? std::optional<Shape>(Shape{4, 3}) : c.rank1;
      auto x = DTensor::FromLocal(suite::MakeTensor(std::vector<double>(6, 1.0), {2, 3}, DType::kFloat32), mesh,
                                  Layout({Shard(0)}), o);
      EXPECT_TRUE(absl::IsInvalidArgument(x.status())) << "rank " << rank << ": " << x.status();
      EXPECT_THAT(std::string(x.status().message()), ::testing::HasSubstr(c.want)) << "rank " << rank;
      // Still usable: both ranks are here.
      EXPECT_TRUE(comm.Barrier().ok()) << "rank " << rank;
    });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  }
}

// ---- Printing ----

TEST(DTensorPrint, ToStringAndVisualizeSharding) {
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}, {"dp", "tp"}));
    const Shape shape = {7, 5};
    DTensor x = Unwrap(DTensor::Distribute(suite::MakeTensor(std::vector<double>(35, 1.0), shape, DType::kFloat32),
                                           mesh, Layout({Shard(0), Replicate()}), {std::nullopt}));
    EXPECT_EQ(x.ToString(), absl::StrCat("DTensor(shape=[7, 5], dtype=float32, mesh=DeviceMesh(dp=2, tp=2), "
                                         "placements=S(0)R, local=[",
                                         rank < 2 ? 4 : 3, ", 5])"));
    if (rank == 0) {
      // The example of dtensor.h.
      EXPECT_EQ(VisualizeSharding(x),
                "DTensor [7, 5] float32 on DeviceMesh(dp=2, tp=2) as S(0)R\n"
                "  [0:4, 0:5]  ranks 0, 1\n"
                "  [4:7, 0:5]  ranks 2, 3");
    }
  });
}

// One line per distinct block, each with the ranks that hold it.
bool HasBlock(const std::string& out, const std::string& block, const std::string& ranks) {
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (line == absl::StrCat("  ", block, "  rank ", ranks) || line == absl::StrCat("  ", block, "  ranks ", ranks)) {
      return true;
    }
  }
  return false;
}

TEST(DTensorPrint, VisualizeShardingBlocks) {
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}, {"a", "b"}));
    if (rank != 0) return;
    // Mesh dim 1 splits rows first: coordinate (c0, c1) holds row 2 * c1 + c0; rank = 2 c0 + c1.
    const Layout tp_first = Unwrap(Layout({Shard(0), Shard(0)}).WithShardOrder(0, {1, 0}));
    std::string out = VisualizeSharding({4, 3}, mesh, tp_first);
    EXPECT_TRUE(HasBlock(out, "[0:1, 0:3]", "0")) << out;
    EXPECT_TRUE(HasBlock(out, "[1:2, 0:3]", "2")) << out;
    EXPECT_TRUE(HasBlock(out, "[2:3, 0:3]", "1")) << out;
    EXPECT_TRUE(HasBlock(out, "[3:4, 0:3]", "3")) << out;
    // Default order, uneven nesting: (5, 3) rows 2/1/1/1.
    out = VisualizeSharding({5, 3}, mesh, Layout({Shard(0), Shard(0)}));
    EXPECT_TRUE(HasBlock(out, "[0:2, 0:3]", "0")) << out;
    EXPECT_TRUE(HasBlock(out, "[2:3, 0:3]", "1")) << out;
    EXPECT_TRUE(HasBlock(out, "[3:4, 0:3]", "2")) << out;
    EXPECT_TRUE(HasBlock(out, "[4:5, 0:3]", "3")) << out;
    out = VisualizeSharding({4, 6}, mesh, Layout({Partial(), Shard(1)}));
    EXPECT_TRUE(HasBlock(out, "[0:4, 0:3]", "0, 2")) << out;
    EXPECT_TRUE(HasBlock(out, "[0:4, 3:6]", "1, 3")) << out;
    EXPECT_THAT(out, HasSubstr("partial sum"));
    out = VisualizeSharding({4, 6}, mesh, Layout({Partial(PartialOp::kAvg), Replicate()}));
    EXPECT_TRUE(HasBlock(out, "[0:4, 0:6]", "0, 1, 2, 3")) << out;
    EXPECT_THAT(out, HasSubstr("partial avg"));
    // Negative dims are shown normalised.
    out = VisualizeSharding({4, 6}, mesh, Layout({Replicate(), Shard(-1)}));
    EXPECT_THAT(out, HasSubstr("RS(1)"));
  });
}

// Undefined inputs give the empty box and an error line, as VisualizeSharding(DTensor()) and
// the invalid-layout overload do, instead of reading a mesh that is not there.
TEST(DTensorPrint, UndefinedDTensorAndMeshAreReportedNotRead) {
  const DTensor undefined;
  EXPECT_TRUE(undefined.local_box().offset.empty());
  EXPECT_TRUE(undefined.local_box().shape.empty());
  EXPECT_EQ(VisualizeSharding(undefined), "DTensor(undefined)");
  const std::string out = VisualizeSharding({4}, DeviceMesh(), Layout({Shard(0)}));
  EXPECT_THAT(out, HasSubstr("undefined DeviceMesh")) << out;
}

// ---- RedistributeAsync ----

// A PendingDTensor moves in code outside the library (its move operations are defined where
// its state is complete), and assigning over one in flight finishes that one first.
TEST(DTensorRedistributeAsync, PendingRedistributionsMove) {
  const Shape shape = {8, 6};
  const std::vector<double> v = suite::GlobalValues(shape, DType::kFloat32, true, 22);
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {4}));
    const DTensor x = Unwrap(
        DTensor::Distribute(suite::MakeTensor(v, shape, DType::kFloat32), mesh, Layout({Shard(0)}), {std::nullopt}));
    absl::StatusOr<PendingDTensor> first = x.RedistributeAsync(Layout({Replicate()}));
    absl::StatusOr<PendingDTensor> second = x.RedistributeAsync(Layout({Shard(1)}));
    ASSERT_TRUE(first.ok() && second.ok()) << first.status() << second.status();
    std::vector<PendingDTensor> pending;
    pending.push_back(std::move(*first));
    auto moved = std::make_unique<PendingDTensor>(std::move(pending.back()));
    PendingDTensor other = std::move(*second);
    other = std::move(*moved);  // the Shard(1) one is finished and dropped
    const DTensor y = Unwrap(other.Wait());
    EXPECT_EQ(suite::CompareBits(y.ToLocal(), suite::MakeTensor(v, shape, DType::kFloat32)), "") << "rank " << rank;
  });
}

TEST(DTensorRedistributeAsync, MatchesSynchronousRedistribute) {
  const Shape shape = {8, 6};
  for (DType dtype : kDTypes) {
    const std::vector<double> v = suite::GlobalValues(shape, dtype, true, 21);
    const std::vector<std::pair<Spec, Spec>> pairs = {
        {{{Shard(0), Shard(1)}, {}}, {{Replicate(), Replicate()}, {}}},
        {{{Shard(0), Replicate()}, {}}, {{Replicate(), Shard(1)}, {}}},
        {{{Shard(0), Shard(1)}, {}}, {{Shard(0), Shard(1)}, {}}},        // nothing to do
        {{{Replicate(), Replicate()}, {}}, {{Shard(1), Shard(0)}, {}}},  // local only
        {{{Partial(), Partial()}, {}}, {{Shard(0), Replicate()}, {}}},
        {{{Shard(0), Shard(0)}, {}}, {{Shard(0), Shard(0)}, {{0, {1, 0}}}}},
    };
    for (const auto& pair : pairs) {
      const auto& src = pair.first;  // not a structured binding: clang 14 lambdas cannot capture those
      const auto& dst = pair.second;
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", suite::SpecString(src), " -> ", suite::SpecString(dst)));
      RunRanks(4, [&](int rank, Communicator& comm) {
        DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
        const suite::Box box = suite::NaiveBox(shape, {2, 2}, src, mesh.coordinate());
        const std::vector<double> piece = suite::HasPartial(src)
                                              ? suite::PartialPiece(v, shape, box, src, {2, 2}, mesh.coordinate(), 5)
                                              : suite::BoxValues(v, shape, box);
        DTensor x = Unwrap(DTensor::FromLocal(suite::MakeTensor(piece, box.shape, dtype), mesh,
                                              Unwrap(suite::ToLayout(src)), {Shape(shape), false}));
        const Layout target = Unwrap(suite::ToLayout(dst));
        CommCounter counter;
        SetCommCounter(mesh, &counter);
        auto pending = x.RedistributeAsync(target);
        ASSERT_TRUE(pending.ok()) << pending.status();
        DTensor y = Unwrap(pending->Wait());
        EXPECT_TRUE(pending->IsCompleted());
        const RedistributePlan plan = Unwrap(PlanRedistribute(shape, {2, 2}, x.layout(), target, ElementSize(dtype)));
        EXPECT_EQ(suite::CompareComm(counter, plan.PredictComm(mesh.coordinate())), "") << "rank " << rank;
        counter.Reset();
        DTensor z = Unwrap(x.Redistribute(target));
        EXPECT_EQ(suite::CompareComm(counter, plan.PredictComm(mesh.coordinate())), "") << "rank " << rank;
        SetCommCounter(mesh, nullptr);
        EXPECT_EQ(y.layout(), target);
        EXPECT_EQ(suite::CompareBits(y.ToLocal(), BoxTensor(v, shape, dtype, dst, {2, 2}, mesh.coordinate())), "")
            << "rank " << rank;
        EXPECT_EQ(suite::CompareBits(z.ToLocal(), BoxTensor(v, shape, dtype, dst, {2, 2}, mesh.coordinate())), "")
            << "rank " << rank;
        EXPECT_EQ(suite::CompareBits(x.ToLocal(), suite::MakeTensor(piece, box.shape, dtype)), "") << "source changed";
      });
    }
  }
}

// ---- Plan cache ----

TEST(DTensorPlanCache, SecondRedistributeHitsTheCache) {
  RunRanks(4, [&](int, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
    DTensor x = Unwrap(DTensor::Distribute(suite::MakeTensor(std::vector<double>(24, 2.0), {4, 6}, DType::kFloat32),
                                           mesh, Layout({Shard(0), Shard(1)}), {std::nullopt}));
    RedistributePlanner& planner = PlannerOf(mesh);
    planner.Clear();
    Unwrap(x.Redistribute(Layout({Shard(1), Replicate()})));
    const int64_t misses = planner.misses();
    const int64_t hits = planner.hits();
    EXPECT_GE(misses, 1);
    Unwrap(x.Redistribute(Layout({Shard(1), Replicate()})));
    EXPECT_EQ(planner.misses(), misses) << "the second identical redistribution planned again";
    EXPECT_GT(planner.hits(), hits);
    // Views share the cache.
    DT_SUITE_MESH(sub, mesh.Sub("d1"));
    EXPECT_EQ(&PlannerOf(sub), &planner);
  });
}

// Two views of one mesh with the same shape share a plan but not their coordinates: on a 2x2
// mesh, rank (0,1) is at 0 of "d0" and at 1 of "d1". Redistributing on them in turn must use
// each view's own step geometry (the executor remembers the last one it used). Uneven shards
// (5 rows, 7 columns over 2), so that the boxes differ in shape by coordinate.
TEST(DTensorPlanCache, ViewsWithOneShapeKeepTheirOwnGeometry) {
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
    DT_SUITE_MESH(d0, mesh.Sub("d0"));
    DT_SUITE_MESH(d1, mesh.Sub("d1"));
    const std::vector<double> v = suite::GlobalValues({5, 7}, DType::kFloat32, false, 5);
    const Tensor full = suite::MakeTensor(v, {5, 7}, DType::kFloat32);
    std::vector<DTensor> xs;
    std::vector<Tensor> wants;
    for (const DeviceMesh* sub : {&d0, &d1}) {
      xs.push_back(Unwrap(DTensor::Distribute(full, *sub, Layout({Shard(0)}), {std::nullopt})));
      wants.push_back(Unwrap(DTensor::Distribute(full, *sub, Layout({Shard(1)}), {std::nullopt})).ToLocal());
    }
    const int64_t plans_before = PlannerOf(mesh).misses();
    for (int round = 0; round < 3; ++round) {
      for (size_t i = 0; i < xs.size(); ++i) {  // back to back: nothing else runs between them
        absl::StatusOr<DTensor> y = xs[i].Redistribute(Layout({Shard(1)}));
        ASSERT_TRUE(y.ok()) << "rank " << rank << " round " << round << " on d" << i << ": " << y.status();
        EXPECT_EQ(suite::CompareBits(y->ToLocal(), wants[i]), "")
            << "rank " << rank << " round " << round << " on d" << i;
      }
    }
    EXPECT_EQ(PlannerOf(mesh).misses(), plans_before + 1) << "the two views should share one plan";
  });
}

// ---- Slabs: the regions of an all_to_all step as one Narrow each ----

// SlabOf against RegionOf (a view from the region's offset in every dim): the same elements
// where the region is a slab of the box, nullopt where it is not.
TEST(DTensorSlabs, SlabOfMatchesRegionOf) {
  const LocalBox box{Shape{2, 3}, Shape{4, 6}};  // rows 2..6, columns 3..9 of some global tensor
  const Tensor t = suite::MakeTensor(suite::GlobalValues({4, 6}, DType::kFloat32, false, 3), {4, 6}, DType::kFloat32);
  struct Case {
    LocalBox region;
    bool slab;
    int64_t dim, start, length;  // the slab expected
  };
  const Case cases[] = {
      {{{2, 3}, {4, 6}}, true, -1, 0, 0},  // the whole box
      {{{2, 6}, {4, 3}}, true, 1, 3, 3},   // its last 3 columns
      {{{3, 3}, {2, 6}}, true, 0, 1, 2},   // rows 1..3
      {{{2, 3}, {4, 0}}, true, 0, 0, 0},   // empty
      {{{9, 1}, {0, 2}}, true, 0, 0, 0},   // empty, outside the box
      {{{3, 4}, {2, 2}}, false, 0, 0, 0},  // narrowed in two dims
      {{{2, 8}, {4, 3}}, false, 0, 0, 0},  // past the box's end
      {{{1, 3}, {2, 6}}, false, 0, 0, 0},  // before the box's start
      {{{2}, {4}}, false, 0, 0, 0},        // fewer dims than the box
  };
  for (const Case& c : cases) {
    const std::string where =
        absl::StrCat("region at ", ShapeString(c.region.offset), " of shape ", ShapeString(c.region.shape));
    const std::optional<internal::Slab> slab = internal::SlabOf(box, c.region);
    ASSERT_EQ(slab.has_value(), c.slab) << where;
    if (!slab) continue;
    EXPECT_EQ(slab->dim, c.dim) << where;
    EXPECT_EQ(slab->start, c.start) << where;
    EXPECT_EQ(slab->length, c.length) << where;
    const Tensor view = slab->dim < 0 ? t : Unwrap(t.Narrow(slab->dim, slab->start, slab->length));
    EXPECT_EQ(view.numel(), c.region.numel()) << where;
    if (c.region.numel() == 0) continue;
    const Tensor want = Unwrap(Contiguous(Unwrap(internal::RegionOf(t, box, c.region))));
    EXPECT_EQ(suite::CompareBits(view, want), "") << where;
  }
}

// An S(0) -> S(1) step takes the slab path (its cached geometry holds the slabs), uneven and
// with an empty piece too, and its result is the global tensor's columns.
TEST(DTensorSlabs, AllToAllStepsUseSlabs) {
  for (const Shape& shape : {Shape{6, 8}, Shape{7, 5}, Shape{5, 2}}) {
    RunRanks(3, [&](int rank, Communicator& comm) {
      DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {3}));
      const std::vector<double> v = suite::GlobalValues(shape, DType::kFloat32, false, 7);
      const Tensor full = suite::MakeTensor(v, shape, DType::kFloat32);
      const DTensor x = Unwrap(DTensor::Distribute(full, mesh, Layout({Shard(0)}), {std::nullopt}));
      const Tensor want = Unwrap(DTensor::Distribute(full, mesh, Layout({Shard(1)}), {std::nullopt})).ToLocal();
      absl::StatusOr<DTensor> y = x.Redistribute(Layout({Shard(1)}));
      ASSERT_TRUE(y.ok()) << "rank " << rank << " " << ShapeString(shape) << ": " << y.status();
      EXPECT_EQ(suite::CompareBits(y->ToLocal(), want), "") << "rank " << rank << " " << ShapeString(shape);
      auto plan = Unwrap(PlannerOf(mesh).Plan(shape, mesh.shape(), Layout({Shard(0)}), Layout({Shard(1)}), 4));
      const auto geometry = internal::GeometryOf(plan, mesh);
      ASSERT_EQ(geometry->steps.size(), 1u);
      EXPECT_EQ(geometry->steps[0].send_slabs.size(), 3u) << "rank " << rank << " " << ShapeString(shape);
      EXPECT_EQ(geometry->steps[0].recv_slabs.size(), 3u) << "rank " << rank << " " << ShapeString(shape);
    });
  }
}

// A local tensor that is a non-contiguous view (the transpose of a transposed copy) takes
// the same paths as a contiguous one: single-step collectives copy it first, all_to_all
// reads it through its strides. Same result, bit for bit, as Distribute's contiguous pieces
// redistributed, and as the target layout distributed from the full tensor.
TEST(DTensorRedistribute, NonContiguousLocalsMatchContiguous) {
  const std::vector<std::pair<Placement, Placement>> moves = {
      {Partial(PartialOp::kSum), Replicate()},
      {Partial(PartialOp::kSum), Shard(0)},
      {Partial(PartialOp::kSum), Shard(1)},
      {Partial(PartialOp::kMax), Replicate()},
      {Shard(0), Replicate()},
      {Shard(1), Replicate()},
      {Shard(0), Shard(1)},
      {Replicate(), Shard(1)},
  };
  // [4, 5]: S(0) pieces of 2, 2 and 0 rows (an empty piece through the direct V collectives).
  for (const Shape& shape : {Shape{6, 4}, Shape{7, 5}, Shape{4, 5}}) {
    RunRanks(3, [&](int rank, Communicator& comm) {
      DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {3}));
      const std::vector<double> v = suite::GlobalValues(shape, DType::kFloat32, true, 11);
      const Tensor full = suite::MakeTensor(v, shape, DType::kFloat32);
      for (const auto& [from, to] : moves) {
        const std::string what =
            absl::StrCat("rank ", rank, " ", ShapeString(shape), " ", from.ToString(), " -> ", to.ToString());
        const DTensor x = Unwrap(DTensor::Distribute(full, mesh, Layout({from}), {std::nullopt}));
        const Tensor strided = Unwrap(Unwrap(Contiguous(Unwrap(x.ToLocal().Transpose(0, 1)))).Transpose(0, 1));
        DTensor::FromLocalOptions options;
        options.global_shape = shape;
        const DTensor xs = Unwrap(DTensor::FromLocal(strided, mesh, Layout({from}), options));
        if (strided.shape()[0] > 1 && strided.shape()[1] > 1) {
          EXPECT_FALSE(xs.ToLocal().is_contiguous()) << what;
        }
        absl::StatusOr<DTensor> y = x.Redistribute(Layout({to}));
        absl::StatusOr<DTensor> ys = xs.Redistribute(Layout({to}));
        ASSERT_TRUE(y.ok() && ys.ok()) << what << ": " << y.status() << " / " << ys.status();  // all ranks alike
        const Tensor want = Unwrap(DTensor::Distribute(full, mesh, Layout({to}), {std::nullopt})).ToLocal();
        EXPECT_EQ(suite::CompareBits(ys->ToLocal(), y->ToLocal()), "") << what;
        EXPECT_EQ(suite::CompareBits(ys->ToLocal(), want), "") << what;
      }
    });
  }
}

// Shapes that keep changing (say, sequence lengths) do not grow the caches without end: past
// kMaxPlans the planner starts over, and so does the step-geometry cache; an async
// redistribution started before keeps its plan and geometry and still finishes right.
TEST(DTensorPlanCache, CachesStayBounded) {
  RunRanks(2, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2}));
    const std::vector<double> v = suite::GlobalValues({6, 4}, DType::kFloat32, false, 3);
    // S(1) -> R: the all-gather's finisher unpacks the column blocks by the step's geometry.
    DTensor first = Unwrap(
        DTensor::Distribute(suite::MakeTensor(v, {6, 4}, DType::kFloat32), mesh, Layout({Shard(1)}), {std::nullopt}));
    auto pending = first.RedistributeAsync(Layout({Replicate()}));
    ASSERT_TRUE(pending.ok()) << pending.status();
    const int64_t n = static_cast<int64_t>(RedistributePlanner::kMaxPlans) + 10;
    for (int64_t rows = 1; rows <= n; ++rows) {
      DTensor x = Unwrap(DTensor::FromLocal(Unwrap(Zeros({rows, 1}, DType::kFloat32)), mesh, Layout({Shard(0)})));
      Unwrap(x.Redistribute(Layout({Replicate()})));
    }
    EXPECT_LE(PlannerOf(mesh).size(), RedistributePlanner::kMaxPlans);
    EXPECT_LE(internal::CoreStateOf(mesh).geometry.size(), internal::CoreState::kMaxGeometries);
    DTensor y = Unwrap(pending->Wait());
    EXPECT_EQ(suite::CompareBits(y.ToLocal(), suite::MakeTensor(v, {6, 4}, DType::kFloat32)), "") << "rank " << rank;
  });
}

// ---- Across meshes over the same world ----

struct CrossCase {
  std::vector<int64_t> from_mesh;
  Spec from;
  std::vector<int64_t> to_mesh;
  Spec to;
};

void RunCrossMesh(const CrossCase& c, const Shape& shape, DType dtype) {
  SCOPED_TRACE(absl::StrCat(ShapeString(c.from_mesh), " ", suite::SpecString(c.from), " -> ", ShapeString(c.to_mesh),
                            " ", suite::SpecString(c.to), " ", ShapeString(shape), " ", DTypeName(dtype)));
  const bool exact = suite::HasPartial(c.from) || suite::HasPartial(c.to);
  const std::vector<double> v = suite::GlobalValues(shape, dtype, exact, 31);
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(a, DeviceMesh::Create(comm, c.from_mesh));
    DT_SUITE_MESH(b, DeviceMesh::Create(comm, c.to_mesh));
    const suite::Box box = suite::NaiveBox(shape, c.from_mesh, c.from, a.coordinate());
    const std::vector<double> piece = suite::HasPartial(c.from)
                                          ? suite::PartialPiece(v, shape, box, c.from, c.from_mesh, a.coordinate(), 9)
                                          : suite::BoxValues(v, shape, box);
    DTensor x = Unwrap(DTensor::FromLocal(suite::MakeTensor(piece, box.shape, dtype), a,
                                          Unwrap(suite::ToLayout(c.from)), {Shape(shape), false}));
    auto y = x.Redistribute(b, Unwrap(suite::ToLayout(c.to)));
    ASSERT_TRUE(y.ok()) << "rank " << rank << ": " << y.status();
    EXPECT_TRUE(y->mesh().SameAs(b));
    EXPECT_EQ(y->layout(), Unwrap(suite::ToLayout(c.to)));
    if (suite::EffectivelyNonPartial(c.to, c.to_mesh)) {
      EXPECT_EQ(suite::CompareBits(y->ToLocal(), BoxTensor(v, shape, dtype, c.to, c.to_mesh, b.coordinate())), "")
          << "rank " << rank;
    }
    Tensor full = Unwrap(y->FullTensor());
    EXPECT_EQ(suite::CompareBits(full, suite::MakeTensor(v, shape, dtype)), "") << "rank " << rank;
    EXPECT_EQ(suite::CompareBits(x.ToLocal(), suite::MakeTensor(piece, box.shape, dtype)), "") << "source changed";
  });
}

TEST(DTensorCrossMesh, FourToTwoByTwoAndBack) {
  const std::vector<CrossCase> cases = {
      {{4}, {{Shard(0)}, {}}, {2, 2}, {{Shard(0), Shard(1)}, {}}},
      {{4}, {{Shard(0)}, {}}, {2, 2}, {{Replicate(), Shard(0)}, {}}},
      {{4}, {{Shard(1)}, {}}, {2, 2}, {{Shard(0), Shard(0)}, {}}},
      {{4}, {{Replicate()}, {}}, {2, 2}, {{Shard(1), Shard(0)}, {}}},
      {{4}, {{Shard(0)}, {}}, {2, 2}, {{Shard(0), Shard(0)}, {{0, {1, 0}}}}},
      {{2, 2}, {{Shard(0), Shard(1)}, {}}, {4}, {{Shard(1)}, {}}},
      {{2, 2}, {{Shard(0), Shard(1)}, {}}, {4}, {{Replicate()}, {}}},
      {{2, 2}, {{Shard(0), Shard(0)}, {{0, {1, 0}}}}, {4}, {{Shard(0)}, {}}},
      {{2, 2}, {{Replicate(), Shard(1)}, {}}, {4}, {{Shard(0)}, {}}},
      {{2, 2}, {{Shard(1), Shard(0)}, {}}, {1, 4}, {{Replicate(), Shard(1)}, {}}},
      // Every rank holds its new box already, some of them empty past the end of what they
      // hold ([2, 3]: ranks 2 and 3 get rows [2, 2)).
      {{2, 2}, {{Replicate(), Shard(0)}, {}}, {4}, {{Shard(0)}, {}}},
  };
  for (const CrossCase& c : cases) {
    for (const Shape& shape : {Shape{8, 6}, Shape{7, 5}, Shape{2, 3}, Shape{1, 1}, Shape{0, 3}}) {
      for (DType dtype : kDTypes) RunCrossMesh(c, shape, dtype);
    }
  }
}

TEST(DTensorCrossMesh, PartialSourcesAndTargets) {
  const std::vector<CrossCase> cases = {
      {{4}, {{Partial()}, {}}, {2, 2}, {{Shard(0), Replicate()}, {}}},
      {{2, 2}, {{Partial(PartialOp::kAvg), Shard(1)}, {}}, {4}, {{Shard(0)}, {}}},
      {{4}, {{Shard(0)}, {}}, {2, 2}, {{Partial(PartialOp::kMax), Shard(1)}, {}}},
      {{4}, {{Replicate()}, {}}, {2, 2}, {{Partial(), Partial()}, {}}},
  };
  for (const CrossCase& c : cases) {
    for (DType dtype : kDTypes) RunCrossMesh(c, {8, 6}, dtype);
  }
}

// Redistribute onto the DTensor's own mesh is the ordinary redistribution.
TEST(DTensorCrossMesh, SameMeshIsOrdinaryRedistribute) {
  const Shape shape = {7, 5};
  const std::vector<double> v = suite::GlobalValues(shape, DType::kFloat32, false, 3);
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));
    DTensor x = Unwrap(DTensor::Distribute(suite::MakeTensor(v, shape, DType::kFloat32), mesh,
                                           Layout({Shard(0), Shard(1)}), {std::nullopt}));
    CommCounter counter;
    SetCommCounter(mesh, &counter);
    DTensor y = Unwrap(x.Redistribute(mesh, Layout({Shard(1), Replicate()})));
    SetCommCounter(mesh, nullptr);
    const RedistributePlan plan =
        Unwrap(PlanRedistribute(shape, {2, 2}, x.layout(), Layout({Shard(1), Replicate()}), 4));
    EXPECT_EQ(suite::CompareComm(counter, plan.PredictComm(mesh.coordinate())), "") << "rank " << rank;
    const Spec want{{Shard(1), Replicate()}, {}};
    EXPECT_EQ(suite::CompareBits(y.ToLocal(), BoxTensor(v, shape, DType::kFloat32, want, {2, 2}, mesh.coordinate())),
              "");
  });
}

// Two meshes over the same 4 ranks of an 8-rank world (sub-meshes of different roots): the
// exchange runs on their group; meshes over different ranks are refused, naming them.
TEST(DTensorCrossMesh, SubMeshesOverTheSameRanksOfALargerWorld) {
  const Shape shape = {7, 6};
  const std::vector<double> v = suite::GlobalValues(shape, DType::kFloat32, false, 13);
  RunRanks(8, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(root_a, DeviceMesh::Create(comm, {2, 4}, {"a", "b"}));
    DT_SUITE_MESH(root_b, DeviceMesh::Create(comm, {2, 2, 2}, {"x", "y", "z"}));
    DeviceMesh a = Unwrap(root_a.Sub("b"));                                 // ranks 4a .. 4a+3
    DeviceMesh b = Unwrap(root_b.Sub(std::vector<std::string>{"y", "z"}));  // the same ranks, as 2x2
    ASSERT_EQ(a.ranks(), b.ranks());
    const Spec from{{Shard(0)}, {}};
    const Spec to{{Shard(1), Shard(0)}, {}};
    const suite::Box box = suite::NaiveBox(shape, {4}, from, a.coordinate());
    DTensor x =
        Unwrap(DTensor::FromLocal(suite::MakeTensor(suite::BoxValues(v, shape, box), box.shape, DType::kFloat32), a,
                                  Unwrap(suite::ToLayout(from)), {Shape(shape), false}));
    DTensor y = Unwrap(x.Redistribute(b, Unwrap(suite::ToLayout(to))));
    EXPECT_TRUE(y.mesh().SameAs(b));
    EXPECT_EQ(suite::CompareBits(y.ToLocal(), BoxTensor(v, shape, DType::kFloat32, to, {2, 2}, b.coordinate())), "")
        << "rank " << rank;
    DTensor back = Unwrap(y.Redistribute(a, Unwrap(suite::ToLayout(from))));
    EXPECT_EQ(suite::CompareBits(back.ToLocal(), x.ToLocal()), "") << "rank " << rank;
    // Over other ranks: "a" groups ranks {r % 4, r % 4 + 4}, not b's four.
    DeviceMesh other = Unwrap(root_a.Sub("a"));
    const absl::Status s = x.Redistribute(other, Layout({Replicate()})).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("same ranks of one communicator"));
  });
}

// Another mesh object over the same ranks and shape, with other names: the result carries the
// target mesh (its names) and the target mesh's counter sees the collectives.
TEST(DTensorCrossMesh, AnEqualMeshObjectRedistributesOnTheTarget) {
  const Shape shape = {7, 5};
  const std::vector<double> v = suite::GlobalValues(shape, DType::kFloat32, false, 5);
  RunRanks(4, [&](int rank, Communicator& comm) {
    DT_SUITE_MESH(a, DeviceMesh::Create(comm, {2, 2}, {"dp", "tp"}));
    DT_SUITE_MESH(b, DeviceMesh::Create(comm, {2, 2}, {"x", "y"}));
    DTensor x = Unwrap(DTensor::Distribute(suite::MakeTensor(v, shape, DType::kFloat32), a,
                                           Layout({Shard(0), Shard(1)}), {std::nullopt}));
    CommCounter on_a, on_b;
    SetCommCounter(a, &on_a);
    SetCommCounter(b, &on_b);
    DTensor y = Unwrap(x.Redistribute(b, Layout({Replicate(), Shard(0)})));
    SetCommCounter(a, nullptr);
    SetCommCounter(b, nullptr);
    EXPECT_EQ(y.mesh().names(), (std::vector<std::string>{"x", "y"})) << "rank " << rank;
    EXPECT_EQ(on_a.ToString(), CommCounter().ToString()) << "rank " << rank;
    const RedistributePlan plan =
        Unwrap(PlanRedistribute(shape, {2, 2}, x.layout(), Layout({Replicate(), Shard(0)}), 4));
    ASSERT_GT(plan.num_collectives(), 0);
    EXPECT_EQ(suite::CompareComm(on_b, plan.PredictComm(b.coordinate())), "") << "rank " << rank;
    const Spec want{{Replicate(), Shard(0)}, {}};
    EXPECT_EQ(suite::CompareBits(y.ToLocal(), BoxTensor(v, shape, DType::kFloat32, want, {2, 2}, b.coordinate())), "");
  });
}

}  // namespace
}  // namespace dtensor

namespace dtensor {
namespace {

// ---- Ranks fail together ----

// Rank k's FromLocal fails its shape check (a [3, 3] piece of [8, 6] where S(0) gives [2, 6])
// while the other three, past their own FromLocal, already wait in the next Redistribute:
// within 1 s they return Aborted naming rank k and its error (not the 20 s timeout), and
// every rank's communicators (the world and the mesh's groups) refuse later calls, saying
// they were aborted.
TEST(DTensorFailTogether, FromLocalFailureReachesPeersWaitingInRedistribute) {
  const std::vector<std::vector<int64_t>> meshes = {{4}, {2, 2}};
  for (const std::vector<int64_t>& shape : meshes) {
    for (int k : {0, 3}) {
      SCOPED_TRACE(absl::StrCat("mesh ", ShapeString(shape), ", failing rank ", k));
      // Every rank's Redistribute to R waits on rank k, directly or through a peer that does
      // (on 2x2 each all-gather step is over a group of one mesh dim).
      const Layout sharded = shape.size() == 1 ? Layout({Shard(0)}) : Layout({Shard(0), Shard(1)});
      const Layout replicated = shape.size() == 1 ? Layout({Replicate()}) : Layout({Replicate(), Replicate()});
      const Shape piece = shape.size() == 1 ? Shape{2, 6} : Shape{4, 3};  // of [8, 6]
      std::vector<double> waited(4, -1.0);
      RunRanks(4, [&](int rank, Communicator& comm) {
        DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, shape));
        DTensor::FromLocalOptions o;
        o.global_shape = Shape{8, 6};
        if (rank == k) {
          // The peers are in Redistribute by now (they only wait there).
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          const Tensor wrong = suite::MakeTensor(std::vector<double>(9, 1.0), {3, 3}, DType::kFloat32);
          const absl::StatusOr<DTensor> x = DTensor::FromLocal(wrong, mesh, sharded, o);
          ASSERT_FALSE(x.ok());
          EXPECT_EQ(x.status().code(), absl::StatusCode::kInvalidArgument) << x.status();
          EXPECT_THAT(x.status().message(), HasSubstr("is not this rank's piece"));
        } else {
          const Tensor local = suite::MakeTensor(std::vector<double>(static_cast<size_t>(piece[0] * piece[1]), 1.0),
                                                 piece, DType::kFloat32);
          DTensor x = Unwrap(DTensor::FromLocal(local, mesh, sharded, o));
          const auto t0 = std::chrono::steady_clock::now();
          const absl::StatusOr<DTensor> y = x.Redistribute(replicated);
          waited[static_cast<size_t>(rank)] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          ASSERT_FALSE(y.ok()) << "rank " << rank;
          EXPECT_EQ(y.status().code(), absl::StatusCode::kAborted) << y.status();
          EXPECT_THAT(y.status().message(), HasSubstr(absl::StrCat("rank ", k, " aborted the communicator")));
          EXPECT_THAT(y.status().message(), HasSubstr("is not this rank's piece"));
        }
        // Unusable afterwards, on every rank and every group of the mesh, and it says so.
        const absl::Status b = comm.Barrier();
        EXPECT_EQ(b.code(), absl::StatusCode::kAborted)
            << "mesh " << ShapeString(shape) << ", failing rank " << k << ", rank " << rank << ": " << b;
        EXPECT_THAT(b.message(), HasSubstr(absl::StrCat("rank ", k, " aborted the communicator")));
        const absl::Status g = mesh.comm(0).Barrier();
        EXPECT_EQ(g.code(), absl::StatusCode::kAborted)
            << "mesh " << ShapeString(shape) << ", failing rank " << k << ", rank " << rank << ": " << g;
      });
      for (int r = 0; r < 4; ++r) {
        if (r == k) continue;
        // From entering Redistribute (about 200 ms before rank k fails) to the error.
        EXPECT_GE(waited[static_cast<size_t>(r)], 0.0) << "rank " << r;
        EXPECT_LT(waited[static_cast<size_t>(r)], 1.0) << "rank " << r;
      }
    }
  }
}

// A piece with a dim more or fewer than its layout or the global shape want (without
// run_check) is this rank's own error too: the peers waiting in Redistribute get Aborted
// naming it within 1 s. An argument every rank passes alike (a wrong placement count, a
// shard dim the given global shape lacks) fails everywhere and aborts nothing.
TEST(DTensorFailTogether, PieceWithOtherDimsReachesPeers) {
  for (bool with_global : {true, false}) {
    SCOPED_TRACE(with_global ? "global shape given" : "global shape inferred");
    std::vector<double> waited(2, -1.0);
    RunRanks(2, [&](int rank, Communicator& comm) {
      DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2}));
      DTensor::FromLocalOptions o;
      if (with_global) o.global_shape = Shape{4, 6};
      // Alike on both ranks: errors, and the mesh still works.
      const Tensor piece = suite::MakeTensor(std::vector<double>(12, 1.0), {2, 6}, DType::kFloat32);
      absl::StatusOr<DTensor> alike = DTensor::FromLocal(piece, mesh, Layout({Shard(0), Replicate()}), o);
      EXPECT_EQ(alike.status().code(), absl::StatusCode::kInvalidArgument) << alike.status();
      if (with_global) {
        alike = DTensor::FromLocal(piece, mesh, Layout({Shard(2)}), o);
        EXPECT_EQ(alike.status().code(), absl::StatusCode::kInvalidArgument) << alike.status();
      }
      ASSERT_TRUE(comm.Barrier().ok()) << "rank " << rank;
      if (rank == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        // A 3-d piece of the 2-d global shape; inferred, S(2) of the 2-d piece.
        const Tensor wrong = suite::MakeTensor(std::vector<double>(12, 1.0), {2, 6, 1}, DType::kFloat32);
        const absl::StatusOr<DTensor> x = with_global ? DTensor::FromLocal(wrong, mesh, Layout({Shard(0)}), o)
                                                      : DTensor::FromLocal(piece, mesh, Layout({Shard(2)}), o);
        ASSERT_FALSE(x.ok());
        EXPECT_EQ(x.status().code(), absl::StatusCode::kInvalidArgument) << x.status();
      } else {
        DTensor x = Unwrap(DTensor::FromLocal(piece, mesh, Layout({Shard(0)}), o));
        const auto t0 = std::chrono::steady_clock::now();
        const absl::StatusOr<DTensor> y = x.Redistribute(Layout({Replicate()}));
        waited[0] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        ASSERT_FALSE(y.ok());
        EXPECT_EQ(y.status().code(), absl::StatusCode::kAborted) << y.status();
        EXPECT_THAT(y.status().message(), HasSubstr("rank 1 aborted the communicator"));
      }
    });
    EXPECT_GE(waited[0], 0.0);
    EXPECT_LT(waited[0], 1.0);
  }
}

}  // namespace
}  // namespace dtensor
