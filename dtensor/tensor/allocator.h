// Allocator: a caching allocator per device, with counters that prove memory savings.
//
//   Allocator& alloc = DefaultAllocator(Device::Cpu());
//   alloc.ResetPeakStats();
//   { auto t = Tensor::Empty({1024, 1024}, DType::kFloat32); ... }   // block returns to cache
//   AllocatorStats s = alloc.Stats();   // s.peak_bytes_in_use >= 4 MiB, s.bytes_in_use == 0
//
// Blocks are rounded up (512 B granules below 1 MiB, 64 KiB above) and, when freed, kept in
// a per-device cache for reuse by a request of the same rounded size (or one up to 1/8
// smaller). CPU blocks are 64-byte aligned and carry their size in a header; each thread
// keeps its last few freed CPU blocks of up to 1 MiB for itself (no lock on that path; a
// thread that ends hands them to the shared cache; blocks freed on it after that, by statics
// or other thread_locals, go to the shared cache too). CUDA blocks come from cudaMalloc.
//
// After EnableSharedCpuBlocks() (shared_cpu_block.h; the ucx backend calls it), CPU blocks
// of kSharedCpuMinBytes (16 KiB) or more come from memfd-backed shared mappings that peer
// processes can map; a fork()ed child does not inherit those (MADV_DONTFORK): it allocates
// and frees as usual (its new blocks are private) but must not read its parent's CPU tensors
// of that size.
//
// CUDA note: as in PyTorch, a freed block may be reused at once by the next allocation; this
// is safe because all work on a device is ordered on the allocating thread's stream
// (cudaStreamPerThread). Work issued on another stream must synchronise before freeing. The
// cache is shared by the device's threads, so the contract is one thread per device (a rank
// per GPU, as gpt_train runs): a block another thread freed while its kernel still runs would
// otherwise be reused on a stream nothing orders after that kernel.
// Out of memory, it empties its cache and retries once; the cudaFree calls of that release
// synchronise the device, so behind an NCCL collective still waiting for a peer they wait
// with it, in the thread that would otherwise notice the communicator's timeout: a dead peer
// then hangs the allocation past that timeout. Give ranks memory headroom.
//
// DefaultAllocator() returns one allocator per device, created on first use and never
// destroyed (tensors may outlive static destruction). It is thread-safe.
#ifndef DTENSOR_TENSOR_ALLOCATOR_H_
#define DTENSOR_TENSOR_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "dtensor/tensor/device.h"

namespace dtensor {

struct AllocatorStats {
  int64_t bytes_in_use = 0;       // rounded bytes of live blocks
  int64_t peak_bytes_in_use = 0;  // maximum of bytes_in_use since the last ResetPeakStats()
  int64_t bytes_cached = 0;       // bytes of free blocks held for reuse
  int64_t num_allocs = 0;         // Allocate() calls that returned memory
  int64_t num_cache_hits = 0;     // ... of which served from the cache
  int64_t num_system_allocs = 0;  // aligned_alloc / cudaMalloc calls
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns a block of at least `nbytes` bytes (nullptr for 0). ResourceExhausted when the device is out of memory
  // even after emptying the cache, and only then (no device: FailedPrecondition; a CUDA fault: Internal).
  virtual absl::StatusOr<void*> Allocate(size_t nbytes) = 0;
  // Returns a block obtained from Allocate() to the cache. nullptr is ignored, and so is a
  // second Free of a block not handed out again since (CPU: its header says so; CUDA: it is
  // not in the table of live blocks). Any other pointer is a contract violation.
  virtual void Free(void* ptr) = 0;
  virtual AllocatorStats Stats() const = 0;
  virtual void ResetPeakStats() = 0;
  // Releases every cached (free) block back to the system; on the CPU, those of the shared
  // cache and of the calling thread (other live threads keep theirs).
  virtual void EmptyCache() = 0;
  virtual Device device() const = 0;
};

// The process-wide caching allocator of `device`. For a CUDA device index outside
// [0, 16) the CPU allocator is never substituted: Allocate() then fails with InvalidArgument.
Allocator& DefaultAllocator(Device device);

// Page-locked ("pinned") host memory, as PyTorch's pin_memory: a CPU allocator (device() is
// cpu) whose blocks the GPU copies to and from at full bus speed, cached as the CUDA
// allocator's. Allocate fails with FailedPrecondition unless PinnedHostAvailable(): the cuda
// component is linked in and a CUDA device is visible. Tensor::EmptyPinned uses it.
Allocator& PinnedHostAllocator();
bool PinnedHostAvailable();

}  // namespace dtensor

#endif  // DTENSOR_TENSOR_ALLOCATOR_H_
