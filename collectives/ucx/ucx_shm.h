// Private to the ucx backend: the shared-memory channel of one communicator whose ranks all
// live on this host (ShmGroup). UCX stays the path between hosts.
//
// One POSIX shared-memory segment per communicator, made by group rank 0, opened by the others
// and unlinked as soon as everyone has it mapped (so nothing is left behind in /dev/shm):
//
//   [control: one cache line per rank: arrival epoch (its low half is the futex word),
//    failed flag, sleepers]
//   [slots: 2 buffers x size ranks x kSlotBytes]   each rank writes only its own slot
//   [results: 2 buffers x kSlotBytes]              AllReduce's reduced slices
//
// Collectives are steps of "write my slot, Sync(), read the others' slots". Sync() publishes
// this rank's arrival epoch and waits until every rank reached it. Each step flips the buffer
// (NextStep), so a slot is rewritten two steps later, when every rank has passed the Sync of
// the step in between and so has finished reading it: one Sync per step is enough.
//
// Waiting spins briefly (when every rank has a CPU), then yields, then sleeps on a futex
// (the arriving rank wakes its sleepers; ranks sharing CPUs give the CPU up at once), checks
// the deadline, the peers' pidfds (through the UcxWorld) and their failed flags, so a dead or
// failed peer gives Unavailable and a late one DeadlineExceeded: never a hang.
#ifndef DTENSOR_COLLECTIVES_UCX_UCX_SHM_H_
#define DTENSOR_COLLECTIVES_UCX_UCX_SHM_H_

#include <sys/uio.h>

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/collectives/ucx/ucx_transport.h"
#include "dtensor/tensor/shared_cpu_block.h"

namespace dtensor::internal {

class ShmGroup {
 public:
  static constexpr size_t kSlotBytes = size_t{512} << 10;

  // A fresh segment name for communicator `comm_id` of this process.
  static std::string NewName(uint16_t comm_id);
  // Creates (create = true: group rank 0; fails if the name exists) or opens the segment
  // `name` for the group whose world ranks are `members`; this is group rank `rank`. Every page
  // is allocated and mapped here: a /dev/shm too small for it is Unavailable (ENOSPC), never a
  // SIGBUS later.
  static absl::StatusOr<std::unique_ptr<ShmGroup>> Map(const std::string& name, bool create, int rank,
                                                       std::vector<int> members, UcxWorld* world);
  // Removes the name (the mappings stay valid).
  static void Unlink(const std::string& name);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // Rank j's slot / the result buffer of the current step.
  char* slot(int j) const { return slot_in(buf_, j); }
  // Rank j's slot of the next step. A rank may fill its own before the Sync of this step when
  // every rank read it last before the previous Sync (pipelines that read slots only between
  // one Sync and the next).
  char* next_slot(int j) const { return slot_in(buf_ ^ 1, j); }
  char* result() const { return base_ + ctl_bytes_ + (2 * members_.size() + static_cast<size_t>(buf_)) * kSlotBytes; }
  void NextStep() { buf_ ^= 1; }

  // Publishes this rank's arrival and waits for every rank (honouring ctx's deadline).
  absl::Status Sync(const UcxWaitContext& ctx);
  // Sync() with work on either side of the wait: publishes this rank's arrival, runs own()
  // (work on private memory that the peers need not wait for: a rank's own block), waits,
  // and calls read(j) for every other rank j. When ranks share CPUs they arrive one
  // scheduling slice apart: then read(j) runs as soon as j has arrived, in arrival order, so
  // a rank copies the early peers' slots while later ones are still on their way. (With a
  // core per rank the plain order measured faster: 0.40 vs 0.45-0.6 us for a 2-rank 4 KiB
  // all_to_all; 4 ranks on 2 cores: 6.1 vs 7.5 us.)
  template <typename Own, typename Read>
  absl::Status SyncEach(const UcxWaitContext& ctx, Own&& own, Read&& read) {
    Arrive();
    own();
    if (!oversubscribed_) {
      absl::Status s = WaitAll(ctx);
      if (!s.ok()) return s;
      for (int j = 0; j < static_cast<int>(members_.size()); ++j) {
        if (j != rank_) read(j);
      }
      return absl::OkStatus();
    }
    uint64_t pending = 0;  // bit j: rank j not read yet (at most 64 ranks share a segment)
    for (size_t j = 0; j < members_.size(); ++j) {
      if (static_cast<int>(j) != rank_) pending |= uint64_t{1} << j;
    }
    while (pending != 0) {
      bool any = false;
      for (uint64_t m = pending; m != 0; m &= m - 1) {
        const int j = std::countr_zero(m);
        if (Arrived(j, epoch_)) {
          read(j);
          pending &= ~(uint64_t{1} << j);
          any = true;
        }
      }
      if (!any) {
        absl::Status s = WaitRank(std::countr_zero(pending), epoch_, ctx);
        if (!s.ok()) return s;
      }
    }
    Passed();
    return absl::OkStatus();
  }

  // One-to-many steps (broadcast) need not be lock-step: the root writes its slot and
  // Arrive()s without waiting; a reader WaitRank(root, epoch() + 1)s, reads, then Arrive()s
  // (so arriving at e means "done reading step e"). Call MarkRelaxed() after such steps: the
  // next BeginWrite() then waits until every rank has arrived where this one is, so a slot is
  // never rewritten while a slower rank still reads it. Every step that writes a slot calls
  // BeginWrite() first (free after a Sync).
  absl::Status BeginWrite(const UcxWaitContext& ctx);
  void Arrive();
  absl::Status WaitRank(int j, uint64_t epoch, const UcxWaitContext& ctx);
  uint64_t epoch() const { return epoch_; }
  // The ranks take turns on the CPUs (no CPU for each: RanksHaveOwnCpus over their affinity
  // masks), as all of them agreed (UcxCommunicator's Setup; true until then). It picks
  // algorithms, so it must be the same everywhere, and the waits: with a CPU each a waiter
  // spins, then yields, then sleeps; else it yields from the start (handing the CPU to the
  // ranks sharing it), then sleeps.
  bool oversubscribed() const { return oversubscribed_; }
  void set_oversubscribed(bool v);
  void MarkRelaxed() { relaxed_ = true; }
  // Arrivals without a fence (as all ranks agreed, each having RegisterProcessBarrier()):
  // then a rank about to sleep on a peer's word makes every CPU fence instead (membarrier),
  // which costs microseconds but is rare where every rank has a CPU (after the spin and yield
  // phases), while the fence costs every step (a 4 KiB broadcast root waits ~0.1 us in it for
  // its message's stores). Off (the default) until then.
  void set_light_arrive(bool v) { light_arrive_ = v; }
  bool light_arrive() const { return light_arrive_; }
  // Registers this process for membarrier's global expedited barrier, once; false where the
  // kernel lacks it or refuses (seccomp).
  static bool RegisterProcessBarrier();

  // Small one-to-many messages may run further ahead: the root's slot (both buffers) is a
  // ring of 2 x kRingSlots places of kRingBytes, step e using RingSlot(root, e). Before the
  // root writes step e there, BeginRingWrite waits until every rank has read step e - 2 x
  // kRingSlots (the same place) and has finished reading the last step that wrote this
  // rank's whole slot (a Sync'ed step, or a relaxed step marked with MarkSlotWritten).
  static constexpr size_t kRingBytes = size_t{32} << 10;
  static constexpr uint64_t kRingSlots = kSlotBytes / kRingBytes;
  char* RingSlot(int root, uint64_t e) const { return slot(root) + (e / 2 % kRingSlots) * kRingBytes; }
  absl::Status BeginRingWrite(uint64_t e, const UcxWaitContext& ctx);
  void MarkSlotWritten() { last_full_ = epoch_; }
  // ---- Writing data for the peers (slots, ring places) ----
  // A step's copies into shared memory go between StartCopyIn(total bytes) and FinishCopyIn()
  // (before the step's Arrive or Sync), each through CopyIn. The lines of a slot were read by
  // the peers a step or two before, so plain stores first fetch each line back from a peer's
  // cache (read for ownership); when the CPUs are far apart in the cache hierarchy that fetch
  // dominates. On x86, copies of kAdaptiveCopyMinBytes or more per step therefore pick
  // between plain and streaming (non-temporal) stores, which invalidate the peers' copies
  // without fetching them but leave the data in memory rather than in a cache, by timing both
  // here: streaming where plain stores took more than kStreamingRatio times as long, and the
  // other kind every kCopyProbeEvery steps so that the choice follows the machine. On this VM
  // (4 ranks on 2 cores, 48 KiB copied per step of a 64 KiB reduce_scatter) plain stores take
  // 3-5 us against 2-3 streamed while its vCPUs share a cache, where streaming loses overall
  // (its readers then load from memory: 14 against 16 us per call), and 8-22 against 1.5-2.5 us
  // while they do not, where it wins by far (40 against 14 us per call).
  // DTENSOR_UCX_STREAMING=0 / 1 (this process's environment, read when the group is made) fixes
  // the choice to plain / streaming stores for every size.
  static constexpr size_t kAdaptiveCopyMinBytes = size_t{16} << 10;
  static constexpr double kStreamingRatio = 3.0;
  static constexpr uint64_t kCopyProbeEvery = 32;
  void StartCopyIn(size_t bytes);
  void CopyIn(char* dst, const char* src, size_t n) const;
  void FinishCopyIn();
  // A step whose only copy is this one.
  void CopyInStep(char* dst, const char* src, size_t n) {
    StartCopyIn(n);
    CopyIn(dst, src, n);
    FinishCopyIn();
  }

  // Tells the peers this rank gave up (they return Unavailable instead of waiting).
  void MarkFailed();
  // For a rank that fails inside a collective whose peers write into its memory (WritePeer)
  // once they have arrived at epoch `first` (where its address reached them): MarkFailed(),
  // then wait until no peer can still be writing — each has not arrived at `first` (it will
  // see the failed flag before it writes: WritePeer refuses a failed peer), has arrived at
  // `done` (past its writes), has failed, or has exited — or until ctx's timeout from now, so
  // that the caller's buffers are not freed under a peer's write.
  void Quiesce(uint64_t first, uint64_t done, const UcxWaitContext& ctx);

  // ---- Single copy: reading a peer's own memory (Linux cross-memory attach) ----
  // Large messages need not pass through the slots (a copy in, a copy out): a rank publishes
  // the address of its buffer in its slot and the peers copy straight out of it with
  // process_vm_readv, one copy (1 MiB: 59 us against 103 us for two memcpys on this 2-core VM).
  //
  // Collective, once after Map: every rank reads a probe word from every peer and writes it
  // back; cma() is true when every rank wanted it and every read and write succeeded (the same
  // answer on every rank, so all of them take the same path; a seccomp or Yama refusal leaves
  // the slots).
  absl::Status SetupCma(bool want, const UcxWaitContext& ctx);
  bool cma() const { return cma_; }
  // Copies peer j's byte ranges `remote` (addresses in its process), in order, into this
  // process's ranges `local`; the totals must agree. Unavailable naming the peer on failure.
  absl::Status ReadPeer(int j, absl::Span<const iovec> local, absl::Span<const iovec> remote,
                        const UcxWaitContext& ctx) const;
  absl::Status ReadPeer(int j, void* local, uint64_t remote, size_t bytes, const UcxWaitContext& ctx) const;
  // An address this rank publishes with its next arrival (in its control line), for steps
  // whose slots are full of data; peers read it after that arrival.
  void Publish(uint64_t addr) { std::atomic_ref<uint64_t>(*addr_of(rank_)).store(addr, std::memory_order_relaxed); }
  uint64_t Published(int j) const { return std::atomic_ref<uint64_t>(*addr_of(j)).load(std::memory_order_relaxed); }
  // The other way: this process's `bytes` at `local` into peer j's memory at `remote`.
  absl::Status WritePeer(int j, uint64_t remote, const void* local, size_t bytes, const UcxWaitContext& ctx) const;

  // ---- Zero copy: peers' shared CPU blocks, mapped (dtensor/tensor/shared_cpu_block.h) ----
  // Where a peer's buffer lies in a shared block, this rank maps the block and copies with
  // memcpy (about twice process_vm_readv's rate). MapPeer returns the address in this process
  // of peer j's byte at r.offset, or nullptr where the block cannot be mapped (the caller then
  // copies through the kernel). Mappings are kept per block for the next calls, at most
  // kMaxPeerMaps per peer (the least recently used goes).
  static constexpr size_t kMaxPeerMaps = 256;
  char* MapPeer(int j, const SharedCpuRange& r);
  // Once per collective: publishes how many shared blocks this process has released, and
  // every kSweepEvery calls unmaps the released blocks of each peer whose count changed (their
  // memory stays allocated while mapped here), whatever the calls are: small collectives
  // alone do not keep peers' freed memory alive. Costs a load and a compare, plus a load of
  // each mapped peer's control line every kSweepEvery calls (a page of each of its mappings
  // only when its count changed).
  static constexpr uint64_t kSweepEvery = 16;
  void TrackReleases();
  // Peer j said it gave up (MarkFailed): it may be freeing its memory, so write none of it.
  bool PeerFailed(int j) const { return std::atomic_ref<uint32_t>(*failed_of(j)).load(std::memory_order_acquire) != 0; }

 private:
  ShmGroup() = default;
  char* slot_in(int buf, int j) const {
    return base_ + ctl_bytes_ + (static_cast<size_t>(buf) * members_.size() + static_cast<size_t>(j)) * kSlotBytes;
  }
  absl::Status WaitFor(int j, uint64_t epoch, const UcxWaitContext& ctx);
  bool Arrived(int j, uint64_t epoch) const;
  // After Arrive(): waits until every rank has arrived at this rank's epoch, then Passed().
  absl::Status WaitAll(const UcxWaitContext& ctx);
  // Every rank has arrived at this epoch (a lock-step step): no relaxed step is pending, and
  // this step counts as the last that wrote this rank's slot (see BeginRingWrite).
  void Passed() {
    relaxed_ = false;
    last_full_ = epoch_;
  }
  uint64_t* epoch_of(int j) const { return reinterpret_cast<uint64_t*>(base_ + static_cast<size_t>(j) * 64); }
  uint32_t* failed_of(int j) const { return reinterpret_cast<uint32_t*>(base_ + static_cast<size_t>(j) * 64 + 8); }
  // The futex word sleepers wait on: the low half of rank j's epoch (little-endian), which
  // changes with every arrival.
  uint32_t* word_of(int j) const {
    static_assert(std::endian::native == std::endian::little, "the futex word is the epoch's low half");
    return reinterpret_cast<uint32_t*>(epoch_of(j));
  }
  // How many ranks sleep on word_of(j).
  uint64_t* addr_of(int j) const { return reinterpret_cast<uint64_t*>(base_ + static_cast<size_t>(j) * 64 + 24); }
  // How many shared blocks rank j's process has released (TrackReleases).
  uint64_t* releases_of(int j) const { return reinterpret_cast<uint64_t*>(base_ + static_cast<size_t>(j) * 64 + 32); }
  uint32_t* waiters_of(int j) const { return reinterpret_cast<uint32_t*>(base_ + static_cast<size_t>(j) * 64 + 16); }

  char* base_ = nullptr;
  size_t bytes_ = 0;
  size_t ctl_bytes_ = 0;
  int rank_ = 0;
  int buf_ = 0;
  uint64_t epoch_ = 0;
  // Per group rank, the highest epoch read from its control line (epochs only grow, and each
  // was read with acquire): a wait that it already covers loads nothing, so a rank far ahead
  // (a broadcast root) keeps its line instead of losing it to every reader's poll.
  mutable std::vector<uint64_t> seen_;
  uint64_t last_full_ = 0;  // the last step that wrote (or may have written) this rank's slot
  bool relaxed_ = false;
  bool light_arrive_ = false;  // see set_light_arrive()
  bool cma_ = false;
  std::vector<int> pids_;  // per group rank, for ReadPeer
  uint64_t probe_ = 0;     // what SetupCma's peers read
  absl::Status Transfer(int j, absl::Span<const iovec> local, absl::Span<const iovec> remote, bool write,
                        const UcxWaitContext& ctx) const;
  bool oversubscribed_ = true;  // see oversubscribed()
  int64_t spin_ns_ = 0;
  int first_spins_ = 0;  // pauses of WaitRank's first look (set_oversubscribed)
  int round_spins_ = 0;  // pauses per round of WaitFor's loop
  // CopyIn's choice (see StartCopyIn): the kind of this step's copies, the forced kind from the
  // environment (-1: choose), the timed ns per KiB of plain [0] and streaming [1] stores
  // (0: not timed yet), the steps timed, and the step being timed.
  bool streaming_ = false;
  int forced_streaming_ = -1;
  double copy_ns_per_kib_[2] = {0, 0};
  uint64_t copy_steps_ = 0;
  int64_t copy_start_ = -1;
  size_t copy_bytes_ = 0;
  std::vector<int> members_;
  UcxWorld* world_ = nullptr;
  struct PeerMap {
    PeerSharedCpuBlock block;
    uint64_t last_use;
  };
  std::vector<absl::flat_hash_map<uint64_t, PeerMap>> peer_maps_;  // per group rank, by block id
  std::vector<bool> no_peer_maps_;                                 // per group rank: its blocks cannot be opened here
  uint64_t map_clock_ = 0;
  uint64_t published_releases_ = 0;       // this process's count, as last published
  uint64_t release_checks_ = 0;           // TrackReleases calls
  std::vector<uint64_t> swept_releases_;  // per group rank: its count at this rank's last sweep of it
};

}  // namespace dtensor::internal

#endif  // DTENSOR_COLLECTIVES_UCX_UCX_SHM_H_
