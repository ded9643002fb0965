// The CPU transports' reduction kernels (threads: ReduceInRankOrder, ucx: Reduce) where the
// destination sits a few cache lines ahead of or behind a source modulo 4 KiB, which makes them
// run backwards (RunBackwards, ForEachBlockOf8 in collectives/cpu_primitives.h): the results
// must be the bits of a plain left fold in source order, in place too, for every length
// around the blocks of 8.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/collectives/cpu_primitives.h"
#include "dtensor/collectives/threads/threads_reduce.h"
#include "dtensor/collectives/ucx/ucx_transport.h"
#include "gtest/gtest.h"

namespace dtensor::internal {
namespace {

constexpr int64_t kPage = 4096;

TEST(RunBackwardsTest, PicksTheDirectionWithoutNearMisses) {
  alignas(4096) static char mem[4 * kPage];
  const char* src = mem + kPage + 0x800;
  const void* one[1] = {src};
  EXPECT_TRUE(RunBackwards(mem + 0x800 + 64, one, 1));               // 64 bytes ahead, a page apart
  EXPECT_TRUE(RunBackwards(mem + 2 * kPage + 0x800 + 448, one, 1));  // 448 ahead
  EXPECT_FALSE(RunBackwards(mem + 0x800 - 64, one, 1));              // behind: forward is fine
  EXPECT_FALSE(RunBackwards(src, one, 1));                           // in place
  EXPECT_FALSE(RunBackwards(mem + 0x800 + 512, one, 1));             // far enough either way
  // One source 448 bytes behind (backward cost 64), one 64 ahead (forward cost 448): backward.
  const void* two[2] = {mem + 0x800 + 448, mem + 2 * kPage + 0x800 - 64};
  EXPECT_TRUE(RunBackwards(mem + 3 * kPage + 0x800, two, 2));
  // The other way round: forward.
  const void* other[2] = {mem + 0x800 - 448, mem + 2 * kPage + 0x800 + 64};
  EXPECT_FALSE(RunBackwards(mem + 3 * kPage + 0x800, other, 2));
}

TEST(ForEachBlockOf8Test, VisitsEveryIndexOnceInOrder) {
  for (const bool backwards : {false, true}) {
    for (int64_t n = 0; n <= 33; ++n) {
      std::vector<int64_t> seen;
      ForEachBlockOf8(
          n, backwards,
          [&](int64_t i) {
            EXPECT_EQ(i % 8, 0);
            for (int k = 0; k < 8; ++k) seen.push_back(i + k);
          },
          [&](int64_t i) { seen.push_back(i); });
      ASSERT_EQ(static_cast<int64_t>(seen.size()), n) << "n " << n << " backwards " << backwards;
      // Blocks ascend within themselves; block starts and single indices follow the direction.
      std::vector<bool> hit(static_cast<size_t>(n), false);
      for (int64_t v : seen) {
        ASSERT_GE(v, 0);
        ASSERT_LT(v, n);
        EXPECT_FALSE(hit[static_cast<size_t>(v)]) << v;
        hit[static_cast<size_t>(v)] = true;
      }
      if (n >= 2 && n % 8 != 0) {
        EXPECT_EQ(seen.front(), backwards ? n - 1 : 0) << n;
      }
    }
  }
}

// Sources and destination of `n` floats at chosen offsets (bytes, multiples of 4) into pages of
// their own; values with NaN, infinities, signed zeros and ones that round differently when
// summed in another order.
struct Layout {
  int nsrcs;
  int64_t dst_minus_src0;  // bytes, modulo a page: > 0 ahead
  bool in_place;           // dst is source 1 (the offset is then ignored)
};

void PrintTo(const Layout& l, std::ostream* os) {
  *os << l.nsrcs << " sources, destination "
      << (l.in_place ? std::string("in place") : absl::StrCat(l.dst_minus_src0, " bytes from source 0"));
}

float Value(int j, int64_t i) {
  switch ((i * 7 + j * 3) % 11) {
    case 0:
      return std::numeric_limits<float>::quiet_NaN();
    case 1:
      return j % 2 == 0 ? std::numeric_limits<float>::infinity() : 1.0f;
    case 2:
      return -0.0f;
    case 3:
      return 1e8f * static_cast<float>(j + 1);
    default:
      return std::ldexp(static_cast<float>((i * 2654435761u + static_cast<uint64_t>(j) * 40503u) % 1000) - 500.0f,
                        -static_cast<int>(i % 9));
  }
}

class CpuReduceTest : public testing::TestWithParam<Layout> {};

TEST_P(CpuReduceTest, BothKernelsGiveTheBitsOfAPlainFoldInEitherDirection) {
  const Layout layout = GetParam();
  for (const int64_t n : {1, 7, 8, 9, 31, 1000, 8195}) {
    for (const bool ucx : {false, true}) {
      const int64_t bytes = n * 4;
      const int64_t span = (bytes / kPage + 3) * kPage;
      std::vector<std::vector<char>> pages(static_cast<size_t>(layout.nsrcs + 1),
                                           std::vector<char>(static_cast<size_t>(span + kPage)));
      auto page = [&](size_t k) {
        char* p = pages[k].data();
        return p + (kPage - reinterpret_cast<uintptr_t>(p) % kPage) % kPage;
      };
      std::vector<float*> src(static_cast<size_t>(layout.nsrcs));
      for (int j = 0; j < layout.nsrcs; ++j) {
        src[static_cast<size_t>(j)] = reinterpret_cast<float*>(page(static_cast<size_t>(j)) + 0x800);
        for (int64_t i = 0; i < n; ++i) src[static_cast<size_t>(j)][i] = Value(j, i);
      }
      std::vector<float> want(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        float acc = src[0][i];
        for (int j = 1; j < layout.nsrcs; ++j) acc = acc + src[static_cast<size_t>(j)][i];
        want[static_cast<size_t>(i)] = acc;
      }
      const int64_t shift = ((layout.dst_minus_src0 % kPage) + kPage) % kPage;
      float* dst = layout.in_place
                       ? src[1]
                       : reinterpret_cast<float*>(page(static_cast<size_t>(layout.nsrcs)) + (0x800 + shift) % kPage);
      std::vector<const char*> from;
      for (float* s : src) from.push_back(reinterpret_cast<const char*>(s));
      if (ucx) {
        std::vector<const void*> v(from.begin(), from.end());
        Reduce(DType::kFloat32, CommReduceOp::kSum, v.data(), layout.nsrcs, n, dst, 0);
      } else {
        ReduceInRankOrder(DType::kFloat32, CommReduceOp::kSum, from, 0, n, reinterpret_cast<char*>(dst));
      }
      const std::string where = absl::StrCat(ucx ? "ucx" : "threads", " n ", n);
      for (int64_t i = 0; i < n; ++i) {
        uint32_t got_bits, want_bits;
        std::memcpy(&got_bits, &dst[i], 4);
        std::memcpy(&want_bits, &want[static_cast<size_t>(i)], 4);
        if (std::isnan(want[static_cast<size_t>(i)])) {
          ASSERT_TRUE(std::isnan(dst[i])) << where << " at " << i;
        } else {
          ASSERT_EQ(got_bits, want_bits) << where << " at " << i << ": " << dst[i] << " vs "
                                         << want[static_cast<size_t>(i)];
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CpuReduceTest,
                         testing::Values(Layout{2, 64, false}, Layout{2, 256, false}, Layout{2, -64, false},
                                         Layout{2, 0, true}, Layout{3, 128, false}, Layout{4, -192, false},
                                         Layout{4, 0, true}, Layout{2, 2048, false}),
                         [](const testing::TestParamInfo<Layout>& info) {
                           const Layout& l = info.param;
                           return absl::StrCat(l.nsrcs, "srcs_",
                                               l.in_place ? std::string("in_place")
                                                          : absl::StrCat(l.dst_minus_src0 < 0 ? "behind" : "ahead",
                                                                         std::abs(l.dst_minus_src0)));
                         });

}  // namespace
}  // namespace dtensor::internal
