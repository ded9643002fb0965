// The CUDA backend against the CPU backend, the reference for every op (itself tested against
// float64 references in tests/ops). Each case builds the same inputs on both devices, runs the
// kernel on each and compares: odd shapes (1, 3, 17, 127, ...), non-contiguous and broadcast
// inputs where the contract allows them, float32 and bfloat16 (float16, integers and float8
// where an op has those paths). Copies, fills and uniform random fills must match bit for bit.
//
// Every test needs a visible GPU and skips without one, except CudaAvailabilityTest, which
// checks that asking for a missing device fails cleanly.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/kernels/cpu/cpu_kernels.h"
#include "dtensor/kernels/cuda/cuda_kernels.h"
#include "dtensor/kernels/kernels.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/allocator.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Tolerance;
using testing::Unwrap;

constexpr const char* kNoGpu =
    "no CUDA device visible: the CUDA kernels can only run, and be compared with the CPU backend, on a GPU";

constexpr Tolerance kExact{0.0, 0.0};
// float32 results that sum many terms in a different order than the CPU (which often sums in
// double): a few float ulps per term.
constexpr Tolerance kF32Sum{1e-4, 1e-4};

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16,    DType::kInt32,
                                DType::kInt64,   DType::kBool,     DType::kFloat8E4M3, DType::kFloat8E5M2};

Kernels* Cpu() { return CpuKernels(); }
Kernels* Gpu() { return Unwrap(CudaKernels(0), "CudaKernels(0)"); }

void ExpectOk(const absl::Status& s, const std::string& what) { EXPECT_TRUE(s.ok()) << what << ": " << s; }

std::string Name(DType d) { return std::string(DTypeName(d)); }

// ---- Moving tensors between the devices with the backend's own Memcpy ----

Tensor ToGpu(const Tensor& host) {
  const Tensor src = Unwrap(Contiguous(host), "Contiguous");
  Tensor dev = Unwrap(Tensor::Empty(host.shape(), host.dtype(), Device::Cuda(0)), "Empty cuda");
  ExpectOk(Gpu()->MemcpyToDevice(dev.raw_data(), src.raw_data(), src.nbytes(), /*wait=*/true), "MemcpyToDevice");
  return dev;
}

Tensor ToCpu(const Tensor& dev) {
  Tensor src = dev;
  if (!dev.is_contiguous()) {
    src = Unwrap(Tensor::Empty(dev.shape(), dev.dtype(), Device::Cuda(0)), "Empty cuda");
    ExpectOk(Gpu()->Copy(dev, src), "Copy to contiguous");
  }
  Tensor host = Unwrap(Tensor::Empty(dev.shape(), dev.dtype(), Device::Cpu()), "Empty cpu");
  ExpectOk(Gpu()->MemcpyToHost(host.raw_data(), src.raw_data(), src.nbytes()), "MemcpyToHost");
  return host;
}

// Row-major values of a tensor on either device, as float64.
std::vector<double> Vals(const Tensor& t) { return testing::Values(t.device().is_cuda() ? ToCpu(t) : t); }

// ---- The same tensor on both devices ----

struct Pair {
  Tensor cpu, gpu;
  const Tensor& operator[](int side) const { return side == 0 ? cpu : gpu; }
};

Pair Both(const Tensor& host) { return {host, ToGpu(host)}; }

Pair EmptyBoth(IntSpan shape, DType dtype) {
  return {Unwrap(Tensor::Empty(shape, dtype, Device::Cpu())), Unwrap(Tensor::Empty(shape, dtype, Device::Cuda(0)))};
}

// Uniform values in [lo, hi) rounded to dtype (integers: rounded to whole numbers).
Tensor HostRandom(IntSpan shape, DType dtype, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  if (IsComputeFloat(dtype)) return testing::Random(shape, dtype, seed, lo, hi);
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(NumElements(shape)));
  for (double& x : v) x = dist(gen);
  return testing::FromDoubles(v, shape, dtype);
}

Pair RandomBoth(IntSpan shape, DType dtype, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  return Both(HostRandom(shape, dtype, seed, lo, hi));
}

// Random values in a non-contiguous layout: stored with the dims reversed, viewed back.
Pair RandomNonContiguous(IntSpan shape, DType dtype, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  const Shape reversed(shape.rbegin(), shape.rend());
  Shape perm(shape.size());
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(perm.size() - 1 - i);
  const Pair base = RandomBoth(reversed, dtype, seed, lo, hi);
  return {Unwrap(base.cpu.Permute(perm)), Unwrap(base.gpu.Permute(perm))};
}

// An output with gaps: every other element of the last dim of a zero-filled buffer.
Pair Gapped(IntSpan shape, DType dtype) {
  Shape big(shape.begin(), shape.end());
  big.back() *= 2;
  const Pair base = EmptyBoth(big, dtype);
  ExpectOk(Cpu()->Fill(base.cpu, 0.0), "Fill");
  ExpectOk(Gpu()->Fill(base.gpu, 0.0), "Fill");
  const int64_t last = static_cast<int64_t>(shape.size()) - 1;
  return {Unwrap(base.cpu.Slice(last, 0, big.back(), 2)), Unwrap(base.gpu.Slice(last, 0, big.back(), 2))};
}

void ExpectSame(const Pair& p, Tolerance tol, const std::string& what) {
  testing::ExpectNear(Vals(p.gpu), Vals(p.cpu), tol, what);
}

// How many elements of a and b differ (a fused path against the unfused one it replaces: none
// means the fused one did not run).
int64_t Differing(const std::vector<double>& a, const std::vector<double>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) n += a[i] != b[i];
  return n;
}

// ---------------------------------------------------------------------------------------
// Without a GPU
// ---------------------------------------------------------------------------------------

TEST(CudaAvailabilityTest, MissingDeviceFailsCleanly) {
  const int count = CudaDeviceCount();
  // On a GPU runner, set DTENSOR_REQUIRE_GPU=1 so that a driver too old for this CUDA build
  // (CudaDeviceCount() == 0: every other test skips) fails the suite instead of passing it.
  if (std::getenv("DTENSOR_REQUIRE_GPU") != nullptr) {
    EXPECT_GT(count, 0) << "DTENSOR_REQUIRE_GPU is set but no CUDA device is visible (built with CUDA: " << CudaBuilt()
                        << "); is the driver recent enough for this CUDA toolkit?";
  }
  auto k = CudaKernels(count);  // one past the last visible device
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), absl::StatusCode::kFailedPrecondition) << k.status();
  if (CudaBuilt()) {
    EXPECT_NE(k.status().message().find(absl::StrCat(count, " CUDA devices are visible")), std::string::npos)
        << k.status();
  } else {
    EXPECT_NE(k.status().message().find("without CUDA"), std::string::npos) << k.status();
  }
  EXPECT_FALSE(CudaKernels(-1).ok());
  EXPECT_FALSE(KernelsFor(Device::Cuda(count)).ok());
  auto t = Tensor::Empty({2, 3}, DType::kFloat32, Device::Cuda(count));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  if (count == 0) {  // the usual case on a machine without a GPU: cuda:0 itself is missing
    auto k0 = CudaKernels(0);
    ASSERT_FALSE(k0.ok());
    EXPECT_EQ(k0.status().code(), absl::StatusCode::kFailedPrecondition);
    if (CudaBuilt()) {
      EXPECT_NE(k0.status().message().find("0 CUDA devices"), std::string::npos) << k0.status();
    }
    EXPECT_FALSE(Tensor::Empty({1}, DType::kBFloat16, Device::Cuda(0)).ok());
  }
}

// ---------------------------------------------------------------------------------------
// Memory, copies, fills, random
// ---------------------------------------------------------------------------------------

TEST(CudaKernelsTest, DeviceMemcpyAndSynchronize) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  EXPECT_EQ(Gpu()->device(), Device::Cuda(0));
  const Tensor host = HostRandom({3, 17}, DType::kFloat32, 1);
  const Tensor back = ToCpu(ToGpu(host));
  testing::ExpectNear(testing::Values(back), testing::Values(host), kExact, "round trip");
  ExpectOk(Gpu()->MemcpyToDevice(nullptr, nullptr, 0, /*wait=*/false), "empty MemcpyToDevice");
  ExpectOk(Gpu()->Synchronize(), "Synchronize");
}

// Device -> host into pinned memory (the checkpoint's staging): the same bytes as the CPU source.
TEST(CudaKernelsTest, CopyToPinnedHostMemory) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  ASSERT_TRUE(PinnedHostAvailable());
  const Tensor cpu = HostRandom({37, 11}, DType::kFloat32, 77);
  const Tensor gpu = ToGpu(cpu);
  Tensor staged = Unwrap(Tensor::EmptyPinned({37, 11}, DType::kFloat32));
  EXPECT_TRUE(staged.is_pinned());
  ASSERT_TRUE(Copy_(staged, gpu).ok());
  EXPECT_EQ(std::memcmp(staged.raw_data(), cpu.raw_data(), cpu.nbytes()), 0);
}

// To(..., {.non_blocking = true}) from pinned memory, double-buffered as gpt_train feeds its
// batches: buffer r % 2 is rewritten in round r only after round r - 2's copy was read back (the
// read waits for the stream). Every device copy holds its own round's values; a pageable source
// (copied with a wait) too.
TEST(CudaKernelsTest, NonBlockingCopyFromPinnedMemoryKeepsEachRoundsValues) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  ASSERT_TRUE(PinnedHostAvailable());
  constexpr int64_t kN = int64_t{1} << 20;
  std::array<Tensor, 2> pinned = {Unwrap(Tensor::EmptyPinned({kN}, DType::kInt32)),
                                  Unwrap(Tensor::EmptyPinned({kN}, DType::kInt32))};
  std::vector<Tensor> dev;
  for (int r = 0; r < 6; ++r) {
    if (r >= 2) {
      EXPECT_EQ(ToCpu(dev[static_cast<size_t>(r - 2)]).data<int32_t>()[kN - 1], (r - 2) * 7 + kN - 1);
    }
    int32_t* p = pinned[static_cast<size_t>(r % 2)].data<int32_t>();
    for (int64_t i = 0; i < kN; ++i) p[i] = static_cast<int32_t>(r * 7 + i);
    dev.push_back(Unwrap(To(pinned[static_cast<size_t>(r % 2)], Device::Cuda(0), {.non_blocking = true})));
    EXPECT_EQ(dev.back().device(), Device::Cuda(0));
  }
  for (int r = 4; r < 6; ++r) {
    const Tensor back = ToCpu(dev[static_cast<size_t>(r)]);
    const int32_t* b = back.data<int32_t>();
    int64_t wrong = 0;
    for (int64_t i = 0; i < kN; ++i) wrong += b[i] != static_cast<int32_t>(r * 7 + i);
    EXPECT_EQ(wrong, 0) << "round " << r;
  }
  const Tensor pageable = HostRandom({5, 7}, DType::kFloat32, 3);
  const Tensor copied = Unwrap(To(pageable, Device::Cuda(0), {.non_blocking = true}));
  testing::ExpectNear(testing::Values(ToCpu(copied)), testing::Values(pageable), kExact, "pageable source");
}

// SumOfSquares on the GPU (float64 partial sums per block, then one block over them) against
// the CPU's float64 sum, for every float dtype and sizes from none to several million (one
// block, many, and the 1024-block cap); the same bits on a second call; an int refused.
TEST(CudaKernelsTest, SumOfSquaresMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{4097}, int64_t{70001}, int64_t{3000017}, int64_t{9000011}}) {
      const Tensor host = HostRandom({n}, d, static_cast<uint64_t>(n) + 1);
      const double want = Vals(Unwrap(SumOfSquares(host)))[0];
      const Tensor gpu = ToGpu(host);
      const Tensor got = Unwrap(SumOfSquares(gpu));
      EXPECT_EQ(got.dtype(), DType::kFloat32);
      EXPECT_NEAR(Vals(got)[0], want, 1e-6 * want) << Name(d) << " n " << n;
      EXPECT_EQ(Vals(Unwrap(SumOfSquares(gpu)))[0], Vals(got)[0]) << Name(d) << " n " << n << ": a second call";
    }
  }
  EXPECT_FALSE(SumOfSquares(ToGpu(Unwrap(Zeros({3}, DType::kInt32)))).ok());
}

TEST(CudaKernelsTest, CopyMatchesCpuBitForBitForEveryDTypePair) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  // Source values: fractions, halfway cases, float8/float16 overflow, int overflow, specials.
  const std::vector<double> pattern = {-300.7, -2.5, -1.0, -0.0, 0.0,   0.3,  1.5,  2.5,   7.0, 100.2, 448.0, 464.0,
                                       500.0,  1e5,  7e4,  3e9,  -3e10, 1e-3, 2e-8, 1e-40, nan, inf,   -inf};
  const Shape shape = {3, 17};  // 51 values: the pattern repeated
  std::vector<double> values(51);
  for (size_t i = 0; i < values.size(); ++i) values[i] = pattern[i % pattern.size()];
  for (DType sd : kAllDTypes) {
    for (DType dd : kAllDTypes) {
      const std::string what = Name(sd) + " -> " + Name(dd);
      // Integer and bool sources hold their own rounding of the pattern's finite values.
      std::vector<double> v = values;
      if (!IsComputeFloat(sd) && !IsFloat8(sd)) {
        for (double& x : v) x = std::isfinite(x) ? std::fmod(std::trunc(x), 1e9) : 3.0;
      }
      // Source: a transposed view of [17, 3] data; destination: a view with gaps.
      const Tensor base = testing::FromDoubles(v, {17, 3}, sd);
      const Pair src_base = Both(base);
      const Pair src{Unwrap(src_base.cpu.Transpose(0, 1)), Unwrap(src_base.gpu.Transpose(0, 1))};
      const Pair dst = Gapped(shape, dd);
      for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Copy(src[side], dst[side]), what);
      ExpectSame(dst, kExact, what);
      // Broadcast source (stride 0 in both dims).
      const Pair one = Both(testing::FromDoubles({IsComputeFloat(sd) ? -2.5 : 5.0}, {1, 1}, sd));
      const Pair bsrc{Unwrap(one.cpu.Expand(shape)), Unwrap(one.gpu.Expand(shape))};
      const Pair bdst = EmptyBoth(shape, dd);
      for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Copy(bsrc[side], bdst[side]), what + " broadcast");
      ExpectSame(bdst, kExact, what + " broadcast");
    }
  }
}

TEST(CudaKernelsTest, FillMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType d : kAllDTypes) {
    for (double value : {2.5, -3.75, 1e10, -1e10, 0.1, nan}) {
      const std::string what = absl::StrCat("fill ", Name(d), " with ", value);
      const Pair dst = Gapped({5, 3, 7}, d);
      for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Fill(dst[side], value), what);
      ExpectSame(dst, kExact, what);
    }
  }
}

TEST(CudaKernelsTest, FillRandomMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  struct Case {
    Shape block, global, offset;
  };
  const Case cases[] = {{{3, 17}, {7, 33}, {2, 9}},         // a shard in the middle
                        {{5, 1031}, {5, 1031}, {0, 0}},     // the whole tensor
                        {{2, 1, 5}, {4, 3, 5}, {1, 2, 0}},  // merged inner dims
                        {{}, {}, {}}};                      // 0-d
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const Case& c : cases) {
      const std::string what = absl::StrCat(Name(d), " block ", ShapeString(c.block), " of ", ShapeString(c.global));
      const Pair dst = EmptyBoth(c.block, d);
      const RandomSpec uniform{RandomSpec::Kind::kUniform, 1234, -0.5, 2.0};
      for (int side : {0, 1}) {
        ExpectOk((side ? Gpu() : Cpu())->FillRandom(dst[side], uniform, c.global, c.offset), what);
      }
      ExpectSame(dst, kExact, "uniform " + what);  // bit-identical
      const RandomSpec normal{RandomSpec::Kind::kNormal, 99, 0.5, 2.0};
      for (int side : {0, 1}) {
        ExpectOk((side ? Gpu() : Cpu())->FillRandom(dst[side], normal, c.global, c.offset), what);
      }
      // Normal values use the device's double log/cos: equal to the host's after rounding to
      // float in all but vanishingly rare cases; allow one float ulp.
      const std::vector<double> g = Vals(dst.gpu), h = Vals(dst.cpu);
      testing::ExpectNear(g, h, {d == DType::kFloat32 ? 2.4e-7 : 8e-3, 0.0}, "normal " + what);
      int64_t equal = 0;
      for (size_t i = 0; i < g.size(); ++i) equal += g[i] == h[i];
      EXPECT_GE(static_cast<double>(equal), 0.99 * static_cast<double>(g.size())) << "normal " << what;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------

constexpr BinaryOp kBinaryOps[] = {BinaryOp::kAdd, BinaryOp::kSub, BinaryOp::kMul,
                                   BinaryOp::kDiv, BinaryOp::kMax, BinaryOp::kMin};
constexpr DType kNumericDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kInt64};

Tolerance TolFor(DType d) { return IsInteger(d) ? kExact : testing::Tol(d); }

TEST(CudaKernelsTest, BinaryMatchesCpuWithBroadcastAndStrides) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Shape shape = {3, 5, 17};
  for (DType d : kNumericDTypes) {
    // a: [3, 1, 17] broadcast over dim 1 (stride 0), with a NaN for float dtypes; b: a
    // transposed layout with zeros (integer division by zero gives 0).
    Tensor a_host = HostRandom({3, 1, 17}, d, 1, -20.0, 20.0);
    if (IsComputeFloat(d)) ExpectOk(Fill_(Unwrap(Unwrap(a_host.Select(2, 4)).Select(0, 1)), std::nan("")), "NaN");
    const Pair a1 = Both(a_host);
    const Pair a{Unwrap(a1.cpu.Expand(shape)), Unwrap(a1.gpu.Expand(shape))};
    const Pair b = RandomNonContiguous(shape, d, 2, -4.0, 4.0);
    for (BinaryOp op : kBinaryOps) {
      const std::string what = absl::StrCat("binary op ", static_cast<int>(op), " ", Name(d));
      const Pair out = EmptyBoth(shape, d);
      for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Binary(op, a[side], b[side], out[side]), what);
      ExpectSame(out, TolFor(d), what);
    }
  }
}

TEST(CudaKernelsTest, BinaryScalarMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Shape shape = {7, 13};
  for (DType d : kNumericDTypes) {
    const Pair a = RandomNonContiguous(shape, d, 3, -9.0, 9.0);
    for (BinaryOp op : kBinaryOps) {
      for (double s : {2.0, -3.0, 0.0, 2.5}) {
        for (bool first : {false, true}) {
          const std::string what =
              absl::StrCat("scalar op ", static_cast<int>(op), " ", Name(d), " s ", s, first ? " first" : "");
          const Pair out = EmptyBoth(shape, d);
          for (int side : {0, 1}) {
            ExpectOk((side ? Gpu() : Cpu())->BinaryScalar(op, a[side], s, first, out[side]), what);
          }
          ExpectSame(out, TolFor(d), what);
        }
      }
    }
  }
}

constexpr UnaryOp kUnaryOps[] = {UnaryOp::kNeg,  UnaryOp::kExp,  UnaryOp::kLog,  UnaryOp::kSqrt, UnaryOp::kRsqrt,
                                 UnaryOp::kRelu, UnaryOp::kGelu, UnaryOp::kTanh, UnaryOp::kAbs,  UnaryOp::kSquare};

bool NeedsPositive(UnaryOp op) { return op == UnaryOp::kLog || op == UnaryOp::kSqrt || op == UnaryOp::kRsqrt; }

TEST(CudaKernelsTest, UnaryMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Shape shape = {3, 127};
  for (DType d : kNumericDTypes) {
    for (UnaryOp op : kUnaryOps) {
      const std::string what = absl::StrCat("unary op ", static_cast<int>(op), " ", Name(d));
      const Pair a =
          NeedsPositive(op) ? RandomNonContiguous(shape, d, 4, 0.05, 5.0) : RandomNonContiguous(shape, d, 4, -5.0, 5.0);
      const Pair out = EmptyBoth(shape, d);
      const absl::Status cpu = Cpu()->Unary(op, a.cpu, out.cpu);
      const absl::Status gpu = Gpu()->Unary(op, a.gpu, out.gpu);
      EXPECT_EQ(cpu.code(), gpu.code()) << what << ": cpu " << cpu << ", cuda " << gpu;
      if (!cpu.ok()) continue;  // an op integers do not have: both refuse
      ExpectSame(out, TolFor(d), what);
    }
  }
}

TEST(CudaKernelsTest, UnaryBackwardMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Shape shape = {5, 67};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (UnaryOp op : kUnaryOps) {
      const std::string what = absl::StrCat("unary backward op ", static_cast<int>(op), " ", Name(d));
      const Pair x = NeedsPositive(op) ? RandomBoth(shape, d, 5, 0.05, 5.0) : RandomBoth(shape, d, 5, -4.0, 4.0);
      const Pair dy = RandomBoth(shape, d, 6);
      const Pair dx = EmptyBoth(shape, d);
      for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->UnaryBackward(op, dy[side], x[side], dx[side]), what);
      ExpectSame(dx, testing::Tol(d), what);
    }
  }
}

// Tolerance for an AdamW-updated parameter. float32 as Tol. bfloat16 / float16: 1e-2 / 2e-3
// relative (the backends' float results round to values at most one step apart: 2^-7 / 2^-10
// of the value) and 1e-6 absolute. Tol's absolute 2e-2 / 4e-3 would pass a parameter the kernel
// never updated: a step with lr 1e-2 moves it by about 1e-2.
Tolerance ParamTol(DType d) {
  if (d == DType::kBFloat16) return {1e-2, 1e-6};
  if (d == DType::kFloat16) return {2e-3, 1e-6};
  return testing::Tol(d);
}

TEST(CudaKernelsTest, AdamWMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Shape shape = {1031};
  const std::pair<DType, DType> combos[] = {{DType::kFloat32, DType::kFloat32},
                                            {DType::kBFloat16, DType::kBFloat16},
                                            {DType::kBFloat16, DType::kFloat32},
                                            {DType::kFloat16, DType::kFloat16}};
  for (const auto& [pd, gd] : combos) {
    const std::string what = "adamw param " + Name(pd) + " grad " + Name(gd);
    const Pair param = RandomBoth(shape, pd, 7);
    const Pair m = RandomBoth(shape, DType::kFloat32, 8, -0.1, 0.1);
    const Pair v = RandomBoth(shape, DType::kFloat32, 9, 0.0, 0.01);
    AdamWParams hp;
    hp.lr = 1e-2f;
    hp.weight_decay = 0.1f;
    for (int64_t step = 1; step <= 3; ++step) {
      hp.step = step;
      const Pair grad = RandomBoth(shape, gd, 10 + static_cast<uint64_t>(step));
      for (int side : {0, 1})
        ExpectOk((side ? Gpu() : Cpu())->AdamW(param[side], grad[side], m[side], v[side], hp), what);
    }
    ExpectSame(param, ParamTol(pd), what + " param");
    ExpectSame(m, {1e-5, 1e-6}, what + " m");
    ExpectSame(v, {1e-5, 1e-7}, what + " v");
  }
}

// ---------------------------------------------------------------------------------------
// Reductions, softmax, normalisation
// ---------------------------------------------------------------------------------------

// The multi-tensor AdamW (64 parameters per launch, grouped by dtype pair and grad_scale)
// against the CPU's: 300 parameters of 4 dtype pairs (75 each), every pair with every size from
// 0 to 70001, their own steps, and a third of them with a gradient factor (two factors).
TEST(CudaKernelsTest, AdamWMultiMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const std::pair<DType, DType> combos[] = {{DType::kFloat32, DType::kFloat32},
                                            {DType::kBFloat16, DType::kBFloat16},
                                            {DType::kBFloat16, DType::kFloat32},
                                            {DType::kFloat16, DType::kFloat16}};
  const int64_t sizes[] = {1, 3, 0, 2047, 2048, 2049, 70001, 768};
  std::vector<Pair> params, grads, ms, vs;
  std::vector<AdamWTensors> cpu, gpu;
  const Tensor cpu_factors[] = {Unwrap(Full({1}, 0.37, DType::kFloat32)), Unwrap(Full({1}, 1e-3, DType::kFloat32))};
  const Tensor gpu_factors[] = {Unwrap(Full({1}, 0.37, DType::kFloat32, Device::Cuda(0))),
                                Unwrap(Full({1}, 1e-3, DType::kFloat32, Device::Cuda(0)))};
  for (int i = 0; i < 300; ++i) {
    const auto& [pd, gd] = combos[i % 4];
    const Shape shape = {sizes[(i / 4) % 8]};
    const uint64_t seed = 100 + 4 * static_cast<uint64_t>(i);
    params.push_back(RandomBoth(shape, pd, seed));
    grads.push_back(RandomBoth(shape, gd, seed + 1));
    ms.push_back(RandomBoth(shape, DType::kFloat32, seed + 2, -0.1, 0.1));
    vs.push_back(RandomBoth(shape, DType::kFloat32, seed + 3, 0.0, 0.01));
    const int64_t step = 1 + i % 5;
    cpu.push_back({params[i].cpu, grads[i].cpu, ms[i].cpu, vs[i].cpu, step});
    gpu.push_back({params[i].gpu, grads[i].gpu, ms[i].gpu, vs[i].gpu, step});
    // Every third entry also sums its gradient's squares (nn::AdamW::StepWithGradNorm).
    if (i % 3 == 0) gpu.back().grad_square_sum = Unwrap(Full({1}, -1.0, DType::kFloat32, Device::Cuda(0)));
    // Entries 100-199 read their gradients times a factor (clipping): one shared factor, and
    // every tenth another, which takes launches of its own.
    if (i >= 100 && i < 200) {
      const int which = i % 10 == 0 ? 1 : 0;
      cpu.back().grad_scale = cpu_factors[which];
      gpu.back().grad_scale = gpu_factors[which];
    }
  }
  AdamWParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  ExpectOk(Cpu()->AdamWMulti(cpu, hp), "cpu");
  ExpectOk(Gpu()->AdamWMulti(gpu, hp), "gpu");
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string what = absl::StrCat("adamw multi entry ", i, " ", Name(params[i].cpu.dtype()), " [",
                                          params[i].cpu.numel(), "] step ", cpu[i].step);
    if (gpu[i].grad_square_sum.defined()) {
      const double want = Vals(Unwrap(SumOfSquares(grads[i].cpu)))[0];
      EXPECT_NEAR(Vals(gpu[i].grad_square_sum)[0], want, 1e-6 * want) << what << " grad_square_sum";
    }
    ExpectSame(params[i], ParamTol(params[i].cpu.dtype()), what + " param");
    ExpectSame(ms[i], {1e-5, 1e-6}, what + " m");
    ExpectSame(vs[i], {1e-5, 1e-7}, what + " v");
  }
}

TEST(CudaKernelsTest, ReduceMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  struct Case {
    int64_t outer, reduce, inner;
  };
  const Case cases[] = {{1, 1, 1},    {3, 17, 1}, {5, 1000, 1}, {2, 1025, 1},  {2, 7, 13},     {1, 4099, 3},
                        {130, 5, 40}, {4, 0, 3},  {3, 0, 1},    {2, 70001, 1}, {1, 300007, 1}, {200, 33, 1}};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kInt32, DType::kInt64}) {
    for (const Case& c : cases) {
      const double range = IsInteger(d) ? 100.0 : 1.0;
      const Pair x = RandomBoth({c.outer, c.reduce, c.inner}, d, 11, -range, range);
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin}) {
        if (c.reduce == 0 && (op == ReduceOp::kMax || op == ReduceOp::kMin)) continue;
        const std::string what = absl::StrCat("reduce op ", static_cast<int>(op), " ", Name(d), " [", c.outer, ", ",
                                              c.reduce, ", ", c.inner, "]");
        const Pair out = EmptyBoth({c.outer, c.inner}, d);
        for (int side : {0, 1}) {
          ExpectOk((side ? Gpu() : Cpu())->Reduce(op, x[side], c.outer, c.reduce, c.inner, out[side]), what);
        }
        const bool sum = op == ReduceOp::kSum || op == ReduceOp::kMean;
        ExpectSame(out, d == DType::kFloat32 && sum ? kF32Sum : TolFor(d), what);
      }
    }
  }
  // NaN propagates through max and min.
  Tensor h = HostRandom({2, 33}, DType::kFloat32, 12);
  h.data<float>()[40] = std::nanf("");
  const Pair x = Both(h);
  for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
    const Pair out = EmptyBoth({2, 1}, DType::kFloat32);
    for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Reduce(op, x[side], 2, 33, 1, out[side]), "NaN");
    const std::vector<double> g = Vals(out.gpu);
    EXPECT_FALSE(std::isnan(g[0]));
    EXPECT_TRUE(std::isnan(g[1]));
  }
}

TEST(CudaKernelsTest, SoftmaxMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Shape shapes[] = {{1, 1}, {3, 17}, {5, 127}, {2, 1000}, {33, 5}, {2, 50257}};
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    for (const Shape& s : shapes) {
      for (bool log : {false, true}) {
        const std::string what = absl::StrCat(log ? "log_softmax " : "softmax ", Name(d), " ", ShapeString(s));
        const Pair x = RandomBoth(s, d, 13, -6.0, 6.0);
        const Pair y = EmptyBoth(s, d);
        for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Softmax(x[side], y[side], log), what);
        ExpectSame(y, d == DType::kFloat32 ? Tolerance{1e-5, 1e-6} : testing::Tol(d), what);
        const Pair dy = RandomBoth(s, d, 14);
        const Pair dx = EmptyBoth(s, d);
        for (int side : {0, 1})
          ExpectOk((side ? Gpu() : Cpu())->SoftmaxBackward(dy[side], y[side], dx[side], log), what);
        ExpectSame(dx, d == DType::kFloat32 ? kF32Sum : testing::Tol(d), what + " backward");
      }
    }
  }
  // Large and -inf logits stay finite where they should.
  const float inf = std::numeric_limits<float>::infinity();
  const Pair x = Both(Unwrap(
      Tensor::FromVector<float>(std::vector<float>{1000.0f, 1001.0f, -inf, 999.0f, -1e30f, 0.0f, 1.0f, -inf}, {2, 4})));
  for (bool log : {false, true}) {
    const Pair y = EmptyBoth({2, 4}, DType::kFloat32);
    for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Softmax(x[side], y[side], log), "special");
    ExpectSame(y, {1e-5, 1e-6}, log ? "log_softmax special" : "softmax special");
  }
  // A row holding NaN or +inf is NaN, as on the CPU, wherever the value falls (max_sum.h; the
  // online state's rules are checked on the CPU by MaxSumTest).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> special(3 * 300, 0.5f);
  special[17] = nan;
  special[300 + 299] = inf;
  special[600 + 5] = -inf;
  const Pair xs = Both(Unwrap(Tensor::FromVector<float>(special, {3, 300})));
  for (bool log : {false, true}) {
    const Pair y = EmptyBoth({3, 300}, DType::kFloat32);
    for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Softmax(xs[side], y[side], log), "NaN / inf");
    ExpectSame(y, {1e-5, 1e-6}, log ? "log_softmax NaN / inf rows" : "softmax NaN / inf rows");
  }
  const Pair t = Both(testing::FromDoubles({0, 1, 2}, {3}, DType::kInt64));
  const Pair losses = EmptyBoth({3}, DType::kFloat32), valid = EmptyBoth({3}, DType::kFloat32),
             lse = EmptyBoth({3}, DType::kFloat32);
  for (int side : {0, 1}) {
    ExpectOk((side ? Gpu() : Cpu())->CrossEntropy(xs[side], t[side], -100, losses[side], valid[side], lse[side]),
             "cross_entropy NaN / inf");
  }
  ExpectSame(lse, kF32Sum, "cross_entropy lse of NaN / inf rows");
  ExpectSame(losses, kF32Sum, "cross_entropy losses of NaN / inf rows");
}

TEST(CudaKernelsTest, LayerNormAndRmsNormMatchCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Shape shapes[] = {{1, 1}, {3, 17}, {17, 127}, {130, 768}, {5, 1025}};
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    const Tolerance tol = d == DType::kFloat32 ? kF32Sum : testing::Tol(d);
    for (const Shape& s : shapes) {
      const int64_t rows = s[0], c = s[1];
      const Pair x = RandomBoth(s, d, 15, -2.0, 3.0);
      const Pair w = RandomBoth({c}, d, 16, 0.5, 1.5);
      const Pair b = RandomBoth({c}, d, 17);
      const Pair dy = RandomBoth(s, d, 18);
      for (bool has_bias : {true, false}) {
        const std::string what = absl::StrCat("layernorm ", Name(d), " ", ShapeString(s), has_bias ? "" : " no bias");
        const Pair y = EmptyBoth(s, d), mean = EmptyBoth({rows}, DType::kFloat32),
                   rstd = EmptyBoth({rows}, DType::kFloat32);
        for (int side : {0, 1}) {
          ExpectOk(
              (side ? Gpu() : Cpu())
                  ->LayerNorm(x[side], w[side], has_bias ? b[side] : Tensor(), 1e-5f, y[side], mean[side], rstd[side]),
              what);
        }
        ExpectSame(y, tol, what + " y");
        ExpectSame(mean, kF32Sum, what + " mean");
        ExpectSame(rstd, kF32Sum, what + " rstd");
        const Pair dx = EmptyBoth(s, d), dw = EmptyBoth({c}, d), db = EmptyBoth({c}, d);
        for (int side : {0, 1}) {
          ExpectOk((side ? Gpu() : Cpu())
                       ->LayerNormBackward(dy[side], x[side], w[side], mean[side], rstd[side], dx[side], dw[side],
                                           has_bias ? db[side] : Tensor()),
                   what);
        }
        ExpectSame(dx, tol, what + " dx");
        ExpectSame(dw, tol, what + " dweight");
        if (has_bias) ExpectSame(db, tol, what + " dbias");
      }
      const std::string what = absl::StrCat("rmsnorm ", Name(d), " ", ShapeString(s));
      const Pair y = EmptyBoth(s, d), rstd = EmptyBoth({rows}, DType::kFloat32);
      for (int side : {0, 1})
        ExpectOk((side ? Gpu() : Cpu())->RmsNorm(x[side], w[side], 1e-6f, y[side], rstd[side]), what);
      ExpectSame(y, tol, what + " y");
      ExpectSame(rstd, kF32Sum, what + " rstd");
      const Pair dx = EmptyBoth(s, d), dw = EmptyBoth({c}, d);
      for (int side : {0, 1}) {
        ExpectOk((side ? Gpu() : Cpu())->RmsNormBackward(dy[side], x[side], w[side], rstd[side], dx[side], dw[side]),
                 what);
      }
      ExpectSame(dx, tol, what + " dx");
      ExpectSame(dw, tol, what + " dweight");
    }
  }
}

// ---------------------------------------------------------------------------------------
// Matrix multiply
// ---------------------------------------------------------------------------------------

// An operand [batch, rows, cols] in one of four layouts, the same on both devices.
enum class Layout { kRowMajor, kTransposed, kBatchBroadcast, kRowBroadcast };

Pair GemmOperand(int64_t batch, int64_t rows, int64_t cols, DType d, Layout layout, uint64_t seed) {
  switch (layout) {
    case Layout::kRowMajor:
      return RandomBoth({batch, rows, cols}, d, seed);
    case Layout::kTransposed: {
      const Pair base = RandomBoth({batch, cols, rows}, d, seed);
      return {Unwrap(base.cpu.Transpose(1, 2)), Unwrap(base.gpu.Transpose(1, 2))};
    }
    case Layout::kBatchBroadcast: {  // batch stride 0
      const Pair base = RandomBoth({1, rows, cols}, d, seed);
      const Shape shape = {batch, rows, cols};
      return {Unwrap(base.cpu.Expand(shape)), Unwrap(base.gpu.Expand(shape))};
    }
    case Layout::kRowBroadcast: {  // row stride 0: BLAS cannot read it, the backend packs it
      const Pair base = RandomBoth({batch, 1, cols}, d, seed);
      const Shape shape = {batch, rows, cols};
      return {Unwrap(base.cpu.Expand(shape)), Unwrap(base.gpu.Expand(shape))};
    }
  }
  return {};
}

TEST(CudaKernelsTest, GemmMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  struct Case {
    int64_t batch, m, n, k;
  };
  const Case cases[] = {{1, 1, 1, 1}, {1, 3, 17, 5}, {3, 17, 13, 127}, {2, 127, 33, 64}, {1, 64, 1, 7}, {2, 5, 7, 0}};
  const Layout layouts[] = {Layout::kRowMajor, Layout::kTransposed, Layout::kBatchBroadcast, Layout::kRowBroadcast};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const Tolerance tol = d == DType::kFloat32 ? kF32Sum : testing::Tol(d);
    for (const Case& c : cases) {
      for (Layout la : layouts) {
        for (Layout lb : layouts) {
          const Pair a = GemmOperand(c.batch, c.m, c.k, d, la, 19);
          const Pair b = GemmOperand(c.batch, c.k, c.n, d, lb, 20);
          for (const auto& [alpha, beta] : {std::pair{1.0f, 0.0f}, std::pair{0.5f, 2.0f}}) {
            const std::string what =
                absl::StrCat("gemm ", Name(d), " b", c.batch, " m", c.m, " n", c.n, " k", c.k, " layouts ",
                             static_cast<int>(la), static_cast<int>(lb), " alpha ", alpha, " beta ", beta);
            const Pair cc = RandomBoth({c.batch, c.m, c.n}, d, 21);
            if (beta == 0.0f) {  // beta 0 ignores the old contents, NaN included
              for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->Fill(cc[side], std::nan("")), what);
            }
            for (int side : {0, 1})
              ExpectOk((side ? Gpu() : Cpu())->Gemm(a[side], b[side], cc[side], alpha, beta), what);
            ExpectSame(cc, tol, what);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Embedding and cross-entropy
// ---------------------------------------------------------------------------------------

// GemmBias (cuBLASLt's bias / bias + GELU epilogues, or the unfused fallback where cuBLASLt
// declines: N not a multiple of 8 with GELU, K = 0) against the CPU's unfused computation, on
// row-major and transposed operands. The fused path adds the bias before its one rounding, so
// bfloat16 / float16 results may differ from the CPU's (which rounds the product first) by an ulp.
TEST(CudaKernelsTest, GemmBiasMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  struct Case {
    int64_t m, n, k;
  };
  const Case cases[] = {{1, 8, 1}, {5, 3, 7}, {64, 3072, 768}, {130, 2304, 768}, {33, 40, 0}, {256, 768, 3072}};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const Tolerance tol = d == DType::kFloat32 ? kF32Sum : testing::Tol(d);
    for (const Case& c : cases) {
      for (Layout la : {Layout::kRowMajor, Layout::kTransposed}) {
        for (bool gelu : {false, true}) {
          const std::string what = absl::StrCat("gemm_bias ", Name(d), " m", c.m, " n", c.n, " k", c.k, " a layout ",
                                                static_cast<int>(la), gelu ? " gelu" : "");
          const Pair a3 = GemmOperand(1, c.m, c.k, d, la, 51);
          const Pair b3 = GemmOperand(1, c.k, c.n, d, Layout::kTransposed, 52);  // w^T, as Linear passes it
          const Pair a = {Unwrap(a3.cpu.Select(0, 0)), Unwrap(a3.gpu.Select(0, 0))};
          const Pair b = {Unwrap(b3.cpu.Select(0, 0)), Unwrap(b3.gpu.Select(0, 0))};
          const Pair bias = RandomBoth({c.n}, d, 53);
          const Pair out = EmptyBoth({c.m, c.n}, d), pre = EmptyBoth({c.m, c.n}, d);
          for (int side : {0, 1}) {
            ExpectOk((side ? Gpu() : Cpu())->GemmBias(a[side], b[side], bias[side], gelu, out[side], pre[side]), what);
          }
          ExpectSame(out, tol, what + " out");
          if (gelu) ExpectSame(pre, tol, what + " pre");
          // Where cuBLASLt surely takes the problem (16-bit dtypes, N a multiple of 8, a GPT-2
          // sized product) the fused path must have run: it adds the bias (and applies GELU)
          // before its one rounding where the unfused default rounds the product first, so some
          // elements differ from the default's on this GPU.
          if (d != DType::kFloat32 && c.m * c.n >= 65536 && c.n % 8 == 0) {
            const Tensor uout = Unwrap(Tensor::Empty({c.m, c.n}, d, Device::Cuda(0)));
            const Tensor upre = Unwrap(Tensor::Empty({c.m, c.n}, d, Device::Cuda(0)));
            ExpectOk(Gpu()->Kernels::GemmBias(a.gpu, b.gpu, bias.gpu, gelu, uout, upre), what + " unfused");
            EXPECT_GT(Differing(Vals(out.gpu), Vals(uout)), 0)
                << what << ": bit for bit the unfused default's: cuBLASLt's epilogue did not run (libcublasLt "
                << "missing, or its heuristic declined the problem)";
          }
        }
      }
    }
  }
}

// |gpu - cpu| <= tol.rtol * |cpu| + tol.atol + slack * mag[i] for every element: sums whose
// terms the two backends round differently (mag[i]: the sum of the terms' magnitudes).
void ExpectSumNear(const Pair& p, const std::vector<double>& mag, Tolerance tol, double slack,
                   const std::string& what) {
  const std::vector<double> g = Vals(p.gpu), c = Vals(p.cpu);
  ASSERT_EQ(g.size(), c.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!(std::fabs(g[i] - c[i]) <= tol.rtol * std::fabs(c[i]) + tol.atol + slack * mag[i]) && bad++ < 5) {
      ADD_FAILURE() << what << ": element " << i << " is " << g[i] << " on the GPU, " << c[i] << " on the CPU";
    }
  }
}

// Per column j of a row-major [rows, cols] tensor: the sum of |t[:, j]|.
std::vector<double> ColumnMagnitudes(const Tensor& t) {
  const std::vector<double> v = Vals(t);
  const int64_t rows = t.size(0), cols = t.size(1);
  std::vector<double> mag(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) mag[static_cast<size_t>(j)] += std::fabs(v[static_cast<size_t>(r * cols + j)]);
  }
  return mag;
}

// The rounding step of `d` (float32: 2^-24; bfloat16: 2^-8; float16: 2^-11), for ExpectSumNear.
double Ulp(DType d) { return d == DType::kBFloat16 ? 0x1p-8 : d == DType::kFloat16 ? 0x1p-11 : 0x1p-24; }

// GemmBiasGrad (cuBLASLt's BGRADB epilogue: nn.Linear's weight gradient dy^T x with the bias
// gradient, the column sums of dy, from one matrix multiply; the unfused fallback where
// cuBLASLt declines) against the CPU's Gemm + Reduce. dw within the GEMM tolerances
// (float32 1e-4, bfloat16 2e-2, float16 4e-3 relative and absolute); db within those plus one
// rounding step of the dtype times the sum of |dy| over the column (the backends may sum the
// M rows in another order).
TEST(CudaKernelsTest, GemmBiasGradMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  struct Case {
    int64_t rows, out, in;
  };
  const Case cases[] = {{1, 8, 8}, {5, 3, 7}, {256, 768, 3072}, {130, 2304, 768}, {512, 3072, 768}};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const Tolerance tol = d == DType::kFloat32 ? kF32Sum : testing::Tol(d);
    for (const Case& c : cases) {
      for (Layout ldy : {Layout::kRowMajor, Layout::kTransposed}) {
        const std::string what = absl::StrCat("gemm_bias_grad ", Name(d), " rows", c.rows, " out", c.out, " in", c.in,
                                              " dy layout ", static_cast<int>(ldy));
        const Pair dy3 = GemmOperand(1, c.rows, c.out, d, ldy, 61);
        const Pair x3 = GemmOperand(1, c.rows, c.in, d, Layout::kRowMajor, 62);
        // a = dy^T [out, rows] (a transposed view of a row-major dy), b = x [rows, in].
        const Pair a = {Unwrap(Unwrap(dy3.cpu.Select(0, 0)).Transpose(0, 1)),
                        Unwrap(Unwrap(dy3.gpu.Select(0, 0)).Transpose(0, 1))};
        const Pair b = {Unwrap(x3.cpu.Select(0, 0)), Unwrap(x3.gpu.Select(0, 0))};
        const Pair dw = EmptyBoth({c.out, c.in}, d), db = EmptyBoth({c.out}, d);
        for (int side : {0, 1}) {
          ExpectOk((side ? Gpu() : Cpu())->GemmBiasGrad(a[side], b[side], dw[side], db[side]), what);
        }
        ExpectSame(dw, tol, what + " dw");
        const Tensor dy_cpu = Unwrap(Contiguous(Unwrap(dy3.cpu.Select(0, 0))));
        ExpectSumNear(db, ColumnMagnitudes(dy_cpu), tol, Ulp(d), what + " db");
      }
    }
  }
}

// AddLayerNorm (one kernel: x1 = x + h, then LayerNorm of x1) against the CPU's fused loop and
// against this GPU's own Add then LayerNorm (the Kernels default); and its backward
// LayerNormBackwardAdd against the CPU's. x1 is one rounded add on
// both devices: exact. y: float32 within kF32Sum; bfloat16 within testing::Tol's 2e-2 relative
// and absolute (a few ulps of its 8-bit mantissa), float16 within 4e-3: the statistics are
// summed in another order than the CPU's, which can move a rounding of y by an ulp. mean and
// rstd are float32 sums: kF32Sum.
TEST(CudaKernelsTest, AddLayerNormMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  // {8200, 40}: more rows than 128 splits of 64, so the weight/bias sums take 65 rows per split
  // and their last split is empty.
  const Shape shapes[] = {{1, 1}, {3, 17}, {17, 127}, {130, 768}, {5, 1025}, {64, 3072}, {8200, 40}};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const Tolerance tol = d == DType::kFloat32 ? kF32Sum : testing::Tol(d);
    for (const Shape& s : shapes) {
      const int64_t rows = s[0], c = s[1];
      const Pair x = RandomBoth(s, d, 61, -2.0, 3.0), h = RandomBoth(s, d, 62, -1.0, 1.0);
      const Pair w = RandomBoth({c}, d, 63, 0.5, 1.5), b = RandomBoth({c}, d, 64);
      for (bool has_bias : {true, false}) {
        const std::string what =
            absl::StrCat("add_layernorm ", Name(d), " ", ShapeString(s), has_bias ? "" : " no bias");
        const Pair x1 = EmptyBoth(s, d), y = EmptyBoth(s, d), mean = EmptyBoth({rows}, DType::kFloat32),
                   rstd = EmptyBoth({rows}, DType::kFloat32);
        for (int side : {0, 1}) {
          ExpectOk((side ? Gpu() : Cpu())
                       ->AddLayerNorm(x[side], h[side], w[side], has_bias ? b[side] : Tensor(), 1e-5f, x1[side],
                                      y[side], mean[side], rstd[side]),
                   what);
        }
        ExpectSame(x1, kExact, what + " x1");
        ExpectSame(y, tol, what + " y");
        ExpectSame(mean, kF32Sum, what + " mean");
        ExpectSame(rstd, kF32Sum, what + " rstd");
        // The GPU's unfused default (Binary, then the LayerNorm kernel) on the same inputs.
        const Tensor ux1 = EmptyBoth(s, d).gpu, uy = EmptyBoth(s, d).gpu;
        const Tensor um = EmptyBoth({rows}, DType::kFloat32).gpu, ur = EmptyBoth({rows}, DType::kFloat32).gpu;
        ExpectOk(Gpu()->Kernels::AddLayerNorm(x.gpu, h.gpu, w.gpu, has_bias ? b.gpu : Tensor(), 1e-5f, ux1, uy, um, ur),
                 what + " unfused");
        testing::ExpectNear(Vals(x1.gpu), Vals(ux1), kExact, what + " x1 vs unfused");
        testing::ExpectNear(Vals(y.gpu), Vals(uy), tol, what + " y vs unfused");
        testing::ExpectNear(Vals(mean.gpu), Vals(um), kF32Sum, what + " mean vs unfused");
        testing::ExpectNear(Vals(rstd.gpu), Vals(ur), kF32Sum, what + " rstd vs unfused");
        // The backward with the residual's gradient added in the same pass (LayerNormBackwardAdd),
        // on the CPU's saved statistics: dx as LayerNorm's dx (tol), dweight/dbias sums (tol).
        const Pair dy = RandomBoth(s, d, 65), dres = RandomBoth(s, d, 66);
        const Pair dx = EmptyBoth(s, d), dw = EmptyBoth({c}, d), db = EmptyBoth({c}, d);
        const Pair smean = Both(mean.cpu), srstd = Both(rstd.cpu);
        for (int side : {0, 1}) {
          ExpectOk((side ? Gpu() : Cpu())
                       ->LayerNormBackwardAdd(dy[side], x1[side], w[side], smean[side], srstd[side], dres[side],
                                              dx[side], dw[side], has_bias ? db[side] : Tensor()),
                   what + " backward");
        }
        ExpectSame(dx, tol, what + " dx");
        ExpectSame(dw, tol, what + " dweight");
        if (has_bias) ExpectSame(db, tol, what + " dbias");
      }
    }
  }
}

// GemmDgelu (cuBLASLt's DGELU_BGRAD epilogue: an MLP's pre-activation gradient
// (dy w) * gelu'(pre) and its column sums from c_proj's input-gradient matrix multiply; the
// unfused fallback where cuBLASLt declines: a pre-activation width not a multiple of 8) against
// the CPU's Gemm + UnaryBackward + Reduce. The fused path multiplies by gelu' before its one
// rounding (the CPU rounds the product first), so bfloat16 / float16 may differ by an ulp or
// two: dpre within the GEMM tolerances; db as GemmBiasGrad's (the sum of |dpre| per column).
TEST(CudaKernelsTest, GemmDgeluMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  struct Case {
    int64_t rows, out, hidden;  // dy [rows, out], w [out, hidden], pre [rows, hidden]
  };
  const Case cases[] = {{1, 8, 8}, {5, 3, 7}, {64, 768, 3072}, {130, 768, 3072}, {256, 1024, 4096}};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const Tolerance tol = d == DType::kFloat32 ? kF32Sum : testing::Tol(d);
    for (const Case& c : cases) {
      const std::string what =
          absl::StrCat("gemm_dgelu ", Name(d), " rows", c.rows, " out", c.out, " hidden", c.hidden);
      const Pair a3 = GemmOperand(1, c.rows, c.out, d, Layout::kRowMajor, 71);
      const Pair b3 = GemmOperand(1, c.out, c.hidden, d, Layout::kRowMajor, 72);  // w [out, hidden], as Linear's dx
      const Pair a = {Unwrap(a3.cpu.Select(0, 0)), Unwrap(a3.gpu.Select(0, 0))};
      const Pair b = {Unwrap(b3.cpu.Select(0, 0)), Unwrap(b3.gpu.Select(0, 0))};
      const Pair pre = RandomBoth({c.rows, c.hidden}, d, 73, -3.0, 3.0);
      const Pair dpre = EmptyBoth({c.rows, c.hidden}, d), db = EmptyBoth({c.hidden}, d);
      for (int side : {0, 1}) {
        ExpectOk((side ? Gpu() : Cpu())->GemmDgelu(a[side], b[side], pre[side], dpre[side], db[side]), what);
      }
      ExpectSame(dpre, tol, what + " dpre");
      ExpectSumNear(db, ColumnMagnitudes(dpre.cpu), tol, 2 * Ulp(d), what + " db");
      // Whether cuBLASLt's DGELU_BGRAD ran (it may decline a layout; the results are right either
      // way): the fused dpre rounds once, the unfused default rounds the product first. Printed,
      // not asserted, for the GPU run's log.
      if (d != DType::kFloat32 && c.hidden % 8 == 0 && c.rows * c.hidden >= 65536) {
        const Tensor udpre = Unwrap(Tensor::Empty({c.rows, c.hidden}, d, Device::Cuda(0)));
        const Tensor udb = Unwrap(Tensor::Empty({c.hidden}, d, Device::Cuda(0)));
        ExpectOk(Gpu()->Kernels::GemmDgelu(a.gpu, b.gpu, pre.gpu, udpre, udb), what + " unfused");
        const int64_t n = Differing(Vals(dpre.gpu), Vals(udpre));
        std::cout << "[   INFO   ] " << what << ": " << (n > 0 ? "fused (DGELU_BGRAD)" : "unfused (cuBLASLt declined)")
                  << ", " << n << " of " << c.rows * c.hidden << " elements differ from the unfused default\n";
      }
    }
  }
}

TEST(CudaKernelsTest, EmbeddingMatchesCpuAndZeroesOutOfRangeIds) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const int64_t v = 11, c = 7;
  const std::vector<double> ids_in = {3, 0, 10, -1, 11, 5, 5, 100, 3, 3, 9, 1, 0, 10, 2, 7, 3};
  const int64_t n = static_cast<int64_t>(ids_in.size());
  std::vector<double> ids_valid = ids_in;  // for the CPU, which rejects out-of-range ids
  std::vector<bool> bad(ids_in.size());
  for (size_t i = 0; i < ids_in.size(); ++i) {
    bad[i] = ids_in[i] < 0 || ids_in[i] >= v;
    if (bad[i]) ids_valid[i] = 0;
  }
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    for (DType id : {DType::kInt32, DType::kInt64}) {
      const std::string what = "embedding " + Name(d) + " ids " + Name(id);
      const Pair w = RandomBoth({v, c}, d, 22);
      const Tensor ids_gpu = ToGpu(testing::FromDoubles(ids_in, {n}, id));
      const Tensor ids_cpu = testing::FromDoubles(ids_valid, {n}, id);
      EXPECT_FALSE(
          Cpu()->Embedding(w.cpu, testing::FromDoubles(ids_in, {n}, id), Unwrap(Tensor::Empty({n, c}, d))).ok());
      const Pair out = EmptyBoth({n, c}, d);
      ExpectOk(Cpu()->Embedding(w.cpu, ids_cpu, out.cpu), what);
      ExpectOk(Gpu()->Embedding(w.gpu, ids_gpu, out.gpu), what);
      const std::vector<double> g = Vals(out.gpu), h = Vals(out.cpu);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < c; ++j) {
          EXPECT_EQ(g[r * c + j], bad[r] ? 0.0 : h[r * c + j]) << what << " row " << r << " col " << j;
        }
      }
      // Backward: scatter-add of repeated ids into an accumulating dweight; both backends skip
      // out-of-range ids.
      for (DType gd : {d, DType::kFloat32}) {
        const Pair dout = RandomBoth({n, c}, gd, 23);
        const Pair dw = RandomBoth({v, c}, d, 24);
        const Tensor ids_raw = testing::FromDoubles(ids_in, {n}, id);
        ExpectOk(Cpu()->EmbeddingBackward(dout.cpu, ids_raw, dw.cpu), what);
        ExpectOk(Gpu()->EmbeddingBackward(dout.gpu, ids_gpu, dw.gpu), what);
        ExpectSame(dw, d == DType::kFloat32 ? kF32Sum : testing::Tol(d), what + " backward dout " + Name(gd));
      }
    }
  }
}

// Tolerance for dlogits. float32: 1e-5 relative. bfloat16: 1e-2 relative (two backends'
// float values round to bfloat16 values at most one step apart, 2^-7 of the value) with a
// negligible absolute term: Tol(bfloat16)'s absolute 2e-2 would pass every element of a wide row
// but the target's (all of them below 3e-4 for V = 50257 and logits in [-8, 8]) whatever the
// kernel wrote there.
Tolerance DlogitsTol(DType d) { return d == DType::kFloat32 ? Tolerance{1e-5, 1e-7} : Tolerance{1e-2, 1e-12}; }

TEST(CudaKernelsTest, CrossEntropyMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const int64_t ignore = -100;
  for (int64_t v : {int64_t{1}, int64_t{17}, int64_t{50257}}) {
    std::vector<double> targets = {0, static_cast<double>(v - 1), -100, static_cast<double>(v / 2), 0};
    const int64_t n = static_cast<int64_t>(targets.size());
    for (DType d : {DType::kFloat32, DType::kBFloat16}) {
      for (DType td : {DType::kInt32, DType::kInt64}) {
        const std::string what = absl::StrCat("cross_entropy ", Name(d), " targets ", Name(td), " V ", v);
        const Pair logits = RandomBoth({n, v}, d, 25, -8.0, 8.0);
        const Pair t = Both(testing::FromDoubles(targets, {n}, td));
        const Pair losses = EmptyBoth({n}, DType::kFloat32), valid = EmptyBoth({n}, DType::kFloat32),
                   lse = EmptyBoth({n}, DType::kFloat32);
        for (int side : {0, 1}) {
          ExpectOk(
              (side ? Gpu() : Cpu())->CrossEntropy(logits[side], t[side], ignore, losses[side], valid[side], lse[side]),
              what);
        }
        ExpectSame(losses, kF32Sum, what + " losses");
        ExpectSame(valid, kExact, what + " valid");
        ExpectSame(lse, kF32Sum, what + " lse");
        for (bool broadcast : {false, true}) {
          const Pair grad = broadcast
                                ? Pair{Unwrap(Unwrap(Full({1}, 0.25, DType::kFloat32)).Expand({n})),
                                       Unwrap(Unwrap(Full({1}, 0.25, DType::kFloat32, Device::Cuda(0))).Expand({n}))}
                                : RandomBoth({n}, DType::kFloat32, 26);
          const Pair dl = EmptyBoth({n, v}, d);
          for (int side : {0, 1}) {
            ExpectOk((side ? Gpu() : Cpu())
                         ->CrossEntropyBackward(logits[side], t[side], lse[side], grad[side], ignore, dl[side]),
                     what);
          }
          ExpectSame(dl, DlogitsTol(d), what + (broadcast ? " backward (broadcast grad)" : " backward"));
        }
      }
    }
  }
  // CUDA treats a target outside [0, V) as ignored (the CPU rejects it).
  const Tensor logits = ToGpu(HostRandom({3, 9}, DType::kFloat32, 27));
  const Tensor t = ToGpu(testing::FromDoubles({9, -5, 2}, {3}, DType::kInt64));
  Tensor losses = Unwrap(Tensor::Empty({3}, DType::kFloat32, Device::Cuda(0)));
  Tensor valid = Unwrap(Tensor::Empty({3}, DType::kFloat32, Device::Cuda(0)));
  Tensor lse = Unwrap(Tensor::Empty({3}, DType::kFloat32, Device::Cuda(0)));
  ExpectOk(Gpu()->CrossEntropy(logits, t, ignore, losses, valid, lse), "out of range");
  EXPECT_EQ(Vals(valid), (std::vector<double>{0, 0, 1}));
  const std::vector<double> l = Vals(losses);
  EXPECT_EQ(l[0], 0.0);
  EXPECT_EQ(l[1], 0.0);
  EXPECT_GT(l[2], 0.0);
  Tensor dl = Unwrap(Tensor::Empty({3, 9}, DType::kFloat32, Device::Cuda(0)));
  Tensor grad = Unwrap(Full({3}, 1.0, DType::kFloat32, Device::Cuda(0)));
  ExpectOk(Gpu()->CrossEntropyBackward(logits, t, lse, grad, ignore, dl), "out of range backward");
  const std::vector<double> g = Vals(dl);
  for (int j = 0; j < 18; ++j) EXPECT_EQ(g[j], 0.0) << "ignored rows get zero gradient, element " << j;
}

// The fused classifier (loss and gradient from one visit of each row), CountTargets and
// ScaleByRatio against the CPU backend.
TEST(CudaKernelsTest, CrossEntropyWithGradMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const int64_t ignore = -100;
  for (int64_t v : {int64_t{1}, int64_t{17}, int64_t{50257}, int64_t{50304}}) {
    std::vector<double> targets = {0, static_cast<double>(v - 1), -100, static_cast<double>(v / 2), 0};
    const int64_t n = static_cast<int64_t>(targets.size());
    for (DType d : {DType::kFloat32, DType::kBFloat16}) {
      for (DType td : {DType::kInt32, DType::kInt64}) {
        const std::string what = absl::StrCat("cross_entropy_with_grad ", Name(d), " targets ", Name(td), " V ", v);
        const Pair logits = RandomBoth({n, v}, d, 28, -8.0, 8.0);
        const Pair t = Both(testing::FromDoubles(targets, {n}, td));
        const Pair count = EmptyBoth({}, DType::kFloat32);
        for (int side : {0, 1}) ExpectOk((side ? Gpu() : Cpu())->CountTargets(t[side], ignore, v, count[side]), what);
        ExpectSame(count, kExact, what + " count");
        const Pair grad = RandomBoth({n}, DType::kFloat32, 29);
        const Pair losses = EmptyBoth({n}, DType::kFloat32), dl = EmptyBoth({n, v}, d);
        for (int side : {0, 1}) {
          ExpectOk((side ? Gpu() : Cpu())
                       ->CrossEntropyWithGrad(logits[side], t[side], ignore, grad[side], losses[side], dl[side]),
                   what);
        }
        ExpectSame(losses, kF32Sum, what + " losses");
        ExpectSame(dl, DlogitsTol(d), what + " dlogits");
        // x *= 3/4, then num == den (0 / 0): untouched.
        const Pair num = Both(testing::FromDoubles({3.0}, {}, DType::kFloat32));
        const Pair den = Both(testing::FromDoubles({4.0}, {}, DType::kFloat32));
        const Pair zero = Both(testing::FromDoubles({0.0}, {}, DType::kFloat32));
        for (int side : {0, 1}) {
          ExpectOk((side ? Gpu() : Cpu())->ScaleByRatio(dl[side], num[side], den[side]), what + " scale");
          ExpectOk((side ? Gpu() : Cpu())->ScaleByRatio(dl[side], zero[side], zero[side]), what + " no scale");
        }
        ExpectSame(dl, DlogitsTol(d), what + " dlogits * 3/4");
      }
    }
  }
  // CUDA does not count a target outside [0, V) (the CPU rejects it).
  const Tensor t = ToGpu(testing::FromDoubles({9, -5, 2, -100}, {4}, DType::kInt64));
  Tensor count = Unwrap(Tensor::Empty({}, DType::kFloat32, Device::Cuda(0)));
  ExpectOk(Gpu()->CountTargets(t, ignore, 9, count), "out of range");
  EXPECT_EQ(Vals(count), (std::vector<double>{1}));
}

// ---------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------

TEST(CudaKernelsTest, CausalAttentionMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  struct Case {
    int64_t b, h, t, d;
  };
  const Case cases[] = {{1, 1, 1, 16}, {2, 3, 17, 64}, {1, 2, 70, 33}, {2, 1, 45, 128}, {1, 1, 33, 1}};
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const Tolerance tol = dt == DType::kFloat32 ? kF32Sum : testing::Tol(dt);
    for (const Case& c : cases) {
      const std::string what = absl::StrCat("attention ", Name(dt), " [", c.b, ", ", c.h, ", ", c.t, ", ", c.d, "]");
      const Shape shape = {c.b, c.h, c.t, c.d};
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
      const Pair q = RandomBoth(shape, dt, 28, -2.0, 2.0), k = RandomBoth(shape, dt, 29, -2.0, 2.0),
                 v = RandomBoth(shape, dt, 30);
      const Pair out = EmptyBoth(shape, dt), lse = EmptyBoth({c.b, c.h, c.t}, DType::kFloat32);
      for (int side : {0, 1}) {
        ExpectOk((side ? Gpu() : Cpu())->CausalAttention(q[side], k[side], v[side], scale, out[side], lse[side]), what);
      }
      ExpectSame(out, tol, what + " out");
      ExpectSame(lse, kF32Sum, what + " lse");
      const Pair dout = RandomBoth(shape, dt, 31);
      const Pair dq = EmptyBoth(shape, dt), dk = EmptyBoth(shape, dt), dv = EmptyBoth(shape, dt);
      for (int side : {0, 1}) {
        ExpectOk((side ? Gpu() : Cpu())
                     ->CausalAttentionBackward(dout[side], q[side], k[side], v[side], out[side], lse[side], scale,
                                               dq[side], dk[side], dv[side]),
                 what);
      }
      ExpectSame(dq, tol, what + " dq");
      ExpectSame(dk, tol, what + " dk");
      ExpectSame(dv, tol, what + " dv");
    }
  }
  // A head dim the kernels do not support is an error naming it.
  const Shape big = {1, 1, 4, 160};
  const Tensor q = Unwrap(Zeros(big, DType::kFloat32, Device::Cuda(0)));
  const Tensor out = Unwrap(Tensor::Empty(big, DType::kFloat32, Device::Cuda(0)));
  const Tensor lse = Unwrap(Tensor::Empty({1, 1, 4}, DType::kFloat32, Device::Cuda(0)));
  const absl::Status s = Gpu()->CausalAttention(q, q, q, 1.0f, out, lse);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("160"), std::string::npos) << s;
}

struct AttentionCase {
  int64_t b, h, t, d;
};

// Runs attention forward and backward on the CPU and on the GPU (whichever kernels
// DTENSOR_CUDA_ATTENTION picks there) on the same inputs and holds the GPU's out, lse, dq, dk,
// dv to the CPU's float32 computation: the tensor-core kernels (dtensor's flash kernels and
// cuDNN's) round P and dS to the input dtype before their products (as FlashAttention does), so
// they are held to the tensor's relative L2 error (1e-2 bfloat16, 2e-3 float16) and to an
// elementwise bound scaled by the largest reference value. With T = 1 the exact dq and dk are
// zero (dS = P (dP - delta) with P = 1 and delta = dP): both backends give only the rounding
// noise of dP - delta there, which no relative bound can hold, so they are held to |x| <= 1e-3
// instead. Returns the GPU's out and dq.
std::pair<std::vector<double>, std::vector<double>> CheckAttentionAgainstCpu(DType dt, const AttentionCase& c,
                                                                             const std::string& what) {
  const double norm_tol = dt == DType::kBFloat16 ? 1e-2 : 2e-3;
  const Shape shape = {c.b, c.h, c.t, c.d};
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  const Pair q = RandomBoth(shape, dt, 41, -2.0, 2.0), k = RandomBoth(shape, dt, 42, -2.0, 2.0),
             v = RandomBoth(shape, dt, 43), dout = RandomBoth(shape, dt, 44);
  const Pair out = EmptyBoth(shape, dt), lse = EmptyBoth({c.b, c.h, c.t}, DType::kFloat32);
  const Pair dq = EmptyBoth(shape, dt), dk = EmptyBoth(shape, dt), dv = EmptyBoth(shape, dt);
  for (int side : {0, 1}) {
    Kernels* kern = side ? Gpu() : Cpu();
    ExpectOk(kern->CausalAttention(q[side], k[side], v[side], scale, out[side], lse[side]), what);
    ExpectOk(kern->CausalAttentionBackward(dout[side], q[side], k[side], v[side], out[side], lse[side], scale, dq[side],
                                           dk[side], dv[side]),
             what);
  }
  ExpectOk(Gpu()->Synchronize(), what);
  for (const auto& [name, p] :
       {std::pair<const char*, const Pair*>{"out", &out}, {"lse", &lse}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
    const std::vector<double> got = Vals(p->gpu), want = Vals(p->cpu);
    if (c.t == 1 && (p == &dq || p == &dk)) {  // exactly zero: rounding noise on both sides
      testing::ExpectNear(got, std::vector<double>(got.size(), 0.0), Tolerance{0.0, 1e-3}, what + " " + name);
      testing::ExpectNear(want, std::vector<double>(want.size(), 0.0), Tolerance{0.0, 1e-3},
                          what + " " + name + " (cpu)");
      continue;
    }
    double peak = 0;
    for (double x : want) peak = std::max(peak, std::fabs(x));
    testing::ExpectNormNear(got, want, norm_tol, what + " " + name);
    testing::ExpectNear(got, want, Tolerance{0.0, 5 * norm_tol * peak}, what + " " + name);
  }
  return {Vals(out.gpu), Vals(dq.gpu)};
}

// dtensor's tensor-core kernels (flash_attention.cu: bfloat16 / float16, D = 64, and D = 128
// forward; DTENSOR_CUDA_ATTENTION=flash) and the simple ones (=simple) on the same inputs, each
// against the CPU (CheckAttentionAgainstCpu). The tensor-core kernels must really have run:
// where T >= 64, out (and dq for D = 64) differ from the simple kernels' somewhere (P rounded to
// the dtype or not), else flash mode silently took the simple kernels and checked nothing new
// (the build's architectures, 80 and 90, are all ones FlashAttentionSupported takes).
TEST(CudaKernelsTest, FlashAttentionMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  // One 64-row tile and less, several with a ragged end, GPT-2's T = 1024, D = 128.
  const AttentionCase cases[] = {{1, 1, 1, 64}, {1, 2, 64, 64}, {2, 3, 130, 64}, {1, 2, 1024, 64}, {1, 2, 200, 128}};
  struct Mode {
    const char* env;  // DTENSOR_CUDA_ATTENTION
    const char* name;
  };
  // The flash mode's out and dq per (dtype, case), compared with the simple kernels' below.
  std::vector<std::vector<double>> flash_out, flash_dq;
  for (const Mode mode : {Mode{"flash", "tensor cores"}, Mode{"simple", "simple kernels"}}) {
    ASSERT_EQ(setenv("DTENSOR_CUDA_ATTENTION", mode.env, 1), 0);
    const bool simple = std::strcmp(mode.env, "simple") == 0;
    size_t run = 0;
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      for (const AttentionCase& c : cases) {
        const std::string what =
            absl::StrCat("attention (", mode.name, ") ", Name(dt), " [", c.b, ", ", c.h, ", ", c.t, ", ", c.d, "]");
        const auto [out, dq] = CheckAttentionAgainstCpu(dt, c, what);
        if (!simple) {
          flash_out.push_back(out);
          flash_dq.push_back(dq);
        } else if (c.t >= 64) {
          EXPECT_GT(Differing(out, flash_out[run]), 0)
              << what
              << ": flash mode's out equals the simple kernels' bit for bit: the tensor-core forward did not run";
          if (c.d == 64) {
            EXPECT_GT(Differing(dq, flash_dq[run]), 0)
                << what
                << ": flash mode's dq equals the simple kernels' bit for bit: the tensor-core backward did not run";
          }
        }
        ++run;
      }
    }
  }
  ASSERT_EQ(unsetenv("DTENSOR_CUDA_ATTENTION"), 0);
}

// cuDNN's fused attention (cudnn_sdpa.h; DTENSOR_CUDA_ATTENTION=cudnn, under which a problem
// cuDNN declines is an error, so every case below really ran on cuDNN) against the CPU, as
// above; then q, k, v and dout as heads of fused projections (row views: cuDNN reads them in
// place, the flash kernels read copies); then a forward on cuDNN with a backward on the flash
// kernels and the other way round (the default mode may mix them where cuDNN declines one
// direction): their lse must mean the same. Skips, saying why, where dtensor was built without
// cuDNN or libcudnn is not installed.
TEST(CudaKernelsTest, CudnnAttentionMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  ASSERT_EQ(setenv("DTENSOR_CUDA_ATTENTION", "cudnn", 1), 0);
  {
    const Shape shape = {1, 1, 64, 64};
    const Tensor q = Unwrap(Zeros(shape, DType::kBFloat16, Device::Cuda(0)));
    const Tensor out = Unwrap(Tensor::Empty(shape, DType::kBFloat16, Device::Cuda(0)));
    const Tensor lse = Unwrap(Tensor::Empty({1, 1, 64}, DType::kFloat32, Device::Cuda(0)));
    const absl::Status probe = Gpu()->CausalAttention(q, q, q, 0.125f, out, lse);
    if (probe.code() == absl::StatusCode::kFailedPrecondition &&
        (probe.message().find("without cuDNN") != std::string::npos ||
         probe.message().find("could not be loaded") != std::string::npos)) {
      ASSERT_EQ(unsetenv("DTENSOR_CUDA_ATTENTION"), 0);
      GTEST_SKIP() << "cuDNN's fused attention is not available here: " << probe;
    }
    ExpectOk(probe, "cuDNN attention probe");
  }
  const AttentionCase cases[] = {{1, 1, 1, 64},    {1, 2, 64, 64},   {2, 3, 130, 64},
                                 {1, 2, 1024, 64}, {1, 2, 200, 128}, {2, 12, 256, 64}};
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (const AttentionCase& c : cases) {
      CheckAttentionAgainstCpu(
          dt, c, absl::StrCat("attention (cuDNN) ", Name(dt), " [", c.b, ", ", c.h, ", ", c.t, ", ", c.d, "]"));
    }
  }
  // Heads read and written in place, as dtensor::CausalAttention lays them out for GPT's
  // attention (ops.h): q, k, v views of [B, T, 3, H, D], out and dout of [B, T, H, D], dq, dk,
  // dv views of one [B, T, 3, H, D] on the GPU (cuDNN reads and writes them in place, the flash
  // kernels through contiguous copies); contiguous tensors on the CPU, the reference.
  for (const char* mode : {"cudnn", "flash"}) {
    ASSERT_EQ(setenv("DTENSOR_CUDA_ATTENTION", mode, 1), 0);
    const int64_t b = 2, h = 4, t = 96, d = 64;
    const std::string what = absl::StrCat("attention (", mode, ") on heads of a fused qkv projection");
    const DType dt = DType::kBFloat16;
    const Pair qkv = RandomBoth({b, t, 3, h, d}, dt, 61, -2.0, 2.0), dy = RandomBoth({b, t, h, d}, dt, 62);
    auto head = [&](const Tensor& x, int64_t j) {  // [B, T, 3, H, D] -> the j-th [B, H, T, D]
      const Tensor part = Unwrap(Unwrap(x.Narrow(2, j, 1)).View({b, t, h, d}));
      return Unwrap(part.Transpose(1, 2));
    };
    const Tensor gq = head(qkv.gpu, 0), gk = head(qkv.gpu, 1), gv = head(qkv.gpu, 2);
    const Tensor gdo = Unwrap(dy.gpu.Transpose(1, 2));
    ASSERT_FALSE(gq.is_contiguous());
    const Tensor cq = Unwrap(Contiguous(head(qkv.cpu, 0))), ck = Unwrap(Contiguous(head(qkv.cpu, 1))),
                 cv = Unwrap(Contiguous(head(qkv.cpu, 2))), cdo = Unwrap(Contiguous(Unwrap(dy.cpu.Transpose(1, 2))));
    const Shape shape = {b, h, t, d};
    const float scale = 0.125f;
    Pair out = EmptyBoth(shape, dt), lse = EmptyBoth({b, h, t}, DType::kFloat32);
    Pair dq = EmptyBoth(shape, dt), dk = EmptyBoth(shape, dt), dv = EmptyBoth(shape, dt);
    out.gpu = Unwrap(Unwrap(Tensor::Empty({b, t, h, d}, dt, Device::Cuda(0))).Transpose(1, 2));
    const Tensor dqkv = Unwrap(Tensor::Empty({b, t, 3, h, d}, dt, Device::Cuda(0)));
    dq.gpu = head(dqkv, 0), dk.gpu = head(dqkv, 1), dv.gpu = head(dqkv, 2);
    ExpectOk(Cpu()->CausalAttention(cq, ck, cv, scale, out.cpu, lse.cpu), what);
    ExpectOk(Cpu()->CausalAttentionBackward(cdo, cq, ck, cv, out.cpu, lse.cpu, scale, dq.cpu, dk.cpu, dv.cpu), what);
    ExpectOk(Gpu()->CausalAttention(gq, gk, gv, scale, out.gpu, lse.gpu), what);
    ExpectOk(Gpu()->CausalAttentionBackward(gdo, gq, gk, gv, out.gpu, lse.gpu, scale, dq.gpu, dk.gpu, dv.gpu), what);
    ExpectOk(Gpu()->Synchronize(), what);
    for (const auto& [name, p] :
         {std::pair<const char*, const Pair*>{"out", &out}, {"lse", &lse}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
      testing::ExpectNormNear(Vals(p->gpu), Vals(p->cpu), 1e-2, what + " " + name);
    }
  }
  // Mixed: the lse one writes is what the other reads.
  const AttentionCase c = {2, 3, 130, 64};
  const Shape shape = {c.b, c.h, c.t, c.d};
  const float scale = 0.125f;
  const DType dt = DType::kBFloat16;
  for (const auto& [fwd, bwd] : {std::pair<const char*, const char*>{"cudnn", "flash"}, {"flash", "cudnn"}}) {
    const std::string what = absl::StrCat("attention forward on ", fwd, ", backward on ", bwd);
    const Pair q = RandomBoth(shape, dt, 51, -2.0, 2.0), k = RandomBoth(shape, dt, 52, -2.0, 2.0),
               v = RandomBoth(shape, dt, 53), dout = RandomBoth(shape, dt, 54);
    const Pair out = EmptyBoth(shape, dt), lse = EmptyBoth({c.b, c.h, c.t}, DType::kFloat32);
    const Pair dq = EmptyBoth(shape, dt), dk = EmptyBoth(shape, dt), dv = EmptyBoth(shape, dt);
    ExpectOk(Cpu()->CausalAttention(q.cpu, k.cpu, v.cpu, scale, out.cpu, lse.cpu), what);
    ExpectOk(
        Cpu()->CausalAttentionBackward(dout.cpu, q.cpu, k.cpu, v.cpu, out.cpu, lse.cpu, scale, dq.cpu, dk.cpu, dv.cpu),
        what);
    ASSERT_EQ(setenv("DTENSOR_CUDA_ATTENTION", fwd, 1), 0);
    ExpectOk(Gpu()->CausalAttention(q.gpu, k.gpu, v.gpu, scale, out.gpu, lse.gpu), what);
    ASSERT_EQ(setenv("DTENSOR_CUDA_ATTENTION", bwd, 1), 0);
    ExpectOk(
        Gpu()->CausalAttentionBackward(dout.gpu, q.gpu, k.gpu, v.gpu, out.gpu, lse.gpu, scale, dq.gpu, dk.gpu, dv.gpu),
        what);
    ExpectOk(Gpu()->Synchronize(), what);
    for (const auto& [name, p] : {std::pair<const char*, const Pair*>{"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
      testing::ExpectNormNear(Vals(p->gpu), Vals(p->cpu), 1e-2, what + " " + name);
    }
  }
  // The same backward three times in a row: each run gets the block the previous one freed as
  // its workspace, float32 dQ accumulator included, and must not add what that block held.
  ASSERT_EQ(setenv("DTENSOR_CUDA_ATTENTION", "cudnn", 1), 0);
  {
    const Pair q = RandomBoth(shape, dt, 71, -2.0, 2.0), k = RandomBoth(shape, dt, 72, -2.0, 2.0),
               v = RandomBoth(shape, dt, 73), dout = RandomBoth(shape, dt, 74);
    const Pair out = EmptyBoth(shape, dt), lse = EmptyBoth({c.b, c.h, c.t}, DType::kFloat32);
    ExpectOk(Cpu()->CausalAttention(q.cpu, k.cpu, v.cpu, scale, out.cpu, lse.cpu), "repeated backward");
    ExpectOk(Gpu()->CausalAttention(q.gpu, k.gpu, v.gpu, scale, out.gpu, lse.gpu), "repeated backward");
    for (int rep = 0; rep < 3; ++rep) {
      const std::string what = absl::StrCat("cuDNN attention backward, run ", rep + 1, " of 3");
      const Pair dq = EmptyBoth(shape, dt), dk = EmptyBoth(shape, dt), dv = EmptyBoth(shape, dt);
      ExpectOk(Cpu()->CausalAttentionBackward(dout.cpu, q.cpu, k.cpu, v.cpu, out.cpu, lse.cpu, scale, dq.cpu, dk.cpu,
                                              dv.cpu),
               what);
      ExpectOk(Gpu()->CausalAttentionBackward(dout.gpu, q.gpu, k.gpu, v.gpu, out.gpu, lse.gpu, scale, dq.gpu, dk.gpu,
                                              dv.gpu),
               what);
      ExpectOk(Gpu()->Synchronize(), what);
      testing::ExpectNormNear(Vals(dq.gpu), Vals(dq.cpu), 1e-2, what + " dq");
    }
  }
  ASSERT_EQ(unsetenv("DTENSOR_CUDA_ATTENTION"), 0);
}

// An unknown DTENSOR_CUDA_ATTENTION is an error naming it, not a silent default.
TEST(CudaKernelsTest, UnknownAttentionChoiceIsAnError) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Shape shape = {1, 1, 8, 64};
  const Tensor q = Unwrap(Zeros(shape, DType::kBFloat16, Device::Cuda(0)));
  const Tensor out = Unwrap(Tensor::Empty(shape, DType::kBFloat16, Device::Cuda(0)));
  const Tensor lse = Unwrap(Tensor::Empty({1, 1, 8}, DType::kFloat32, Device::Cuda(0)));
  ASSERT_EQ(setenv("DTENSOR_CUDA_ATTENTION", "cudnnn", 1), 0);
  const absl::Status s = Gpu()->CausalAttention(q, q, q, 0.125f, out, lse);
  ASSERT_EQ(unsetenv("DTENSOR_CUDA_ATTENTION"), 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("cudnnn"), std::string::npos) << s;
}

// ---------------------------------------------------------------------------------------
// Errors are statuses naming the op
// ---------------------------------------------------------------------------------------

TEST(CudaKernelsTest, UnsupportedDTypesAreErrors) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << kNoGpu;
  const Tensor b = Unwrap(Tensor::Empty({3}, DType::kBool, Device::Cuda(0)));
  const absl::Status s = Gpu()->Unary(UnaryOp::kExp, b, b);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("[Unary]"), std::string::npos) << s;
  const Tensor i = Unwrap(Tensor::Empty({1, 2, 2}, DType::kInt32, Device::Cuda(0)));
  EXPECT_FALSE(Gpu()->Gemm(i, i, i, 1.0f, 0.0f).ok());
  const Tensor f = Unwrap(Tensor::Empty({1, 2, 2}, DType::kFloat32, Device::Cuda(0)));
  const absl::Status mixed = Gpu()->Gemm(f, i, f, 1.0f, 0.0f);
  EXPECT_EQ(mixed.code(), absl::StatusCode::kInvalidArgument) << mixed;
  EXPECT_NE(mixed.message().find("[Gemm]"), std::string::npos) << mixed;
}

}  // namespace
}  // namespace dtensor
