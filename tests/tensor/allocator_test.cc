// The caching allocator's counters: what the memory-saving claims of later layers rest on.
#include "dtensor/tensor/allocator.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "dtensor/tensor/cuda_hooks.h"
#include "dtensor/tensor/tensor.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

TEST(AllocatorTest, CountsBytesInUseAndPeak) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  const AllocatorStats before = alloc.Stats();
  alloc.ResetPeakStats();
  {
    Tensor a = testing::Unwrap(Tensor::Empty({1000}, DType::kFloat32));     // 4000 B -> 4096 B block
    Tensor b = testing::Unwrap(Tensor::Empty({3, 1000}, DType::kFloat32));  // 12000 B -> 12288 B
    const AllocatorStats during = alloc.Stats();
    EXPECT_EQ(during.bytes_in_use - before.bytes_in_use, 4096 + 12288);
    EXPECT_GE(during.peak_bytes_in_use, during.bytes_in_use);
  }
  const AllocatorStats after = alloc.Stats();
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use);
  EXPECT_GE(after.peak_bytes_in_use - before.bytes_in_use, 4096 + 12288);
}

TEST(AllocatorTest, ReusesFreedBlocks) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  void* first = nullptr;
  {
    Tensor a = testing::Unwrap(Tensor::Empty({777, 333}, DType::kFloat32));
    first = a.raw_data();
  }
  const AllocatorStats s0 = alloc.Stats();
  Tensor b = testing::Unwrap(Tensor::Empty({777, 333}, DType::kFloat32));
  const AllocatorStats s1 = alloc.Stats();
  EXPECT_EQ(b.raw_data(), first);
  EXPECT_EQ(s1.num_cache_hits, s0.num_cache_hits + 1);
  EXPECT_EQ(s1.num_system_allocs, s0.num_system_allocs);
}

TEST(AllocatorTest, EmptyCacheReleasesFreeBlocks) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  { Tensor a = testing::Unwrap(Tensor::Empty({1 << 20}, DType::kFloat32)); }
  EXPECT_GT(alloc.Stats().bytes_cached, 0);
  alloc.EmptyCache();
  EXPECT_EQ(alloc.Stats().bytes_cached, 0);
}

TEST(AllocatorTest, AlignedAndZeroSized) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  void* p = testing::Unwrap(alloc.Allocate(3));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  alloc.Free(p);
  EXPECT_EQ(testing::Unwrap(alloc.Allocate(0)), nullptr);
  alloc.Free(nullptr);
}

// Threads allocate, fill, check and free at once (a quarter of the blocks freed by another
// thread, as a tensor handed between rank threads is): no block is handed to two owners, the
// counters return to where they were, and blocks cached by threads that ended go back to the
// shared cache (EmptyCache then releases everything).
TEST(AllocatorTest, ThreadsShareItSafely) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  alloc.EmptyCache();
  const AllocatorStats before = alloc.Stats();
  constexpr int kThreads = 4, kRounds = 3000;
  std::mutex mu;
  std::vector<std::pair<void*, std::pair<size_t, unsigned char>>> handed;  // freed by another thread
  std::atomic<int> bad{0};
  auto worker = [&](int t) {
    uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(t + 1);
    std::vector<std::pair<void*, size_t>> held;
    for (int i = 0; i < kRounds; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      const size_t n = size_t{64} << (x % 15);  // 64 B .. 1 MiB
      auto p = alloc.Allocate(n);
      if (!p.ok()) {
        ++bad;
        return;
      }
      const unsigned char mark = static_cast<unsigned char>(t * 16 + i % 16);
      std::memset(*p, mark, n);
      held.push_back({*p, n});
      if (held.size() > 6 || i + 1 == kRounds) {
        for (auto& [q, m] : held) {
          const auto* c = static_cast<const unsigned char*>(q);
          if (c[0] != c[m - 1] || c[m / 2] != c[0]) ++bad;  // another owner wrote here
        }
        for (size_t k = 0; k < held.size(); ++k) {
          if (k % 4 == 0) {
            std::lock_guard<std::mutex> lock(mu);
            handed.push_back({held[k].first, {held[k].second, static_cast<const unsigned char*>(held[k].first)[0]}});
          } else {
            alloc.Free(held[k].first);
          }
        }
        held.clear();
        std::vector<std::pair<void*, std::pair<size_t, unsigned char>>> mine;
        {
          std::lock_guard<std::mutex> lock(mu);
          mine.swap(handed);
        }
        for (auto& [q, info] : mine) {
          const auto* c = static_cast<const unsigned char*>(q);
          if (c[0] != info.second || c[info.first - 1] != info.second) ++bad;
          alloc.Free(q);
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (std::thread& th : threads) th.join();
  for (auto& [q, info] : handed) alloc.Free(q);
  EXPECT_EQ(bad.load(), 0);
  const AllocatorStats after = alloc.Stats();
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use);
  EXPECT_EQ(after.num_allocs - before.num_allocs, int64_t{kThreads} * kRounds);
  EXPECT_GT(after.num_cache_hits - before.num_cache_hits, 0);
  alloc.EmptyCache();
  EXPECT_EQ(alloc.Stats().bytes_cached, 0);
}

TEST(AllocatorTest, SecondFreeOfABlockIsANoOp) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  constexpr size_t kBytes = 77777;  // a size no other test uses
  void* p = *alloc.Allocate(kBytes);
  const int64_t in_use = alloc.Stats().bytes_in_use;
  alloc.Free(p);
  const int64_t after_one = alloc.Stats().bytes_in_use;
  EXPECT_LT(after_one, in_use);
  alloc.Free(p);  // a caller's bug: must not put the block in a cache twice
  EXPECT_EQ(alloc.Stats().bytes_in_use, after_one);
  void* a = *alloc.Allocate(kBytes);
  void* b = *alloc.Allocate(kBytes);
  EXPECT_NE(a, b) << "one block handed to two owners";
  alloc.Free(a);
  alloc.Free(b);
}

// A thread_local made before the thread's first allocation is destroyed after the thread's
// cache: what it frees or allocates then must go through the shared cache, not the dead one.
struct LateHolder {
  Allocator* alloc = nullptr;
  size_t bytes = 0;
  void** out = nullptr;  // where the destructor's allocation goes
  ~LateHolder() {
    if (alloc != nullptr) *out = *alloc->Allocate(bytes);
  }
};

TEST(AllocatorTest, ThreadLocalsDestroyedAfterTheCacheUseTheSharedOne) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  constexpr size_t kBytes = 55555;  // a size no other test uses
  void* late = nullptr;
  std::thread t([&] {
    thread_local LateHolder holder;  // constructed before the thread's cache...
    holder.alloc = &alloc;
    holder.bytes = kBytes;
    holder.out = &late;
    void* p = *alloc.Allocate(kBytes);  // ...which this constructs
    alloc.Free(p);                      // p waits in the thread's cache
  });
  t.join();
  // The thread's cache gave p to the shared cache as it ended; the holder's allocation took it
  // from there. The next allocation of this size must be another block.
  ASSERT_NE(late, nullptr);
  void* next = *alloc.Allocate(kBytes);
  EXPECT_NE(next, late) << "one block handed to two owners";
  alloc.Free(next);
  alloc.Free(late);
}

TEST(AllocatorTest, HugeRequestIsResourceExhausted) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  auto p = alloc.Allocate(size_t{1} << 62);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
}

// A failed cudaMalloc is ResourceExhausted (what the caching allocator retries after releasing
// its cache, and what a caller may take for "use a smaller batch") only when memory ran out: on
// a machine without a GPU the device is missing (FailedPrecondition); with one, a request larger
// than any GPU's memory runs out.
TEST(AllocatorTest, CudaMallocFailsAsOutOfMemoryOnlyWhenItIs) {
  const internal::CudaHooks* cuda = internal::GetCudaHooks();
  if (cuda == nullptr) GTEST_SKIP() << "this build has no CUDA component";
  if (CudaDeviceCount() == 0) {
    absl::StatusOr<void*> p = cuda->malloc(0, 1024);
    ASSERT_FALSE(p.ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(p.status())) << p.status();
    EXPECT_NE(p.status().message().find("cudaMalloc of 1024 bytes"), std::string::npos) << p.status();
    return;
  }
  absl::StatusOr<void*> p = cuda->malloc(0, size_t{1} << 52);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
  EXPECT_TRUE(DefaultAllocator(Device::Cuda(0)).Allocate(size_t{1} << 52).status().code() ==
              absl::StatusCode::kResourceExhausted);
}

// Pinned host memory: on a machine without a GPU (or a program without the cuda component),
// EmptyPinned falls back to ordinary CPU memory and the pinned allocator refuses with a reason;
// with a GPU, the tensor is pinned and its blocks are cached for the next request.
TEST(PinnedHostTest, EmptyPinnedHoldsValuesAndSaysWhereItsMemoryIsFrom) {
  Tensor t = testing::Unwrap(Tensor::EmptyPinned({3, 5}, DType::kFloat32));
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.is_pinned(), PinnedHostAvailable());
  float* p = t.data<float>();
  for (int i = 0; i < 15; ++i) p[i] = static_cast<float>(i) * 0.5f;
  const std::vector<double> v = testing::Values(t);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(v[static_cast<size_t>(i)], i * 0.5) << i;
  EXPECT_FALSE(testing::Unwrap(Tensor::Empty({3}, DType::kFloat32)).is_pinned());
  EXPECT_FALSE(Tensor::EmptyPinned({-1}, DType::kFloat32).ok());

  Allocator& pinned = PinnedHostAllocator();
  EXPECT_TRUE(pinned.device().is_cpu());
  auto block = pinned.Allocate(4096);
  if (!PinnedHostAvailable()) {
    ASSERT_FALSE(block.ok());
    EXPECT_EQ(block.status().code(), absl::StatusCode::kFailedPrecondition) << block.status();
    EXPECT_NE(block.status().message().find("pinned host memory"), std::string::npos) << block.status();
    return;
  }
  ASSERT_TRUE(block.ok()) << block.status();
  const AllocatorStats before = pinned.Stats();
  pinned.Free(*block);
  void* again = testing::Unwrap(pinned.Allocate(4096));
  EXPECT_EQ(again, *block) << "the freed pinned block should be reused";
  EXPECT_EQ(pinned.Stats().num_cache_hits, before.num_cache_hits + 1);
  pinned.Free(again);
}

}  // namespace
}  // namespace dtensor
