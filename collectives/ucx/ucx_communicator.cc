#include "dtensor/collectives/ucx/ucx_communicator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/collectives/checks.h"
#include "dtensor/collectives/store/cpus.h"
#include "dtensor/collectives/ucx/ucx_shm.h"
#include "dtensor/collectives/ucx/ucx_transport.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace internal {
namespace {

constexpr size_t kSmallBytes = size_t{64} << 10;  // below: one-hop algorithms
constexpr size_t kMinChunk = size_t{64} << 10;
constexpr size_t kMaxChunk = size_t{1} << 20;
constexpr uint32_t kAllGatherSteps = 0x8000;  // AllReduce's all-gather phase numbers its messages from here
constexpr int kMaxCommId = 0x7fff;
constexpr int kMaxShmRanks = 64;                          // larger groups on one host use UCX
constexpr size_t kShmFullReduceBytes = size_t{16} << 10;  // below: every rank reduces everything
// The same with ranks sharing cores: there the p-fold reduction work of every rank reducing
// everything costs more than the sliced loop's extra Sync from 16 KiB on (4 ranks on 2 cores,
// medians of 8 interleaved runs: 16 KiB 19.2 against 16.4 us; 8 KiB 12.0 against 13.7 us).
constexpr size_t kShmFullReduceOversubscribedBytes = size_t{8} << 10;
// Blocks from this size are read from the peers' memory (one copy, two Syncs) rather than
// passed through the slots (two copies, a Sync per slot): 2 ranks, 64 KiB all_to_all 3.9-5.2
// against 6.7-6.9 us, all_reduce 7-10 against 12.5-14 us; no gain below (compare.sh, 2026-11-25).
// Ranks sharing cores (4 on 2) lost at 16 KiB blocks (64 KiB all_reduce / all_gather 0.75x Open
// MPI against 1.15-1.5x through the slots) and at 64 KiB blocks (256 KiB all_gather 47-50 us
// against 36-44; all_to_all even); from 256 KiB blocks single copy wins (1 MiB all_to_all
// 226-287 against 296-313 us): they start from 128 KiB.
constexpr size_t kCmaMinBytes = size_t{16} << 10;
constexpr size_t kCmaMinOversubscribedBytes = size_t{128} << 10;
// From peers' shared blocks (mapped: memcpy, no system call) single copy wins from smaller
// blocks, on any rank count: 2 ranks, 16 KiB all_to_all 1.40 -> 0.55 us, reduce_scatter
// 1.44 -> 0.55 us; 4 ranks on 2 cores, 32 KiB all_reduce 14.1 -> 7.3 us (paired medians of
// alternating runs, 2026-11-26).
constexpr size_t kZeroCopyMinBytes = size_t{8} << 10;
constexpr size_t kCmaChunk = size_t{256} << 10;  // CmaReduce's step per peer (in cache)
// Broadcasts of up to this many bytes go through the root's ring places when ranks share CPUs
// (ShmBroadcast); 4 ranks on 2 cores: 1 MiB even with single copy, 256 KiB 10-20% faster.
constexpr size_t kSharedCpuRingBroadcastBytes = size_t{256} << 10;
// Larger blocks reduce through the slots: the kernel's copy (process_vm_readv ~9.5 GB/s into
// cache here) is slower than memcpy (~23 GB/s), which the peers run in parallel. 2 ranks, 16 MiB
// all_reduce: CmaReduce 3.9-5.0 ms, slots + written result 3.1-3.3 ms; 4 MiB: 0.61-0.63 against
// 0.66-0.69 ms.
constexpr size_t kCmaReduceMaxBytes = size_t{2} << 20;
// Ranks of one host move data through the shared-memory channel at every size: it beat UCX's
// zero-copy (CMA) rendezvous for gather, all-to-all and broadcast on 2 ranks too, from 64 KiB
// to 64 MiB (1.1-1.8x Open MPI's busbw there, where the CMA path gave 0.75-1.2x; compare.sh,
// 2026-11-22), so there is no size threshold.

// ---------------------------------------------------------------------------------------------
// Validation (local to one rank).

absl::Status CheckTensor(const char* op, int rank, const char* name, const Tensor& t) {
  if (t.defined() && !t.device().is_cpu()) {
    return absl::UnimplementedError(absl::StrCat("[", op, "] rank ", rank, ": ", name, " is on ", t.device().ToString(),
                                                 "; the ucx backend moves CPU tensors only (use the nccl backend)"));
  }
  return CheckContiguous(op, rank, name, t);
}

absl::Status CheckPair(const char* op, int rank, const Tensor& in, const Tensor& out) {
  DT_RETURN_IF_ERROR(CheckTensor(op, rank, "input", in));
  DT_RETURN_IF_ERROR(CheckTensor(op, rank, "output", out));
  return CheckSameDType(op, rank, in, out);
}

bool Overlap(const char* a, size_t an, const char* b, size_t bn) {
  return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

char* Bytes(const Tensor& t) { return static_cast<char*>(t.raw_data()); }

// Per-rank numbers of one call, inline up to 8 ranks (no allocation on the small-message path).
using Counts = absl::InlinedVector<int64_t, 8>;

// Byte blocks of a collective: block j is [off[j], off[j] + len[j]).
struct Blocks {
  absl::InlinedVector<size_t, 8> off, len;
  size_t total = 0;
  size_t max_len = 0;
};

Blocks MakeBlocks(absl::Span<const int64_t> counts, size_t es) {
  Blocks b;
  b.off.reserve(counts.size());
  b.len.reserve(counts.size());
  for (int64_t c : counts) {
    b.off.push_back(b.total);
    b.len.push_back(static_cast<size_t>(c) * es);
    b.total += b.len.back();
    b.max_len = std::max(b.max_len, b.len.back());
  }
  return b;
}

// torch.chunk-like even split of n elements over p ranks (the first n % p get one more).
Counts EvenCounts(int64_t n, int p) {
  Counts c(static_cast<size_t>(p), n / p);
  for (int64_t i = 0; i < n % p; ++i) c[static_cast<size_t>(i)] += 1;
  return c;
}

// Pipelining chunk: a quarter of the largest block, within [64 KiB, 1 MiB], whole elements.
size_t ChunkBytes(size_t max_len, size_t es) {
  size_t c = std::clamp(max_len / 4, kMinChunk, kMaxChunk);
  return c / es * es;
}

size_t NumChunks(size_t len, size_t chunk) { return (len + chunk - 1) / chunk; }

// ---------------------------------------------------------------------------------------------
// DTENSOR_DEBUG=1: before each collective the ranks exchange what they were called with.

constexpr const char* kOpNames[] = {
    "?",         "AllReduce", "AllGather", "AllGatherV", "ReduceScatter", "ReduceScatterV", "AllToAll",
    "AllToAllV", "Broadcast", "Barrier",   "Split",      "Setup",         "AllToAllBlocks"};

// Fixed size, plain integers: sent as bytes between ranks.
struct CallDesc {
  int32_t op = 0;       // index in kOpNames
  int32_t dtype = -1;   // DType, or -1
  int32_t reduce = -1;  // CommReduceOp, or -1
  int32_t root = -1;    // Broadcast's root
  int64_t numel = -1;   // elements every rank must agree on, or -1
  uint64_t counts_hash = 0;
};

CallDesc Describe(const char* op, const Tensor* t = nullptr, int64_t numel = -1, int reduce = -1, int root = -1,
                  absl::Span<const int64_t> counts = {}) {
  CallDesc d;
  for (size_t i = 0; i < std::size(kOpNames); ++i) {
    if (std::strcmp(op, kOpNames[i]) == 0) d.op = static_cast<int32_t>(i);
  }
  if (t != nullptr) d.dtype = static_cast<int32_t>(t->dtype());
  d.reduce = reduce;
  d.root = root;
  d.numel = numel;
  uint64_t h = 1469598103934665603ull;
  for (int64_t c : counts) h = (h ^ static_cast<uint64_t>(c)) * 1099511628211ull;
  d.counts_hash = counts.empty() ? 0 : h;
  return d;
}

bool SameCall(const CallDesc& a, const CallDesc& b) {
  return a.op == b.op && a.dtype == b.dtype && a.reduce == b.reduce && a.root == b.root && a.numel == b.numel &&
         a.counts_hash == b.counts_hash;
}

// "AllReduce(float32, 12 elements, sum)".
std::string CallString(const CallDesc& d) {
  const char* op = d.op >= 0 && static_cast<size_t>(d.op) < std::size(kOpNames) ? kOpNames[d.op] : "?";
  std::vector<std::string> parts;
  if (d.dtype >= 0) parts.push_back(DTypeName(static_cast<DType>(d.dtype)));
  if (d.numel >= 0) parts.push_back(absl::StrCat(d.numel, d.numel == 1 ? " element" : " elements"));
  if (d.counts_hash != 0) parts.push_back(absl::StrCat("counts #", absl::Hex(d.counts_hash & 0xffff)));
  if (d.reduce >= 0) parts.push_back(CommReduceOpName(static_cast<CommReduceOp>(d.reduce)));
  if (d.root >= 0) parts.push_back(absl::StrCat("root ", d.root));
  return absl::StrCat(op, "(", absl::StrJoin(parts, ", "), ")");
}

bool DebugFromEnv() {
  const char* v = std::getenv("DTENSOR_DEBUG");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// DTENSOR_UCX_INFO=1: rank 0 of each communicator prints the paths it agreed on (stderr).
bool InfoFromEnv() {
  const char* v = std::getenv("DTENSOR_UCX_INFO");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// DTENSOR_UCX_SHM=0 turns the shared-memory channel off (every byte goes through UCX).
bool ShmFromEnv() {
  const char* v = std::getenv("DTENSOR_UCX_SHM");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// DTENSOR_UCX_CMA=0 keeps every byte in the shared-memory slots (no single-copy reads).
bool CmaFromEnv() {
  const char* v = std::getenv("DTENSOR_UCX_CMA");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// DTENSOR_UCX_ZERO_COPY=0: large CPU tensors stay private memory, so single-copy steps copy
// through the kernel (dtensor/tensor/shared_cpu_block.h).
bool ZeroCopyFromEnv() {
  const char* v = std::getenv("DTENSOR_UCX_ZERO_COPY");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// Blocks of at least this many bytes are read from the peers' memory (ShmGroup::ReadPeer)
// rather than passed through the slots (kCmaMinBytes, or kCmaMinOversubscribedBytes when ranks
// share CPUs); DTENSOR_UCX_CMA_MIN=<bytes> overrides it (tests, tuning).
constexpr uint64_t kNoCmaMin = ~uint64_t{0};
std::optional<uint64_t> CmaMinFromEnv() {
  const char* v = std::getenv("DTENSOR_UCX_CMA_MIN");
  if (v == nullptr || v[0] == '\0') return std::nullopt;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (end == nullptr || *end != '\0' || n == kNoCmaMin) return std::nullopt;
  return static_cast<uint64_t>(n);
}

// A posted Send / Recv; Wait() progresses the worker until it completes.
class P2PWork final : public Work {
 public:
  P2PWork(std::shared_ptr<UcxWorld> world, UcxRequest req, Tensor keep, const char* op, int rank,
          absl::Duration timeout)
      : world_(std::move(world)),
        req_(std::move(req)),
        keep_(std::move(keep)),
        op_(op),
        rank_(rank),
        timeout_(timeout) {}
  // The comm thread may be running collectives on the same worker: each call waits for it.
  ~P2PWork() override {
    world_->comm_thread().Drain();
    if (!req_.done) world_->Orphan(std::move(req_), keep_.storage());
  }
  absl::Status Wait() override {
    world_->comm_thread().Drain();
    if (!waited_) {
      UcxWaitContext ctx{op_, rank_, timeout_};
      result_ = world_->Wait(req_, ctx);
      if (!result_.ok()) world_->Abandon(req_);
      waited_ = true;
    }
    return result_;
  }
  bool IsCompleted() override {
    if (waited_) return true;
    world_->comm_thread().Drain();
    return world_->Test(req_);
  }

 private:
  std::shared_ptr<UcxWorld> world_;
  UcxRequest req_;
  Tensor keep_;  // keeps the buffer alive while UCX may use it
  const char* op_;
  int rank_;
  absl::Duration timeout_;
  bool waited_ = false;
  absl::Status result_;
};

// Copies elements [start, start + count) of `view` (row-major order; a CPU tensor of any
// strides) to the contiguous bytes at `flat`, or from them when `into_view`.
void CopyRange(const Tensor& view, int64_t start, int64_t count, char* flat, bool into_view) {
  if (count <= 0) return;
  const size_t es = ElementSize(view.dtype());
  char* base = static_cast<char*>(view.raw_data());
  const int64_t nd = view.dim();
  // Dims [k, nd) form runs of `run` elements back to back in memory.
  int64_t run = 1, k = nd;
  if (nd > 0 && view.stride(nd - 1) == 1) {
    run = view.size(nd - 1);
    k = nd - 1;
    while (k > 0 && (view.size(k - 1) == 1 || view.stride(k - 1) == run)) run *= view.size(--k);
  }
  absl::InlinedVector<int64_t, 8> idx(static_cast<size_t>(k));  // the run's index over dims [0, k)
  int64_t q = start / run, o = start % run;
  for (int64_t i = k - 1; i >= 0; --i) {
    idx[static_cast<size_t>(i)] = q % view.size(i);
    q /= view.size(i);
  }
  while (count > 0) {
    int64_t off = o;
    for (int64_t i = 0; i < k; ++i) off += idx[static_cast<size_t>(i)] * view.stride(i);
    const int64_t n = std::min(run - o, count);
    char* at = base + off * static_cast<int64_t>(es);
    if (into_view) {
      std::memcpy(at, flat, static_cast<size_t>(n) * es);
    } else {
      std::memcpy(flat, at, static_cast<size_t>(n) * es);
    }
    flat += static_cast<size_t>(n) * es;
    count -= n;
    o = 0;
    for (int64_t i = k - 1; i >= 0; --i) {  // the next run, row-major
      if (++idx[static_cast<size_t>(i)] < view.size(i)) break;
      idx[static_cast<size_t>(i)] = 0;
    }
  }
}

// ---------------------------------------------------------------------------------------------

class UcxCommunicator final : public Communicator {
 public:
  UcxCommunicator(std::shared_ptr<UcxWorld> world, std::vector<int> members, int rank, uint16_t id,
                  absl::Duration timeout)
      : world_(std::move(world)),
        members_(std::move(members)),
        rank_(rank),
        id_(id),
        timeout_(timeout),
        send_seq_(members_.size(), 0),
        recv_seq_(members_.size(), 0) {}

  // Jobs on the comm thread use this communicator: they finish before it goes.
  ~UcxCommunicator() override { world_->comm_thread().Drain(); }

  void AdoptStore(std::unique_ptr<StoreClient> store) { store_ = std::move(store); }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  Device device() const override { return Device::Cpu(); }
  const char* backend() const override { return "ucx"; }
  void SetTimeout(absl::Duration timeout) override { timeout_ = timeout; }
  absl::Duration timeout() const override { return timeout_; }

  // The world's abort (ucx_transport.h): every communicator of this world, on every rank.
  void Abort(const absl::Status& why) override {
    world_->comm_thread().Drain();
    const int world_rank = members_[static_cast<size_t>(rank_)];
    world_->Abort(absl::AbortedError(
        absl::StrCat("rank ", rank_, world_rank == rank_ ? "" : absl::StrCat(" (world rank ", world_rank, ")"),
                     " aborted the communicator: ", why.ok() ? "no reason given" : why.ToString())));
    if (shm_ != nullptr) shm_->MarkFailed();
  }

  // Each collective: its checks, then either RunNow (the blocking form: on this thread) or
  // Submit (the *Async form: on the comm thread, with copies of what it uses).
  absl::Status CheckAllReduce(const Tensor& input, const Tensor& output, CommReduceOp op) const {
    constexpr const char* kOp = "AllReduce";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "output", output, input.numel(), "same as input"));
    return CheckReducible(kOp, rank_, input.dtype(), op);
  }
  absl::Status AllReduce(const Tensor& input, const Tensor& output, CommReduceOp op) override {
    DT_RETURN_IF_ERROR(CheckAllReduce(input, output, op));
    return RunNow(
        "AllReduce", [&] { return Describe("AllReduce", &input, input.numel(), static_cast<int>(op)); },
        [&] { return DoAllReduce(input, output, op); });
  }
  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const Tensor& input, const Tensor& output,
                                                       CommReduceOp op) override {
    DT_RETURN_IF_ERROR(CheckAllReduce(input, output, op));
    return Submit(
        "AllReduce", [input, op] { return Describe("AllReduce", &input, input.numel(), static_cast<int>(op)); },
        [this, input, output, op] { return DoAllReduce(input, output, op); });
  }

  absl::Status CheckAllGather(const Tensor& input, const Tensor& output) const {
    DT_RETURN_IF_ERROR(CheckPair("AllGather", rank_, input, output));
    return CheckNumel("AllGather", rank_, "output", output, size() * input.numel(), "size * input elements");
  }
  absl::Status AllGather(const Tensor& input, const Tensor& output) override {
    DT_RETURN_IF_ERROR(CheckAllGather(input, output));
    const Counts counts(members_.size(), input.numel());
    return RunNow(
        "AllGather", [&] { return Describe("AllGather", &input, input.numel()); },
        [&] { return DoAllGatherV(input, output, counts); });
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const Tensor& input, const Tensor& output) override {
    DT_RETURN_IF_ERROR(CheckAllGather(input, output));
    return Submit(
        "AllGather", [input] { return Describe("AllGather", &input, input.numel()); },
        [this, input, output, counts = Counts(members_.size(), input.numel())] {
          return DoAllGatherV(input, output, counts);
        });
  }

  absl::StatusOr<int64_t> CheckAllGatherV(const Tensor& input, const Tensor& output,
                                          absl::Span<const int64_t> counts) const {
    constexpr const char* kOp = "AllGatherV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckCounts(kOp, rank_, "counts", counts, size()));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "input", input, counts[static_cast<size_t>(rank_)], "counts[rank]"));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "output", output, total, "sum of counts"));
    return total;
  }
  absl::Status AllGatherV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts) override {
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckAllGatherV(input, output, counts));
    return RunNow(
        "AllGatherV", [&] { return Describe("AllGatherV", &input, total, -1, -1, counts); },
        [&] { return DoAllGatherV(input, output, counts); });
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherVAsync(const Tensor& input, const Tensor& output,
                                                        absl::Span<const int64_t> counts) override {
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckAllGatherV(input, output, counts));
    Counts c(counts.begin(), counts.end());
    return Submit(
        "AllGatherV", [input, total, c] { return Describe("AllGatherV", &input, total, -1, -1, c); },
        [this, input, output, c] { return DoAllGatherV(input, output, c); });
  }

  absl::Status CheckReduceScatter(const Tensor& input, const Tensor& output, CommReduceOp op) const {
    constexpr const char* kOp = "ReduceScatter";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "input", input, size() * output.numel(), "size * output elements"));
    return CheckReducible(kOp, rank_, input.dtype(), op);
  }
  absl::Status ReduceScatter(const Tensor& input, const Tensor& output, CommReduceOp op) override {
    DT_RETURN_IF_ERROR(CheckReduceScatter(input, output, op));
    const Counts counts(members_.size(), output.numel());
    return RunNow(
        "ReduceScatter", [&] { return Describe("ReduceScatter", &input, input.numel(), static_cast<int>(op)); },
        [&] { return DoReduceScatterV(input, output, counts, op); });
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const Tensor& input, const Tensor& output,
                                                           CommReduceOp op) override {
    DT_RETURN_IF_ERROR(CheckReduceScatter(input, output, op));
    return Submit(
        "ReduceScatter", [input, op] { return Describe("ReduceScatter", &input, input.numel(), static_cast<int>(op)); },
        [this, input, output, op, counts = Counts(members_.size(), output.numel())] {
          return DoReduceScatterV(input, output, counts, op);
        });
  }

  absl::StatusOr<int64_t> CheckReduceScatterV(const Tensor& input, const Tensor& output,
                                              absl::Span<const int64_t> counts, CommReduceOp op) const {
    constexpr const char* kOp = "ReduceScatterV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckCounts(kOp, rank_, "counts", counts, size()));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "input", input, total, "sum of counts"));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "output", output, counts[static_cast<size_t>(rank_)], "counts[rank]"));
    DT_RETURN_IF_ERROR(CheckReducible(kOp, rank_, input.dtype(), op));
    return total;
  }
  absl::Status ReduceScatterV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts,
                              CommReduceOp op) override {
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckReduceScatterV(input, output, counts, op));
    return RunNow(
        "ReduceScatterV", [&] { return Describe("ReduceScatterV", &input, total, static_cast<int>(op), -1, counts); },
        [&] { return DoReduceScatterV(input, output, counts, op); });
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterVAsync(const Tensor& input, const Tensor& output,
                                                            absl::Span<const int64_t> counts,
                                                            CommReduceOp op) override {
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckReduceScatterV(input, output, counts, op));
    Counts c(counts.begin(), counts.end());
    return Submit(
        "ReduceScatterV",
        [input, total, op, c] { return Describe("ReduceScatterV", &input, total, static_cast<int>(op), -1, c); },
        [this, input, output, c, op] { return DoReduceScatterV(input, output, c, op); });
  }

  absl::Status CheckAllToAll(const Tensor& input, const Tensor& output) const {
    constexpr const char* kOp = "AllToAll";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    if (input.numel() % size() != 0) {
      return InvalidArg(kOp, "rank ", rank_, ": input has ", input.numel(),
                        " elements, not divisible by the group size ", size());
    }
    return CheckNumel(kOp, rank_, "output", output, input.numel(), "same as input");
  }
  absl::Status AllToAll(const Tensor& input, const Tensor& output) override {
    DT_RETURN_IF_ERROR(CheckAllToAll(input, output));
    const Counts counts(members_.size(), input.numel() / size());
    return RunNow(
        "AllToAll", [&] { return Describe("AllToAll", &input, input.numel()); },
        [&] { return DoAllToAllV(input, output, counts, counts, /*uniform=*/true); });
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllAsync(const Tensor& input, const Tensor& output) override {
    DT_RETURN_IF_ERROR(CheckAllToAll(input, output));
    return Submit(
        "AllToAll", [input] { return Describe("AllToAll", &input, input.numel()); },
        [this, input, output, counts = Counts(members_.size(), input.numel() / size())] {
          return DoAllToAllV(input, output, counts, counts, /*uniform=*/true);
        });
  }

  absl::Status CheckAllToAllV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> send_counts,
                              absl::Span<const int64_t> recv_counts) const {
    constexpr const char* kOp = "AllToAllV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t sent, CheckCounts(kOp, rank_, "send_counts", send_counts, size()));
    DT_ASSIGN_OR_RETURN(const int64_t received, CheckCounts(kOp, rank_, "recv_counts", recv_counts, size()));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "input", input, sent, "sum of send_counts"));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "output", output, received, "sum of recv_counts"));
    const size_t r = static_cast<size_t>(rank_);
    if (send_counts[r] != recv_counts[r]) {
      return InvalidArg(kOp, "rank ", rank_, ": send_counts[", rank_, "] is ", send_counts[r], " but recv_counts[",
                        rank_, "] is ", recv_counts[r], " (what a rank sends itself)");
    }
    return absl::OkStatus();
  }
  absl::Status AllToAllV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> send_counts,
                         absl::Span<const int64_t> recv_counts) override {
    DT_RETURN_IF_ERROR(CheckAllToAllV(input, output, send_counts, recv_counts));
    return RunNow(
        "AllToAllV", [&] { return Describe("AllToAllV", &input); },
        [&] { return DoAllToAllV(input, output, send_counts, recv_counts); });
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(const Tensor& input, const Tensor& output,
                                                       absl::Span<const int64_t> send_counts,
                                                       absl::Span<const int64_t> recv_counts) override {
    DT_RETURN_IF_ERROR(CheckAllToAllV(input, output, send_counts, recv_counts));
    return Submit(
        "AllToAllV", [input] { return Describe("AllToAllV", &input); },
        [this, input, output, sc = Counts(send_counts.begin(), send_counts.end()),
         rc = Counts(recv_counts.begin(), recv_counts.end())] { return DoAllToAllV(input, output, sc, rc); });
  }

  // A collective on this thread, once the comm thread is idle (the two never use the worker at
  // once, and calls keep their order).
  template <typename D, typename F>
  absl::Status RunNow(const char* op, D&& describe, F&& body) {
    world_->comm_thread().Drain();
    return Run(op, describe, body);
  }
  // A job for the comm thread; `describe` and `body` own what they use (capture by value).
  template <typename D, typename F>
  std::unique_ptr<Work> Submit(const char* op, D describe, F body) {
    return world_->comm_thread().Submit([this, op, describe = std::move(describe), body = std::move(body)]() mutable {
      return Run(op, describe, body);
    });
  }

  // Without `uniform` the ranks first exchange their block counts (one small all-gather):
  // every rank checks every sender's count against its receiver's, so a mismatch is
  // InvalidArgument on every rank (the communicator stays usable). Then, among ranks of one
  // host: ShmAllToAll's steps (as many as the largest block needs), each window copied
  // straight from the send view into this rank's slot and from the peers' slots into the
  // receive views (nothing packed or unpacked); between hosts: the default (pack, AllToAll(V),
  // unpack).
  absl::Status AllToAllBlocks(absl::Span<const Tensor> sends, absl::Span<const Tensor> recvs, bool uniform) override {
    world_->comm_thread().Drain();
    constexpr const char* kOp = "AllToAllBlocks";
    DT_ASSIGN_OR_RETURN(const DType dtype, CheckBlocks(kOp, rank_, sends, recvs, size()));
    if (uniform) DT_RETURN_IF_ERROR(CheckUniformBlocks(kOp, rank_, sends, recvs));
    for (size_t j = 0; j < sends.size(); ++j) {
      for (const auto& [name, t] : {std::pair{"sends", &sends[j]}, std::pair{"recvs", &recvs[j]}}) {
        if (t->device() != Device::Cpu()) {
          return InvalidArg(kOp, "rank ", rank_, ": ", name, "[", j, "] is on ", t->device().ToString(),
                            "; the ucx backend moves CPU tensors only");
        }
      }
    }
    int64_t longest = sends[0].numel();
    if (!uniform) {
      DT_ASSIGN_OR_RETURN(longest, ExchangeBlockCounts(kOp, sends, recvs));
    }
    if (shm_ == nullptr) return Communicator::AllToAllBlocks(sends, recvs, uniform);
    // A send view that may share bytes with a receive view is copied first: the receive views
    // are written window by window while later windows of the sends are still to be read.
    std::vector<Tensor> staged(sends.begin(), sends.end());
    for (Tensor& t : staged) {
      for (const Tensor& v : recvs) {
        if (internal::Overlap(t, v)) {
          DT_ASSIGN_OR_RETURN(t, Clone(t));
          break;
        }
      }
    }
    const auto d = [&] { return Describe(kOp, &sends[0], uniform ? longest : -1); };
    return Run(kOp, d, [&] { return ShmAllToAllBlocks(staged, recvs, longest, ElementSize(dtype)); });
  }

  // Every rank's send and receive counts to every rank (an all-gather of 2 x size integers);
  // InvalidArgument on every rank when a sender's count differs from its receiver's (the
  // communicator stays usable); else the largest count.
  absl::StatusOr<int64_t> ExchangeBlockCounts(const char* op, absl::Span<const Tensor> sends,
                                              absl::Span<const Tensor> recvs) {
    const size_t p = members_.size();
    std::vector<int64_t> mine(2 * p), all(2 * p * p);
    for (size_t j = 0; j < p; ++j) {
      mine[j] = sends[j].numel();
      mine[p + j] = recvs[j].numel();
    }
    DT_RETURN_IF_ERROR(Run(
        op, [&] { return Describe(op); },
        [&] {
          return GatherBytes(reinterpret_cast<const char*>(mine.data()), reinterpret_cast<char*>(all.data()),
                             MakeBlocks(Counts(p, static_cast<int64_t>(2 * p)), sizeof(int64_t)));
        }));
    int64_t longest = 0;
    for (size_t i = 0; i < p; ++i) {
      for (size_t j = 0; j < p; ++j) {
        const int64_t sent = all[i * 2 * p + j], expected = all[j * 2 * p + p + i];
        if (sent != expected) {
          return InvalidArg(op, "rank ", rank_, ": rank ", i, " sends ", sent, " elements to rank ", j,
                            ", which expects ", expected, " (sends[", j, "] on rank ", i, " vs recvs[", i, "] on rank ",
                            j, ")");
        }
        longest = std::max(longest, sent);
      }
    }
    return longest;
  }

  absl::Status CheckBroadcast(const Tensor& tensor, int root) const {
    DT_RETURN_IF_ERROR(CheckTensor("Broadcast", rank_, "tensor", tensor));
    return CheckPeer("Broadcast", rank_, "root", root, size());
  }
  absl::Status Broadcast(const Tensor& tensor, int root) override {
    DT_RETURN_IF_ERROR(CheckBroadcast(tensor, root));
    return RunNow(
        "Broadcast", [&] { return Describe("Broadcast", &tensor, tensor.numel(), -1, root); },
        [&] { return DoBroadcast(Bytes(tensor), tensor.nbytes(), root); });
  }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(const Tensor& tensor, int root) override {
    DT_RETURN_IF_ERROR(CheckBroadcast(tensor, root));
    return Submit(
        "Broadcast", [tensor, root] { return Describe("Broadcast", &tensor, tensor.numel(), -1, root); },
        [this, tensor, root] { return DoBroadcast(Bytes(tensor), tensor.nbytes(), root); });
  }

  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const Tensor& tensor, int peer) override {
    return PostP2P("Send", tensor, peer, /*is_send=*/true);
  }
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(const Tensor& tensor, int peer) override {
    return PostP2P("Recv", tensor, peer, /*is_send=*/false);
  }

  absl::Status Barrier() override {
    world_->comm_thread().Drain();
    return Run(
        "Barrier", [&] { return Describe("Barrier"); }, [&] { return DoBarrier(); });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    world_->comm_thread().Drain();
    std::vector<int64_t> all(3 * members_.size());
    absl::Status s = Run(
        "Split", [&] { return Describe("Split"); },
        [&] {
          const int64_t mine[3] = {color, key, world_->next_comm_id()};
          const Blocks b = MakeBlocks(std::vector<int64_t>(members_.size(), 3), sizeof(int64_t));
          return GatherBytes(reinterpret_cast<const char*>(mine), reinterpret_cast<char*>(all.data()), b);
        });
    DT_RETURN_IF_ERROR(s);
    int64_t base = 0;
    std::vector<int64_t> colors;
    for (size_t j = 0; j < members_.size(); ++j) {
      base = std::max(base, all[3 * j + 2]);
      if (all[3 * j] >= 0) colors.push_back(all[3 * j]);
    }
    std::sort(colors.begin(), colors.end());
    colors.erase(std::unique(colors.begin(), colors.end()), colors.end());
    if (base + static_cast<int64_t>(colors.size()) > kMaxCommId) {
      return absl::ResourceExhaustedError(
          absl::StrCat("[Split] rank ", rank_, ": out of ucx communicator ids (", kMaxCommId, " per process)"));
    }
    world_->set_next_comm_id(static_cast<uint16_t>(base + static_cast<int64_t>(colors.size())));
    if (color < 0) return std::unique_ptr<Communicator>();
    std::vector<std::pair<int64_t, int>> order;  // (key, rank) of my color
    for (size_t j = 0; j < members_.size(); ++j) {
      if (all[3 * j] == color) order.emplace_back(all[3 * j + 1], static_cast<int>(j));
    }
    std::sort(order.begin(), order.end());
    std::vector<int> members;
    int new_rank = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      if (order[i].second == rank_) new_rank = static_cast<int>(i);
      members.push_back(members_[static_cast<size_t>(order[i].second)]);
    }
    const int64_t index = std::lower_bound(colors.begin(), colors.end(), color) - colors.begin();
    auto child = std::make_unique<UcxCommunicator>(world_, std::move(members), new_rank,
                                                   static_cast<uint16_t>(base + index), timeout_);
    DT_RETURN_IF_ERROR(child->Setup());
    return std::unique_ptr<Communicator>(std::move(child));
  }

  // Collective over this communicator, once, before any other call: the ranks agree on every
  // setting that picks an algorithm, so that all of them take the same path whatever each one's
  // environment or CPU affinity says (ranks on different paths would deadlock or read each
  // other's buffers as the wrong thing). DTENSOR_DEBUG on any rank turns the checks on for all.
  // Maps a shared-memory segment when every rank is on this host and none refuses it
  // (DTENSOR_UCX_SHM=0), and uses it when all of them got it; single copy when every rank
  // wants it and can (ShmGroup::SetupCma); one single-copy threshold, the largest that any
  // rank's DTENSOR_UCX_CMA_MIN asks for, else the default for ranks that share CPUs. Ranks
  // share CPUs unless their affinity masks give each one a CPU of its own (RanksHaveOwnCpus:
  // ranks bound to one core each by dtrun, or unbound ranks no more than the host's CPUs).
  absl::Status Setup() {
    if (size() == 1) return absl::OkStatus();
    bool eligible = size() <= kMaxShmRanks && ShmFromEnv();
    for (int m : members_) eligible = eligible && world_->OnThisHost(m);
    char name[96] = {};
    std::unique_ptr<ShmGroup> group;
    if (rank_ == 0 && eligible) {
      const std::string n = ShmGroup::NewName(id_);
      absl::StatusOr<std::unique_ptr<ShmGroup>> g = ShmGroup::Map(n, /*create=*/true, rank_, members_, world_.get());
      if (g.ok()) {
        group = *std::move(g);
        std::memcpy(name, n.data(), std::min(n.size(), sizeof(name) - 1));
      } else {
        WarnNoShm(g.status());
      }
    }
    struct Offer {
      uint64_t mapped;     // 1: this rank mapped the segment
      uint64_t debug;      // 1: DTENSOR_DEBUG
      uint64_t cma_min;    // DTENSOR_UCX_CMA_MIN, or kNoCmaMin
      uint64_t zero_copy;  // 1: DTENSOR_UCX_ZERO_COPY is not 0
      uint64_t barrier;    // 1: this process can make every CPU fence (ShmGroup::RegisterProcessBarrier)
      uint64_t ncpus;      // entries of cpus
      // The first (up to kMaxShmRanks) CPUs this process may use: enough to decide whether
      // every rank has a CPU of its own (a rank with as many CPUs as ranks always has one).
      int32_t cpus[kMaxShmRanks];
    };
    std::vector<Offer> all(members_.size());
    const absl::Status s = Run(
        "Setup", [&] { return Describe("Setup"); },
        [&]() -> absl::Status {
          DT_RETURN_IF_ERROR(DoBroadcast(name, sizeof(name), 0));
          if (rank_ != 0 && eligible && name[0] != '\0') {
            absl::StatusOr<std::unique_ptr<ShmGroup>> g =
                ShmGroup::Map(name, /*create=*/false, rank_, members_, world_.get());
            if (g.ok()) {
              group = *std::move(g);
            } else {
              WarnNoShm(g.status());
            }
          }
          Offer mine{group != nullptr ? 1u : 0u,
                     DebugFromEnv() ? 1u : 0u,
                     CmaMinFromEnv().value_or(kNoCmaMin),
                     ZeroCopyFromEnv() ? 1u : 0u,
                     group != nullptr && ShmGroup::RegisterProcessBarrier() ? 1u : 0u,
                     0,
                     {}};
          for (int c : AllowedCpus()) {
            if (mine.ncpus == kMaxShmRanks) break;
            mine.cpus[mine.ncpus++] = c;
          }
          return GatherBytes(reinterpret_cast<const char*>(&mine), reinterpret_cast<char*>(all.data()),
                             MakeBlocks(std::vector<int64_t>(members_.size(), sizeof(Offer)), 1));
        });
    if (rank_ == 0 && name[0] != '\0') ShmGroup::Unlink(name);  // every rank has it mapped (or gave up)
    DT_RETURN_IF_ERROR(s);
    debug_ = std::any_of(all.begin(), all.end(), [](const Offer& o) { return o.debug != 0; });
    if (!std::all_of(all.begin(), all.end(), [](const Offer& o) { return o.mapped != 0; })) {
      if (rank_ == 0 && InfoFromEnv()) {
        std::fprintf(stderr, "dtensor ucx: communicator %d, %d ranks: over UCX only (%s)\n", static_cast<int>(id_),
                     size(),
                     !eligible ? "ranks on several hosts, more than 64, or DTENSOR_UCX_SHM=0"
                               : "not every rank mapped the shared-memory segment");
      }
      return absl::OkStatus();
    }
    std::vector<std::vector<int>> cpus(all.size());
    for (size_t j = 0; j < all.size(); ++j) {
      cpus[j].assign(all[j].cpus, all[j].cpus + std::min<uint64_t>(all[j].ncpus, kMaxShmRanks));
    }
    const bool oversubscribed = !RanksHaveOwnCpus(cpus);
    uint64_t cma_min = kNoCmaMin;
    for (const Offer& o : all) {
      if (o.cma_min != kNoCmaMin) cma_min = cma_min == kNoCmaMin ? o.cma_min : std::max(cma_min, o.cma_min);
    }
    shm_ = std::move(group);
    shm_->set_oversubscribed(oversubscribed);
    // Ranks that share CPUs sleep at almost every wait: a barrier on every CPU each time would
    // cost more than the fences it saves.
    shm_->set_light_arrive(!oversubscribed &&
                           std::all_of(all.begin(), all.end(), [](const Offer& o) { return o.barrier != 0; }));
    cma_min_ = cma_min != kNoCmaMin ? static_cast<size_t>(cma_min)
                                    : (oversubscribed ? kCmaMinOversubscribedBytes : kCmaMinBytes);
    zero_copy_min_ = cma_min != kNoCmaMin ? static_cast<size_t>(cma_min) : kZeroCopyMinBytes;
    DT_RETURN_IF_ERROR(Run(
        "Setup", [&] { return Describe("Setup"); }, [&] { return shm_->SetupCma(CmaFromEnv(), ctx_); }));
    // Large CPU tensors allocated from now on can be mapped by the peers (single-copy steps
    // then copy with memcpy), where every rank wants it. Which buffers are shared still
    // differs (tensors made before, memory not from the allocator): the peers adapt per buffer.
    zero_copy_ = shm_->cma() && std::all_of(all.begin(), all.end(), [](const Offer& o) { return o.zero_copy != 0; });
    if (zero_copy_) EnableSharedCpuBlocks();
    if (rank_ == 0 && InfoFromEnv()) {
      std::string where;
      for (size_t j = 0; j < cpus.size(); ++j) absl::StrAppend(&where, j == 0 ? "" : " | ", FormatCpuList(cpus[j]));
      std::fprintf(
          stderr,
          "dtensor ucx: communicator %d, %d ranks on one host: shared memory, single copy %s%s, %s (cpus %s), %s\n",
          static_cast<int>(id_), size(), shm_->cma() ? absl::StrCat("from ", cma_min_, " B blocks").c_str() : "off",
          zero_copy_ ? ", zero copy from shared blocks" : "", oversubscribed ? "ranks share CPUs" : "a CPU per rank",
          where.c_str(), shm_->light_arrive() ? "light arrivals" : "fenced arrivals");
    }
    return absl::OkStatus();
  }

 private:
  // Printed whatever DTENSOR_UCX_INFO says: the ranks of this host then move every byte
  // through UCX, several times slower for small and large messages alike.
  void WarnNoShm(const absl::Status& why) const {
    std::fprintf(stderr,
                 "dtensor ucx: warning: communicator %d, rank %d of %d: no shared-memory channel, collectives "
                 "among the ranks of this host go over UCX only (%s)\n",
                 static_cast<int>(id_), rank_, size(), std::string(why.message()).c_str());
  }

  // ---- Per-call plumbing ----

  // Runs one collective: checks the sticky failure, numbers the call, and on an error cancels
  // what is still in flight and fails the world.
  // With DTENSOR_DEBUG=1 the ranks first compare their calls (`describe()`, made only then); a mismatch is
  // InvalidArgument on every rank and leaves the communicator usable.
  template <typename D, typename F>
  absl::Status Run(const char* op, D&& describe, F&& body) {
    ctx_ = UcxWaitContext{op, rank_, timeout_};
    if (world_->PollAbort() || !world_->failure().ok()) {
      if (shm_ != nullptr) shm_->MarkFailed();  // peers waiting here give up at once
      return world_->Failed(ctx_);
    }
    reqs_.clear();
    absl::Status s;
    if (debug_ && size() > 1) {
      ++seq_;
      s = CheckCalls(describe());
      if (absl::IsInvalidArgument(s)) return s;
    }
    if (s.ok()) {
      ++seq_;
      reqs_.clear();
      if (shm_ != nullptr) shm_->TrackReleases();
      s = body();
    }
    if (!s.ok()) {
      world_->Abandon(reqs_);
      world_->Fail(s);
      if (shm_ != nullptr) shm_->MarkFailed();
    }
    reqs_.clear();
    return s;
  }

  absl::Status CheckCalls(const CallDesc& mine) {
    std::vector<CallDesc> all(members_.size());
    const Blocks b = MakeBlocks(Counts(members_.size(), 1), sizeof(CallDesc));
    DT_RETURN_IF_ERROR(GatherBytes(reinterpret_cast<const char*>(&mine), reinterpret_cast<char*>(all.data()), b));
    for (size_t j = 0; j < all.size(); ++j) {
      if (!SameCall(all[j], mine)) {
        return absl::InvalidArgumentError(absl::StrCat("[Debug] rank ", rank_, " called ", CallString(mine),
                                                       " but rank ", j, " called ", CallString(all[j])));
      }
    }
    return absl::OkStatus();
  }

  int Mod(int i) const { return (i % size() + size()) % size(); }

  uint64_t Tag(int src, uint32_t step) const {
    return (uint64_t{id_} << 48) | (static_cast<uint64_t>(src) << 32) | (uint64_t{seq_ & 0xffffu} << 16) |
           (step & 0xffffu);
  }

  absl::Status Send(int peer, uint32_t step, const void* buf, size_t bytes) {
    DT_ASSIGN_OR_RETURN(
        UcxRequest r, world_->PostSend(ctx_, peer, members_[static_cast<size_t>(peer)], Tag(rank_, step), buf, bytes));
    reqs_.push_back(std::move(r));
    return absl::OkStatus();
  }
  // Posts a receive; its index in reqs_ goes to *index.
  absl::Status Recv(int peer, uint32_t step, void* buf, size_t bytes, size_t* index = nullptr) {
    DT_ASSIGN_OR_RETURN(UcxRequest r,
                        world_->PostRecv(ctx_, peer, members_[static_cast<size_t>(peer)], Tag(peer, step), buf, bytes));
    if (index != nullptr) *index = reqs_.size();
    reqs_.push_back(std::move(r));
    return absl::OkStatus();
  }
  absl::Status WaitOne(size_t index) { return world_->Wait(reqs_[index], ctx_); }
  absl::Status WaitAll() {
    for (UcxRequest& r : reqs_) DT_RETURN_IF_ERROR(world_->Wait(r, ctx_));
    reqs_.clear();
    return absl::OkStatus();
  }

  char* Scratch(size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }
  // A private copy of `bytes` at src (inputs that partly overlap their output).
  const char* Stage(const char* src, size_t bytes) {
    if (stage_.size() < bytes) stage_.resize(bytes);
    std::memcpy(stage_.data(), src, bytes);
    return stage_.data();
  }

  // ---- Algorithms on bytes ----

  // out gets every rank's block at b.off; this rank's block comes from in.
  // `in` overlaps no other rank's block of out (DoAllGatherV stages it otherwise).
  absl::Status GatherBytes(const char* in, char* out, const Blocks& b) {
    const size_t r = static_cast<size_t>(rank_);
    auto copy_mine = [&] {
      if (out + b.off[r] != in && b.len[r] > 0) std::memmove(out + b.off[r], in, b.len[r]);
    };
    const bool direct = shm_ == nullptr && size() > 1 && (b.total < kSmallBytes || size() == 2);
    if (shm_ != nullptr) return ShmGather(in, out, b);  // copies this rank's block while it waits
    if (!direct) {
      copy_mine();
      if (size() == 1) return absl::OkStatus();
      return RingAllGather(out, b, 0);
    }
    // Every block straight to every peer: post the transfers (sent from `in`), copy this
    // rank's own block while they run, then wait.
    for (int j = 0; j < size(); ++j) {
      if (j != rank_ && b.len[static_cast<size_t>(j)] > 0) {
        DT_RETURN_IF_ERROR(Recv(j, 0, out + b.off[static_cast<size_t>(j)], b.len[static_cast<size_t>(j)]));
      }
    }
    if (b.len[r] > 0) {
      for (int k = 1; k < size(); ++k) DT_RETURN_IF_ERROR(Send(Mod(rank_ + k), 0, in, b.len[r]));
    }
    copy_mine();
    return WaitAll();
  }

  // Ring all-gather in place on out (this rank's block already there). At step s rank r sends
  // block r - s to the right and receives block r - s - 1 from the left, chunk by chunk, and
  // forwards each received chunk as soon as it lands.
  absl::Status RingAllGather(char* out, const Blocks& b, uint32_t step_base) {
    const int left = Mod(rank_ - 1), right = Mod(rank_ + 1);
    const size_t chunk = ChunkBytes(b.max_len, 8);
    std::vector<size_t> recvs;
    uint32_t k = step_base;
    for (int s = 0; s + 1 < size(); ++s) {
      const size_t blk = static_cast<size_t>(Mod(rank_ - s - 1));
      for (size_t c = 0; c < NumChunks(b.len[blk], chunk); ++c) {
        const size_t at = c * chunk;
        size_t idx;
        DT_RETURN_IF_ERROR(Recv(left, k++, out + b.off[blk] + at, std::min(chunk, b.len[blk] - at), &idx));
        recvs.push_back(idx);
      }
    }
    uint32_t ks = step_base;
    const size_t mine = static_cast<size_t>(rank_);
    for (size_t c = 0; c < NumChunks(b.len[mine], chunk); ++c) {
      const size_t at = c * chunk;
      DT_RETURN_IF_ERROR(Send(right, ks++, out + b.off[mine] + at, std::min(chunk, b.len[mine] - at)));
    }
    size_t next = 0;
    for (int s = 0; s + 1 < size(); ++s) {
      const size_t blk = static_cast<size_t>(Mod(rank_ - s - 1));
      for (size_t c = 0; c < NumChunks(b.len[blk], chunk); ++c) {
        DT_RETURN_IF_ERROR(WaitOne(recvs[next++]));
        if (s + 2 < size()) {
          const size_t at = c * chunk;
          DT_RETURN_IF_ERROR(Send(right, ks++, out + b.off[blk] + at, std::min(chunk, b.len[blk] - at)));
        }
      }
    }
    return WaitAll();
  }

  // Ring reduce-scatter: block `rank` of the reduction of every rank's `in` goes to out_block.
  // At step s rank r receives the partial of block r - s - 2 from the left, reduces its own
  // input into it and passes it on (the last step, block r, lands in out_block).
  absl::Status RingReduceScatter(const char* in, char* out_block, const Blocks& b, DType dtype, CommReduceOp op) {
    const size_t es = ElementSize(dtype);
    const int left = Mod(rank_ - 1), right = Mod(rank_ + 1);
    const size_t chunk = ChunkBytes(b.max_len, 8);
    char* acc = Scratch(b.total);
    std::vector<size_t> recvs;
    uint32_t k = 0;
    for (int s = 0; s + 1 < size(); ++s) {
      const size_t blk = static_cast<size_t>(Mod(rank_ - s - 2));
      for (size_t c = 0; c < NumChunks(b.len[blk], chunk); ++c) {
        const size_t at = c * chunk;
        size_t idx;
        DT_RETURN_IF_ERROR(Recv(left, k++, acc + b.off[blk] + at, std::min(chunk, b.len[blk] - at), &idx));
        recvs.push_back(idx);
      }
    }
    uint32_t ks = 0;
    const size_t first = static_cast<size_t>(Mod(rank_ - 1));
    for (size_t c = 0; c < NumChunks(b.len[first], chunk); ++c) {
      const size_t at = c * chunk;
      DT_RETURN_IF_ERROR(Send(right, ks++, in + b.off[first] + at, std::min(chunk, b.len[first] - at)));
    }
    size_t next = 0;
    for (int s = 0; s + 1 < size(); ++s) {
      const size_t blk = static_cast<size_t>(Mod(rank_ - s - 2));
      const bool last = s + 2 == size();
      for (size_t c = 0; c < NumChunks(b.len[blk], chunk); ++c) {
        DT_RETURN_IF_ERROR(WaitOne(recvs[next++]));
        const size_t at = c * chunk, len = std::min(chunk, b.len[blk] - at);
        char* partial = acc + b.off[blk] + at;
        const void* srcs[2] = {in + b.off[blk] + at, partial};
        const int64_t n = static_cast<int64_t>(len / es);
        if (last) {
          Reduce(dtype, op, srcs, 2, n, out_block + at, size());
        } else {
          Reduce(dtype, op, srcs, 2, n, partial, 0);
          DT_RETURN_IF_ERROR(Send(right, ks++, partial, len));
        }
      }
    }
    return WaitAll();
  }

  absl::Status DoAllReduce(const Tensor& input, const Tensor& output, CommReduceOp op) {
    const size_t bytes = input.nbytes();
    const size_t es = ElementSize(input.dtype());
    const char* in = Bytes(input);
    char* out = Bytes(output);
    if (bytes == 0) return absl::OkStatus();
    if (size() == 1) {
      const void* srcs[1] = {in};
      Reduce(input.dtype(), op, srcs, 1, input.numel(), out, 1);
      return absl::OkStatus();
    }
    if (in != out && Overlap(in, bytes, out, bytes)) in = Stage(in, bytes);
    if (shm_ != nullptr) return ShmAllReduce(in, out, input.numel(), input.dtype(), op);
    if (bytes < kSmallBytes || input.numel() < size()) {
      // Everyone sends its input to everyone; reduce in rank order (identical bits everywhere).
      char* all = Scratch(bytes * members_.size());
      for (int j = 0; j < size(); ++j) {
        if (j != rank_) DT_RETURN_IF_ERROR(Recv(j, 0, all + static_cast<size_t>(j) * bytes, bytes));
      }
      for (int k = 1; k < size(); ++k) DT_RETURN_IF_ERROR(Send(Mod(rank_ + k), 0, in, bytes));
      DT_RETURN_IF_ERROR(WaitAll());
      std::vector<const void*> srcs(members_.size());
      for (int j = 0; j < size(); ++j)
        srcs[static_cast<size_t>(j)] = j == rank_ ? in : all + static_cast<size_t>(j) * bytes;
      Reduce(input.dtype(), op, srcs.data(), size(), input.numel(), out, size());
      return absl::OkStatus();
    }
    const Blocks b = MakeBlocks(EvenCounts(input.numel(), size()), es);
    const size_t r = static_cast<size_t>(rank_);
    DT_RETURN_IF_ERROR(RingReduceScatter(in, out + b.off[r], b, input.dtype(), op));
    return RingAllGather(out, b, kAllGatherSteps);
  }

  absl::Status DoAllGatherV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts) {
    const Blocks b = MakeBlocks(counts, ElementSize(input.dtype()));
    const char* in = Bytes(input);
    char* out = Bytes(output);
    const size_t r = static_cast<size_t>(rank_);
    if (in != out + b.off[r] && Overlap(in, b.len[r], out, b.total)) in = Stage(in, b.len[r]);
    return GatherBytes(in, out, b);
  }

  absl::Status DoReduceScatterV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts,
                                CommReduceOp op) {
    const size_t es = ElementSize(input.dtype());
    const Blocks b = MakeBlocks(counts, es);
    const char* in = Bytes(input);
    char* out = Bytes(output);
    const size_t r = static_cast<size_t>(rank_);
    if (out != in + b.off[r] && Overlap(in, b.total, out, b.len[r])) in = Stage(in, b.total);
    if (size() == 1) {
      const void* srcs[1] = {in};
      Reduce(input.dtype(), op, srcs, 1, counts[0], out, 1);
      return absl::OkStatus();
    }
    if (shm_ != nullptr) return ShmReduceScatter(in, out, counts, b, input.dtype(), op);
    if (b.total < kSmallBytes) {
      // Every rank sends block j straight to rank j; reduce in rank order.
      char* all = Scratch(b.len[r] * members_.size());
      if (b.len[r] > 0) {
        for (int j = 0; j < size(); ++j) {
          if (j != rank_) DT_RETURN_IF_ERROR(Recv(j, 0, all + static_cast<size_t>(j) * b.len[r], b.len[r]));
        }
      }
      for (int k = 1; k < size(); ++k) {
        const size_t j = static_cast<size_t>(Mod(rank_ + k));
        if (b.len[j] > 0) DT_RETURN_IF_ERROR(Send(static_cast<int>(j), 0, in + b.off[j], b.len[j]));
      }
      DT_RETURN_IF_ERROR(WaitAll());
      std::vector<const void*> srcs(members_.size());
      for (size_t j = 0; j < members_.size(); ++j) srcs[j] = j == r ? in + b.off[r] : all + j * b.len[r];
      Reduce(input.dtype(), op, srcs.data(), size(), counts[r], out, size());
      return absl::OkStatus();
    }
    return RingReduceScatter(in, out, b, input.dtype(), op);
  }

  // uniform: every rank's blocks have one size (AllToAll), so the shared-memory channel, whose
  // steps every rank must count alike, can take it.
  absl::Status DoAllToAllV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> send_counts,
                           absl::Span<const int64_t> recv_counts, bool uniform = false) {
    const size_t es = ElementSize(input.dtype());
    const Blocks sb = MakeBlocks(send_counts, es), rb = MakeBlocks(recv_counts, es);
    const char* in = Bytes(input);
    char* out = Bytes(output);
    if (Overlap(in, sb.total, out, rb.total)) in = Stage(in, sb.total);
    if (shm_ != nullptr && uniform) {
      return ShmAllToAll(in, out, sb.max_len);
    }
    for (int j = 0; j < size(); ++j) {
      const size_t u = static_cast<size_t>(j);
      if (j != rank_ && rb.len[u] > 0) DT_RETURN_IF_ERROR(Recv(j, 0, out + rb.off[u], rb.len[u]));
    }
    for (int k = 1; k < size(); ++k) {
      const size_t j = static_cast<size_t>(Mod(rank_ + k));
      if (sb.len[j] > 0) DT_RETURN_IF_ERROR(Send(static_cast<int>(j), 0, in + sb.off[j], sb.len[j]));
    }
    const size_t r = static_cast<size_t>(rank_);
    if (sb.len[r] > 0) std::memmove(out + rb.off[r], in + sb.off[r], sb.len[r]);
    return WaitAll();
  }

  // Small: the root sends to everyone. Large: a chain root -> root + 1 -> ..., in chunks.
  absl::Status DoBroadcast(char* data, size_t bytes, int root) {
    if (bytes == 0 || size() == 1) return absl::OkStatus();
    if (shm_ != nullptr) return ShmBroadcast(data, bytes, root);
    if (bytes < kSmallBytes || size() == 2) {
      if (rank_ == root) {
        for (int k = 1; k < size(); ++k) DT_RETURN_IF_ERROR(Send(Mod(root + k), 0, data, bytes));
      } else {
        DT_RETURN_IF_ERROR(Recv(root, 0, data, bytes));
      }
      return WaitAll();
    }
    const size_t chunk = ChunkBytes(bytes, 8);
    const size_t n = NumChunks(bytes, chunk);
    const int pos = Mod(rank_ - root);
    const int prev = Mod(rank_ - 1), next = Mod(rank_ + 1);
    const bool forward = pos + 1 < size();
    if (pos == 0) {
      for (size_t c = 0; c < n; ++c) {
        DT_RETURN_IF_ERROR(Send(next, static_cast<uint32_t>(c), data + c * chunk, std::min(chunk, bytes - c * chunk)));
      }
      return WaitAll();
    }
    for (size_t c = 0; c < n; ++c) {
      DT_RETURN_IF_ERROR(Recv(prev, static_cast<uint32_t>(c), data + c * chunk, std::min(chunk, bytes - c * chunk)));
    }
    for (size_t c = 0; c < n; ++c) {
      DT_RETURN_IF_ERROR(WaitOne(c));
      if (forward) {
        DT_RETURN_IF_ERROR(Send(next, static_cast<uint32_t>(c), data + c * chunk, std::min(chunk, bytes - c * chunk)));
      }
    }
    return WaitAll();
  }

  // Empty messages to and from every peer.
  absl::Status DoBarrier() {
    if (size() == 1) return absl::OkStatus();
    if (shm_ != nullptr) return shm_->Sync(ctx_);
    static char dummy[1];
    for (int j = 0; j < size(); ++j) {
      if (j != rank_) DT_RETURN_IF_ERROR(Recv(j, 0, dummy, 0));
    }
    for (int k = 1; k < size(); ++k) DT_RETURN_IF_ERROR(Send(Mod(rank_ + k), 0, dummy, 0));
    return WaitAll();
  }

  // ---- The shared-memory channel (all ranks on this host; see ucx_shm.h) ----

  // Small: every rank copies its input into its slot and reduces all slots (in rank order, so
  // every rank gets the same bits): one Sync. Large, per slot-sized chunk: copy in, Sync, each
  // rank reduces its 1/P of the chunk into the shared result, Sync, everyone copies it out;
  // the copy-in of the next chunk shares the second Sync (one Sync per chunk). Large with a
  // core per rank: ShmReduceScatter, then ShmGather.
  absl::Status ShmAllReduce(const char* in, char* out, int64_t n, DType dtype, CommReduceOp op) {
    DT_RETURN_IF_ERROR(shm_->BeginWrite(ctx_));
    const size_t es = ElementSize(dtype);
    const int p = size();
    const void* srcs[kMaxShmRanks];
    const size_t bytes = static_cast<size_t>(n) * es, longest = static_cast<size_t>((n + p - 1) / p) * es;
    // Small: every rank reduces everything, unless the buffers may be shared blocks, which
    // single copy reads faster (2 ranks, 16 KiB: 2.76 -> 0.76 us).
    if (bytes <= (shm_->oversubscribed() ? kShmFullReduceOversubscribedBytes : kShmFullReduceBytes) &&
        !ZeroCopySized(longest, bytes)) {
      std::memcpy(shm_->slot(rank_), in, bytes);
      DT_RETURN_IF_ERROR(shm_->Sync(ctx_));
      // Its own part from its input: the same bits as its slot, which the peers are reading
      // (2 ranks: 4 KiB 1.31 against 1.73-1.75 us, 16 KiB 3.84-3.92 against 5.07-5.27 us).
      for (int j = 0; j < p; ++j) srcs[j] = j == rank_ ? in : shm_->slot(j);
      Reduce(dtype, op, srcs, p, n, out, p);
      shm_->NextStep();
      return absl::OkStatus();
    }
    const Counts counts = EvenCounts(n, p);
    const Blocks b = MakeBlocks(counts, es);
    if (UseCma(b.max_len, b.total)) {
      if (b.max_len > kCmaReduceMaxBytes && !shm_->oversubscribed()) {
        // Through the kernel the slots win at this size (kCmaReduceMaxBytes); from shared
        // blocks single copy is plain memcpy and wins by far (2 ranks, 16 MiB: 2.0 against
        // 3.5 ms). Every rank must take the same path: one Sync to agree.
        const CmaReduceDesc mine{DescribeBuffer(in, b.total), DescribeBuffer(out, b.total)};
        DT_ASSIGN_OR_RETURN(const bool all_shared, AllAgree(mine.in.shared.id != 0 && mine.out.shared.id != 0));
        if (all_shared) return CmaReduceWith(mine, in, out, b, dtype, op, /*all=*/true);
        return ShmReduceScatter(in, out, counts, b, dtype, op, /*write_back=*/true);
      }
      return CmaReduce(in, out, b, dtype, op, /*all=*/true);
    }
    if (!shm_->oversubscribed()) {
      // With a core per rank, a reduce-scatter into this rank's block of `out` and an
      // all-gather from there measured faster than the fused loop below (2 ranks, 1-16 MiB:
      // 4 MiB 0.40-0.47 vs 0.52-0.67 ms, interleaved); ranks that share cores lose more to
      // its extra Syncs than they gain (4 ranks on 2 cores).
      char* mine = out + b.off[static_cast<size_t>(rank_)];
      DT_RETURN_IF_ERROR(ShmReduceScatter(in, mine, counts, b, dtype, op));
      return ShmGather(mine, out, b);
    }
    // A rank's own slice never goes through its slot: it reduces it from its input directly.
    const int64_t per = static_cast<int64_t>(ShmGroup::kSlotBytes / es);
    auto slice = [&](int64_t m, int j) { return m * j / p; };  // rank j's slice of an m-element chunk
    // Copies chunk `at` of the input, less this rank's slice, to `slot`.
    auto copy_in = [&](int64_t at, char* slot) {
      const int64_t m = std::min(per, n - at);
      const size_t lo = static_cast<size_t>(slice(m, rank_)) * es, hi = static_cast<size_t>(slice(m, rank_ + 1)) * es;
      const char* chunk = in + static_cast<size_t>(at) * es;
      shm_->StartCopyIn(static_cast<size_t>(m) * es - (hi - lo));
      shm_->CopyIn(slot, chunk, lo);
      shm_->CopyIn(slot + hi, chunk + hi, static_cast<size_t>(m) * es - hi);
      shm_->FinishCopyIn();
    };
    // One Sync per chunk: after the Sync that publishes chunk k's slots, a rank reduces its
    // slice of k into this step's result and fills its next slot with chunk k + 1; the next
    // Sync publishes both, then it copies result k out. Slots of a step are read only between
    // its Sync and the next, results only after the Sync that completes them and before the
    // one after, so each buffer is rewritten only after every rank is done with it.
    copy_in(0, shm_->slot(rank_));
    DT_RETURN_IF_ERROR(shm_->Sync(ctx_));
    for (int64_t at = 0; at < n; at += per) {
      const int64_t m = std::min(per, n - at);
      const int64_t lo = slice(m, rank_), hi = slice(m, rank_ + 1);
      const char* chunk = in + static_cast<size_t>(at) * es;
      for (int j = 0; j < p; ++j) srcs[j] = (j == rank_ ? chunk : shm_->slot(j)) + static_cast<size_t>(lo) * es;
      Reduce(dtype, op, srcs, p, hi - lo, shm_->result() + static_cast<size_t>(lo) * es, p);
      if (at + per < n) copy_in(at + per, shm_->next_slot(rank_));
      DT_RETURN_IF_ERROR(shm_->Sync(ctx_));
      std::memcpy(out + static_cast<size_t>(at) * es, shm_->result(), static_cast<size_t>(m) * es);
      shm_->NextStep();
    }
    return absl::OkStatus();
  }

  // Per step every rank puts the next window of each block j != rank in its slot (at j *
  // window); rank r reduces window r of every slot (its own from its input) into its output.
  // With `write_back` (AllReduce past the single-copy limit) `out` is the whole output: each
  // reduced window lands at this rank's block of it and goes straight from cache into every
  // peer's output (process_vm_writev; the outputs' addresses travel with the first arrival),
  // and a last Sync waits for all those writes. In place is fine: a peer writes window w of
  // block j only after the Sync that follows this rank's copy of that window into its slot.
  absl::Status ShmReduceScatter(const char* in, char* out, absl::Span<const int64_t> counts, const Blocks& b,
                                DType dtype, CommReduceOp op, bool write_back = false) {
    if (!write_back && UseCma(b.max_len, b.total)) {
      if (b.max_len <= kCmaReduceMaxBytes) return CmaReduce(in, out, b, dtype, op, /*all=*/false);
      // Larger, single copy wins only from shared blocks (see ShmAllReduce): agree on it.
      const CmaReduceDesc mine{DescribeBuffer(in, b.total), {}};
      DT_ASSIGN_OR_RETURN(const bool all_shared, AllAgree(mine.in.shared.id != 0));
      if (all_shared) return CmaReduceWith(mine, in, out, b, dtype, op, /*all=*/false);
    }
    DT_RETURN_IF_ERROR(shm_->BeginWrite(ctx_));
    const int64_t per = static_cast<int64_t>(ShmGroup::kSlotBytes / ElementSize(dtype) / members_.size());
    const int64_t longest = *std::max_element(counts.begin(), counts.end());
    if (write_back) {
      // The peers write into `out` until they arrive at the last Sync: on an error before
      // then, wait until none can still be writing (ShmGroup::Quiesce).
      const uint64_t first = shm_->epoch() + 1;
      const uint64_t done = first + static_cast<uint64_t>((longest + per - 1) / per);
      const absl::Status s = ShmReduceScatterSteps(in, out, counts, b, dtype, op, true, per, longest);
      if (!s.ok()) shm_->Quiesce(first, done, ctx_);
      return s;
    }
    return ShmReduceScatterSteps(in, out, counts, b, dtype, op, false, per, longest);
  }
  // ShmReduceScatter's steps, `per` elements of each block at a time.
  absl::Status ShmReduceScatterSteps(const char* in, char* out, absl::Span<const int64_t> counts, const Blocks& b,
                                     DType dtype, CommReduceOp op, bool write_back, int64_t per, int64_t longest) {
    const size_t es = ElementSize(dtype);
    const int p = size();
    const size_t r = static_cast<size_t>(rank_);
    const void* srcs[kMaxShmRanks];
    char* const block = write_back ? out + b.off[r] : out;
    absl::InlinedVector<uint64_t, 8> outs(write_back ? static_cast<size_t>(p) : 0);
    if (write_back) shm_->Publish(reinterpret_cast<uintptr_t>(out));
    for (int64_t at = 0; at < longest; at += per) {
      char* mine = shm_->slot(rank_);
      auto window = [&](int j) { return std::clamp<int64_t>(counts[static_cast<size_t>(j)] - at, 0, per); };
      int64_t copied = 0;
      for (int j = 0; j < p; ++j) copied += j == rank_ ? 0 : window(j);
      shm_->StartCopyIn(static_cast<size_t>(copied) * es);
      for (int j = 0; j < p; ++j) {
        if (j == rank_) continue;
        shm_->CopyIn(mine + static_cast<size_t>(j * per) * es,
                     in + b.off[static_cast<size_t>(j)] + static_cast<size_t>(at) * es,
                     static_cast<size_t>(window(j)) * es);
      }
      shm_->FinishCopyIn();
      DT_RETURN_IF_ERROR(shm_->Sync(ctx_));
      if (write_back && at == 0) {
        for (int j = 0; j < p; ++j) outs[static_cast<size_t>(j)] = shm_->Published(j);
      }
      const int64_t m = std::clamp<int64_t>(counts[r] - at, 0, per);
      const size_t pos = static_cast<size_t>(at) * es, len = static_cast<size_t>(m) * es;
      for (int j = 0; j < p; ++j) srcs[j] = shm_->slot(j) + static_cast<size_t>(rank_ * per) * es;
      srcs[rank_] = in + b.off[r] + pos;
      Reduce(dtype, op, srcs, p, m, block + pos, p);
      for (int k = 1; write_back && k < p && len > 0; ++k) {
        const int j = Mod(rank_ + k);
        DT_RETURN_IF_ERROR(shm_->WritePeer(j, outs[static_cast<size_t>(j)] + b.off[r] + pos, block + pos, len, ctx_));
      }
      shm_->NextStep();
    }
    if (write_back) {
      DT_RETURN_IF_ERROR(shm_->Sync(ctx_));
      shm_->NextStep();
    }
    return absl::OkStatus();
  }

  // `in` is this rank's block (possibly already at its place in out, and overlapping no other
  // block of out); per step each rank publishes the next slot-sized window of its block and
  // copies each other rank's as soon as it is there. The copy of its own block into out runs
  // while the first step waits.
  absl::Status ShmGather(const char* in, char* out, const Blocks& b) {
    if (UseCma(b.max_len, b.max_len)) return CmaGather(in, out, b);
    DT_RETURN_IF_ERROR(shm_->BeginWrite(ctx_));
    const size_t w = ShmGroup::kSlotBytes;
    const size_t r = static_cast<size_t>(rank_);
    auto copy_mine = [&] {
      if (out + b.off[r] != in && b.len[r] > 0) std::memmove(out + b.off[r], in, b.len[r]);
    };
    if (b.max_len == 0) return absl::OkStatus();
    for (size_t at = 0; at < b.max_len; at += w) {
      if (b.len[r] > at) {
        shm_->CopyInStep(shm_->slot(rank_), in + at, std::min(w, b.len[r] - at));
      }
      DT_RETURN_IF_ERROR(shm_->SyncEach(
          ctx_,
          [&] {
            if (at == 0) copy_mine();
          },
          [&](int jj) {
            const size_t j = static_cast<size_t>(jj);
            if (b.len[j] > at) std::memcpy(out + b.off[j] + at, shm_->slot(jj), std::min(w, b.len[j] - at));
          }));
      shm_->NextStep();
    }
    return absl::OkStatus();
  }

  // Not lock-step (see ShmGroup::MarkRelaxed): the root publishes each window and goes on;
  // readers wait for the root only.
  absl::Status ShmBroadcast(char* data, size_t bytes, int root) {
    // Up to `ring` bytes the root copies the message into its ring places, in 32 KiB steps, and
    // goes on while the readers copy it out; past it, single copy at any rank count (4 ranks on
    // 2 cores, 64 KiB: 17 against 40-44 us through the slots). Ranks that share CPUs take the
    // ring further: there it needs no reader to be running when the root is (4 ranks on 2 cores,
    // 64 KiB: 8 us against 17 single copy), while ranks with a core each do better with single
    // copy past one place (2 ranks, 256 KiB: 8 against 17 us).
    const size_t ring = shm_->oversubscribed() ? kSharedCpuRingBroadcastBytes : ShmGroup::kRingBytes;
    if (bytes > ring && shm_->cma()) return CmaBroadcast(data, bytes, root);
    if (bytes <= ring) {  // the root may run up to a ring's length ahead
      const size_t steps = std::max<size_t>(1, (bytes + ShmGroup::kRingBytes - 1) / ShmGroup::kRingBytes);
      for (size_t i = 0; i < steps; ++i) {  // one step (of 0 bytes) for an empty message
        const size_t at = i * ShmGroup::kRingBytes, m = std::min(ShmGroup::kRingBytes, bytes - at);
        const uint64_t e = shm_->epoch() + 1;
        char* place = shm_->RingSlot(root, e);
        if (rank_ == root) {
          DT_RETURN_IF_ERROR(shm_->BeginRingWrite(e, ctx_));
          shm_->CopyInStep(place, data + at, m);
        } else {
          DT_RETURN_IF_ERROR(shm_->WaitRank(root, e, ctx_));
          std::memcpy(data + at, place, m);
        }
        shm_->Arrive();
        shm_->NextStep();
        shm_->MarkRelaxed();
      }
      return absl::OkStatus();
    }
    const size_t w = ShmGroup::kSlotBytes;
    for (size_t at = 0; at < bytes; at += w) {
      const size_t m = std::min(w, bytes - at);
      if (rank_ == root) {
        DT_RETURN_IF_ERROR(shm_->BeginWrite(ctx_));
        shm_->CopyInStep(shm_->slot(root), data + at, m);
      } else {
        DT_RETURN_IF_ERROR(shm_->WaitRank(root, shm_->epoch() + 1, ctx_));
        std::memcpy(data + at, shm_->slot(root), m);
      }
      shm_->Arrive();
      if (rank_ == root) shm_->MarkSlotWritten();
      shm_->NextStep();
      shm_->MarkRelaxed();
    }
    return absl::OkStatus();
  }

  // Blocks of `len` bytes: per step each rank puts the next window of block j in its slot at
  // j * window and copies window `rank` of each slot as soon as its rank is there.
  absl::Status ShmAllToAll(const char* in, char* out, size_t len) {
    if (UseCma(len, len * members_.size())) return CmaAllToAll(in, out, len);
    DT_RETURN_IF_ERROR(shm_->BeginWrite(ctx_));
    const size_t p = members_.size(), r = static_cast<size_t>(rank_);
    const size_t w = ShmGroup::kSlotBytes / p;
    for (size_t at = 0; at < len; at += w) {
      const size_t m = std::min(w, len - at);
      shm_->StartCopyIn((p - 1) * m);
      for (size_t j = 0; j < p; ++j) {
        if (j != r) shm_->CopyIn(shm_->slot(rank_) + j * w, in + j * len + at, m);
      }
      shm_->FinishCopyIn();
      DT_RETURN_IF_ERROR(shm_->SyncEach(
          ctx_,
          [&] {  // this rank's own block, while the first step waits (in and out do not overlap)
            if (at == 0) std::memcpy(out + r * len, in + r * len, len);
          },
          [&](int j) { std::memcpy(out + static_cast<size_t>(j) * len + at, shm_->slot(j) + r * w, m); }));
      shm_->NextStep();
    }
    return absl::OkStatus();
  }

  // ShmAllToAll on views, blocks of up to `longest` elements (the largest block of any rank:
  // every rank takes the same steps).
  // Always through the slots: reading the peers' views directly (process_vm_readv with one
  // range per row) measured slower, the kernel pays per range (2 ranks, 1 MiB S(0) -> S(1)
  // column blocks: 111 us against 48 us through the slots; 4 ranks: 329 against 49 us).
  absl::Status ShmAllToAllBlocks(absl::Span<const Tensor> sends, absl::Span<const Tensor> recvs, int64_t longest,
                                 size_t es) {
    DT_RETURN_IF_ERROR(shm_->BeginWrite(ctx_));
    const size_t p = members_.size(), r = static_cast<size_t>(rank_);
    const size_t w = ShmGroup::kSlotBytes / p;
    const int64_t per = static_cast<int64_t>(w / es);
    auto window = [&](const Tensor& t, int64_t at) { return std::clamp<int64_t>(t.numel() - at, 0, per); };
    for (int64_t at = 0; at < longest; at += per) {
      for (size_t j = 0; j < p; ++j) {
        if (j != r) CopyRange(sends[j], at, window(sends[j], at), shm_->slot(rank_) + j * w, /*into_view=*/false);
      }
      DT_RETURN_IF_ERROR(shm_->SyncEach(
          ctx_, [] {},
          [&](int j) {
            const Tensor& recv = recvs[static_cast<size_t>(j)];
            CopyRange(recv, at, window(recv, at), shm_->slot(j) + r * w, /*into_view=*/true);
          }));
      shm_->NextStep();
    }
    // This rank's own block (no longer sharing bytes with its receive view: staged).
    if (sends[r].numel() == 0) return absl::OkStatus();
    if (sends[r].shape() == recvs[r].shape()) return CopyBlock(recvs[r], sends[r]);
    DT_ASSIGN_OR_RETURN(Tensor flat, Contiguous(sends[r]));
    DT_ASSIGN_OR_RETURN(flat, flat.View(recvs[r].shape()));
    return CopyBlock(recvs[r], flat);
  }

  // ---- Single copy among ranks of one host (ShmGroup::ReadPeer) ----
  // Every rank's decision depends only on sizes all ranks know, so all take the same path.
  // Single copy for a step whose peers read `buffer_bytes` of a rank's buffer (the same on
  // every rank) in blocks of `block_bytes`: from cma_min_, or from zero_copy_min_ where the
  // buffer is large enough to be in a shared block (memcpy beats the slots from far smaller
  // blocks than the kernel's copy does: 4 ranks on 2 cores, 256 KiB all_to_all 20-21 us
  // against 51-61 through the slots). A buffer that is private after all is still correct,
  // through the kernel.
  bool UseCma(size_t block_bytes, size_t buffer_bytes) const {
    if (!shm_->cma()) return false;
    return block_bytes >= cma_min_ || ZeroCopySized(block_bytes, buffer_bytes);
  }
  // Single copy for blocks of a buffer that may be in a shared block (peers then memcpy).
  bool ZeroCopySized(size_t block_bytes, size_t buffer_bytes) const {
    return zero_copy_ && shm_->cma() && buffer_bytes >= kSharedCpuMinBytes && block_bytes >= zero_copy_min_;
  }
  // Collective over the shared-memory group: whether `mine` holds on every rank (one Sync).
  absl::StatusOr<bool> AllAgree(bool mine) {
    DT_RETURN_IF_ERROR(shm_->BeginWrite(ctx_));
    shm_->slot(rank_)[0] = mine ? 1 : 0;
    DT_RETURN_IF_ERROR(shm_->Sync(ctx_));
    bool all = true;
    for (int j = 0; j < size(); ++j) all = all && shm_->slot(j)[0] == 1;
    shm_->NextStep();
    return all;
  }

  // Every rank publishes `desc` in its slot; after the Sync each runs own() (while waiting) and
  // read(j, rank j's desc) for every other rank; a second Sync then holds every rank until all
  // peers are done reading its memory (its buffers may change once it returns).
  // finish() runs after the reads, before the second Sync.
  // On an error after the descriptors are out, the rank waits (ShmGroup::Quiesce) until no
  // peer can still be writing into its buffers (AllReduce, Broadcast write into the peers).
  template <typename Own, typename Read, typename Finish>
  absl::Status CmaStep(const void* desc, size_t desc_bytes, Own&& own, Read&& read, Finish&& finish) {
    DT_RETURN_IF_ERROR(shm_->BeginWrite(ctx_));
    // Peers write into this rank after arriving at the first Sync; at the second they are done.
    const uint64_t first = shm_->epoch() + 1, done = first + 1;
    std::memcpy(shm_->slot(rank_), desc, desc_bytes);
    const absl::Status s = [&]() -> absl::Status {
      absl::Status status;
      DT_RETURN_IF_ERROR(shm_->SyncEach(ctx_, own, [&](int j) {
        if (status.ok()) status = read(j, static_cast<const char*>(shm_->slot(j)));
      }));
      shm_->NextStep();
      DT_RETURN_IF_ERROR(status);
      DT_RETURN_IF_ERROR(finish());
      DT_RETURN_IF_ERROR(shm_->Sync(ctx_));
      shm_->NextStep();
      return absl::OkStatus();
    }();
    if (!s.ok()) shm_->Quiesce(first, done, ctx_);
    return s;
  }
  template <typename Own, typename Read>
  absl::Status CmaStep(const void* desc, size_t desc_bytes, Own&& own, Read&& read) {
    return CmaStep(desc, desc_bytes, own, read, [] { return absl::OkStatus(); });
  }
  // What a rank publishes of one of its buffers for a single-copy step: the address and, where
  // the buffer lies in a shared block, the block, which the peers map and copy with memcpy.
  struct BufferDesc {
    uint64_t addr = 0;
    uint64_t bytes = 0;     // what the peers may touch from addr on
    SharedCpuRange shared;  // id 0: private memory
  };
  static BufferDesc DescribeBuffer(const void* p, size_t bytes) {
    BufferDesc d{reinterpret_cast<uintptr_t>(p), bytes, {}};
    if (std::optional<SharedCpuRange> r = FindSharedCpuRange(p, bytes)) d.shared = *r;
    return d;
  }
  static BufferDesc DescIn(const char* desc) {
    BufferDesc d;
    std::memcpy(&d, desc, sizeof(d));
    return d;
  }
  // Peer j's buffer `d` mapped into this process (its first byte), or nullptr: copy through the
  // kernel.
  char* Mapped(int j, const BufferDesc& d) { return d.shared.id != 0 ? shm_->MapPeer(j, d.shared) : nullptr; }
  // Ranks whose calls disagree on sizes (a user error that DTENSOR_DEBUG=1 reports first)
  // would read or write past a peer's buffer: an error instead.
  absl::Status CheckRange(int j, const BufferDesc& d, size_t off, size_t bytes) const {
    if (off <= d.bytes && bytes <= d.bytes - off) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "[", ctx_.op, "] rank ", rank_, ": peer rank ", j, "'s buffer holds ", d.bytes, " bytes, this call moves ",
        bytes, " at ", off, " (do the ranks' calls agree? DTENSOR_DEBUG=1 checks)"));
  }
  // `bytes` at `off` of peer j's buffer `d` (mapped: `at`, else through the kernel) into `local`.
  absl::Status ReadFrom(int j, const BufferDesc& d, const char* at, size_t off, void* local, size_t bytes) {
    DT_RETURN_IF_ERROR(CheckRange(j, d, off, bytes));
    if (at == nullptr) return shm_->ReadPeer(j, local, d.addr + off, bytes, ctx_);
    std::memcpy(local, at + off, bytes);
    return absl::OkStatus();
  }
  // ... and the other way. A peer that gave up may be freeing the buffer: write none of it.
  absl::Status WriteTo(int j, const BufferDesc& d, char* at, size_t off, const void* local, size_t bytes) {
    DT_RETURN_IF_ERROR(CheckRange(j, d, off, bytes));
    if (at == nullptr) return shm_->WritePeer(j, d.addr + off, local, bytes, ctx_);
    if (shm_->PeerFailed(j)) {
      return absl::UnavailableError(
          absl::StrCat("[", ctx_.op, "] rank ", rank_, ": peer rank ", j, " failed (see its error)"));
    }
    std::memcpy(at + off, local, bytes);
    return absl::OkStatus();
  }

  // ShmGather's contract; each rank reads every peer's block from the peer's `in`.
  absl::Status CmaGather(const char* in, char* out, const Blocks& b) {
    const size_t r = static_cast<size_t>(rank_);
    const BufferDesc mine = DescribeBuffer(in, b.len[r]);
    return CmaStep(
        &mine, sizeof(mine),
        [&] {
          if (out + b.off[r] != in && b.len[r] > 0) std::memmove(out + b.off[r], in, b.len[r]);
        },
        [&](int j, const char* desc) {
          const size_t u = static_cast<size_t>(j);
          if (b.len[u] == 0) return absl::OkStatus();
          const BufferDesc d = DescIn(desc);
          return ReadFrom(j, d, Mapped(j, d), 0, out + b.off[u], b.len[u]);
        });
  }

  // Reduce-scatter (all = false: this rank's block of the result into `out`) or all-reduce
  // (all = true: `out` is the whole result). Rank r reduces block r, a chunk at a time: it
  // reduces every peer's piece of the chunk (from the peer's mapped shared block, else read into
  // scratch) in rank order with its own, and for all-reduce writes the result into every
  // peer's output while it is still in cache (mapped, or process_vm_writev). Two Syncs in all;
  // no rank's bytes pass through the slots. In place (out == in, or out == in's block r) is
  // fine: only rank r reads or writes block r.
  struct CmaReduceDesc {
    BufferDesc in, out;  // out: all-reduce only
  };
  absl::Status CmaReduce(const char* in, char* out, const Blocks& b, DType dtype, CommReduceOp op, bool all) {
    const CmaReduceDesc mine{DescribeBuffer(in, b.total), all ? DescribeBuffer(out, b.total) : BufferDesc{}};
    return CmaReduceWith(mine, in, out, b, dtype, op, all);
  }
  // CmaReduce, this rank's descriptors made (ShmAllReduce decides on them first at large sizes).
  absl::Status CmaReduceWith(const CmaReduceDesc& mine, const char* in, char* out, const Blocks& b, DType dtype,
                             CommReduceOp op, bool all) {
    using Desc = CmaReduceDesc;
    const size_t p = members_.size(), r = static_cast<size_t>(rank_), es = ElementSize(dtype);
    absl::InlinedVector<Desc, 8> peers(p);
    absl::InlinedVector<const char*, 8> pin(p, nullptr);
    absl::InlinedVector<char*, 8> pout(p, nullptr);
    char* const block = all ? out + b.off[r] : out;
    return CmaStep(
        &mine, sizeof(mine), [] {},
        [&](int j, const char* desc) {
          const size_t u = static_cast<size_t>(j);
          std::memcpy(&peers[u], desc, sizeof(Desc));
          pin[u] = Mapped(j, peers[u].in);
          if (all) pout[u] = Mapped(j, peers[u].out);
          return absl::OkStatus();
        },
        [&]() -> absl::Status {
          char* scratch = Scratch(p * kCmaChunk);
          const void* srcs[kMaxShmRanks];
          for (size_t at = 0; at < b.len[r]; at += kCmaChunk) {
            const size_t m = std::min(kCmaChunk, b.len[r] - at);
            for (size_t k = 1; k < p; ++k) {  // from the next rank on, so that peers spread out
              const size_t j = (r + k) % p;
              if (pin[j] != nullptr) {
                DT_RETURN_IF_ERROR(CheckRange(static_cast<int>(j), peers[j].in, b.off[r] + at, m));
                srcs[j] = pin[j] + b.off[r] + at;
                continue;
              }
              DT_RETURN_IF_ERROR(
                  ReadFrom(static_cast<int>(j), peers[j].in, nullptr, b.off[r] + at, scratch + j * kCmaChunk, m));
              srcs[j] = scratch + j * kCmaChunk;
            }
            srcs[r] = in + b.off[r] + at;
            Reduce(dtype, op, srcs, static_cast<int>(p), static_cast<int64_t>(m / es), block + at, static_cast<int>(p));
            if (!all) continue;
            for (size_t k = 1; k < p; ++k) {
              const size_t j = (r + k) % p;
              DT_RETURN_IF_ERROR(WriteTo(static_cast<int>(j), peers[j].out, pout[j], b.off[r] + at, block + at, m));
            }
          }
          return absl::OkStatus();
        });
  }

  // ShmAllToAll's contract (in and out do not overlap).
  absl::Status CmaAllToAll(const char* in, char* out, size_t len) {
    const size_t r = static_cast<size_t>(rank_);
    const BufferDesc mine = DescribeBuffer(in, len * members_.size());
    return CmaStep(
        &mine, sizeof(mine),
        [&] {
          if (len > 0) std::memcpy(out + r * len, in + r * len, len);  // empty blocks may be null
        },
        [&](int j, const char* desc) {
          const BufferDesc d = DescIn(desc);
          return ReadFrom(j, d, Mapped(j, d), r * len, out + static_cast<size_t>(j) * len, len);
        });
  }

  // The buffer in p parts: the root writes part `pos` into the rank `pos` places after it
  // (mapped, or process_vm_writev), and each other rank reads the remaining parts from the
  // root, so the root copies as much as each reader and every core works (2 ranks: half each;
  // reading it all on the reader measured 0.96-0.98x Open MPI at 4-16 MiB, with the root's core
  // idle).
  absl::Status CmaBroadcast(char* data, size_t bytes, int root) {
    const BufferDesc mine = DescribeBuffer(data, bytes);
    const int p = size();
    auto part = [&](int q) { return bytes * static_cast<size_t>(q) / static_cast<size_t>(p); };
    return CmaStep(
        &mine, sizeof(mine), [] {},
        [&](int j, const char* desc) -> absl::Status {
          if (rank_ != root && j != root) return absl::OkStatus();  // readers touch only the root
          const BufferDesc d = DescIn(desc);
          char* at = Mapped(j, d);
          if (rank_ == root) {
            const int pos = Mod(j - root);
            return WriteTo(j, d, at, part(pos), data + part(pos), part(pos + 1) - part(pos));
          }
          const int pos = Mod(rank_ - root);
          DT_RETURN_IF_ERROR(CheckRange(j, d, 0, bytes));
          if (at != nullptr) {
            std::memcpy(data, at, part(pos));
            std::memcpy(data + part(pos + 1), at + part(pos + 1), bytes - part(pos + 1));
            return absl::OkStatus();
          }
          const iovec local[2] = {{data, part(pos)}, {data + part(pos + 1), bytes - part(pos + 1)}};
          const iovec remote[2] = {{reinterpret_cast<void*>(d.addr), part(pos)},
                                   {reinterpret_cast<void*>(d.addr + part(pos + 1)), bytes - part(pos + 1)}};
          return shm_->ReadPeer(j, local, remote, ctx_);
        });
  }

  absl::StatusOr<std::unique_ptr<Work>> PostP2P(const char* op, const Tensor& tensor, int peer, bool is_send) {
    world_->comm_thread().Drain();
    DT_RETURN_IF_ERROR(CheckTensor(op, rank_, "tensor", tensor));
    DT_RETURN_IF_ERROR(CheckPeer(op, rank_, "peer", peer, size()));
    if (peer == rank_) return InvalidArg(op, "rank ", rank_, ": peer is this rank (", peer, ")");
    if (world_->PollAbort() || !world_->failure().ok()) return world_->Failed(UcxWaitContext{op, rank_, timeout_});
    const size_t p = static_cast<size_t>(peer);
    const int src = is_send ? rank_ : peer;
    const uint32_t n = is_send ? send_seq_[p]++ : recv_seq_[p]++;
    const uint64_t tag = (uint64_t{1} << 63) | (uint64_t{id_} << 48) | (static_cast<uint64_t>(src) << 32) | n;
    const UcxWaitContext ctx{op, rank_, timeout_};
    absl::StatusOr<UcxRequest> r = is_send
                                       ? world_->PostSend(ctx, peer, members_[p], tag, Bytes(tensor), tensor.nbytes())
                                       : world_->PostRecv(ctx, peer, members_[p], tag, Bytes(tensor), tensor.nbytes());
    if (!r.ok()) {
      world_->Fail(r.status());
      return r.status();
    }
    return std::unique_ptr<Work>(std::make_unique<P2PWork>(world_, *std::move(r), tensor, op, rank_, timeout_));
  }

  std::shared_ptr<UcxWorld> world_;
  std::vector<int> members_;  // world rank of each group rank
  int rank_;
  uint16_t id_;
  absl::Duration timeout_;
  uint32_t seq_ = 0;
  std::vector<uint32_t> send_seq_, recv_seq_;  // point-to-point messages per peer
  UcxWaitContext ctx_;
  std::vector<UcxRequest> reqs_;
  std::vector<char> scratch_, stage_;
  std::unique_ptr<ShmGroup> shm_;             // all ranks on this host: the shared-memory channel
  size_t cma_min_ = kCmaMinBytes;             // agreed in Setup
  size_t zero_copy_min_ = kZeroCopyMinBytes;  // agreed in Setup (UseCma)
  bool zero_copy_ = false;                    // agreed in Setup: every rank allocates shared blocks
  bool debug_ = false;                        // agreed in Setup (any rank's DTENSOR_DEBUG)
  std::unique_ptr<StoreClient> store_;        // FromEnv: the store (rank 0's owns the server)
};

}  // namespace
}  // namespace internal

namespace {
absl::StatusOr<std::unique_ptr<internal::UcxCommunicator>> MakeWorld(const LaunchInfo& info, StoreClient& store,
                                                                     absl::Duration timeout) {
  DT_ASSIGN_OR_RETURN(std::shared_ptr<internal::UcxWorld> world, internal::UcxWorld::Create(info, store, timeout));
  std::vector<int> members(static_cast<size_t>(info.world_size));
  std::iota(members.begin(), members.end(), 0);
  auto comm = std::make_unique<internal::UcxCommunicator>(std::move(world), std::move(members), info.rank, 0, timeout);
  DT_RETURN_IF_ERROR(comm->Barrier());  // wires up every endpoint; afterwards nobody needs the store
  DT_RETURN_IF_ERROR(comm->Setup());
  return comm;
}
}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeUcxCommunicator(const LaunchInfo& info, StoreClient& store,
                                                                  absl::Duration timeout) {
  DT_ASSIGN_OR_RETURN(std::unique_ptr<internal::UcxCommunicator> comm, MakeWorld(info, store, timeout));
  return std::unique_ptr<Communicator>(std::move(comm));
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeUcxCommunicatorFromEnv(absl::Duration timeout) {
  DT_RETURN_IF_ERROR(TimeoutFromEnv().status());  // a malformed DTENSOR_TIMEOUT_S is an error, not 300 s
  DT_ASSIGN_OR_RETURN(const LaunchInfo info, LaunchInfoFromEnv());
  DT_ASSIGN_OR_RETURN(std::unique_ptr<StoreClient> store, ConnectStore(info, timeout));
  DT_ASSIGN_OR_RETURN(std::unique_ptr<internal::UcxCommunicator> comm, MakeWorld(info, *store, timeout));
  comm->AdoptStore(std::move(store));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace dtensor
