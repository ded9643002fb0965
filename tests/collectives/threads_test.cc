// Tests of the threads backend: every collective against a naive reference computed here
// (float64, or exact integers), for every dtype and world sizes 1, 2, 3, 4, 8; sub-groups,
// timeouts, departed ranks, cross-rank call checks and bad inputs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/tensor/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using ::testing::AllOf;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using CommPtr = std::unique_ptr<Communicator>;
using RankFn = std::function<absl::Status(int rank, CommPtr& comm)>;

// Runs fn(rank, comms[rank]) on one thread per rank; returns each rank's status. fn may
// reset its communicator (the rank leaves the group).
std::vector<absl::Status> RunOn(std::vector<CommPtr>& comms, const RankFn& fn) {
  std::vector<absl::Status> statuses(comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r) {
    threads.emplace_back([&, r] { statuses[r] = fn(static_cast<int>(r), comms[r]); });
  }
  for (auto& t : threads) t.join();
  return statuses;
}

std::vector<absl::Status> RunRanks(int world, const RankFn& fn, absl::Duration timeout = absl::Seconds(20)) {
  auto comms = MakeThreadGroup(world, timeout);
  if (!comms.ok()) return {comms.status()};
  return RunOn(*comms, fn);
}

void ExpectAllOk(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

// ---- Inputs and references ----

// Element i of rank r's data: nonzero values representable in every dtype (±0.5 .. ±2 for
// floats, ±1 .. ±4 for integers, a pattern for bool), so products stay small.
double Value(int rank, int64_t i, DType dtype) {
  const int64_t k = (rank * 5 + i * 3 + i / 7) % 8;
  const double v = static_cast<double>(k < 4 ? k - 4 : k - 3);
  if (dtype == DType::kBool) return ((rank + i) % 3 == 0) ? 1.0 : 0.0;
  if (IsInteger(dtype)) return v;
  return v * 0.5;
}

std::vector<double> Values(int rank, int64_t n, DType dtype, int64_t from = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = Value(rank, from + i, dtype);
  return v;
}

Tensor Make(const std::vector<double>& values, DType dtype) {
  return testing::FromDoubles(values, {static_cast<int64_t>(values.size())}, dtype);
}
// An output tensor prefilled with a sentinel, so unwritten elements show.
Tensor Sentinel(int64_t n, DType dtype) { return Make(std::vector<double>(static_cast<size_t>(n), 3.0), dtype); }

// The reduction of one element over all ranks, as the backend documents it.
double ReduceRef(CommReduceOp op, const std::vector<double>& v, DType dtype) {
  if (dtype == DType::kBool) {
    bool any = false, all = true;
    for (double x : v) any = any || x != 0, all = all && x != 0;
    return (op == CommReduceOp::kMin || op == CommReduceOp::kProduct) ? all : any;
  }
  double acc = v[0];
  for (size_t j = 1; j < v.size(); ++j) {
    switch (op) {
      case CommReduceOp::kSum:
      case CommReduceOp::kAvg:
        acc += v[j];
        break;
      case CommReduceOp::kMax:
        acc = std::max(acc, v[j]);
        break;
      case CommReduceOp::kMin:
        acc = std::min(acc, v[j]);
        break;
      case CommReduceOp::kProduct:
        acc *= v[j];
        break;
    }
  }
  if (op == CommReduceOp::kAvg) {
    if (IsInteger(dtype)) return static_cast<double>(static_cast<int64_t>(acc) / static_cast<int64_t>(v.size()));
    acc /= static_cast<double>(v.size());
  }
  return acc;
}

// Element i of the reduction over ranks of Value(rank, from + i).
std::vector<double> ReducedValues(CommReduceOp op, int world, int64_t n, DType dtype, int64_t from) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> v;
    for (int j = 0; j < world; ++j) v.push_back(Value(j, from + i, dtype));
    out[static_cast<size_t>(i)] = ReduceRef(op, v, dtype);
  }
  return out;
}

// torch.chunk(total, world) sizes, padded with zeros: 5 over 4 -> 2, 2, 1, 0.
std::vector<int64_t> ChunkCounts(int64_t total, int world) {
  const int64_t chunk = (total + world - 1) / world;
  std::vector<int64_t> c(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) c[static_cast<size_t>(r)] = std::clamp<int64_t>(total - r * chunk, 0, chunk);
  return c;
}

int64_t Sum(const std::vector<int64_t>& v, int upto) {
  int64_t s = 0;
  for (int j = 0; j < upto; ++j) s += v[static_cast<size_t>(j)];
  return s;
}

void ExpectValues(const Tensor& t, const std::vector<double>& expected, DType dtype, const std::string& what) {
  testing::ExpectNear(testing::Values(t), expected, testing::Tol(dtype), what);
}

// ---- Sweep: collective x dtype x world size ----

enum class Coll {
  kAllReduce,
  kAllReduceInPlace,
  kReduceScatter,
  kAllGather,
  kAllToAll,
  kBroadcast,
  kAllGatherV,
  kReduceScatterV,
  kAllToAllV,
  kSendRecv,
  kBatchSendRecv,
};

const char* CollName(Coll c) {
  switch (c) {
    case Coll::kAllReduce:
      return "AllReduce";
    case Coll::kAllReduceInPlace:
      return "AllReduceInPlace";
    case Coll::kReduceScatter:
      return "ReduceScatter";
    case Coll::kAllGather:
      return "AllGather";
    case Coll::kAllToAll:
      return "AllToAll";
    case Coll::kBroadcast:
      return "Broadcast";
    case Coll::kAllGatherV:
      return "AllGatherV";
    case Coll::kReduceScatterV:
      return "ReduceScatterV";
    case Coll::kAllToAllV:
      return "AllToAllV";
    case Coll::kSendRecv:
      return "SendRecv";
    case Coll::kBatchSendRecv:
      return "BatchSendRecv";
  }
  return "?";
}

bool Reduces(Coll c) {
  return c == Coll::kAllReduce || c == Coll::kAllReduceInPlace || c == Coll::kReduceScatter ||
         c == Coll::kReduceScatterV;
}

constexpr CommReduceOp kOps[] = {CommReduceOp::kSum, CommReduceOp::kAvg, CommReduceOp::kMax, CommReduceOp::kMin,
                                 CommReduceOp::kProduct};
// Element counts: empty, tiny, not divisible by any world size > 1, larger than a chunk.
constexpr int64_t kSizes[] = {0, 1, 5, 17, 1100};

using SweepParam = std::tuple<Coll, DType, int>;

class ThreadsSweepTest : public ::testing::TestWithParam<SweepParam> {};

// One reducing collective on one rank; checks this rank's output.
absl::Status RunReducing(Coll coll, CommReduceOp op, DType dtype, int64_t m, int rank, Communicator& comm) {
  const int world = comm.size();
  const std::string what = absl::StrCat(CollName(coll), " ", CommReduceOpName(op), " m=", m, " rank ", rank);
  switch (coll) {
    case Coll::kAllReduce:
    case Coll::kAllReduceInPlace: {
      Tensor in = Make(Values(rank, m, dtype), dtype);
      Tensor out = coll == Coll::kAllReduce ? Sentinel(m, dtype) : in;
      DT_RETURN_IF_ERROR(comm.AllReduce(in, out, op));
      ExpectValues(out, ReducedValues(op, world, m, dtype, 0), dtype, what);
      if (coll == Coll::kAllReduce) ExpectValues(in, Values(rank, m, dtype), dtype, what + " input kept");
      return absl::OkStatus();
    }
    case Coll::kReduceScatter: {
      Tensor in = Make(Values(rank, world * m, dtype), dtype);
      Tensor out = Sentinel(m, dtype);
      DT_RETURN_IF_ERROR(comm.ReduceScatter(in, out, op));
      ExpectValues(out, ReducedValues(op, world, m, dtype, rank * m), dtype, what);
      return absl::OkStatus();
    }
    case Coll::kReduceScatterV: {
      const std::vector<int64_t> counts = ChunkCounts(m, world);
      Tensor in = Make(Values(rank, m, dtype), dtype);
      Tensor out = Sentinel(counts[static_cast<size_t>(rank)], dtype);
      DT_RETURN_IF_ERROR(comm.ReduceScatterV(in, out, counts, op));
      ExpectValues(out, ReducedValues(op, world, counts[static_cast<size_t>(rank)], dtype, Sum(counts, rank)), dtype,
                   what);
      return absl::OkStatus();
    }
    default:
      return absl::InternalError("not a reducing collective");
  }
}

// One data-moving collective on one rank; checks this rank's output.
absl::Status RunMoving(Coll coll, DType dtype, int64_t m, int rank, Communicator& comm) {
  const int world = comm.size();
  const std::string what = absl::StrCat(CollName(coll), " m=", m, " rank ", rank);
  switch (coll) {
    case Coll::kAllGather: {
      Tensor out = Sentinel(world * m, dtype);
      DT_RETURN_IF_ERROR(comm.AllGather(Make(Values(rank, m, dtype), dtype), out));
      std::vector<double> expected;
      for (int j = 0; j < world; ++j) {
        for (double v : Values(j, m, dtype)) expected.push_back(v);
      }
      ExpectValues(out, expected, dtype, what);
      return absl::OkStatus();
    }
    case Coll::kAllToAll: {
      Tensor out = Sentinel(world * m, dtype);
      DT_RETURN_IF_ERROR(comm.AllToAll(Make(Values(rank, world * m, dtype), dtype), out));
      std::vector<double> expected;
      for (int j = 0; j < world; ++j) {
        for (double v : Values(j, m, dtype, rank * m)) expected.push_back(v);
      }
      ExpectValues(out, expected, dtype, what);
      return absl::OkStatus();
    }
    case Coll::kBroadcast: {
      const int root = world / 2;
      Tensor t = rank == root ? Make(Values(rank, m, dtype), dtype) : Sentinel(m, dtype);
      DT_RETURN_IF_ERROR(comm.Broadcast(t, root));
      ExpectValues(t, Values(root, m, dtype), dtype, what);
      return absl::OkStatus();
    }
    case Coll::kAllGatherV: {
      const std::vector<int64_t> counts = ChunkCounts(m, world);
      Tensor out = Sentinel(m, dtype);
      DT_RETURN_IF_ERROR(
          comm.AllGatherV(Make(Values(rank, counts[static_cast<size_t>(rank)], dtype), dtype), out, counts));
      std::vector<double> expected;
      for (int j = 0; j < world; ++j) {
        for (double v : Values(j, counts[static_cast<size_t>(j)], dtype)) expected.push_back(v);
      }
      ExpectValues(out, expected, dtype, what);
      return absl::OkStatus();
    }
    case Coll::kAllToAllV: {
      // Rank r sends (r + 2 j + m) % 4 elements to rank j (some zero).
      auto sends = [&](int r, int j) -> int64_t { return (r + 2 * j + m) % 4; };
      std::vector<int64_t> send(static_cast<size_t>(world)), recv(static_cast<size_t>(world));
      for (int j = 0; j < world; ++j) {
        send[static_cast<size_t>(j)] = sends(rank, j);
        recv[static_cast<size_t>(j)] = sends(j, rank);
      }
      Tensor out = Sentinel(Sum(recv, world), dtype);
      DT_RETURN_IF_ERROR(comm.AllToAllV(Make(Values(rank, Sum(send, world), dtype), dtype), out, send, recv));
      std::vector<double> expected;
      for (int j = 0; j < world; ++j) {
        int64_t from = 0;  // where rank j's block for this rank starts in rank j's input
        for (int k = 0; k < rank; ++k) from += sends(j, k);
        for (double v : Values(j, sends(j, rank), dtype, from)) expected.push_back(v);
      }
      ExpectValues(out, expected, dtype, what);
      return absl::OkStatus();
    }
    case Coll::kSendRecv: {
      if (world == 1) return absl::OkStatus();
      // A ring, two messages per pair (they must arrive in order), posted before waiting.
      const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
      Tensor a = Sentinel(m, dtype), b = Sentinel(m + 1, dtype);
      DT_ASSIGN_OR_RETURN(auto s1, comm.SendAsync(Make(Values(rank, m, dtype), dtype), next));
      DT_ASSIGN_OR_RETURN(auto s2, comm.SendAsync(Make(Values(rank, m + 1, dtype, 50), dtype), next));
      DT_ASSIGN_OR_RETURN(auto r1, comm.RecvAsync(a, prev));
      DT_RETURN_IF_ERROR(comm.Recv(b, prev));
      DT_RETURN_IF_ERROR(r1->Wait());
      DT_RETURN_IF_ERROR(s1->Wait());
      DT_RETURN_IF_ERROR(s2->Wait());
      ExpectValues(a, Values(prev, m, dtype), dtype, what + " first");
      ExpectValues(b, Values(prev, m + 1, dtype, 50), dtype, what + " second");
      return absl::OkStatus();
    }
    case Coll::kBatchSendRecv: {
      // Every rank sends to every rank, itself included, m + sender elements, in two batches
      // posted before either is waited for: the first lists its sends first, the second its
      // receives first (the order of a batch's ops must not matter). Messages of a pair must
      // match in posting order, across the batches too (the payloads differ by batch).
      std::vector<Tensor> first(static_cast<size_t>(world)), second(static_cast<size_t>(world));
      std::vector<PeerOp> ops1, ops2;
      for (int j = 0; j < world; ++j) {
        ops1.push_back(PeerOp::Send(Make(Values(rank, m + rank, dtype, 100 * j), dtype), j));
        ops2.push_back(PeerOp::Send(Make(Values(rank, m + rank, dtype, 100 * j + 1000), dtype), j));
      }
      for (int j = world - 1; j >= 0; --j) {
        const size_t uj = static_cast<size_t>(j);
        first[uj] = Sentinel(m + j, dtype);
        second[uj] = Sentinel(m + j, dtype);
        ops1.push_back(PeerOp::Recv(first[uj], j));
        ops2.insert(ops2.begin(), PeerOp::Recv(second[uj], j));
      }
      DT_ASSIGN_OR_RETURN(auto w1, comm.BatchSendRecvAsync(ops1));
      DT_ASSIGN_OR_RETURN(auto w2, comm.BatchSendRecvAsync(ops2));
      DT_RETURN_IF_ERROR(w2->Wait());
      DT_RETURN_IF_ERROR(w1->Wait());
      EXPECT_TRUE(w1->IsCompleted() && w2->IsCompleted());
      for (int j = 0; j < world; ++j) {
        const size_t uj = static_cast<size_t>(j);
        ExpectValues(first[uj], Values(j, m + j, dtype, 100 * rank), dtype, absl::StrCat(what, " first from ", j));
        ExpectValues(second[uj], Values(j, m + j, dtype, 100 * rank + 1000), dtype,
                     absl::StrCat(what, " second from ", j));
      }
      return absl::OkStatus();
    }
    default:
      return absl::InternalError("not a moving collective");
  }
}

TEST_P(ThreadsSweepTest, MatchesReference) {
  // (No structured bindings: clang 14 cannot capture them in the lambda.)
  const Coll coll = std::get<0>(GetParam());
  const DType dtype = std::get<1>(GetParam());
  const int world = std::get<2>(GetParam());
  const std::vector<absl::Status> statuses = RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
    for (int64_t m : kSizes) {
      if (!Reduces(coll)) {
        DT_RETURN_IF_ERROR(RunMoving(coll, dtype, m, rank, *comm));
        continue;
      }
      for (CommReduceOp op : kOps) {
        const absl::Status s = RunReducing(coll, op, dtype, m, rank, *comm);
        if (IsFloat8(dtype)) {  // storage-only: moving works, reducing does not
          EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
        } else if (dtype == DType::kBool && op == CommReduceOp::kAvg) {
          EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
        } else {
          DT_RETURN_IF_ERROR(s);
        }
      }
    }
    return comm->Barrier();
  });
  ExpectAllOk(statuses);
}

INSTANTIATE_TEST_SUITE_P(
    All, ThreadsSweepTest,
    ::testing::Combine(::testing::Values(Coll::kAllReduce, Coll::kAllReduceInPlace, Coll::kReduceScatter,
                                         Coll::kAllGather, Coll::kAllToAll, Coll::kBroadcast, Coll::kAllGatherV,
                                         Coll::kReduceScatterV, Coll::kAllToAllV, Coll::kSendRecv,
                                         Coll::kBatchSendRecv),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt32,
                                         DType::kInt64, DType::kBool, DType::kFloat8E4M3, DType::kFloat8E5M2),
                       ::testing::Values(1, 2, 3, 4, 8)),
    [](const ::testing::TestParamInfo<SweepParam>& info) {
      return absl::StrCat(CollName(std::get<0>(info.param)), "_", DTypeName(std::get<1>(info.param)), "_",
                          std::get<2>(info.param));
    });

// ---- Specific behaviours ----

TEST(ThreadsTest, MakeThreadGroupRejectsEmptyGroup) {
  EXPECT_EQ(MakeThreadGroup(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ThreadsTest, Properties) {
  auto comms = testing::Unwrap(MakeThreadGroup(3, absl::Seconds(7)));
  ASSERT_EQ(comms.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(comms[static_cast<size_t>(r)]->rank(), r);
    EXPECT_EQ(comms[static_cast<size_t>(r)]->size(), 3);
    EXPECT_EQ(comms[static_cast<size_t>(r)]->device(), Device::Cpu());
    EXPECT_STREQ(comms[static_cast<size_t>(r)]->backend(), "threads");
    EXPECT_EQ(comms[static_cast<size_t>(r)]->timeout(), absl::Seconds(7));
  }
  comms[0]->SetTimeout(absl::Seconds(2));
  EXPECT_EQ(comms[0]->timeout(), absl::Seconds(2));
}

TEST(ThreadsTest, NanPropagatesThroughMaxAndMin) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    ExpectAllOk(RunRanks(3, [&](int rank, CommPtr& comm) -> absl::Status {
      // Element 0 is NaN on rank 1 only; element 1 is NaN on rank 0 only.
      std::vector<double> v = {1.0 + rank, 2.0 - rank, 5.0};
      if (rank == 1) v[0] = std::nan("");
      if (rank == 0) v[1] = std::nan("");
      for (CommReduceOp op : {CommReduceOp::kMax, CommReduceOp::kMin}) {
        Tensor out = Sentinel(3, dtype);
        DT_RETURN_IF_ERROR(comm->AllReduce(Make(v, dtype), out, op));
        const std::vector<double> got = testing::Values(out);
        EXPECT_TRUE(std::isnan(got[0])) << DTypeName(dtype);
        EXPECT_TRUE(std::isnan(got[1])) << DTypeName(dtype);
        EXPECT_EQ(got[2], 5.0);
      }
      return absl::OkStatus();
    }));
  }
}

// Blocks of several AllReduce chunks (256 KiB), uneven over 3 ranks, out of place and in place:
// every element of every rank's output is the sum of the ranks' values (small integers, so
// float32 sums are exact), checked against a sum computed here.
TEST(ThreadsTest, LargeAllReduceReachesEveryElementOfEveryRank) {
  // 4 MiB of float32; 4 ranks' 16 MiB of inputs take the streaming stores, at blocks that start
  // and end off 16-byte alignment.
  const int64_t n = (int64_t{1} << 20) + 7;
  for (int world : {2, 3, 4}) {
    ExpectAllOk(RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
      auto value = [](int r, int64_t i) { return static_cast<float>((i * 7 + r * 13) % 101); };
      DT_ASSIGN_OR_RETURN(Tensor in, Tensor::Empty({n}, DType::kFloat32));
      for (int64_t i = 0; i < n; ++i) in.data<float>()[i] = value(rank, i);
      DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({n}, DType::kFloat32));
      DT_RETURN_IF_ERROR(comm->AllReduce(in, out, CommReduceOp::kSum));
      DT_RETURN_IF_ERROR(comm->AllReduce(in, in, CommReduceOp::kSum));
      int64_t wrong = 0, first = -1;
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int r = 0; r < world; ++r) want += value(r, i);
        if (out.data<float>()[i] != want || in.data<float>()[i] != want) {
          if (first < 0) first = i;
          ++wrong;
        }
      }
      EXPECT_EQ(wrong, 0) << world << " ranks, rank " << rank << ": first wrong element " << first;
      return absl::OkStatus();
    }));
  }
}

// Broadcasts of 64 KiB and more are copied by every rank, a block of the bytes each (blocks
// that split elements over 3 ranks): every receiver gets every element, from every root.
TEST(ThreadsTest, LargeBroadcastReachesEveryElementFromEveryRoot) {
  for (int world : {2, 3, 4}) {
    for (int64_t n : {int64_t{16384}, int64_t{300001}}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        for (int root = 0; root < world; ++root) {
          ExpectAllOk(RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
            auto value = [&](int64_t i) { return static_cast<double>((i * 7 + root * 13) % 101); };
            std::vector<double> want(static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] = value(i);
            Tensor t = rank == root ? Make(want, dtype) : Sentinel(n, dtype);
            DT_RETURN_IF_ERROR(comm->Broadcast(t, root));
            const std::vector<double> got = testing::Values(t);
            int64_t wrong = 0, first = -1;
            for (int64_t i = 0; i < n; ++i) {
              if (got[static_cast<size_t>(i)] != want[static_cast<size_t>(i)]) {
                if (first < 0) first = i;
                ++wrong;
              }
            }
            EXPECT_EQ(wrong, 0) << world << " ranks, root " << root << ", rank " << rank << ", " << n << " "
                                << DTypeName(dtype) << ": first wrong element " << first;
            return absl::OkStatus();
          }));
        }
      }
    }
  }
}

// ---- The one-barrier (mailbox) paths, on both sides of their cut-offs ----

// The largest inputs (bytes) that go through the mailboxes, as threads_communicator.cc's
// constants, where each rank has a CPU of its own and where ranks share CPUs: AllReduce 512 B,
// 4 KiB; ReduceScatter(V) 2, 16 KiB; AllGather(V) 1, 4 KiB (its input; V: its largest block);
// AllToAll 2, 4 KiB; Broadcast 4, 16 KiB (below them a Broadcast's root does not wait).
constexpr int64_t kReduceCutOffs[] = {512, 2048, 4096, 16384};
constexpr int64_t kGatherCutOffs[] = {1024, 4096};
constexpr int64_t kAllToAllCutOffs[] = {2048, 4096};
constexpr int64_t kBroadcastCutOffs[] = {4096, 16384};

// Counts of `unit`-byte units just below, at (or just below) and just above `cutoff` bytes.
std::vector<int64_t> Around(int64_t cutoff, int64_t unit) {
  const int64_t m = cutoff / unit;
  return {m - 1, m, m + 1};
}

// Element i of rank r's data in call `call`: an integer that `dtype` holds exactly, hashed from
// (call, rank, i), so a block from the wrong rank, place or call shows in most of its elements
// (float32, int32 and int64 take 2^20 values; narrower dtypes fewer).
double Hashed(int call, int rank, int64_t i, DType dtype) {
  uint64_t h = (static_cast<uint64_t>(call) * 8 + static_cast<uint64_t>(rank)) << 32 | static_cast<uint64_t>(i);
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  int bits = 20;
  if (dtype == DType::kBFloat16) bits = 8;
  if (dtype == DType::kFloat16) bits = 11;
  if (dtype == DType::kFloat8E4M3) bits = 4;
  if (dtype == DType::kFloat8E5M2) bits = 3;
  if (dtype == DType::kBool) bits = 1;
  return static_cast<double>(h & ((uint64_t{1} << bits) - 1));
}

std::vector<double> HashedValues(int call, int rank, int64_t n, DType dtype, int64_t from = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = Hashed(call, rank, from + i, dtype);
  return v;
}

// EXPECTs that t holds exactly `want` (moved bytes are not rounded), naming the first miss.
void ExpectExactly(const Tensor& t, const std::vector<double>& want, const std::string& what) {
  const std::vector<double> got = testing::Values(t);
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t wrong = 0;
  std::string first;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    if (wrong++ == 0) first = absl::StrCat("element ", i, " is ", got[i], ", want ", want[i]);
  }
  EXPECT_EQ(wrong, 0) << what << ": " << wrong << " of " << got.size() << " elements wrong, first " << first;
}

// One data-moving collective on data of call `call` only, checked against blocks built here.
// m: AllGather its input elements; AllGatherV its largest block (on rank `root`; the other
// blocks smaller, every second one empty); AllToAll elements per block; Broadcast elements
// (from `root`).
absl::Status MoveAndCheck(Coll coll, DType dtype, int64_t m, int root, int call, int rank, Communicator& comm) {
  const int world = comm.size();
  const std::string what = absl::StrCat(CollName(coll), " ", DTypeName(dtype), " m=", m, " root ", root, " call ", call,
                                        ", ", world, " ranks, rank ", rank);
  std::vector<double> want;
  Tensor out;
  switch (coll) {
    case Coll::kAllGather:
      out = Sentinel(world * m, dtype);
      DT_RETURN_IF_ERROR(comm.AllGather(Make(HashedValues(call, rank, m, dtype), dtype), out));
      for (int j = 0; j < world; ++j) {
        for (double v : HashedValues(call, j, m, dtype)) want.push_back(v);
      }
      break;
    case Coll::kAllGatherV: {
      std::vector<int64_t> counts(static_cast<size_t>(world));
      for (int j = 0; j < world; ++j) counts[static_cast<size_t>(j)] = j == root ? m : j % 2 == 0 ? 0 : m / 2 + j;
      out = Sentinel(Sum(counts, world), dtype);
      const int64_t mine = counts[static_cast<size_t>(rank)];
      DT_RETURN_IF_ERROR(comm.AllGatherV(Make(HashedValues(call, rank, mine, dtype), dtype), out, counts));
      for (int j = 0; j < world; ++j) {
        for (double v : HashedValues(call, j, counts[static_cast<size_t>(j)], dtype)) want.push_back(v);
      }
      break;
    }
    case Coll::kAllToAll:
      out = Sentinel(world * m, dtype);
      DT_RETURN_IF_ERROR(comm.AllToAll(Make(HashedValues(call, rank, world * m, dtype), dtype), out));
      for (int j = 0; j < world; ++j) {
        for (double v : HashedValues(call, j, m, dtype, rank * m)) want.push_back(v);
      }
      break;
    case Coll::kBroadcast:
      out = rank == root ? Make(HashedValues(call, root, m, dtype), dtype) : Sentinel(m, dtype);
      DT_RETURN_IF_ERROR(comm.Broadcast(out, root));
      want = HashedValues(call, root, m, dtype);
      break;
    default:
      return absl::InternalError("not a moving collective");
  }
  ExpectExactly(out, want, what);
  return absl::OkStatus();
}

// Every collective one element (AllToAll / ReduceScatter: one per block) below, at and above
// each cut-off, Broadcast and AllGatherV from every root, in every dtype on 2, 3 and 4 ranks:
// both paths of each, against references computed here.
using CutOffParam = std::tuple<DType, int>;
class ThreadsCutOffTest : public ::testing::TestWithParam<CutOffParam> {};

TEST_P(ThreadsCutOffTest, BothSidesOfEveryCutOff) {
  const DType dtype = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  const int64_t es = static_cast<int64_t>(ElementSize(dtype));
  ExpectAllOk(RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
    int call = 0;
    for (int64_t cutoff : kAllToAllCutOffs) {
      for (int64_t m : Around(cutoff, world * es)) {
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllToAll, dtype, m, 0, ++call, rank, *comm));
      }
    }
    for (int64_t cutoff : kGatherCutOffs) {
      for (int64_t m : Around(cutoff, es)) {
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllGather, dtype, m, 0, ++call, rank, *comm));
        for (int root = 0; root < world; ++root) {
          DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllGatherV, dtype, m, root, ++call, rank, *comm));
        }
      }
    }
    for (int64_t cutoff : kBroadcastCutOffs) {
      for (int64_t m : Around(cutoff, es)) {
        for (int root = 0; root < world; ++root) {
          DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kBroadcast, dtype, m, root, ++call, rank, *comm));
        }
      }
    }
    if (IsFloat8(dtype)) return comm->Barrier();  // moved, never reduced
    for (int64_t cutoff : kReduceCutOffs) {
      for (int64_t m : Around(cutoff, es)) {
        DT_RETURN_IF_ERROR(RunReducing(Coll::kAllReduce, CommReduceOp::kSum, dtype, m, rank, *comm));
        DT_RETURN_IF_ERROR(RunReducing(Coll::kAllReduceInPlace, CommReduceOp::kMax, dtype, m, rank, *comm));
        DT_RETURN_IF_ERROR(RunReducing(Coll::kReduceScatterV, CommReduceOp::kSum, dtype, m, rank, *comm));
      }
      for (int64_t m : Around(cutoff, world * es)) {
        DT_RETURN_IF_ERROR(RunReducing(Coll::kReduceScatter, CommReduceOp::kSum, dtype, m, rank, *comm));
      }
    }
    return comm->Barrier();
  }));
}

INSTANTIATE_TEST_SUITE_P(CutOffs, ThreadsCutOffTest,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                                              DType::kInt32, DType::kInt64, DType::kBool,
                                                              DType::kFloat8E4M3, DType::kFloat8E5M2),
                                            ::testing::Values(2, 3, 4)),
                         [](const ::testing::TestParamInfo<CutOffParam>& info) {
                           return absl::StrCat(DTypeName(std::get<0>(info.param)), "_", std::get<1>(info.param));
                         });

// Back-to-back calls of mixed kinds through both paths, each on data of its own, sizes and roots
// changing every round, a rank (another each round) yielding its CPU before some: a rank that
// returns from a one-barrier call goes on into the next while its peers still read its mailbox.
// Were a mailbox rewritten before every peer had read it, a peer would copy the next call's data
// (float32: differs in nearly every element) and TSan would see the unordered write and read.
TEST(ThreadsTest, MixedBackToBackCallsKeepEachMailboxUntilItIsRead) {
  const DType f32 = DType::kFloat32;
  for (int world : {2, 3, 4}) {
    ExpectAllOk(RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
      int call = 0;
      for (int it = 0; it < 150; ++it) {
        const int64_t m = 1 + (it * 397) % 1024;  // elements: one barrier for most of the moves
        const int root = it % world;
        if (it % world == rank) std::this_thread::yield();
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllGather, f32, m, 0, ++call, rank, *comm));
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kBroadcast, f32, 2 * m, root, ++call, rank, *comm));
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllToAll, f32, m / world + 1, 0, ++call, rank, *comm));
        DT_RETURN_IF_ERROR(RunReducing(Coll::kAllReduce, CommReduceOp::kSum, f32, m % 1024, rank, *comm));
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllGatherV, f32, m, root, ++call, rank, *comm));
        DT_RETURN_IF_ERROR(RunReducing(Coll::kReduceScatter, CommReduceOp::kSum, f32, m % 1024, rank, *comm));
        if (it % 3 == 0) {  // two barriers
          DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllGather, f32, 1100 + it, 0, ++call, rank, *comm));
          DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kBroadcast, f32, 4100 + it, root, ++call, rank, *comm));
        }
        if (it % 7 == 0) DT_RETURN_IF_ERROR(comm->Barrier());
      }
      return absl::OkStatus();
    }));
  }
}

// A collective whose ranks pass sizes on either side of a cut-off (one barrier on some ranks,
// two on others) fails on every rank after the first, and the group goes on in step.
TEST(ThreadsTest, CallsOnBothSidesOfACutOffFailTogether) {
  const DType f32 = DType::kFloat32;
  ExpectAllOk(RunRanks(3, [&](int rank, CommPtr& comm) -> absl::Status {
    for (int64_t cutoff : kGatherCutOffs) {
      const int64_t n = cutoff / 4 + (rank == 1 ? 1 : 0);
      const absl::Status gather = comm->AllGather(Sentinel(n, f32), Sentinel(3 * n, f32));
      EXPECT_EQ(gather.code(), absl::StatusCode::kInvalidArgument) << gather;
    }
    for (int call = 1; call <= 4; ++call) {
      DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllGather, f32, call * 700, 0, call, rank, *comm));
    }
    return comm->Barrier();
  }));
  // A small Broadcast's root returns without meeting the group (RunEagerBroadcast): the rank
  // past the cut-off (which meets the group) finds the others' calls are not its own and fails
  // the group, so every rank fails in that call or its next, naming the mismatch. With
  // DTENSOR_DEBUG=1 every rank fails in the call itself.
  for (const bool debug : {false, true}) {
    for (int64_t cutoff : kBroadcastCutOffs) {
      if (debug) setenv("DTENSOR_DEBUG", "1", 1);
      auto comms = testing::Unwrap(MakeThreadGroup(3, absl::Seconds(20)));
      unsetenv("DTENSOR_DEBUG");
      std::vector<absl::Status> broadcasts(3);
      const auto nexts = RunOn(comms, [&](int rank, CommPtr& comm) -> absl::Status {
        Tensor t = Sentinel(cutoff / 4 + (rank == 2 ? 1 : 0), f32);
        broadcasts[static_cast<size_t>(rank)] = comm->Broadcast(t, 0);
        return comm->Barrier();
      });
      for (size_t r = 0; r < 3; ++r) {
        const std::string where = absl::StrCat("cut-off ", cutoff, debug ? ", debug" : "", ", rank ", r);
        const absl::Status& first = broadcasts[r].ok() ? nexts[r] : broadcasts[r];
        EXPECT_EQ(first.code(), absl::StatusCode::kInvalidArgument) << where << ": " << first;
        if (r == 2 || debug) {
          EXPECT_FALSE(broadcasts[r].ok()) << where;
        }
        EXPECT_THAT(std::string(first.message()),
                    AllOf(HasSubstr("[Debug] rank "), HasSubstr(absl::StrCat("rank 2 called Broadcast(float32, ",
                                                                             cutoff / 4 + 1, " elements, root 0)"))))
            << where;
      }
    }
  }
}

TEST(ThreadsTest, IntegerAvgTruncatesTowardZero) {
  ExpectAllOk(RunRanks(4, [](int rank, CommPtr& comm) -> absl::Status {
    // Sums 7 and -7 over 4 ranks: 1 and -1 (not 2 and -2).
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<int32_t>({rank == 0 ? 4 : 1, rank == 0 ? -4 : -1}, {2}));
    DT_RETURN_IF_ERROR(comm->AllReduce(t, t, CommReduceOp::kAvg));
    EXPECT_EQ(t.data<int32_t>()[0], 1);
    EXPECT_EQ(t.data<int32_t>()[1], -1);
    return absl::OkStatus();
  }));
  // The sum wraps in the element type before the division, as on ucx and NCCL: 2 x 2e9 wraps
  // to -294967296 in int32, whose half is -147483648 (not 2e9).
  ExpectAllOk(RunRanks(2, [](int, CommPtr& comm) -> absl::Status {
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<int32_t>({2000000000, 7}, {2}));
    DT_RETURN_IF_ERROR(comm->AllReduce(t, t, CommReduceOp::kAvg));
    EXPECT_EQ(t.data<int32_t>()[0], -147483648);
    EXPECT_EQ(t.data<int32_t>()[1], 7);
    return absl::OkStatus();
  }));
}

// In place and overlapping, small (one barrier) and large (two: the overlaps are staged), on 2
// ranks (a CPU each here: the own-CPU cut-offs) and 3, 4 (sharing CPUs). A rank's own block of
// AllGather / AllToAll is copied while it waits at the first barrier (from its input, which in
// one barrier may overlap its output): each overlap below must come out exact.
TEST(ThreadsTest, InPlaceGatherScatterAndOverlappingAllToAll) {
  const DType dtype = DType::kFloat32;
  for (const int world : {2, 3, 4}) {
    for (const int64_t n : {int64_t{5}, int64_t{300}, int64_t{5000}}) {
      ExpectAllOk(RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
        const std::string size = absl::StrCat(", ", n, " elements per block");
        // AllGather whose input is this rank's block of the output.
        Tensor full = Sentinel(world * n, dtype);
        DT_ASSIGN_OR_RETURN(Tensor mine, full.Narrow(0, rank * n, n));
        Tensor src = Make(Values(rank, n, dtype), dtype);
        std::memcpy(mine.raw_data(), src.raw_data(), src.nbytes());
        DT_RETURN_IF_ERROR(comm->AllGather(mine, full));
        std::vector<double> expected;
        for (int j = 0; j < world; ++j) {
          for (double v : Values(j, n, dtype)) expected.push_back(v);
        }
        ExpectValues(full, expected, dtype, "in-place all_gather" + size);

        // AllGather whose input is the next rank's block of the output (overwritten by the call).
        Tensor other = Sentinel(world * n, dtype);
        DT_ASSIGN_OR_RETURN(Tensor next, other.Narrow(0, (rank + 1) % world * n, n));
        std::memcpy(next.raw_data(), src.raw_data(), src.nbytes());
        DT_RETURN_IF_ERROR(comm->AllGather(next, other));
        ExpectValues(other, expected, dtype, "overlapping all_gather" + size);

        // ReduceScatter whose output is this rank's block of the input.
        Tensor in = Make(Values(rank, world * n, dtype), dtype);
        DT_ASSIGN_OR_RETURN(Tensor block, in.Narrow(0, rank * n, n));
        DT_RETURN_IF_ERROR(comm->ReduceScatter(in, block, CommReduceOp::kSum));
        ExpectValues(block, ReducedValues(CommReduceOp::kSum, world, n, dtype, rank * n), dtype, "in-place rs" + size);

        // AllToAll in place (input == output) and AllReduce into a shifted overlapping view.
        Tensor a2a = Make(Values(rank, world * n, dtype), dtype);
        DT_RETURN_IF_ERROR(comm->AllToAll(a2a, a2a));
        std::vector<double> a2a_expected;
        for (int j = 0; j < world; ++j) {
          for (double v : Values(j, n, dtype, rank * n)) a2a_expected.push_back(v);
        }
        ExpectValues(a2a, a2a_expected, dtype, "in-place all_to_all" + size);

        Tensor buf = Make(Values(rank, n + 1, dtype), dtype);
        DT_ASSIGN_OR_RETURN(Tensor lo, buf.Narrow(0, 0, n));
        DT_ASSIGN_OR_RETURN(Tensor hi, buf.Narrow(0, 1, n));
        DT_RETURN_IF_ERROR(comm->AllReduce(lo, hi, CommReduceOp::kSum));
        ExpectValues(hi, ReducedValues(CommReduceOp::kSum, world, n, dtype, 0), dtype, "overlapping all_reduce" + size);

        // AllToAll whose output starts one block into its input (each block read by its peer
        // overlaps another block written here).
        Tensor wide = Make(Values(rank, (world + 1) * n, dtype), dtype);
        DT_ASSIGN_OR_RETURN(Tensor a2a_in, wide.Narrow(0, 0, world * n));
        DT_ASSIGN_OR_RETURN(Tensor a2a_out, wide.Narrow(0, n, world * n));
        DT_RETURN_IF_ERROR(comm->AllToAll(a2a_in, a2a_out));
        ExpectValues(a2a_out, a2a_expected, dtype, "shifted all_to_all" + size);
        return absl::OkStatus();
      }));
    }
  }
}

TEST(ThreadsTest, TwoDimensionalTensorsUseFlatOrder) {
  ExpectAllOk(RunRanks(2, [](int rank, CommPtr& comm) -> absl::Status {
    DT_ASSIGN_OR_RETURN(Tensor in, Tensor::FromVector<float>({1.f + rank, 2.f, 3.f, 4.f, 5.f, 6.f * rank}, {2, 3}));
    DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({4, 3}, DType::kFloat32));
    DT_RETURN_IF_ERROR(comm->AllGather(in, out));
    const std::vector<double> expected = {1, 2, 3, 4, 5, 0, 2, 2, 3, 4, 5, 6};
    EXPECT_EQ(testing::Values(out), expected);
    return absl::OkStatus();
  }));
}

TEST(ThreadsTest, SplitGridByRowsAndColumns) {
  // 8 ranks as a 2 x 4 grid: rank = 4 * row + col.
  ExpectAllOk(RunRanks(8, [](int rank, CommPtr& comm) -> absl::Status {
    const int row = rank / 4, col = rank % 4;
    DT_ASSIGN_OR_RETURN(CommPtr rows, comm->Split(row, col));
    DT_ASSIGN_OR_RETURN(CommPtr cols, comm->Split(col, row));
    DT_ASSIGN_OR_RETURN(CommPtr reversed, comm->Split(0, -rank));  // one group, ranks reversed
    DT_ASSIGN_OR_RETURN(CommPtr none, comm->Split(rank % 2 == 0 ? -1 : 5, 0));
    EXPECT_EQ(rows->size(), 4);
    EXPECT_EQ(rows->rank(), col);
    EXPECT_EQ(cols->size(), 2);
    EXPECT_EQ(cols->rank(), row);
    EXPECT_EQ(reversed->rank(), 7 - rank);
    if (rank % 2 == 0) {
      EXPECT_EQ(none, nullptr);
    } else {
      EXPECT_EQ(none->size(), 4);
      EXPECT_EQ(none->rank(), rank / 2);
    }
    // Row sums then column sums of the rank ids: every rank ends with the total 28.
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<int64_t>({rank, 1}, {2}));
    DT_RETURN_IF_ERROR(rows->AllReduce(t, t, CommReduceOp::kSum));
    EXPECT_EQ(t.data<int64_t>()[0], 4 * row * 4 + 6);
    EXPECT_EQ(t.data<int64_t>()[1], 4);
    DT_RETURN_IF_ERROR(cols->AllReduce(t, t, CommReduceOp::kSum));
    EXPECT_EQ(t.data<int64_t>()[0], 28);
    EXPECT_EQ(t.data<int64_t>()[1], 8);
    // A gather over the columns' groups, and a sub-group of a sub-group.
    DT_ASSIGN_OR_RETURN(Tensor g, Tensor::Empty({2}, DType::kInt32));
    DT_ASSIGN_OR_RETURN(Tensor mine, Tensor::FromVector<int32_t>({rank}, {1}));
    DT_RETURN_IF_ERROR(cols->AllGather(mine, g));
    EXPECT_EQ(g.data<int32_t>()[0], col);
    EXPECT_EQ(g.data<int32_t>()[1], 4 + col);
    DT_ASSIGN_OR_RETURN(CommPtr pairs, rows->Split(col / 2, 0));
    EXPECT_EQ(pairs->size(), 2);
    DT_ASSIGN_OR_RETURN(Tensor p, Tensor::FromVector<int32_t>({rank}, {1}));
    DT_RETURN_IF_ERROR(pairs->AllReduce(p, p, CommReduceOp::kMax));
    EXPECT_EQ(p.data<int32_t>()[0], rank | 1);
    if (none) DT_RETURN_IF_ERROR(none->Barrier());
    return comm->Barrier();
  }));
}

TEST(ThreadsTest, ManyBackToBackCollectives) {
  // Slot reuse across consecutive collectives of different kinds.
  ExpectAllOk(RunRanks(4, [](int rank, CommPtr& comm) -> absl::Status {
    for (int it = 0; it < 200; ++it) {
      DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<int64_t>({rank + it, 1, 2}, {3}));
      DT_RETURN_IF_ERROR(comm->AllReduce(t, t, CommReduceOp::kSum));
      EXPECT_EQ(t.data<int64_t>()[0], 6 + 4 * it);
      DT_ASSIGN_OR_RETURN(Tensor g, Tensor::Empty({4}, DType::kInt64));
      DT_ASSIGN_OR_RETURN(Tensor one, Tensor::FromVector<int64_t>({rank * it}, {1}));
      DT_RETURN_IF_ERROR(comm->AllGather(one, g));
      for (int j = 0; j < 4; ++j) EXPECT_EQ(g.data<int64_t>()[j], j * it);
      if (it % 10 == 0) DT_RETURN_IF_ERROR(comm->Barrier());
    }
    return absl::OkStatus();
  }));
}

TEST(ThreadsTest, AsyncFormsCompleteAndSendWaitsForItsReceiver) {
  ExpectAllOk(RunRanks(2, [](int rank, CommPtr& comm) -> absl::Status {
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<float>({1.f + rank}, {1}));
    DT_ASSIGN_OR_RETURN(auto work, comm->AllReduceAsync(t, t, CommReduceOp::kSum));
    DT_RETURN_IF_ERROR(work->Wait());
    EXPECT_TRUE(work->IsCompleted());
    EXPECT_EQ(t.data<float>()[0], 3.f);
    DT_ASSIGN_OR_RETURN(Tensor msg, Tensor::FromVector<float>({42.f}, {1}));
    if (rank == 0) {
      DT_ASSIGN_OR_RETURN(auto send, comm->SendAsync(msg, 1));
      EXPECT_FALSE(send->IsCompleted());  // rank 1 only posts its Recv after the barrier
      DT_RETURN_IF_ERROR(comm->Barrier());
      DT_RETURN_IF_ERROR(send->Wait());
      EXPECT_TRUE(send->IsCompleted());
    } else {
      DT_RETURN_IF_ERROR(comm->Barrier());
      DT_ASSIGN_OR_RETURN(Tensor got, Tensor::Empty({1}, DType::kFloat32));
      DT_RETURN_IF_ERROR(comm->Recv(got, 0));
      EXPECT_EQ(got.data<float>()[0], 42.f);
    }
    return absl::OkStatus();
  }));
}

TEST(ThreadsTest, SendRecvMismatchFailsBothSides) {
  const auto statuses = RunRanks(2, [](int rank, CommPtr& comm) -> absl::Status {
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty({rank == 0 ? 3 : 4}, DType::kFloat32));
    return rank == 0 ? comm->Send(t, 1) : comm->Recv(t, 0);
  });
  ASSERT_EQ(statuses.size(), 2u);
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(statuses[0].message()), StartsWith("[Send] rank 0 sent 3 float32 elements to rank 1"));
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(statuses[1].message()), HasSubstr("expected 4 float32"));
}

// BatchSendRecv checks every op before posting any, and names the offending one.
TEST(ThreadsTest, BatchSendRecvRejectsBadOpsBeforePostingAny) {
  const auto statuses = RunRanks(
      2,
      [](int rank, CommPtr& comm) -> absl::Status {
        DT_ASSIGN_OR_RETURN(Tensor a, Tensor::Empty({3}, DType::kFloat32));
        DT_ASSIGN_OR_RETURN(Tensor b, Tensor::Empty({4}, DType::kFloat32));
        DT_ASSIGN_OR_RETURN(Tensor m, Tensor::Empty({2, 3}, DType::kFloat32));
        DT_ASSIGN_OR_RETURN(Tensor strided, m.Transpose(0, 1));
        const int other = 1 - rank;
        struct Case {
          std::vector<PeerOp> ops;
          std::string message;
        };
        const std::vector<Case> cases = {
            {{PeerOp::Recv(a, other), PeerOp::Send(a, 2)}, "ops[1] send peer 2 is out of range for a group of size 2"},
            {{PeerOp::Send(a, other), PeerOp::Recv(strided, other)},
             "ops[1] (recv from " + std::to_string(other) + ") is not contiguous"},
            {{PeerOp::Send(a, rank)}, "1 send(s) to this rank but 0 receive(s) from it"},
            {{PeerOp::Send(a, rank), PeerOp::Recv(b, rank)},
             "send to itself ops[0] has 3 float32 elements but its "
             "receive ops[1] has 4 float32"},
            {{PeerOp::Send(a, other), PeerOp::Recv(Tensor(), other)}, "is undefined"},
        };
        for (const Case& c : cases) {
          const absl::Status s = comm->BatchSendRecv(c.ops);
          EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
          EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
          EXPECT_THAT(std::string(s.message()), StartsWith("[BatchSendRecv] rank " + std::to_string(rank)));
        }
        // Nothing was posted: a plain exchange now matches its own messages, not a rejected batch's.
        DT_ASSIGN_OR_RETURN(Tensor mine, Tensor::FromVector<float>({1.f + rank, 2.f, 3.f}, {3}));
        DT_RETURN_IF_ERROR(comm->BatchSendRecv({PeerOp::Send(mine, other), PeerOp::Recv(a, other)}));
        EXPECT_EQ(a.data<float>()[0], 1.f + other);
        return comm->BatchSendRecv({});
      },
      absl::Seconds(5));
  ExpectAllOk(statuses);
}

// A batch that fails part-way (its second op's peer has left) takes back the receive it had
// posted: the pair's next message goes to the next receive, not into the failed call's tensor.
TEST(ThreadsTest, BatchSendRecvFailingPartWayLeavesNothingPosted) {
  auto comms = testing::Unwrap(MakeThreadGroup(3, absl::Seconds(5)));
  std::atomic<bool> left{false}, batch_failed{false};
  const auto statuses = RunOn(comms, [&](int rank, CommPtr& comm) -> absl::Status {
    if (rank == 2) {
      comm.reset();  // leaves the group
      left = true;
      return absl::OkStatus();
    }
    DT_ASSIGN_OR_RETURN(Tensor stale, Tensor::FromVector<float>({-1.f, -1.f}, {2}));
    DT_ASSIGN_OR_RETURN(Tensor got, Tensor::FromVector<float>({-2.f, -2.f}, {2}));
    DT_ASSIGN_OR_RETURN(Tensor mine, Tensor::FromVector<float>({10.f + rank, 20.f + rank}, {2}));
    if (rank == 0) {
      while (!left) std::this_thread::yield();
      // The receive from rank 1 is posted, then the send to rank 2 fails.
      const absl::Status s = comm->BatchSendRecv({PeerOp::Recv(stale, 1), PeerOp::Send(mine, 2)});
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("rank 2"));
      batch_failed = true;
      DT_RETURN_IF_ERROR(comm->Recv(got, 1));
      EXPECT_EQ(got.data<float>()[0], 11.f);
      EXPECT_EQ(stale.data<float>()[0], -1.f);  // the failed batch's receive got nothing
      return absl::OkStatus();
    }
    while (!batch_failed) std::this_thread::yield();
    return comm->Send(mine, 0);
  });
  ExpectAllOk(statuses);
}

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

TEST(ThreadsTest, TimeoutNamesTheMissingRankAndLaterCallsFailFast) {
  auto comms = testing::Unwrap(MakeThreadGroup(4, absl::Milliseconds(200)));
  const auto start = Clock::now();
  std::vector<double> fail_fast_s(4, 0.0);
  const auto statuses = RunOn(comms, [&](int rank, CommPtr& comm) -> absl::Status {
    if (rank == 3) return absl::OkStatus();  // never calls
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<float>({1.f, 2.f}, {2}));
    absl::Status s = comm->AllReduce(t, t, CommReduceOp::kSum);
    const auto again = Clock::now();
    const absl::Status later = comm->Barrier();
    fail_fast_s[static_cast<size_t>(rank)] = SecondsSince(again);
    EXPECT_EQ(later.code(), absl::StatusCode::kDeadlineExceeded) << later;
    return s;
  });
  const double elapsed = SecondsSince(start);
  EXPECT_GE(elapsed, 0.15);
  EXPECT_LT(elapsed, 3.0);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[static_cast<size_t>(r)].code(), absl::StatusCode::kDeadlineExceeded) << statuses[r];
    EXPECT_THAT(std::string(statuses[static_cast<size_t>(r)].message()), StartsWith("[AllReduce] rank "));
    EXPECT_THAT(std::string(statuses[static_cast<size_t>(r)].message()), HasSubstr("waiting for rank(s) "));
    EXPECT_THAT(std::string(statuses[static_cast<size_t>(r)].message()), EndsWith("3"));
    EXPECT_LT(fail_fast_s[static_cast<size_t>(r)], 0.1);
  }
  // The rank that timed out first says so.
  bool someone_timed_out = false;
  for (int r = 0; r < 3; ++r) {
    someone_timed_out |= absl::StrContains(statuses[static_cast<size_t>(r)].message(), "timed out after 200ms");
  }
  EXPECT_TRUE(someone_timed_out) << statuses[0];
}

TEST(ThreadsTest, RecvTimeoutNamesThePeer) {
  auto comms = testing::Unwrap(MakeThreadGroup(2, absl::Milliseconds(100)));
  const auto statuses = RunOn(comms, [&](int rank, CommPtr& comm) -> absl::Status {
    if (rank == 0) return absl::OkStatus();
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty({3}, DType::kFloat32));
    return comm->Recv(t, 0);
  });
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(statuses[1].message(), "[Recv] rank 1 timed out after 100ms waiting for rank 0");
}

TEST(ThreadsTest, DepartedRankGivesUnavailable) {
  const auto start = Clock::now();
  const auto statuses = RunRanks(
      3,
      [](int rank, CommPtr& comm) -> absl::Status {
        if (rank == 2) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          comm.reset();  // leaves while the others wait
          return absl::OkStatus();
        }
        DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty({4}, DType::kFloat32));
        return comm->AllGather(t, Sentinel(12, DType::kFloat32));
      },
      absl::Seconds(20));
  EXPECT_LT(SecondsSince(start), 5.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(statuses[static_cast<size_t>(r)].code(), absl::StatusCode::kUnavailable) << statuses[r];
    EXPECT_THAT(std::string(statuses[static_cast<size_t>(r)].message()), HasSubstr("rank 2"));
  }
  // A Recv from a departed rank fails at once, too.
  auto comms = testing::Unwrap(MakeThreadGroup(2, absl::Seconds(20)));
  comms[1].reset();
  Tensor t = Sentinel(1, DType::kFloat32);
  EXPECT_EQ(comms[0]->Recv(t, 1).code(), absl::StatusCode::kUnavailable);
}

// A rank that leaves right after a one-barrier call (a small AllGather: after its barrier
// every rank reads the group's mailboxes only) does not fail a peer still asleep in that
// call's barrier: the peer may see the rank's departure and, read just before, not yet its
// arrival. The leaving rank comes last, about when the others go from yielding to sleeping,
// so its arrival and departure land on a sleeper's look at the group now and then. Before the
// fix 3 of 40000 4-rank rounds and 2 of 20000 6-rank rounds failed with "[AllGather] rank 1
// was waiting for rank 2, which has left the group"; this runs 6 ranks for 4 s, which caught
// it in 1 run of 6 without the fix (2 cores): it fails now and then, never wrongly.
TEST(ThreadsTest, ALastRankLeavingRightAfterAOneBarrierCallFailsNoPeer) {
  constexpr int kWorld = 6;
  const Clock::time_point start = Clock::now();
  int rounds = 0;
  for (; SecondsSince(start) < 4.0; ++rounds) {
    const int64_t delay_ns = 150'000 + (rounds % 64) * 2'500;  // the sleep starts at 200 us (kYieldNs)
    const auto statuses = RunRanks(kWorld, [&](int rank, CommPtr& comm) -> absl::Status {
      if (rank == kWorld - 1) {
        const Clock::time_point t0 = Clock::now();
        while (std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count() < delay_ns) {
        }
      }
      Tensor out = Sentinel(4 * kWorld, DType::kFloat32);
      const absl::Status s = comm->AllGather(Make(Values(rank, 4, DType::kFloat32), DType::kFloat32), out);
      comm.reset();  // leaves at once
      if (!s.ok()) return s;
      for (int j = 0; j < kWorld; ++j) {
        for (int64_t i = 0; i < 4; ++i) {
          if (out.data<float>()[j * 4 + i] != static_cast<float>(Value(j, i, DType::kFloat32))) {
            return absl::InternalError(absl::StrCat("element ", i, " of rank ", j, "'s block is wrong"));
          }
        }
      }
      return absl::OkStatus();
    });
    for (size_t r = 0; r < statuses.size(); ++r) {
      ASSERT_TRUE(statuses[r].ok()) << "round " << rounds << ", rank " << r << ": " << statuses[r];
    }
  }
  EXPECT_GT(rounds, 0);
}

// Ranks fail together: on a 2x2 grid (rows {0, 1}, {2, 3}; columns {0, 2}, {1, 3}) rank 0
// aborts the world while rank 1 waits in AllReduce on their row and ranks 2, 3 wait in
// AllGather on their columns (rank 3's column does not hold rank 0): all three return
// Aborted naming rank 0 and its reason at once, and every group refuses later calls.
// A rank late past the spinning and yielding phases of the wait (200 us) finds its peers
// asleep on the group's futex word; its arrival must wake them. A lost wake-up would leave
// them asleep until the timeout (DeadlineExceeded). Each round another rank is late, through
// the one-barrier path (small all_reduce), the two-barrier path (a larger one) and Barrier.
TEST(ThreadsTest, LateRanksWakeSleepingPeers) {
  constexpr int kWorld = 3, kRounds = 60;
  const auto start = Clock::now();
  ExpectAllOk(RunRanks(
      kWorld,
      [](int rank, CommPtr& comm) -> absl::Status {
        for (int it = 0; it < kRounds; ++it) {
          for (const int64_t n : {int64_t{4}, int64_t{64} << 10}) {
            if (it % kWorld == rank) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            DT_ASSIGN_OR_RETURN(Tensor t,
                                Tensor::FromVector<float>(
                                    std::vector<float>(static_cast<size_t>(n), static_cast<float>(rank + it)), {n}));
            DT_RETURN_IF_ERROR(comm->AllReduce(t, t, CommReduceOp::kSum));
            const float want = static_cast<float>(kWorld * it + kWorld * (kWorld - 1) / 2);
            if (t.data<float>()[0] != want || t.data<float>()[n - 1] != want) {
              return absl::InternalError(absl::StrCat("round ", it, ": sum ", t.data<float>()[0], ", want ", want));
            }
          }
          if (it % kWorld == (rank + 1) % kWorld) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          DT_RETURN_IF_ERROR(comm->Barrier());
        }
        return absl::OkStatus();
      },
      absl::Seconds(5)));
  // About 3 ms a round; a lost wake-up costs the 5 s timeout.
  EXPECT_LT(SecondsSince(start), 4.0);
}

// In AllReduce (and a large Broadcast) ranks write into their peers' outputs. A rank whose
// call fails (here: aborted from another group of the family mid-call, or a short timeout)
// must not return while a peer still writes there: the caller may free or reuse the buffer at
// once. Each failing rank fills its output with a sentinel right after the call returns; once
// every rank is done, the sentinel must be whole. (Before, up to the whole 8 MiB changed in
// about 1 of 5 failed calls.)
TEST(ThreadsTest, NoPeerWritesIntoAFailedCallsOutputAfterItReturns) {
  constexpr int64_t kElems = int64_t{4} << 20;
  int failed = 0, written_after = 0;
  auto check = [&](const std::vector<Tensor>& outs, const std::vector<int>& errored, const std::string& what) {
    for (size_t r = 0; r < outs.size(); ++r) {
      if (!errored[r]) continue;
      ++failed;
      const auto* p = static_cast<const unsigned char*>(outs[r].raw_data());
      const int64_t changed = std::count_if(p, p + outs[r].nbytes(), [](unsigned char b) { return b != 0xAB; });
      if (changed > 0) ++written_after;
      EXPECT_EQ(changed, 0) << what << ": rank " << r << "'s output changed after its call returned";
    }
  };
  for (int round = 0; round < 20; ++round) {
    // An abort through rank 3's row group while the column groups all-reduce.
    std::vector<Tensor> outs(4);
    std::vector<int> errored(4, 0);
    RunRanks(4, [&](int rank, CommPtr& comm) -> absl::Status {
      DT_ASSIGN_OR_RETURN(CommPtr row, comm->Split(rank / 2, rank));
      DT_ASSIGN_OR_RETURN(CommPtr col, comm->Split(rank % 2, rank));
      DT_ASSIGN_OR_RETURN(Tensor in, Full({kElems}, 1.0, DType::kFloat32));
      DT_ASSIGN_OR_RETURN(outs[static_cast<size_t>(rank)], Tensor::Empty({kElems}, DType::kFloat32));
      std::thread aborter;
      if (rank == 3) {
        aborter = std::thread([&, round] {
          std::this_thread::sleep_for(std::chrono::microseconds(300 * round));
          row->Abort(absl::InternalError("test: row thread gives up"));
        });
      }
      const absl::Status s = col->AllReduce(in, outs[static_cast<size_t>(rank)], CommReduceOp::kSum);
      if (!s.ok()) {
        std::memset(outs[static_cast<size_t>(rank)].raw_data(), 0xAB, outs[static_cast<size_t>(rank)].nbytes());
        errored[static_cast<size_t>(rank)] = 1;
      }
      if (aborter.joinable()) aborter.join();
      return s;
    });
    check(outs, errored, absl::StrCat("abort, round ", round));
    // A timeout too short for the call, AllReduce and a large Broadcast.
    for (const bool broadcast : {false, true}) {
      std::vector<Tensor> outs2(4);
      std::vector<int> errored2(4, 0);
      RunRanks(
          4,
          [&](int rank, CommPtr& comm) -> absl::Status {
            DT_ASSIGN_OR_RETURN(Tensor in, Full({kElems}, 1.0, DType::kFloat32));
            Tensor& out = outs2[static_cast<size_t>(rank)];
            DT_ASSIGN_OR_RETURN(out, Full({kElems}, 1.0, DType::kFloat32));
            const absl::Status s = broadcast ? comm->Broadcast(out, 0) : comm->AllReduce(in, out, CommReduceOp::kSum);
            if (!s.ok()) {
              std::memset(out.raw_data(), 0xAB, out.nbytes());
              errored2[static_cast<size_t>(rank)] = 1;
            }
            return s;
          },
          absl::Microseconds(300 + 400 * round));
      check(outs2, errored2, absl::StrCat(broadcast ? "broadcast" : "all_reduce", " timeout, round ", round));
    }
  }
  std::printf("%d failed calls, %d written after they returned\n", failed, written_after);
}

// An abort through a split group reaches every group of the family, where the aborting rank's
// number in its group means another rank: the message also names its world rank (as ucx's).
TEST(ThreadsTest, AnAbortThroughASplitNamesTheWorldRank) {
  const auto statuses = RunRanks(
      4,
      [&](int rank, CommPtr& comm) -> absl::Status {
        DT_ASSIGN_OR_RETURN(CommPtr row, comm->Split(rank / 2, rank));  // world rank 3 is row rank 1
        DT_ASSIGN_OR_RETURN(CommPtr col, comm->Split(rank % 2, rank));
        if (rank == 3) {
          row->Abort(absl::InternalError("test: world rank 3 gives up"));
          return absl::OkStatus();
        }
        return comm->Barrier();  // waits for rank 3, which never comes
      },
      absl::Seconds(20));
  for (int r = 0; r < 3; ++r) {
    const absl::Status& s = statuses[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << "rank " << r << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 (world rank 3) aborted the communicator: INTERNAL: test"))
        << "rank " << r;
  }
}

TEST(ThreadsTest, AbortReachesRanksWaitingOnSubCommunicators) {
  std::vector<double> waited(4, -1.0);
  const auto statuses = RunRanks(
      4,
      [&](int rank, CommPtr& comm) -> absl::Status {
        DT_ASSIGN_OR_RETURN(CommPtr row, comm->Split(rank / 2, rank));
        DT_ASSIGN_OR_RETURN(CommPtr col, comm->Split(rank % 2, rank));
        DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty({4}, DType::kFloat32));
        absl::Status s;
        if (rank == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          comm->Abort(absl::InvalidArgumentError("test: rank 0 gives up"));
          comm->Abort(absl::InternalError("a second abort keeps the first reason"));
        } else {
          const auto start = Clock::now();
          s = rank == 1 ? row->AllReduce(t, t, CommReduceOp::kSum) : col->AllGather(t, Sentinel(8, DType::kFloat32));
          waited[static_cast<size_t>(rank)] = SecondsSince(start);
        }
        // Every group of the family is dead on every rank, and says why.
        for (Communicator* c : {comm.get(), row.get(), col.get()}) {
          const absl::Status b = c->Barrier();
          EXPECT_EQ(b.code(), absl::StatusCode::kAborted) << "rank " << rank << ": " << b;
          EXPECT_THAT(std::string(b.message()), HasSubstr("rank 0 aborted the communicator: INVALID_ARGUMENT: test"));
        }
        return s;
      },
      absl::Seconds(20));
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  for (int r = 1; r < 4; ++r) {
    const absl::Status& s = statuses[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("rank 0 aborted the communicator: INVALID_ARGUMENT: test: rank 0 gives up"));
    EXPECT_GE(waited[static_cast<size_t>(r)], 0.15) << "rank " << r << " should have waited for the abort";
    EXPECT_LT(waited[static_cast<size_t>(r)], 1.0) << "rank " << r;
  }
}

// A collective every rank completed succeeds on every rank, even when a peer that left it first
// aborts before a slower rank has woken up (the closing barrier): a rank must not see an error
// for a call its peers saw succeed. Repeated, since the race is a matter of timing.
TEST(ThreadsTest, AbortAfterACompletedCollectiveDoesNotFailIt) {
  for (int trial = 0; trial < 200; ++trial) {
    const auto statuses = RunRanks(
        3,
        [&](int rank, CommPtr& comm) -> absl::Status {
          DT_ASSIGN_OR_RETURN(Tensor t, Tensor::FromVector<float>({static_cast<float>(rank)}, {1}));
          DT_RETURN_IF_ERROR(comm->Barrier());
          DT_RETURN_IF_ERROR(comm->AllReduce(t, t, CommReduceOp::kSum));
          if (testing::Values(t)[0] != 3.0) return absl::InternalError(absl::StrCat("sum ", testing::Values(t)[0]));
          if (rank == 0) comm->Abort(absl::InvalidArgumentError("test: rank 0 gives up after the sum"));
          return absl::OkStatus();
        },
        absl::Seconds(20));
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(statuses[static_cast<size_t>(r)].ok())
          << "trial " << trial << " rank " << r << ": " << statuses[static_cast<size_t>(r)];
    }
  }
}

// A rank that fails in the middle of a stream of back-to-back calls (one barrier and two; each
// call's header read from its writer's arrival line, which the writer may already be filling
// for its next call): it aborts, leaves (its communicator destroyed) or stops calling (a
// timeout). Every other rank gets the matching error within the timeout, never wrong data, and
// every later call fails fast.
TEST(ThreadsTest, ARankFailingMidStreamFailsEveryPeer) {
  const DType f32 = DType::kFloat32;
  enum class How { kAbort, kLeave, kStop };
  for (const How how : {How::kAbort, How::kLeave, How::kStop}) {
    for (const int world : {2, 3, 4}) {
      const int failing = world - 1;
      const int fail_at = 40 + world;
      const auto start = Clock::now();
      const auto statuses = RunRanks(
          world,
          [&](int rank, CommPtr& comm) -> absl::Status {
            int call = 0;
            for (int it = 0; it < 200; ++it) {
              if (rank == failing && it == fail_at) {
                if (how == How::kAbort) comm->Abort(absl::InternalError("test: gives up mid-stream"));
                if (how == How::kLeave) comm.reset();
                return absl::OkStatus();
              }
              const int64_t m = 1 + (it * 211) % 3000;  // elements: both paths of every move
              DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllToAll, f32, m / world + 1, 0, ++call, rank, *comm));
              DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kAllGather, f32, m, 0, ++call, rank, *comm));
              DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kBroadcast, f32, m, it % world, ++call, rank, *comm));
              DT_RETURN_IF_ERROR(RunReducing(Coll::kReduceScatter, CommReduceOp::kSum, f32, m, rank, *comm));
              DT_RETURN_IF_ERROR(RunReducing(Coll::kAllReduce, CommReduceOp::kSum, f32, m, rank, *comm));
            }
            return absl::InternalError("the stream should have failed");
          },
          absl::Milliseconds(how == How::kStop ? 1000 * testing::TimeScale() : 20000));
      EXPECT_LT(SecondsSince(start), 5.0 * testing::TimeScale());
      const absl::StatusCode want = how == How::kAbort   ? absl::StatusCode::kAborted
                                    : how == How::kLeave ? absl::StatusCode::kUnavailable
                                                         : absl::StatusCode::kDeadlineExceeded;
      for (int r = 0; r < world; ++r) {
        const absl::Status& s = statuses[static_cast<size_t>(r)];
        if (r == failing) {
          EXPECT_TRUE(s.ok()) << s;
        } else {
          EXPECT_EQ(s.code(), want) << world << " ranks, rank " << r << ": " << s;
        }
      }
    }
  }
}

TEST(ThreadsTest, MismatchedCallsFailOnEveryRank) {
  setenv("DTENSOR_DEBUG", "1", 1);
  auto comms = testing::Unwrap(MakeThreadGroup(3, absl::Seconds(20)));
  unsetenv("DTENSOR_DEBUG");
  const auto statuses = RunOn(comms, [](int rank, CommPtr& comm) -> absl::Status {
    if (rank == 2) {
      DT_ASSIGN_OR_RETURN(Tensor in, Tensor::Empty({3}, DType::kFloat32));
      DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({9}, DType::kFloat32));
      absl::Status s = comm->AllGather(in, out);
      EXPECT_TRUE(comm->Barrier().ok());  // the group stays usable
      return s;
    }
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty({12}, DType::kFloat32));
    absl::Status s = comm->AllReduce(t, t, CommReduceOp::kSum);
    EXPECT_TRUE(comm->Barrier().ok());
    return s;
  });
  for (const absl::Status& s : statuses) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(),
              "[Debug] rank 0 called AllReduce(float32, 12 elements, sum) but rank 2 called AllGather(float32, 3 "
              "elements)");
  }
  // Mismatched roots, reductions, and AllToAllV counts that do not pair up.
  const auto more = RunOn(comms, [](int rank, CommPtr& comm) -> absl::Status {
    Tensor t = Sentinel(2, DType::kFloat32);
    const absl::Status root = comm->Broadcast(t, rank == 1 ? 1 : 0);
    EXPECT_THAT(std::string(root.message()), HasSubstr("but rank 1 called Broadcast(float32, 2 elements, root 1)"));
    const absl::Status op = comm->AllReduce(t, t, rank == 0 ? CommReduceOp::kMax : CommReduceOp::kSum);
    EXPECT_EQ(op.code(), absl::StatusCode::kInvalidArgument);
    const std::vector<int64_t> send = {1, 1, 1};
    const std::vector<int64_t> recv = {1, 1, rank == 0 ? 2 : 1};
    Tensor out = Sentinel(rank == 0 ? 4 : 3, DType::kFloat32);
    const absl::Status a2a = comm->AllToAllV(Sentinel(3, DType::kFloat32), out, send, recv);
    EXPECT_THAT(std::string(a2a.message()), HasSubstr("rank 2 sends 1 elements to rank 0 but rank 0 expects 2"));
    return root;
  });
  for (const absl::Status& s : more) EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

// A rank's slot holds its whole call only for kinds whose peers need more than the header
// (counts, views): here both slots of rank 2 (0 in the second round) hold AllGatherV calls
// equal to the others' when it calls AllGather, which must be told from its header, not from
// the slot left over. Every rank reaches the same verdict and the group stays usable.
TEST(ThreadsTest, AMismatchIsToldFromThisCallNotFromASlotLeftByAnEarlierOne) {
  auto comms = testing::Unwrap(MakeThreadGroup(3, absl::Seconds(20)));
  const std::vector<int64_t> counts = {1, 1, 1};
  for (const int odd : {2, 0}) {
    const auto statuses = RunOn(comms, [&](int rank, CommPtr& comm) -> absl::Status {
      Tensor in = Sentinel(1, DType::kFloat32);
      for (int i = 0; i < 2; ++i) {
        Tensor out = Sentinel(3, DType::kFloat32);
        DT_RETURN_IF_ERROR(comm->AllGatherV(in, out, counts));
      }
      Tensor out = Sentinel(3, DType::kFloat32);
      const absl::Status s = rank == odd ? comm->AllGather(in, out) : comm->AllGatherV(in, out, counts);
      EXPECT_TRUE(comm->Barrier().ok());
      return s;
    });
    const std::string want =
        odd == 2 ? "[Debug] rank 0 called AllGatherV(float32, counts [1, 1, 1]) but rank 2 called AllGather(float32, 1 "
                   "elements)"
                 : "[Debug] rank 0 called AllGather(float32, 1 elements) but rank 1 called AllGatherV(float32, counts "
                   "[1, 1, 1])";
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_EQ(s.message(), want);
    }
  }
}

// A small Broadcast's root returns once its bytes are in the group's slot, up to 32 calls ahead
// of its slowest receiver (RunEagerBroadcast): here the last receiver waits until the root has
// made 32 calls before it makes its first (it gives up after 10 s and the test fails), and the
// root's 33rd call returns only after that receiver has entered the second.
// Then every rank runs 300 small Broadcasts (roots and sizes changing, runs from one root, one
// rank yielding before some, an AllReduce now and then): every slot is reused many times, and a
// slot rewritten before every receiver had read it would hand one the wrong call's values.
TEST(ThreadsTest, SmallBroadcastRootsRunAheadOfTheirReceivers) {
  constexpr int kDepth = 32;
  const DType f32 = DType::kFloat32;
  for (int world : {2, 3, 4}) {
    std::atomic<bool> ran_ahead{false}, entered{false};
    ExpectAllOk(RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
      int call = 0;
      if (rank == world - 1) {
        const Clock::time_point start = Clock::now();
        while (!ran_ahead.load() && SecondsSince(start) < 10.0 * testing::TimeScale()) std::this_thread::yield();
        EXPECT_TRUE(ran_ahead.load()) << world << " ranks: the root waited for a receiver within 32 calls";
        entered.store(true);
      }
      for (int i = 0; i <= kDepth; ++i) {
        if (rank == 0 && i == kDepth) ran_ahead.store(true);
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kBroadcast, f32, 64 + i, 0, ++call, rank, *comm));
      }
      if (rank == 0) {
        EXPECT_TRUE(entered.load()) << world << " ranks: the root ran 33 calls ahead";
      }
      for (int it = 0; it < 300; ++it) {
        const int root = (it / 7) % world;
        if (it % (world + 3) == rank) std::this_thread::yield();
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kBroadcast, f32, 1 + (it * 379) % 1024, root, ++call, rank, *comm));
        if (it % 41 == 0) {
          DT_RETURN_IF_ERROR(RunReducing(Coll::kAllReduce, CommReduceOp::kSum, f32, 1 + it % 500, rank, *comm));
        }
      }
      return comm->Barrier();
    }));
  }
}

// A rank that skips a small Broadcast, or makes its calls in another order, is found out of step
// at the next collective that meets the group: every rank fails within the call or the next,
// well before the timeout, and no AllReduce returns a result.
TEST(ThreadsTest, ASkippedSmallBroadcastFailsEveryRank) {
  for (const int variant : {0, 1}) {
    auto comms = testing::Unwrap(MakeThreadGroup(3, absl::Seconds(20)));
    std::vector<int> failures(3, 0);
    const Clock::time_point start = Clock::now();
    const auto lasts = RunOn(comms, [&](int rank, CommPtr& comm) -> absl::Status {
      Tensor small = Sentinel(16, DType::kFloat32);
      Tensor sum = Sentinel(16, DType::kFloat32);
      auto broadcast = [&] { return comm->Broadcast(small, 0); };
      auto reduce = [&] { return comm->AllReduce(sum, sum, CommReduceOp::kSum); };
      // variant 0: rank 2 skips the Broadcast; variant 1: rank 0 (the root) reduces first.
      const bool skip = variant == 0 && rank == 2;
      const bool swap = variant == 1 && rank == 0;
      std::vector<absl::Status> got;
      if (!skip && !swap) got.push_back(broadcast());
      got.push_back(reduce());
      if (swap) got.push_back(broadcast());
      got.push_back(comm->Barrier());
      for (const absl::Status& s : got) failures[static_cast<size_t>(rank)] += s.ok() ? 0 : 1;
      const absl::Status reduced = got[skip || swap ? 0 : 1];
      EXPECT_FALSE(reduced.ok()) << "variant " << variant << ", rank " << rank << ": the AllReduce returned";
      return got.back();
    });
    EXPECT_LT(SecondsSince(start), 10.0);
    for (int r = 0; r < 3; ++r) {
      EXPECT_GE(failures[static_cast<size_t>(r)], 1) << "variant " << variant << ", rank " << r;
      EXPECT_EQ(lasts[static_cast<size_t>(r)].code(), absl::StatusCode::kInvalidArgument)
          << "variant " << variant << ", rank " << r << ": " << lasts[static_cast<size_t>(r)];
      EXPECT_THAT(std::string(lasts[static_cast<size_t>(r)].message()), HasSubstr("did not call it in step"));
    }
  }
}

// Ranks that disagree on a small Broadcast's root so that two of them both act as its root
// (here each rank names itself, or ranks 0 and 1 name themselves and rank 2 names rank 0): the
// roots return without meeting the group, so no receiver may be the only one to look. The
// second root to take the slot finds it taken for this call and fails the group, so every rank
// fails in the Broadcast or the Barrier after it (InvalidArgument naming both roots), instead
// of every rank keeping its own tensor, or a receiver copying a slot two roots write at once.
// Last, rank 2 names rank 1, a receiver: it reads the slot whenever rank 1 arrives, written by
// rank 0 or not yet, and must fail the group either way.
TEST(ThreadsTest, TwoRanksActingAsRootOfOneSmallBroadcastFailTheGroup) {
  for (const int world : {2, 3, -3}) {
    const int n = std::abs(world);
    for (int trial = 0; trial < 20; ++trial) {
      auto comms = testing::Unwrap(MakeThreadGroup(n, absl::Seconds(20)));
      std::vector<absl::Status> broadcasts(static_cast<size_t>(n));
      const auto barriers = RunOn(comms, [&](int rank, CommPtr& comm) -> absl::Status {
        Tensor t = Make(HashedValues(trial, rank, 64, DType::kFloat32), DType::kFloat32);
        const int root = world < 0 ? (rank == 2 ? 1 : 0) : rank < 2 ? rank : 0;
        broadcasts[static_cast<size_t>(rank)] = comm->Broadcast(t, root);
        return comm->Barrier();
      });
      for (int r = 0; r < n; ++r) {
        const size_t ur = static_cast<size_t>(r);
        const absl::Status& first = broadcasts[ur].ok() ? barriers[ur] : broadcasts[ur];
        EXPECT_EQ(first.code(), absl::StatusCode::kInvalidArgument)
            << world << " ranks, trial " << trial << ", rank " << r << ": " << first;
        EXPECT_THAT(
            std::string(first.message()),
            HasSubstr(world < 0 ? "rank 2 called Broadcast(float32, 64 elements, root 1)" : "both called Broadcast"))
            << world << " ranks, trial " << trial << ", rank " << r;
      }
    }
  }
}

// A small Broadcast's root returns before its receivers have read its bytes (they are in the
// group's slot): it may then leave the group (its communicator destroyed), and so may a receiver
// that has its bytes, without failing a receiver that comes later (as a rank that leaves after
// a collective every rank has entered does not fail it). A receiver whose root left before
// reaching the Broadcast still gets Unavailable.
TEST(ThreadsTest, ASmallBroadcastSurvivesItsRootLeavingAfterItReturns) {
  for (const int world : {2, 3}) {
    std::atomic<int> left{0};
    const auto statuses = RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
      if (rank == world - 1) {  // the last receiver comes once every other rank has left
        const Clock::time_point start = Clock::now();
        while (left.load() < world - 1 && SecondsSince(start) < 10.0 * testing::TimeScale()) {
          std::this_thread::yield();
        }
        EXPECT_EQ(left.load(), world - 1);
      }
      absl::Status s = MoveAndCheck(Coll::kBroadcast, DType::kFloat32, 100, 0, 1, rank, *comm);
      if (rank != world - 1) {
        comm.reset();
        left.fetch_add(1);
      }
      return s;
    });
    ExpectAllOk(statuses);
  }
  // The root left before its Broadcast: the receiver fails at once, naming it.
  auto comms = testing::Unwrap(MakeThreadGroup(2, absl::Seconds(20)));
  comms[0].reset();
  Tensor t = Sentinel(4, DType::kFloat32);
  const absl::Status s = comms[1]->Broadcast(t, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 0"));
}

// A rank that leaves the group while a receiver waits in a small Broadcast for its root: the
// root, coming later, refuses the call (a rank has left), so the receiver must not wait for it
// until the timeout; it fails at once with Unavailable naming the rank that left.
TEST(ThreadsTest, ARankLeavingFailsReceiversWaitingForASmallBroadcastsRoot) {
  std::atomic<bool> left{false};
  const auto start = Clock::now();
  const auto statuses = RunRanks(
      3,
      [&](int rank, CommPtr& comm) -> absl::Status {
        Tensor t = Sentinel(16, DType::kFloat32);
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 2 is waiting by then
          comm.reset();
          left.store(true);
          return absl::OkStatus();
        }
        if (rank == 0) {
          while (!left.load()) std::this_thread::yield();
        }
        return comm->Broadcast(t, 0);
      },
      absl::Seconds(20));
  EXPECT_LT(SecondsSince(start), 5.0);
  for (int r : {0, 2}) {
    const absl::Status& s = statuses[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << "rank " << r << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1")) << "rank " << r;
  }
}

// Receivers of a small Broadcast wait for its root alone: a root that never comes gives them
// DeadlineExceeded naming it within the timeout, and an Abort from another rank wakes them at
// once with Aborted. A receiver whose dtype differs from the root's (the same bytes) fails the
// group naming both calls. And slots are reused correctly on 1 and 8 ranks too.
TEST(ThreadsTest, SmallBroadcastReceiversFailOnTimeoutAbortAndDtype) {
  {  // the root (rank 0) never calls
    const auto start = Clock::now();
    const auto statuses = RunRanks(
        3,
        [&](int rank, CommPtr& comm) -> absl::Status {
          if (rank == 0) return absl::OkStatus();
          Tensor t = Sentinel(16, DType::kFloat32);
          return comm->Broadcast(t, 0);
        },
        absl::Milliseconds(300 * testing::TimeScale()));
    EXPECT_LT(SecondsSince(start), 5.0 * testing::TimeScale());
    for (int r : {1, 2}) {
      const absl::Status& s = statuses[static_cast<size_t>(r)];
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << "rank " << r << ": " << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("waiting for rank(s) 0")) << "rank " << r;
    }
  }
  {  // rank 1 aborts while rank 2 waits for root 0, which never calls
    const auto start = Clock::now();
    const auto statuses = RunRanks(
        3,
        [&](int rank, CommPtr& comm) -> absl::Status {
          if (rank == 0) return absl::OkStatus();
          if (rank == 1) {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            comm->Abort(absl::InternalError("test: rank 1 gives up"));
            return absl::OkStatus();
          }
          Tensor t = Sentinel(16, DType::kFloat32);
          return comm->Broadcast(t, 0);
        },
        absl::Seconds(20));
    EXPECT_LT(SecondsSince(start), 5.0 * testing::TimeScale());
    EXPECT_EQ(statuses[2].code(), absl::StatusCode::kAborted) << statuses[2];
    EXPECT_THAT(std::string(statuses[2].message()), HasSubstr("rank 1 aborted the communicator: "));
  }
  {  // 64 bytes each, float32 at the root, bfloat16 on rank 1
    std::vector<absl::Status> broadcasts(2);
    const auto nexts = RunRanks(2, [&](int rank, CommPtr& comm) -> absl::Status {
      Tensor t = rank == 0 ? Sentinel(16, DType::kFloat32) : Sentinel(32, DType::kBFloat16);
      broadcasts[static_cast<size_t>(rank)] = comm->Broadcast(t, 0);
      return comm->Barrier();
    });
    EXPECT_TRUE(broadcasts[0].ok()) << broadcasts[0];  // the root returned at once
    EXPECT_EQ(nexts[0].code(), absl::StatusCode::kInvalidArgument) << nexts[0];
    EXPECT_EQ(broadcasts[1].code(), absl::StatusCode::kInvalidArgument) << broadcasts[1];
    EXPECT_THAT(std::string(broadcasts[1].message()),
                HasSubstr("rank 0 called Broadcast(float32, 16 elements, root 0) but rank 1 called "
                          "Broadcast(bfloat16, 32 elements, root 0)"));
  }
  for (int world : {1, 8}) {
    ExpectAllOk(RunRanks(world, [&](int rank, CommPtr& comm) -> absl::Status {
      int call = 0;
      for (int it = 0; it < 100; ++it) {
        DT_RETURN_IF_ERROR(MoveAndCheck(Coll::kBroadcast, DType::kFloat32, 1 + (it * 211) % 1000, (it / 3) % world,
                                        ++call, rank, *comm));
      }
      return comm->Barrier();
    }));
  }
}

// Bad inputs are rejected locally: rank 0 gets them while rank 1 does nothing.
TEST(ThreadsTest, BadInputsAreRejectedWithClearMessages) {
  auto comms = testing::Unwrap(MakeThreadGroup(2, absl::Seconds(20)));
  Communicator& c = *comms[0];
  const DType f32 = DType::kFloat32;
  auto expect = [](const absl::Status& s, absl::StatusCode code, const std::string& text) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), StartsWith(text));
  };
  const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  Tensor x = testing::FromDoubles(std::vector<double>(12, 1.0), {3, 4}, f32);
  expect(c.AllReduce(testing::NonContiguous(x), x, CommReduceOp::kSum), kInvalid,
         "[AllReduce] rank 0: input is not contiguous (shape [3, 4]");
  expect(c.AllReduce(x, Sentinel(12, DType::kBFloat16), CommReduceOp::kSum), kInvalid,
         "[AllReduce] rank 0: input is float32 but output is bfloat16");
  expect(c.AllReduce(x, Sentinel(11, f32), CommReduceOp::kSum), kInvalid,
         "[AllReduce] rank 0: output has 11 elements, expected 12");
  expect(c.AllGather(x, Sentinel(12, f32)), kInvalid,
         "[AllGather] rank 0: output has 12 elements, expected 24 (size 2 x input 12)");
  expect(c.ReduceScatter(x, Sentinel(5, f32), CommReduceOp::kSum), kInvalid,
         "[ReduceScatter] rank 0: input has 12 elements, expected 10 (size 2 x output 5)");
  expect(c.AllToAll(Sentinel(3, f32), Sentinel(3, f32)), kInvalid,
         "[AllToAll] rank 0: input has 3 elements, not a multiple of the group size 2");
  expect(c.AllToAll(x, Sentinel(10, f32)), kInvalid, "[AllToAll] rank 0: output has 10 elements, expected 12");
  const std::vector<int64_t> three = {1, 1, 1}, negative = {3, -1}, ok = {2, 1};
  expect(c.AllGatherV(Sentinel(2, f32), Sentinel(3, f32), three), kInvalid,
         "[AllGatherV] rank 0: counts has 3 entries, expected 2 (one per rank)");
  expect(c.AllGatherV(Sentinel(3, f32), Sentinel(2, f32), negative), kInvalid, "[AllGatherV] rank 0: counts[1] is -1");
  // Counts too large to add up without overflow are refused by name (with 3 or more ranks, a
  // sum that wraps around could equal the tensor's size and pass every other check).
  const int64_t big = std::numeric_limits<int64_t>::max() - 1000;
  const std::vector<int64_t> wrapping = {big, 1001 + 3};
  expect(c.AllToAllV(Sentinel(3, f32), Sentinel(3, f32), wrapping, wrapping), kInvalid,
         absl::StrCat("[AllToAllV] rank 0: send_counts sum past 2^56 elements at send_counts[0] = ", big));
  // Entries each below the bound whose sum passes it.
  const int64_t half = int64_t{1} << 55;
  const std::vector<int64_t> summing = {half, half + 1};
  expect(c.AllGatherV(Sentinel(3, f32), Sentinel(3, f32), summing), kInvalid,
         absl::StrCat("[AllGatherV] rank 0: counts sum past 2^56 elements at counts[1] = ", half + 1));
  expect(c.AllGatherV(Sentinel(1, f32), Sentinel(3, f32), ok), kInvalid,
         "[AllGatherV] rank 0: input has 1 elements, expected 2 (counts[0])");
  expect(c.ReduceScatterV(Sentinel(4, f32), Sentinel(2, f32), ok, CommReduceOp::kSum), kInvalid,
         "[ReduceScatterV] rank 0: input has 4 elements, expected 3 (sum of counts)");
  expect(c.AllToAllV(Sentinel(3, f32), Sentinel(3, f32), ok, three), kInvalid,
         "[AllToAllV] rank 0: recv_counts has 3 entries");
  expect(c.Broadcast(x, 2), kInvalid, "[Broadcast] rank 0: root 2 is out of range for a group of size 2");
  expect(c.Broadcast(x, -1), kInvalid, "[Broadcast] rank 0: root -1 is out of range");
  expect(c.Send(x, 5), kInvalid, "[Send] rank 0: peer 5 is out of range");
  expect(c.Send(x, 0), kInvalid, "[Send] rank 0: peer is this rank (0)");
  expect(c.Recv(x, 0), kInvalid, "[Recv] rank 0: peer is this rank (0)");
  expect(c.AllReduce(Tensor(), x, CommReduceOp::kSum), kInvalid, "[AllReduce] rank 0: input is undefined");
  Tensor b = Sentinel(2, DType::kBool);
  expect(c.AllReduce(b, b, CommReduceOp::kAvg), kInvalid, "[AllReduce] rank 0: avg is not defined for bool");
  Tensor f8 = Sentinel(2, DType::kFloat8E4M3);
  expect(c.AllReduce(f8, f8, CommReduceOp::kSum), absl::StatusCode::kUnimplemented,
         "[AllReduce] rank 0: cannot reduce float8_e4m3");
  std::vector<float> host(4);
  auto cuda = Tensor::FromBlob(host.data(), {4}, f32, Device::Cuda(0));
  if (cuda.ok()) {
    expect(c.AllGather(*cuda, Sentinel(8, f32)), absl::StatusCode::kUnimplemented,
           "[AllGather] rank 0: input is on cuda:0");
    EXPECT_THAT(std::string(c.AllGather(*cuda, Sentinel(8, f32)).message()), HasSubstr("use the nccl backend"));
  }
}

}  // namespace
}  // namespace dtensor
