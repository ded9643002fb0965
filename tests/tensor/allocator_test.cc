// The caching allocator's counters: what the memory-saving claims of later layers rest on.
#include "dtensor/tensor/allocator.h"

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

TEST(AllocatorTest, HugeRequestIsResourceExhausted) {
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  auto p = alloc.Allocate(size_t{1} << 62);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
}

}  // namespace
}  // namespace dtensor
