// The reverse-mode engine (autograd/variable.h) and the DTensor boundaries (Redistribute,
// FromLocal, ToLocal), each against gradients worked out by hand here:
// accumulation over several paths and over several backward passes, the no-grad scope,
// retain_graph and the release of saved tensors, gradient and post-accumulate hooks, roots
// with and without gradients, Redistribute's backward as the transposed redistribution, and
// a data-parallel linear layer whose Replicate weight gets a Partial(sum) gradient.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/tensor/allocator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/autograd/autograd_test_util.h"

namespace dtensor {
namespace {

using agtest::Rand;
using testing::Unwrap;
using testing::Values;

using namespace agtest::placements;  // R, S0, S1, S2, S3, P, PA, PM

// a*x + b elementwise, as a tensor.
Tensor Affine(const Tensor& x, double a, double b) {
  std::vector<double> v = Values(x);
  for (double& e : v) e = a * e + b;
  return testing::FromDoubles(v, x.shape(), DType::kFloat32);
}

void ExpectValues(const Value& v, const Tensor& expected, const std::string& what) {
  agtest::ExpectClose(v, expected, what);
}

// loss = sum(x*x + 3x): d/dx = 2x + 3 (x reaches the sum along two paths).
absl::StatusOr<Variable> TwoPathLoss(const Variable& x) {
  DT_ASSIGN_OR_RETURN(Variable sq, Mul(x, x));
  DT_ASSIGN_OR_RETURN(Variable lin, Scale(x, 3.0));
  DT_ASSIGN_OR_RETURN(Variable s, Add(sq, lin));
  return Sum(s);
}

TEST(Engine, GradientsOfSeveralPathsAreSummed) {
  const Tensor xv = Rand({3, 4}, 1);
  Variable x = Variable::Leaf(xv, true, "x");
  Variable loss = Unwrap(TwoPathLoss(x));
  EXPECT_FALSE(loss.is_leaf());
  EXPECT_TRUE(loss.requires_grad());
  ASSERT_TRUE(Backward(loss).ok());
  ExpectValues(x.grad(), Affine(xv, 2, 3), "d/dx (x*x + 3x)");
}

TEST(Engine, BackwardTwiceAccumulates) {
  const Tensor xv = Rand({3, 4}, 2);
  Variable x = Variable::Leaf(xv, true, "x");
  Variable loss = Unwrap(TwoPathLoss(x));
  ASSERT_TRUE(Backward(loss, /*retain_graph=*/true).ok());
  ExpectValues(x.grad(), Affine(xv, 2, 3), "after one pass");
  ASSERT_TRUE(Backward(loss, /*retain_graph=*/true).ok());
  ExpectValues(x.grad(), Affine(xv, 4, 6), "after two passes");
  // A second forward (gradient accumulation over micro-batches) adds again.
  Variable loss2 = Unwrap(TwoPathLoss(x));
  ASSERT_TRUE(Backward(loss2).ok());
  ExpectValues(x.grad(), Affine(xv, 6, 9), "after a second graph");
  // reset_grad starts over.
  x.reset_grad();
  EXPECT_FALSE(x.grad().defined());
  ASSERT_TRUE(Backward(loss).ok());
  ExpectValues(x.grad(), Affine(xv, 2, 3), "after reset_grad");
}

// A gradient passed through unchanged (here the caller's own root gradient) is not modified by
// later accumulation.
TEST(Engine, AccumulationDoesNotWriteIntoTheCallersGradient) {
  const Tensor xv = Rand({2, 3}, 3), gv = Rand({2, 3}, 4);
  const std::vector<double> g_before = Values(gv);
  Variable x = Variable::Leaf(xv, true, "x");
  Variable y = Unwrap(AddScalar(x, 1.0));  // backward: the gradient itself
  ASSERT_TRUE(Backward({y}, {Value(gv)}, /*retain_graph=*/true).ok());
  ASSERT_TRUE(Backward({y}, {Value(gv)}).ok());
  EXPECT_EQ(Values(gv), g_before) << "the root gradient was modified in place";
  ExpectValues(x.grad(), Affine(gv, 2, 0), "two passes of g");
}

// Add's backward hands the same gradient tensor to both inputs: accumulating into one leaf's
// gradient must not change the other's.
TEST(Engine, OneGradientTensorForTwoLeaves) {
  const Tensor av = Rand({2, 3}, 17), bv = Rand({2, 3}, 18), wv = Rand({2, 3}, 19);
  Variable a = Variable::Leaf(av, true, "a"), b = Variable::Leaf(bv, true, "b");
  Variable loss = Unwrap(Sum(Unwrap(Mul(Unwrap(Add(a, b)), Variable::Constant(wv)))));
  for (int pass = 1; pass <= 3; ++pass) {
    ASSERT_TRUE(Backward(loss, /*retain_graph=*/true).ok());
    ExpectValues(a.grad(), Affine(wv, pass, 0), absl::StrCat("a.grad after ", pass, " passes"));
    ExpectValues(b.grad(), Affine(wv, pass, 0), absl::StrCat("b.grad after ", pass, " passes"));
  }
}

// A leaf's grad never shares memory with another's: scaling one in place (as gradient
// clipping does) leaves the other alone, and the root gradient handed in is not aliased.
TEST(Engine, LeafGradientsDoNotShareMemory) {
  const Tensor av = Rand({2, 3}, 21), bv = Rand({2, 3}, 22), gv = Rand({2, 3}, 23);
  Variable a = Variable::Leaf(av, true, "a"), b = Variable::Leaf(bv, true, "b");
  Variable y = Unwrap(Add(a, b));  // backward: the same gradient tensor to both
  ASSERT_TRUE(Backward({y}, {Value(gv)}).ok());
  EXPECT_NE(a.grad().local().raw_data(), b.grad().local().raw_data());
  EXPECT_NE(a.grad().local().raw_data(), gv.raw_data());
  ASSERT_TRUE(Scale_(a.grad().local(), 0.5).ok());
  ExpectValues(a.grad(), Affine(gv, 0.5, 0), "a.grad halved");
  ExpectValues(b.grad(), Affine(gv, 1, 0), "b.grad untouched");
}

TEST(Engine, RootGradientsMustMatchTheirRoots) {
  Variable x = Variable::Leaf(Rand({4}, 31), true, "x"), w = Variable::Leaf(Rand({4}, 32), true, "w");
  Variable y = Unwrap(Mul(x, w));
  absl::Status s = Backward({y}, {Value(Rand({1}, 33))}, /*retain_graph=*/true);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("the gradient of root 0 is float32 [1] but the root is float32 [4]"));
  s = Backward({y}, {Value(Rand({4}, 33)), Value(Rand({4}, 34))}, /*retain_graph=*/true);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("2 root gradients for 1 roots"));
  EXPECT_FALSE(x.grad().defined()) << "nothing ran";
  EXPECT_TRUE(Backward({y}, {Value(Rand({4}, 33))}).ok());
}

TEST(Engine, NoGradGuardRecordsNothing) {
  Variable x = Variable::Leaf(Rand({3}, 5), true, "x");
  EXPECT_TRUE(GradEnabled());
  {
    NoGradGuard ng;
    EXPECT_FALSE(GradEnabled());
    // Grad mode is per thread: another thread still records.
    std::atomic<bool> other{false};
    std::thread t([&] { other = GradEnabled(); });
    t.join();
    EXPECT_TRUE(other.load());
    Variable y = Unwrap(Mul(x, x));
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(y.is_leaf());
    EXPECT_EQ(y.grad_fn(), nullptr);
    Variable s = Unwrap(Sum(y));
    absl::Status st = Backward(s);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    {
      NoGradGuard nested;
      EXPECT_FALSE(GradEnabled());
    }
    EXPECT_FALSE(GradEnabled()) << "a nested guard restores the outer state";
  }
  EXPECT_TRUE(GradEnabled());
  Variable y = Unwrap(Mul(x, x));
  EXPECT_TRUE(y.requires_grad());
  EXPECT_NE(y.grad_fn(), nullptr);
  // Nothing requires grad: nothing recorded either.
  Variable c = Variable::Constant(Rand({3}, 6));
  Variable z = Unwrap(Mul(c, c));
  EXPECT_FALSE(z.requires_grad());
  EXPECT_EQ(z.grad_fn(), nullptr);
}

TEST(Engine, SecondBackwardWithoutRetainGraphFails) {
  Variable x = Variable::Leaf(Rand({3, 4}, 7), true, "x");
  Variable loss = Unwrap(TwoPathLoss(x));
  ASSERT_TRUE(Backward(loss).ok());
  absl::Status st = Backward(loss);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("retain_graph"));
  // retain_graph keeps the graph for one more pass, which then releases it.
  Variable loss2 = Unwrap(TwoPathLoss(x));
  ASSERT_TRUE(Backward(loss2, true).ok());
  ASSERT_TRUE(Backward(loss2, false).ok());
  EXPECT_EQ(Backward(loss2).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(Engine, SavedTensorsAreReleasedAfterBackward) {
  const Tensor xv = Rand({3, 4}, 8);
  Variable x = Variable::Leaf(xv, true, "x");
  const long before = x.value().local().storage().use_count();
  Variable y = Unwrap(Mul(x, x));  // saves x twice
  Variable loss = Unwrap(Sum(y));
  EXPECT_GT(x.value().local().storage().use_count(), before) << "Mul saved nothing?";
  ASSERT_TRUE(Backward(loss, /*retain_graph=*/true).ok());
  EXPECT_GT(x.value().local().storage().use_count(), before) << "retain_graph released the saved x";
  ASSERT_TRUE(Backward(loss).ok());
  EXPECT_EQ(x.value().local().storage().use_count(), before) << "the graph still holds x after backward";
}

TEST(Engine, GradientHooks) {
  const Tensor xv = Rand({3, 4}, 9);
  // A hook on a leaf replaces the gradient before it is accumulated.
  {
    Variable x = Variable::Leaf(xv, true, "x");
    x.RegisterHook([](Value& g) -> absl::Status {
      DT_ASSIGN_OR_RETURN(g, fn::Scale(g, 2.0));
      return absl::OkStatus();
    });
    ASSERT_TRUE(Backward(Unwrap(TwoPathLoss(x))).ok());
    ExpectValues(x.grad(), Affine(xv, 4, 6), "leaf hook doubling");
  }
  // A hook on an intermediate sees dL/dh and changes what flows further back.
  {
    Variable x = Variable::Leaf(xv, true, "x");
    Variable h = Unwrap(Mul(x, x));
    const Tensor w = Rand({3, 4}, 10);
    int calls = 0;
    h.RegisterHook([&](Value& g) -> absl::Status {
      ++calls;
      testing::ExpectNear(Values(g.local()), Values(w), agtest::kTight, "dL/dh seen by the hook");
      DT_ASSIGN_OR_RETURN(g, fn::Scale(g, -1.0));
      return absl::OkStatus();
    });
    Variable loss = Unwrap(Sum(Unwrap(Mul(h, Variable::Constant(w)))));
    ASSERT_TRUE(Backward(loss).ok());
    EXPECT_EQ(calls, 1);
    // dL/dx = -(w * 2x)
    std::vector<double> e = Values(xv), wv = Values(w);
    for (size_t i = 0; i < e.size(); ++i) e[i] = -2 * e[i] * wv[i];
    ExpectValues(x.grad(), testing::FromDoubles(e, xv.shape(), DType::kFloat32), "intermediate hook negating");
  }
  // A hook's error stops the pass.
  {
    Variable x = Variable::Leaf(xv, true, "x");
    x.RegisterHook([](Value&) { return absl::InternalError("hook says no"); });
    absl::Status st = Backward(Unwrap(TwoPathLoss(x)));
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
    EXPECT_FALSE(x.grad().defined());
  }
}

TEST(Engine, PostAccumulateHookRunsOncePerLeafPerBackward) {
  const Tensor xv = Rand({3, 4}, 11), wv = Rand({4}, 12);
  Variable x = Variable::Leaf(xv, true, "x");
  Variable w = Variable::Leaf(wv, true, "w");
  int x_calls = 0, w_calls = 0;
  std::vector<std::vector<double>> seen;
  x.RegisterPostAccumulateGradHook([&](Variable& v) -> absl::Status {
    ++x_calls;
    if (!v.grad().defined()) return absl::InternalError("grad not accumulated yet");
    seen.push_back(Values(v.grad().local()));
    return absl::OkStatus();
  });
  w.RegisterPostAccumulateGradHook([&](Variable&) -> absl::Status {
    ++w_calls;
    return absl::OkStatus();
  });
  // x reaches the loss along three paths, w along two.
  auto build = [&]() -> absl::StatusOr<Variable> {
    DT_ASSIGN_OR_RETURN(Variable a, Mul(x, w));
    DT_ASSIGN_OR_RETURN(Variable b, Add(a, x));
    DT_ASSIGN_OR_RETURN(Variable c, Mul(b, x));
    DT_ASSIGN_OR_RETURN(Variable d, Add(c, w));
    return Sum(d);
  };
  Variable loss = Unwrap(build());
  ASSERT_TRUE(Backward(loss, true).ok());
  EXPECT_EQ(x_calls, 1);
  EXPECT_EQ(w_calls, 1);
  ASSERT_TRUE(Backward(loss).ok());
  EXPECT_EQ(x_calls, 2);
  EXPECT_EQ(w_calls, 2);
  // loss = sum((x w + x) x + w): dx = 2x(w + 1), dw = sum_rows(x^2) + 3.
  std::vector<double> dx = Values(xv), dw(4, 3.0);
  const std::vector<double> wvv = Values(wv), xvv = Values(xv);
  for (size_t i = 0; i < dx.size(); ++i) {
    dx[i] = 2 * xvv[i] * (wvv[i % 4] + 1);
    dw[i % 4] += xvv[i] * xvv[i];
  }
  ASSERT_EQ(seen.size(), 2u);
  testing::ExpectNear(seen[0], dx, agtest::kTight, "x.grad in the first hook call");
  for (double& e : dx) e *= 2;
  for (double& e : dw) e *= 2;
  testing::ExpectNear(seen[1], dx, agtest::kTight, "x.grad in the second hook call (accumulated)");
  testing::ExpectNear(Values(w.grad().local()), dw, agtest::kTight, "w.grad after two passes");
}

TEST(Engine, Roots) {
  const Tensor xv = Rand({2, 3}, 13), gv = Rand({2, 3}, 14);
  Variable x = Variable::Leaf(xv, true, "x");
  Variable y = Unwrap(Scale(x, 2.0));
  // A non-scalar root needs a gradient.
  absl::Status st = Backward(y);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_FALSE(x.grad().defined());
  ASSERT_TRUE(Backward({y}, {Value(gv)}).ok());
  ExpectValues(x.grad(), Affine(gv, 2, 0), "d(2x)/dx . g");
  // A root that does not require grad.
  Variable c = Variable::Constant(xv);
  EXPECT_EQ(Backward(Unwrap(Sum(c))).code(), absl::StatusCode::kInvalidArgument);
  // Several roots: their gradients add up.
  Variable x2 = Variable::Leaf(xv, true, "x2");
  Variable a = Unwrap(Sum(x2));
  Variable b = Unwrap(Sum(Unwrap(Scale(x2, 3.0))));
  ASSERT_TRUE(Backward({a, b}, {}).ok());
  ExpectValues(x2.grad(), Affine(xv, 0, 4), "two roots");
  // A leaf root: its own gradient is the ones.
  Variable s = Variable::Leaf(Unwrap(Full({}, 2.0, DType::kFloat32)), true, "s");
  ASSERT_TRUE(Backward(s).ok());
  ExpectValues(s.grad(), Unwrap(Full({}, 1.0, DType::kFloat32)), "leaf root");
}

TEST(Engine, UnaryWithoutGradientIsRefusedUnlessNoGrad) {
  Variable x = Variable::Leaf(Rand({3}, 15), true, "x");
  auto y = Unary(UnaryOp::kAbs, x);
  EXPECT_EQ(y.status().code(), absl::StatusCode::kUnimplemented) << y.status();
  NoGradGuard ng;
  EXPECT_TRUE(Unary(UnaryOp::kAbs, x).ok());
}

// Outputs that do not reach the loss get no gradient; their producer still runs for the others.
TEST(Engine, UnusedOutputsGetNoGradient) {
  const Tensor xv = Rand({2, 6}, 16);
  Variable x = Variable::Leaf(xv, true, "x");
  std::vector<Variable> parts = Unwrap(Split(x, 2, 1));
  ASSERT_EQ(parts.size(), 3u);
  Variable loss = Unwrap(Sum(Unwrap(Scale(parts[1], 5.0))));
  ASSERT_TRUE(Backward(loss).ok());
  const std::vector<double> want = {0, 0, 5, 5, 0, 0, 0, 0, 5, 5, 0, 0};
  testing::ExpectNear(Values(x.grad().local()), want, agtest::kTight, "gradient of the middle part");
  // A leaf that is not on the path to the root keeps no gradient.
  Variable other = Variable::Leaf(xv, true, "other");
  Variable unused = Unwrap(Mul(other, x));
  (void)unused;
  ASSERT_TRUE(Backward(Unwrap(Sum(x))).ok());
  EXPECT_FALSE(other.grad().defined());
}

// Split's backward concatenates the parts' gradients in one pass. Where they already lie side
// by side in one buffer, as CausalAttentionBackward writes dq, dk and dv for the heads of one qkv
// projection, the concatenation is that buffer, uncopied; anything else is copied.
TEST(Engine, SplitBackwardOfAdjacentGradientsIsTheirBuffer) {
  const Tensor buf = Rand({2, 3, 12}, 17);
  std::vector<Value> parts;
  for (int64_t j = 0; j < 3; ++j) parts.push_back(Value(Unwrap(buf.Narrow(2, 4 * j, 4))));
  const Value whole = Unwrap(fn::SplitBackward(parts, 2));
  EXPECT_EQ(whole.local().storage(), buf.storage());
  ExpectValues(whole, buf, "adjacent parts");

  // Out of order, or rows with a gap between them: copies, with Cat's values.
  const std::vector<Value> swapped = {parts[1], parts[0], parts[2]};
  const Value cat = Unwrap(fn::SplitBackward(swapped, 2));
  EXPECT_NE(cat.local().storage(), buf.storage());
  ExpectValues(cat, Unwrap(Cat({parts[1].local(), parts[0].local(), parts[2].local()}, 2)), "swapped parts");
  const Tensor gapped = Rand({2, 3, 13}, 18);
  std::vector<Value> rows;
  for (int64_t j = 0; j < 3; ++j) rows.push_back(Value(Unwrap(gapped.Narrow(2, 4 * j, 4))));
  const Value copied = Unwrap(fn::SplitBackward(rows, 2));
  EXPECT_NE(copied.local().storage(), gapped.storage());
  ExpectValues(copied, Unwrap(Contiguous(Unwrap(gapped.Narrow(2, 0, 12)))), "parts of rows with a gap");
  // Along the first dim: [2, 3] and [1, 3] of one [3, 3] buffer, in order.
  const Tensor rows3 = Rand({3, 3}, 19);
  const Value stacked =
      Unwrap(fn::SplitBackward({Value(Unwrap(rows3.Narrow(0, 0, 2))), Value(Unwrap(rows3.Narrow(0, 2, 1)))}, 0));
  EXPECT_EQ(stacked.local().storage(), rows3.storage());
  ExpectValues(stacked, rows3, "dim 0");
}

// ---- DTensor boundaries ----

// Forward x (layout `from`) -> Redistribute(to) -> sum(y * W): the gradient of x is W laid out
// as `from` with Partial read as Replicate.
void CheckRedistributeBackward(IntSpan mesh_shape, const Layout& from, const Layout& to, const Layout& want_grad) {
  const Tensor xv = Rand({5, 6}, 21), wv = Rand({5, 6}, 22);
  agtest::RunMesh(mesh_shape, [&](const DeviceMesh& mesh) {
    const std::string what = absl::StrCat(agtest::MeshName(mesh_shape), " ", from.ToString(), " -> ", to.ToString());
    Variable x = Variable::Leaf(Unwrap(DTensor::Distribute(xv, mesh, from, {.src_rank = std::nullopt})), true, "x");
    Variable y = Unwrap(Redistribute(x, to));
    ASSERT_EQ(y.value().dtensor().layout(), to);
    Variable loss = Unwrap(Sum(Unwrap(Mul(y, Variable::Constant(wv)))));
    ASSERT_TRUE(Backward(loss).ok()) << what;
    ASSERT_TRUE(x.grad().is_dtensor()) << what;
    EXPECT_EQ(x.grad().dtensor().layout(), want_grad) << what;
    ExpectValues(x.grad(), wv, what + ": gradient");
  });
}

TEST(Engine, RedistributeBackwardIsTheTransposedRedistribution) {
  for (int64_t n : {2, 4}) {
    CheckRedistributeBackward({n}, {S0}, {R}, {S0});  // all_gather forward, the gradient comes back S(0)
    CheckRedistributeBackward({n}, {P}, {R}, {R});    // all_reduce forward, the gradient stays R
    CheckRedistributeBackward({n}, {R}, {S1}, {R});   // a local slice forward, R back
    CheckRedistributeBackward({n}, {S0}, {S1}, {S0});
    CheckRedistributeBackward({n}, {R}, {P}, {R});
  }
  CheckRedistributeBackward({2, 2}, {S0, S1}, {R, R}, {S0, S1});
  CheckRedistributeBackward({2, 2}, {P, S0}, {R, S1}, {R, S0});
}

// With a Partial gradient arriving at Redistribute(S(0) -> R), the backward is one
// reduce_scatter (the transpose of the forward all_gather).
TEST(Engine, RedistributeBackwardOfAllGatherIsReduceScatter) {
  const Tensor xv = Rand({5, 6}, 23), gv = Rand({5, 6}, 24);
  for (int64_t n : {2, 4}) {
    agtest::RunMesh({n}, [&](const DeviceMesh& mesh) {
      Variable x = Variable::Leaf(Unwrap(DTensor::Distribute(xv, mesh, {S0}, {.src_rank = std::nullopt})), true, "x");
      Variable y = Unwrap(Redistribute(x, {R}));
      DTensor g = Unwrap(DTensor::Distribute(gv, mesh, {P}, {.src_rank = std::nullopt}));
      CommCounter counter;
      SetCommCounter(mesh, &counter);
      absl::Status st = Backward({y}, {Value(g)});
      SetCommCounter(mesh, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(counter.calls(CommKind::kReduceScatter), 1) << counter.ToString();
      EXPECT_EQ(counter.total_calls(), 1) << counter.ToString();
      EXPECT_EQ(x.grad().dtensor().layout(), Layout({S0}));
      ExpectValues(x.grad(), gv, "reduce-scattered gradient");
    });
  }
}

TEST(Engine, RedistributeOfAPlainTensorIsRefused) {
  Variable x = Variable::Leaf(Rand({2, 2}, 25), true);
  auto y = Redistribute(x, {R});
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument) << y.status();
}

// Data parallel: the batch is Shard(0) (uneven: 5 rows), the parameters Replicate leaves. Their
// gradients come out Partial(sum) (each rank's batch rows' contribution) and, reduced to
// Replicate, equal the single-rank gradients.
TEST(Engine, DataParallelLinearGradientIsPartial) {
  const Tensor xv = Rand({5, 6}, 31), wv = Rand({3, 6}, 32), bv = Rand({3}, 33);
  auto loss_of = [](const Variable& x, const Variable& w, const Variable& b) -> absl::StatusOr<Variable> {
    DT_ASSIGN_OR_RETURN(Variable y, Linear(x, w, b));
    DT_ASSIGN_OR_RETURN(Variable a, Gelu(y));
    return Mean(a);
  };
  Variable w1 = Variable::Leaf(wv, true, "w"), b1 = Variable::Leaf(bv, true, "b");
  Variable l1 = Unwrap(loss_of(Variable::Constant(xv), w1, b1));
  ASSERT_TRUE(Backward(l1).ok());
  const Tensor dw = w1.grad().local(), db = b1.grad().local();
  for (int64_t n : {2, 4}) {
    agtest::RunMesh({n}, [&](const DeviceMesh& mesh) {
      const std::string what = absl::StrCat(n, " ranks");
      Variable x = Variable::Constant(Unwrap(DTensor::Distribute(xv, mesh, {S0}, {.src_rank = std::nullopt})));
      Variable w = Variable::Leaf(Unwrap(DTensor::Distribute(wv, mesh, {R}, {.src_rank = std::nullopt})), true, "w");
      Variable b = Variable::Leaf(Unwrap(DTensor::Distribute(bv, mesh, {R}, {.src_rank = std::nullopt})), true, "b");
      Variable loss = Unwrap(loss_of(x, w, b));
      EXPECT_EQ(loss.value().dtensor().layout(), Layout({P})) << loss.value().ToString();
      agtest::ExpectClose(loss.value(), l1.value().local(), what + " loss");
      ASSERT_TRUE(Backward(loss).ok());
      ASSERT_TRUE(w.grad().is_dtensor() && b.grad().is_dtensor());
      EXPECT_EQ(w.grad().dtensor().layout(), Layout({P})) << w.grad().ToString();
      EXPECT_EQ(b.grad().dtensor().layout(), Layout({P})) << b.grad().ToString();
      // Partial indeed: this rank holds its rows' contribution only.
      if (mesh.coordinate(0) == 0) {
        std::vector<double> mine = Values(w.grad().local()), full = Values(dw);
        double diff = 0;
        for (size_t i = 0; i < full.size(); ++i) diff += std::fabs(mine[i] - full[i]);
        EXPECT_GT(diff, 1e-4) << "rank 0's partial gradient is already the full one";
      }
      DTensor gw = Unwrap(w.grad().dtensor().Redistribute({R}));
      DTensor gb = Unwrap(b.grad().dtensor().Redistribute({R}));
      testing::ExpectNear(Values(gw.ToLocal()), Values(dw), agtest::kTight, what + " dw reduced to R");
      testing::ExpectNear(Values(gb.ToLocal()), Values(db), agtest::kTight, what + " db reduced to R");
      // A second micro-batch accumulates into the Partial gradient.
      Variable loss2 = Unwrap(loss_of(x, w, b));
      ASSERT_TRUE(Backward(loss2).ok());
      EXPECT_EQ(w.grad().dtensor().layout(), Layout({P}));
      agtest::ExpectClose(w.grad(), Affine(dw, 2, 0), what + " dw after two micro-batches");
    });
  }
}

// DDP's pattern: a post-accumulate hook reduces each Partial gradient to Replicate right away
// (set_grad); the next backward accumulates its Partial gradient into that Replicate one.
TEST(Engine, PostAccumulateHookReducesPartialGradients) {
  const Tensor xv = Rand({5, 6}, 34), wv = Rand({3, 6}, 35);
  Variable w1 = Variable::Leaf(wv, true, "w");
  ASSERT_TRUE(Backward(Unwrap(Sum(Unwrap(Linear(Variable::Constant(xv), w1))))).ok());
  const Tensor dw = w1.grad().local();
  agtest::RunMesh({4}, [&](const DeviceMesh& mesh) {
    Variable x = Variable::Constant(Unwrap(DTensor::Distribute(xv, mesh, {S0}, {.src_rank = std::nullopt})));
    Variable w = Variable::Leaf(Unwrap(DTensor::Distribute(wv, mesh, {R}, {.src_rank = std::nullopt})), true, "w");
    int calls = 0;
    w.RegisterPostAccumulateGradHook([&](Variable& v) -> absl::Status {
      ++calls;
      if (v.grad().dtensor().layout().has_partial()) {
        DT_ASSIGN_OR_RETURN(DTensor r, v.grad().dtensor().Redistribute({R}));
        v.set_grad(r);
      }
      return absl::OkStatus();
    });
    for (int step = 1; step <= 2; ++step) {
      ASSERT_TRUE(Backward(Unwrap(Sum(Unwrap(Linear(x, w))))).ok());
      EXPECT_EQ(calls, step);
      EXPECT_EQ(w.grad().dtensor().layout(), Layout({R}));
      testing::ExpectNear(Values(w.grad().local()), Values(Affine(dw, step, 0)), agtest::kTight,
                          absl::StrCat("replicated dw after ", step, " passes"));
    }
  });
}

// Gradients with different layouts reaching one variable are combined by the dispatched Add.
TEST(Engine, GradientsOfDifferentLayoutsAreSummed) {
  const Tensor xv = Rand({4, 6}, 41), cv = Rand({4, 6}, 42);
  agtest::RunMesh({2}, [&](const DeviceMesh& mesh) {
    Variable x = Variable::Leaf(Unwrap(DTensor::Distribute(xv, mesh, {R}, {.src_rank = std::nullopt})), true, "x");
    Variable c = Variable::Constant(Unwrap(DTensor::Distribute(cv, mesh, {S0}, {.src_rank = std::nullopt})));
    Variable a = Unwrap(Mul(x, c));             // gradient to x laid out S(0)
    Variable b = Unwrap(Scale(x, 2.0));         // gradient to x laid out R
    Variable p = Unwrap(Redistribute(x, {P}));  // and through P
    Variable loss = Unwrap(Add(Unwrap(Add(Unwrap(Sum(a)), Unwrap(Sum(b)))), Unwrap(Sum(p))));
    ASSERT_TRUE(Backward(loss).ok());
    ExpectValues(x.grad(), Affine(cv, 1, 3), "c + 2 + 1");
  });
}

// FromLocal / ToLocal: the gradient crosses between a rank's piece and the DTensor.
TEST(Engine, FromLocalAndToLocal) {
  const Tensor xv = Rand({5, 6}, 51), wv = Rand({5, 6}, 52);
  for (int64_t n : {2, 4}) {
    agtest::RunMesh({n}, [&](const DeviceMesh& mesh) {
      const LocalBox box = LocalBoxOf(xv.shape(), mesh.shape(), Layout({S0}), mesh.coordinate());
      const Tensor mine = Unwrap(Contiguous(Unwrap(xv.Narrow(0, box.offset[0], box.shape[0]))));
      const Tensor wmine = Unwrap(Contiguous(Unwrap(wv.Narrow(0, box.offset[0], box.shape[0]))));
      // FromLocal: loss = sum(gelu(X) * W) over the global X; d/d(local) = this rank's rows.
      Variable local = Variable::Leaf(mine, true, "local");
      Variable d = Unwrap(FromLocal(local, mesh, {S0}, {.global_shape = Shape{5, 6}}));
      Variable loss = Unwrap(Sum(Unwrap(Mul(Unwrap(Gelu(d)), Variable::Constant(wv)))));
      ASSERT_TRUE(Backward(loss).ok());
      ASSERT_FALSE(local.grad().is_dtensor());
      const Tensor want = Unwrap(fn::UnaryBackward(UnaryOp::kGelu, wmine, mine)).local();
      testing::ExpectNear(Values(local.grad().local()), Values(want), agtest::kTight, "FromLocal gradient");
      // ToLocal: each rank's local loss; the DTensor's gradient is each rank's piece, S(0).
      Variable x = Variable::Leaf(Unwrap(DTensor::Distribute(xv, mesh, {S0}, {.src_rank = std::nullopt})), true, "x");
      Variable l = Unwrap(ToLocal(x));
      ASSERT_FALSE(l.value().is_dtensor());
      Variable ll = Unwrap(Sum(Unwrap(Mul(l, Variable::Constant(wmine)))));
      ASSERT_TRUE(Backward(ll).ok());
      ASSERT_TRUE(x.grad().is_dtensor());
      EXPECT_EQ(x.grad().dtensor().layout(), Layout({S0}));
      ExpectValues(x.grad(), wv, "ToLocal gradient");
      // ToLocal of a Replicate DTensor whose local tensor then meets a DTensor (as Replicate):
      // its gradient arrives as that op's DTensor (here S(1)) and is the whole one, reduced;
      // it used to be wrapped as it came, a Replicate [5, 6] holding a [5, 6 / n] piece.
      Variable xr = Variable::Leaf(Unwrap(DTensor::Distribute(xv, mesh, {R}, {.src_rank = std::nullopt})), true, "xr");
      const Variable w = Variable::Constant(Unwrap(DTensor::Distribute(wv, mesh, {S1}, {.src_rank = std::nullopt})));
      Variable lr = Unwrap(Sum(Unwrap(Mul(Unwrap(ToLocal(xr)), w))));
      ASSERT_TRUE(Backward(lr).ok());
      ASSERT_TRUE(xr.grad().is_dtensor());
      EXPECT_EQ(xr.grad().dtensor().layout(), Layout({R}));
      EXPECT_EQ(xr.grad().local().shape(), IntSpan({5, 6}));
      ExpectValues(xr.grad(), wv, "ToLocal gradient arriving as a DTensor");
    });
  }
}

// QueueBackwardCallback: a callback at a sequence mark runs once every node recorded after
// the mark has run (before the first older node: FSDP's post-backward of a module whose
// forward began at the mark), one at 0 when the pass ends; a cast's gradient comes back in
// the input's dtype.
TEST(Engine, BackwardCallbacksRunWhenTheirPartOfTheGraphIsDone) {
  Variable w = Variable::Leaf(Rand({2, 3}, 7), true, "w");
  Variable a = Unwrap(Scale(w, 2.0));  // older than the mark
  const uint64_t mark = NextSequenceNr();
  Variable b = Unwrap(Scale(a, 3.0));  // the "module": b, c
  Variable c = Unwrap(Cast(b, DType::kBFloat16));
  Variable loss = Unwrap(Sum(Unwrap(Cast(c, DType::kFloat32))));
  std::vector<std::string> log;
  EXPECT_FALSE(InBackward());
  EXPECT_TRUE(absl::IsFailedPrecondition(QueueBackwardCallback(0, [] { return absl::OkStatus(); })));
  c.RegisterHook([&](Value&) -> absl::Status {
    log.push_back("c");
    EXPECT_TRUE(InBackward());
    DT_RETURN_IF_ERROR(QueueBackwardCallback(0, [&] { return log.push_back("end"), absl::OkStatus(); }));
    return QueueBackwardCallback(mark, [&] {
      log.push_back(absl::StrCat("mark, w.grad ", w.grad().defined() ? "set" : "unset"));
      return absl::OkStatus();
    });
  });
  a.RegisterHook([&](Value&) { return log.push_back("a"), absl::OkStatus(); });
  ASSERT_TRUE(Backward(loss).ok());
  EXPECT_EQ(log, (std::vector<std::string>{"c", "mark, w.grad unset", "a", "end"}));
  EXPECT_EQ(w.grad().dtype(), DType::kFloat32);
  ExpectValues(w.grad(), Affine(Rand({2, 3}, 7), 0, 6), "d/dw sum(6w)");
  EXPECT_FALSE(InBackward());
}

TEST(Engine, AFailingBackwardCallbackStopsThePass) {
  Variable w = Variable::Leaf(Rand({2}, 8), true, "w");
  Variable y = Unwrap(Scale(w, 2.0));
  y.RegisterHook(
      [](Value&) { return QueueBackwardCallback(0, [] { return absl::FailedPreconditionError("callback failed"); }); });
  const absl::Status s = Backward(Unwrap(Sum(y)));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(s.message(), "callback failed");
}

// ---- Adding into a pending gradient (Node::ApplyInto) ----

// Two nodes feed x: "late" (recorded second, so it runs first) delivers gA; "early" has an into
// backward. The pass offers it gA only where the pass alone holds gA; where the test keeps a copy
// of gA, the dense backward runs and gA keeps its values.
TEST(Engine, PendingGradientsAreOfferedOnlyWhereOnlyThePassHoldsThem) {
  for (const bool share : {false, true}) {
    SCOPED_TRACE(share ? "gA shared with the test" : "gA held by the pass alone");
    const Tensor xv = Rand({2, 3}, 41), ga_values = Rand({2, 3}, 42), gb = Rand({2, 3}, 43);
    Variable x = Variable::Leaf(xv, true, "x");
    Tensor held;  // the test's copy of gA when shared
    int offered = 0, dense = 0;
    Variable early = Record("Early", {x}, {Value(Unwrap(Clone(xv)))}, [&](std::vector<Value>&) {
      ++dense;
      return absl::StatusOr<std::vector<Value>>(std::vector<Value>{Value(gb)});
    })[0];
    auto* node = dynamic_cast<FunctionNode*>(early.grad_fn().get());
    ASSERT_NE(node, nullptr);
    node->set_into(
        [&](std::vector<Value>&, absl::Span<const Tensor* const> pending) -> absl::StatusOr<std::vector<Value>> {
          EXPECT_EQ(pending.size(), 1u);
          if (pending.empty() || pending[0] == nullptr) {
            ++dense;
            return std::vector<Value>{Value(gb)};
          }
          ++offered;
          DT_RETURN_IF_ERROR(Add_(*pending[0], gb));
          return std::vector<Value>{Value()};
        });
    Variable late = Record("Late", {x}, {Value(Unwrap(Clone(xv)))}, [&](std::vector<Value>&) {
      Tensor ga = Unwrap(Clone(ga_values));
      if (share) held = ga;
      return absl::StatusOr<std::vector<Value>>(std::vector<Value>{Value(ga)});
    })[0];
    ASSERT_TRUE(Backward({early, late}, {Value(Rand({2, 3}, 44)), Value(Rand({2, 3}, 45))}).ok());
    EXPECT_EQ(offered, share ? 0 : 1);
    EXPECT_EQ(dense, share ? 1 : 0);
    std::vector<double> want = Values(ga_values);
    const std::vector<double> b = Values(gb);
    for (size_t i = 0; i < want.size(); ++i) want[i] += b[i];
    ExpectValues(x.grad(), testing::FromDoubles(want, {2, 3}, DType::kFloat32), "x.grad = gA + gB");
    if (share) {
      EXPECT_EQ(Values(held), Values(ga_values)) << "the shared gA was written";
    }
  }
}

// A table used twice, as GPT-2 ties its embedding and its head: logits = E W^T with E = W[ids],
// loss = sum(logits * R). Against float64 loops: d/dW[v] = sum_p R[p, v] E[p] (the head) plus,
// at each row ids[p], sum_v R[p, v] W[v] (the lookup), with ids repeating. The lookup adds its
// rows into the head's gradient: the backward pass holds one [V, C] gradient at a time, not a
// [V, C] of zeros and a sum beside it. A second pass accumulates into the table's gradient.
TEST(Engine, TiedEmbeddingAddsItsRowsIntoTheHeadsGradient) {
  constexpr int64_t V = 4096, C = 64;
  const std::vector<int64_t> ids = {3, 17, 3, 4095, 0, 17, 3};
  const int64_t P = static_cast<int64_t>(ids.size());
  const Tensor wv = Rand({V, C}, 51), rv = Rand({P, V}, 52);
  const std::vector<double> w = Values(wv), r = Values(rv);
  std::vector<double> want(static_cast<size_t>(V * C), 0.0);
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t v = 0; v < V; ++v) {
      for (int64_t c = 0; c < C; ++c) {
        const double rpv = r[static_cast<size_t>(p * V + v)];
        want[static_cast<size_t>(v * C + c)] += rpv * w[static_cast<size_t>(ids[static_cast<size_t>(p)] * C + c)];
        want[static_cast<size_t>(ids[static_cast<size_t>(p)] * C + c)] += rpv * w[static_cast<size_t>(v * C + c)];
      }
    }
  }
  Variable table = Variable::Leaf(wv, true, "table");
  std::vector<double> hook_saw;  // a hook on the table sees the whole sum
  table.RegisterHook([&](Value& g) { return hook_saw = Values(g.local()), absl::OkStatus(); });
  Variable idv = Variable::Constant(Unwrap(Tensor::FromVector<int64_t>(ids, {P})));
  Variable e = Unwrap(Embedding(table, idv));                           // [P, C]
  Variable logits = Unwrap(Matmul(e, table, false, /*trans_b=*/true));  // [P, V]
  Variable loss = Unwrap(Sum(Unwrap(Mul(logits, Variable::Constant(rv)))));
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  const int64_t table_bytes = V * C * 4;
  const int64_t before = alloc.Stats().bytes_in_use;
  alloc.ResetPeakStats();
  // Each element sums ~2 x 4096 float32 products of up to ~20 in magnitude.
  constexpr testing::Tolerance kSums = {1e-4, 3e-4};
  ASSERT_TRUE(Backward(loss, /*retain_graph=*/true).ok());
  // The table's gradient, the logits' gradient [P, V] and small ones; the dense path would hold
  // two more [V, C] (the zeros scattered into, and the sum).
  EXPECT_LT(alloc.Stats().peak_bytes_in_use - before, table_bytes + table_bytes / 2);
  agtest::ExpectClose(table.grad(), testing::FromDoubles(want, {V, C}, DType::kFloat32), "d/dtable, one pass", kSums);
  agtest::ExpectClose(Value(testing::FromDoubles(hook_saw, {V, C}, DType::kFloat32)),
                      testing::FromDoubles(want, {V, C}, DType::kFloat32), "the table's hook", kSums);
  ASSERT_TRUE(Backward(loss).ok());
  for (double& x : want) x *= 2;
  agtest::ExpectClose(table.grad(), testing::FromDoubles(want, {V, C}, DType::kFloat32), "d/dtable, two passes", kSums);
}

}  // namespace
}  // namespace dtensor
