#include "dtensor/tensor/allocator.h"

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>  // std::once_flag
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#ifdef DTENSOR_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace dtensor {
namespace {

constexpr size_t kSmallGranule = 512;
constexpr size_t kLargeGranule = 64 << 10;
constexpr size_t kLargeThreshold = 1 << 20;
constexpr int kMaxCudaDevices = 16;

size_t RoundSize(size_t n) {
  const size_t g = n < kLargeThreshold ? kSmallGranule : kLargeGranule;
  return (n + g - 1) / g * g;
}

// Raw system memory for one device.
class SystemMemory {
 public:
  explicit SystemMemory(Device d) : device_(d) {}
  absl::StatusOr<void*> Alloc(size_t n) {
    if (device_.is_cpu()) {
      void* p = std::aligned_alloc(64, n);
      if (p == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat("[Allocate] cpu: out of memory for ", n, " bytes"));
      }
      return p;
    }
#ifdef DTENSOR_WITH_CUDA
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_.index);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, n);
    cudaSetDevice(prev);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state
      return absl::ResourceExhaustedError(absl::StrCat("[Allocate] ", device_.ToString(), ": cudaMalloc of ", n,
                                                       " bytes failed: ", cudaGetErrorString(err)));
    }
    return p;
#else
    return absl::FailedPreconditionError(
        absl::StrCat("[Allocate] ", device_.ToString(), ": this build has no CUDA support"));
#endif
  }
  void Release(void* p) {
    if (device_.is_cpu()) {
      std::free(p);
      return;
    }
#ifdef DTENSOR_WITH_CUDA
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_.index);
    cudaFree(p);
    cudaSetDevice(prev);
#endif
  }

 private:
  Device device_;
};

class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(Device d) : device_(d), system_(d) {}

  absl::StatusOr<void*> Allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const size_t size = RoundSize(nbytes);
    absl::MutexLock lock(&mu_);
    void* p = nullptr;
    size_t block = size;
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= size + size / 8) {
      block = it->first;
      p = it->second;
      free_.erase(it);
      stats_.bytes_cached -= static_cast<int64_t>(block);
      ++stats_.num_cache_hits;
    } else {
      auto got = system_.Alloc(size);
      if (!got.ok()) {  // return the cache to the system and try once more
        ReleaseCacheLocked();
        got = system_.Alloc(size);
        if (!got.ok()) return got.status();
      }
      p = *got;
      ++stats_.num_system_allocs;
    }
    live_[p] = block;
    ++stats_.num_allocs;
    stats_.bytes_in_use += static_cast<int64_t>(block);
    if (stats_.bytes_in_use > stats_.peak_bytes_in_use) stats_.peak_bytes_in_use = stats_.bytes_in_use;
    return p;
  }

  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    absl::MutexLock lock(&mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return;  // not ours: ignore rather than corrupt the cache
    const size_t block = it->second;
    live_.erase(it);
    stats_.bytes_in_use -= static_cast<int64_t>(block);
    stats_.bytes_cached += static_cast<int64_t>(block);
    free_.emplace(block, ptr);
  }

  AllocatorStats Stats() const override {
    absl::MutexLock lock(&mu_);
    return stats_;
  }
  void ResetPeakStats() override {
    absl::MutexLock lock(&mu_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }
  void EmptyCache() override {
    absl::MutexLock lock(&mu_);
    ReleaseCacheLocked();
  }
  Device device() const override { return device_; }

 private:
  void ReleaseCacheLocked() {
    for (auto& [size, p] : free_) system_.Release(p);
    free_.clear();
    stats_.bytes_cached = 0;
  }

  const Device device_;
  SystemMemory system_;
  // Rank threads of one process allocate and free in lockstep (right after each collective):
  // std::mutex put the loser to sleep and its wake-up cost 12-20 us per 8-byte collective
  // (redistribute_bench, threads backend); absl::Mutex spins briefly first, and the critical
  // sections are a map lookup long.
  mutable absl::Mutex mu_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> live_;
  AllocatorStats stats_;
};

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
  // Leaked on purpose: tensors held in static objects may be freed after main() returns.
  static CachingAllocator* const cpu = new CachingAllocator(Device::Cpu());
  static InvalidDeviceAllocator* const invalid = new InvalidDeviceAllocator();
  static std::once_flag once[kMaxCudaDevices];
  static CachingAllocator* cuda[kMaxCudaDevices] = {};
  if (device.is_cpu()) return *cpu;
  if (device.index < 0 || device.index >= kMaxCudaDevices) return *invalid;
  std::call_once(once[device.index], [&] { cuda[device.index] = new CachingAllocator(device); });
  return *cuda[device.index];
}

}  // namespace dtensor
