#include "dtensor/collectives/threads/threads_communicator.h"

#include <linux/futex.h>
#include <linux/membarrier.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/collectives/checks.h"
#include "dtensor/collectives/cpu_primitives.h"
#include "dtensor/collectives/threads/threads_reduce.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace internal {
namespace {

// AllReduce's step: a reduced chunk is copied to the peers while in L1. (2 ranks, alternating
// runs, us, 64 KiB / 256 KiB / 1 MiB: 8 KiB steps 2.64-2.71 / 7.80-7.94 / 30.4-30.6, 4 KiB
// 2.65-2.77 / 8.4-8.7 / 32.6-32.7, 256 KiB 2.80-2.85 / 7.8-8.0 / 31.6-32.0; ucx 2.65-2.84 /
// 8.1-8.5 / 32.0-32.3. 4 ranks on 2 cores and 4 MiB and up alike.)
constexpr int64_t kPushChunkBytes = int64_t{8} << 10;

// Broadcasts of at least this many bytes are copied by every rank, a block each.
constexpr int64_t kSplitBroadcastBytes = int64_t{64} << 10;

void Copy(char* dst, const char* src, int64_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, static_cast<size_t>(bytes));
}

// AllReduce writes its results with streaming (non-temporal) stores where the group's inputs
// alone fill a last-level cache (this VM's 16 MiB; sysconf says 256 MiB here, so it is a constant):
// a plain store first reads the line it writes, which then only evicts what the next chunks need.
// DTENSOR_THREADS_STREAMING=0 / 1 forces them off / on. (2 ranks, 16-64 MiB: 8-10% faster; 4 ranks on 2 cores, 4-64
// MiB: 1.2-1.4x; below that plain stores win, 2 ranks 4 MiB 180 against 300 us. ReduceScatter, whose results are a
// quarter of its traffic or less, was 5-25% slower with them (4 ranks, 4-64 MiB, through a 16 KiB chunk in L1).)
constexpr int64_t kStreamingMinInputBytes = int64_t{16} << 20;

bool UseStreaming(int64_t input_bytes) {
  static const int64_t forced = [] {
    const char* e = std::getenv("DTENSOR_THREADS_STREAMING");
    return e != nullptr && (e[0] == '0' || e[0] == '1') && e[1] == 0 ? int64_t{e[0] - '0'} : int64_t{-1};
  }();
  return forced >= 0 ? forced == 1 : input_bytes >= kStreamingMinInputBytes;
}

// A reduced chunk of the streaming paths: small enough to stay in L1 between the reduction and
// the streaming copy.
constexpr int64_t kStreamChunkBytes = int64_t{16} << 10;

// ---------------------------------------------------------------------------------------------
// Deadlines on the steady clock; an enormous timeout means "wait forever".

class Deadline {
 public:
  explicit Deadline(absl::Duration timeout)
      : infinite_(timeout >= absl::Hours(24 * 365 * 100)),
        at_(std::chrono::steady_clock::now() +
            (infinite_ ? std::chrono::nanoseconds(0)
                       : absl::ToChronoNanoseconds(std::max(timeout, absl::ZeroDuration())))) {}
  bool Expired() const { return !infinite_ && std::chrono::steady_clock::now() >= at_; }
  // Nanoseconds left (at least 1 until it expires), or -1 for "forever".
  int64_t RemainingNs() const {
    if (infinite_) return -1;
    return std::max<int64_t>(
        1, std::chrono::duration_cast<std::chrono::nanoseconds>(at_ - std::chrono::steady_clock::now()).count());
  }
  void WaitOn(std::condition_variable& cv, std::unique_lock<std::mutex>& lock) const {
    if (infinite_) {
      cv.wait(lock);
    } else {
      cv.wait_until(lock, at_);
    }
  }

 private:
  bool infinite_;
  std::chrono::steady_clock::time_point at_;
};

// ---------------------------------------------------------------------------------------------
// Waiting for the peers at a barrier (ThreadGroup::Arrive), as the ucx backend's shared-memory
// channel waits (collectives/ucx/ucx_shm.cc): where every rank has a CPU of its own a waiter
// spins on the peers' arrival words for kSpinNs, a pause between looks, then yields until
// kYieldNs, then sleeps on a futex; where ranks share CPUs (more thread ranks than the
// process's CPUs) it yields from the start, since the peer it waits for is often the one
// waiting for its CPU. (The earlier wait yielded after 20 looks and slept on a condition
// variable after 200: a yield hands the CPU to any other runnable thread, e.g. a compiler of
// a build beside it, and a sleeper behind a mutex wakes late.)

constexpr int64_t kSpinNs = 50'000;
constexpr int64_t kYieldNs = 200'000;
constexpr int kRoundSpins = 32;          // looks per round, a pause apart, between clock reads
constexpr int kSharedCpuRoundSpins = 4;  // the same for ranks that share CPUs: then a yield

// Sleeps while *word == expected, at most timeout_ns (-1: no limit). Private futex: the word
// lives in this process. Returns on a wake-up, a change, a signal or the timeout alike.
void FutexWait(std::atomic<uint32_t>& word, uint32_t expected, int64_t timeout_ns) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) && std::atomic<uint32_t>::is_always_lock_free);
  struct timespec ts {
    static_cast<time_t>(timeout_ns / 1'000'000'000), static_cast<long>(timeout_ns % 1'000'000'000)
  };
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, timeout_ns < 0 ? nullptr : &ts,
          nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

// Registers this process for membarrier's private expedited barrier, once; false where the
// kernel lacks it or refuses it (seccomp): arrivals then fence.
bool RegisterProcessBarrier() {
  static const bool registered = [] {
    const long cmds = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    return cmds >= 0 && (cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) != 0 &&
           syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  }();
  return registered;
}

// A full memory barrier on every running thread of this process (the slow side of an
// asymmetric fence; RegisterProcessBarrier() first).
void ProcessBarrier() { syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0); }

// The CPUs this process may run on (its calling thread's affinity), at least 1.
int AllowedCpuCount() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

constexpr int kSpins = 200;

// Reductions of up to this many input bytes go through the mailboxes in one barrier
// (RunInline) rather than reading the peers' buffers between two. Reading lines that a peer
// has just written costs more than reading its input, written long before (in every call of a
// benchmark, and in many real ones), so the barrier saved pays only for small messages. On this
// 2-vCPU VM (a build running beside it; ranges of 2-3 runs, us, mailbox against direct):
// 2 ranks, all_reduce 4 KiB 3.3-4.9 against 4.5-8.1, 64 KiB worse; reduce_scatter 16 KiB
// 4.1-5.8 against 6.1-9.9, 64 KiB even. 4 ranks on 2 cores: all_reduce 4 KiB 8.8-12.4 against
// 11.4-14.6, 16 KiB 20-35 against 14-18; reduce_scatter 16 KiB 10.5-20 against 14-14.
// Those cut-offs hold where ranks share CPUs (a barrier costs a switch). Where every rank has a
// CPU (spinning waiters) the second barrier is cheap and the mailbox copy is not: 2 ranks on this
// quiet VM (after the waits became ucx's, 3 runs each, us, mailbox against direct): all_reduce
// 256-512 B 0.37-0.38 against 0.42-0.43, 1 KiB 1.40-1.58 against 0.78-1.17 in a slow phase,
// 4 KiB 2.5 against 1.5; reduce_scatter 1 KiB 0.38-0.39 against 0.42-0.43, 4 KiB 0.54 against
// 0.50-0.52, 8 KiB 2.2-2.5 against 1.3-1.4, 16 KiB 3.3-3.5 against 1.5-1.6 (0.30x ucx before).
constexpr int64_t kInlineAllReduceBytes = int64_t{4} << 10;
constexpr int64_t kInlineReduceScatterBytes = int64_t{16} << 10;
constexpr int64_t kOwnCpuInlineAllReduceBytes = 512;
constexpr int64_t kOwnCpuInlineReduceScatterBytes = int64_t{2} << 10;

// AllGather(V) (by its input, 1/size of the output; V: its largest block), AllToAll and
// Broadcast of up to these many input bytes take one barrier too (RunMove). The mailbox costs a
// copy of the input and, as above, lines the peers must fetch from the writer's cache where the
// direct path reads inputs written long before; it saves a barrier. Which wins depends on where
// the scheduler runs the ranks, so the cut-offs keep each size at or below ucx's time (compare.sh)
// in both cases where one path cannot. On this 2-vCPU VM (3 runs each, medians, us, mailbox
// against direct; sizes as compare.sh's, the output for all_gather), first with both vCPUs free,
// then beside another engineer's 2-job build (ranks often on one vCPU: a barrier costs a switch):
// 2 ranks: all_gather 1 KiB 0.97 against 1.01 / 1.36 against 2.34, 4 KiB 1.49 against 1.04 /
// 1.47 against 2.42, 16 KiB 3.5 against 1.4 / 2.25 against 2.88 (ucx 2.0 at 4 KiB, 5.5 at 16);
// all_to_all 4 KiB 1.50 against 0.99 / 1.61 against 2.51, 16 KiB 3.4 against 1.35 / 2.56 against
// 3.09 (ucx 2.1, 2.2); broadcast 4 KiB 1.18 against 0.97 / 1.39 against 2.26, 16 KiB 3.1 against
// 1.2 / 1.91 against 2.60 (ucx 1.8, 3.3). 4 ranks on 2 cores: all_gather 4 KiB 3.3 against 4.4 /
// 4.3 against 7.3, 16 KiB 5.5 against 5.2 / 5.6 against 8.3, 64 KiB 14.1 against 7.5 / 11.7
// against 13.2 (ucx 11-16 up to 16 KiB); all_to_all 4 KiB 4.3 against 4.4 / 4.5 against 7.2,
// 16 KiB 8.2 against 5.0 / 7.0 against 8.4 (ucx 11-19); broadcast 4 KiB 3.0 against 4.0 / 4.0
// against 6.8, 16 KiB 5.2 against 4.8 / 5.1 against 7.7 (ucx 1.5-3.1 and 7.0-8.3: its root
// returns once its message is out; here every rank meets the others, so 4 KiB stays slower).
// Since then (the header in the arrival line, a rank's own block copied during the wait; small
// Broadcasts no longer meet the group: RunEagerBroadcast), 2 ranks with a CPU each, alternating
// runs, us, mailbox against direct, sizes as above: all_gather 1 KiB 0.75-0.81 against
// 0.77-0.90, 2 KiB 0.82-0.84 against 0.88-1.00, 4 KiB 1.20-1.36 against 0.92-1.06; all_to_all
// 2 KiB 0.80-0.93 against 0.84-1.02, 4 KiB 1.21-1.36 against 0.86-1.04 (ucx 0.97 and 0.99 at
// 4 KiB): the own-CPU cut-offs moved down to 1 and 2 KiB of input. Broadcast, the root
// returning at once against every rank meeting: 512 B 0.36-0.40 against 0.61-0.73, 2 KiB 0.53
// against 0.85, 4 KiB 0.91-0.92 against 1.14-1.23, but 8 / 16 KiB 1.52 / 2.85 against the
// direct path's 0.96 / 1.18 (the receiver reads the slot while the root writes the next one).
constexpr int64_t kInlineAllGatherBytes = int64_t{4} << 10;
constexpr int64_t kInlineAllToAllBytes = int64_t{4} << 10;
constexpr int64_t kInlineBroadcastBytes = int64_t{16} << 10;
constexpr int64_t kOwnCpuInlineAllGatherBytes = int64_t{1} << 10;
constexpr int64_t kOwnCpuInlineAllToAllBytes = int64_t{2} << 10;
constexpr int64_t kOwnCpuInlineBroadcastBytes = int64_t{4} << 10;

// ---------------------------------------------------------------------------------------------
// One rank's collective call, published in shared memory for its peers.

enum class CallKind : uint8_t {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kBroadcast,
  kAllGatherV,
  kReduceScatterV,
  kAllToAllV,
  kAllToAllBlocks,
  kBarrier,
  kSplit,
};

const char* CallName(CallKind k) {
  switch (k) {
    case CallKind::kAllReduce:
      return "AllReduce";
    case CallKind::kAllGather:
      return "AllGather";
    case CallKind::kReduceScatter:
      return "ReduceScatter";
    case CallKind::kAllToAll:
      return "AllToAll";
    case CallKind::kBroadcast:
      return "Broadcast";
    case CallKind::kAllGatherV:
      return "AllGatherV";
    case CallKind::kReduceScatterV:
      return "ReduceScatterV";
    case CallKind::kAllToAllV:
      return "AllToAllV";
    case CallKind::kAllToAllBlocks:
      return "AllToAllBlocks";
    case CallKind::kBarrier:
      return "Barrier";
    case CallKind::kSplit:
      return "Split";
  }
  return "?";
}

class ThreadGroup;

struct Call {
  CallKind kind = CallKind::kBarrier;
  DType dtype = DType::kFloat32;
  CommReduceOp op = CommReduceOp::kSum;
  int64_t numel = 0;  // input elements (the tensor's for Broadcast)
  int root = -1;
  const char* in = nullptr;  // the input, or this rank's staged copy of it
  char* out = nullptr;
  std::vector<int64_t> counts;       // *V counts; AllToAllV: send counts
  std::vector<int64_t> recv_counts;  // AllToAllV
  std::vector<Tensor> blocks;        // AllToAllBlocks: the send views, read by the peers
  int color = -1;
  int key = 0;
  std::shared_ptr<ThreadGroup> split;  // Split: the new group, set by its first member

  bool Reduces() const {
    return kind == CallKind::kAllReduce || kind == CallKind::kReduceScatter || kind == CallKind::kReduceScatterV;
  }
  bool HasData() const { return kind != CallKind::kBarrier && kind != CallKind::kSplit; }
};

std::string Describe(const Call& c) {
  std::string s = absl::StrCat(CallName(c.kind), "(");
  if (c.HasData()) absl::StrAppend(&s, DTypeName(c.dtype));
  switch (c.kind) {
    case CallKind::kAllGatherV:
    case CallKind::kReduceScatterV:
      absl::StrAppend(&s, ", counts [", absl::StrJoin(c.counts, ", "), "]");
      break;
    case CallKind::kAllToAllV:
    case CallKind::kAllToAllBlocks:
      absl::StrAppend(&s, ", send [", absl::StrJoin(c.counts, ", "), "], recv [", absl::StrJoin(c.recv_counts, ", "),
                      "]");
      break;
    case CallKind::kBarrier:
    case CallKind::kSplit:
      break;
    default:
      absl::StrAppend(&s, ", ", c.numel, " elements");
  }
  if (c.Reduces()) absl::StrAppend(&s, ", ", CommReduceOpName(c.op));
  if (c.kind == CallKind::kBroadcast) absl::StrAppend(&s, ", root ", c.root);
  return s + ")";
}

// Whether two ranks' calls belong to one collective (AllToAllV's counts are checked pairwise).
bool SameCall(const Call& a, const Call& b) {
  if (a.kind != b.kind) return false;
  if (!a.HasData()) return true;
  if (a.dtype != b.dtype) return false;
  if (a.Reduces() && a.op != b.op) return false;
  switch (a.kind) {
    case CallKind::kAllGatherV:
    case CallKind::kReduceScatterV:
      return a.counts == b.counts;
    case CallKind::kAllToAllV:
    case CallKind::kAllToAllBlocks:
      return true;
    case CallKind::kBroadcast:
      return a.numel == b.numel && a.root == b.root;
    default:
      return a.numel == b.numel;
  }
}

// What the peers need of a call on its fast path, its output included, published in the rank's
// arrival line (see ThreadGroup::PublishHeader); the rest of the Call (counts, views, split)
// goes into its slot only for the kinds that need it (PublishesCall).
constexpr uint64_t kRootMask = (uint64_t{1} << 24) - 1;  // a root in a header (-1: none)
// A header's element count: a contiguous CPU tensor's, under 2^47 bytes of user address space.
constexpr uint64_t kNumelMask = (uint64_t{1} << 48) - 1;
struct Header {
  CallKind kind = CallKind::kBarrier;
  DType dtype = DType::kFloat32;
  CommReduceOp op = CommReduceOp::kSum;
  int root = -1;
  int64_t numel = 0;
  const char* in = nullptr;
  uint32_t tag = 0;     // read from the arrival line: the low bits of the barrier it was published at
  char* out = nullptr;  // read only by collectives with a closing barrier (see PublishHeader)
};

Header HeaderOf(const Call& c) { return Header{c.kind, c.dtype, c.op, c.root, c.numel, c.in, 0, c.out}; }
std::string Describe(const Header& h) {
  Call c;
  c.kind = h.kind;
  c.dtype = h.dtype;
  c.op = h.op;
  c.root = h.root;
  c.numel = h.numel;
  return Describe(c);
}

// SameCall on headers: true where SameCall is, unless the kind's counts or views need the
// full Calls (which NeedsFullCall says).
bool SameHeader(const Header& a, const Header& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case CallKind::kBarrier:
    case CallKind::kSplit:
      return true;
    case CallKind::kAllGatherV:
    case CallKind::kReduceScatterV:
    case CallKind::kAllToAllV:
    case CallKind::kAllToAllBlocks:
      return a.dtype == b.dtype && a.op == b.op;
    case CallKind::kBroadcast:
      return a.dtype == b.dtype && a.numel == b.numel && a.root == b.root;
    default:
      return a.dtype == b.dtype && a.numel == b.numel && a.op == b.op;
  }
}
bool NeedsFullCall(CallKind k) {
  return k == CallKind::kAllGatherV || k == CallKind::kReduceScatterV || k == CallKind::kAllToAllV ||
         k == CallKind::kAllToAllBlocks;
}
// Whether a rank's Call goes into its slot (Publish): where the peers need more than its header
// (counts, views, Split's color and key); for the rest the header says all. Moving a Call in
// on every collective cost a 2-rank 64 KiB Broadcast about 0.1 us (alternating runs: 1.52-1.62
// us with, 1.39-1.48 without).
bool PublishesCall(CallKind k) { return NeedsFullCall(k) || k == CallKind::kSplit; }

// Small calls carry their input in the mailbox, right after the header (RunInline, RunMove).
constexpr int64_t kInlineBytes = std::max({kInlineAllReduceBytes, kInlineReduceScatterBytes, kInlineAllGatherBytes,
                                           kInlineAllToAllBytes, kInlineBroadcastBytes});

// One rank's mailbox for one collective: written by that rank before it arrives at the
// collective's first barrier, read by the peers after it (the call's header travels in the
// arrival line). A group holds 2 x size of them (16 KiB each).
struct alignas(64) Mailbox {
  char data[kInlineBytes];
};

// A small Broadcast's root's call and bytes, for its receivers (RunEagerBroadcast): a group
// holds kEagerDepth of them, used in turn. Deeper lets a root run further ahead of receivers
// that share its CPUs (4 ranks on 2 cores, 4 KiB, us, alternating runs: 1.5-1.7 with 8 slots,
// 1.26-1.30 with 32). The bytes are allocated untouched (a page is mapped where a call writes it).
constexpr uint64_t kEagerDepth = 32;
struct alignas(64) EagerSlot {
  Header header;
  uint64_t epoch = 0;                         // the barrier its root arrived at
  std::atomic<uint64_t> index{~uint64_t{0}};  // which small Broadcast of the group wrote it last (release)
  // Which small Broadcast took it last, and which rank as its root: index << 24 | rank. Ranks that
  // disagree on the root may both act as it; the second to take the slot for one call finds it
  // taken, writes nothing and fails the group (else nobody would look: roots do not read slots).
  std::atomic<uint64_t> claim{~uint64_t{0}};
  char* data = nullptr;  // kInlineBytes
};

// A posted Send or Recv.
struct P2POp {
  Tensor tensor;
  bool matched = false;  // guarded by the group's mutex; once true, a copy is under way or done
  std::atomic<bool> done{false};
  absl::Status status;  // written before done is set
};

// ---------------------------------------------------------------------------------------------
// The state one group's communicators share.

// A group made by MakeThreadGroup and every group split from it (transitively): an abort on
// any of them fails them all.
class Family {
 public:
  // `threads`: the ranks of the group MakeThreadGroup made (every split runs on those threads).
  explicit Family(int threads) : share_cpus_(threads > AllowedCpuCount()) {}
  // More thread ranks than CPUs: they take turns, so waiters yield instead of spinning.
  bool share_cpus() const { return share_cpus_; }
  // Joins `group`; a group that joins after an abort fails at once.
  void Join(const std::shared_ptr<ThreadGroup>& group);
  // Records the first abort and fails every live group of the family.
  void Abort(const absl::Status& status);
  // The abort, once there was one (a group may be checked before Abort reached it).
  bool aborted() const { return aborted_flag_.load(std::memory_order_acquire); }
  absl::Status abort_status() {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_;
  }

 private:
  const bool share_cpus_;
  std::atomic<bool> aborted_flag_{false};
  std::mutex mu_;
  absl::Status aborted_;                            // the first abort, guarded by mu_
  std::vector<std::weak_ptr<ThreadGroup>> groups_;  // guarded by mu_
};

class ThreadGroup {
 public:
  // CheckUsable's `peer` beside a rank.
  enum CheckPeers : int { kAll = -1, kNone = -2 };
  ThreadGroup(int size, bool debug, std::shared_ptr<Family> family)
      : family_(std::move(family)),
        size_(size),
        debug_(debug),
        slots_(2 * static_cast<size_t>(size)),
        mailboxes_(2 * static_cast<size_t>(size)),
        eager_(kEagerDepth),
        eager_bytes_(new Mailbox[kEagerDepth]),
        arrived_(static_cast<size_t>(size)),
        cpus_(static_cast<size_t>(size)),
        quiet_(static_cast<size_t>(size)),
        gone_(static_cast<size_t>(size)),
        channels_(static_cast<size_t>(size) * static_cast<size_t>(size)) {
    for (uint64_t i = 0; i < kEagerDepth; ++i) eager_[i].data = eager_bytes_[i].data;
  }

  int size() const { return size_; }
  bool debug() const { return debug_; }
  const std::shared_ptr<Family>& family() const { return family_; }

  // Fails the group with `status` (an abort): every waiter wakes and returns it.
  void Fail(const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(status);
  }
  // Slots alternate between consecutive collectives: a rank can only reuse a slot after
  // every rank has entered the next collective, i.e. finished reading it.
  Call& slot(uint64_t seq, int rank) {
    return slots_[(seq & 1) * static_cast<size_t>(size_) + static_cast<size_t>(rank)].call;
  }
  // Rank `rank`'s mailbox for collective `seq`: alternates like the slots.
  Mailbox& mailbox(uint64_t seq, int rank) {
    return mailboxes_[(seq & 1) * static_cast<size_t>(size_) + static_cast<size_t>(rank)];
  }
  // The slot of the group's small Broadcast `index` (counted alike by every rank).
  EagerSlot& eager_slot(uint64_t index) { return eager_[index % kEagerDepth]; }

  // The header of `rank`'s collective `seq` travels in its arrival line (the line its peers
  // poll at the barrier), so a peer has it with the arrival: one cache miss where a header in a
  // line of its own (the mailbox's first) was two in a row. Written before the arrival (release)
  // and read after it (acquire); two places, alternating like the mailboxes, so a rank already
  // into its next collective (after a one-barrier call) does not overwrite what a slow peer
  // still reads. (4 ranks on 2 cores, broadcast 4 / 16 KiB, medians of 10 alternating runs:
  // 3.96 / 5.08 us; one place under a seqlock, a reader that found it rewritten taking the
  // header from the slot: 4.05 / 5.12; the mailbox's line, before: 4.23 / 5.33.)
  // The header carries the low 32 bits of the barrier it is published at (`target`; 16 in each
  // of the first two words): a peer that finds another number there knows that rank is not in
  // this collective (it made a small Broadcast, which does not publish here, or skipped or added
  // a call), even where the rest of the header would match; a stale header passes only if it is
  // 2^32 barriers old. Roots take 24 bits (MakeThreadGroup: under 2^24 - 1 ranks), element
  // counts 48 (kNumelMask).
  // The output pointer has one place, not two: only collectives with a closing barrier read it
  // (an AllReduce's or a split Broadcast's peers write into it), and no rank publishes its next
  // collective before every peer has reached that barrier, done with it. (Read from the slot,
  // a line more to fetch that its owner then has to take back, a 2-rank 64 KiB AllReduce took
  // 2.92-2.98 us, 2.69-2.84 from here, in alternating runs; ucx 2.69-2.80.)
  void PublishHeader(int rank, uint64_t seq, uint64_t target, const Header& h) {
    PaddedEpoch& line = arrived_[static_cast<size_t>(rank)];
    line.out.store(reinterpret_cast<uintptr_t>(h.out), std::memory_order_relaxed);
    std::atomic<uint64_t>* w = line.head[seq & 1];
    w[0].store(static_cast<uint64_t>(h.kind) | static_cast<uint64_t>(h.dtype) << 8 | static_cast<uint64_t>(h.op) << 16 |
                   (static_cast<uint64_t>(static_cast<uint32_t>(h.root)) & kRootMask) << 24 | (target & 0xffff) << 48,
               std::memory_order_relaxed);
    w[1].store(static_cast<uint64_t>(h.numel) | (target >> 16 & 0xffff) << 48, std::memory_order_relaxed);
    w[2].store(reinterpret_cast<uintptr_t>(h.in), std::memory_order_relaxed);
  }
  // After `rank` arrived at the collective's first barrier (an acquire of its arrival).
  Header ReadHeader(int rank, uint64_t seq) const {
    const PaddedEpoch& line = arrived_[static_cast<size_t>(rank)];
    const std::atomic<uint64_t>* w = line.head[seq & 1];
    const uint64_t w0 = w[0].load(std::memory_order_relaxed);
    Header h;
    h.kind = static_cast<CallKind>(w0 & 0xff);
    h.dtype = static_cast<DType>(w0 >> 8 & 0xff);
    h.op = static_cast<CommReduceOp>(w0 >> 16 & 0xff);
    const uint64_t root = w0 >> 24 & kRootMask;
    h.root = root == kRootMask ? -1 : static_cast<int>(root);
    const uint64_t w1 = w[1].load(std::memory_order_relaxed);
    h.tag = static_cast<uint32_t>(w0 >> 48 | (w1 >> 48) << 16);
    h.numel = static_cast<int64_t>(w1 & kNumelMask);
    h.in = reinterpret_cast<const char*>(w[2].load(std::memory_order_relaxed));
    h.out = reinterpret_cast<char*>(line.out.load(std::memory_order_relaxed));
    return h;
  }

  // Fails fast when the group failed before or `peer` (every rank when -1, none when
  // CheckPeers::kNone) has left.
  absl::Status CheckUsable(int rank, const char* op, int peer) {
    if (!failed_.load(std::memory_order_acquire) && family_->aborted()) Fail(family_->abort_status());
    if (failed_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(mu_);
      return absl::Status(failure_.code(),
                          absl::StrCat("[", op, "] rank ", rank, ": the group failed earlier: ", failure_.message()));
    }
    for (int j = 0; j < size_; ++j) {
      if ((peer == kAll || j == peer) && gone_[static_cast<size_t>(j)].load(std::memory_order_acquire)) {
        return absl::UnavailableError(absl::StrCat("[", op, "] rank ", rank, ": rank ", j,
                                                   " has left the group (its communicator was destroyed)"));
      }
    }
    return absl::OkStatus();
  }

  // Marks `rank` as arrived at barrier `target` and waits until every rank has. A `closing`
  // barrier (after it no rank reads another's buffers) succeeds once every rank has arrived,
  // even if the group failed meanwhile: a peer that left it and then aborted must not fail a
  // collective that completed.
  absl::Status Arrive(int rank, uint64_t target, const char* op, absl::Duration timeout, bool closing) {
    Announce(rank, target);
    return Await(rank, target, op, timeout, closing);
  }
  // Arrive in two: Announce publishes the arrival (and wakes sleepers), Await waits for the
  // peers'. Between them a rank may do work of its own that no peer waits for (its own block).
  // With `header`, publishes it (PublishHeader, collective `seq`) right before the arrival: the
  // stores to the line go out back to back, so a peer polling it takes it from this core once.
  void Announce(int rank, uint64_t target, const Header* header = nullptr, uint64_t seq = 0) {
    const int cpu = sched_getcpu();
    PaddedEpoch& mine = arrived_[static_cast<size_t>(rank)];
    if (header != nullptr) PublishHeader(rank, seq, target, *header);
    // The CPU in a line of its own, stored only when it changed: a store into a line the peers
    // have read waits for the line to come back, and every store after it waits too (x86 keeps
    // the order of stores), the arrival among them. (When the arrival line held it, a load there
    // to skip an unchanged store made the arrival wait as well: 2 ranks, reduce_scatter 4 KiB,
    // 1.04-1.10 us against 0.80-0.84 storing it every time.)
    std::atomic<int>& last = cpus_[static_cast<size_t>(rank)].cpu;
    if (last.load(std::memory_order_relaxed) != cpu) last.store(cpu, std::memory_order_relaxed);
    mine.value.store(target, std::memory_order_release);
    // Pairs with a sleeper's count then barrier (Sleep): either it sees this arrival, or this
    // sees it counted and wakes it. With light arrivals the sleeper's barrier runs on every CPU
    // of the process (membarrier), so this side needs none: a fence here would wait for this
    // rank's stores (its header, the lines its peers read last time) to leave the core before
    // it may look at the peers' arrivals, ~1 us per barrier on this VM.
    if (light_arrive_) {
      std::atomic_signal_fence(std::memory_order_seq_cst);
    } else {
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    if (sleepers_.load(std::memory_order_relaxed) > 0) Wake();
  }
  // With `only` >= 0, waits for that rank's arrival alone (a small Broadcast's receivers wait
  // for its root: RunEagerBroadcast).
  absl::Status Await(int rank, uint64_t target, const char* op, absl::Duration timeout, bool closing, int only = -1) {
    const int cpu = cpus_[static_cast<size_t>(rank)].cpu.load(std::memory_order_relaxed);
    // A failed group fails every wait, also one whose ranks have all arrived: a peer that gave
    // up may be freeing what it published (its staging copy) while this rank would read it.
    const bool share = family_->share_cpus();
    const int64_t spin_ns = share ? 0 : kSpinNs;
    // The clock is read after the first round, in which most waits end (perf of a 2-rank 4 KiB
    // all_to_all found 10% of its samples in clock_gettime when Arrive read it on entry).
    int64_t start = 0;
    for (;;) {
      // Unbound threads may be put on one CPU by the scheduler (another program keeps the other
      // CPUs busy): a late rank that last arrived on this CPU is likely waiting for it, so this
      // rank yields at once instead of spinning (2 ranks so placed, 4 KiB all_gather: 104 us
      // spinning first, 4.9 us after a round of 32 pauses, 2.4 us with no round).
      const bool late_here = cpu >= 0 && LateRankOn(cpu, target, only);
      const int spins = late_here ? 1 : share ? kSharedCpuRoundSpins : kRoundSpins;
      for (int i = 0; i < spins; ++i) {
        if (closing && Arrived(target, only)) return absl::OkStatus();
        if (failed_.load(std::memory_order_acquire)) return Sleep(rank, target, op, timeout, closing, only);
        if (Arrived(target, only)) return absl::OkStatus();
        if (!late_here) CpuRelax();
      }
      if (start == 0) start = NowNs();
      const int64_t waited = NowNs() - start;
      if (waited >= kYieldNs) break;
      if (late_here || waited >= spin_ns) sched_yield();
    }
    return Sleep(rank, target, op, timeout, closing, only);
  }

  // Collectives in which ranks write into their peers' outputs (AllReduce, the large
  // Broadcast): between the first barrier (`first`) and the closing one each rank that passed
  // the first writes its share into every peer's output. A rank whose call fails must not return
  // while a peer still writes into its buffers (the caller may free them at once). So each rank
  // marks when it will write no more in the collective whose first barrier is `first` (after
  // its writes, or on giving up), and a rank returning an error first waits in AwaitWriters.
  void MarkQuiet(int rank, uint64_t first) {
    quiet_[static_cast<size_t>(rank)].first.store(first, std::memory_order_release);
  }
  // For a rank that announced barrier `first` and is about to return an error: marks itself
  // quiet, then waits until no peer can write into its buffers. A peer passes the first
  // barrier only once every rank has announced it; if one has not, nobody has passed (the
  // group has failed: a rank announcing later sees that after its arrival, the fence and the
  // process barrier below ordering the two) and nobody will. Else it waits for every peer
  // that announced to mark itself quiet or leave the group. The writes are copies and
  // reductions, with no waits, so this ends; it is bounded all the same, by the call's timeout
  // but at least 30 s (a short timeout must not cut it before large copies end).
  void AwaitWriters(int rank, uint64_t first, absl::Duration timeout) {
    MarkQuiet(rank, first);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (light_arrive_) ProcessBarrier();
    for (const PaddedEpoch& a : arrived_) {
      if (a.value.load(std::memory_order_acquire) < first) return;
    }
    const Deadline deadline(std::max(timeout, absl::Seconds(30)));
    for (int j = 0; j < size_; ++j) {
      while (quiet_[static_cast<size_t>(j)].first.load(std::memory_order_acquire) < first &&
             !gone_[static_cast<size_t>(j)].load(std::memory_order_acquire) && !deadline.Expired()) {
        sched_yield();
      }
    }
  }

  // Whether `rank` has arrived at barrier `target` (an acquire of its arrival).
  bool HasArrived(int rank, uint64_t target) const { return Arrived(target, rank); }
  // The lowest barrier every rank has reached (an acquire of each arrival).
  uint64_t LowestArrival() const {
    uint64_t low = ~uint64_t{0};
    for (const PaddedEpoch& a : arrived_) low = std::min(low, a.value.load(std::memory_order_acquire));
    return low;
  }

  void MarkGone(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    gone_[static_cast<size_t>(rank)].store(true, std::memory_order_seq_cst);
    cv_.notify_all();
    Wake();
  }

  // Posts a Send (src -> dst) or a Recv; the side that completes a pair does the copy.
  void Post(int src, int dst, bool is_send, const std::shared_ptr<P2POp>& op) {
    std::shared_ptr<P2POp> send, recv;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Channel& ch = channel(src, dst);
      (is_send ? ch.sends : ch.recvs).push_back(op);
      if (ch.sends.empty() || ch.recvs.empty()) return;
      send = std::move(ch.sends.front());
      recv = std::move(ch.recvs.front());
      ch.sends.pop_front();
      ch.recvs.pop_front();
      send->matched = recv->matched = true;
    }
    const Tensor& s = send->tensor;
    const Tensor& r = recv->tensor;
    if (s.dtype() != r.dtype() || s.numel() != r.numel()) {
      const std::string what =
          absl::StrCat("rank ", src, " sent ", s.numel(), " ", DTypeName(s.dtype()), " elements to rank ", dst,
                       ", which expected ", r.numel(), " ", DTypeName(r.dtype()), " elements");
      send->status = absl::InvalidArgumentError(absl::StrCat("[Send] ", what));
      recv->status = absl::InvalidArgumentError(absl::StrCat("[Recv] ", what));
    } else {
      Copy(static_cast<char*>(r.raw_data()), static_cast<const char*>(s.raw_data()), static_cast<int64_t>(s.nbytes()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    send->done.store(true, std::memory_order_release);
    recv->done.store(true, std::memory_order_release);
    cv_.notify_all();
  }

  // Takes back a posted op that no peer has matched yet (its Work was dropped unfinished).
  void Withdraw(int src, int dst, bool is_send, const P2POp& op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (op.matched) return;
    auto& queue = is_send ? channel(src, dst).sends : channel(src, dst).recvs;
    queue.erase(std::remove_if(queue.begin(), queue.end(), [&](const auto& p) { return p.get() == &op; }), queue.end());
  }

  // Waits for a posted op of `rank` with `peer`; withdraws it on failure.
  absl::Status WaitP2P(int rank, int peer, int src, int dst, bool is_send, P2POp& op, absl::Duration timeout) {
    const char* name = is_send ? "Send" : "Recv";
    for (int i = 0; i < kSpins; ++i) {
      if (op.done.load(std::memory_order_acquire)) return op.status;
      if (i >= 20) std::this_thread::yield();
    }
    const Deadline deadline(timeout);
    std::unique_lock<std::mutex> lock(mu_);
    while (!op.done.load(std::memory_order_acquire)) {
      if (op.matched) {  // the copy is under way: it ends soon
        cv_.wait(lock);
        continue;
      }
      absl::Status error;
      if (failed_.load(std::memory_order_acquire)) {
        error = absl::Status(failure_.code(), absl::StrCat("[", name, "] rank ", rank, " stopped waiting for rank ",
                                                           peer, ": ", failure_.message()));
      } else if (gone_[static_cast<size_t>(peer)].load(std::memory_order_acquire)) {
        error = absl::UnavailableError(absl::StrCat("[", name, "] rank ", rank, " was waiting for rank ", peer,
                                                    ", which has left the group (its communicator was destroyed)"));
      } else if (deadline.Expired()) {
        error = absl::DeadlineExceededError(absl::StrCat("[", name, "] rank ", rank, " timed out after ",
                                                         absl::FormatDuration(timeout), " waiting for rank ", peer));
        FailLocked(error);
      }
      if (!error.ok()) {
        auto& queue = is_send ? channel(src, dst).sends : channel(src, dst).recvs;
        queue.erase(std::remove_if(queue.begin(), queue.end(), [&](const auto& p) { return p.get() == &op; }),
                    queue.end());
        return error;
      }
      deadline.WaitOn(cv_, lock);
    }
    return op.status;
  }

 private:
  struct Channel {
    std::deque<std::shared_ptr<P2POp>> sends, recvs;
  };
  Channel& channel(int src, int dst) {
    return channels_[static_cast<size_t>(src) * static_cast<size_t>(size_) + static_cast<size_t>(dst)];
  }

  bool AllArrived(uint64_t target) const {
    for (const PaddedEpoch& a : arrived_) {
      if (a.value.load(std::memory_order_acquire) < target) return false;
    }
    return true;
  }
  // Every rank (only < 0) or rank `only` has arrived at `target`.
  bool Arrived(uint64_t target, int only) const {
    if (only < 0) return AllArrived(target);
    return arrived_[static_cast<size_t>(only)].value.load(std::memory_order_acquire) >= target;
  }

  // Whether a rank (only < 0: any; else `only`) that has not arrived at `target` last arrived
  // on `cpu`.
  bool LateRankOn(int cpu, uint64_t target, int only) const {
    for (int j = 0; j < size_; ++j) {
      const PaddedEpoch& a = arrived_[static_cast<size_t>(j)];
      if ((only < 0 || j == only) && a.value.load(std::memory_order_relaxed) < target &&
          cpus_[static_cast<size_t>(j)].cpu.load(std::memory_order_relaxed) == cpu) {
        return true;
      }
    }
    return false;
  }

  // Arrive's last phase: sleeps on wake_ until every rank (or `only`) has arrived at `target`,
  // the group fails, a missing rank has left, or the timeout.
  absl::Status Sleep(int rank, uint64_t target, const char* op, absl::Duration timeout, bool closing, int only) {
    const Deadline deadline(timeout);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    // Pairs with Arrive's fence (see there); with light arrivals, a barrier on every running
    // thread of the process. Wakers that do not look at sleepers_ (Fail, MarkGone) bump wake_
    // after their store: this rank then either sees the store below or sleeps on a word that
    // has changed already.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (light_arrive_) ProcessBarrier();
    absl::Status result;
    for (;;) {
      const uint32_t word = wake_.load(std::memory_order_acquire);
      const bool failed = failed_.load(std::memory_order_acquire);
      if (Arrived(target, only) && (closing || !failed)) break;
      std::vector<int> missing;
      int gone = -1;
      for (int j = 0; j < size_; ++j) {
        const bool late = arrived_[static_cast<size_t>(j)].value.load(std::memory_order_acquire) < target;
        if ((only < 0 || j == only) && late) missing.push_back(j);
        // Waiting for one rank (a small Broadcast's root, which has not arrived), any rank that
        // left fails the wait: the root refuses the call when it comes (CheckUsable), and no rank
        // can have finished this call before the root arrived.
        if (gone < 0 && (only >= 0 || late) && gone_[static_cast<size_t>(j)].load(std::memory_order_acquire)) {
          gone = j;
        }
      }
      if (failed) {
        std::lock_guard<std::mutex> lock(mu_);
        result = absl::Status(failure_.code(), absl::StrCat("[", op, "] rank ", rank, " stopped waiting for rank(s) ",
                                                            absl::StrJoin(missing, ", "), ": ", failure_.message()));
        break;
      }
      // A rank arrives before it leaves, and a one-barrier call needs no rank after its barrier:
      // the late rank may have arrived, finished and left between the look at its arrival above
      // and the look at its departure. Arrivals read after that departure are final, so look
      // again (4 ranks, small AllGather, the last one leaving at once: 3 in 40000 rounds failed
      // here with Unavailable before).
      if (gone >= 0 && Arrived(target, only)) continue;
      if (gone >= 0) {
        std::lock_guard<std::mutex> lock(mu_);
        result = absl::UnavailableError(
            only < 0 || gone == only
                ? absl::StrCat("[", op, "] rank ", rank, " was waiting for rank ", gone,
                               ", which has left the group (its communicator was destroyed)")
                : absl::StrCat("[", op, "] rank ", rank, " was waiting for rank ", only, " but rank ", gone,
                               " has left the group (its communicator was destroyed)"));
        FailLocked(result);
        break;
      }
      if (deadline.Expired()) {
        std::lock_guard<std::mutex> lock(mu_);
        result = absl::DeadlineExceededError(absl::StrCat("[", op, "] rank ", rank, " timed out after ",
                                                          absl::FormatDuration(timeout), " waiting for rank(s) ",
                                                          absl::StrJoin(missing, ", ")));
        FailLocked(result);
        break;
      }
      FutexWait(wake_, word, deadline.RemainingNs());
    }
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    return result;
  }

  // Wakes every sleeper of Sleep (after the store it waits for).
  void Wake() {
    wake_.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(wake_);
  }

  // Records the group's first failure and wakes every waiter. Requires mu_.
  void FailLocked(const absl::Status& status) {
    if (!failed_.load(std::memory_order_relaxed)) {
      failure_ = status;
      failed_.store(true, std::memory_order_seq_cst);
    }
    cv_.notify_all();
    Wake();
  }

  const std::shared_ptr<Family> family_;
  const int size_;
  const bool debug_;
  // A cache line of its own per rank: arrivals of different ranks do not steal each other's.
  struct alignas(64) PaddedEpoch {
    std::atomic<uint64_t> value{0};
    std::atomic<uint64_t> out{0};           // the Header's out (PublishHeader)
    std::atomic<uint64_t> head[2][3] = {};  // collective seq's Header at [seq & 1], packed (PublishHeader)
  };
  static_assert(sizeof(PaddedEpoch) == 64);
  struct alignas(64) PaddedCpu {
    std::atomic<int> cpu{-1};  // where the rank last arrived (sched_getcpu)
  };
  struct alignas(64) PaddedQuiet {
    std::atomic<uint64_t> first{0};  // see MarkQuiet
  };
  struct alignas(64) Slot {  // lines of their own: ranks write their slots at the same time
    Call call;
  };
  std::vector<Slot> slots_;                 // [2][size]; slot (seq, r) is written by rank r only (PublishesCall)
  std::vector<Mailbox> mailboxes_;          // [2][size], as the slots
  std::vector<EagerSlot> eager_;            // [kEagerDepth]
  std::unique_ptr<Mailbox[]> eager_bytes_;  // [kEagerDepth]: eager_[i].data
  std::vector<PaddedEpoch> arrived_;        // barriers each rank has reached
  std::vector<PaddedCpu> cpus_;
  std::vector<PaddedQuiet> quiet_;
  std::vector<std::atomic<bool>> gone_;
  const bool light_arrive_ = RegisterProcessBarrier();  // see Arrive
  alignas(64) std::atomic<int> sleepers_{0};            // ranks in Sleep
  std::atomic<uint32_t> wake_{0};                       // the futex word of Sleep: bumped by Wake
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  absl::Status failure_;           // guarded by mu_
  std::vector<Channel> channels_;  // [src][dst], guarded by mu_
};

void Family::Join(const std::shared_ptr<ThreadGroup>& group) {
  absl::Status aborted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(groups_, [](const std::weak_ptr<ThreadGroup>& g) { return g.expired(); });
    groups_.push_back(group);
    aborted = aborted_;
  }
  if (!aborted.ok()) group->Fail(aborted);
}

void Family::Abort(const absl::Status& status) {
  std::vector<std::shared_ptr<ThreadGroup>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.ok()) return;
    aborted_ = status;
    aborted_flag_.store(true, std::memory_order_release);
    for (const auto& g : groups_) {
      if (auto p = g.lock()) live.push_back(std::move(p));
    }
  }
  for (const auto& g : live) g->Fail(status);
}

// ---------------------------------------------------------------------------------------------
// Validation (local to one rank).

absl::Status CheckTensor(const char* op, int rank, const char* name, const Tensor& t) {
  if (t.defined() && !t.device().is_cpu()) {
    return absl::UnimplementedError(
        absl::StrCat("[", op, "] rank ", rank, ": ", name, " is on ", t.device().ToString(),
                     "; the threads backend moves CPU tensors only (use the nccl backend)"));
  }
  return CheckContiguous(op, rank, name, t);
}

absl::Status CheckPair(const char* op, int rank, const Tensor& in, const Tensor& out) {
  DT_RETURN_IF_ERROR(CheckTensor(op, rank, "input", in));
  DT_RETURN_IF_ERROR(CheckTensor(op, rank, "output", out));
  return CheckSameDType(op, rank, in, out);
}

const char* Bytes(const Tensor& t) { return static_cast<const char*>(t.raw_data()); }
char* MutableBytes(const Tensor& t) { return static_cast<char*>(t.raw_data()); }

absl::StatusOr<std::unique_ptr<Work>> Done(absl::Status status) { return MakeCompletedWork(std::move(status)); }

class P2PWork final : public Work {
 public:
  P2PWork(std::shared_ptr<ThreadGroup> group, std::shared_ptr<P2POp> op, int rank, int peer, bool is_send,
          absl::Duration timeout)
      : group_(std::move(group)), op_(std::move(op)), rank_(rank), peer_(peer), is_send_(is_send), timeout_(timeout) {}
  // Dropped unfinished: an op no peer has matched is taken back, so it cannot consume a later
  // message of the pair (a matched one completes; the op keeps its tensor alive meanwhile).
  ~P2PWork() override {
    if (!waited_) group_->Withdraw(is_send_ ? rank_ : peer_, is_send_ ? peer_ : rank_, is_send_, *op_);
  }
  absl::Status Wait() override {
    if (!waited_) {
      result_ =
          group_->WaitP2P(rank_, peer_, is_send_ ? rank_ : peer_, is_send_ ? peer_ : rank_, is_send_, *op_, timeout_);
      waited_ = true;
    }
    return result_;
  }
  bool IsCompleted() override { return waited_ || op_->done.load(std::memory_order_acquire); }

 private:
  std::shared_ptr<ThreadGroup> group_;
  std::shared_ptr<P2POp> op_;
  int rank_, peer_;
  bool is_send_;
  absl::Duration timeout_;
  bool waited_ = false;
  absl::Status result_;
};

// ---------------------------------------------------------------------------------------------

// Cache-line aligned: the ranks' communicators are allocated one after the other, and each
// rank writes its own (seq_, epoch_) on every call; sharing a line with a peer's cost a miss
// per call (~1 us between this VM's vCPUs at times).
class alignas(64) ThreadsCommunicator final : public Communicator {
 public:
  // world_rank: this rank's in the world the group was split from (MakeThreadGroup's), for
  // messages that reach every group of the family.
  ThreadsCommunicator(std::shared_ptr<ThreadGroup> group, int rank, int world_rank, absl::Duration timeout)
      : group_(std::move(group)), rank_(rank), world_rank_(world_rank), timeout_(timeout) {
    if (size() > kLocalRanks) {
      spilled_heads_.resize(static_cast<size_t>(size()));
      spilled_inputs_.resize(static_cast<size_t>(size()));
    }
    heads_ = size() > kLocalRanks ? spilled_heads_.data() : local_heads_;
    inputs_ = size() > kLocalRanks ? spilled_inputs_.data() : local_inputs_;
  }
  ThreadsCommunicator(const ThreadsCommunicator&) = delete;
  ThreadsCommunicator& operator=(const ThreadsCommunicator&) = delete;
  ~ThreadsCommunicator() override { group_->MarkGone(rank_); }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Device device() const override { return Device::Cpu(); }
  const char* backend() const override { return "threads"; }
  void SetTimeout(absl::Duration timeout) override { timeout_ = timeout; }
  absl::Duration timeout() const override { return timeout_; }

  void Abort(const absl::Status& why) override {
    // The abort fails every group of the family, where rank_ may be another rank's number.
    group_->family()->Abort(absl::AbortedError(
        absl::StrCat("rank ", rank_, world_rank_ == rank_ ? "" : absl::StrCat(" (world rank ", world_rank_, ")"),
                     " aborted the communicator: ", why.ok() ? "no reason given" : why.ToString())));
  }

  // The blocking forms run the collective without a Work (the Async forms wrap the same call in
  // a completed one): a heap allocation less per call.
  absl::Status AllReduce(const Tensor& input, const Tensor& output, CommReduceOp op) override {
    return DoAllReduce(input, output, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const Tensor& input, const Tensor& output,
                                                       CommReduceOp op) override {
    return Done(DoAllReduce(input, output, op));
  }
  absl::Status AllGather(const Tensor& input, const Tensor& output) override { return DoAllGather(input, output); }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const Tensor& input, const Tensor& output) override {
    return Done(DoAllGather(input, output));
  }
  absl::Status AllGatherV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts) override {
    return DoAllGatherV(input, output, counts);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGatherVAsync(const Tensor& input, const Tensor& output,
                                                        absl::Span<const int64_t> counts) override {
    return Done(DoAllGatherV(input, output, counts));
  }
  absl::Status ReduceScatter(const Tensor& input, const Tensor& output, CommReduceOp op) override {
    return DoReduceScatter(input, output, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const Tensor& input, const Tensor& output,
                                                           CommReduceOp op) override {
    return Done(DoReduceScatter(input, output, op));
  }
  absl::Status ReduceScatterV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts,
                              CommReduceOp op) override {
    return DoReduceScatterV(input, output, counts, op);
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterVAsync(const Tensor& input, const Tensor& output,
                                                            absl::Span<const int64_t> counts,
                                                            CommReduceOp op) override {
    return Done(DoReduceScatterV(input, output, counts, op));
  }
  absl::Status AllToAll(const Tensor& input, const Tensor& output) override { return DoAllToAll(input, output); }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllAsync(const Tensor& input, const Tensor& output) override {
    return Done(DoAllToAll(input, output));
  }
  absl::Status AllToAllV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> send_counts,
                         absl::Span<const int64_t> recv_counts) override {
    return DoAllToAllV(input, output, send_counts, recv_counts);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(const Tensor& input, const Tensor& output,
                                                       absl::Span<const int64_t> send_counts,
                                                       absl::Span<const int64_t> recv_counts) override {
    return Done(DoAllToAllV(input, output, send_counts, recv_counts));
  }
  absl::Status Broadcast(const Tensor& tensor, int root) override { return DoBroadcast(tensor, root); }
  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(const Tensor& tensor, int root) override {
    return Done(DoBroadcast(tensor, root));
  }

  absl::Status DoAllReduce(const Tensor& input, const Tensor& output, CommReduceOp op) {
    constexpr const char* kOp = "AllReduce";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "output", output, input.numel(), "same as input"));
    DT_RETURN_IF_ERROR(CheckReducible(kOp, rank_, input.dtype(), op));
    Call call = NewCall(CallKind::kAllReduce, input, output);
    call.op = op;
    if (static_cast<int64_t>(input.nbytes()) <= InlineBytes(CallKind::kAllReduce)) {
      return RunInline(std::move(call), input, output, /*block_start=*/0, input.numel());
    }
    call.in = Stage(input, output, Bytes(output));
    return RunAllReduce(std::move(call));
  }

  absl::Status DoAllGather(const Tensor& input, const Tensor& output) {
    constexpr const char* kOp = "AllGather";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    if (output.numel() != size() * input.numel()) {  // the message is built only for the error
      return CheckNumel(kOp, rank_, "output", output, size() * input.numel(),
                        absl::StrCat("size ", size(), " x input ", input.numel()));
    }
    const int64_t bytes = static_cast<int64_t>(input.nbytes());
    return RunMove(NewCall(CallKind::kAllGather, input, output), input, output, Bytes(output) + rank_ * bytes,
                   bytes <= InlineBytes(CallKind::kAllGather));
  }

  absl::Status DoAllGatherV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts) {
    constexpr const char* kOp = "AllGatherV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckCounts(kOp, rank_, "counts", counts, size()));
    if (input.numel() != counts[static_cast<size_t>(rank_)]) {
      return CheckNumel(kOp, rank_, "input", input, counts[static_cast<size_t>(rank_)],
                        absl::StrCat("counts[", rank_, "]"));
    }
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "output", output, total, "sum of counts"));
    Call call = NewCall(CallKind::kAllGatherV, input, output);
    call.counts.assign(counts.begin(), counts.end());
    // One barrier where every block fits a mailbox (the counts are every rank's).
    const bool one_barrier =
        *std::max_element(counts.begin(), counts.end()) * ElementSizeOf(input) <= InlineBytes(CallKind::kAllGather);
    return RunMove(std::move(call), input, output, Bytes(output) + Prefix(counts, rank_) * ElementSizeOf(input),
                   one_barrier);
  }

  absl::Status DoReduceScatter(const Tensor& input, const Tensor& output, CommReduceOp op) {
    constexpr const char* kOp = "ReduceScatter";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    if (input.numel() != size() * output.numel()) {
      return CheckNumel(kOp, rank_, "input", input, size() * output.numel(),
                        absl::StrCat("size ", size(), " x output ", output.numel()));
    }
    DT_RETURN_IF_ERROR(CheckReducible(kOp, rank_, input.dtype(), op));
    Call call = NewCall(CallKind::kReduceScatter, input, output);
    call.op = op;
    if (static_cast<int64_t>(input.nbytes()) <= InlineBytes(CallKind::kReduceScatter)) {
      return RunInline(std::move(call), input, output, rank_ * output.numel(), output.numel());
    }
    call.in = StageForScatter(input, output, rank_ * output.numel());
    return RunReduceScatter(std::move(call));
  }

  absl::Status DoReduceScatterV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts,
                                CommReduceOp op) {
    constexpr const char* kOp = "ReduceScatterV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckCounts(kOp, rank_, "counts", counts, size()));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "input", input, total, "sum of counts"));
    if (output.numel() != counts[static_cast<size_t>(rank_)]) {
      return CheckNumel(kOp, rank_, "output", output, counts[static_cast<size_t>(rank_)],
                        absl::StrCat("counts[", rank_, "]"));
    }
    DT_RETURN_IF_ERROR(CheckReducible(kOp, rank_, input.dtype(), op));
    Call call = NewCall(CallKind::kReduceScatterV, input, output);
    call.op = op;
    call.counts.assign(counts.begin(), counts.end());
    if (static_cast<int64_t>(input.nbytes()) <= InlineBytes(CallKind::kReduceScatter)) {
      return RunInline(std::move(call), input, output, Prefix(counts, rank_), output.numel());
    }
    call.in = StageForScatter(input, output, Prefix(counts, rank_));
    return RunReduceScatter(std::move(call));
  }

  absl::Status DoAllToAll(const Tensor& input, const Tensor& output) {
    constexpr const char* kOp = "AllToAll";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    if (input.numel() % size() != 0) {
      return InvalidArg(kOp, "rank ", rank_, ": input has ", input.numel(),
                        " elements, not a multiple of the group size ", size());
    }
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "output", output, input.numel(), "same as input"));
    return RunMove(NewCall(CallKind::kAllToAll, input, output), input, output, nullptr,
                   static_cast<int64_t>(input.nbytes()) <= InlineBytes(CallKind::kAllToAll));
  }

  absl::Status DoAllToAllV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> send_counts,
                           absl::Span<const int64_t> recv_counts) {
    constexpr const char* kOp = "AllToAllV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, rank_, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t sent, CheckCounts(kOp, rank_, "send_counts", send_counts, size()));
    DT_ASSIGN_OR_RETURN(const int64_t received, CheckCounts(kOp, rank_, "recv_counts", recv_counts, size()));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "input", input, sent, "sum of send_counts"));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank_, "output", output, received, "sum of recv_counts"));
    Call call = NewCall(CallKind::kAllToAllV, input, output);
    call.counts.assign(send_counts.begin(), send_counts.end());
    call.recv_counts.assign(recv_counts.begin(), recv_counts.end());
    // Two barriers at every size: the ranks' inputs differ, so no size decides for all of them.
    return RunMove(std::move(call), input, output, nullptr, /*one_barrier=*/false);
  }

  // Each rank copies the block every peer addressed to it straight from the peer's view into
  // its own (strided on either side): every block is moved once, and nothing is packed.
  absl::Status AllToAllBlocks(absl::Span<const Tensor> sends, absl::Span<const Tensor> recvs,
                              bool /*uniform: every block moves the same way here*/) override {
    constexpr const char* kOp = "AllToAllBlocks";
    DT_ASSIGN_OR_RETURN(const DType dtype, CheckBlocks(kOp, rank_, sends, recvs, size()));
    Call call;
    call.kind = CallKind::kAllToAllBlocks;
    call.dtype = dtype;
    for (size_t j = 0; j < sends.size(); ++j) {
      // The names are built only for the error (this loop runs on every S -> S redistribution).
      if (!sends[j].device().is_cpu()) DT_RETURN_IF_ERROR(CheckDevice(kOp, absl::StrCat("sends[", j, "]"), sends[j]));
      if (!recvs[j].device().is_cpu()) DT_RETURN_IF_ERROR(CheckDevice(kOp, absl::StrCat("recvs[", j, "]"), recvs[j]));
      call.counts.push_back(sends[j].numel());
      call.recv_counts.push_back(recvs[j].numel());
    }
    call.blocks.assign(sends.begin(), sends.end());
    // A send view that shares bytes with a receive view (AllToAllBlocks(views, views)) is
    // copied first: this rank writes its receive views while the peers still read its sends.
    for (Tensor& t : call.blocks) {
      for (const Tensor& v : recvs) {
        if (Overlap(t, v)) {
          DT_ASSIGN_OR_RETURN(t, Clone(t));
          break;
        }
      }
    }
    DT_RETURN_IF_ERROR(Begin(kOp, std::move(call)));
    absl::Status status;
    for (int j = 0; j < size() && status.ok(); ++j) {
      const Tensor& dst = recvs[static_cast<size_t>(j)];
      const Tensor& src = Peer(j).blocks[static_cast<size_t>(rank_)];
      status = CopyElements(dst, src);
    }
    // Everyone reaches the closing barrier (peers still read this rank's blocks until then);
    // then the slot lets go of the views, so that they do not keep the caller's memory alive.
    const absl::Status synced = Sync(kOp, /*closing=*/true);
    if (synced.ok()) group_->slot(seq_, rank_).blocks.clear();
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("[", kOp, "] rank ", rank_, ": ", status.message()));
    }
    return synced;
  }

  absl::Status DoBroadcast(const Tensor& tensor, int root) {
    constexpr const char* kOp = "Broadcast";
    DT_RETURN_IF_ERROR(CheckTensor(kOp, rank_, "tensor", tensor));
    DT_RETURN_IF_ERROR(CheckPeer(kOp, rank_, "root", root, size()));
    Call call = NewCall(CallKind::kBroadcast, tensor, tensor);
    call.root = root;
    const bool small = static_cast<int64_t>(tensor.nbytes()) <= InlineBytes(CallKind::kBroadcast);
    if (small && !group_->debug()) return RunEagerBroadcast(call, tensor);
    return RunMove(std::move(call), tensor, tensor, Bytes(tensor), small);
  }

  // A small Broadcast (up to InlineBytes; not with DTENSOR_DEBUG=1) does not meet the group:
  // the root copies its tensor into the group's next eager slot (kEagerDepth of them, taken in
  // turn by every rank's count of small Broadcasts) with its header, publishes its arrival and
  // returns, as NCCL's and ucx's roots return once their message is out; a receiver publishes
  // its arrival, waits for the root's alone, checks the slot's call against its own and copies
  // the bytes. So a root may run up to kEagerDepth Broadcasts ahead of its slowest receiver,
  // which then takes them in one go where ranks share CPUs, instead of a switch per call. A root
  // reuses a slot once every rank has entered the small Broadcast after the one that used it
  // last (it has finished reading it then). These calls take no mailbox, header line or slot of
  // the meeting collectives (seq_ does not count them), and the checks still hold: a meeting
  // collective reads in each peer's header the barrier it was published at (PublishHeader), so
  // it sees a peer that made a small Broadcast instead (or skipped or added a call) out of step;
  // a receiver checks that its slot was written by the root at its own barrier and with its
  // call; two ranks that both act as the root of one call (they disagree on it) are found by the
  // second to take the slot (EagerSlot::claim), as no receiver may look. Each fails the group
  // with the mismatch, so the root, which returned already, fails at its next call (with
  // DTENSOR_DEBUG=1 every rank meets the others and gets the mismatch in the call itself).
  // (4 ranks on 2 cores, 4 / 16 KiB, us, alternating runs: 1.26-1.30 / 3.5-4.1 against
  // 2.0-4.1 / 5.2-7.0 meeting every rank through the mailboxes; ucx 1.3 / 3.6.)
  // A receiver whose root has arrived takes the bytes even if a peer has left since (a root may
  // leave once it returned); one still waiting for its root fails at once when any rank leaves
  // (the root would refuse the call: Sleep).
  absl::Status RunEagerBroadcast(const Call& call, const Tensor& tensor) {
    constexpr const char* kOp = "Broadcast";
    const int root = call.root;
    const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
    // A receiver whose root has arrived finds the bytes in the group's slot: it takes them even
    // if the root (or a receiver done with them) has left the group since; a root that returned
    // may leave without failing its receivers. (A failed group still fails the call.)
    const bool ready = rank_ != root && group_->HasArrived(root, epoch_ + 1);
    absl::Status usable = group_->CheckUsable(rank_, kOp, ready ? ThreadGroup::kNone : ThreadGroup::kAll);
    // The root may have arrived and left between the two looks; its arrival, read after its
    // departure, is final (as in Sleep).
    if (!usable.ok() && !ready && rank_ != root && group_->HasArrived(root, epoch_ + 1)) {
      usable = group_->CheckUsable(rank_, kOp, ThreadGroup::kNone);
    }
    DT_RETURN_IF_ERROR(usable);
    const uint64_t index = eager_count_++;
    const uint64_t target = ++epoch_;
    eager_epochs_[index % kEagerDepth] = target;
    EagerSlot& slot = group_->eager_slot(index);
    if (rank_ == root) {
      // Every rank has entered small Broadcast index - kEagerDepth + 1. The root looks at the
      // arrivals only when what it saw last does not tell: each look takes the receivers' arrival
      // lines, which they then have to take back before their next arrival goes out.
      const uint64_t need = eager_epochs_[(index + 1) % kEagerDepth];
      if (index >= kEagerDepth && eager_seen_ < need) {
        eager_seen_ = group_->LowestArrival();
        if (eager_seen_ < need) {
          DT_RETURN_IF_ERROR(group_->Await(rank_, need, kOp, timeout_, /*closing=*/true));
          eager_seen_ = need;
        }
      }
      const uint64_t claim = index << 24 | static_cast<uint64_t>(rank_);
      const uint64_t taken = slot.claim.exchange(claim, std::memory_order_acq_rel);
      if (taken != ~uint64_t{0} && taken >> 24 == index) {
        const absl::Status mismatch =
            InvalidArg("Debug", "rank ", taken & kRootMask, " and rank ", rank_,
                       " both called Broadcast as its root (rank ", rank_, " called ", Describe(call), ")");
        group_->Fail(mismatch);
        return mismatch;
      }
      Copy(slot.data, Bytes(tensor), bytes);
      slot.header = HeaderOf(call);
      slot.epoch = target;
      // Release: a receiver out of step (one that waited for another rank than this root) that
      // finds this index sees the whole slot.
      slot.index.store(index, std::memory_order_release);
      group_->Announce(rank_, target);
      return absl::OkStatus();
    }
    group_->Announce(rank_, target);
    // Closing: the slot is the group's memory, which a rank that gives up keeps.
    DT_RETURN_IF_ERROR(group_->Await(rank_, target, kOp, timeout_, /*closing=*/true, root));
    const bool in_step = slot.index.load(std::memory_order_acquire) == index && slot.epoch == target;
    if (!in_step || !SameHeader(slot.header, HeaderOf(call))) {
      const absl::Status mismatch =
          !in_step ? InvalidArg("Debug", "rank ", rank_, " called ", Describe(call), " but rank ", root,
                                " did not call it in step (it made a call rank ", rank_, " did not make, or none)")
                   : InvalidArg("Debug", "rank ", root, " called ", Describe(slot.header), " but rank ", rank_,
                                " called ", Describe(call));
      group_->Fail(mismatch);
      return mismatch;
    }
    Copy(MutableBytes(tensor), slot.data, bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const Tensor& tensor, int peer) override {
    return PostP2P("Send", tensor, peer, /*is_send=*/true);
  }
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(const Tensor& tensor, int peer) override {
    return PostP2P("Recv", tensor, peer, /*is_send=*/false);
  }

  absl::Status Barrier() override {
    Call call;
    call.kind = CallKind::kBarrier;
    return Begin("Barrier", std::move(call), /*closing=*/true);
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    Call call;
    call.kind = CallKind::kSplit;
    call.color = color;
    call.key = key;
    DT_RETURN_IF_ERROR(Begin("Split", std::move(call)));
    std::vector<int> members;  // my color's ranks ordered by (key, rank)
    if (color >= 0) {
      for (int j = 0; j < size(); ++j) {
        if (group_->slot(seq_, j).color == color) members.push_back(j);
      }
      std::stable_sort(members.begin(), members.end(),
                       [&](int a, int b) { return group_->slot(seq_, a).key < group_->slot(seq_, b).key; });
      if (members.front() == rank_) {
        auto split = std::make_shared<ThreadGroup>(static_cast<int>(members.size()), group_->debug(), group_->family());
        group_->family()->Join(split);
        group_->slot(seq_, rank_).split = std::move(split);
      }
    }
    DT_RETURN_IF_ERROR(Sync("Split", /*closing=*/true));  // the slots stay the group's
    if (color < 0) return std::unique_ptr<Communicator>();
    const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    return std::unique_ptr<Communicator>(std::make_unique<ThreadsCommunicator>(
        group_->slot(seq_, members.front()).split, new_rank, world_rank_, timeout_));
  }

 private:
  static int64_t ElementSizeOf(const Tensor& t) { return static_cast<int64_t>(ElementSize(t.dtype())); }
  static int64_t Prefix(absl::Span<const int64_t> counts, int upto) {
    int64_t p = 0;
    for (int j = 0; j < upto; ++j) p += counts[static_cast<size_t>(j)];
    return p;
  }
  // Elements [Block(n, r), Block(n, r + 1)) are reduced by rank r.
  int64_t BlockStart(int64_t n, int r) const { return n * r / size(); }

  Call NewCall(CallKind kind, const Tensor& in, const Tensor& out) const {
    Call call;
    call.kind = kind;
    call.dtype = in.dtype();
    call.numel = in.numel();
    call.in = Bytes(in);
    call.out = MutableBytes(out);
    return call;
  }

  // The input pointer to publish: the input itself when it does not overlap the output or
  // starts exactly at `in_place` (the aliasing the algorithm supports), else a private copy.
  const char* Stage(const Tensor& in, const Tensor& out, const char* in_place) {
    if (!Overlap(in, out) || Bytes(in) == in_place) return Bytes(in);
    // After a failure a slow peer may still read the last staged copy: leave it (Begin then
    // fails this call).
    if (!group_->CheckUsable(rank_, "Stage", -1).ok()) return Bytes(in);
    staging_.assign(Bytes(in), Bytes(in) + in.nbytes());
    return staging_.data();
  }
  // ReduceScatter(V): output may be exactly this rank's block of the input.
  const char* StageForScatter(const Tensor& in, const Tensor& out, int64_t block_start) {
    return Stage(in, out, Bytes(out) == Bytes(in) + block_start * ElementSizeOf(in) ? Bytes(in) : nullptr);
  }

  // Waits for every rank; `closing` when no rank reads another's buffers after it (see Arrive).
  absl::Status Sync(const char* op, bool closing = false) {
    return group_->Arrive(rank_, ++epoch_, op, timeout_, closing);
  }
  // Sync, running own() after this rank's arrival is out and before it waits for the peers'; with
  // `header`, the arrival publishes it (as collective seq_'s).
  absl::Status Sync(const char* op, bool closing, absl::FunctionRef<void()> own, const Header* header = nullptr) {
    group_->Announce(rank_, ++epoch_, header, seq_);
    own();
    return group_->Await(rank_, epoch_, op, timeout_, closing);
  }

  absl::Status CheckDevice(const char* op, const std::string& name, const Tensor& t) const {
    if (t.device().is_cpu()) return absl::OkStatus();
    return absl::UnimplementedError(
        absl::StrCat("[", op, "] rank ", rank_, ": ", name, " is on ", t.device().ToString(),
                     "; the threads backend moves CPU tensors only (use the nccl backend)"));
  }

  // dst = src element for element in row-major order (equal counts, shapes may differ).
  // `src` is usually a peer's tensor: it is read, not copied (a copy would write the peer's
  // reference count, a cache line its owner touches again right after).
  static absl::Status CopyElements(const Tensor& dst, const Tensor& src) {
    if (dst.numel() == 0) return absl::OkStatus();
    const bool overlap = Overlap(dst, src);  // a rank's own block sent onto itself, or shared memory
    if (!overlap && src.shape() == dst.shape()) return CopyBlock(dst, src);
    Tensor from = src;
    if (overlap) {
      DT_ASSIGN_OR_RETURN(from, Clone(src));
    }
    if (from.shape() != dst.shape()) {
      DT_ASSIGN_OR_RETURN(from, Contiguous(from));
      DT_ASSIGN_OR_RETURN(from, from.View(dst.shape()));
    }
    return CopyBlock(dst, from);
  }

  // Publishes `call`, waits for every rank's, and checks that they match (every rank reaches
  // the same verdict from the same slots). `closing` for a call that reads nothing but the
  // group's memory after it (a barrier, the one-barrier paths).
  absl::Status Begin(
      const char* op, Call&& call, bool closing = false, absl::FunctionRef<void()> own = [] {}) {
    DT_RETURN_IF_ERROR(group_->CheckUsable(rank_, op, -1));
    return Publish(op, std::move(call), closing, own);
  }

  // This rank's mailbox data for its next collective, to fill before Publish, once the group is
  // usable: after a failure a slow peer may still read the mailbox of two collectives ago, which
  // the next one reuses.
  absl::StatusOr<char*> NextMailbox(const char* op) {
    DT_RETURN_IF_ERROR(group_->CheckUsable(rank_, op, -1));
    return group_->mailbox(seq_ + 1, rank_).data;
  }

  // Begin, the group's usability checked before.
  // own() runs while this rank waits at the barrier (see Sync).
  absl::Status Publish(
      const char* op, Call&& call, bool closing, absl::FunctionRef<void()> own = [] {}) {
    const uint64_t before = epoch_;
    absl::Status st = PublishAndCheck(op, std::move(call), closing, own);
    // A rank that announced and fails writes nothing into its peers in this collective: said at
    // once, so that a peer in a writing collective (a mismatched call) need not wait for it.
    if (!st.ok() && epoch_ != before) group_->MarkQuiet(rank_, epoch_);
    return st;
  }
  absl::Status PublishAndCheck(const char* op, Call&& call, bool closing, absl::FunctionRef<void()> own) {
    ++seq_;
    const Header header = HeaderOf(call);
    if (PublishesCall(call.kind)) group_->slot(seq_, rank_) = std::move(call);
    DT_RETURN_IF_ERROR(Sync(op, closing, own, &header));
    int stale = -1;  // a peer whose header is not from this barrier: not in this collective
    for (int j = 0; j < size(); ++j) {
      heads_[j] = group_->ReadHeader(j, seq_);
      inputs_[j] = heads_[j].in;
      if (heads_[j].tag != static_cast<uint32_t>(epoch_)) stale = j;
    }
    if (stale >= 0) {
      const absl::Status mismatch =
          InvalidArg("Debug", "rank ", rank_, " called ",
                     PublishesCall(header.kind) ? Describe(group_->slot(seq_, rank_)) : Describe(header), " but rank ",
                     stale, " did not call it in step (it made a small Broadcast, which ",
                     "does not meet the group, or a call rank ", rank_, " did not make)");
      group_->Fail(mismatch);
      return mismatch;
    }
    const Header& first = Head(0);
    bool same = true;
    for (int j = 1; j < size() && same; ++j) same = SameHeader(first, Head(j));
    if (!same || NeedsFullCall(first.kind)) {
      // A rank's slot holds its whole call only where its kind PublishesCall: a slot of another
      // kind may be left from an earlier collective.
      auto describe = [&](int j) { return PublishesCall(Head(j).kind) ? Describe(Peer(j)) : Describe(Head(j)); };
      for (int j = 1; j < size(); ++j) {
        const bool whole = PublishesCall(first.kind) && PublishesCall(Head(j).kind);
        if (!SameHeader(first, Head(j)) || (whole && !SameCall(Peer(0), Peer(j)))) {
          return InvalidArg("Debug", "rank 0 called ", describe(0), " but rank ", j, " called ", describe(j));
        }
      }
    }
    if (first.kind == CallKind::kAllToAllV || first.kind == CallKind::kAllToAllBlocks) {
      for (int i = 0; i < size(); ++i) {
        for (int j = 0; j < size(); ++j) {
          const int64_t sends = group_->slot(seq_, i).counts[static_cast<size_t>(j)];
          const int64_t expects = group_->slot(seq_, j).recv_counts[static_cast<size_t>(i)];
          if (sends != expects) {
            return InvalidArg("Debug", "in ", CallName(first.kind), " rank ", i, " sends ", sends, " elements to rank ",
                              j, " but rank ", j, " expects ", expects, " from rank ", i);
          }
        }
      }
    }
    return absl::OkStatus();
  }

  // Rank j's call of the current collective: its header, or all of it (where PublishesCall).
  const Header& Head(int j) const { return heads_[j]; }
  const Call& Peer(int j) const { return group_->slot(seq_, j); }
  absl::Span<const char* const> Inputs() const { return absl::MakeConstSpan(inputs_, static_cast<size_t>(size())); }

  // Small reductions in one barrier: every rank copies what its peers read of its input
  // (AllReduce: all of it; ReduceScatter: all but its own block) into its mailbox and publishes
  // it with its call; after the barrier each reduces elements [begin, begin + count) of the
  // mailboxes into its output, its own part from its input (AllReduce: all elements, every
  // rank the same bits, as the sources are folded in rank order). Nobody reads the caller's
  // buffers after this rank returns, so no closing barrier; the mailbox is rewritten two
  // collectives later, after every rank has entered the next one. The output is written only
  // after the barrier; where it overlaps the input other than exactly in place, the own part
  // is read from the mailbox too.
  absl::Status RunInline(Call&& call, const Tensor& input, const Tensor& output, int64_t begin, int64_t count) {
    const char* op = CallName(call.kind);
    const DType dtype = call.dtype;
    const CommReduceOp rop = call.op;
    const int64_t es = static_cast<int64_t>(ElementSize(dtype));
    char* out = call.out;
    const char* in = Bytes(input);
    const bool own_from_input = !Overlap(input, output) || out == in + begin * es;
    DT_ASSIGN_OR_RETURN(char* box, NextMailbox(op));
    const int64_t bytes = static_cast<int64_t>(input.nbytes());
    if (call.kind == CallKind::kAllReduce || !own_from_input) {
      Copy(box, in, bytes);
    } else {
      Copy(box, in, begin * es);
      Copy(box + (begin + count) * es, in + (begin + count) * es, bytes - (begin + count) * es);
    }
    call.in = box;
    // Closing: what the peers read after it is the group's, which a rank that gives up does
    // not free, so a failure after every rank arrived does not fail the call (as with the
    // closing barrier of the other collectives).
    DT_RETURN_IF_ERROR(Publish(op, std::move(call), /*closing=*/true));
    if (own_from_input) inputs_[rank_] = in;
    ReduceInRankOrder(dtype, rop, Inputs(), begin, count, out);
    return absl::OkStatus();
  }

  // Rank r reduces block r of every input, a chunk at a time, into its output and copies each
  // chunk into every peer's output while it is still in cache, so nobody reads a result back
  // and one barrier ends the call. In place is fine: block r of any buffer is read and
  // written by rank r alone, chunk by chunk. (2 ranks, 4 MiB: 0.29-0.31 ms against
  // 0.45-0.47 ms reducing the whole block, a barrier, and copying the peers' blocks back.)
  absl::Status RunAllReduce(Call&& call) {
    const char* op = "AllReduce";
    const DType dtype = call.dtype;
    const CommReduceOp rop = call.op;
    const int64_t n = call.numel;
    const int64_t es = static_cast<int64_t>(ElementSize(dtype));
    char* out = call.out;
    DT_RETURN_IF_ERROR(BeginWriting(op, std::move(call)));
    const uint64_t first = epoch_;
    const int64_t begin = BlockStart(n, rank_), end = BlockStart(n, rank_ + 1);
    const int64_t chunk = std::max<int64_t>(1, kPushChunkBytes / es);
    const absl::Span<const char* const> in = Inputs();
    if (UseStreaming(n * es * size())) {
      const int64_t sc = std::max<int64_t>(1, kStreamChunkBytes / es);
      alignas(64) char tmp[kStreamChunkBytes];
      for (int64_t at = begin; at < end; at += sc) {
        const int64_t m = std::min(sc, end - at);
        ReduceInRankOrder(dtype, rop, in, at, m, tmp);
        for (int k = 0; k < size(); ++k) StreamCopy(Head((rank_ + k) % size()).out + at * es, tmp, m * es);
      }
      StreamFence();
    } else {
      for (int64_t at = begin; at < end; at += chunk) {
        const int64_t m = std::min(chunk, end - at);
        ReduceInRankOrder(dtype, rop, in, at, m, out + at * es);
        for (int k = 1; k < size(); ++k) {
          Copy(Head((rank_ + k) % size()).out + at * es, out + at * es, m * es);
        }
      }
    }
    // Every block is in every output; nobody reads this rank's buffers any more.
    return EndWriting(op, first);
  }

  // Begin for a collective whose ranks write into their peers' outputs (see MarkQuiet): a
  // rank that announced its first barrier and fails there waits for the peers' writes.
  absl::Status BeginWriting(
      const char* op, Call&& call, absl::FunctionRef<void()> own = [] {}) {
    const uint64_t before = epoch_;
    absl::Status begun = Begin(op, std::move(call), /*closing=*/false, own);
    if (!begun.ok() && epoch_ != before) group_->AwaitWriters(rank_, epoch_, timeout_);
    return begun;
  }
  // After this rank's writes of the collective whose first barrier is `first`: the closing
  // barrier, and on its failure the wait for the peers' writes.
  absl::Status EndWriting(const char* op, uint64_t first) {
    group_->MarkQuiet(rank_, first);
    absl::Status done = Sync(op, /*closing=*/true);
    if (!done.ok()) group_->AwaitWriters(rank_, first, timeout_);
    return done;
  }

  // The moving collectives: every rank copies what it needs of the inputs its peers publish
  // into its output (AllGather(V): every block; AllToAll(V): block r of every input; Broadcast:
  // the root's tensor, large ones a block of the bytes by each rank into every receiver). With
  // `one_barrier` (small messages, every rank alike: see InlineBytes) each rank (Broadcast: the
  // root) copies its input into its mailbox (AllToAll: the peers' blocks only) and publishes
  // that: as in RunInline, the peers then read only the group's memory, so there is no closing
  // barrier, and in-place calls need no staging. Otherwise it publishes its input (staged where
  // it overlaps the output other than starting at `in_place`), and a closing barrier ends the
  // reading of the peers' buffers. Either way a rank's own block (AllGather(V), AllToAll) is
  // copied while it waits at the first barrier.
  absl::Status RunMove(Call&& call, const Tensor& input, const Tensor& output, const char* in_place, bool one_barrier) {
    const char* op = CallName(call.kind);
    const CallKind kind = call.kind;
    const int64_t es = static_cast<int64_t>(ElementSize(call.dtype));
    const int64_t numel = call.numel;
    const int root = call.root;
    char* out = call.out;
    // This rank's own block (AllGather(V), AllToAll) is copied while it waits at the barrier:
    // nobody else reads or writes it. From `own_src` to `own_dst`, `own_bytes`; memmove, as in
    // one barrier the input may overlap the output (its other bytes are in the mailbox by then).
    const bool gathers = kind == CallKind::kAllGather || kind == CallKind::kAllGatherV;
    const bool own_early = gathers || kind == CallKind::kAllToAll;
    const int64_t own_bytes = kind == CallKind::kAllToAll ? numel / size() * es : gathers ? numel * es : 0;
    char* const own_dst = kind == CallKind::kAllToAll ? out + rank_ * own_bytes : const_cast<char*>(in_place);
    const char* own_src = Bytes(input) + (kind == CallKind::kAllToAll ? rank_ * own_bytes : 0);
    auto own = [&] {
      if (own_early && own_bytes > 0 && own_dst != own_src)
        std::memmove(own_dst, own_src, static_cast<size_t>(own_bytes));
    };
    // A large Broadcast: every rank writes its block of the bytes into every receiver's output.
    const bool split_broadcast = kind == CallKind::kBroadcast && !one_barrier && numel * es >= kSplitBroadcastBytes;
    if (one_barrier) {
      DT_ASSIGN_OR_RETURN(char* box, NextMailbox(op));
      if (kind == CallKind::kAllToAll) {  // the peers' blocks only, each at its place
        for (int j = 0; j < size(); ++j) {
          if (j != rank_) Copy(box + j * own_bytes, Bytes(input) + j * own_bytes, own_bytes);
        }
      } else if (kind != CallKind::kBroadcast || rank_ == root) {
        Copy(box, Bytes(input), numel * es);
      }
      call.in = box;
      DT_RETURN_IF_ERROR(Publish(op, std::move(call), /*closing=*/true, own));
    } else {
      call.in = Stage(input, output, in_place);
      own_src = call.in + (own_src - Bytes(input));  // the staged copy where there is one
      if (split_broadcast) {
        DT_RETURN_IF_ERROR(BeginWriting(op, std::move(call), own));
      } else {
        DT_RETURN_IF_ERROR(Begin(op, std::move(call), /*closing=*/false, own));
      }
    }
    const uint64_t first = epoch_;
    switch (kind) {
      case CallKind::kBroadcast:
        if (split_broadcast) {
          // Every rank, the root too, copies its block of the bytes to every receiver: the root's
          // core would idle otherwise (2 ranks: both cores copy, about twice the bandwidth). (Not
          // in one barrier: a receiver would return while the root still writes its output.)
          const int64_t bytes = numel * es;
          const int64_t begin = BlockStart(bytes, rank_), end = BlockStart(bytes, rank_ + 1);
          const char* src = Head(root).in;
          for (int d = 0; d < size(); ++d) {
            if (d != root) Copy(Head(d).out + begin, src + begin, end - begin);
          }
        } else if (rank_ != root) {
          Copy(out, Head(root).in, numel * es);  // small: the bytes land in the cache that reads them next
        }
        break;
      case CallKind::kAllToAll:
      case CallKind::kAllToAllV: {
        const bool uneven = kind == CallKind::kAllToAllV;
        const int64_t n = numel / size();
        int64_t offset = 0;
        for (int j = 0; j < size(); ++j) {
          const int64_t from = uneven ? Prefix(Peer(j).counts, rank_) : n * rank_;
          const int64_t count = uneven ? Peer(j).counts[static_cast<size_t>(rank_)] : n;
          if (uneven || j != rank_) Copy(out + offset * es, Head(j).in + from * es, count * es);
          offset += count;
        }
        break;
      }
      default: {  // AllGather(V)
        const bool uneven = kind == CallKind::kAllGatherV;
        int64_t offset = 0;
        for (int j = 0; j < size(); ++j) {
          const int64_t count = uneven ? Peer(j).counts[static_cast<size_t>(j)] : numel;
          if (j != rank_) Copy(out + offset * es, Head(j).in, count * es);  // (its own: by own())
          offset += count;
        }
      }
    }
    if (one_barrier) return absl::OkStatus();
    return split_broadcast ? EndWriting(op, first) : Sync(op, /*closing=*/true);
  }

  // ReduceScatter(V): rank r reduces its block of every input into its output.
  absl::Status RunReduceScatter(Call&& call) {
    const char* op = CallName(call.kind);
    const bool uneven = call.kind == CallKind::kReduceScatterV;
    const DType dtype = call.dtype;
    const CommReduceOp rop = call.op;
    const int64_t begin = uneven ? Prefix(call.counts, rank_) : call.numel / size() * rank_;
    const int64_t count = uneven ? call.counts[static_cast<size_t>(rank_)] : call.numel / size();
    char* out = call.out;
    DT_RETURN_IF_ERROR(Begin(op, std::move(call)));
    ReduceInRankOrder(dtype, rop, Inputs(), begin, count, out);
    return Sync(op, /*closing=*/true);
  }

  absl::StatusOr<std::unique_ptr<Work>> PostP2P(const char* op, const Tensor& tensor, int peer, bool is_send) {
    DT_RETURN_IF_ERROR(CheckTensor(op, rank_, "tensor", tensor));
    DT_RETURN_IF_ERROR(CheckPeer(op, rank_, "peer", peer, size()));
    if (peer == rank_) return InvalidArg(op, "rank ", rank_, ": peer is this rank (", peer, ")");
    DT_RETURN_IF_ERROR(group_->CheckUsable(rank_, op, peer));
    auto p2p = std::make_shared<P2POp>();
    p2p->tensor = tensor;
    group_->Post(is_send ? rank_ : peer, is_send ? peer : rank_, is_send, p2p);
    return std::unique_ptr<Work>(std::make_unique<P2PWork>(group_, std::move(p2p), rank_, peer, is_send, timeout_));
  }

  // The largest input a call of `kind` sends through the mailboxes (RunInline, RunMove's
  // one_barrier; AllGatherV: its largest block). Every rank of a collective decides alike
  // (Begin fails them all where their calls differ, after the first barrier).
  int64_t InlineBytes(CallKind kind) const {
    const bool share = group_->family()->share_cpus();
    switch (kind) {
      case CallKind::kAllReduce:
        return share ? kInlineAllReduceBytes : kOwnCpuInlineAllReduceBytes;
      case CallKind::kReduceScatter:
        return share ? kInlineReduceScatterBytes : kOwnCpuInlineReduceScatterBytes;
      case CallKind::kAllGather:
        return share ? kInlineAllGatherBytes : kOwnCpuInlineAllGatherBytes;
      case CallKind::kAllToAll:
        return share ? kInlineAllToAllBytes : kOwnCpuInlineAllToAllBytes;
      default:
        return share ? kInlineBroadcastBytes : kOwnCpuInlineBroadcastBytes;
    }
  }

  std::shared_ptr<ThreadGroup> group_;
  int rank_;
  int world_rank_;
  absl::Duration timeout_;
  uint64_t epoch_ = 0;                       // barriers passed (all ranks of the group pass the same ones)
  uint64_t seq_ = 0;                         // collectives begun that meet the group (all but RunEagerBroadcast's)
  uint64_t eager_count_ = 0;                 // small Broadcasts made (RunEagerBroadcast)
  uint64_t eager_seen_ = 0;                  // a barrier every rank had reached when a root last looked
  uint64_t eager_epochs_[kEagerDepth] = {};  // the barrier of small Broadcast i at [i % kEagerDepth]
  std::vector<char> staging_;
  // The ranks' headers of collective seq_ (Publish) and their `in`s. Written on every call: for
  // groups of up to kLocalRanks in this object's own cache lines (a vector's buffer, allocated
  // beside the peers' when MakeThreadGroup makes them all, could share a line with theirs).
  static constexpr int kLocalRanks = 8;
  Header local_heads_[kLocalRanks];
  const char* local_inputs_[kLocalRanks] = {};
  std::vector<Header> spilled_heads_;
  std::vector<const char*> spilled_inputs_;
  Header* heads_;
  const char** inputs_;
};

}  // namespace
}  // namespace internal

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeThreadGroup(int world_size, absl::Duration timeout) {
  if (world_size < 1 || static_cast<uint64_t>(world_size) >= internal::kRootMask) {
    return InvalidArg("MakeThreadGroup", "world_size must be in [1, ", internal::kRootMask - 1, "], got ", world_size);
  }
  const char* env = std::getenv("DTENSOR_DEBUG");
  const bool debug = env != nullptr && std::string(env) == "1";
  auto family = std::make_shared<internal::Family>(world_size);
  auto group = std::make_shared<internal::ThreadGroup>(world_size, debug, family);
  family->Join(group);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    comms.push_back(std::make_unique<internal::ThreadsCommunicator>(group, r, r, timeout));
  }
  return comms;
}

}  // namespace dtensor
