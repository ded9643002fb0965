// Checkpoints on thread ranks, each checked against the global tensors it was made from:
// save under one mesh and layouts, load under others (another world size, nested shard orders,
// uneven pieces, Partial sources and targets, plain tensors), the bytes a rank reads, the
// atomic directory protocol (keep K, incomplete directories never picked) and the errors for
// missing, truncated and corrupted files and mismatched targets.
#include "dtensor/checkpoint/checkpoint.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dtensor/ops/ops.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/core/suite_util.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using ::testing::HasSubstr;
using testing::Unwrap;

using suite::RunRanks;

// The global tensors every test saves: distinct values, so a misplaced element shows.
Tensor Global(IntSpan shape, DType dtype, uint64_t seed) {
  if (dtype == DType::kInt64) {  // integers: seed * 1000 + index
    std::vector<int64_t> v(static_cast<size_t>(NumElements(shape)));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>(seed * 1000 + i);
    return Unwrap(Tensor::FromVector<int64_t>(v, shape));
  }
  return testing::Random(shape, dtype, seed, -100.0, 100.0);
}

struct Item {
  std::string name;
  Shape shape;
  DType dtype;
  Layout layout;  // on the saving mesh
};

// Saved on a 2x2 mesh: the layouts that matter (sharded both ways, replicated, nested with the
// non-default order, uneven, Partial) and one plain tensor.
std::vector<Item> Items() {
  Layout nested = Unwrap(Layout({Shard(0), Shard(0)}).WithShardOrder(0, {1, 0}));
  return {
      {"a", {8, 6}, DType::kFloat32, Layout({Shard(0), Shard(1)})},
      {"b", {7, 5}, DType::kFloat32, Layout({Replicate(), Shard(0)})},
      {"c", {9, 4}, DType::kFloat32, nested},
      {"d", {6, 3}, DType::kBFloat16, Layout({Partial(), Shard(1)})},
      {"e", {5}, DType::kInt64, Layout({Replicate(), Replicate()})},
  };
}

std::string Save(const std::string& root, const std::string& name, SaveOptions options = {}) {
  RunRanks(4, [&](int, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {2, 2}));
    CheckpointState state;
    uint64_t seed = 1;
    for (const Item& it : Items()) {
      const Tensor g = Global(it.shape, it.dtype, seed++);
      state.push_back({it.name, Unwrap(DTensor::Distribute(g, mesh, it.layout, {.src_rank = std::nullopt}))});
    }
    state.push_back({"step", Unwrap(Tensor::FromVector<int64_t>({10}, {1}))});
    const absl::Status s = SaveCheckpoint(comm, root, name, state, options);
    EXPECT_TRUE(s.ok()) << s;
  });
  return root + "/" + name;
}

// Loads every item onto `world` ranks with mesh `mesh_shape` and the layouts `layout_of` gives,
// and compares each full tensor with the global it was saved from.
void LoadAndCheck(const std::string& dir, int world, Shape mesh_shape,
                  const std::function<Layout(const Item&)>& layout_of) {
  RunRanks(world, [&](int, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, mesh_shape));
    CheckpointState state;
    for (const Item& it : Items()) {
      const Tensor zeros = Unwrap(Zeros(it.shape, it.dtype));
      state.push_back({it.name, Unwrap(DTensor::Distribute(zeros, mesh, layout_of(it), {.src_rank = std::nullopt}))});
    }
    const Tensor step = Unwrap(Tensor::FromVector<int64_t>({0}, {1}));
    state.push_back({"step", step});
    const absl::Status s = LoadCheckpoint(dir, state);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(step.data<int64_t>()[0], 10);
    uint64_t seed = 1;
    const std::vector<Item> items = Items();
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      const Tensor got = Unwrap(std::get<DTensor>(state[i].tensor).FullTensor());
      EXPECT_EQ(testing::Values(got), testing::Values(Global(it.shape, it.dtype, seed++)))
          << it.name << " loaded as " << layout_of(it).ToString();
    }
  });
}

class CheckpointTest : public ::testing::Test {
 protected:
  std::string Root() const { return dir_.Path("ckpt"); }

 private:
  testing::ScopedTempDir dir_{"checkpoint_test"};
};

TEST_F(CheckpointTest, LoadsUnderTheSameLayouts) {
  const std::string dir = Save(Root(), "step-1");
  LoadAndCheck(dir, 4, {2, 2}, [](const Item& it) { return it.layout; });
}

TEST_F(CheckpointTest, ReshardsOntoOtherMeshesAndLayouts) {
  const std::string dir = Save(Root(), "step-1");
  // 4 ranks in a line: every tensor sharded on its last dim (uneven), or on dim 0.
  LoadAndCheck(dir, 4, {4}, [](const Item& it) { return Layout({Shard(static_cast<int64_t>(it.shape.size()) - 1)}); });
  LoadAndCheck(dir, 4, {4}, [](const Item&) { return Layout({Shard(0)}); });
  // Another world size: 3 ranks, Partial targets (filled as R -> P), and 6 ranks as 3x2.
  LoadAndCheck(dir, 3, {3}, [](const Item&) { return Layout({Partial()}); });
  LoadAndCheck(dir, 6, {3, 2}, [](const Item& it) {
    return it.shape.size() == 2 ? Layout({Shard(1), Shard(0)}) : Layout({Shard(0), Replicate()});
  });
  // The transposed nesting on 2x2, and one rank.
  LoadAndCheck(dir, 4, {2, 2}, [](const Item&) { return Layout({Shard(0), Shard(0)}); });
  LoadAndCheck(dir, 1, {1}, [](const Item&) { return Layout({Replicate()}); });
}

TEST_F(CheckpointTest, ARankReadsOnlyTheBlocksOfItsBox) {
  // [8, 16] float32 saved as S(0) over 4 ranks, 64-byte blocks (one row each).
  const std::string dir = Root() + "/rows";
  RunRanks(4, [&](int, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {4}));
    DTensor x = Unwrap(
        DTensor::Distribute(Global({8, 16}, DType::kFloat32, 7), mesh, Layout({Shard(0)}), {.src_rank = std::nullopt}));
    EXPECT_TRUE(SaveCheckpoint(comm, Root(), "rows", {{"x", x}}, {.block_bytes = 64}).ok());
  });
  // On 2 ranks: S(0) needs 4 rows = 256 bytes from 2 files; S(1) needs half of each of 8 rows,
  // so it reads 8 whole blocks = 512 bytes from all 4 files.
  for (const auto& [layout, bytes, files] :
       {std::tuple{Layout({Shard(0)}), 256, 2}, std::tuple{Layout({Shard(1)}), 512, 4}}) {
    RunRanks(2, [&, layout = layout, bytes = bytes, files = files](int, Communicator& comm) {
      DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {2}));
      DTensor y = Unwrap(
          DTensor::Distribute(Unwrap(Zeros({8, 16}, DType::kFloat32)), mesh, layout, {.src_rank = std::nullopt}));
      LoadStats stats;
      ASSERT_TRUE(LoadCheckpoint(dir, {{"x", y}}, &stats).ok());
      EXPECT_EQ(stats.bytes_read, bytes) << layout.ToString();
      EXPECT_EQ(stats.files_opened, files) << layout.ToString();
      EXPECT_EQ(testing::Values(Unwrap(y.FullTensor())), testing::Values(Global({8, 16}, DType::kFloat32, 7)));
    });
  }
}

// GPT-2's fused c_attn [3C, C], which tensor parallelism views as [3, C, C] with dim 1 sharded
// (each rank its heads of q, k and v): saved in one view, loaded in the other.
TEST_F(CheckpointTest, AStackedViewLoadsFromTheFusedShapeAndBack) {
  const Tensor fused = Global({12, 5}, DType::kFloat32, 11);
  const Tensor stacked = Unwrap(fused.View({3, 4, 5}));
  // Fused [12, 5] S(0) over 4 ranks (rows 0-2, 3-5, ...: q/k/v boundaries cut through pieces).
  RunRanks(4, [&](int, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {4}));
    DTensor x = Unwrap(DTensor::Distribute(fused, mesh, Layout({Shard(0)}), {.src_rank = std::nullopt}));
    EXPECT_TRUE(SaveCheckpoint(comm, Root(), "fused", {{"w", x}}).ok());
  });
  // Stacked [3, 4, 5] S(1) over 2 ranks, stored as [12, 5]: load, compare, save.
  RunRanks(2, [&](int, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {2}));
    DTensor y = Unwrap(DTensor::Distribute(Unwrap(Zeros({3, 4, 5}, DType::kFloat32)), mesh, Layout({Shard(1)}),
                                           {.src_rank = std::nullopt}));
    const CheckpointState state = {{"w", y, std::vector<int64_t>{12, 5}}};
    const absl::Status s = LoadCheckpoint(Root() + "/fused", state);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(testing::Values(Unwrap(y.FullTensor())), testing::Values(stacked));
    EXPECT_TRUE(SaveCheckpoint(comm, Root(), "stacked", state).ok());
  });
  // Back to the fused shape on 3 ranks (uneven rows), and a stored shape that does not fit.
  RunRanks(3, [&](int, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {3}));
    DTensor z = Unwrap(DTensor::Distribute(Unwrap(Zeros({12, 5}, DType::kFloat32)), mesh, Layout({Shard(1)}),
                                           {.src_rank = std::nullopt}));
    ASSERT_TRUE(LoadCheckpoint(Root() + "/stacked", {{"w", z}}).ok());
    EXPECT_EQ(testing::Values(Unwrap(z.FullTensor())), testing::Values(fused));
    const absl::Status bad = LoadCheckpoint(Root() + "/stacked", {{"w", z, std::vector<int64_t>{6, 10}}});
    EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
    EXPECT_THAT(bad.message(), HasSubstr("cannot be stored as [6, 10]"));
  });
}

// An asynchronous save holds the values of its Start: the tensors change at once (training
// goes on), Finish commits, and the checkpoint holds the staged values.
TEST_F(CheckpointTest, AnAsynchronousSaveKeepsTheValuesItStartedWith) {
  const Tensor g = Global({6, 4}, DType::kFloat32, 21);
  RunRanks(2, [&](int, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {2}));
    DTensor x = Unwrap(DTensor::Distribute(g, mesh, Layout({Shard(0)}), {.src_rank = std::nullopt}));
    std::unique_ptr<AsyncCheckpointSave> save = Unwrap(AsyncCheckpointSave::Start(comm, Root(), "async", {{"x", x}}));
    EXPECT_TRUE(absl::IsNotFound(LatestCheckpoint(Root()).status()));  // not committed before Finish
    ASSERT_TRUE(Fill_(x.ToLocal(), 7.0).ok());
    const absl::Status s = save->Finish();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(absl::IsFailedPrecondition(save->Finish()));
    DTensor y = Unwrap(DTensor::Distribute(Unwrap(Zeros({6, 4}, DType::kFloat32)), mesh, Layout({Replicate()}),
                                           {.src_rank = std::nullopt}));
    ASSERT_TRUE(LoadCheckpoint(Root() + "/async", {{"x", y}}).ok());
    EXPECT_EQ(testing::Values(y.ToLocal()), testing::Values(g));
  });
}

TEST_F(CheckpointTest, KeepsTheNewestAndNeverPicksAnIncompleteOne) {
  EXPECT_TRUE(absl::IsNotFound(LatestCheckpoint(Root()).status()));
  for (const char* name : {"step-00000001", "step-00000002", "step-00000003"}) Save(Root(), name, {.keep = 2});
  EXPECT_FALSE(std::filesystem::exists(Root() + "/step-00000001"));
  EXPECT_TRUE(std::filesystem::exists(Root() + "/step-00000002"));
  EXPECT_EQ(Unwrap(LatestCheckpoint(Root())), Root() + "/step-00000003");
  // What an interrupted save leaves: a temporary directory, or a directory without metadata.
  std::filesystem::create_directories(Root() + "/.tmp-step-00000009");
  testing::WriteBytes(Root() + "/.tmp-step-00000009/rank-00000.bin", "partial");
  std::filesystem::create_directories(Root() + "/step-00000008");
  EXPECT_EQ(Unwrap(LatestCheckpoint(Root())), Root() + "/step-00000003");
  // A name that exists is refused on every rank, and so is a tensor name JSON cannot hold.
  RunRanks(2, [&](int, Communicator& comm) {
    const absl::Status s = SaveCheckpoint(comm, Root(), "step-00000003", {});
    EXPECT_TRUE(absl::IsAlreadyExists(s)) << s;
    const absl::Status utf8 =
        SaveCheckpoint(comm, Root(), "step-00000005", {{"bad\xff", Unwrap(Zeros({2}, DType::kFloat32))}});
    EXPECT_TRUE(absl::IsInvalidArgument(utf8)) << utf8;
    EXPECT_THAT(utf8.message(), HasSubstr("is not UTF-8"));
  });
  EXPECT_FALSE(std::filesystem::exists(Root() + "/step-00000005"));
  // A save named before another run's newer checkpoint keeps itself (and leaves the newer one):
  // keep counts it and those before it.
  Save(Root(), "step-00000010");
  Save(Root(), "step-00000004", {.keep = 1});
  EXPECT_TRUE(std::filesystem::exists(Root() + "/step-00000004/metadata.json"));
  EXPECT_TRUE(std::filesystem::exists(Root() + "/step-00000010/metadata.json"));
  EXPECT_FALSE(std::filesystem::exists(Root() + "/step-00000003"));
  EXPECT_FALSE(std::filesystem::exists(Root() + "/step-00000002"));
  for (const auto& e : std::filesystem::directory_iterator(Root())) {
    EXPECT_NE(e.path().filename().string().rfind(".pruned-", 0), 0u) << e.path();
  }
}

// Metadata whose pieces overlap (two copies of one piece standing in for another: the count of
// elements still adds up) and metadata nested 100,000 deep are DataLoss, not a tensor with
// unwritten elements or a crash.
TEST_F(CheckpointTest, OverlappingPiecesAndDeepNestingAreDataLoss) {
  const std::string dir = Save(Root(), "step-1");
  const std::string meta = dir + "/metadata.json";
  const std::string good = testing::ReadBytes(meta);
  auto load_a = [&]() {
    absl::Status s;
    RunRanks(1, [&](int, Communicator&) { s = LoadCheckpoint(dir, {{"a", Unwrap(Zeros({8, 6}, DType::kFloat32))}}); });
    return s;
  };
  ASSERT_TRUE(load_a().ok());
  // "a" is [8, 6] as S(0) x S(1) on 2 x 2: four [4, 3] pieces, in the order the ranks wrote.
  const size_t pieces = good.find("\"pieces\"", good.find("\"a\""));
  const size_t first = good.find('{', pieces), second = good.find('{', good.find('}', first));
  ASSERT_NE(second, std::string::npos);
  const std::string piece0 = good.substr(first, good.find('}', first) + 1 - first);
  const std::string piece1 = good.substr(second, good.find('}', second) + 1 - second);
  ASSERT_NE(piece0, piece1);
  testing::WriteBytes(meta, good.substr(0, second) + piece0 + good.substr(second + piece1.size()));
  absl::Status s = load_a();
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("overlap"));
  testing::WriteBytes(meta, "{\"version\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
  s = load_a();
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("nests deeper than 64 levels"));
}

TEST_F(CheckpointTest, BadFilesAndTargetsAreErrorsNamingThem) {
  const std::string dir = Save(Root(), "step-1", {.block_bytes = 16});
  auto load_a = [&](const std::string& d, Shape shape, DType dtype, const std::string& name = "a") {
    absl::Status s;
    RunRanks(1, [&](int, Communicator&) {
      const Tensor t = Unwrap(Zeros(shape, dtype));
      s = LoadCheckpoint(d, {{name, t}});
    });
    return s;
  };
  ASSERT_TRUE(load_a(dir, {8, 6}, DType::kFloat32).ok());
  absl::Status s = load_a(dir, {8, 7}, DType::kFloat32);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("tensor a is [8,6] float32 in "));
  s = load_a(dir, {8, 6}, DType::kBFloat16);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  s = load_a(dir, {8, 6}, DType::kFloat32, "z");
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("tensor z is not in"));

  // A flipped byte: the block's checksum; a cut file: truncated; no file: not found.
  const std::string f = dir + "/rank-00001.bin";
  std::string bytes = testing::ReadBytes(f);
  ASSERT_GT(bytes.size(), 4u);
  bytes[3] ^= 0x40;
  testing::WriteBytes(f, bytes);
  s = load_a(dir, {8, 6}, DType::kFloat32);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch in rank-00001.bin"));
  bytes[3] ^= 0x40;
  testing::WriteBytes(f, bytes.substr(0, 10));
  s = load_a(dir, {8, 6}, DType::kFloat32);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank-00001.bin is truncated"));
  std::filesystem::remove(f);
  s = load_a(dir, {8, 6}, DType::kFloat32);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("tensor a: cannot open " + f));
  std::filesystem::remove(dir + "/metadata.json");
  s = load_a(dir, {8, 6}, DType::kFloat32);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("not a complete checkpoint"));
}

// A load that fails on a target's name, shape or dtype, or on pieces that do not cover it,
// changes no target: every target is checked before any byte is read (the first used to be
// filled before the second's error).
TEST_F(CheckpointTest, AFailedLoadChangesNoTarget) {
  const std::string dir = Save(Root(), "step-1");
  RunRanks(1, [&](int, Communicator&) {
    const Tensor a = Unwrap(Zeros({8, 6}, DType::kFloat32));
    for (const auto& [what, second] : std::vector<std::pair<std::string, StateEntry>>{
             {"a missing tensor", {"z", Unwrap(Zeros({2}, DType::kFloat32))}},
             {"a shape", {"b", Unwrap(Zeros({7, 6}, DType::kFloat32))}},
             {"a dtype", {"e", Unwrap(Zeros({5}, DType::kFloat32))}}}) {
      const absl::Status s = LoadCheckpoint(dir, {{"a", a}, second});
      EXPECT_FALSE(s.ok()) << what;
      EXPECT_EQ(testing::Values(a), std::vector<double>(48, 0.0)) << what << ": " << s;
    }
    // The missing-tensor message names a few of the checkpoint's tensors and their count.
    const absl::Status s = LoadCheckpoint(dir, {{"z", Unwrap(Zeros({2}, DType::kFloat32))}});
    EXPECT_THAT(s.message(), HasSubstr("(it holds a, b, c, d, e, step)"));
  });
  // b's metadata without its first piece: b is not covered, found before a is read.
  const std::string meta = dir + "/metadata.json";
  nlohmann::json m = nlohmann::json::parse(testing::ReadBytes(meta));
  ASSERT_GT(m["tensors"]["b"]["pieces"].size(), 1u);
  m["tensors"]["b"]["pieces"].erase(0);
  testing::WriteBytes(meta, m.dump());
  RunRanks(1, [&](int, Communicator&) {
    const Tensor a = Unwrap(Zeros({8, 6}, DType::kFloat32));
    const absl::Status s = LoadCheckpoint(dir, {{"a", a}, {"b", Unwrap(Zeros({7, 5}, DType::kFloat32))}});
    EXPECT_TRUE(absl::IsDataLoss(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("tensor b: the pieces in"));
    EXPECT_EQ(testing::Values(a), std::vector<double>(48, 0.0)) << s;
  });
}

// A save whose ranks' pieces do not cover a tensor exactly (a rank that leaves a sharded
// tensor out, ranks that give it different layouts) is refused on every rank before anything
// is committed, so `keep` prunes nothing: it used to commit a checkpoint that could not load
// and delete the good one before it. Two entries of one name are refused too (the second's
// data was dropped).
TEST_F(CheckpointTest, ASaveThatDoesNotCoverATensorOrNamesOneTwiceIsRefused) {
  const Tensor g = Global({4, 2}, DType::kFloat32, 3);
  RunRanks(2, [&](int rank, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {2}));
    const DTensor a = Unwrap(DTensor::Distribute(g, mesh, Layout({Shard(0)}), {.src_rank = std::nullopt}));
    const DTensor r = Unwrap(DTensor::Distribute(g, mesh, Layout({Replicate()}), {.src_rank = std::nullopt}));
    ASSERT_TRUE(SaveCheckpoint(comm, Root(), "step-00000001", {{"a", a}}).ok());
    absl::Status s = SaveCheckpoint(comm, Root(), "step-00000002", {{"a", rank == 0 ? a : r}}, {.keep = 1});
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    if (rank == 0) {
      EXPECT_THAT(s.message(), HasSubstr("tensor a [4, 2]: the ranks' pieces hold 4 of its 8 elements"));
    }
    s = SaveCheckpoint(comm, Root(), "step-00000003", rank == 0 ? CheckpointState{{"a", a}} : CheckpointState{},
                       {.keep = 1});  // rank 1 leaves it out
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    // Shard(0) on rank 0 (rows 0-1), Shard(1) on rank 1 (column 1): 4 + 4 elements, but two shared.
    const DTensor c = Unwrap(DTensor::Distribute(g, mesh, Layout({Shard(1)}), {.src_rank = std::nullopt}));
    s = SaveCheckpoint(comm, Root(), "step-00000003", {{"a", rank == 0 ? a : c}}, {.keep = 1});
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    if (rank == 0) {
      EXPECT_THAT(s.message(), HasSubstr("rank 0's piece (offset [0, 0], box [2, 2]) and rank 1's (offset [0, 1], box "
                                         "[4, 1]) overlap"));
    }
    s = SaveCheckpoint(comm, Root(), "step-00000004", {{"w", a}, {"w", a}});
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr("tensor name \"w\" is given twice (entries 0 and 1)"));
  });
  EXPECT_EQ(Unwrap(LatestCheckpoint(Root())), Root() + "/step-00000001");
  for (const char* name : {"step-00000002", "step-00000003", "step-00000004"}) {
    EXPECT_FALSE(std::filesystem::exists(Root() + "/" + name)) << name;
  }
}

// Checkpoint names order by their numbers (step-100000000 after step-99999999), and `keep`
// prunes only the names of the saved one's form (digits aside): a "best" stays.
// An interrupted save's .tmp- directory of the series is removed by the next commit after it
// (one of a later name, maybe a save in flight, stays).
TEST_F(CheckpointTest, NamesOrderByTheirNumbersAndKeepPrunesItsOwnSeries) {
  Save(Root(), "best");
  Save(Root(), "step-99999999");
  for (const char* tmp : {".tmp-step-99999998", ".tmp-step-100000001", ".tmp-best"}) {
    std::filesystem::create_directories(Root() + "/" + tmp);
  }
  Save(Root(), "step-100000000", {.keep = 1});
  EXPECT_EQ(Unwrap(LatestCheckpoint(Root())), Root() + "/step-100000000");
  EXPECT_FALSE(std::filesystem::exists(Root() + "/step-99999999"));
  EXPECT_TRUE(std::filesystem::exists(Root() + "/best/metadata.json"));
  EXPECT_FALSE(std::filesystem::exists(Root() + "/.tmp-step-99999998"));
  EXPECT_TRUE(std::filesystem::exists(Root() + "/.tmp-step-100000001"));
  EXPECT_TRUE(std::filesystem::exists(Root() + "/.tmp-best"));
}

// The entries of `root` whose names start with `prefix`.
std::vector<std::string> EntriesStartingWith(const std::string& root, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  }
  return out;
}

// Two saves of one name into one root at once, as two jobs would: one commits its own values
// whole, the other is AlreadyExists and prunes nothing, and no temporary directory is left.
TEST_F(CheckpointTest, TwoJobsSavingOneNameAtOnceCommitOneWholeAndTheOtherIsAlreadyExists) {
  const Tensor g[2] = {Global({256, 256}, DType::kFloat32, 31), Global({256, 256}, DType::kFloat32, 32)};
  for (int trial = 0; trial < 16; ++trial) {
    const std::string root = Root() + "/" + std::to_string(trial);
    absl::Status st[2];
    auto job = [&](int j) {
      RunRanks(2, [&](int rank, Communicator& comm) {
        DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {2}));
        DTensor a = Unwrap(DTensor::Distribute(g[j], mesh, Layout({Shard(0)}), {.src_rank = std::nullopt}));
        const absl::Status s = SaveCheckpoint(comm, root, "step-1", {{"a", a}});
        if (rank == 0) st[j] = s;
      });
    };
    std::thread t0(job, 0), t1(job, 1);
    t0.join();
    t1.join();
    ASSERT_NE(st[0].ok(), st[1].ok()) << "trial " << trial << ": " << st[0] << " | " << st[1];
    const int winner = st[0].ok() ? 0 : 1;
    EXPECT_TRUE(absl::IsAlreadyExists(st[1 - winner])) << st[1 - winner];
    Tensor out = Unwrap(Zeros({256, 256}, DType::kFloat32));
    const absl::Status loaded = LoadCheckpoint(root + "/step-1", {{"a", out}});
    ASSERT_TRUE(loaded.ok()) << "trial " << trial << ": " << loaded;
    EXPECT_EQ(testing::Values(out), testing::Values(g[winner])) << "trial " << trial;
    EXPECT_THAT(EntriesStartingWith(root, ".tmp-"), ::testing::IsEmpty()) << "trial " << trial;
  }
}

// The same in one job, deterministically: a save of a name still in flight (async) when
// another save of that name commits keeps its directory (no other save removes it) and its
// Finish is AlreadyExists, pruning nothing; the committed checkpoint is the other save's.
TEST_F(CheckpointTest, ASaveInFlightWhenItsNameIsCommittedIsAlreadyExistsAndPrunesNothing) {
  const Tensor g1 = Global({6, 4}, DType::kFloat32, 41), g2 = Global({6, 4}, DType::kFloat32, 42);
  RunRanks(2, [&](int, Communicator& comm) {
    DeviceMesh mesh = Unwrap(DeviceMesh::Create(comm, {2}));
    DTensor x = Unwrap(DTensor::Distribute(g1, mesh, Layout({Shard(0)}), {.src_rank = std::nullopt}));
    DTensor y = Unwrap(DTensor::Distribute(g2, mesh, Layout({Shard(1)}), {.src_rank = std::nullopt}));
    ASSERT_TRUE(SaveCheckpoint(comm, Root(), "step-00000001", {{"x", x}}).ok());
    std::unique_ptr<AsyncCheckpointSave> late =
        Unwrap(AsyncCheckpointSave::Start(comm, Root(), "step-00000002", {{"x", x}}, {.keep = 1}));
    const absl::Status first = SaveCheckpoint(comm, Root(), "step-00000002", {{"x", y}});
    ASSERT_TRUE(first.ok()) << first;
    const absl::Status s = late->Finish();
    EXPECT_TRUE(absl::IsAlreadyExists(s)) << s;
  });
  EXPECT_TRUE(std::filesystem::exists(Root() + "/step-00000001/metadata.json"));  // not pruned
  Tensor out = Unwrap(Zeros({6, 4}, DType::kFloat32));
  const absl::Status loaded = LoadCheckpoint(Root() + "/step-00000002", {{"x", out}});
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(testing::Values(out), testing::Values(g2));
  EXPECT_THAT(EntriesStartingWith(Root(), ".tmp-"), ::testing::IsEmpty());
}

// Every dtype saves and loads, float8 ones included: the bytes come back as they were written.
TEST_F(CheckpointTest, Float8TensorsRoundTrip) {
  CheckpointState state;
  std::vector<std::string> bytes;
  for (DType dtype : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    Tensor t = Unwrap(Tensor::Empty({3, 5}, dtype));
    std::string b;
    for (int i = 0; i < 15; ++i) b.push_back(static_cast<char>(0x11 * (i + 1) + static_cast<int>(dtype)));
    std::memcpy(t.raw_data(), b.data(), b.size());
    bytes.push_back(b);
    state.push_back({DTypeName(dtype), t});
  }
  RunRanks(1, [&](int, Communicator& comm) {
    const absl::Status s = SaveCheckpoint(comm, Root(), "f8", state);
    ASSERT_TRUE(s.ok()) << s;
  });
  const std::vector<CheckpointTensor> listed = Unwrap(CheckpointTensors(Root() + "/f8"));
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].dtype, DType::kFloat8E4M3);
  EXPECT_EQ(listed[1].dtype, DType::kFloat8E5M2);
  CheckpointState target;
  for (const StateEntry& e : state) {
    target.push_back({e.name, Unwrap(Tensor::Empty({3, 5}, std::get<Tensor>(e.tensor).dtype()))});
    std::memset(std::get<Tensor>(target.back().tensor).raw_data(), 0, 15);
  }
  const absl::Status loaded = LoadCheckpoint(Root() + "/f8", target);
  ASSERT_TRUE(loaded.ok()) << loaded;
  for (size_t i = 0; i < target.size(); ++i) {
    const Tensor& t = std::get<Tensor>(target[i].tensor);
    EXPECT_EQ(std::string(static_cast<const char*>(t.raw_data()), 15), bytes[i]) << target[i].name;
  }
}

// A root given with a trailing '/' whose parents do not exist yet is made (every directory on
// the way) and is the same root without it. (That each new directory's parent is fsynced can
// only show after a power loss; the test checks what a running system shows.)
TEST_F(CheckpointTest, ANewNestedRootWithATrailingSlashIsMadeAndHoldsTheCheckpoint) {
  const std::string root = Root() + "/runs//a/b/";
  Save(root, "step-1");
  EXPECT_TRUE(std::filesystem::is_directory(Root() + "/runs/a/b"));
  EXPECT_EQ(Unwrap(LatestCheckpoint(Root() + "/runs/a/b")), Root() + "/runs/a/b/step-1");
  LoadAndCheck(Root() + "/runs/a/b/step-1", 2, {2}, [](const Item&) { return Layout({Replicate()}); });
  EXPECT_THAT(EntriesStartingWith(Root() + "/runs/a/b", ".tmp-"), ::testing::IsEmpty());
  // MakeCheckpointRoot alone: nested directories, an existing root, a file's path.
  ASSERT_TRUE(MakeCheckpointRoot(Root() + "/x/y/z/").ok());
  EXPECT_TRUE(std::filesystem::is_directory(Root() + "/x/y/z"));
  EXPECT_TRUE(MakeCheckpointRoot(Root() + "/x/y/z").ok());
  testing::WriteBytes(Root() + "/file", "not a directory");
  const absl::Status file = MakeCheckpointRoot(Root() + "/file");
  EXPECT_TRUE(absl::IsFailedPrecondition(file)) << file;
  EXPECT_THAT(file.message(), HasSubstr(Root() + "/file"));
  const absl::Status under = MakeCheckpointRoot(Root() + "/file/sub");
  EXPECT_FALSE(under.ok());
  EXPECT_THAT(under.message(), HasSubstr(Root() + "/file/sub"));
}

}  // namespace
}  // namespace dtensor
