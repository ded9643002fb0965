// Shared CPU blocks: CPU memory that the other processes of this host can map, so that a
// collective between them moves bytes with plain loads and stores rather than through the
// kernel (process_vm_readv / writev copy at about half of memcpy's rate here: 2 ranks, 4 MiB
// all_reduce 0.35-0.42 ms mapped against 0.65-0.99 ms through the kernel).
//
//   EnableSharedCpuBlocks();                       // the ucx backend does this at setup
//   Tensor t = Tensor::Empty({1 << 20}, kFloat32);  // a large block: shareable
//   std::optional<SharedCpuRange> r = FindSharedCpuRange(t.data(), t.nbytes());
//   // ... r travels to a peer process on this host, which maps it:
//   absl::StatusOr<PeerSharedCpuBlock> m = PeerSharedCpuBlock::Open(owner_pid, *r);
//   std::memcpy(dst, m->at(r->offset), t.nbytes());
//
// Once enabled, CPU blocks of at least kSharedCpuMinBytes (and at most half the host's memory)
// come from their own memfd, as long as fewer than MaxSharedCpuBlocks() exist (blocks under
// kSharedCpuLargeBytes: fewer than half that many, so that they never crowd out the large
// ones); beyond that, for other sizes, and after the system refused a memfd, memory stays
// private and collectives copy through the kernel or the ucx backend's slots.
// The mappings are not inherited by fork()ed children (MADV_DONTFORK, as for memory
// registered for RDMA): a child's allocator forgets them (its large blocks are private, it
// never hands out a cached shared one, freeing an inherited tensor in one does nothing), but
// the data of tensors it inherited in shared blocks are not there to read: a forked worker
// must not touch its parent's CPU tensors of kSharedCpuMinBytes or more.
// A peer opens the owner's memfd through /proc/<pid>/fd/<fd> (same user; the same permission
// as reading the process's memory) and checks the block's id, written in the mapping's first
// page, so a recycled descriptor number can never map the wrong memory. When the owner gives
// the block back to the system it marks that page released (PeerSharedCpuBlock::released());
// peers drop their mappings at their next sweep (the ucx backend sweeps every 16 single-copy
// steps), and until then the memory stays allocated.
// Shared blocks get transparent huge pages only where /sys/kernel/mm/transparent_hugepage/
// shmem_enabled allows them (MADV_HUGEPAGE is asked for), while private memory follows
// `enabled`: on a host with THP for anonymous memory only, large tensors lose their huge pages.
// Turning it off: DTENSOR_UCX_ZERO_COPY=0 on any rank (the ucx backend then never enables it).
#ifndef DTENSOR_TENSOR_SHARED_CPU_BLOCK_H_
#define DTENSOR_TENSOR_SHARED_CPU_BLOCK_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"

namespace dtensor {

// From 16 KiB: the ucx backend reads blocks of 8 KiB or more straight from a peer's shared
// buffer, which a 2-rank collective of 16 KiB has (2 ranks against the slots or the kernel's
// copy: 64 KiB all_gather 5.6 -> 1.7 us, all_reduce 10.5 -> 2.1 us, 16 KiB all_reduce 2.8 ->
// 0.8 us, all_to_all 1.4 -> 0.6 us; 4 ranks on 2 cores, 64 KiB all_reduce 22.7 -> 12.5 us).
// Each block costs a descriptor and a page of its own.
inline constexpr size_t kSharedCpuMinBytes = size_t{16} << 10;
inline constexpr size_t kSharedCpuLargeBytes = size_t{256} << 10;

// Where a byte range of this process lies in a shared block: plain data, so that it can travel
// through shared memory to a peer.
struct SharedCpuRange {
  uint64_t id = 0;         // the block's id, unique within the owner process; 0: not shared
  uint64_t offset = 0;     // of the range's first byte from the start of the block's mapping
  uint64_t map_bytes = 0;  // the mapping's size
  int32_t fd = -1;         // the owner's descriptor of the block's memfd
  int32_t pad = 0;
};

// CPU blocks allocated from now on may be shared (see above); cached private blocks of that
// size are given back rather than handed out. Idempotent, thread-safe.
void EnableSharedCpuBlocks();
bool SharedCpuBlocksEnabled();
// How many shared blocks may exist at once: a quarter of the descriptor limit, at most 1024.
int MaxSharedCpuBlocks();
// The shared block that holds all of [p, p + bytes), or nullopt (private memory, memory not
// from the CPU allocator, or bytes == 0).
std::optional<SharedCpuRange> FindSharedCpuRange(const void* p, size_t bytes);

// Another process's shared block, mapped into this one (unmapped when destroyed).
class PeerSharedCpuBlock {
 public:
  // Maps block `r` of process `pid`: NotFound / PermissionDenied / FailedPrecondition naming
  // the pid and descriptor when it cannot be opened, or holds another block than r.id.
  static absl::StatusOr<PeerSharedCpuBlock> Open(pid_t pid, const SharedCpuRange& r);
  PeerSharedCpuBlock(PeerSharedCpuBlock&& o) noexcept;
  PeerSharedCpuBlock& operator=(PeerSharedCpuBlock&& o) noexcept;
  ~PeerSharedCpuBlock();

  uint64_t id() const { return id_; }
  // The byte at `offset` from the mapping's start (offset < map_bytes).
  char* at(uint64_t offset) const { return base_ + offset; }
  uint64_t map_bytes() const { return bytes_; }
  // The owner has released the block (freed it to the system): the mapping no longer means
  // anything to it.
  bool released() const;

 private:
  PeerSharedCpuBlock(char* base, uint64_t bytes, uint64_t id) : base_(base), bytes_(bytes), id_(id) {}
  char* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t id_ = 0;
};

namespace internal {
// The allocator's side. A new memfd-backed block: its first page holds the block's id and
// released flag (in its first 64 bytes) and, in its last 64, room for the allocator's own
// header; the `user_bytes` start at the next page (`user`). nullopt when the system refuses.
struct OwnedSharedCpuBlock {
  char* user = nullptr;
  int fd = -1;
  uint64_t map_bytes = 0;
};
// nullopt also for blocks larger than MaxSharedCpuBlockBytes().
std::optional<OwnedSharedCpuBlock> CreateSharedCpuBlock(size_t user_bytes, uint64_t id);
// The largest block made shared: half the host's memory (a memfd is not reserved when made,
// so a larger one would "succeed" where malloc fails, and the process die when it touches
// it), and below the file size limit (past it, ftruncate raises SIGXFSZ).
uint64_t MaxSharedCpuBlockBytes();
// Marks the block released (for the peers' mappings), unmaps it and closes its memfd.
void ReleaseSharedCpuBlock(const OwnedSharedCpuBlock& b);
// How many blocks this process has released so far (ReleaseSharedCpuBlock; each block's
// released flag is set first): a peer that sees the count change unmaps what it mapped of them.
uint64_t SharedCpuBlocksReleased();
// Offset of the user bytes from the mapping's start.
inline constexpr uint64_t kSharedCpuPage = 4096;
}  // namespace internal

}  // namespace dtensor

#endif  // DTENSOR_TENSOR_SHARED_CPU_BLOCK_H_
