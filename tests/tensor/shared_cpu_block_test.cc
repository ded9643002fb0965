// Shared CPU blocks: what the ucx backend's zero-copy steps rest on. Each test case runs in
// its own process under ctest; EnableSharedCpuBlocks() is for the rest of that process.
#include "dtensor/tensor/shared_cpu_block.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/tensor/allocator.h"
#include "dtensor/tensor/tensor.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

constexpr int64_t kLarge = 1 << 18;  // floats: 1 MiB

Tensor Floats(int64_t n) { return testing::Unwrap(Tensor::Empty({n}, DType::kFloat32)); }

// MaxSharedCpuBlocks() read (once per process) under a descriptor limit of 64: 16; or 0 and
// why not.
int SmallCap(std::string* why) {
  rlimit before{};
  if (getrlimit(RLIMIT_NOFILE, &before) != 0 || before.rlim_cur < 64) {
    *why = "descriptor limit below 64";
    return 0;
  }
  rlimit low = before;
  low.rlim_cur = 64;
  if (setrlimit(RLIMIT_NOFILE, &low) != 0) {
    *why = "cannot lower the descriptor limit";
    return 0;
  }
  const int cap = MaxSharedCpuBlocks();
  setrlimit(RLIMIT_NOFILE, &before);
  if (cap > 16) {
    *why = absl::StrCat("the cap was computed earlier in this process (", cap, ")");
    return 0;
  }
  return cap;
}

TEST(SharedCpuBlockTest, OffUntilEnabled) {
  if (SharedCpuBlocksEnabled()) GTEST_SKIP() << "enabled by an earlier test of this process";
  Tensor t = Floats(kLarge);
  EXPECT_FALSE(FindSharedCpuRange(t.raw_data(), t.nbytes()).has_value());
}

TEST(SharedCpuBlockTest, LargeBlocksAreSharedAndFoundFromAnyAddressInThem) {
  EnableSharedCpuBlocks();
  ASSERT_TRUE(SharedCpuBlocksEnabled());
  Tensor t = Floats(kLarge);
  Tensor u = Floats(kLarge);
  const std::optional<SharedCpuRange> r = FindSharedCpuRange(t.raw_data(), t.nbytes());
  ASSERT_TRUE(r.has_value());
  EXPECT_NE(r->id, 0u);
  EXPECT_GE(r->fd, 0);
  EXPECT_GE(r->map_bytes, t.nbytes() + r->offset);
  // An interior range: same block, offset moved by as much.
  const char* mid = static_cast<const char*>(t.raw_data()) + 1000;
  const std::optional<SharedCpuRange> m = FindSharedCpuRange(mid, 4000);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->id, r->id);
  EXPECT_EQ(m->offset, r->offset + 1000);
  // Another block has another id and descriptor.
  const std::optional<SharedCpuRange> ru = FindSharedCpuRange(u.raw_data(), u.nbytes());
  ASSERT_TRUE(ru.has_value());
  EXPECT_NE(ru->id, r->id);
  EXPECT_NE(ru->fd, r->fd);
  // Past the block's end, empty, small blocks and memory not from the allocator: not found.
  const size_t block_bytes = r->map_bytes - r->offset;
  EXPECT_FALSE(FindSharedCpuRange(t.raw_data(), block_bytes + 1).has_value());
  EXPECT_FALSE(FindSharedCpuRange(t.raw_data(), 0).has_value());
  Tensor small = Floats(1000);
  EXPECT_FALSE(FindSharedCpuRange(small.raw_data(), small.nbytes()).has_value());
  int on_stack = 0;
  EXPECT_FALSE(FindSharedCpuRange(&on_stack, sizeof(on_stack)).has_value());
}

TEST(SharedCpuBlockTest, APeerMappingSeesTheSameBytesBothWays) {
  EnableSharedCpuBlocks();
  Tensor t = Floats(kLarge);
  float* x = t.data<float>();
  for (int64_t i = 0; i < kLarge; ++i) x[i] = static_cast<float>(i) * 0.5f;
  const std::optional<SharedCpuRange> r = FindSharedCpuRange(t.raw_data(), t.nbytes());
  ASSERT_TRUE(r.has_value());
  // This process's own block, opened the way a peer opens it (/proc/<pid>/fd/<fd>).
  absl::StatusOr<PeerSharedCpuBlock> m = PeerSharedCpuBlock::Open(getpid(), *r);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->id(), r->id);
  EXPECT_FALSE(m->released());
  const float* seen = reinterpret_cast<const float*>(m->at(r->offset));
  EXPECT_NE(static_cast<const void*>(seen), t.raw_data());  // a second mapping, not the same address
  EXPECT_EQ(std::memcmp(seen, x, t.nbytes()), 0);
  reinterpret_cast<float*>(m->at(r->offset))[kLarge - 1] = -7.0f;
  EXPECT_EQ(x[kLarge - 1], -7.0f);
}

TEST(SharedCpuBlockTest, ReleasingABlockIsVisibleToItsMappingsAndItCannotBeOpenedAgain) {
  EnableSharedCpuBlocks();
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  std::optional<SharedCpuRange> r;
  std::optional<PeerSharedCpuBlock> m;
  {
    Tensor t = Floats(3 * kLarge);  // a size no other test here caches
    r = FindSharedCpuRange(t.raw_data(), t.nbytes());
    ASSERT_TRUE(r.has_value());
    absl::StatusOr<PeerSharedCpuBlock> opened = PeerSharedCpuBlock::Open(getpid(), *r);
    ASSERT_TRUE(opened.ok()) << opened.status();
    m.emplace(*std::move(opened));
  }
  EXPECT_FALSE(m->released());  // back in the cache: still the allocator's
  alloc.EmptyCache();
  EXPECT_TRUE(m->released());
  absl::StatusOr<PeerSharedCpuBlock> again = PeerSharedCpuBlock::Open(getpid(), *r);
  EXPECT_FALSE(again.ok());
}

TEST(SharedCpuBlockTest, OpenChecksTheBlockId) {
  EnableSharedCpuBlocks();
  Tensor t = Floats(kLarge);
  std::optional<SharedCpuRange> r = FindSharedCpuRange(t.raw_data(), t.nbytes());
  ASSERT_TRUE(r.has_value());
  SharedCpuRange wrong = *r;
  wrong.id += 1000;
  absl::StatusOr<PeerSharedCpuBlock> m = PeerSharedCpuBlock::Open(getpid(), wrong);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(m.status().message().find(std::to_string(wrong.id)), std::string::npos) << m.status();
  SharedCpuRange no_fd = *r;
  no_fd.fd = 100000;
  m = PeerSharedCpuBlock::Open(getpid(), no_fd);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("/fd/100000"), std::string::npos) << m.status();
  EXPECT_FALSE(PeerSharedCpuBlock::Open(getpid(), SharedCpuRange{}).ok());
}

TEST(SharedCpuBlockTest, EnablingReleasesCachedPrivateBlocks) {
  if (SharedCpuBlocksEnabled()) GTEST_SKIP() << "enabled by an earlier test of this process";
  {
    Tensor a = Floats(kLarge);      // 1 MiB: cached by this thread when freed
    Tensor b = Floats(5 * kLarge);  // larger: the shared cache
  }
  EnableSharedCpuBlocks();
  Tensor a = Floats(kLarge);
  Tensor b = Floats(5 * kLarge);
  EXPECT_TRUE(FindSharedCpuRange(a.raw_data(), a.nbytes()).has_value());
  EXPECT_TRUE(FindSharedCpuRange(b.raw_data(), b.nbytes()).has_value());
}

// A block memfd could not really back (more than half the host's memory) stays private, so
// that an impossible size fails at once as before instead of "succeeding" and killing the
// process when touched. Where the host itself overcommits (vm.overcommit_memory=1, as on some
// GPU machines), a private allocation of that size succeeds untouched, as malloc's does; the
// block must still not be a memfd one.
TEST(SharedCpuBlockTest, AnImpossibleSizeStaysPrivate) {
  EnableSharedCpuBlocks();
  constexpr size_t kBytes = size_t{1} << 44;  // 16 TiB
  absl::StatusOr<Tensor> t = Tensor::Empty({static_cast<int64_t>(kBytes / 4)}, DType::kFloat32);
  void* probe = std::malloc(kBytes);
  // The pointer escapes here: else clang drops a malloc whose result is only freed, and takes
  // it as successful.
  asm volatile("" : "+r"(probe) : : "memory");
  const bool host_overcommits = probe != nullptr;
  std::free(probe);
  if (!host_overcommits) {
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
    return;
  }
  ASSERT_TRUE(t.ok()) << "malloc gave " << kBytes << " bytes but the allocator refused: " << t.status();
  EXPECT_FALSE(FindSharedCpuRange(t->raw_data(), t->nbytes()).has_value());
}

// Past MaxSharedCpuBlocks() blocks are private, and the cache still serves them (it must not
// give cached private blocks back in the hope of a shared one it cannot make).
TEST(SharedCpuBlockTest, PastTheCapBlocksArePrivateAndStillCached) {
  std::string why;
  const int cap = SmallCap(&why);
  if (cap == 0) GTEST_SKIP() << why;
  EnableSharedCpuBlocks();
  std::vector<Tensor> held;
  bool got_private = false;
  for (int i = 0; i <= 2 * cap && !got_private; ++i) {
    Tensor t = Floats(kLarge / 2);  // 512 KiB
    got_private = !FindSharedCpuRange(t.raw_data(), t.nbytes()).has_value();
    held.push_back(std::move(t));
  }
  ASSERT_TRUE(got_private) << "more than " << 2 * cap << " shared blocks";
  held.pop_back();  // the private block, to the cache
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  const AllocatorStats s0 = alloc.Stats();
  Tensor again = Floats(kLarge / 2);
  const AllocatorStats s1 = alloc.Stats();
  EXPECT_EQ(s1.num_cache_hits, s0.num_cache_hits + 1);
  EXPECT_EQ(s1.num_system_allocs, s0.num_system_allocs);
  EXPECT_FALSE(FindSharedCpuRange(again.raw_data(), again.nbytes()).has_value());
}

// Blocks from kSharedCpuMinBytes to kSharedCpuLargeBytes are shared up to half the cap; large
// blocks still get the rest.
TEST(SharedCpuBlockTest, SmallBlocksTakeAtMostHalfTheCap) {
  std::string why;
  const int cap = SmallCap(&why);
  if (cap == 0) GTEST_SKIP() << why;
  EnableSharedCpuBlocks();
  const int64_t min_floats = static_cast<int64_t>(kSharedCpuMinBytes / sizeof(float));
  Tensor below = Floats(min_floats - 1024);  // rounds to under kSharedCpuMinBytes
  EXPECT_FALSE(FindSharedCpuRange(below.raw_data(), below.nbytes()).has_value());
  std::vector<Tensor> held;
  int shared = 0;
  for (int i = 0; i < cap; ++i) {
    Tensor t = Floats(min_floats);
    shared += FindSharedCpuRange(t.raw_data(), t.nbytes()).has_value() ? 1 : 0;
    held.push_back(std::move(t));
  }
  EXPECT_EQ(shared, cap / 2);
  for (int i = 0; i < cap - cap / 2; ++i) {
    Tensor t = Floats(static_cast<int64_t>(kSharedCpuLargeBytes / sizeof(float)));
    EXPECT_TRUE(FindSharedCpuRange(t.raw_data(), t.nbytes()).has_value()) << "large block " << i;
    held.push_back(std::move(t));
  }
  Tensor past = Floats(static_cast<int64_t>(kSharedCpuLargeBytes / sizeof(float)));
  EXPECT_FALSE(FindSharedCpuRange(past.raw_data(), past.nbytes()).has_value());
}

// Another process (a fork()ed child: it does not inherit the block, MADV_DONTFORK) maps the
// parent's block by descriptor, checks the parent's bytes and writes its own.
TEST(SharedCpuBlockTest, AnotherProcessMapsTheBlock) {
  EnableSharedCpuBlocks();
  Tensor t = Floats(kLarge);
  float* x = t.data<float>();
  for (int64_t i = 0; i < kLarge; ++i) x[i] = static_cast<float>(i % 977);
  const std::optional<SharedCpuRange> r = FindSharedCpuRange(t.raw_data(), t.nbytes());
  ASSERT_TRUE(r.has_value());
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<PeerSharedCpuBlock> m = PeerSharedCpuBlock::Open(parent, *r);
    if (!m.ok()) _exit(2);
    float* y = reinterpret_cast<float*>(m->at(r->offset));
    for (int64_t i = 0; i < kLarge; ++i) {
      if (y[i] != static_cast<float>(i % 977)) _exit(3);
    }
    for (int64_t i = 0; i < kLarge; ++i) y[i] = static_cast<float>(-i);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << "2: could not open the block, 3: wrong bytes";
  for (int64_t i = 0; i < kLarge; i += 4099) EXPECT_EQ(x[i], static_cast<float>(-i));
}

// A fork()ed child (a data-loader worker, say) has no mapping of the parent's shared blocks.
// Its allocator must not hand one out of its cache (writing it would fault), and its new large
// blocks are private.
TEST(SharedCpuBlockTest, AForkedChildAllocatesPrivateMemoryNotTheParentsCachedBlocks) {
  EnableSharedCpuBlocks();
  void* cached = nullptr;
  Tensor live = Floats(2 * kLarge);  // held across the fork: the child frees its copy
  ASSERT_TRUE(FindSharedCpuRange(live.raw_data(), live.nbytes()).has_value());
  {
    Tensor a = Floats(kLarge);      // 1 MiB: this thread's cache when freed
    Tensor b = Floats(3 * kLarge);  // the shared cache
    ASSERT_TRUE(FindSharedCpuRange(a.raw_data(), a.nbytes()).has_value());
    ASSERT_TRUE(FindSharedCpuRange(b.raw_data(), b.nbytes()).has_value());
    cached = a.raw_data();
  }
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    live = Tensor();  // frees (the child's view of) a block it has no mapping of
    absl::StatusOr<Tensor> a = Tensor::Empty({kLarge}, DType::kFloat32);
    absl::StatusOr<Tensor> b = Tensor::Empty({3 * kLarge}, DType::kFloat32);
    if (!a.ok() || !b.ok()) _exit(2);
    if (a->raw_data() == cached) _exit(3);
    if (FindSharedCpuRange(a->raw_data(), a->nbytes()).has_value()) _exit(4);
    std::memset(a->raw_data(), 1, a->nbytes());  // faults on an unmapped block
    std::memset(b->raw_data(), 1, b->nbytes());
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: allocation failed, 3: got the parent's cached block, 4: shared";
  // The parent's blocks are untouched by all this.
  Tensor again = Floats(kLarge);
  EXPECT_TRUE(FindSharedCpuRange(again.raw_data(), again.nbytes()).has_value());
}

}  // namespace
}  // namespace dtensor
