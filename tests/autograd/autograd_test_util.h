// Helpers for the autograd tests: thread ranks with a mesh, enumeration of input layouts,
// distributing full tensors and comparing gathered results with single-rank ones.
//
//   agtest::RunMesh({2, 2}, [&](const DeviceMesh& mesh) {
//     for (const std::vector<Layout>& ls : agtest::LayoutCombos(cands, groups, full_inputs, mesh.ndim(), 400)) {
//       std::vector<Value> in = agtest::DistributeAll(full_inputs, mesh, ls);  // or DistributeParts
//       ...
//       agtest::ExpectClose(out[0], reference, "what");
//     }
//   });
#ifndef DTENSOR_TESTS_AUTOGRAD_AUTOGRAD_TEST_UTIL_H_
#define DTENSOR_TESTS_AUTOGRAD_AUTOGRAD_TEST_UTIL_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/tensor/status.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
// Readable Layouts in gtest messages.
inline void PrintTo(const Layout& l, std::ostream* os) { *os << l.ToString(); }
}  // namespace dtensor

namespace dtensor::agtest {

using testing::Unwrap;

// The mesh shapes every distributed check runs on.
inline std::vector<Shape> MeshShapes() { return {Shape{2}, Shape{4}, Shape{2, 2}}; }

inline std::string MeshName(IntSpan s) { return absl::StrCat("mesh[", absl::StrJoin(s, "x"), "]"); }

// Runs fn on NumElements(mesh_shape) thread ranks, each with its DeviceMesh of that shape.
inline void RunMesh(IntSpan mesh_shape, const std::function<void(const DeviceMesh& mesh)>& fn) {
  const int world = static_cast<int>(NumElements(mesh_shape));
  auto comms = MakeThreadGroup(world, absl::Seconds(20));
  ASSERT_TRUE(comms.ok()) << comms.status();
  const Shape shape(mesh_shape.begin(), mesh_shape.end());
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto mesh = DeviceMesh::Create(*(*comms)[static_cast<size_t>(r)], shape);
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      // Every rank has its mesh before any runs fn: an abort in fn (a deliberately wrong piece
      // given to FromLocal) must not reach a rank still creating its mesh's groups.
      const absl::Status st = mesh->world().Barrier();
      ASSERT_TRUE(st.ok()) << st;
      fn(*mesh);
    });
  }
  for (auto& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 15.0 * testing::TimeScale()) << MeshName(shape) << ": took too long (a rank waited for a timeout?)";
}

// Whether `ok` holds on every rank of the mesh (collective over its world): after an op failed
// on some ranks only, every rank skips the checks instead of waiting in a collective. With
// `aborted`, a world aborted by a failing rank (DTensor::FromLocal's checks abort the mesh's
// communicators) sets it and returns false on every rank instead of failing the test: the
// caller then needs a fresh world.
inline bool AllOk(const DeviceMesh& mesh, bool ok, bool* aborted = nullptr) {
  Tensor t = Unwrap(Tensor::FromVector<float>({ok ? 1.0f : 0.0f}, {1}), "AllOk");
  absl::Status st = mesh.world().AllReduce(t, t, CommReduceOp::kMin);
  if (aborted != nullptr && absl::IsAborted(st)) {
    *aborted = true;
    return false;
  }
  if (!st.ok()) {
    ADD_FAILURE() << "AllOk: " << st;
    return false;
  }
  return testing::Values(t)[0] == 1.0;
}

// Whether placement p fits a tensor of `ndim` dims (and `is_int` tensors are never Partial).
inline bool Fits(const Placement& p, int64_t ndim, bool is_int) {
  if (p.is_partial()) return !is_int;
  if (p.is_shard()) return p.shard_dim() >= -ndim && p.shard_dim() < ndim;
  return true;
}

// Input layouts to try on a mesh of `mesh_ndim` dims: for input i, every combination of one
// candidate placement per mesh dim. Inputs with the same group id take the same candidate
// index on each mesh dim (so a group's inputs are laid out alike); each input is its own
// group when the independent product has at most `limit` combos. Layouts that do not
// normalise (mixed Partial ops) or do not fit an input are skipped.
inline std::vector<std::vector<Layout>> LayoutCombos(const std::vector<std::vector<Placement>>& cands,
                                                     const std::vector<int>& groups, const std::vector<Tensor>& inputs,
                                                     int mesh_ndim, int64_t limit) {
  const size_t n = cands.size();
  std::vector<int> group(n);
  int64_t independent = 1;
  for (size_t i = 0; i < n; ++i) {
    for (int m = 0; m < mesh_ndim; ++m) independent *= static_cast<int64_t>(cands[i].size());
  }
  for (size_t i = 0; i < n; ++i) {
    group[i] = (independent <= limit || groups.empty()) ? static_cast<int>(i) : groups[i];
  }
  // The leader (first input) of each group decides the candidate count.
  std::vector<size_t> leaders;
  std::vector<int> leader_of(n);
  for (size_t i = 0; i < n; ++i) {
    size_t l = i;
    for (size_t j = 0; j < i; ++j) {
      if (group[j] == group[i]) {
        l = j;
        break;
      }
    }
    if (l == i) leaders.push_back(i);
    leader_of[i] = static_cast<int>(l);
  }
  // Digits: per leader, per mesh dim.
  std::vector<size_t> radix;
  for (size_t l : leaders) {
    for (int m = 0; m < mesh_ndim; ++m) radix.push_back(cands[l].size());
  }
  std::vector<std::vector<Layout>> out;
  std::vector<size_t> digit(radix.size(), 0);
  while (true) {
    std::vector<Layout> combo;
    bool ok = true;
    for (size_t i = 0; i < n && ok; ++i) {
      const size_t li = static_cast<size_t>(
          std::find(leaders.begin(), leaders.end(), static_cast<size_t>(leader_of[i])) - leaders.begin());
      Placements ps;
      for (int m = 0; m < mesh_ndim; ++m) {
        const size_t k = digit[li * static_cast<size_t>(mesh_ndim) + static_cast<size_t>(m)];
        Placement p = k < cands[i].size() ? cands[i][k] : Placement(Replicate());
        const bool is_int = inputs[i].dtype() == DType::kInt32 || inputs[i].dtype() == DType::kInt64;
        if (!Fits(p, inputs[i].dim(), is_int)) p = Replicate();
        ps.push_back(p);
      }
      auto l = NormalizeLayout("test", Layout(ps), inputs[i].dim(), mesh_ndim);
      if (!l.ok()) {
        ok = false;
      } else {
        combo.push_back(*l);
      }
    }
    if (ok && std::find(out.begin(), out.end(), combo) == out.end()) out.push_back(std::move(combo));
    size_t d = 0;
    while (d < digit.size() && ++digit[d] == radix[d]) digit[d++] = 0;
    if (d == digit.size()) break;
  }
  return out;
}

inline std::string LayoutsString(const std::vector<Layout>& ls) {
  std::vector<std::string> s;
  for (const Layout& l : ls) s.push_back(l.ToString());
  return absl::StrJoin(s, ", ");
}

// Every rank holds the same full tensors; each keeps its piece of input i laid out as ls[i].
inline std::vector<Value> DistributeAll(const std::vector<Tensor>& full, const DeviceMesh& mesh,
                                        const std::vector<Layout>& ls) {
  std::vector<Value> out;
  for (size_t i = 0; i < full.size(); ++i) {
    out.emplace_back(Unwrap(DTensor::Distribute(full[i], mesh, ls[i], {.src_rank = std::nullopt}), "Distribute"));
  }
  return out;
}

// Like DistributeAll, but an input laid out Partial holds unequal parts on the ranks of its
// Partial mesh dims (DTensor::Distribute gives them equal ones): with g this rank's index
// among the n ranks of those dims and N_0..N_{n-1} random tensors of the global shape (the same
// on every rank, from `seed`), the part is
//   sum: full / n + N_g - N_{(g+1) % n}    avg: full + N_g - N_{(g+1) % n}
//   max: full on the element's owner g = e % n, full - |N_g| - 0.1 elsewhere (min: + instead)
// so that the parts sum to / average / max / min to the full value, and no rank holds it all.
// No communication.
inline std::vector<Value> DistributeParts(const std::vector<Tensor>& full, const DeviceMesh& mesh,
                                          const std::vector<Layout>& ls, uint64_t seed) {
  std::vector<Value> out;
  for (size_t i = 0; i < full.size(); ++i) {
    const Layout& l = ls[i];
    if (!l.has_partial()) {
      out.emplace_back(Unwrap(DTensor::Distribute(full[i], mesh, l, {.src_rank = std::nullopt}), "Distribute"));
      continue;
    }
    int64_t n = 1, g = 0;
    Layout base = l;
    for (int m = 0; m < l.ndim(); ++m) {
      if (!l[m].is_partial()) continue;
      g = g * mesh.size(m) + mesh.coordinate()[static_cast<size_t>(m)];
      n *= mesh.size(m);
      base = base.WithPlacement(m, Replicate());
    }
    const PartialOp op = *l.partial_op();
    const IntSpan shape = full[i].shape();
    const uint64_t s = seed * 7919 + i * 131;
    std::vector<double> v = testing::Values(full[i]);
    const std::vector<double> ng =
        testing::Values(testing::Random(shape, DType::kFloat32, s + static_cast<uint64_t>(g), -0.5, 0.5));
    const std::vector<double> nn =
        testing::Values(testing::Random(shape, DType::kFloat32, s + static_cast<uint64_t>((g + 1) % n), -0.5, 0.5));
    for (size_t e = 0; e < v.size(); ++e) {
      switch (op) {
        case PartialOp::kSum:
          v[e] = v[e] / static_cast<double>(n) + ng[e] - nn[e];
          break;
        case PartialOp::kAvg:
          v[e] = v[e] + ng[e] - nn[e];
          break;
        case PartialOp::kMax:
          if (static_cast<int64_t>(e) % n != g) v[e] -= std::abs(ng[e]) + 0.1;
          break;
        case PartialOp::kMin:
          if (static_cast<int64_t>(e) % n != g) v[e] += std::abs(ng[e]) + 0.1;
          break;
      }
    }
    const Tensor mine = testing::FromDoubles(v, shape, full[i].dtype());
    DTensor piece = Unwrap(DTensor::Distribute(mine, mesh, base, {.src_rank = std::nullopt}), "Distribute");
    out.emplace_back(
        Unwrap(DTensor::FromLocal(piece.ToLocal(), mesh, l, {.global_shape = Shape(shape.begin(), shape.end())}),
               "FromLocal"));
  }
  return out;
}

// The full value of v (FullTensor for a DTensor; collective).
inline Tensor Full(const Value& v) {
  if (!v.is_dtensor()) return v.local();
  return Unwrap(v.dtensor().FullTensor(), "FullTensor");
}

inline constexpr testing::Tolerance kTight = {1e-5, 1e-5};

// Compares the full value of `actual` (same shape) with `expected`.
inline void ExpectClose(const Value& actual, const Tensor& expected, const std::string& what,
                        testing::Tolerance tol = kTight) {
  ASSERT_TRUE(actual.defined()) << what << ": undefined";
  ASSERT_EQ(Shape(actual.shape().begin(), actual.shape().end()),
            Shape(expected.shape().begin(), expected.shape().end()))
      << what;
  Tensor full = Full(actual);
  testing::ExpectNear(testing::Values(full), testing::Values(expected), tol, what);
}

// A fixed random float32 tensor.
inline Tensor Rand(IntSpan shape, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  return testing::Random(shape, DType::kFloat32, seed, lo, hi);
}

inline Tensor Ids(const std::vector<int64_t>& v, IntSpan shape) {
  return Unwrap(Tensor::FromVector<int64_t>(v, shape), "Ids");
}

// Short placement names for the tables of the tests: `using namespace agtest::placements;`.
namespace placements {
inline const Placement R = Replicate();
inline const Placement S0 = Shard(0);
inline const Placement S1 = Shard(1);
inline const Placement S2 = Shard(2);
inline const Placement S3 = Shard(3);
inline const Placement P = Partial(PartialOp::kSum);
inline const Placement PA = Partial(PartialOp::kAvg);
inline const Placement PM = Partial(PartialOp::kMax);
}  // namespace placements

}  // namespace dtensor::agtest

#endif  // DTENSOR_TESTS_AUTOGRAD_AUTOGRAD_TEST_UTIL_H_
