#include "dtensor/tensor/allocator.h"

#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>  // std::once_flag
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "dtensor/tensor/cuda_hooks.h"
#include "dtensor/tensor/shared_cpu_block.h"

namespace dtensor {
namespace {

// absl::Mutex is compiled in Debian's libabsl without ThreadSanitizer, which then cannot see it
// order the accesses it guards (every reuse of a cached block reads as a race). Under TSan each
// lock also tells it: acquire after locking, release before unlocking. Otherwise absl::MutexLock.
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DTENSOR_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define DTENSOR_TSAN 1
#endif
#ifdef DTENSOR_TSAN
}  // namespace
}  // namespace dtensor
#include <sanitizer/tsan_interface.h>
namespace dtensor {
namespace {
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
    __tsan_acquire(mu_);
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() {
    __tsan_release(mu_);
    mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  absl::Mutex* const mu_;
};
#else
using MutexLock = absl::MutexLock;
#endif

constexpr size_t kSmallGranule = 512;
constexpr size_t kLargeGranule = 64 << 10;
constexpr size_t kLargeThreshold = 1 << 20;
constexpr int kMaxCudaDevices = 16;

size_t RoundSize(size_t n) {
  const size_t g = n < kLargeThreshold ? kSmallGranule : kLargeGranule;
  return (n + g - 1) / g * g;
}

// Raw memory of one CUDA device, or page-locked host memory (Device::Cuda(kPinnedHost)), from
// the cuda component (cuda_hooks.h). The CPU has its own allocator below.
constexpr int kPinnedHost = -1;

class SystemMemory {
 public:
  explicit SystemMemory(int device) : device_(device) {}
  absl::StatusOr<void*> Alloc(size_t n) {
    const internal::CudaHooks* cuda = internal::GetCudaHooks();
    if (cuda == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("[Allocate] ", Name(), ": ", internal::CudaNotLinkedMessage()));
    }
    if (device_ != kPinnedHost) return cuda->malloc(device_, n);
    if (CudaDeviceCount() == 0) {
      return absl::FailedPreconditionError("[Allocate] pinned host memory needs a CUDA device; 0 are visible");
    }
    return cuda->host_malloc(n);
  }
  void Release(void* p) {
    const internal::CudaHooks* cuda = internal::GetCudaHooks();
    if (cuda == nullptr) return;
    if (device_ == kPinnedHost) {
      cuda->host_free(p);
    } else {
      cuda->free(device_, p);
    }
  }

 private:
  std::string Name() const { return device_ == kPinnedHost ? "pinned host memory" : absl::StrCat("cuda:", device_); }
  int device_;
};

class CachingAllocator final : public Allocator {
 public:
  // `d`: a CUDA device, or the CPU for pinned host memory.
  explicit CachingAllocator(Device d) : device_(d), system_(d.is_cpu() ? kPinnedHost : d.index) {}

  absl::StatusOr<void*> Allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const size_t size = RoundSize(nbytes);
    {
      MutexLock lock(&mu_);
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= size + size / 8) {
        const size_t block = it->first;
        void* p = it->second;
        free_.erase(it);
        stats_.bytes_cached -= static_cast<int64_t>(block);
        ++stats_.num_cache_hits;
        return HandedLocked(p, block);
      }
    }
    // cudaMalloc and cudaFree outside the lock: they may wait for the device (cudaFree
    // synchronises it), e.g. behind an NCCL kernel waiting for a peer, and other threads
    // must still be served from the cache meanwhile.
    absl::StatusOr<void*> got = system_.Alloc(size);
    if (absl::IsResourceExhausted(got.status())) {
      // Out of memory: return the cache to the system and try once more. One thread at a time,
      // and after any release in progress has finished (else this retry could run before
      // another thread's EmptyCache has given its blocks back, and fail with memory about to
      // be free). Any other failure (a missing device, a kernel fault the call reported) is
      // returned as it is.
      absl::MutexLock release(&release_mu_);
      ReleaseCache();
      got = system_.Alloc(size);
    }
    if (!got.ok()) return got.status();
    MutexLock lock(&mu_);
    ++stats_.num_system_allocs;
    return HandedLocked(*got, size);
  }

  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    MutexLock lock(&mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return;  // not ours: ignore rather than corrupt the cache
    const size_t block = it->second;
    live_.erase(it);
    stats_.bytes_in_use -= static_cast<int64_t>(block);
    stats_.bytes_cached += static_cast<int64_t>(block);
    free_.emplace(block, ptr);
  }

  AllocatorStats Stats() const override {
    MutexLock lock(&mu_);
    return stats_;
  }
  void ResetPeakStats() override {
    MutexLock lock(&mu_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }
  void EmptyCache() override {
    absl::MutexLock release(&release_mu_);
    ReleaseCache();
  }
  Device device() const override { return device_; }

 private:
  // Takes the free blocks under mu_ and gives them back to the system outside it.
  void ReleaseCache() ABSL_EXCLUSIVE_LOCKS_REQUIRED(release_mu_) {
    std::multimap<size_t, void*> blocks;
    {
      MutexLock lock(&mu_);
      blocks.swap(free_);
      stats_.bytes_cached = 0;
    }
    for (auto& [size, p] : blocks) system_.Release(p);
  }

  void* HandedLocked(void* p, size_t block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    live_[p] = block;
    ++stats_.num_allocs;
    stats_.bytes_in_use += static_cast<int64_t>(block);
    if (stats_.bytes_in_use > stats_.peak_bytes_in_use) stats_.peak_bytes_in_use = stats_.bytes_in_use;
    return p;
  }

  const Device device_;
  SystemMemory system_;
  // Order: release_mu_ before mu_. No CUDA call is made under mu_.
  absl::Mutex release_mu_;  // one cache release (and the out-of-memory retry after it) at a time
  mutable absl::Mutex mu_;  // spins briefly before sleeping: the critical sections are short
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> live_;
  AllocatorStats stats_;
};

class CpuAllocator;
CpuAllocator& TheCpuAllocator();

// The CPU allocator. Rank threads of one process allocate and free in lockstep (right after
// each collective), so the common path takes no lock: every block carries a 64-byte header
// with its size (freeing needs no shared map), and each thread keeps up to kThreadSlots freed
// blocks of at most kLargeThreshold bytes for its own next requests. The rest is the shared
// cache under a mutex, as for CUDA. (One shared map under std::mutex made an 8-byte threads
// collective 12-20 us instead of 1.2-1.7: the losing thread slept on the lock.)
class CpuAllocator final : public Allocator {
 public:
  absl::StatusOr<void*> Allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    if (nbytes > (SIZE_MAX >> 2)) {
      return absl::ResourceExhaustedError(absl::StrCat("[Allocate] cpu: out of memory for ", nbytes, " bytes"));
    }
    const size_t size = RoundSize(nbytes);
    // Once shared blocks are on, cached private blocks of a shareable size are given back
    // rather than handed out (EnableShared cannot reach other threads' caches).
    const bool want_shared = CanShare(size);
    ThreadCache* tc = Local();
    for (int i = 0; tc != nullptr && i < tc->n; ++i) {
      const size_t block = tc->entries[i].first;
      if (want_shared && CanShare(block) && HeaderOf(tc->entries[i].second)->shared_id == 0) {
        bytes_cached_.fetch_sub(static_cast<int64_t>(block), std::memory_order_relaxed);
        SystemFree(tc->entries[i].second);
        tc->entries[i--] = tc->entries[--tc->n];
        continue;
      }
      if (block >= size && block <= size + size / 8) {
        void* p = tc->entries[i].second;
        tc->entries[i] = tc->entries[--tc->n];
        bytes_cached_.fetch_sub(static_cast<int64_t>(block), std::memory_order_relaxed);
        num_cache_hits_.fetch_add(1, std::memory_order_relaxed);
        return Handed(p, block);
      }
    }
    void* p = nullptr;
    size_t block = size;
    {
      MutexLock lock(&mu_);
      auto it = free_.lower_bound(size);
      while (want_shared && it != free_.end() && it->first <= size + size / 8 && HeaderOf(it->second)->shared_id == 0) {
        bytes_cached_.fetch_sub(static_cast<int64_t>(it->first), std::memory_order_relaxed);
        SystemFree(it->second);
        it = free_.erase(it);
      }
      if (it != free_.end() && it->first <= size + size / 8) {
        block = it->first;
        p = it->second;
        free_.erase(it);
        bytes_cached_.fetch_sub(static_cast<int64_t>(block), std::memory_order_relaxed);
        num_cache_hits_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (p == nullptr) {
      p = SystemAlloc(block);
      if (p == nullptr) {  // return the caches to the system and try once more
        EmptyCache();
        p = SystemAlloc(block);
        if (p == nullptr) {
          return absl::ResourceExhaustedError(absl::StrCat("[Allocate] cpu: out of memory for ", nbytes, " bytes"));
        }
      }
      num_system_allocs_.fetch_add(1, std::memory_order_relaxed);
    }
    return Handed(p, block);
  }

  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    if (forgot_shared_.load(std::memory_order_relaxed) && Forgotten(ptr)) return;  // see AtForkChild
    Header* h = HeaderOf(ptr);
    // Only blocks from Allocate() may come here, once each: the tag turns a second Free of a
    // block into a no-op (it is kFreeTag until the block is handed out again), and most other
    // mistakes too (a pointer into a block, one from malloc). It cannot make a foreign pointer
    // safe: the 64 bytes before it are read (a lookup on every Free would cost what the tag
    // saves).
    if (h->tag != kTag) return;
    h->tag = kFreeTag;
    const size_t block = h->block;
    bytes_in_use_.fetch_sub(static_cast<int64_t>(block), std::memory_order_relaxed);
    bytes_cached_.fetch_add(static_cast<int64_t>(block), std::memory_order_relaxed);
    ThreadCache* tc = Local();
    if (tc != nullptr && block <= kLargeThreshold && tc->n < kThreadSlots) {
      tc->entries[tc->n++] = {block, ptr};
      return;
    }
    MutexLock lock(&mu_);
    free_.emplace(block, ptr);
  }

  AllocatorStats Stats() const override {
    AllocatorStats s;
    s.bytes_in_use = bytes_in_use_.load(std::memory_order_relaxed);
    s.peak_bytes_in_use = peak_.load(std::memory_order_relaxed);
    s.bytes_cached = bytes_cached_.load(std::memory_order_relaxed);
    s.num_allocs = num_allocs_.load(std::memory_order_relaxed);
    s.num_cache_hits = num_cache_hits_.load(std::memory_order_relaxed);
    s.num_system_allocs = num_system_allocs_.load(std::memory_order_relaxed);
    return s;
  }
  void ResetPeakStats() override { peak_.store(bytes_in_use_.load(std::memory_order_relaxed)); }
  // The shared cache and the calling thread's (other threads' blocks stay with them until they
  // exit or reuse them).
  void EmptyCache() override {
    ThreadCache* tc = Local();
    MutexLock lock(&mu_);
    for (int i = 0; tc != nullptr && i < tc->n; ++i) free_.emplace(tc->entries[i].first, tc->entries[i].second);
    if (tc != nullptr) tc->n = 0;
    for (auto& [size, p] : free_) {
      bytes_cached_.fetch_sub(static_cast<int64_t>(size), std::memory_order_relaxed);
      SystemFree(p);
    }
    free_.clear();
  }

  // Shared blocks (shared_cpu_block.h).
  // Cached private blocks of a shareable size are given back as Allocate comes across them.
  void EnableShared() {
    static std::once_flag once;
    std::call_once(once, [] { pthread_atfork(&AtForkPrepare, &AtForkParent, &AtForkChild); });
    shared_on_.store(true, std::memory_order_relaxed);
  }
  // fork(): the child has no mapping of the shared blocks (MADV_DONTFORK). Its allocator
  // forgets them without touching them (their headers are in those pages): no shared block is
  // handed out from its caches, new blocks are private, it closes their descriptors (so it
  // keeps none of their memory alive), and freeing one of its live tensors in them is a no-op
  // (a tensor's destructor at exit must not fault). Their data stay unreadable in the child.
  // The locks are held across fork() so the child finds the maps consistent.
  static void AtForkPrepare() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    TheCpuAllocator().mu_.Lock();
    TheCpuAllocator().shared_mu_.Lock();
  }
  static void AtForkParent() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    TheCpuAllocator().shared_mu_.Unlock();
    TheCpuAllocator().mu_.Unlock();
  }
  static void AtForkChild() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    CpuAllocator& a = TheCpuAllocator();
    a.shared_on_.store(false, std::memory_order_relaxed);
    for (auto it = a.free_.begin(); it != a.free_.end();) {
      if (a.shared_.count(reinterpret_cast<uintptr_t>(it->second)) != 0) {
        a.bytes_cached_.fetch_sub(static_cast<int64_t>(it->first), std::memory_order_relaxed);
        it = a.free_.erase(it);
      } else {
        ++it;
      }
    }
    if (ThreadCache* tc = a.Local()) {
      for (int i = 0; i < tc->n; ++i) {
        if (a.shared_.count(reinterpret_cast<uintptr_t>(tc->entries[i].second)) != 0) {
          a.bytes_cached_.fetch_sub(static_cast<int64_t>(tc->entries[i].first), std::memory_order_relaxed);
          tc->entries[i--] = tc->entries[--tc->n];
        }
      }
    }
    for (const auto& [user, e] : a.shared_) {
      close(e.block.fd);
      a.forgotten_.insert(user);
    }
    a.shared_.clear();
    a.forgot_shared_.store(true, std::memory_order_relaxed);
    a.shared_count_.store(0, std::memory_order_relaxed);
    a.shared_mu_.Unlock();
    a.mu_.Unlock();
  }
  bool shared_enabled() const { return shared_on_.load(std::memory_order_relaxed); }
  bool Forgotten(void* p) {
    MutexLock lock(&shared_mu_);
    return forgotten_.count(reinterpret_cast<uintptr_t>(p)) != 0;
  }
  // A new block of `size` bytes may be shared: enabled, under the cap (half of it for blocks
  // under kSharedCpuLargeBytes), and the system has not refused one.
  bool CanShare(size_t size) const {
    if (size < kSharedCpuMinBytes || !shared_enabled() || shared_refused_.load(std::memory_order_relaxed)) return false;
    const int cap = size >= kSharedCpuLargeBytes ? MaxSharedCpuBlocks() : MaxSharedCpuBlocks() / 2;
    return shared_count_.load(std::memory_order_relaxed) < cap;
  }
  std::optional<SharedCpuRange> FindShared(const void* p, size_t bytes) {
    if (bytes == 0 || !shared_enabled()) return std::nullopt;
    const auto a = reinterpret_cast<uintptr_t>(p);
    MutexLock lock(&shared_mu_);
    auto it = shared_.upper_bound(a);
    if (it == shared_.begin()) return std::nullopt;
    --it;
    const SharedEntry& e = it->second;
    if (a + bytes < a || a + bytes > it->first + e.block.map_bytes - internal::kSharedCpuPage) return std::nullopt;
    return SharedCpuRange{e.id, internal::kSharedCpuPage + (a - it->first), e.block.map_bytes, e.block.fd, 0};
  }
  Device device() const override { return Device::Cpu(); }

 private:
  static constexpr size_t kHeader = 64;                        // keeps the 64-byte alignment
  static constexpr uint64_t kTag = 0x6474656e736f7221ull;      // handed out
  static constexpr uint64_t kFreeTag = 0x6474656e736f723full;  // in a cache
  static constexpr int kThreadSlots = 8;
  struct Header {
    size_t block;
    uint64_t tag;
    uint64_t shared_id;  // 0: private memory (aligned_alloc)
  };
  struct SharedEntry {
    uint64_t id;
    internal::OwnedSharedCpuBlock block;
  };
  struct ThreadCache {
    CpuAllocator* owner = nullptr;
    int n = 0;
    std::pair<size_t, void*> entries[kThreadSlots];
    ~ThreadCache() {  // a thread that ends gives its blocks to the shared cache
      ThreadCacheGone() = true;
      if (owner == nullptr || n == 0) return;
      MutexLock lock(&owner->mu_);
      for (int i = 0; i < n; ++i) owner->free_.emplace(entries[i].first, entries[i].second);
      n = 0;
    }
  };
  // Set once this thread's cache is destroyed (thread exit; for the main thread, before static
  // objects are): tensors freed later, from statics or other thread_locals, use the shared
  // cache. A bool has no destructor, so it can be read at any time.
  static bool& ThreadCacheGone() {
    thread_local bool gone = false;
    return gone;
  }
  // This thread's cache, or nullptr once it is gone.
  ThreadCache* Local() {
    if (ThreadCacheGone()) return nullptr;
    thread_local ThreadCache tc;
    tc.owner = this;
    return &tc;
  }
  static Header* HeaderOf(void* p) { return reinterpret_cast<Header*>(static_cast<char*>(p) - kHeader); }
  void* SystemAlloc(size_t block) {
    if (CanShare(block)) {
      if (void* p = SharedAlloc(block)) return p;
    }
    char* raw = static_cast<char*>(std::aligned_alloc(64, block + kHeader));
    if (raw == nullptr) return nullptr;
    void* p = raw + kHeader;
    *HeaderOf(p) = Header{block, kTag, 0};
    return p;
  }
  // nullptr where the system refuses (private memory then). The caller checked CanShare(block):
  // threads allocating at once may pass the cap by one block each.
  void* SharedAlloc(size_t block) {
    uint64_t id;
    {
      MutexLock lock(&shared_mu_);
      id = ++last_shared_id_;
    }
    std::optional<internal::OwnedSharedCpuBlock> b = internal::CreateSharedCpuBlock(block, id);
    if (!b.has_value()) {
      // memfd refused (seccomp, descriptors used up): private memory from now on, else every
      // large allocation would pay a failed attempt and skip the cache's private blocks.
      if (block <= internal::MaxSharedCpuBlockBytes()) shared_refused_.store(true, std::memory_order_relaxed);
      return nullptr;
    }
    shared_count_.fetch_add(1, std::memory_order_relaxed);
    *HeaderOf(b->user) = Header{block, kTag, id};
    MutexLock lock(&shared_mu_);
    shared_.emplace(reinterpret_cast<uintptr_t>(b->user), SharedEntry{id, *b});
    return b->user;
  }
  void SystemFree(void* p) {
    if (HeaderOf(p)->shared_id == 0) {
      std::free(static_cast<char*>(p) - kHeader);
      return;
    }
    internal::OwnedSharedCpuBlock b;
    {
      MutexLock lock(&shared_mu_);
      auto it = shared_.find(reinterpret_cast<uintptr_t>(p));
      if (it == shared_.end()) return;
      b = it->second.block;
      shared_.erase(it);
    }
    internal::ReleaseSharedCpuBlock(b);
    shared_count_.fetch_sub(1, std::memory_order_relaxed);
  }
  void* Handed(void* p, size_t block) {
    HeaderOf(p)->tag = kTag;
    num_allocs_.fetch_add(1, std::memory_order_relaxed);
    const int64_t in_use =
        bytes_in_use_.fetch_add(static_cast<int64_t>(block), std::memory_order_relaxed) + static_cast<int64_t>(block);
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (in_use > peak && !peak_.compare_exchange_weak(peak, in_use, std::memory_order_relaxed)) {
    }
    return p;
  }

  absl::Mutex mu_;
  std::multimap<size_t, void*> free_;  // user pointers by block size
  std::atomic<int64_t> bytes_in_use_{0}, peak_{0}, bytes_cached_{0}, num_allocs_{0}, num_cache_hits_{0},
      num_system_allocs_{0};
  std::atomic<bool> shared_on_{false};
  std::atomic<bool> shared_refused_{false};
  std::atomic<bool> forgot_shared_{false};                               // a fork()ed child: see AtForkChild
  std::unordered_set<uintptr_t> forgotten_ ABSL_GUARDED_BY(shared_mu_);  // its parent's shared blocks
  std::atomic<int> shared_count_{0};
  absl::Mutex shared_mu_;                                                // after mu_ where both are held
  std::map<uintptr_t, SharedEntry> shared_ ABSL_GUARDED_BY(shared_mu_);  // by user pointer
  uint64_t last_shared_id_ ABSL_GUARDED_BY(shared_mu_) = 0;
};

CpuAllocator& TheCpuAllocator() {
  // Leaked on purpose: tensors held in static objects may be freed after main() returns.
  static CpuAllocator* const cpu = new CpuAllocator();
  return *cpu;
}

// Allocation for a device that does not exist: fails with a clear message.
class InvalidDeviceAllocator final : public Allocator {
 public:
  absl::StatusOr<void*> Allocate(size_t) override {
    return absl::InvalidArgumentError("[Allocate] CUDA device index out of range [0, 16)");
  }
  void Free(void*) override {}
  AllocatorStats Stats() const override { return {}; }
  void ResetPeakStats() override {}
  void EmptyCache() override {}
  Device device() const override { return Device::Cuda(-1); }
};

}  // namespace

Allocator& DefaultAllocator(Device device) {
  static InvalidDeviceAllocator* const invalid = new InvalidDeviceAllocator();
  static std::once_flag once[kMaxCudaDevices];
  static CachingAllocator* cuda[kMaxCudaDevices] = {};
  if (device.is_cpu()) return TheCpuAllocator();
  if (device.index < 0 || device.index >= kMaxCudaDevices) return *invalid;
  std::call_once(once[device.index], [&] { cuda[device.index] = new CachingAllocator(device); });
  return *cuda[device.index];
}

Allocator& PinnedHostAllocator() {
  static CachingAllocator* const pinned = new CachingAllocator(Device::Cpu());
  return *pinned;
}

bool PinnedHostAvailable() { return internal::GetCudaHooks() != nullptr && CudaDeviceCount() > 0; }

void EnableSharedCpuBlocks() { TheCpuAllocator().EnableShared(); }
bool SharedCpuBlocksEnabled() { return TheCpuAllocator().shared_enabled(); }
int MaxSharedCpuBlocks() {
  static const int max = [] {
    rlimit r{};
    if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 1024;
    return static_cast<int>(std::min<rlim_t>(1024, r.rlim_cur / 4));
  }();
  return max;
}
std::optional<SharedCpuRange> FindSharedCpuRange(const void* p, size_t bytes) {
  return TheCpuAllocator().FindShared(p, bytes);
}

}  // namespace dtensor
