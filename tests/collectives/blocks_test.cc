// Communicator::AllToAllBlocks: blocks given as strided views (the column blocks of S(0) ->
// S(1)), on the threads backend (view to view, no packing) and through the default
// implementation (pack, AllToAllV, unpack) that the ucx and nccl transports inherit. The
// default is reached through a communicator that forwards everything else to a threads
// communicator. Reference: the global matrix g(i, c) = 100 i + c, cut with torch.chunk.
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using ::testing::HasSubstr;
using CommPtr = std::unique_ptr<Communicator>;

// Forwards every call to `inner` except AllToAllBlocks, which stays the base class's.
class DefaultBlocks final : public Communicator {
 public:
  explicit DefaultBlocks(CommPtr inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Device device() const override { return inner_->device(); }
  const char* backend() const override { return "default-blocks"; }
  void SetTimeout(absl::Duration t) override { inner_->SetTimeout(t); }
  absl::Duration timeout() const override { return inner_->timeout(); }
  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const Tensor& i, const Tensor& o, CommReduceOp op) override {
    return inner_->AllReduceAsync(i, o, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const Tensor& i, const Tensor& o) override {
    return inner_->AllGatherAsync(i, o);
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const Tensor& i, const Tensor& o, CommReduceOp op) override {
    return inner_->ReduceScatterAsync(i, o, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllAsync(const Tensor& i, const Tensor& o) override {
    return inner_->AllToAllAsync(i, o);
  }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(const Tensor& t, int root) override {
    return inner_->BroadcastAsync(t, root);
  }
  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const Tensor& t, int peer) override {
    return inner_->SendAsync(t, peer);
  }
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(const Tensor& t, int peer) override {
    return inner_->RecvAsync(t, peer);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherVAsync(const Tensor& i, const Tensor& o,
                                                        absl::Span<const int64_t> c) override {
    return inner_->AllGatherVAsync(i, o, c);
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterVAsync(const Tensor& i, const Tensor& o,
                                                            absl::Span<const int64_t> c, CommReduceOp op) override {
    return inner_->ReduceScatterVAsync(i, o, c, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(const Tensor& i, const Tensor& o, absl::Span<const int64_t> s,
                                                       absl::Span<const int64_t> r) override {
    return inner_->AllToAllVAsync(i, o, s, r);
  }
  absl::Status Barrier() override { return inner_->Barrier(); }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override { return inner_->Split(color, key); }

 private:
  CommPtr inner_;
};

// torch.chunk of n over k: piece j's [start, size).
std::pair<int64_t, int64_t> Chunk(int64_t n, int k, int j) {
  const int64_t c = (n + k - 1) / k;
  const int64_t start = std::min(n, c * j);
  return {start, std::min(n, start + c) - start};
}

Tensor Matrix(int64_t row0, int64_t rows, int64_t col0, int64_t cols) {
  std::vector<double> v;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) v.push_back(static_cast<double>(100 * (row0 + i) + col0 + c));
  }
  return testing::FromDoubles(v, {rows, cols}, DType::kFloat32);
}

// Runs fn(rank, comm) on one thread per rank of a threads group of `world` (wrapped in
// DefaultBlocks when `use_default`).
void RunRanks(int world, bool use_default, const std::function<void(int, Communicator&)>& fn) {
  auto comms = testing::Unwrap(MakeThreadGroup(world, absl::Seconds(20)));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CommPtr comm = std::move(comms[static_cast<size_t>(r)]);
      if (use_default) comm = std::make_unique<DefaultBlocks>(std::move(comm));
      fn(r, *comm);
    });
  }
  for (auto& t : threads) t.join();
}

class BlocksTest : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

// S(0) -> S(1) of a [7, 5] matrix: rank r holds rows chunk r, sends column chunk j of them to
// rank j, receives rows chunk j of its columns from rank j. `transposed_out`: the output is
// the transpose of a [cols, 7] buffer, so the receive views are strided too.
TEST_P(BlocksTest, ColumnBlocksOfRowShards) {
  const int world = std::get<0>(GetParam());
  const bool use_default = std::get<1>(GetParam()), transposed_out = std::get<2>(GetParam());
  const int64_t rows = 7, cols = 5;
  RunRanks(world, use_default, [&](int rank, Communicator& comm) {
    const auto [r0, nr] = Chunk(rows, world, rank);
    const int64_t c0 = Chunk(cols, world, rank).first, nc = Chunk(cols, world, rank).second;
    const Tensor local = Matrix(r0, nr, 0, cols);
    Tensor out;
    if (transposed_out) {
      out = testing::Unwrap(testing::Unwrap(Full({nc, rows}, -1.0, DType::kFloat32)).Transpose(0, 1));
    } else {
      out = testing::Unwrap(Full({rows, nc}, -1.0, DType::kFloat32));
    }
    std::vector<Tensor> sends, recvs;
    for (int j = 0; j < world; ++j) {
      const auto [jc0, jnc] = Chunk(cols, world, j);
      const auto [jr0, jnr] = Chunk(rows, world, j);
      sends.push_back(testing::Unwrap(local.Narrow(1, jc0, jnc)));
      recvs.push_back(testing::Unwrap(out.Narrow(0, jr0, jnr)));
    }
    const absl::Status s = comm.AllToAllBlocks(sends, recvs);
    ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s;
    testing::ExpectNear(testing::Values(testing::Unwrap(Contiguous(out))), testing::Values(Matrix(0, rows, c0, nc)),
                        {0, 0}, absl::StrCat("rank ", rank, " of ", world, use_default ? " (default)" : " (threads)"));
    // The inputs are untouched.
    testing::ExpectNear(testing::Values(local), testing::Values(Matrix(r0, nr, 0, cols)), {0, 0}, "input");
  });
}

INSTANTIATE_TEST_SUITE_P(All, BlocksTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool(), ::testing::Bool()));

// Blocks of different shapes but equal counts move in row-major element order; a rank's own
// block may alias its receive view.
TEST(BlocksTest, ShapesMayDifferAndOwnBlockMayAlias) {
  for (bool use_default : {false, true}) {
    RunRanks(2, use_default, [&](int rank, Communicator& comm) {
      Tensor buf = Matrix(rank * 10, 2, 0, 6);  // [2, 6]
      // To the peer: a [2, 3] column block; from the peer: into a [3, 2] region of buf.
      const Tensor to_peer = testing::Unwrap(buf.Narrow(1, 0, 3));
      const Tensor from_peer = testing::Unwrap(Tensor::Empty({3, 2}, DType::kFloat32));
      const Tensor self = testing::Unwrap(buf.Narrow(1, 3, 3));  // sent onto itself
      std::vector<Tensor> sends(2), recvs(2);
      sends[static_cast<size_t>(1 - rank)] = to_peer;
      recvs[static_cast<size_t>(1 - rank)] = from_peer;
      sends[static_cast<size_t>(rank)] = self;
      recvs[static_cast<size_t>(rank)] = self;
      const Tensor expected_self = testing::Unwrap(Contiguous(self));
      const absl::Status s = comm.AllToAllBlocks(sends, recvs);
      ASSERT_TRUE(s.ok()) << s;
      const std::vector<double> peer = testing::Values(
          testing::Unwrap(Contiguous(testing::Unwrap(Matrix((1 - rank) * 10, 2, 0, 6).Narrow(1, 0, 3)))));
      EXPECT_EQ(testing::Values(from_peer), peer) << "rank " << rank;
      EXPECT_EQ(testing::Values(testing::Unwrap(Contiguous(self))), testing::Values(expected_self));
    });
  }
}

// A rank's own block sent onto a receive view that shares some of its bytes without starting at
// them: rows 0-1 of a matrix's left half onto rows 1-2 of it. The views are strided, so the
// bytes they touch reach beyond numel x element size from their first element; copied row by
// row without a private copy of the source first, row 1 would be overwritten before it is read.
TEST(BlocksTest, OwnBlockOverlappingItsReceiveViewShifted) {
  for (bool use_default : {false, true}) {
    RunRanks(1, use_default, [&](int, Communicator& comm) {
      const Tensor buf = Matrix(0, 3, 0, 4);  // [3, 4]: rows 0, 1, 2 = 0.., 100.., 200..
      const Tensor left = testing::Unwrap(buf.Narrow(1, 0, 2));
      const Tensor send = testing::Unwrap(left.Narrow(0, 0, 2)), recv = testing::Unwrap(left.Narrow(0, 1, 2));
      const absl::Status s = comm.AllToAllBlocks({send}, {recv});
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(testing::Values(buf), (std::vector<double>{0, 1, 2, 3, 0, 1, 102, 103, 100, 101, 202, 203}))
          << (use_default ? "default" : "threads");
    });
  }
}

// AllToAllBlocks(views, views): every rank sends column block j of its buffer to rank j and
// receives rank j's block into the same columns (an in-place exchange). A rank writes its
// receive views while the peers still read its send views, so those must be staged.
TEST(BlocksTest, InPlaceExchangeOfColumnBlocks) {
  for (int world : {2, 3}) {
    for (bool use_default : {false, true}) {
      RunRanks(world, use_default, [&](int rank, Communicator& comm) {
        const int64_t rows = 5, c = 3;
        // Rank r's buffer: g(i, col) = 100 i + col + 1000 r.
        const Tensor buf = testing::Unwrap(Add(
            Matrix(0, rows, 0, c * world), testing::Unwrap(Full({rows, c * world}, 1000.0 * rank, DType::kFloat32))));
        std::vector<Tensor> views;
        for (int j = 0; j < world; ++j) views.push_back(testing::Unwrap(buf.Narrow(1, j * c, c)));
        const absl::Status s = comm.AllToAllBlocks(views, views, /*uniform=*/true);
        ASSERT_TRUE(s.ok()) << s;
        // Block j now holds rank j's block `rank`: 100 i + rank * c + cc + 1000 j.
        std::vector<double> want;
        for (int64_t i = 0; i < rows; ++i) {
          for (int j = 0; j < world; ++j) {
            for (int64_t cc = 0; cc < c; ++cc) want.push_back(static_cast<double>(100 * i + rank * c + cc + 1000 * j));
          }
        }
        EXPECT_EQ(testing::Values(buf), want)
            << "rank " << rank << " of " << world << (use_default ? " (default)" : " (threads)");
      });
    }
  }
}

// `uniform` (every block the same count on every rank): the default takes the even AllToAll.
TEST(BlocksTest, UniformEvenSplitOnBothPaths) {
  for (bool use_default : {false, true}) {
    RunRanks(2, use_default, [&](int rank, Communicator& comm) {
      const Tensor local = Matrix(2 * rank, 2, 0, 4);  // rows 2r, 2r+1 of a [4, 4] matrix
      const Tensor out = testing::Unwrap(Tensor::Empty({4, 2}, DType::kFloat32));
      std::vector<Tensor> sends, recvs;
      for (int j = 0; j < 2; ++j) {
        sends.push_back(testing::Unwrap(local.Narrow(1, 2 * j, 2)));
        recvs.push_back(testing::Unwrap(out.Narrow(0, 2 * j, 2)));
      }
      const absl::Status s = comm.AllToAllBlocks(sends, recvs, /*uniform=*/true);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(testing::Values(out), testing::Values(Matrix(0, 4, 2 * rank, 2))) << "rank " << rank;
    });
  }
  // The default checks the promise.
  RunRanks(1, true, [&](int, Communicator& comm) {
    const Tensor f = testing::Unwrap(Tensor::Empty({2}, DType::kFloat32));
    const Tensor g = testing::Unwrap(Tensor::Empty({3}, DType::kFloat32));
    const absl::Status s = comm.AllToAllBlocks({f}, {g}, /*uniform=*/true);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("uniform, but"));
  });
}

TEST(BlocksTest, BadArgumentsNameTheBlock) {
  RunRanks(1, false, [&](int, Communicator& comm) {
    const Tensor f = testing::Unwrap(Tensor::Empty({2}, DType::kFloat32));
    const Tensor i = testing::Unwrap(Tensor::Empty({2}, DType::kInt64));
    absl::Status s = comm.AllToAllBlocks({f, f}, {f});
    EXPECT_TRUE(absl::IsInvalidArgument(s));
    EXPECT_THAT(std::string(s.message()), HasSubstr("sends has 2 blocks, expected 1"));
    s = comm.AllToAllBlocks({f}, {i});
    EXPECT_THAT(std::string(s.message()), HasSubstr("recvs[0] is int64 but sends[0] is float32"));
    s = comm.AllToAllBlocks({Tensor()}, {f});
    EXPECT_THAT(std::string(s.message()), HasSubstr("sends[0] is undefined"));
  });
}

// Counts that disagree between a sender and its receiver fail on every rank, for both paths.
TEST(BlocksTest, MismatchedCountsFailEverywhere) {
  for (bool use_default : {false, true}) {
    RunRanks(2, use_default, [&](int rank, Communicator& comm) {
      const Tensor two = testing::Unwrap(Tensor::Empty({2}, DType::kFloat32));
      const Tensor three = testing::Unwrap(Tensor::Empty({3}, DType::kFloat32));
      // Rank 0 sends 2 to rank 1, which expects 3.
      const absl::Status s =
          rank == 0 ? comm.AllToAllBlocks({two, two}, {two, two}) : comm.AllToAllBlocks({two, two}, {three, two});
      EXPECT_TRUE(absl::IsInvalidArgument(s)) << (use_default ? "default" : "threads") << " rank " << rank << ": " << s;
    });
  }
}

}  // namespace
}  // namespace dtensor
