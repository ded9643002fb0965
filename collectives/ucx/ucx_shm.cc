#include "dtensor/collectives/ucx/ucx_shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <linux/membarrier.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dtensor/collectives/cpu_primitives.h"

namespace dtensor::internal {
namespace {

constexpr int64_t kSpinNs = 50'000;  // when every rank has a CPU of its own (hyperthreads count as CPUs)
// Then sched_yield until this, then futex sleeps; ranks sharing CPUs yield from the start.
// They yield this long too: a yield hands the CPU to the ranks sharing it, and a sleeper whose
// CPU goes idle wakes late (a VM's idle vCPU is descheduled by its host). 4 ranks on 2 vCPUs,
// 8 interleaved runs, 4-64 KiB: 200 us beat the earlier 5 us in 12 of 15 rows (broadcast 16 KiB
// 2.19 -> 2.02 us, all_gather 16 KiB 7.46 -> 6.85 us, all_reduce 64 KiB 29.8 -> 26.4 us).
constexpr int64_t kYieldNs = 200'000;
// Checks of a peer's epoch, a pause apart, before the wait does anything else: in WaitRank's
// first look, then in each round of WaitFor's loop (which then polls UCX and may yield). A
// pause takes ~25 ns on this VM's AMD EPYC (~140 cycles on recent Intel). With a CPU per rank
// they catch a peer that is about to arrive. Ranks that share CPUs yield soon instead: the
// peer they wait for is often the one waiting for this CPU, and the earlier 64 + 32 pauses
// (~2.5 us per wait) held it back. 4 ranks on 2 cores, 4-64 KiB, the two settings timed
// trial by trial in the same runs (3 runs): 4 KiB all_reduce 6.4-11.9 -> 4.4-7.3 us, all_gather
// 4.9-5.8 -> 2.8-3.3, reduce_scatter 5.1-5.7 -> 3.0-3.6, all_to_all 5.1-5.6 -> 2.9-3.5; 64 KiB
// rows 5-25% faster, broadcast 3-20%; 2, 4 and 8 pauses per round measured alike.
constexpr int kFirstSpins = 64, kRoundSpins = 32;
constexpr int kSharedCpuFirstSpins = 2, kSharedCpuRoundSpins = 8;
constexpr int64_t kPeerCheckNs = 1'000'000;   // a sleeper wakes at least this often (pidfds, deadline)
constexpr int64_t kUnfencedSleepNs = 50'000;  // the same where a wake-up can be missed (see WaitFor)

// Sleeps while *word == expected (shared-memory futex: not FUTEX_PRIVATE), at most timeout_ns.
void FutexWait(uint32_t* word, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts {
    static_cast<time_t>(timeout_ns / 1'000'000'000), static_cast<long>(timeout_ns % 1'000'000'000)
  };
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0); }

// A full memory barrier on every running thread of every process that registered for it
// (membarrier(2)): the slow side of an asymmetric fence.
bool ProcessesBarrier() { return syscall(SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0) == 0; }

}  // namespace

bool ShmGroup::RegisterProcessBarrier() {
  static const bool registered = [] {
    const long cmds = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    const long need = MEMBARRIER_CMD_GLOBAL_EXPEDITED | MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED;
    return cmds >= 0 && (cmds & need) == need &&
           syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) == 0;
  }();
  return registered;
}

std::string ShmGroup::NewName(uint16_t comm_id) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat("/dtensor-ucx-", getpid(), "-", comm_id, "-", counter.fetch_add(1), "-", NowNs() % 1000000007);
}

absl::StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::Map(const std::string& name, bool create, int rank,
                                                        std::vector<int> members, UcxWorld* world) {
  const size_t p = members.size();
  const size_t ctl = (p * 64 + 4095) / 4096 * 4096;
  const size_t bytes = ctl + (2 * p + 2) * kSlotBytes;
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_open ", name, ": ", std::strerror(errno)));
  const char* step = "";
  int err = 0;
  if (create) {
    // Every page is allocated here: where /dev/shm cannot hold the segment (a container's
    // default 64 MiB, shared with UCX's own segments) a store to a page that could not be
    // allocated would be SIGBUS. posix_fallocate says ENOSPC instead.
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      step = "sizing";
      err = errno;
    } else {
      while ((err = posix_fallocate(fd, 0, static_cast<off_t>(bytes))) == EINTR) {
      }
      if (err != 0) step = "allocating";
    }
  } else {
    struct stat st {};
    step = "checking";
    if (fstat(fd, &st) != 0) {
      err = errno;
    } else if (static_cast<size_t>(st.st_size) != bytes) {
      err = EINVAL;
    }
  }
  // Populated now, so that no collective takes the page faults (and the first timed copy into
  // the slots, which picks plain or streaming stores, measures copying, not faulting).
  void* base = MAP_FAILED;
  if (err == 0) {
    step = "mapping";
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) err = errno;
  }
  close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    return absl::UnavailableError(
        absl::StrCat(step, " the shared-memory segment /dev/shm", name, " (", bytes, " bytes): ", std::strerror(err),
                     err == ENOSPC ? "; /dev/shm is full or too small (docker run --shm-size)" : ""));
  }
  std::unique_ptr<ShmGroup> g(new ShmGroup());
  g->base_ = static_cast<char*>(base);
  g->bytes_ = bytes;
  g->ctl_bytes_ = ctl;
  g->rank_ = rank;
  g->members_ = std::move(members);
  g->seen_.assign(p, 0);
  g->swept_releases_.assign(p, 0);
  g->world_ = world;
  g->set_oversubscribed(true);  // until the ranks agree (UcxCommunicator's Setup)
  if (const char* v = std::getenv("DTENSOR_UCX_STREAMING"); v != nullptr && (v[0] == '0' || v[0] == '1') && v[1] == 0) {
    g->forced_streaming_ = v[0] - '0';
  }
  return g;
}

void ShmGroup::set_oversubscribed(bool v) {
  oversubscribed_ = v;
  spin_ns_ = v ? 0 : kSpinNs;
  first_spins_ = v ? kSharedCpuFirstSpins : kFirstSpins;
  round_spins_ = v ? kSharedCpuRoundSpins : kRoundSpins;
}

void ShmGroup::Unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmGroup::~ShmGroup() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

void ShmGroup::MarkFailed() {
  std::atomic_ref<uint32_t>(*failed_of(rank_)).store(1, std::memory_order_seq_cst);
  FutexWakeAll(word_of(rank_));  // sleepers wake and look at the flags
}

void ShmGroup::Arrive() {
  const uint64_t e = ++epoch_;
  std::atomic_ref<uint64_t>(*epoch_of(rank_)).store(e, std::memory_order_release);
  // Pairs with the sleeper's fence between counting itself and re-reading the epoch: either
  // it sees the new epoch, or this sees its count and wakes it. No extra store: the futex
  // word is the epoch's low half, which every arrival changes. With light arrivals the
  // sleeper's side is a barrier on every CPU (membarrier), so this one needs none: a fence
  // here waits for this step's stores (a broadcast root's whole message) to leave the core.
  if (light_arrive_) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
  } else {
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  if (std::atomic_ref<uint32_t>(*waiters_of(rank_)).load(std::memory_order_relaxed) != 0) {
    FutexWakeAll(word_of(rank_));
  }
}

void ShmGroup::Quiesce(uint64_t first, uint64_t done, const UcxWaitContext& ctx) {
  MarkFailed();
  // Pairs with the fence in a peer's Arrive: either this sees its arrival at `first`, or it
  // sees the failed flag before it writes. Peers that arrive light (no fence) get the barrier
  // on their CPUs instead; where that fails, a peer short of `first` counts as busy.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const bool fenced = !light_arrive_ || ProcessesBarrier();
  const int64_t deadline = ctx.DeadlineNs(NowNs());
  for (;;) {
    bool quiet = true;
    for (int j = 0; j < static_cast<int>(members_.size()) && quiet; ++j) {
      if (j == rank_ || (fenced && !Arrived(j, first)) || Arrived(j, done)) continue;
      if (std::atomic_ref<uint32_t>(*failed_of(j)).load(std::memory_order_acquire) != 0) continue;
      quiet = !world_->gone(members_[static_cast<size_t>(j)]).empty();
    }
    if (quiet || NowNs() >= deadline) return;
    world_->PollPeers();  // notices peers that exited
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool ShmGroup::Arrived(int j, uint64_t e) const {
  uint64_t& seen = seen_[static_cast<size_t>(j)];
  if (seen < e) seen = std::atomic_ref<uint64_t>(*epoch_of(j)).load(std::memory_order_acquire);
  return seen >= e;
}

absl::Status ShmGroup::WaitRank(int j, uint64_t e, const UcxWaitContext& ctx) {
  uint64_t& seen = seen_[static_cast<size_t>(j)];
  if (seen >= e) return absl::OkStatus();  // no load: the line stays where its writer has it
  std::atomic_ref<uint64_t> theirs(*epoch_of(j));
  for (int i = 0; i < first_spins_; ++i) {
    if ((seen = theirs.load(std::memory_order_acquire)) >= e) return absl::OkStatus();
    CpuRelax();
  }
  return WaitFor(j, e, ctx);
}

absl::Status ShmGroup::Sync(const UcxWaitContext& ctx) {
  Arrive();
  return WaitAll(ctx);
}

absl::Status ShmGroup::WaitAll(const UcxWaitContext& ctx) {
  for (int j = 0; j < static_cast<int>(members_.size()); ++j) {
    if (j == rank_) continue;
    absl::Status s = WaitRank(j, epoch_, ctx);
    if (!s.ok()) return s;
  }
  Passed();
  return absl::OkStatus();
}

absl::Status ShmGroup::BeginRingWrite(uint64_t e, const UcxWaitContext& ctx) {
  const uint64_t lap = 2 * kRingSlots;
  // Readers of step n are done once they arrive at n (relaxed) or n + 1 (Sync'ed: they read
  // after the Sync); the step after n uses the other buffer, so only a step of n's parity
  // needs the stronger bound.
  uint64_t need = std::max(e > lap ? e - lap : 0, last_full_);
  if ((e - last_full_) % 2 == 0) need = std::max(need, last_full_ + 1);
  for (int j = 0; j < static_cast<int>(members_.size()); ++j) {
    if (j == rank_) continue;
    absl::Status s = WaitRank(j, need, ctx);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::BeginWrite(const UcxWaitContext& ctx) {
  if (!relaxed_) return absl::OkStatus();
  for (int j = 0; j < static_cast<int>(members_.size()); ++j) {
    if (j == rank_) continue;
    absl::Status s = WaitRank(j, epoch_, ctx);
    if (!s.ok()) return s;
  }
  relaxed_ = false;
  return absl::OkStatus();
}

absl::Status ShmGroup::WaitFor(int j, uint64_t epoch, const UcxWaitContext& ctx) {
  std::atomic_ref<uint64_t> theirs(*epoch_of(j));
  uint64_t& seen = seen_[static_cast<size_t>(j)];
  auto reached = [&] { return (seen = theirs.load(std::memory_order_acquire)) >= epoch; };
  // From its first sleep to its return this rank counts among rank j's sleepers (see Arrive):
  // one count, fence and barrier for the whole wait, however often it sleeps (a barrier per
  // sleep would interrupt every CPU of every rank up to a thousand times a second while one
  // rank is late).
  uint32_t* counted = nullptr;
  struct Uncount {
    uint32_t*& word;
    ~Uncount() {
      if (word != nullptr) std::atomic_ref<uint32_t>(*word).fetch_sub(1, std::memory_order_seq_cst);
    }
  } uncount{counted};
  bool fenced = false;
  const int64_t start = NowNs();
  const int64_t deadline = ctx.DeadlineNs(start);
  int64_t last_check = start;
  // A collective on the comm thread (an *Async call's) waits beside the caller's compute on
  // the rank's CPUs: it yields from the start, as ranks sharing CPUs do, instead of spinning.
  const int64_t spin_ns = CommThread::OnCommThread() ? 0 : spin_ns_;
  for (;;) {
    for (int i = 0; i < round_spins_; ++i) {
      if (reached()) return absl::OkStatus();
      CpuRelax();
    }
    const int64_t now = NowNs();
    const int64_t waited = now - start;
    if (waited >= spin_ns) world_->Progress();  // pending point-to-point messages keep moving
    if (now - last_check >= kPeerCheckNs || now >= deadline) {
      last_check = now;
      world_->PollPeers();
      world_->Progress();  // a peer's abort (it may have exited right after sending it)
      if (world_->PollAbort()) return world_->Failed(ctx);
      for (size_t k = 0; k < members_.size(); ++k) {
        if (static_cast<int>(k) == rank_) continue;
        const std::string& gone = world_->gone(members_[k]);
        const UcxRankNames n =
            NameRanks(ctx.rank, members_[static_cast<size_t>(rank_)], static_cast<int>(k), members_[k]);
        if (!gone.empty()) {
          return absl::UnavailableError(
              absl::StrCat("[", ctx.op, "] ", n.self, ": peer ", n.peer, " is gone (", gone, ")"));
        }
        if (std::atomic_ref<uint32_t>(*failed_of(static_cast<int>(k))).load(std::memory_order_acquire) != 0) {
          return absl::UnavailableError(
              absl::StrCat("[", ctx.op, "] ", n.self, ": peer ", n.peer, " failed (see its error)"));
        }
      }
      if (reached()) return absl::OkStatus();
      if (now >= deadline) {
        const UcxRankNames n =
            NameRanks(ctx.rank, members_[static_cast<size_t>(rank_)], j, members_[static_cast<size_t>(j)]);
        return absl::DeadlineExceededError(absl::StrCat("[", ctx.op, "] ", n.self, " timed out after ",
                                                        absl::FormatDuration(ctx.timeout), " waiting for ", n.peer));
      }
    }
    if (waited < spin_ns) continue;
    if (waited < kYieldNs) {
      sched_yield();
      continue;
    }
    // Sleep until rank j publishes (it wakes us) or the next peer check is due.
    if (counted == nullptr) {
      counted = waiters_of(j);
      std::atomic_ref<uint32_t>(*counted).fetch_add(1, std::memory_order_seq_cst);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      // Rank j arrives light: its CPU gets the barrier now.
      fenced = !light_arrive_ || ProcessesBarrier();
    }
    if (reached()) return absl::OkStatus();
    // Without the barrier rank j may miss the count and not wake us: short sleeps instead.
    const int64_t nap = fenced ? kPeerCheckNs : kUnfencedSleepNs;
    FutexWait(word_of(j), static_cast<uint32_t>(seen), std::min(nap, std::max<int64_t>(deadline - now, 1)));
  }
}

void ShmGroup::StartCopyIn(size_t bytes) {
  copy_start_ = -1;
#if defined(__x86_64__)
  if (forced_streaming_ >= 0) {
    streaming_ = forced_streaming_ == 1;
    return;
  }
  streaming_ = false;
  if (bytes < kAdaptiveCopyMinBytes) return;
  const double plain = copy_ns_per_kib_[0], streamed = copy_ns_per_kib_[1];
  bool prefer = plain > 0 && streamed > 0 && plain > kStreamingRatio * streamed;
  if (plain == 0 || streamed == 0) {
    prefer = plain != 0;  // time each kind once, plain first
  } else if (++copy_steps_ % kCopyProbeEvery == 0) {
    prefer = !prefer;  // keep the other kind's time current
  }
  streaming_ = prefer;
  copy_bytes_ = bytes;
  copy_start_ = NowNs();
#else
  (void)bytes;
  streaming_ = false;
#endif
}

void ShmGroup::CopyIn(char* dst, const char* src, size_t n) const {
  if (streaming_) {  // false off x86-64 (StartCopyIn)
    StreamCopy(dst, src, static_cast<int64_t>(n));
  } else {
    std::memcpy(dst, src, n);
  }
}

void ShmGroup::FinishCopyIn() {
#if defined(__x86_64__)
  // Streaming stores are weakly ordered: this fence puts them before the step's arrival.
  if (streaming_) StreamFence();
  if (copy_start_ < 0) return;
  // A sample counts as at most 4x the estimate, so one slow copy (a rank preempted mid-copy)
  // raises it by at most 1.75x.
  double& est = copy_ns_per_kib_[streaming_ ? 1 : 0];
  double x = static_cast<double>(NowNs() - copy_start_) * 1024.0 / static_cast<double>(copy_bytes_);
  if (est > 0) x = std::min(x, 4 * est);
  est = est == 0 ? x : est + (x - est) / 4;
  copy_start_ = -1;
#endif
}

absl::Status ShmGroup::SetupCma(bool want, const UcxWaitContext& ctx) {
  struct Probe {
    uint64_t addr, value;
    int64_t pid;
  };
  absl::Status s = BeginWrite(ctx);
  if (!s.ok()) return s;
  probe_ = 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(NowNs()) ^ (static_cast<uint64_t>(rank_) << 56);
  const Probe mine{reinterpret_cast<uintptr_t>(&probe_), probe_, getpid()};
  std::memcpy(slot(rank_), &mine, sizeof(mine));
  if (s = Sync(ctx); !s.ok()) return s;
  const size_t p = members_.size();
  pids_.assign(p, 0);
  bool ok = want;
  for (size_t j = 0; j < p; ++j) {
    if (static_cast<int>(j) == rank_) continue;
    Probe theirs;
    std::memcpy(&theirs, slot(static_cast<int>(j)), sizeof(theirs));
    pids_[j] = static_cast<int>(theirs.pid);
    if (!ok) continue;
    uint64_t value = 0;
    iovec local{&value, sizeof(value)}, remote{reinterpret_cast<void*>(theirs.addr), sizeof(value)};
    ok = process_vm_readv(pids_[j], &local, 1, &remote, 1, 0) == sizeof(value) && value == theirs.value;
    // Writes too (Broadcast and AllReduce write into the peers): the same value back.
    ok = ok && process_vm_writev(pids_[j], &local, 1, &remote, 1, 0) == sizeof(value);
  }
  NextStep();
  slot(rank_)[0] = ok ? 1 : 0;  // the other buffer: nobody reads it before the next Sync
  if (s = Sync(ctx); !s.ok()) return s;
  bool all = true;
  for (size_t j = 0; j < p; ++j) all = all && slot(static_cast<int>(j))[0] == 1;
  NextStep();
  cma_ = all;
  return absl::OkStatus();
}

namespace {

// A cursor over a list of byte ranges.
struct Ranges {
  absl::Span<const iovec> v;
  size_t i = 0, off = 0;  // the next byte: range i, `off` bytes in

  bool done() {
    while (i < v.size() && off == v[i].iov_len) {
      ++i;
      off = 0;
    }
    return i == v.size();
  }
  // Up to `max` entries of at most `limit` bytes in all from the cursor on (not moving it).
  size_t Fill(iovec* out, size_t max, size_t limit, size_t* count) const {
    size_t bytes = 0, n = 0;
    for (size_t k = i, o = off; k < v.size() && n < max && bytes < limit; ++k, o = 0) {
      const size_t len = std::min(v[k].iov_len - o, limit - bytes);
      if (len == 0) continue;
      out[n++] = iovec{static_cast<char*>(v[k].iov_base) + o, len};
      bytes += len;
    }
    *count = n;
    return bytes;
  }
  void Advance(size_t bytes) {
    while (bytes > 0) {
      const size_t len = std::min(v[i].iov_len - off, bytes);
      off += len;
      bytes -= len;
      if (off == v[i].iov_len) {
        ++i;
        off = 0;
      }
    }
  }
};

}  // namespace

absl::Status ShmGroup::ReadPeer(int j, absl::Span<const iovec> local, absl::Span<const iovec> remote,
                                const UcxWaitContext& ctx) const {
  return Transfer(j, local, remote, /*write=*/false, ctx);
}

absl::Status ShmGroup::Transfer(int j, absl::Span<const iovec> local, absl::Span<const iovec> remote, bool write,
                                const UcxWaitContext& ctx) const {
  constexpr size_t kBatch = 512;  // ranges per call, each side (IOV_MAX is 1024)
  iovec l[kBatch], r[kBatch];
  Ranges lc{local}, rc{remote};
  while (!lc.done() && !rc.done()) {
    if (write && std::atomic_ref<uint32_t>(*failed_of(j)).load(std::memory_order_acquire) != 0) {
      // It gave up and may be freeing this memory (it waits for us in Quiesce, up to a point).
      return absl::UnavailableError(
          absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": peer rank ", j, " failed (see its error)"));
    }
    size_t nl = 0, nr = 0;
    size_t bytes = lc.Fill(l, kBatch, SIZE_MAX, &nl);
    const size_t rbytes = rc.Fill(r, kBatch, bytes, &nr);
    if (rbytes < bytes) bytes = lc.Fill(l, kBatch, rbytes, &nl);
    const pid_t pid = pids_[static_cast<size_t>(j)];
    const ssize_t n = write ? process_vm_writev(pid, l, nl, r, nr, 0) : process_vm_readv(pid, l, nl, r, nr, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      return absl::UnavailableError(absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": ",
                                                 write ? "writing " : "reading ", bytes, " bytes ",
                                                 write ? "into" : "of", " peer rank ", j, "'s memory failed (",
                                                 write ? "process_vm_writev" : "process_vm_readv", ": ",
                                                 err != 0 ? std::strerror(err) : "nothing moved", ")"));
    }
    lc.Advance(static_cast<size_t>(n));
    rc.Advance(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::ReadPeer(int j, void* local, uint64_t remote, size_t bytes, const UcxWaitContext& ctx) const {
  const iovec l{local, bytes}, r{reinterpret_cast<void*>(remote), bytes};
  return ReadPeer(j, absl::MakeConstSpan(&l, 1), absl::MakeConstSpan(&r, 1), ctx);
}

absl::Status ShmGroup::WritePeer(int j, uint64_t remote, const void* local, size_t bytes,
                                 const UcxWaitContext& ctx) const {
  const iovec l{const_cast<void*>(local), bytes}, r{reinterpret_cast<void*>(remote), bytes};
  return Transfer(j, absl::MakeConstSpan(&l, 1), absl::MakeConstSpan(&r, 1), /*write=*/true, ctx);
}

char* ShmGroup::MapPeer(int j, const SharedCpuRange& r) {
  const size_t u = static_cast<size_t>(j);
  if (r.id == 0 || u >= pids_.size() || pids_[u] <= 0) return nullptr;
  if (peer_maps_.size() != members_.size()) {
    peer_maps_.resize(members_.size());
    no_peer_maps_.assign(members_.size(), false);
  }
  if (no_peer_maps_[u]) return nullptr;
  absl::flat_hash_map<uint64_t, PeerMap>& maps = peer_maps_[u];
  ++map_clock_;
  // A published id is live (its owner holds the buffer for this call), and ids are never
  // reused: a cached mapping of it is still the block.
  if (auto it = maps.find(r.id); it != maps.end() && it->second.block.map_bytes() == r.map_bytes) {
    it->second.last_use = map_clock_;
    return it->second.block.at(r.offset);
  }
  absl::StatusOr<PeerSharedCpuBlock> m = PeerSharedCpuBlock::Open(pids_[u], r);
  if (!m.ok()) {
    // Not allowed to open its descriptors (another user, a hardened /proc): stop trying.
    if (absl::IsPermissionDenied(m.status())) no_peer_maps_[u] = true;
    return nullptr;
  }
  if (maps.size() >= kMaxPeerMaps) {
    auto oldest = maps.begin();
    for (auto it = maps.begin(); it != maps.end(); ++it) {
      if (it->second.last_use < oldest->second.last_use) oldest = it;
    }
    maps.erase(oldest);
  }
  auto [it, fresh] = maps.insert_or_assign(r.id, PeerMap{*std::move(m), map_clock_});
  return it->second.block.at(r.offset);
}

void ShmGroup::TrackReleases() {
  const uint64_t mine = SharedCpuBlocksReleased();
  if (mine != published_releases_) {  // after the blocks' released flags (acquire above)
    std::atomic_ref<uint64_t>(*releases_of(rank_)).store(mine, std::memory_order_release);
    published_releases_ = mine;
  }
  if (++release_checks_ % kSweepEvery != 0) return;
  for (size_t j = 0; j < peer_maps_.size(); ++j) {
    if (peer_maps_[j].empty()) continue;
    const uint64_t theirs =
        std::atomic_ref<uint64_t>(*releases_of(static_cast<int>(j))).load(std::memory_order_acquire);
    if (theirs == swept_releases_[j]) continue;
    absl::erase_if(peer_maps_[j], [](const auto& kv) { return kv.second.block.released(); });
    swept_releases_[j] = theirs;
  }
}

}  // namespace dtensor::internal
