// Tests of DeviceMesh on the threads backend: coordinates, and the members of every dim
// group (found by all-gathering world ranks over the group's communicator) against a naive
// computation from row-major coordinates; Sub, Flatten, ranks(), SameAs, ToString, DimIndex
// and the errors of Create, Sub, Flatten and comm(dims).
#include "dtensor/mesh/device_mesh.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/tensor/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dtensor {
namespace {

using ::testing::HasSubstr;
using Index = std::vector<int64_t>;
using CommPtr = std::unique_ptr<Communicator>;

// ---- Harness ----

// Runs fn(rank, comm) on one thread per rank of a fresh thread group of `world` ranks.
void RunRanks(int world, const std::function<void(int, Communicator&)>& fn) {
  absl::StatusOr<std::vector<CommPtr>> comms = MakeThreadGroup(world, absl::Seconds(30));
  ASSERT_TRUE(comms.ok()) << comms.status();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { fn(r, *(*comms)[static_cast<size_t>(r)]); });
  for (auto& t : threads) t.join();
}

// The world ranks of the members of `comm`, in its rank order: every member contributes its
// world rank to an all_gather. Collective over `comm`.
std::vector<int64_t> MembersOf(Communicator& comm, int world_rank) {
  absl::StatusOr<Tensor> in = Tensor::FromVector<int64_t>({static_cast<int64_t>(world_rank)}, {1});
  absl::StatusOr<Tensor> out = Tensor::Empty({comm.size()}, DType::kInt64);
  if (!in.ok() || !out.ok()) {
    ADD_FAILURE() << "tensor allocation failed";
    return {};
  }
  absl::Status s = comm.AllGather(*in, *out);
  if (!s.ok()) {
    ADD_FAILURE() << "rank " << world_rank << ": " << s;
    return {};
  }
  const int64_t* p = out->data<int64_t>();
  return std::vector<int64_t>(p, p + comm.size());
}

// ---- Naive references ----

int64_t Product(const Index& v) {
  int64_t n = 1;
  for (int64_t s : v) n *= s;
  return n;
}

// Row-major coordinate of rank r.
Index CoordOf(const Index& shape, int64_t r) {
  Index c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = r % shape[d];
    r /= shape[d];
  }
  return c;
}

// The world ranks that agree with `coord` outside `dims`, ordered row-major over `dims`
// taken in ascending order.
std::vector<int64_t> NaiveGroup(const Index& shape, const Index& coord, std::vector<int> dims) {
  std::sort(dims.begin(), dims.end());
  std::vector<std::pair<Index, int64_t>> members;  // (coordinate over dims, world rank)
  for (int64_t r = 0; r < Product(shape); ++r) {
    const Index c = CoordOf(shape, r);
    bool same = true;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (std::find(dims.begin(), dims.end(), static_cast<int>(d)) == dims.end() && c[d] != coord[d]) same = false;
    }
    if (!same) continue;
    Index key;
    for (int d : dims) key.push_back(c[static_cast<size_t>(d)]);
    members.push_back({key, r});
  }
  std::sort(members.begin(), members.end());
  std::vector<int64_t> out;
  for (const auto& m : members) out.push_back(m.second);
  return out;
}

std::vector<int> MaskDims(uint32_t mask, int ndim) {
  std::vector<int> dims;
  for (int d = 0; d < ndim; ++d) {
    if (mask & (1u << d)) dims.push_back(d);
  }
  return dims;
}

std::vector<std::string> Names(size_t n) {
  const std::vector<std::string> all = {"pp", "dp", "cp", "tp"};
  return std::vector<std::string>(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n));
}

std::string Str(const Index& v) { return absl::StrCat("[", absl::StrJoin(v, ","), "]"); }

// Checks that `comm` holds exactly `expected` (world ranks, in rank order) and that this
// rank sits at its place in it.
void ExpectGroup(Communicator& comm, int world_rank, const std::vector<int64_t>& expected, const std::string& what) {
  EXPECT_EQ(comm.size(), static_cast<int>(expected.size())) << what;
  const auto pos = std::find(expected.begin(), expected.end(), world_rank);
  ASSERT_NE(pos, expected.end()) << what;
  EXPECT_EQ(comm.rank(), pos - expected.begin()) << what;
  EXPECT_EQ(MembersOf(comm, world_rank), expected) << what;
}

// ---- Sweep over mesh shapes ----

class DeviceMeshShapeTest : public ::testing::TestWithParam<Index> {};

TEST_P(DeviceMeshShapeTest, CoordinatesAndEveryDimGroup) {
  const Index shape = GetParam();
  const int world = static_cast<int>(Product(shape));
  const int nd = static_cast<int>(shape.size());
  RunRanks(world, [&](int r, Communicator& comm) {
    absl::StatusOr<DeviceMesh> created = DeviceMesh::Create(comm, shape, Names(shape.size()));
    ASSERT_TRUE(created.ok()) << created.status();
    const DeviceMesh& mesh = *created;
    const Index coord = CoordOf(shape, r);
    const std::string where = absl::StrCat("mesh ", Str(shape), " rank ", r);
    EXPECT_EQ(mesh.ndim(), nd) << where;
    EXPECT_EQ(Index(mesh.shape().begin(), mesh.shape().end()), shape) << where;
    EXPECT_EQ(mesh.size(), world) << where;
    for (int d = 0; d < nd; ++d) EXPECT_EQ(mesh.size(d), shape[static_cast<size_t>(d)]) << where;
    EXPECT_EQ(mesh.names(), Names(shape.size())) << where;
    EXPECT_EQ(Index(mesh.coordinate().begin(), mesh.coordinate().end()), coord) << where;
    for (int d = 0; d < nd; ++d) EXPECT_EQ(mesh.coordinate(d), coord[static_cast<size_t>(d)]) << where;
    EXPECT_EQ(mesh.world_rank(), r) << where;
    EXPECT_EQ(&mesh.world(), &comm) << where;
    EXPECT_TRUE(mesh.device().is_cpu()) << where;
    std::vector<int> all(static_cast<size_t>(world));
    for (int i = 0; i < world; ++i) all[static_cast<size_t>(i)] = i;
    EXPECT_EQ(mesh.ranks(), all) << where;
    for (int d = 0; d < nd; ++d) {
      absl::StatusOr<int> idx = mesh.DimIndex(Names(shape.size())[static_cast<size_t>(d)]);
      ASSERT_TRUE(idx.ok()) << idx.status();
      EXPECT_EQ(*idx, d);
    }

    // One communicator per dim: the ranks differing only in that dim, ordered by it.
    for (int d = 0; d < nd; ++d) {
      Communicator& c = mesh.comm(d);
      EXPECT_EQ(c.rank(), coord[static_cast<size_t>(d)]) << where << " dim " << d;
      ExpectGroup(c, r, NaiveGroup(shape, coord, {d}), absl::StrCat(where, " comm(", d, ")"));
    }
    // Every set of dims, given ascending and reversed: row-major over the dims ascending.
    for (uint32_t mask = 1; mask < (1u << nd); ++mask) {
      std::vector<int> dims = MaskDims(mask, nd);
      const std::vector<int64_t> expected = NaiveGroup(shape, coord, dims);
      absl::StatusOr<Communicator*> c = mesh.comm(dims);
      ASSERT_TRUE(c.ok()) << c.status();
      ExpectGroup(**c, r, expected, absl::StrCat(where, " comm({", absl::StrJoin(dims, ","), "})"));
      std::reverse(dims.begin(), dims.end());
      absl::StatusOr<Communicator*> rev = mesh.comm(dims);
      ASSERT_TRUE(rev.ok()) << rev.status();
      ExpectGroup(**rev, r, expected, absl::StrCat(where, " comm({", absl::StrJoin(dims, ","), "})"));
      if (dims.size() == 1) {
        EXPECT_EQ(*c, &mesh.comm(dims[0])) << where << " comm({d}) is comm(d)";
      }
      if (static_cast<int>(dims.size()) == nd) {
        EXPECT_EQ((*c)->size(), world) << where;
      }
    }
  });
}

TEST_P(DeviceMeshShapeTest, SubMeshesOfEverySetOfDims) {
  const Index shape = GetParam();
  const int world = static_cast<int>(Product(shape));
  const int nd = static_cast<int>(shape.size());
  const std::vector<std::string> names = Names(shape.size());
  RunRanks(world, [&](int r, Communicator& comm) {
    absl::StatusOr<DeviceMesh> created = DeviceMesh::Create(comm, shape, names);
    ASSERT_TRUE(created.ok()) << created.status();
    const Index coord = CoordOf(shape, r);
    for (uint32_t mask = 1; mask < (1u << nd); ++mask) {
      const std::vector<int> dims = MaskDims(mask, nd);
      std::vector<std::string> sub_names;
      for (int d : dims) sub_names.push_back(names[static_cast<size_t>(d)]);
      const std::string where =
          absl::StrCat("mesh ", Str(shape), " rank ", r, " Sub(", absl::StrJoin(sub_names, ","), ")");
      absl::StatusOr<DeviceMesh> sub = dims.size() == 1 ? created->Sub(sub_names[0]) : created->Sub(sub_names);
      ASSERT_TRUE(sub.ok()) << where << ": " << sub.status();
      ASSERT_EQ(sub->ndim(), static_cast<int>(dims.size())) << where;
      EXPECT_EQ(sub->names(), sub_names) << where;
      Index sub_shape, sub_coord;
      for (int d : dims) {
        sub_shape.push_back(shape[static_cast<size_t>(d)]);
        sub_coord.push_back(coord[static_cast<size_t>(d)]);
      }
      EXPECT_EQ(Index(sub->shape().begin(), sub->shape().end()), sub_shape) << where;
      EXPECT_EQ(Index(sub->coordinate().begin(), sub->coordinate().end()), sub_coord) << where;
      EXPECT_EQ(sub->size(), Product(sub_shape)) << where;
      EXPECT_EQ(sub->world_rank(), r) << where;
      EXPECT_EQ(&sub->world(), &comm) << where;
      const std::vector<int64_t> group = NaiveGroup(shape, coord, dims);
      const std::vector<int> ranks = sub->ranks();
      EXPECT_EQ(std::vector<int64_t>(ranks.begin(), ranks.end()), group) << where;
      // The sub-mesh's dims map to the parent's dims.
      for (size_t k = 0; k < dims.size(); ++k) {
        ExpectGroup(sub->comm(static_cast<int>(k)), r, NaiveGroup(shape, coord, {dims[k]}),
                    absl::StrCat(where, " comm(", k, ")"));
      }
      std::vector<int> sub_all(dims.size());
      for (size_t k = 0; k < dims.size(); ++k) sub_all[k] = static_cast<int>(k);
      absl::StatusOr<Communicator*> c = sub->comm(sub_all);
      ASSERT_TRUE(c.ok()) << c.status();
      ExpectGroup(**c, r, group, absl::StrCat(where, " comm(all)"));
      // A sub-mesh of all dims is the mesh itself.
      EXPECT_EQ(sub->SameAs(*created), static_cast<int>(dims.size()) == nd) << where;
    }
  });
}

TEST_P(DeviceMeshShapeTest, FlattenEveryRangeOfDims) {
  const Index shape = GetParam();
  const int world = static_cast<int>(Product(shape));
  const int nd = static_cast<int>(shape.size());
  const std::vector<std::string> names = Names(shape.size());
  RunRanks(world, [&](int r, Communicator& comm) {
    absl::StatusOr<DeviceMesh> created = DeviceMesh::Create(comm, shape, names);
    ASSERT_TRUE(created.ok()) << created.status();
    const Index coord = CoordOf(shape, r);
    for (int a = 0; a < nd; ++a) {
      for (int b = a; b < nd; ++b) {
        const std::string where = absl::StrCat("mesh ", Str(shape), " rank ", r, " Flatten(",
                                               names[static_cast<size_t>(a)], "..", names[static_cast<size_t>(b)], ")");
        absl::StatusOr<DeviceMesh> flat =
            created->Flatten(names[static_cast<size_t>(a)], names[static_cast<size_t>(b)], "merged");
        ASSERT_TRUE(flat.ok()) << where << ": " << flat.status();
        // Expected: dims before a, then the product of a..b, then dims after b.
        Index fshape, fcoord;
        std::vector<std::string> fnames;
        std::vector<std::vector<int>> fdims;  // root dims of each flattened-mesh dim
        for (int d = 0; d < nd; ++d) {
          const size_t i = static_cast<size_t>(d);
          if (d > a && d <= b) {
            fshape.back() *= shape[i];
            fcoord.back() = fcoord.back() * shape[i] + coord[i];
            fdims.back().push_back(d);
            continue;
          }
          fshape.push_back(shape[i]);
          fcoord.push_back(coord[i]);
          fnames.push_back(d == a ? "merged" : names[i]);
          fdims.push_back({d});
        }
        EXPECT_EQ(Index(flat->shape().begin(), flat->shape().end()), fshape) << where;
        EXPECT_EQ(Index(flat->coordinate().begin(), flat->coordinate().end()), fcoord) << where;
        EXPECT_EQ(flat->names(), fnames) << where;
        EXPECT_EQ(flat->size(), world) << where;
        std::vector<int> all(static_cast<size_t>(world));
        for (int i = 0; i < world; ++i) all[static_cast<size_t>(i)] = i;
        EXPECT_EQ(flat->ranks(), all) << where;
        for (size_t k = 0; k < fdims.size(); ++k) {
          ExpectGroup(flat->comm(static_cast<int>(k)), r, NaiveGroup(shape, coord, fdims[k]),
                      absl::StrCat(where, " comm(", k, ")"));
        }
        EXPECT_EQ(flat->SameAs(*created), a == b || fshape == shape) << where;
        absl::StatusOr<int> idx = flat->DimIndex("merged");
        ASSERT_TRUE(idx.ok()) << idx.status();
        EXPECT_EQ(*idx, a) << where;
      }
    }
    // Everything into one dim: the world.
    absl::StatusOr<DeviceMesh> one = created->Flatten(names.front(), names.back(), "world");
    ASSERT_TRUE(one.ok()) << one.status();
    EXPECT_EQ(one->ndim(), 1);
    EXPECT_EQ(one->size(0), world);
    EXPECT_EQ(one->coordinate(0), r);
    EXPECT_EQ(one->comm(0).size(), world);
    EXPECT_EQ(one->comm(0).rank(), r);
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceMeshShapeTest,
                         ::testing::Values(Index{1}, Index{4}, Index{8}, Index{1, 1}, Index{2, 2}, Index{2, 3},
                                           Index{3, 2}, Index{1, 4}, Index{4, 1}, Index{4, 2}, Index{2, 4},
                                           Index{2, 2, 2}, Index{3, 1, 2}, Index{2, 1, 2, 2}, Index{1, 2, 1, 3},
                                           Index{2, 2, 2, 1}),
                         [](const ::testing::TestParamInfo<Index>& info) { return absl::StrJoin(info.param, "x"); });

// ---- Named examples on a 2x2x2 mesh ----

TEST(DeviceMeshTest, ThreeDimExample) {
  RunRanks(8, [](int r, Communicator& comm) {
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(comm, {2, 2, 2}, {"dp", "cp", "tp"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    EXPECT_EQ(mesh->ToString(), "DeviceMesh(dp=2, cp=2, tp=2)");
    if (r == 5) {
      EXPECT_EQ(Index(mesh->coordinate().begin(), mesh->coordinate().end()), (Index{1, 0, 1}));
    }
    // Rank 5 = (1,0,1): tp group {4,5}, cp group {5,7}, dp group {1,5}.
    absl::StatusOr<DeviceMesh> tp = mesh->Sub("tp");
    ASSERT_TRUE(tp.ok()) << tp.status();
    EXPECT_EQ(tp->ToString(), "DeviceMesh(tp=2)");
    const std::vector<int64_t> tp_members = MembersOf(tp->comm(0), r);
    const std::vector<int64_t> cp_members = MembersOf(mesh->comm(1), r);
    const std::vector<int64_t> dp_members = MembersOf(mesh->comm(0), r);
    absl::StatusOr<Communicator*> dp_tp = mesh->comm({2, 0});
    ASSERT_TRUE(dp_tp.ok()) << dp_tp.status();
    const std::vector<int64_t> dp_tp_members = MembersOf(**dp_tp, r);
    absl::StatusOr<DeviceMesh> dp_cp = mesh->Flatten("dp", "cp", "dp_cp");
    ASSERT_TRUE(dp_cp.ok()) << dp_cp.status();
    EXPECT_EQ(dp_cp->ToString(), "DeviceMesh(dp_cp=4, tp=2)");
    const std::vector<int64_t> dp_cp_members = MembersOf(dp_cp->comm(0), r);
    if (r == 5) {
      EXPECT_EQ(tp_members, (std::vector<int64_t>{4, 5}));
      EXPECT_EQ(cp_members, (std::vector<int64_t>{5, 7}));
      EXPECT_EQ(dp_members, (std::vector<int64_t>{1, 5}));
      // Row-major over (dp, tp): (0,0)=1... dp 0 tp 0 -> (0,0,0)? No: cp fixed at 0 -> ranks 0,1,4,5.
      EXPECT_EQ(dp_tp_members, (std::vector<int64_t>{0, 1, 4, 5}));
      // dp_cp fixes tp=1: ranks (dp,cp) row-major = 1,3,5,7.
      EXPECT_EQ(dp_cp_members, (std::vector<int64_t>{1, 3, 5, 7}));
      EXPECT_EQ(dp_cp->coordinate(0), 2);
      EXPECT_EQ(dp_cp->coordinate(1), 1);
    }
    // Sub of several names and Flatten of a sub-mesh whose dims are adjacent in the root.
    absl::StatusOr<DeviceMesh> cp_tp = mesh->Sub(std::vector<std::string>{"cp", "tp"});
    ASSERT_TRUE(cp_tp.ok()) << cp_tp.status();
    absl::StatusOr<DeviceMesh> cp_tp_flat = cp_tp->Flatten("cp", "tp", "cptp");
    ASSERT_TRUE(cp_tp_flat.ok()) << cp_tp_flat.status();
    const std::vector<int64_t> cptp = MembersOf(cp_tp_flat->comm(0), r);
    if (r == 5) {
      EXPECT_EQ(cptp, (std::vector<int64_t>{4, 5, 6, 7}));
    }
    // Flatten of a flattened mesh, then Sub of the flattened dim.
    absl::StatusOr<DeviceMesh> all = dp_cp->Flatten("dp_cp", "tp", "all");
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(all->ToString(), "DeviceMesh(all=8)");
    EXPECT_EQ(all->comm(0).size(), 8);
    absl::StatusOr<DeviceMesh> sub_flat = dp_cp->Sub("dp_cp");
    ASSERT_TRUE(sub_flat.ok()) << sub_flat.status();
    EXPECT_EQ(sub_flat->size(), 4);
    const std::vector<int64_t> sub_flat_members = MembersOf(sub_flat->comm(0), r);
    EXPECT_EQ(sub_flat_members, dp_cp_members);
    // Views outlive the mesh they came from (they share its root).
    absl::StatusOr<DeviceMesh> view = mesh->Sub("cp");
    ASSERT_TRUE(view.ok());
    mesh = absl::InternalError("dropped");
    const std::vector<int64_t> still = MembersOf(view->comm(0), r);
    EXPECT_EQ(still, cp_members);
  });
}

TEST(DeviceMeshTest, DefaultNamesAndToString) {
  RunRanks(6, [](int, Communicator& comm) {
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(comm, {2, 3});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    EXPECT_EQ(mesh->names(), (std::vector<std::string>{"d0", "d1"}));
    EXPECT_EQ(mesh->ToString(), "DeviceMesh(d0=2, d1=3)");
    absl::StatusOr<int> d1 = mesh->DimIndex("d1");
    ASSERT_TRUE(d1.ok());
    EXPECT_EQ(*d1, 1);
  });
}

TEST(DeviceMeshTest, SameAs) {
  absl::StatusOr<std::vector<CommPtr>> other = MakeThreadGroup(4, absl::Seconds(30));
  ASSERT_TRUE(other.ok()) << other.status();
  RunRanks(4, [&](int r, Communicator& comm) {
    absl::StatusOr<DeviceMesh> a = DeviceMesh::Create(comm, {2, 2}, {"dp", "tp"});
    ASSERT_TRUE(a.ok()) << a.status();
    // Another mesh over the same world and shape, other names: same.
    absl::StatusOr<DeviceMesh> b = DeviceMesh::Create(comm, {2, 2}, {"x", "y"});
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(a->SameAs(*a));
    EXPECT_TRUE(a->SameAs(*b));
    EXPECT_TRUE(b->SameAs(*a));
    // Other shape over the same world: not the same.
    absl::StatusOr<DeviceMesh> line = DeviceMesh::Create(comm, {4}, {"w"});
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_FALSE(a->SameAs(*line));
    // ...but the flattened 2x2 is the 1-d mesh of 4.
    absl::StatusOr<DeviceMesh> flat = a->Flatten("dp", "tp", "w");
    ASSERT_TRUE(flat.ok()) << flat.status();
    EXPECT_TRUE(flat->SameAs(*line));
    EXPECT_TRUE(line->SameAs(*flat));
    absl::StatusOr<DeviceMesh> four_one = DeviceMesh::Create(comm, {4, 1});
    ASSERT_TRUE(four_one.ok()) << four_one.status();
    EXPECT_FALSE(four_one->SameAs(*line));
    // Sub-meshes of different dims have the same shape but other ranks.
    absl::StatusOr<DeviceMesh> dp = a->Sub("dp");
    absl::StatusOr<DeviceMesh> tp = a->Sub("tp");
    ASSERT_TRUE(dp.ok() && tp.ok());
    EXPECT_FALSE(dp->SameAs(*tp));
    EXPECT_TRUE(dp->SameAs(*b->Sub("x")));
    // Same shape, other world: not the same.
    absl::StatusOr<DeviceMesh> c = DeviceMesh::Create(*(*other)[static_cast<size_t>(r)], {2, 2}, {"dp", "tp"});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_FALSE(a->SameAs(*c));
    EXPECT_FALSE(c->SameAs(*a));
  });
}

// ---- Errors ----

// Create must reject these before any collective, so one rank alone may call it (a bug that
// let it through would time out in Split and fail the code check).
void ExpectCreateError(int world, const Index& shape, std::vector<std::string> names,
                       const std::vector<std::string>& needles) {
  absl::StatusOr<std::vector<CommPtr>> comms = MakeThreadGroup(world, absl::Seconds(3));
  ASSERT_TRUE(comms.ok()) << comms.status();
  absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(*(*comms)[0], shape, std::move(names));
  ASSERT_FALSE(mesh.ok()) << Str(shape);
  EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument) << mesh.status();
  for (const std::string& n : needles) EXPECT_THAT(mesh.status().message(), HasSubstr(n)) << mesh.status();
}

TEST(DeviceMeshErrorTest, Create) {
  ExpectCreateError(4, {2, 3}, {"a", "b"}, {"[2, 3]", "6", "4"});  // mesh size != world size
  ExpectCreateError(4, {8}, {"a"}, {"[8]", "8", "4"});
  ExpectCreateError(4, {}, {}, {"0 dims"});                                                         // no dims
  ExpectCreateError(4, {1, 1, 1, 1, 4}, {"a", "b", "c", "d", "e"}, {"[1, 1, 1, 1, 4]", "5 dims"});  // > 4 dims
  ExpectCreateError(1, {1, 1, 1, 1, 1}, {"a", "b", "c", "d", "e"}, {"5 dims"});
  ExpectCreateError(4, {-2, -2}, {"a", "b"}, {"[-2, -2]"});  // non-positive
  ExpectCreateError(4, {0, 4}, {"a", "b"}, {"[0, 4]"});
  ExpectCreateError(4, {2, 2}, {"a"}, {"a"});  // wrong number of names
  ExpectCreateError(4, {2, 2}, {"a", "b", "c"}, {"a, b, c"});
  ExpectCreateError(4, {2, 2}, {"x", "x"}, {"\"x\""});  // duplicate
  ExpectCreateError(8, {2, 2, 2}, {"dp", "tp", "dp"}, {"\"dp\""});
  ExpectCreateError(4, {2, 2}, {"a", ""}, {"empty"});  // empty name
  // Products that overflow int64 (they wrapped to the world size and were accepted).
  ExpectCreateError(4, {(int64_t{1} << 62) + 1, 4}, {"a", "b"},
                    {"4611686018427387905", "more than the communicator's 4"});
  ExpectCreateError(1, {7, 0x6DB6DB6DB6DB6DB7}, {"a", "b"}, {"more than the communicator's 1"});
}

// Ranks asking for different meshes (shapes, or names) all get the same error, at once (they
// got meshes whose groups did not match their shapes).
TEST(DeviceMeshErrorTest, RanksAskingForDifferentMeshesAllFail) {
  struct Case {
    int world;
    std::function<std::pair<Index, std::vector<std::string>>(int)> mesh_of;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {6,
       [](int r) {
         return std::make_pair(r < 3 ? Index{2, 3} : Index{3, 2}, std::vector<std::string>{"dp", "tp"});
       },
       {"rank 0 for [2, 3] (dp, tp), rank 3 for [3, 2] (dp, tp)", "rank(s) 3, 4, 5 differ"}},
      {4,
       [](int r) {
         return std::make_pair(Index{2, 2},
                               r == 2 ? std::vector<std::string>{"tp", "dp"} : std::vector<std::string>{"dp", "tp"});
       },
       {"rank 0 for [2, 2] (dp, tp), rank 2 for [2, 2] (tp, dp)", "rank(s) 2 differ"}},
  };
  for (const Case& c : cases) {
    const absl::Time t0 = absl::Now();
    RunRanks(c.world, [&](int r, Communicator& comm) {
      auto [shape, names] = c.mesh_of(r);
      absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(comm, shape, names);
      ASSERT_FALSE(mesh.ok()) << "rank " << r;
      EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument) << mesh.status();
      for (const std::string& n : c.needles) EXPECT_THAT(mesh.status().message(), HasSubstr(n)) << "rank " << r;
    });
    EXPECT_LT(absl::Now() - t0, absl::Seconds(5)) << "ranks waited for a timeout";
  }
}

TEST(DeviceMeshErrorTest, NamesDimsSubFlatten) {
  RunRanks(8, [](int, Communicator& comm) {
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(comm, {2, 2, 2}, {"dp", "cp", "tp"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    auto expect_error = [](const absl::Status& s, const std::vector<std::string>& needles, const std::string& what) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
      for (const std::string& n : needles) EXPECT_THAT(s.message(), HasSubstr(n)) << what;
    };
    expect_error(mesh->DimIndex("ep").status(), {"\"ep\"", "dp=2, cp=2, tp=2"}, "DimIndex unknown");
    expect_error(mesh->Sub("ep").status(), {"\"ep\""}, "Sub unknown");
    expect_error(mesh->Sub(std::vector<std::string>{"dp", "ep"}).status(), {"\"ep\""}, "Sub unknown of two");
    expect_error(mesh->Sub(std::vector<std::string>{"tp", "dp"}).status(), {"tp, dp"}, "Sub out of order");
    expect_error(mesh->Sub(std::vector<std::string>{"dp", "dp"}).status(), {"dp, dp"}, "Sub duplicate");
    expect_error(mesh->Sub(std::vector<std::string>{}).status(), {}, "Sub of nothing");
    expect_error(mesh->Flatten("tp", "dp", "x").status(), {"\"tp\"", "\"dp\""}, "Flatten reversed");
    expect_error(mesh->Flatten("dp", "ep", "x").status(), {"\"ep\""}, "Flatten unknown");
    expect_error(mesh->Flatten("dp", "cp", "").status(), {}, "Flatten empty name");
    expect_error(mesh->Flatten("dp", "cp", "tp").status(), {"\"tp\""}, "Flatten name clash");
    // Reusing a merged dim's name is fine.
    EXPECT_TRUE(mesh->Flatten("dp", "cp", "dp").ok());
    // Dims adjacent in a sub-mesh but not in the root mesh cannot be merged.
    absl::StatusOr<DeviceMesh> dp_tp = mesh->Sub(std::vector<std::string>{"dp", "tp"});
    ASSERT_TRUE(dp_tp.ok()) << dp_tp.status();
    expect_error(dp_tp->Flatten("dp", "tp", "x").status(), {"\"dp\"", "\"tp\"", "adjacent"}, "Flatten non-adjacent");
    // comm(dims) with bad lists.
    expect_error(mesh->comm(std::vector<int>{}).status(), {}, "comm({})");
    expect_error(mesh->comm(std::vector<int>{3}).status(), {"{3}"}, "comm({3})");
    expect_error(mesh->comm(std::vector<int>{-1}).status(), {"{-1}"}, "comm({-1})");
    expect_error(mesh->comm(std::vector<int>{1, 1}).status(), {"{1,1}"}, "comm({1,1})");
    expect_error(dp_tp->comm(std::vector<int>{2}).status(), {"{2}"}, "sub comm({2})");
  });
}

}  // namespace
}  // namespace dtensor
