// Helpers for the redistribution correctness suite (redistribute_suite_test.cc) and the
// DTensor tests: layouts described independently of Layout (placements + shard orders), a
// naive re-derivation of every rank's box (torch.chunk, nested outermost first), test values
// for which every Partial reduction is exact in every order (also in bfloat16), bit-for-bit
// tensor comparison, and a runner that keeps one thread group (one DeviceMesh per rank) alive
// over many cases, with a barrier between cases.
//
//   suite::Spec s{{Shard(0), Shard(0)}, {{0, {1, 0}}}};      // mesh dim 1 splits dim 0 first
//   suite::Box b = suite::NaiveBox({5, 3}, {2, 2}, s, {1, 0}); // computed here, not by the library
//   suite::RunStats st = suite::RunMeshCases({2, 2}, n, [&](suite::RankEnv& env, int64_t i) {...});
#ifndef DTENSOR_TESTS_CORE_SUITE_UTIL_H_
#define DTENSOR_TESTS_CORE_SUITE_UTIL_H_

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/core/comm_counter.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/core/plan.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/placements/layout.h"
#include "dtensor/placements/placement.h"
#include "dtensor/tensor/tensor.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

// In a test body or a void lambda: `DT_SUITE_MESH(mesh, DeviceMesh::Create(comm, {2, 2}));`
// declares `DeviceMesh& mesh`, or fails the test and returns.
#define DT_SUITE_MESH(var, expr)                                      \
  auto var##_or_ = (expr);                                            \
  ASSERT_TRUE(var##_or_.ok()) << #expr << ": " << var##_or_.status(); \
  ::dtensor::DeviceMesh& var = *var##_or_

namespace dtensor::suite {

// ---- Layout specs ----

// A layout as the tests think of it: one placement per mesh dim (shard dims >= 0) and, for
// the tensor dims whose sharders do not split in ascending mesh-dim order, the order
// (outermost first).
struct Spec {
  std::vector<Placement> placements;
  std::vector<std::pair<int64_t, std::vector<int>>> orders;
};

// Mesh dims that shard tensor dim d, outermost first.
inline std::vector<int> Sharders(const Spec& s, int64_t d) {
  for (const auto& [dim, order] : s.orders) {
    if (dim == d) return order;
  }
  std::vector<int> out;
  for (size_t m = 0; m < s.placements.size(); ++m) {
    if (s.placements[m].is_shard() && s.placements[m].shard_dim() == d) out.push_back(static_cast<int>(m));
  }
  return out;
}

inline std::string SpecString(const Spec& s) {
  std::string out;
  for (const Placement& p : s.placements) absl::StrAppend(&out, p.ToString());
  for (const auto& [d, order] : s.orders) absl::StrAppend(&out, "{", d, ":", absl::StrJoin(order, ","), "}");
  return out;
}

// The Layout of `s`; with negate[m] set, mesh dim m's shard dim is written negatively
// (d - tensor_ndim), which must not be combined with orders.
inline absl::StatusOr<Layout> ToLayout(const Spec& s, int64_t tensor_ndim = 0, const std::vector<bool>& negate = {}) {
  std::vector<Placement> ps = s.placements;
  for (size_t m = 0; m < negate.size() && m < ps.size(); ++m) {
    if (negate[m] && ps[m].is_shard()) ps[m] = Shard(ps[m].shard_dim() - tensor_ndim);
  }
  Layout l(ps);
  for (const auto& [d, order] : s.orders) {
    auto next = l.WithShardOrder(d, order);
    if (!next.ok()) return next.status();
    l = *next;
  }
  return l;
}

inline bool HasPartial(const Spec& s) {
  for (const Placement& p : s.placements) {
    if (p.is_partial()) return true;
  }
  return false;
}

inline bool IsMixedPartial(const Spec& s) {
  bool seen = false;
  PartialOp op = PartialOp::kSum;
  for (const Placement& p : s.placements) {
    if (!p.is_partial()) continue;
    if (seen && p.partial_op() != op) return true;
    seen = true;
    op = p.partial_op();
  }
  return false;
}

// Partial only on mesh dims of size 1: every rank's piece is the plain value of its box.
inline bool EffectivelyNonPartial(const Spec& s, IntSpan mesh) {
  for (size_t m = 0; m < s.placements.size(); ++m) {
    if (s.placements[m].is_partial() && mesh[m] > 1) return false;
  }
  return true;
}

// Shard -> Partial on a mesh dim of size > 1 (not a legal redistribution).
inline bool ShardToPartial(const Spec& src, const Spec& dst, IntSpan mesh) {
  for (size_t m = 0; m < src.placements.size(); ++m) {
    if (mesh[m] > 1 && src.placements[m].is_shard() && dst.placements[m].is_partial()) return true;
  }
  return false;
}

// Every spec over mesh_ndim mesh dims with placements from {R, S(0..tensor_ndim-1), P(sum),
// P(avg), P(max)}: with all shard orders (the default first) when with_orders, and the
// mixed-Partial ones only when with_mixed (then only those).
inline std::vector<Spec> AllSpecs(int mesh_ndim, int64_t tensor_ndim, bool with_orders, bool mixed_only = false) {
  std::vector<Placement> alphabet = {Replicate()};
  for (int64_t d = 0; d < tensor_ndim; ++d) alphabet.push_back(Shard(d));
  alphabet.push_back(Partial(PartialOp::kSum));
  alphabet.push_back(Partial(PartialOp::kAvg));
  alphabet.push_back(Partial(PartialOp::kMax));
  std::vector<Spec> out;
  const size_t a = alphabet.size();
  size_t total = 1;
  for (int m = 0; m < mesh_ndim; ++m) total *= a;
  for (size_t code = 0; code < total; ++code) {
    Spec s;
    size_t rest = code;
    for (int m = 0; m < mesh_ndim; ++m) {
      s.placements.push_back(alphabet[rest % a]);
      rest /= a;
    }
    std::reverse(s.placements.begin(), s.placements.end());
    if (IsMixedPartial(s) != mixed_only) continue;
    out.push_back(s);
    if (!with_orders) continue;
    // Every combination of orders over the tensor dims with 2+ sharders.
    std::vector<std::vector<std::vector<int>>> choices;  // per such dim: its permutations
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < tensor_ndim; ++d) {
      std::vector<int> sh = Sharders(s, d);
      if (sh.size() < 2) continue;
      std::vector<std::vector<int>> perms;
      do {
        perms.push_back(sh);
      } while (std::next_permutation(sh.begin(), sh.end()));
      choices.push_back(std::move(perms));
      dims.push_back(d);
    }
    if (choices.empty()) continue;
    std::vector<size_t> idx(choices.size(), 0);
    while (true) {
      size_t i = 0;
      while (i < idx.size() && ++idx[i] == choices[i].size()) idx[i++] = 0;
      if (i == idx.size()) break;
      Spec o = s;
      for (size_t j = 0; j < idx.size(); ++j) {
        if (idx[j] != 0) o.orders.push_back({dims[j], choices[j][idx[j]]});
      }
      out.push_back(std::move(o));
    }
  }
  return out;
}

// ---- Boxes, computed naively ----

struct Box {
  Shape offset;
  Shape shape;
};

// The box of the rank at `coord`: for each tensor dim, start from [0, n) and let each sharder
// (outermost first) keep its torch.chunk piece of the current range: chunk = ceil(len / k),
// piece c is [c * chunk, min(len, (c + 1) * chunk)), empty past the end.
inline Box NaiveBox(IntSpan global, IntSpan mesh, const Spec& s, IntSpan coord) {
  Box b;
  for (size_t d = 0; d < global.size(); ++d) {
    int64_t lo = 0;
    int64_t len = global[d];
    for (int m : Sharders(s, static_cast<int64_t>(d))) {
      const int64_t k = mesh[static_cast<size_t>(m)];
      const int64_t c = coord[static_cast<size_t>(m)];
      const int64_t chunk = (len + k - 1) / k;
      const int64_t start = std::min(len, c * chunk);
      const int64_t end = std::min(len, (c + 1) * chunk);
      lo += start;
      len = end - start;
    }
    b.offset.push_back(lo);
    b.shape.push_back(len);
  }
  return b;
}

inline int64_t Numel(IntSpan shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Row-major coordinate of linear index i.
inline Shape Unravel(int64_t i, IntSpan shape) {
  Shape c(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = shape[d] == 0 ? 0 : i % shape[d];
    i = shape[d] == 0 ? 0 : i / shape[d];
  }
  return c;
}

// ---- Values ----

inline uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline uint64_t Hash(uint64_t seed, int64_t i, uint64_t salt) {
  return Mix(seed ^ Mix(static_cast<uint64_t>(i) * 0x100000001b3ull + salt));
}

// The global tensor's values. exact_partial: multiples of 24 (|v| <= 8 * 24 in bfloat16,
// <= 1000 * 24 otherwise), so that every Partial piece built below, every partial reduction
// of any subgroup of them and every division by a group size dividing 24 is exact. Otherwise
// values that are exact in `dtype` and mostly distinct (only copies happen).
inline std::vector<double> GlobalValues(IntSpan shape, DType dtype, bool exact_partial, uint64_t seed) {
  const int64_t n = Numel(shape);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = Hash(seed, i, 17);
    double x;
    if (exact_partial) {
      const int64_t range = dtype == DType::kBFloat16 ? 8 : 1000;
      x = 24.0 * static_cast<double>(static_cast<int64_t>(h % static_cast<uint64_t>(2 * range + 1)) - range);
    } else if (dtype == DType::kBFloat16) {
      x = static_cast<double>(static_cast<int64_t>(h % 255) - 127) / 8.0;  // 7 significant bits
    } else if (dtype == DType::kFloat32) {
      x = static_cast<double>(static_cast<int64_t>(h % 2000001) - 1000000) / 64.0;
    } else {
      x = static_cast<double>(static_cast<int64_t>(h % 2000000001ull) - 1000000000);
    }
    v[static_cast<size_t>(i)] = x;
  }
  return v;
}

// A contiguous CPU tensor holding `values` (exactly representable in dtype) — written
// element by element here, no library casts.
inline Tensor MakeTensor(const std::vector<double>& values, IntSpan shape, DType dtype) {
  auto t = Tensor::Empty(shape, dtype);
  if (!t.ok()) return Tensor();
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case DType::kFloat32:
        t->data<float>()[i] = static_cast<float>(values[i]);
        break;
      case DType::kBFloat16:
        t->data<BFloat16>()[i] = BFloat16(static_cast<float>(values[i]));
        break;
      case DType::kInt64:
        t->data<int64_t>()[i] = static_cast<int64_t>(values[i]);
        break;
      case DType::kInt32:
        t->data<int32_t>()[i] = static_cast<int32_t>(values[i]);
        break;
      default:
        return Tensor();
    }
  }
  return *std::move(t);
}

// The values of `box` of a global row-major tensor.
inline std::vector<double> BoxValues(const std::vector<double>& global, IntSpan global_shape, const Box& box) {
  const int64_t n = Numel(box.shape);
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const Shape c = Unravel(i, box.shape);
    int64_t g = 0;
    for (size_t d = 0; d < global_shape.size(); ++d) g = g * global_shape[d] + box.offset[d] + c[d];
    out[static_cast<size_t>(i)] = global[static_cast<size_t>(g)];
  }
  return out;
}

// This rank's Partial piece of its box (src has Partial placements, all of one op): for
// element with global linear index g and value v, with k = product of the Partial mesh dims'
// sizes and p = this rank's row-major index among them:
//   sum: the holder h(g) has v - (k-1) e(g), the others e(g), e in {-24, 0, 24};
//   avg: v + t(g) * a(c), c = coordinate on the first Partial mesh dim of size > 1, a = +24,
//        -24, +24, ... with a 0 last for odd sizes (sums to 0 along that dim); any average
//        over whole mesh dims is then v or v + t a(c) exactly;
//   max: the holder has v, the others v - 24 j (0 <= j <= 2); min: v + 24 j.
inline std::vector<double> PartialPiece(const std::vector<double>& global, IntSpan global_shape, const Box& box,
                                        const Spec& src, IntSpan mesh, IntSpan coord, uint64_t seed) {
  PartialOp op = PartialOp::kSum;
  int64_t k = 1;
  int64_t p = 0;
  int first = -1;
  for (size_t m = 0; m < src.placements.size(); ++m) {
    if (!src.placements[m].is_partial()) continue;
    op = src.placements[m].partial_op();
    k *= mesh[m];
    p = p * mesh[m] + coord[m];
    if (first < 0 && mesh[m] > 1) first = static_cast<int>(m);
  }
  const int64_t n = Numel(box.shape);
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const Shape c = Unravel(i, box.shape);
    int64_t g = 0;
    for (size_t d = 0; d < global_shape.size(); ++d) g = g * global_shape[d] + box.offset[d] + c[d];
    const double v = global[static_cast<size_t>(g)];
    const int64_t holder = static_cast<int64_t>(Hash(seed, g, 1) % static_cast<uint64_t>(k));
    double x = v;
    switch (op) {
      case PartialOp::kSum: {
        const double e = 24.0 * static_cast<double>(static_cast<int64_t>(Hash(seed, g, 2) % 3) - 1);
        x = p == holder ? v - static_cast<double>(k - 1) * e : e;
        break;
      }
      case PartialOp::kAvg: {
        if (first >= 0) {
          const int64_t s = mesh[static_cast<size_t>(first)];
          const int64_t cc = coord[static_cast<size_t>(first)];
          const double sign = Hash(seed, g, 3) % 2 == 0 ? 1.0 : -1.0;
          const double a = (s % 2 == 1 && cc == s - 1) ? 0.0 : (cc % 2 == 0 ? 24.0 : -24.0);
          x = v + sign * a;
        }
        break;
      }
      case PartialOp::kMax:
      case PartialOp::kMin: {
        const double j = p == holder ? 0.0 : static_cast<double>((Hash(seed, g, 4) + static_cast<uint64_t>(p)) % 3);
        x = op == PartialOp::kMax ? v - 24.0 * j : v + 24.0 * j;
        break;
      }
    }
    out[static_cast<size_t>(i)] = x;
  }
  return out;
}

// ---- Comparison ----

inline double ElementAsDouble(const char* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBFloat16: {
      BFloat16 b;
      std::memcpy(&b.bits, p, 2);
      return static_cast<float>(b);
    }
    case DType::kInt64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<double>(x);
    }
    case DType::kInt32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    default:
      return 0;
  }
}

// "" when `actual` has expected's dtype, shape and bytes (element by element, any strides);
// otherwise what differs first.
inline std::string CompareBits(const Tensor& actual, const Tensor& expected) {
  if (!actual.defined()) return "undefined tensor";
  if (actual.dtype() != expected.dtype()) {
    return absl::StrCat("dtype ", DTypeName(actual.dtype()), " != ", DTypeName(expected.dtype()));
  }
  if (!std::equal(actual.shape().begin(), actual.shape().end(), expected.shape().begin(), expected.shape().end())) {
    return absl::StrCat("shape ", ShapeString(actual.shape()), " != ", ShapeString(expected.shape()));
  }
  if (actual.device() != Device::Cpu()) return "not a CPU tensor";
  const size_t es = ElementSize(actual.dtype());
  const int64_t n = actual.numel();
  const char* a = static_cast<const char*>(actual.raw_data());
  const char* e = static_cast<const char*>(expected.raw_data());  // contiguous (MakeTensor)
  Shape c(actual.shape().size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (size_t d = 0; d < c.size(); ++d) off += c[d] * actual.strides()[d];
    const char* pa = a + off * static_cast<int64_t>(es);
    const char* pe = e + i * static_cast<int64_t>(es);
    if (std::memcmp(pa, pe, es) != 0) {
      return absl::StrCat("element ", i, " [", absl::StrJoin(c, ","), "] is ", ElementAsDouble(pa, actual.dtype()),
                          ", expected ", ElementAsDouble(pe, actual.dtype()));
    }
    for (size_t d = c.size(); d-- > 0;) {
      if (++c[d] < actual.shape()[d]) break;
      c[d] = 0;
    }
  }
  return "";
}

// "" when the counter saw exactly the predicted collectives (calls and bytes per kind).
inline std::string CompareComm(const CommCounter& counter, const std::vector<CommRecord>& predicted) {
  int64_t calls[kNumCommKinds] = {};
  int64_t bytes[kNumCommKinds] = {};
  for (const CommRecord& r : predicted) {
    calls[static_cast<int>(r.kind)] += 1;
    bytes[static_cast<int>(r.kind)] += r.bytes;
  }
  std::string diff;
  for (int k = 0; k < kNumCommKinds; ++k) {
    const CommKind kind = static_cast<CommKind>(k);
    if (counter.calls(kind) != calls[k] || counter.bytes(kind) != bytes[k]) {
      absl::StrAppend(&diff, diff.empty() ? "" : "; ", CommKindName(kind), ": saw ", counter.calls(kind), " calls ",
                      counter.bytes(kind), " bytes, predicted ", calls[k], " calls ", bytes[k], " bytes");
    }
  }
  return diff;
}

// ---- Running many cases on one thread group ----

struct RankEnv {
  int rank = 0;
  Communicator* comm = nullptr;
  DeviceMesh* mesh = nullptr;
  CommCounter* counter = nullptr;
  // Failures of this rank (the first 20 kept, all counted).
  std::vector<std::string> messages;
  int64_t failures = 0;
  void Fail(std::string m) {
    ++failures;
    if (messages.size() < 20) messages.push_back(absl::StrCat("rank ", rank, ": ", std::move(m)));
  }
};

// fn(env, case_index) runs one case on one rank; it returns false when the group can no
// longer be used (a transport error: timeout, departed peer).
using CaseFn = std::function<bool(RankEnv& env, int64_t case_index)>;

struct RunStats {
  int64_t cases = 0;  // cases every rank ran
  int64_t failures = 0;
  std::vector<std::string> messages;
  int restarts = 0;
  double seconds = 0;
};

inline bool IsTransportError(const absl::Status& s) {
  return absl::IsDeadlineExceeded(s) || absl::IsUnavailable(s) || absl::IsAborted(s) || absl::IsInternal(s);
}

// Runs cases [0, num_cases) on a thread group of the size of `mesh_shape`, one thread per
// rank, each with a DeviceMesh of that shape and a CommCounter attached to it; a barrier
// separates cases. After a case that broke the group, the group is rebuilt (twice at most)
// and the run goes on with the next case.
inline RunStats RunMeshCases(IntSpan mesh_shape, int64_t num_cases, const CaseFn& fn,
                             absl::Duration timeout = absl::Seconds(20)) {
  RunStats stats;
  const auto t0 = std::chrono::steady_clock::now();
  const int world = static_cast<int>(Numel(mesh_shape));
  int64_t next = 0;
  while (next < num_cases) {
    auto comms = MakeThreadGroup(world, timeout);
    if (!comms.ok()) {
      stats.failures++;
      stats.messages.push_back(absl::StrCat("MakeThreadGroup: ", comms.status().ToString()));
      break;
    }
    std::vector<RankEnv> envs(static_cast<size_t>(world));
    std::atomic<bool> broken{false};
    std::atomic<int64_t> resume{num_cases};
    // Snapshot of `broken` taken when every rank has arrived, read after the barrier: every
    // rank makes the same decision even if one breaks the group again in the next case.
    bool stop = false;
    int64_t phase = 0;
    auto on_phase = [&]() noexcept {
      stop = broken.load();
      if (phase++ > 0 && !stop) stats.cases++;
    };
    std::barrier sync(world, on_phase);
    std::vector<std::thread> threads;
    const int64_t first = next;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        RankEnv& env = envs[static_cast<size_t>(r)];
        env.rank = r;
        env.comm = (*comms)[static_cast<size_t>(r)].get();
        auto mesh = DeviceMesh::Create(*env.comm, mesh_shape);
        if (!mesh.ok()) {
          env.Fail(absl::StrCat("DeviceMesh::Create: ", mesh.status().ToString()));
          broken = true;
        }
        CommCounter counter;
        if (mesh.ok()) {
          SetCommCounter(*mesh, &counter);
          env.mesh = &*mesh;
          env.counter = &counter;
        }
        sync.arrive_and_wait();
        for (int64_t i = first; i < num_cases && !stop; ++i) {
          if (!fn(env, i)) {
            broken = true;
            int64_t cur = resume.load();
            while (i + 1 < cur && !resume.compare_exchange_weak(cur, i + 1)) {
            }
          }
          sync.arrive_and_wait();
        }
        if (mesh.ok()) SetCommCounter(*mesh, nullptr);
        env.mesh = nullptr;
      });
    }
    for (auto& t : threads) t.join();
    for (RankEnv& env : envs) {
      stats.failures += env.failures;
      for (std::string& m : env.messages) {
        if (stats.messages.size() < 40) stats.messages.push_back(std::move(m));
      }
    }
    if (!broken.load()) break;
    next = resume.load();
    if (next < num_cases) {
      if (stats.restarts == 2) {
        stats.failures++;
        stats.messages.push_back(absl::StrCat("gave up after 2 restarts; cases ", next, "..", num_cases, " not run"));
        break;
      }
      stats.restarts++;
    }
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

// Runs fn(rank, comm) on one thread per rank of a fresh thread group with `timeout`; returns
// the seconds it took (a test asserts it is well below the timeout: no rank waited for one).
inline double RunThreads(int world, const std::function<void(int rank, Communicator& comm)>& fn,
                         absl::Duration timeout = absl::Seconds(20)) {
  auto comms = MakeThreadGroup(world, timeout);
  if (!comms.ok()) return -1;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { fn(r, *(*comms)[static_cast<size_t>(r)]); });
  for (auto& t : threads) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// RunThreads, failing the test when the group cannot be made or a rank waited for a timeout
// (10 s).
inline void RunRanks(int world, const std::function<void(int rank, Communicator& comm)>& fn) {
  const double seconds = RunThreads(world, fn);
  EXPECT_GE(seconds, 0) << "MakeThreadGroup failed";
  EXPECT_LT(seconds, 10.0 * dtensor::testing::TimeScale()) << "took too long: something waited for a timeout";
}

}  // namespace dtensor::suite

#endif  // DTENSOR_TESTS_CORE_SUITE_UTIL_H_
