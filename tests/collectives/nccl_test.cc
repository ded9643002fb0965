// Tests of the nccl backend. Without a GPU (or in a build without CUDA/NCCL) only the
// factory's clean FailedPrecondition is checked; everything else skips. With one GPU: a world
// of one rank (every call's mapping, element counts against guard bytes, validation, Split,
// Barrier, async lifetimes). With two or more GPUs: one thread per GPU forming one NCCL group
// through an in-process TCP store, every collective against float64 / exact-integer
// references computed here, sub-groups and a timeout that aborts the communicator.
//
// The MultiRank tests also run with one process per rank, which is how NCCL is used in
// training and the only way to run them on a machine with one GPU:
//   dtrun --nproc-per-node N collectives_test --gtest_filter='NcclTest.MultiRank*'
// Each process is then rank RANK of WORLD_SIZE (joined through the launcher's store) on
// cuda:LOCAL_RANK, or on cuda:0 when there are fewer GPUs than ranks: NCCL refuses two ranks of
// one host on one GPU, so each such process names itself a host of its own (NCCL_HOSTID) and
// the ranks meet over sockets on loopback, slowly but through every code path of the backend.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "dtensor/collectives/nccl/nccl_communicator.h"
#include "dtensor/collectives/store/rendezvous.h"
#include "dtensor/collectives/store/tcp_store.h"
#include "dtensor/tensor/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/nccl_process_gpu.h"
#include "tests/testing/run_process.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using ::testing::HasSubstr;
using testing::Random;
using testing::Unwrap;
using testing::Values;
using CommPtr = std::unique_ptr<Communicator>;

constexpr DType kAllTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kInt64};

// Asserts that a Status is OK, printing it otherwise.
#define ASSERT_OK(expr)                                    \
  do {                                                     \
    const absl::Status status_ = (expr);                   \
    ASSERT_TRUE(status_.ok()) << #expr << ": " << status_; \
  } while (false)

#define SKIP_WITHOUT_GPUS(n)                                                                                      \
  do {                                                                                                            \
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the nccl backend needs a GPU";           \
    if (CudaDeviceCount() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, " << CudaDeviceCount() << " visible"; \
  } while (false)

// A store served in this process, and one client per rank.
struct LocalStore {
  std::unique_ptr<StoreServer> server;
  explicit LocalStore() : server(Unwrap(StoreServer::Start("127.0.0.1", 0), "StoreServer")) {}
  std::unique_ptr<StoreClient> Client() const {
    return Unwrap(StoreClient::Connect("127.0.0.1", server->port(), absl::Seconds(60)), "Connect");
  }
};

LaunchInfo World(int rank, int size) {
  LaunchInfo info;
  info.rank = rank;
  info.world_size = size;
  info.local_rank = rank;
  info.local_world_size = size;
  return info;
}

// Launched as one process per rank (dtrun, mpirun, srun with a world of two or more): this
// process's rank, its GPU and the run's store, made on first use and kept to the end (rank 0's
// store serves the others); null otherwise.
struct ProcessRank {
  LaunchInfo info;
  int device = 0;
  std::unique_ptr<StoreClient> store;
};
ProcessRank* Process() {
  static ProcessRank* const process = []() -> ProcessRank* {
    absl::StatusOr<LaunchInfo> info = LaunchInfoFromEnv();
    if (!info.ok() || info->scheme == "none" || info->world_size < 2) return nullptr;
    auto* p = new ProcessRank;  // never freed: used up to the process's exit
    p->info = *info;
    if (CudaDeviceCount() == 0) return p;  // the tests skip; no store needed
    p->device = testing::NcclProcessGpu(*info);
    p->store = Unwrap(ConnectStore(*info, absl::Seconds(120)), "ConnectStore");
    return p;
  }();
  return process;
}

// The GPU of `rank`: cuda:rank for thread ranks; a process rank uses its own.
Device RankDevice(int rank) { return Device::Cuda(Process() != nullptr ? Process()->device : rank); }

// Runs fn(rank, comm) on one thread per rank, rank r on cuda:r, after forming the group; or,
// launched as one process per rank, fn for this process's rank only.
void RunRanks(int world, const std::function<void(int, Communicator&)>& fn,
              absl::Duration timeout = absl::Seconds(60)) {
  if (ProcessRank* p = Process(); p != nullptr) {
    ASSERT_EQ(world, p->info.world_size);
    auto comm = MakeNcclCommunicator(p->info, *p->store, p->device, timeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_EQ((*comm)->rank(), p->info.rank);
    EXPECT_EQ((*comm)->size(), world);
    EXPECT_EQ((*comm)->device(), RankDevice(p->info.rank));
    fn(p->info.rank, **comm);
    return;
  }
  LocalStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto client = store.Client();
      if (client == nullptr) return;
      auto comm = MakeNcclCommunicator(World(r, world), *client, r, timeout);
      ASSERT_TRUE(comm.ok()) << comm.status();
      EXPECT_EQ((*comm)->rank(), r);
      EXPECT_EQ((*comm)->size(), world);
      EXPECT_EQ((*comm)->device(), Device::Cuda(r));
      EXPECT_STREQ((*comm)->backend(), "nccl");
      fn(r, **comm);
    });
  }
  for (auto& t : threads) t.join();
}

// A single-rank communicator on cuda:0 with its store (comm is null if forming it failed).
struct SingleRank {
  LocalStore store;
  std::unique_ptr<StoreClient> client = store.Client();
  CommPtr comm = client == nullptr
                     ? nullptr
                     : Unwrap(MakeNcclCommunicator(World(0, 1), *client, 0, absl::Seconds(60)), "MakeNcclCommunicator");
};

Tensor OnGpu(const Tensor& x, int device) { return Unwrap(To(x, Device::Cuda(device)), "To"); }

// Rank r's deterministic input (integers in [-9, 9] for integer types, so products stay exact).
Tensor Input(IntSpan shape, DType dtype, int rank, int salt) {
  const uint64_t seed = static_cast<uint64_t>(1000 * salt + rank);
  if (dtype == DType::kInt32 || dtype == DType::kInt64) {  // random integers: rounded float draws
    return testing::FromDoubles(Values(Random(shape, DType::kFloat32, seed, -9.0, 9.0)), shape, dtype);
  }
  return Random(shape, dtype, seed);
}

testing::Tolerance GroupTol(DType dtype, int world) {
  testing::Tolerance t = testing::Tol(dtype);
  t.rtol *= world;
  t.atol *= world;
  return t;
}

double Reduce(CommReduceOp op, const std::vector<double>& xs, bool integer) {
  double acc = xs[0];
  for (size_t i = 1; i < xs.size(); ++i) {
    switch (op) {
      case CommReduceOp::kSum:
      case CommReduceOp::kAvg:
        acc += xs[i];
        break;
      case CommReduceOp::kMax:
        acc = std::max(acc, xs[i]);
        break;
      case CommReduceOp::kMin:
        acc = std::min(acc, xs[i]);
        break;
      case CommReduceOp::kProduct:
        acc *= xs[i];
        break;
    }
  }
  if (op == CommReduceOp::kAvg) {
    const double n = static_cast<double>(xs.size());
    acc = integer ? std::trunc(acc / n) : acc / n;
  }
  return acc;
}

// ---- Without a GPU: the factory fails cleanly ----

TEST(NcclTest, FactoryWithoutGpuIsFailedPrecondition) {
  if (NcclBuilt() && CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible; covered by the GPU tests";
  LocalStore store;
  auto client = store.Client();
  ASSERT_NE(client, nullptr);
  auto comm = MakeNcclCommunicator(World(0, 1), *client, 0, absl::Seconds(5));
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
  EXPECT_THAT(comm.status().message(), HasSubstr("[MakeNcclCommunicator] rank 0"));
  EXPECT_THAT(comm.status().message(), HasSubstr("cuda:0"));
}

TEST(NcclTest, FactoryRejectsBadDeviceAndRank) {
  LocalStore store;
  auto client = store.Client();
  ASSERT_NE(client, nullptr);
  auto comm = MakeNcclCommunicator(World(0, 1), *client, 1000, absl::Seconds(5));
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
  EXPECT_THAT(comm.status().message(), HasSubstr("cuda:1000"));
  if (!NcclBuilt()) return;
  auto bad = MakeNcclCommunicator(World(3, 2), *client, 0, absl::Seconds(5));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("rank 3 is not in a world of size 2"));
}

// ---- One GPU: a world of one rank ----

TEST(NcclTest, SingleRankCollectivesMoveExactlyTheirElements) {
  SKIP_WITHOUT_GPUS(1);
  SingleRank world;
  CommPtr& comm = world.comm;
  ASSERT_NE(comm, nullptr);
  for (DType dtype : kAllTypes) {
    for (int64_t n : {1, 3, 17, 127, 4099}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " n=", n));
      const Tensor x = OnGpu(Input({n}, dtype, 0, 1), 0);
      const std::vector<double> xv = Values(x);
      // Output: the first n elements of a buffer whose tail is a guard that must survive (a
      // bytes-as-count bug would overwrite it).
      const Tensor buf = OnGpu(Unwrap(Full({n + 64}, 7.0, dtype)), 0);
      const Tensor out = Unwrap(buf.Narrow(0, 0, n));
      for (CommReduceOp op :
           {CommReduceOp::kSum, CommReduceOp::kAvg, CommReduceOp::kMax, CommReduceOp::kMin, CommReduceOp::kProduct}) {
        const absl::Status st = comm->AllReduce(x, out, op);
        ASSERT_TRUE(st.ok()) << CommReduceOpName(op) << ": " << st;
        testing::ExpectNear(Values(out), xv, testing::Tol(dtype), CommReduceOpName(op));
      }
      ASSERT_OK(comm->AllGather(x, out));
      testing::ExpectNear(Values(out), xv, testing::Tol(dtype), "AllGather");
      ASSERT_OK(comm->ReduceScatter(x, out, CommReduceOp::kSum));
      testing::ExpectNear(Values(out), xv, testing::Tol(dtype), "ReduceScatter");
      ASSERT_OK(comm->AllToAll(x, out));
      testing::ExpectNear(Values(out), xv, testing::Tol(dtype), "AllToAll");
      ASSERT_OK(comm->AllGatherV(x, out, {n}));
      testing::ExpectNear(Values(out), xv, testing::Tol(dtype), "AllGatherV");
      ASSERT_OK(comm->ReduceScatterV(x, out, {n}, CommReduceOp::kMax));
      testing::ExpectNear(Values(out), xv, testing::Tol(dtype), "ReduceScatterV");
      ASSERT_OK(comm->AllToAllV(x, out, {n}, {n}));
      testing::ExpectNear(Values(out), xv, testing::Tol(dtype), "AllToAllV");
      ASSERT_OK(comm->Broadcast(out, 0));
      testing::ExpectNear(Values(out), xv, testing::Tol(dtype), "Broadcast");
      const std::vector<double> all = Values(buf);
      for (int64_t i = n; i < n + 64; ++i) ASSERT_EQ(all[static_cast<size_t>(i)], 7.0) << "guard element " << i;
    }
  }
}

TEST(NcclTest, SingleRankInPlaceEmptyAndByteTypes) {
  SKIP_WITHOUT_GPUS(1);
  SingleRank world;
  CommPtr& comm = world.comm;
  ASSERT_NE(comm, nullptr);
  // In place.
  const Tensor x = OnGpu(Input({5, 7}, DType::kFloat32, 0, 2), 0);
  const std::vector<double> xv = Values(x);
  ASSERT_OK(comm->AllReduce(x, x, CommReduceOp::kAvg));
  testing::ExpectNear(Values(x), xv, testing::Tol(DType::kFloat32), "in place");
  // Overlapping (shifted) input and output are staged, not raced.
  const Tensor buf = OnGpu(Unwrap(Arange(20, DType::kFloat32)), 0);
  const Tensor in = Unwrap(buf.Narrow(0, 0, 16)), out = Unwrap(buf.Narrow(0, 4, 16));
  ASSERT_OK(comm->AllToAll(in, out));
  const std::vector<double> got = Values(buf);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(got[static_cast<size_t>(4 + i)], i) << i;
  // Empty tensors.
  const Tensor e = Unwrap(Tensor::Empty({0}, DType::kFloat32, Device::Cuda(0)));
  EXPECT_TRUE(comm->AllReduce(e, e, CommReduceOp::kSum).ok());
  EXPECT_TRUE(comm->AllGather(e, e).ok());
  EXPECT_TRUE(comm->Broadcast(e, 0).ok());
  // bool reduces as or / and; float8 moves as bytes.
  const Tensor b = OnGpu(testing::FromDoubles({1, 0, 1, 1, 0}, {5}, DType::kBool), 0);
  const Tensor bo = Unwrap(Tensor::Empty({5}, DType::kBool, Device::Cuda(0)));
  ASSERT_OK(comm->AllReduce(b, bo, CommReduceOp::kSum));
  EXPECT_EQ(Values(bo), Values(b));
  ASSERT_OK(comm->AllReduce(b, bo, CommReduceOp::kProduct));
  EXPECT_EQ(Values(bo), Values(b));
  const Tensor f8 = OnGpu(Unwrap(Cast(Input({9}, DType::kFloat32, 0, 3), DType::kFloat8E4M3)), 0);
  const Tensor f8o = Unwrap(Tensor::Empty({9}, DType::kFloat8E4M3, Device::Cuda(0)));
  ASSERT_OK(comm->AllGather(f8, f8o));
  EXPECT_EQ(Values(f8o), Values(f8));
}

TEST(NcclTest, SingleRankValidation) {
  SKIP_WITHOUT_GPUS(1);
  SingleRank world;
  CommPtr& comm = world.comm;
  ASSERT_NE(comm, nullptr);
  const Tensor g = OnGpu(Input({4, 6}, DType::kFloat32, 0, 4), 0);
  auto code_of = [](const absl::Status& s) { return s.code(); };
  // CPU tensor.
  absl::Status s = comm->AllReduce(Input({4, 6}, DType::kFloat32, 0, 4), g, CommReduceOp::kSum);
  EXPECT_EQ(code_of(s), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("[AllReduce] rank 0: input is on cpu"));
  // Non-contiguous.
  s = comm->AllReduce(Unwrap(g.Transpose(0, 1)), g, CommReduceOp::kSum);
  EXPECT_EQ(code_of(s), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("not contiguous"));
  // Sizes and dtypes.
  const Tensor small = Unwrap(Tensor::Empty({5}, DType::kFloat32, Device::Cuda(0)));
  s = comm->AllGather(g, small);
  EXPECT_EQ(code_of(s), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("output has 5 elements, expected 24"));
  const Tensor half = Unwrap(Tensor::Empty({4, 6}, DType::kFloat16, Device::Cuda(0)));
  s = comm->AllReduce(g, half, CommReduceOp::kSum);
  EXPECT_THAT(s.message(), HasSubstr("input is float32 but output is float16"));
  s = comm->AllGatherV(g, g, {24, 0});
  EXPECT_THAT(s.message(), HasSubstr("counts has 2 entries, expected 1"));
  s = comm->AllToAllV(g, g, {-1}, {24});
  EXPECT_THAT(s.message(), HasSubstr("send_counts[0] is -1"));
  // Reductions of byte types.
  const Tensor b = Unwrap(Tensor::Empty({3}, DType::kBool, Device::Cuda(0)));
  EXPECT_EQ(comm->AllReduce(b, b, CommReduceOp::kAvg).code(), absl::StatusCode::kInvalidArgument);
  const Tensor f8 = Unwrap(Tensor::Empty({3}, DType::kFloat8E5M2, Device::Cuda(0)));
  EXPECT_EQ(comm->ReduceScatter(f8, f8, CommReduceOp::kSum).code(), absl::StatusCode::kUnimplemented);
  // Peers.
  s = comm->Send(g, 0);
  EXPECT_THAT(s.message(), HasSubstr("peer is this rank"));
  s = comm->Broadcast(g, 1);
  EXPECT_THAT(s.message(), HasSubstr("root 1 is out of range for a group of size 1"));
  // Still usable after local errors.
  EXPECT_TRUE(comm->Barrier().ok());
}

// BatchSendRecv to itself: NCCL pairs the k-th send to this rank with the k-th receive from
// it, in one group (a lone Send to itself is InvalidArgument: it could never complete).
TEST(NcclTest, SingleRankBatchSendRecvToItself) {
  SKIP_WITHOUT_GPUS(1);
  SingleRank world;
  CommPtr& comm = world.comm;
  ASSERT_NE(comm, nullptr);
  const Tensor a = OnGpu(Input({5, 3}, DType::kFloat32, 0, 9), 0);
  const Tensor b = OnGpu(Input({1000}, DType::kBFloat16, 0, 10), 0);
  const Tensor got_a = OnGpu(Unwrap(Full({15}, -1.0, DType::kFloat32)), 0);
  const Tensor got_b = OnGpu(Unwrap(Full({1000}, -1.0, DType::kBFloat16)), 0);
  const Tensor empty = Unwrap(Tensor::Empty({0}, DType::kFloat32, Device::Cuda(0)));
  ASSERT_OK(comm->BatchSendRecv({PeerOp::Send(a, 0), PeerOp::Send(empty, 0), PeerOp::Send(b, 0), PeerOp::Recv(got_a, 0),
                                 PeerOp::Recv(empty, 0), PeerOp::Recv(got_b, 0)}));
  EXPECT_EQ(Values(got_a), Values(a));
  EXPECT_EQ(Values(got_b), Values(b));
  // Async, then waited on.
  const Tensor got_c = OnGpu(Unwrap(Full({5, 3}, -1.0, DType::kFloat32)), 0);
  auto work = comm->BatchSendRecvAsync({PeerOp::Recv(got_c, 0), PeerOp::Send(a, 0)});
  ASSERT_TRUE(work.ok()) << work.status();
  ASSERT_OK((*work)->Wait());
  EXPECT_TRUE((*work)->IsCompleted());
  EXPECT_EQ(Values(got_c), Values(a));
  // Checked before anything is queued.
  absl::Status s = comm->BatchSendRecv({PeerOp::Send(a, 0), PeerOp::Recv(got_b, 0)});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("send to itself ops[0] has 15 float32 elements but its receive ops[1] has 1000"));
  s = comm->BatchSendRecv({PeerOp::Send(a, 0)});
  EXPECT_THAT(s.message(), HasSubstr("1 send(s) to this rank but 0 receive(s) from it"));
  s = comm->BatchSendRecv({PeerOp::Send(Input({15}, DType::kFloat32, 0, 9), 0), PeerOp::Recv(got_a, 0)});
  EXPECT_THAT(s.message(), HasSubstr("ops[0] (send to 0) is on cpu but the communicator moves cuda:0 tensors"));
  ASSERT_OK(comm->BatchSendRecv({}));
  EXPECT_TRUE(comm->Barrier().ok());
}

// AllToAllBlocks (the default: pack, ncclSend/Recv, unpack) with strided CUDA views on both
// sides: a column block of a matrix into the transpose of a buffer.
TEST(NcclTest, SingleRankAllToAllBlocksOfStridedViews) {
  SKIP_WITHOUT_GPUS(1);
  SingleRank world;
  CommPtr& comm = world.comm;
  ASSERT_NE(comm, nullptr);
  const Tensor matrix = OnGpu(Input({4, 6}, DType::kFloat32, 0, 7), 0);
  const Tensor send = Unwrap(matrix.Narrow(1, 1, 3));  // [4, 3], row stride 6
  const Tensor buf = OnGpu(Unwrap(Full({3, 4}, -1.0, DType::kFloat32)), 0);
  const Tensor recv = Unwrap(buf.Transpose(0, 1));  // [4, 3], strides (1, 4)
  ASSERT_OK(comm->AllToAllBlocks({send}, {recv}));
  EXPECT_EQ(Values(Unwrap(Contiguous(recv))), Values(Unwrap(Contiguous(send))));
  // The same through back-to-back contiguous blocks (no packing: one flat view each way).
  const Tensor flat_in = OnGpu(Input({6}, DType::kFloat32, 0, 8), 0);
  const Tensor flat_out = OnGpu(Unwrap(Full({6}, -1.0, DType::kFloat32)), 0);
  ASSERT_OK(comm->AllToAllBlocks({flat_in}, {flat_out}));
  EXPECT_EQ(Values(flat_out), Values(flat_in));
}

TEST(NcclTest, SingleRankAsyncSplitAndBarrier) {
  SKIP_WITHOUT_GPUS(1);
  SingleRank world;
  CommPtr& comm = world.comm;
  ASSERT_NE(comm, nullptr);
  EXPECT_TRUE(comm->Barrier().ok());
  // The collective is ordered after compute queued before it, and the Work keeps the input
  // alive when the caller drops it.
  std::unique_ptr<Work> work;
  const Tensor out = Unwrap(Tensor::Empty({1 << 20}, DType::kFloat32, Device::Cuda(0)));
  {
    const Tensor x = Unwrap(Full({1 << 20}, 3.0, DType::kFloat32, Device::Cuda(0)));
    auto w = comm->AllReduceAsync(x, out, CommReduceOp::kSum);
    ASSERT_TRUE(w.ok()) << w.status();
    work = *std::move(w);
  }
  const Tensor reuse = Unwrap(Full({1 << 20}, -1.0, DType::kFloat32, Device::Cuda(0)));  // may get x's block
  ASSERT_TRUE(work->Wait().ok());
  EXPECT_TRUE(work->IsCompleted());
  const std::vector<double> v = Values(out);
  EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](double d) { return d == 3.0; }));
  // Split.
  auto child = comm->Split(0, 5);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_NE(*child, nullptr);
  EXPECT_EQ((*child)->size(), 1);
  EXPECT_EQ((*child)->rank(), 0);
  EXPECT_TRUE((*child)->Barrier().ok());
  auto none = comm->Split(-1, 0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  // Two communicators on one store get different NCCL ids.
  auto second = MakeNcclCommunicator(World(0, 1), *world.client, 0, absl::Seconds(60));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE((*second)->Barrier().ok());
}

// ---- Several GPUs: one rank per GPU (threads of this process), or one process per rank ----

// Thread ranks: up to 4 GPUs. Process ranks: the launcher's world, on one GPU or more.
int MultiWorld() { return Process() != nullptr ? Process()->info.world_size : std::min(CudaDeviceCount(), 4); }

#define SKIP_WITHOUT_MULTI_RANK()                                                                       \
  do {                                                                                                  \
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the nccl backend needs a GPU"; \
    if (Process() == nullptr && CudaDeviceCount() < 2) {                                                \
      GTEST_SKIP() << "needs 2 GPUs (" << CudaDeviceCount()                                             \
                   << " visible), or one process per rank: dtrun --nproc-per-node 2 collectives_test "  \
                      "--gtest_filter='NcclTest.MultiRank*'";                                           \
    }                                                                                                   \
  } while (false)

TEST(NcclTest, MultiRankReductions) {
  SKIP_WITHOUT_MULTI_RANK();
  const int world = MultiWorld();
  RunRanks(world, [&](int rank, Communicator& comm) {
    for (DType dtype : kAllTypes) {
      const bool integer = dtype == DType::kInt32 || dtype == DType::kInt64;
      const int64_t n = 127;
      std::vector<std::vector<double>> inputs;
      for (int r = 0; r < world; ++r) inputs.push_back(Values(Input({n * world}, dtype, r, 5)));
      const Tensor x = OnGpu(Input({n * world}, dtype, rank, 5), RankDevice(rank).index);
      const Tensor full = Unwrap(Tensor::Empty({n * world}, dtype, RankDevice(rank)));
      const Tensor part = Unwrap(Tensor::Empty({n}, dtype, RankDevice(rank)));
      for (CommReduceOp op :
           {CommReduceOp::kSum, CommReduceOp::kAvg, CommReduceOp::kMax, CommReduceOp::kMin, CommReduceOp::kProduct}) {
        std::vector<double> ref(static_cast<size_t>(n * world));
        for (size_t i = 0; i < ref.size(); ++i) {
          std::vector<double> xs;
          for (int r = 0; r < world; ++r) xs.push_back(inputs[static_cast<size_t>(r)][i]);
          ref[i] = Reduce(op, xs, integer);
        }
        const std::string what = absl::StrCat(DTypeName(dtype), " ", CommReduceOpName(op), " rank ", rank);
        ASSERT_TRUE(comm.AllReduce(x, full, op).ok()) << what;
        testing::ExpectNear(Values(full), ref, GroupTol(dtype, world), "AllReduce " + what);
        ASSERT_TRUE(comm.ReduceScatter(x, part, op).ok()) << what;
        const std::vector<double> block(ref.begin() + rank * n, ref.begin() + (rank + 1) * n);
        testing::ExpectNear(Values(part), block, GroupTol(dtype, world), "ReduceScatter " + what);
      }
      // Uneven ReduceScatterV (one empty shard).
      std::vector<int64_t> counts;
      for (int r = 0; r < world; ++r) counts.push_back(r == 1 ? 0 : 3 + 5 * r);
      int64_t total = 0, offset = 0;
      for (int r = 0; r < world; ++r) total += counts[static_cast<size_t>(r)];
      for (int r = 0; r < rank; ++r) offset += counts[static_cast<size_t>(r)];
      const Tensor xv = Unwrap(x.Narrow(0, 0, total));
      const Tensor mine = Unwrap(Tensor::Empty({counts[static_cast<size_t>(rank)]}, dtype, RankDevice(rank)));
      ASSERT_TRUE(comm.ReduceScatterV(xv, mine, counts, CommReduceOp::kSum).ok());
      std::vector<double> ref;
      for (int64_t i = offset; i < offset + counts[static_cast<size_t>(rank)]; ++i) {
        std::vector<double> xs;
        for (int r = 0; r < world; ++r) xs.push_back(inputs[static_cast<size_t>(r)][static_cast<size_t>(i)]);
        ref.push_back(Reduce(CommReduceOp::kSum, xs, integer));
      }
      testing::ExpectNear(Values(mine), ref, GroupTol(dtype, world), "ReduceScatterV");
    }
  });
}

TEST(NcclTest, MultiRankDataMovement) {
  SKIP_WITHOUT_MULTI_RANK();
  const int world = MultiWorld();
  RunRanks(world, [&](int rank, Communicator& comm) {
    const DType dtype = DType::kBFloat16;
    const int64_t n = 17;
    std::vector<std::vector<double>> inputs;
    for (int r = 0; r < world; ++r) inputs.push_back(Values(Input({n * world}, dtype, r, 6)));
    const Tensor x = OnGpu(Input({n * world}, dtype, rank, 6), RankDevice(rank).index);
    const Tensor out = Unwrap(Tensor::Empty({n * world}, dtype, RankDevice(rank)));
    // AllGather of the first n elements.
    ASSERT_TRUE(comm.AllGather(Unwrap(x.Narrow(0, 0, n)), out).ok());
    std::vector<double> ref;
    for (int r = 0; r < world; ++r) {
      ref.insert(ref.end(), inputs[static_cast<size_t>(r)].begin(), inputs[static_cast<size_t>(r)].begin() + n);
    }
    EXPECT_EQ(Values(out), ref) << "AllGather";
    // AllToAll: block j of rank r goes to rank j at block r.
    ASSERT_TRUE(comm.AllToAll(x, out).ok());
    ref.clear();
    for (int r = 0; r < world; ++r) {
      const auto& in = inputs[static_cast<size_t>(r)];
      ref.insert(ref.end(), in.begin() + rank * n, in.begin() + (rank + 1) * n);
    }
    EXPECT_EQ(Values(out), ref) << "AllToAll";
    // AllGatherV with uneven (and one empty) shards: rank r contributes r + (r == 1 ? -1 : 2).
    std::vector<int64_t> counts;
    for (int r = 0; r < world; ++r) counts.push_back(r == 1 ? 0 : r + 2);
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    const Tensor gv = Unwrap(Tensor::Empty({total}, dtype, RankDevice(rank)));
    ASSERT_TRUE(comm.AllGatherV(Unwrap(x.Narrow(0, 0, counts[static_cast<size_t>(rank)])), gv, counts).ok());
    ref.clear();
    for (int r = 0; r < world; ++r) {
      const auto& in = inputs[static_cast<size_t>(r)];
      ref.insert(ref.end(), in.begin(), in.begin() + counts[static_cast<size_t>(r)]);
    }
    EXPECT_EQ(Values(gv), ref) << "AllGatherV";
    // AllToAllV: rank r sends (r + j) % 3 elements to rank j.
    std::vector<int64_t> send, recv;
    for (int j = 0; j < world; ++j) {
      send.push_back((rank + j) % 3);
      recv.push_back((j + rank) % 3);
    }
    int64_t sends = 0, recvs = 0;
    for (int j = 0; j < world; ++j) sends += send[static_cast<size_t>(j)], recvs += recv[static_cast<size_t>(j)];
    const Tensor av = Unwrap(Tensor::Empty({recvs}, dtype, RankDevice(rank)));
    ASSERT_TRUE(comm.AllToAllV(Unwrap(x.Narrow(0, 0, sends)), av, send, recv).ok());
    ref.clear();
    for (int r = 0; r < world; ++r) {  // from rank r: its block for me, at its prefix of sends
      int64_t off = 0;
      for (int j = 0; j < rank; ++j) off += (r + j) % 3;
      const auto& in = inputs[static_cast<size_t>(r)];
      ref.insert(ref.end(), in.begin() + off, in.begin() + off + (r + rank) % 3);
    }
    EXPECT_EQ(Values(av), ref) << "AllToAllV";
    // Broadcast from the last rank.
    const Tensor b = OnGpu(Input({n}, dtype, rank, 7), RankDevice(rank).index);
    ASSERT_TRUE(comm.Broadcast(b, world - 1).ok());
    EXPECT_EQ(Values(b), Values(Input({n}, dtype, world - 1, 7))) << "Broadcast";
    // Ring shift in one batch, sends listed first (as separate SendAsync / RecvAsync calls
    // every rank's send would wait for a receive queued behind it: see nccl_communicator.h).
    const Tensor mine = OnGpu(Input({n}, dtype, rank, 8), RankDevice(rank).index);
    const Tensor got = Unwrap(Tensor::Empty({n}, dtype, RankDevice(rank)));
    ASSERT_OK(
        comm.BatchSendRecv({PeerOp::Send(mine, (rank + 1) % world), PeerOp::Recv(got, (rank + world - 1) % world)}));
    EXPECT_EQ(Values(got), Values(Input({n}, dtype, (rank + world - 1) % world, 8))) << "BatchSendRecv";
    // Then Send / Recv in an order that needs no group: even ranks send first, odd ones receive.
    const Tensor back = Unwrap(Tensor::Empty({n}, dtype, RankDevice(rank)));
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    if (world % 2 == 0) {
      if (rank % 2 == 0) {
        ASSERT_OK(comm.Send(got, prev));
        ASSERT_OK(comm.Recv(back, next));
      } else {
        ASSERT_OK(comm.Recv(back, next));
        ASSERT_OK(comm.Send(got, prev));
      }
      EXPECT_EQ(Values(back), Values(mine)) << "Send / Recv";
    }
    EXPECT_TRUE(comm.Barrier().ok());
  });
}

TEST(NcclTest, MultiRankSplitByParity) {
  SKIP_WITHOUT_MULTI_RANK();
  const int world = MultiWorld();
  RunRanks(world, [&](int rank, Communicator& comm) {
    // Even ranks in reverse order (key = -rank); odd ranks opt out.
    auto child = comm.Split(rank % 2 == 0 ? 0 : -1, -rank);
    ASSERT_TRUE(child.ok()) << child.status();
    if (rank % 2 == 1) {
      EXPECT_EQ(*child, nullptr);
      return;
    }
    ASSERT_NE(*child, nullptr);
    const int evens = (world + 1) / 2;
    EXPECT_EQ((*child)->size(), evens);
    EXPECT_EQ((*child)->rank(), evens - 1 - rank / 2);
    const Tensor x = Unwrap(Full({5}, rank + 1.0, DType::kFloat32, RankDevice(rank)));
    ASSERT_TRUE((*child)->AllReduce(x, x, CommReduceOp::kSum).ok());
    double sum = 0;
    for (int r = 0; r < world; r += 2) sum += r + 1.0;
    EXPECT_EQ(Values(x), std::vector<double>(5, sum));
  });
}

// Keeps ranks other than 0 (and their communicators, whose teardown a peer may notice) until
// rank 0 is done: thread ranks wait on a notification, process ranks on a key of the store.
class RankZeroDone {
 public:
  // Rank 0: on leaving the scope of the returned guard, the others go on.
  auto Guard() {
    struct Signal {
      RankZeroDone* done;
      ~Signal() { done->Signal(); }
    };
    return Signal{this};
  }
  void Await() {
    if (Process() == nullptr) {
      EXPECT_TRUE(notification_.WaitForNotificationWithTimeout(absl::Seconds(120)));
    } else {
      const absl::Status s = Process()->store->Wait({key_});
      EXPECT_TRUE(s.ok()) << s;
    }
  }

 private:
  void Signal() {
    if (Process() == nullptr) {
      notification_.Notify();
    } else {
      const absl::Status s = Process()->store->Set(key_, "1");
      EXPECT_TRUE(s.ok()) << s;
    }
  }
  std::string key_ =
      absl::StrCat("nccl_test/", ::testing::UnitTest::GetInstance()->current_test_info()->name(), "/rank0_done");
  absl::Notification notification_;
};

TEST(NcclTest, MultiRankTimeoutAbortsAndNamesTheCall) {
  SKIP_WITHOUT_MULTI_RANK();
  const int world = MultiWorld();
  RankZeroDone done;
  RunRanks(world, [&](int rank, Communicator& comm) {
    ASSERT_TRUE(comm.Barrier().ok());
    comm.SetTimeout(absl::Seconds(2));   // also bounds the other ranks' teardown
    if (rank != 0) return done.Await();  // only rank 0 calls: it must time out, not hang
    auto guard = done.Guard();
    const Tensor x = Unwrap(Full({8}, 1.0, DType::kFloat32, RankDevice(0)));
    const absl::Status s = comm.AllReduce(x, x, CommReduceOp::kSum);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("[AllReduce] rank 0"));
    const absl::Status later = comm.Barrier();
    EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
    EXPECT_THAT(later.message(), HasSubstr("failed earlier"));
  });
}

// Peers that leave (destroy their communicators) while rank 0 waits in a collective: rank 0
// gets an error naming the call, never a hang. Where the ranks talk over sockets (processes
// sharing a GPU) NCCL sees the connections close and the error is Unavailable, long before the
// timeout; through GPU peer-to-peer memory nothing tells, and the timeout ends the wait.
TEST(NcclTest, MultiRankPeersThatLeaveFailTheCall) {
  SKIP_WITHOUT_MULTI_RANK();
  const int world = MultiWorld();
  const bool sockets = Process() != nullptr && CudaDeviceCount() < world;
  RunRanks(world, [&](int rank, Communicator& comm) {
    ASSERT_TRUE(comm.Barrier().ok());
    comm.SetTimeout(absl::Seconds(sockets ? 60 : 3));
    if (rank != 0) return;  // its communicator goes
    const Tensor x = Unwrap(Full({8}, 1.0, DType::kFloat32, RankDevice(0)));
    const absl::Time start = absl::Now();
    const absl::Status s = comm.AllReduce(x, x, CommReduceOp::kSum);
    EXPECT_THAT(s.message(), HasSubstr("[AllReduce] rank 0"));
    if (sockets) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << s;
    } else {
      EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded) << s;
    }
    EXPECT_EQ(comm.Barrier().code(), absl::StatusCode::kFailedPrecondition);
  });
}

// A BatchSendRecv whose peers never answer times out naming them: the one peer, or all of the
// batch's (NCCL cannot tell which one is missing), not every rank of the group.
TEST(NcclTest, MultiRankBatchTimeoutNamesTheBatchPeers) {
  SKIP_WITHOUT_MULTI_RANK();
  const int world = MultiWorld();
  RankZeroDone done;
  RunRanks(world, [&](int rank, Communicator& comm) {
    ASSERT_TRUE(comm.Barrier().ok());
    comm.SetTimeout(absl::Seconds(2));
    if (rank != 0) return done.Await();
    auto guard = done.Guard();
    const Tensor a = Unwrap(Tensor::Empty({8}, DType::kFloat32, RankDevice(0)));
    const Tensor b = Unwrap(Tensor::Empty({8}, DType::kFloat32, RankDevice(0)));
    std::vector<PeerOp> ops = {PeerOp::Recv(a, 1), PeerOp::Send(a, 1)};
    if (world >= 3) ops.push_back(PeerOp::Recv(b, 2));
    const absl::Status s = comm.BatchSendRecv(ops);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("[BatchSendRecv] rank 0"));
    EXPECT_THAT(s.message(),
                HasSubstr(world >= 3 ? "waiting for ranks 1 and 2 (NCCL cannot tell" : "waiting for rank 1;"));
  });
}

#if defined(DTRUN_PATH)
// The MultiRank tests above as 2 processes of this binary under dtrun (on a one-GPU machine
// they share cuda:0, see the top), so that ctest covers NCCL across processes wherever a GPU is.
TEST(NcclTest, ProcessRanksPassTheMultiRankTests) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the nccl backend needs a GPU";
  if (Process() != nullptr) GTEST_SKIP() << "already one process of a launched group";
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(len, 0);
  self[len] = '\0';
  const dtensor::testing::ProcessRun run =
      dtensor::testing::RunProcess({DTRUN_PATH, "--nproc-per-node", "2", self, "--gtest_filter=NcclTest.MultiRank*"},
                                   {.timeout = absl::Seconds(300), .merge_output = true});
  const std::string& output = run.out;
  EXPECT_EQ(run.code, 0) << output;
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(output, HasSubstr(absl::StrCat("[rank ", r, "] [  PASSED  ]"))) << output;
  }
  EXPECT_THAT(output, ::testing::Not(HasSubstr("SKIPPED"))) << output;
}
#endif

// DTENSOR_DEBUG=1 while the communicators are made; restored afterwards.
class ScopedDebugEnv {
 public:
  ScopedDebugEnv() { setenv("DTENSOR_DEBUG", "1", 1); }
  ~ScopedDebugEnv() { unsetenv("DTENSOR_DEBUG"); }
};

TEST(NcclTest, DebugModeLetsMatchingCallsThrough) {
  SKIP_WITHOUT_GPUS(1);
  ScopedDebugEnv debug;
  SingleRank world;
  CommPtr& comm = world.comm;
  ASSERT_NE(comm, nullptr);
  const Tensor x = Unwrap(Full({7}, 2.0, DType::kFloat32, Device::Cuda(0)));
  ASSERT_OK(comm->AllReduce(x, x, CommReduceOp::kSum));
  EXPECT_EQ(Values(x), std::vector<double>(7, 2.0));
  ASSERT_OK(comm->Barrier());
}

TEST(NcclTest, MultiRankDebugModeReportsMismatchedCallsOnEveryRank) {
  SKIP_WITHOUT_MULTI_RANK();
  ScopedDebugEnv debug;
  const int world = MultiWorld();
  RunRanks(world, [&](int rank, Communicator& comm) {
    absl::Status s;
    if (rank == 1) {
      const Tensor in = Unwrap(Full({3}, 1.0, DType::kFloat32, RankDevice(rank)));
      const Tensor out = Unwrap(Tensor::Empty({3 * world}, DType::kFloat32, RankDevice(rank)));
      s = comm.AllGather(in, out);
    } else {
      const Tensor x = Unwrap(Full({12}, 1.0, DType::kFloat32, RankDevice(rank)));
      s = comm.AllReduce(x, x, CommReduceOp::kSum);
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("[Debug]"));
    EXPECT_THAT(s.message(), HasSubstr("AllReduce(float32, 12 elements, sum)"));
    EXPECT_THAT(s.message(), HasSubstr("AllGather(float32, 3 elements)"));
    // Nothing moved: the communicator is still usable for a matching call.
    const Tensor y = Unwrap(Full({4}, 1.0, DType::kFloat32, RankDevice(rank)));
    ASSERT_TRUE(comm.AllReduce(y, y, CommReduceOp::kSum).ok());
    EXPECT_EQ(Values(y), std::vector<double>(4, world));
  });
}

}  // namespace
}  // namespace dtensor
