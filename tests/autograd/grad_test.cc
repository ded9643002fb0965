// Gradients of every differentiable op of autograd/ops.h.
//
// For each op y = op(inputs), the scalar loss is L = sum(y * W) with fixed random weights W.
//   - 1 rank (plain Tensors): the tape's gradient of every float input equals central finite
//     differences of the same float32 forward (L accumulated in float64), within 1e-2 relative
//     (+ a small absolute term for float32 rounding).
//   - 2 and 4 thread ranks and a 2x2 mesh: with the inputs as DTensors in each sensible layout
//     (batch-sharded, replicated, Partial, and for linear/matmul the colwise/rowwise and
//     contraction-sharded forms; on 2x2 every product of two of them), the loss and the
//     gathered gradients equal the single-rank ones within 1e-5.
// Together: the gradient matches finite differences on 1, 2 and 4 ranks for each layout.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/device.h"
#include "gtest/gtest.h"
#include "tests/autograd/autograd_test_util.h"

namespace dtensor {
namespace {

using agtest::Ids;
using agtest::Rand;
using testing::Unwrap;

using namespace agtest::placements;  // R, S0, S1, S2, S3, P, PA, PM

using FwdFn = std::function<absl::StatusOr<Variable>(const std::vector<Variable>&)>;

struct GradCase {
  std::string name;
  std::vector<Tensor> inputs;
  std::vector<bool> diff;  // which inputs require grad
  FwdFn fwd;
  // One-mesh-dim layouts: each entry gives one placement per input. A k-d mesh runs every
  // product of k entries.
  std::vector<std::vector<Placement>> dims;
  double h = 1e-2;  // finite-difference step
};

// Values of y as float64 dotted with W.
double Dot(const Tensor& y, const Tensor& w) {
  const std::vector<double> a = testing::Values(y), b = testing::Values(w);
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Forward + L = sum(y * W) + backward on `values` (plain or DTensors). Returns the loss and one
// gradient per input (undefined where none), or an error.
struct Result {
  Value loss;
  std::vector<Value> grads;
};
absl::StatusOr<Result> RunGrad(const GradCase& c, const std::vector<Value>& values, const Tensor& w) {
  std::vector<Variable> leaves;
  for (size_t i = 0; i < values.size(); ++i) leaves.push_back(Variable::Leaf(values[i], c.diff[i], "in"));
  DT_ASSIGN_OR_RETURN(Variable y, c.fwd(leaves));
  DT_ASSIGN_OR_RETURN(Variable yw, Mul(y, Variable::Constant(Value(w))));
  DT_ASSIGN_OR_RETURN(Variable loss, Sum(yw));
  DT_RETURN_IF_ERROR(Backward(loss));
  Result r;
  r.loss = loss.value();
  for (const Variable& l : leaves) r.grads.push_back(l.grad());
  return r;
}

// All k-products of the case's one-dim layouts, as Layouts per input.
std::vector<std::vector<Layout>> Products(const GradCase& c, int k) {
  std::vector<std::vector<Layout>> out;
  const size_t n = c.dims.size();
  size_t total = 1;
  for (int m = 0; m < k; ++m) total *= n;
  for (size_t idx = 0; idx < total; ++idx) {
    std::vector<Placements> ps(c.inputs.size());
    size_t rest = idx;
    for (int m = 0; m < k; ++m) {
      const std::vector<Placement>& d = c.dims[rest % n];
      rest /= n;
      for (size_t i = 0; i < c.inputs.size(); ++i) ps[i].push_back(d[i]);
    }
    std::vector<Layout> ls;
    bool ok = true;
    for (size_t i = 0; i < c.inputs.size() && ok; ++i) {
      auto l = NormalizeLayout("test", Layout(ps[i]), c.inputs[i].dim(), k);
      ok = l.ok();
      if (ok) ls.push_back(*l);
    }
    if (ok) out.push_back(ls);
  }
  return out;
}

void CheckGrad(const GradCase& c) {
  SCOPED_TRACE(c.name);
  // ---- 1 rank: tape vs finite differences ----
  std::vector<Value> plain(c.inputs.begin(), c.inputs.end());
  Tensor y0;
  {
    NoGradGuard ng;
    std::vector<Variable> cs;
    for (const Tensor& t : c.inputs) cs.push_back(Variable::Constant(Value(t)));
    auto y = c.fwd(cs);
    ASSERT_TRUE(y.ok()) << y.status();
    y0 = y->value().local();
  }
  const Tensor w = Rand(y0.shape(), 7919, -1, 1);
  auto ref = RunGrad(c, plain, w);
  ASSERT_TRUE(ref.ok()) << "single rank: " << ref.status();
  EXPECT_NEAR(testing::Values(ref->loss.local())[0], Dot(y0, w), 1e-4 * (1 + std::fabs(Dot(y0, w))));
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    if (!c.diff[i]) {
      EXPECT_FALSE(ref->grads[i].defined()) << "input " << i << " does not require grad";
      continue;
    }
    ASSERT_TRUE(ref->grads[i].defined()) << "no gradient for input " << i;
    auto f = [&](const std::vector<double>& v) {
      NoGradGuard ng;
      std::vector<Variable> cs;
      for (size_t j = 0; j < c.inputs.size(); ++j) {
        cs.push_back(Variable::Constant(
            Value(j == i ? testing::FromDoubles(v, c.inputs[j].shape(), DType::kFloat32) : c.inputs[j])));
      }
      return Dot(Unwrap(c.fwd(cs), "forward").value().local(), w);
    };
    const std::vector<double> fd = testing::FiniteDifference(f, testing::Values(c.inputs[i]), c.h);
    const std::vector<double> g = testing::Values(ref->grads[i].local());
    testing::ExpectNear(g, fd, {1e-2, 2e-3}, absl::StrCat(c.name, " d/d input ", i, " vs finite differences"));
    double gmax = 0;
    for (double x : g) gmax = std::max(gmax, std::fabs(x));
    EXPECT_GT(gmax, 1e-3) << "input " << i << ": a zero gradient checks nothing";
  }
  // ---- 1 GPU, where one is visible: the same loss and gradients on cuda:0 (plain Tensors) ----
  if (CudaDeviceCount() > 0) {
    auto gpu = [](const Tensor& t) { return Unwrap(To(t, Device::Cuda(0)), "to cuda:0"); };
    std::vector<Value> on_gpu;
    for (const Tensor& t : c.inputs) on_gpu.push_back(Value(gpu(t)));
    auto r = RunGrad(c, on_gpu, gpu(w));
    ASSERT_TRUE(r.ok()) << "cuda:0: " << r.status();
    EXPECT_EQ(r->loss.local().device(), Device::Cuda(0));
    // Reductions run in another order on the GPU (and exp/tanh are other approximations).
    const testing::Tolerance tol = {1e-4, 1e-5};
    agtest::ExpectClose(r->loss, ref->loss.local(), c.name + " loss on cuda:0", tol);
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      if (!c.diff[i]) continue;
      ASSERT_TRUE(r->grads[i].defined()) << "cuda:0: no gradient for input " << i;
      EXPECT_EQ(r->grads[i].local().device(), Device::Cuda(0)) << "input " << i;
      agtest::ExpectClose(r->grads[i], ref->grads[i].local(), absl::StrCat(c.name, " d/d input ", i, " on cuda:0"),
                          tol);
    }
  }
  // ---- 2, 4 ranks and 2x2: equal to the single-rank gradient ----
  for (const Shape& ms : agtest::MeshShapes()) {
    agtest::RunMesh(ms, [&](const DeviceMesh& mesh) {
      for (const std::vector<Layout>& ls : Products(c, mesh.ndim())) {
        const std::string what =
            absl::StrCat(c.name, " on ", agtest::MeshName(ms), " inputs ", agtest::LayoutsString(ls));
        std::vector<Value> in = agtest::DistributeAll(c.inputs, mesh, ls);
        auto r = RunGrad(c, in, w);
        if (!agtest::AllOk(mesh, r.ok())) {
          if (!r.ok()) ADD_FAILURE() << what << ": " << r.status();
          continue;
        }
        agtest::ExpectClose(r->loss, ref->loss.local(), what + " loss");
        for (size_t i = 0; i < c.inputs.size(); ++i) {
          if (!c.diff[i]) continue;
          const Value& g = r->grads[i];
          const bool ok = g.defined() && g.is_dtensor();
          if (!agtest::AllOk(mesh, ok)) {
            ADD_FAILURE() << what << ": input " << i << "'s gradient is " << (g.defined() ? g.ToString() : "undefined");
            continue;
          }
          agtest::ExpectClose(g, ref->grads[i].local(),
                              absl::StrCat(what, " d/d input ", i, " (", g.dtensor().layout().ToString(), ")"));
        }
      }
    });
  }
}

// Uniform values with |x| in [0.2, 1] (away from the kinks of relu/max and from 0).
Tensor AwayFromZero(IntSpan shape, uint64_t seed) {
  std::vector<double> v = testing::Values(Rand(shape, seed, -1, 1));
  for (double& x : v) x = (x < 0 ? -1 : 1) * (0.2 + 0.8 * std::fabs(x));
  return testing::FromDoubles(v, shape, DType::kFloat32);
}

FwdFn Fwd1(std::function<absl::StatusOr<Variable>(const Variable&)> f) {
  return [f](const std::vector<Variable>& in) { return f(in[0]); };
}
FwdFn Fwd2(std::function<absl::StatusOr<Variable>(const Variable&, const Variable&)> f) {
  return [f](const std::vector<Variable>& in) { return f(in[0], in[1]); };
}

// ---- Pointwise ----

TEST(Grad, GpuComparisonsNeedAGpu) {
  // CheckGrad compares every op's loss and gradients on cuda:0 with the CPU's where a GPU is
  // visible; this test only says so when none is.
  if (CudaDeviceCount() == 0)
    GTEST_SKIP() << "no CUDA device visible: the cuda:0 comparisons of every case are skipped";
  EXPECT_TRUE(To(Rand({2}, 1), Device::Cuda(0)).ok());
}

TEST(Grad, Binary) {
  const Tensor a = Rand({5, 6}, 1), b6 = Rand({6}, 2), b51 = Rand({5, 1}, 3), b = Rand({5, 6}, 4);
  const Tensor pos = Rand({5, 6}, 5, 0.5, 1.5);
  CheckGrad({"add [5,6]+[6]",
             {a, b6},
             {true, true},
             Fwd2([](auto& x, auto& y) { return Add(x, y); }),
             {{R, R}, {S0, R}, {S1, S0}, {P, P}}});
  CheckGrad({"sub [5,6]-[5,1]",
             {a, b51},
             {true, true},
             Fwd2([](auto& x, auto& y) { return Sub(x, y); }),
             {{R, R}, {S0, S0}, {S1, R}, {P, P}}});
  CheckGrad({"mul [5,6]*[5,6]",
             {a, b},
             {true, true},
             Fwd2([](auto& x, auto& y) { return Mul(x, y); }),
             {{R, R}, {S0, S0}, {S1, S1}, {P, R}}});
  CheckGrad({"mul [5,6]*[6], only a",
             {a, b6},
             {true, false},
             Fwd2([](auto& x, auto& y) { return Mul(x, y); }),
             {{R, R}, {S0, R}, {S1, S0}}});
  CheckGrad({"div [5,6]/[5,6]",
             {a, pos},
             {true, true},
             Fwd2([](auto& x, auto& y) { return Div(x, y); }),
             {{R, R}, {S0, S0}, {S1, S1}, {P, R}}});
  CheckGrad({"div [5,6]/[5,1]",
             {a, Rand({5, 1}, 6, 0.5, 1.5)},
             {true, true},
             Fwd2([](auto& x, auto& y) { return Div(x, y); }),
             {{R, R}, {S0, S0}, {S1, R}}});
}

TEST(Grad, ScalarAndUnary) {
  const Tensor a = AwayFromZero({5, 6}, 11), pos = Rand({5, 6}, 12, 0.5, 2);
  const std::vector<std::vector<Placement>> d = {{R}, {S0}, {S1}, {P}};
  CheckGrad({"scale", {a}, {true}, Fwd1([](auto& x) { return Scale(x, -1.5); }), d});
  CheckGrad({"add_scalar", {a}, {true}, Fwd1([](auto& x) { return AddScalar(x, 0.5); }), d});
  for (UnaryOp op : {UnaryOp::kNeg, UnaryOp::kExp, UnaryOp::kRelu, UnaryOp::kGelu, UnaryOp::kTanh}) {
    GradCase c{
        absl::StrCat("unary ", static_cast<int>(op)), {a}, {true}, Fwd1([op](auto& x) { return Unary(op, x); }), d};
    if (op == UnaryOp::kRelu) c.h = 1e-3;
    CheckGrad(c);
  }
  for (UnaryOp op : {UnaryOp::kLog, UnaryOp::kSqrt}) {
    CheckGrad(
        {absl::StrCat("unary ", static_cast<int>(op)), {pos}, {true}, Fwd1([op](auto& x) { return Unary(op, x); }), d});
  }
}

TEST(Grad, Dropout) {
  // A fixed seed fixes the mask, so the op is linear in x.
  CheckGrad({"dropout p=0.3",
             {Rand({5, 6}, 13)},
             {true},
             Fwd1([](auto& x) { return Dropout(x, 0.3, 99); }),
             {{R}, {S0}, {S1}}});
}

// ---- Reductions ----

TEST(Grad, Reductions) {
  const Tensor x = Rand({5, 6}, 21);
  const std::vector<std::vector<Placement>> d = {{R}, {S0}, {S1}, {P}};
  CheckGrad({"sum all", {x}, {true}, Fwd1([](auto& v) { return Sum(v); }), d});
  CheckGrad({"sum dim 1", {x}, {true}, Fwd1([](auto& v) { return Sum(v, {1}); }), d});
  CheckGrad({"sum dim 0 keepdim", {x}, {true}, Fwd1([](auto& v) { return Sum(v, {0}, true); }), d});
  CheckGrad({"mean all", {x}, {true}, Fwd1([](auto& v) { return Mean(v); }), d});
  CheckGrad({"mean dim -1 keepdim", {x}, {true}, Fwd1([](auto& v) { return Mean(v, {-1}, true); }), d});
  CheckGrad({"mean dim 0", {x}, {true}, Fwd1([](auto& v) { return Mean(v, {0}); }), d});
  // Max: distinct values so that the argmax does not move within +-h.
  const std::vector<std::vector<Placement>> dm = {{R}, {S0}, {S1}};
  const Tensor xm = Rand({5, 6}, 22);
  for (std::vector<int64_t> dims : {std::vector<int64_t>{1}, std::vector<int64_t>{0}, std::vector<int64_t>{}}) {
    GradCase c{absl::StrCat("max dims [", absl::StrJoin(dims, ","), "]"),
               {xm},
               {true},
               Fwd1([dims](auto& v) { return Max(v, dims); }),
               dm};
    c.h = 1e-3;
    CheckGrad(c);
  }
  GradCase c{"max dim 1 keepdim", {xm}, {true}, Fwd1([](auto& v) { return Max(v, {1}, true); }), dm};
  c.h = 1e-3;
  CheckGrad(c);
}

// Ties of max are split evenly (torch.amax's rule), also when the tied elements sit on
// different ranks (the count of ties is then a sum over the shards).
TEST(Grad, MaxTiesAreSplitEvenlyAcrossShards) {
  // Rows: [1, 3, 3, 0, 3, 2] (three ties), [5, 1, 1, 5, 0, 0] (two), [0, 1, 2, 3, 4, 9] (none).
  const std::vector<double> xv = {1, 3, 3, 0, 3, 2, 5, 1, 1, 5, 0, 0, 0, 1, 2, 3, 4, 9};
  const Tensor x = testing::FromDoubles(xv, {3, 6}, DType::kFloat32);
  const Tensor w = testing::FromDoubles({2, 3, 6}, {3}, DType::kFloat32);
  const std::vector<double> want = {0, 2.0 / 3, 2.0 / 3, 0, 2.0 / 3, 0, 1.5, 0, 0, 1.5, 0, 0, 0, 0, 0, 0, 0, 6};
  auto run = [&](const Value& xin) -> absl::StatusOr<Value> {
    Variable xl = Variable::Leaf(xin, true, "x");
    DT_ASSIGN_OR_RETURN(Variable y, Max(xl, {1}));
    DT_ASSIGN_OR_RETURN(Variable yw, Mul(y, Variable::Constant(Value(w))));
    DT_ASSIGN_OR_RETURN(Variable l, Sum(yw));
    DT_RETURN_IF_ERROR(Backward(l));
    return xl.grad();
  };
  auto g1 = run(x);
  ASSERT_TRUE(g1.ok()) << g1.status();
  testing::ExpectNear(testing::Values(g1->local()), want, agtest::kTight, "single rank");
  for (const Shape& ms : agtest::MeshShapes()) {
    agtest::RunMesh(ms, [&](const DeviceMesh& mesh) {
      for (const Layout& l :
           {Layout(Placements(ms.size(), S1)), Layout(Placements(ms.size(), S0)), Layout(Placements(ms.size(), R))}) {
        auto g = run(Unwrap(DTensor::Distribute(x, mesh, l, {.src_rank = std::nullopt})));
        if (!agtest::AllOk(mesh, g.ok())) {
          if (!g.ok()) ADD_FAILURE() << l.ToString() << ": " << g.status();
          continue;
        }
        agtest::ExpectClose(*g, testing::FromDoubles(want, {3, 6}, DType::kFloat32),
                            absl::StrCat(agtest::MeshName(ms), " x ", l.ToString()));
      }
    });
  }
}

// ---- Linear algebra ----

TEST(Grad, Linear) {
  // Feature sizes divide over 2 and 4 ranks (see OpsStrategy.LinearWithAnEmptyLocalPieceOfTheLastDim);
  // the batch (5) is uneven.
  const Tensor x = Rand({5, 8}, 31), w = Rand({4, 8}, 32), b = Rand({4}, 33), x3 = Rand({2, 5, 8}, 34);
  auto lin_b = [](const std::vector<Variable>& in) { return Linear(in[0], in[1], in[2]); };
  auto lin = [](const std::vector<Variable>& in) { return Linear(in[0], in[1]); };
  // data parallel, colwise, rowwise, replicated, Partial input
  CheckGrad({"linear with bias",
             {x, w, b},
             {true, true, true},
             lin_b,
             {{S0, R, R}, {R, S0, S0}, {S1, S1, R}, {R, R, R}, {P, R, R}}});
  CheckGrad({"linear no bias", {x, w}, {true, true}, lin, {{S0, R}, {R, S0}, {S1, S1}, {R, R}}});
  CheckGrad(
      {"linear 3-d x", {x3, w, b}, {true, true, true}, lin_b, {{S0, R, R}, {S1, R, R}, {R, S0, S0}, {S2, S1, R}}});
  CheckGrad({"linear, weight only", {x, w}, {false, true}, lin, {{S0, R}, {R, S0}, {S1, S1}}});
}

TEST(Grad, LinearGelu) {
  // The fused bias + GELU (linear_bias with gelu): data parallel, colwise, replicated, and
  // inputs that its strategies do not take as they are (rowwise pieces, a Partial x: the
  // dispatcher redistributes them first, since GELU cannot run on partial sums).
  const Tensor x = Rand({5, 8}, 35), w = Rand({4, 8}, 36), b = Rand({4}, 37), x3 = Rand({2, 5, 8}, 38);
  auto fused = [](const std::vector<Variable>& in) { return LinearGelu(in[0], in[1], in[2]); };
  CheckGrad({"linear + gelu",
             {x, w, b},
             {true, true, true},
             fused,
             {{S0, R, R}, {R, S0, S0}, {S1, S1, R}, {R, R, R}, {P, R, R}}});
  CheckGrad({"linear + gelu 3-d x", {x3, w, b}, {true, true, true}, fused, {{S1, R, R}, {R, S0, S0}, {S2, S1, R}}});
  // The same values and gradients as the unfused Gelu(Linear(x, w, b)), on one rank.
  const Variable vx = Variable::Leaf(x, true), vw = Variable::Leaf(w, true), vb = Variable::Leaf(b, true);
  const Variable ux = Variable::Leaf(x, true), uw = Variable::Leaf(w, true), ub = Variable::Leaf(b, true);
  const Variable y = Unwrap(LinearGelu(vx, vw, vb));
  const Variable z = Unwrap(Gelu(Unwrap(Linear(ux, uw, ub))));
  EXPECT_EQ(testing::Values(y.value().local()), testing::Values(z.value().local()));
  ASSERT_TRUE(Backward(Unwrap(Sum(y))).ok());
  ASSERT_TRUE(Backward(Unwrap(Sum(z))).ok());
  for (const auto& [a, c] : {std::pair{vx, ux}, std::pair{vw, uw}, std::pair{vb, ub}}) {
    EXPECT_EQ(testing::Values(a.grad().local()), testing::Values(c.grad().local()));
  }
  EXPECT_EQ(LinearGelu(vx, vw, Variable()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Grad, MlpGelu) {
  // The MLP as one op (mlp_gelu): data parallel, Megatron's colwise c_fc and rowwise c_proj,
  // replicated, and layouts its strategies do not take as they are (a Partial x, a sharded
  // hidden dim with a replicated w_fc: the dispatcher redistributes them first).
  const Tensor x = Rand({5, 8}, 81), wfc = Rand({12, 8}, 82), bfc = Rand({12}, 83), wproj = Rand({6, 12}, 84),
               bproj = Rand({6}, 85), x3 = Rand({2, 5, 8}, 86);
  auto mlp = [](const std::vector<Variable>& in) { return MlpGelu(in[0], in[1], in[2], in[3], in[4]); };
  CheckGrad({"mlp_gelu",
             {x, wfc, bfc, wproj, bproj},
             {true, true, true, true, true},
             mlp,
             {{S0, R, R, R, R}, {R, S0, S0, S1, R}, {R, R, R, R, R}, {P, R, R, R, R}, {R, R, S0, S1, R}}});
  // A hidden width that is a multiple of 8, so that on a GPU the GELU backward runs in the
  // matrix multiply's epilogue (cuBLASLt's DGELU_BGRAD needs it; 12 runs unfused).
  const Tensor wfc16 = Rand({16, 8}, 89), bfc16 = Rand({16}, 90), wproj16 = Rand({6, 16}, 91);
  CheckGrad({"mlp_gelu 3-d x, hidden 16",
             {x3, wfc16, bfc16, wproj16, bproj},
             {true, true, true, true, true},
             mlp,
             {{S1, R, R, R, R}, {S0, R, R, R, R}, {R, S0, S0, S1, R}}});
  CheckGrad({"mlp_gelu, some inputs frozen",
             {x, wfc, bfc, wproj, bproj},
             {false, true, false, false, true},
             mlp,
             {{S0, R, R, R, R}, {R, S0, S0, S1, R}}});
  CheckGrad({"mlp_gelu, c_proj only",
             {x, wfc, bfc, wproj, bproj},
             {false, false, false, true, false},
             mlp,
             {{S0, R, R, R, R}, {R, S0, S0, S1, R}}});
  // The same values and gradients as the unfused Linear(LinearGelu(x, w_fc, b_fc), w_proj,
  // b_proj), bit for bit, on one rank (float32 and bfloat16).
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(d));
    std::vector<Tensor> in;
    for (const Tensor& t : {x3, wfc, bfc, wproj, bproj}) in.push_back(Unwrap(Cast(t, d)));
    std::vector<Variable> f, u;
    for (const Tensor& t : in) {
      f.push_back(Variable::Leaf(t, true));
      u.push_back(Variable::Leaf(t, true));
    }
    const Variable y = Unwrap(MlpGelu(f[0], f[1], f[2], f[3], f[4]));
    const Variable z = Unwrap(Linear(Unwrap(LinearGelu(u[0], u[1], u[2])), u[3], u[4]));
    EXPECT_EQ(testing::Values(y.value().local()), testing::Values(z.value().local()));
    const Tensor wy = Unwrap(Cast(Rand(y.value().shape(), 87, -1, 1), d));
    ASSERT_TRUE(Backward(Unwrap(Sum(Unwrap(Mul(y, Variable::Constant(Value(wy))))))).ok());
    ASSERT_TRUE(Backward(Unwrap(Sum(Unwrap(Mul(z, Variable::Constant(Value(wy))))))).ok());
    for (size_t i = 0; i < f.size(); ++i) {
      EXPECT_EQ(testing::Values(f[i].grad().local()), testing::Values(u[i].grad().local())) << "input " << i;
    }
  }
  const Variable vx = Variable::Leaf(x, true), vw = Variable::Leaf(wfc, true), vb = Variable::Leaf(bfc, true),
                 vp = Variable::Leaf(wproj, true);
  EXPECT_EQ(MlpGelu(vx, vw, vb, vp, Variable()).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::Status bad =
      MlpGelu(vx, vw, vb, Variable::Leaf(Rand({6, 11}, 88), true), Variable::Leaf(bproj, true)).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
}

TEST(Grad, Matmul) {
  auto mm = [](bool ta, bool tb) {
    return FwdFn([ta, tb](const std::vector<Variable>& in) { return Matmul(in[0], in[1], ta, tb); });
  };
  // M shard, N shard, K shard (-> Partial), replicated.
  CheckGrad({"matmul [5,4]x[4,6]",
             {Rand({5, 4}, 41), Rand({4, 6}, 42)},
             {true, true},
             mm(false, false),
             {{S0, R}, {R, S1}, {S1, S0}, {R, R}}});
  CheckGrad({"matmul [4,5]^T x[4,6]",
             {Rand({4, 5}, 43), Rand({4, 6}, 44)},
             {true, true},
             mm(true, false),
             {{S1, R}, {R, S1}, {S0, S0}, {R, R}}});
  CheckGrad({"matmul [5,4]x[6,4]^T",
             {Rand({5, 4}, 45), Rand({6, 4}, 46)},
             {true, true},
             mm(false, true),
             {{S0, R}, {R, S0}, {S1, S1}, {R, R}}});
  CheckGrad({"matmul [4,5]^T x[6,4]^T",
             {Rand({4, 5}, 47), Rand({6, 4}, 48)},
             {true, true},
             mm(true, true),
             {{S1, R}, {R, S0}, {S0, S1}, {R, R}}});
  CheckGrad({"matmul batched [3,5,4]x[3,4,2]",
             {Rand({3, 5, 4}, 49), Rand({3, 4, 2}, 50)},
             {true, true},
             mm(false, false),
             {{S0, S0}, {S1, R}, {R, S2}, {S2, S1}, {R, R}}});
  CheckGrad({"matmul batched [3,4,5]^T x[3,2,4]^T",
             {Rand({3, 4, 5}, 51), Rand({3, 2, 4}, 52)},
             {true, true},
             mm(true, true),
             {{S0, S0}, {S2, R}, {S1, S2}, {R, R}}});
  CheckGrad({"matmul batched [3,5,4]x[4,2]",
             {Rand({3, 5, 4}, 53), Rand({4, 2}, 54)},
             {true, true},
             mm(false, false),
             {{S0, R}, {S1, R}, {S2, S0}, {R, R}}});
  CheckGrad({"matmul batched [3,4,5]^T x[4,2]",
             {Rand({3, 4, 5}, 55), Rand({4, 2}, 56)},
             {true, true},
             mm(true, false),
             {{S0, R}, {S1, S0}, {R, R}}});
}

// ---- Normalisation, softmax ----

TEST(Grad, Norms) {
  const Tensor x = Rand({5, 3, 8}, 61, -2, 2), w = Rand({8}, 62, 0.5, 1.5), b = Rand({8}, 63);
  CheckGrad({"layer_norm",
             {x, w, b},
             {true, true, true},
             [](const std::vector<Variable>& in) { return LayerNorm(in[0], in[1], in[2]); },
             {{S0, R, R}, {S1, R, R}, {R, R, R}, {R, S0, S0}}});
  const Tensor x2 = Rand({5, 8}, 64, -2, 2);
  CheckGrad({"rms_norm",
             {x2, w},
             {true, true},
             Fwd2([](auto& v, auto& g) { return RmsNorm(v, g); }),
             {{S0, R}, {R, R}, {S1, R}, {R, S0}}});
}

// The fused residual add + LayerNorm, with both outputs used (residual * y), so the gradient
// of the residual sums its own and LayerNorm's. x and h sharded alike or not, Partial, and
// sharded weights: the dispatcher redistributes to the op's rule.
TEST(Grad, AddLayerNorm) {
  const Tensor x = Rand({5, 3, 8}, 65, -2, 2), h = Rand({5, 3, 8}, 66, -2, 2);
  const Tensor w = Rand({8}, 67, 0.5, 1.5), b = Rand({8}, 68);
  CheckGrad({"add_layer_norm",
             {x, h, w, b},
             {true, true, true, true},
             [](const std::vector<Variable>& in) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(ResidualNorm r, AddLayerNorm(in[0], in[1], in[2], in[3]));
               return Mul(r.residual, r.y);
             },
             {{S0, S0, R, R}, {S1, S1, R, R}, {R, R, R, R}, {S0, R, R, R}, {P, P, R, R}, {R, R, S0, S0}}});
  CheckGrad({"add_layer_norm y only",
             {x, h, w, b},
             {true, false, true, true},
             [](const std::vector<Variable>& in) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(ResidualNorm r, AddLayerNorm(in[0], in[1], in[2], in[3]));
               return r.y;
             },
             {{S0, S0, R, R}, {R, R, R, R}, {S1, R, R, R}}});
}

// On the CPU the fused op gives Add then LayerNorm's values and gradients bit for bit, in
// float32 and bfloat16 (the sum is rounded to the dtype before it is normalised).
TEST(Grad, AddLayerNormEqualsUnfusedBitForBit) {
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(d));
    const Tensor x = testing::Random({4, 5, 24}, d, 91, -2, 2), h = testing::Random({4, 5, 24}, d, 92, -2, 2);
    const Tensor w = testing::Random({24}, d, 93, 0.5, 1.5), b = testing::Random({24}, d, 94);
    const Tensor wl = testing::Random({4, 5, 24}, d, 95);
    struct Out {
      std::vector<double> loss;
      std::vector<std::vector<double>> grads;
    };
    auto run = [&](bool fused) -> Out {
      std::vector<Variable> in;
      for (const Tensor& t : {x, h, w, b}) in.push_back(Variable::Leaf(Value(t), true, "in"));
      Variable res, y;
      if (fused) {
        ResidualNorm r = Unwrap(AddLayerNorm(in[0], in[1], in[2], in[3]));
        res = r.residual;
        y = r.y;
      } else {
        res = Unwrap(Add(in[0], in[1]));
        y = Unwrap(LayerNorm(res, in[2], in[3]));
      }
      // As in a GPT block: the residual goes on, and y through a nonlinearity joins it.
      const Variable g = Unwrap(Gelu(y));
      const Variable out = Unwrap(Add(res, g));
      const Variable loss = Unwrap(Sum(Unwrap(Mul(out, Variable::Constant(Value(wl))))));
      EXPECT_TRUE(Backward(loss).ok());
      Out o;
      o.loss = testing::Values(loss.value().local());
      for (const Variable& v : in) o.grads.push_back(testing::Values(v.grad().local()));
      return o;
    };
    const Out fused = run(true), plain = run(false);
    EXPECT_EQ(fused.loss, plain.loss);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(fused.grads[i], plain.grads[i]) << "input " << i;
  }
}

TEST(Grad, Softmax) {
  const Tensor x = Rand({5, 7}, 71, -2, 2);
  const std::vector<std::vector<Placement>> d = {{R}, {S0}, {S1}, {P}};
  CheckGrad({"softmax dim -1", {x}, {true}, Fwd1([](auto& v) { return Softmax(v, -1); }), d});
  CheckGrad({"softmax dim 0", {x}, {true}, Fwd1([](auto& v) { return Softmax(v, 0); }), d});
  CheckGrad({"log_softmax dim -1", {x}, {true}, Fwd1([](auto& v) { return LogSoftmax(v, -1); }), d});
  CheckGrad({"log_softmax [2,3,4] dim 1",
             {Rand({2, 3, 4}, 72, -2, 2)},
             {true},
             Fwd1([](auto& v) { return LogSoftmax(v, 1); }),
             {{R}, {S0}, {S2}}});
}

// ---- Embedding, loss, attention ----

TEST(Grad, Embedding) {
  const Tensor w = Rand({11, 4}, 81);
  const Tensor ids = Ids({0, 10, 3, 3, 7, 5, 1, 10, 2, 9}, {2, 5});  // repeats accumulate
  CheckGrad({"embedding",
             {w, ids},
             {true, false},
             Fwd2([](auto& t, auto& i) { return Embedding(t, i); }),
             {{R, S0}, {R, S1}, {S0, R}, {S1, R}, {R, R}}});
}

TEST(Grad, CrossEntropy) {
  const Tensor l = Rand({5, 7}, 91, -2, 2), t = Ids({3, 6, 0, -100, 2}, {5});
  auto ce = Fwd2([](auto& a, auto& b) { return CrossEntropy(a, b); });
  // batch-sharded (uneven), vocab-sharded (loss parallel), replicated
  CheckGrad({"cross_entropy [5,7]", {l, t}, {true, false}, ce, {{S0, S0}, {S1, R}, {R, R}, {P, R}}});
  const Tensor l3 = Rand({2, 3, 7}, 92, -2, 2), t3 = Ids({1, 6, 2, 0, -100, 5}, {2, 3});
  CheckGrad({"cross_entropy [2,3,7]", {l3, t3}, {true, false}, ce, {{S0, S0}, {S1, S1}, {S2, R}, {R, R}}});
}

TEST(Grad, CrossEntropyFused) {
  // The upstream gradient here is the random weight W, not the 1.0 the forward assumed: the
  // backward's rescale runs. Vocab-sharded logits are gathered (no loss parallel) but exact.
  const Tensor l = Rand({5, 7}, 93, -2, 2), t = Ids({3, 6, 0, -100, 2}, {5});
  auto ce = Fwd2([](auto& a, auto& b) { return CrossEntropyFused(a, b); });
  CheckGrad({"cross_entropy_fused [5,7]", {l, t}, {true, false}, ce, {{S0, S0}, {S1, R}, {R, R}, {P, R}}});
  const Tensor l3 = Rand({2, 3, 7}, 94, -2, 2), t3 = Ids({1, 6, 2, 0, -100, 5}, {2, 3});
  auto ce_half = Fwd2([](auto& a, auto& b) { return CrossEntropyFused(a, b, -100, 0.5); });
  CheckGrad(
      {"cross_entropy_fused [2,3,7] for dloss 0.5", {l3, t3}, {true, false}, ce_half, {{S0, S0}, {S1, S1}, {R, R}}});
}

// Backpropagated as is (dloss = 1, the forward's assumption), the fused loss gives the unfused
// one's value and gradient bit for bit; any other dloss, and a second backward, rescale.
TEST(Grad, CrossEntropyFusedSkipsTheRescaleOnlyWhenExact) {
  const Tensor l = Rand({6, 9}, 95, -3, 3), t = Ids({3, -100, 8, 0, 2, 2}, {6});
  auto run = [&](bool fused, const std::vector<double>& dlosses) {
    Variable x = Variable::Leaf(Value(l), true, "logits");
    Variable loss = Unwrap(fused ? CrossEntropyFused(x, Variable::Constant(Value(t)))
                                 : CrossEntropy(x, Variable::Constant(Value(t))));
    for (size_t i = 0; i < dlosses.size(); ++i) {
      const Value g(testing::FromDoubles({dlosses[i]}, {}, DType::kFloat32));
      const Variable roots[] = {loss};
      const Value grads[] = {g};
      EXPECT_TRUE(Backward(roots, grads, /*retain_graph=*/i + 1 < dlosses.size()).ok());
    }
    return std::make_pair(testing::Values(loss.value().local())[0], testing::Values(x.grad().local()));
  };
  const auto [loss0, g0] = run(false, {1.0});
  const auto [loss1, g1] = run(true, {1.0});
  EXPECT_EQ(loss1, loss0);
  EXPECT_EQ(g1, g0) << "dloss 1: the gradient computed in the forward is handed on as is";
  // dloss 2.5, then (retain_graph) 0.5 more: the leaf gets 3 times the unit gradient, and the
  // first pass's gradient (held by the leaf while the second ran) was not rescaled under it.
  const auto [loss2, g2] = run(true, {2.5, 0.5});
  std::vector<double> want;
  for (double v : g0) want.push_back(3.0 * v);
  testing::ExpectNear(g2, want, {1e-6, 1e-7}, "2.5 then 0.5");
  double gmax = 0;
  for (double v : g0) gmax = std::max(gmax, std::fabs(v));
  EXPECT_GT(gmax, 1e-2);
}

// The backward rescales by dloss / expected_dloss: an expected_dloss of 0 (the gradient stored
// as zeros, then scaled by 1 / 0) or a non-finite one would give NaN gradients, so it is refused.
TEST(Grad, CrossEntropyFusedRejectsAZeroOrNonFiniteExpectedDloss) {
  const Tensor l = Rand({2, 3}, 96, -1, 1), t = Ids({0, 2}, {2});
  Variable x = Variable::Leaf(Value(l), true, "logits");
  for (double e : {0.0, -0.0, 1e-45, std::numeric_limits<double>::infinity(), std::nan(""), 1e39}) {
    const absl::Status s = CrossEntropyFused(x, Variable::Constant(Value(t)), -100, e).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << e << ": " << s;
    EXPECT_NE(s.message().find("expected_dloss"), std::string::npos) << s;
  }
  // Without a gradient to compute it is CrossEntropy, which has no rescale: any value does.
  EXPECT_TRUE(CrossEntropyFused(Variable::Constant(Value(l)), Variable::Constant(Value(t)), -100, 0.0).ok());
}

TEST(Grad, CausalAttention) {
  const Tensor q = Rand({3, 5, 4, 2}, 101), k = Rand({3, 5, 4, 2}, 102), v = Rand({3, 5, 4, 2}, 103);
  CheckGrad({"causal_attention",
             {q, k, v},
             {true, true, true},
             [](const std::vector<Variable>& in) { return CausalAttention(in[0], in[1], in[2]); },
             {{S0, S0, S0}, {S1, S1, S1}, {R, R, R}}});
  CheckGrad({"causal_attention scale 0.3",
             {q, k, v},
             {true, true, true},
             [](const std::vector<Variable>& in) { return CausalAttention(in[0], in[1], in[2], 0.3); },
             {{S0, S0, S0}, {S1, S1, S1}}});
}

// ---- Views ----

TEST(Grad, Views) {
  const Tensor a = Rand({4, 6}, 111), x = Rand({5, 6, 3}, 112), b = Rand({5, 6}, 113);
  // The views are linear: compose with gelu so that the gradient depends on the values.
  CheckGrad({"reshape [4,6]->[2,12]",
             {a},
             {true},
             Fwd1([](auto& v) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(Variable r, Reshape(v, {2, 12}));
               return Gelu(r);
             }),
             {{R}, {S0}, {S1}, {P}}});
  CheckGrad({"reshape [5,6,3]->[5,18]",
             {x},
             {true},
             Fwd1([](auto& v) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(Variable r, Reshape(v, {5, -1}));
               return Gelu(r);
             }),
             {{R}, {S0}, {S1}, {S2}}});
  CheckGrad({"transpose (0,2)",
             {x},
             {true},
             Fwd1([](auto& v) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(Variable r, Transpose(v, 0, 2));
               return Gelu(r);
             }),
             {{R}, {S0}, {S1}, {S2}, {P}}});
  CheckGrad({"narrow dim 0 [1,4)",
             {b},
             {true},
             Fwd1([](auto& v) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(Variable r, Narrow(v, 0, 1, 3));
               return Gelu(r);
             }),
             {{R}, {S0}, {S1}, {P}}});
  CheckGrad({"narrow dim -1 [2,5)",
             {b},
             {true},
             Fwd1([](auto& v) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(Variable r, Narrow(v, -1, 2, 3));
               return Gelu(r);
             }),
             {{R}, {S0}, {S1}}});
  // Split into [5,2] x 3, recombined with different weights: every part's gradient counts.
  CheckGrad({"split size 2 dim 1",
             {b},
             {true},
             Fwd1([](auto& v) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(std::vector<Variable> parts, Split(v, 2, 1));
               if (parts.size() != 3) return absl::InternalError("expected 3 parts");
               DT_ASSIGN_OR_RETURN(Variable p1, Scale(parts[1], 2.0));
               DT_ASSIGN_OR_RETURN(Variable p2, Gelu(parts[2]));
               DT_ASSIGN_OR_RETURN(Variable s, Add(parts[0], p1));
               return Add(s, p2);
             }),
             {{R}, {S0}, {S1}}});
  CheckGrad({"split uneven size 4 dim 0",
             {b},
             {true},
             Fwd1([](auto& v) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(std::vector<Variable> parts, Split(v, 4, 0));  // [4,6], [1,6]
               if (parts.size() != 2) return absl::InternalError("expected 2 parts");
               DT_ASSIGN_OR_RETURN(Variable a0, Sum(parts[0], {0}));
               DT_ASSIGN_OR_RETURN(Variable g1, Gelu(parts[1]));
               DT_ASSIGN_OR_RETURN(Variable a1, Sum(g1, {0}));
               return Mul(a0, a1);
             }),
             {{R}, {S0}, {S1}}});
}

// A small composite (linear -> gelu -> layer_norm -> linear -> cross-entropy) through the
// whole tape, the shape of one GPT MLP block with its loss.
TEST(Grad, Composite) {
  const Tensor x = Rand({5, 8}, 121), w1 = Rand({8, 8}, 122, -0.5, 0.5), b1 = Rand({8}, 123);
  const Tensor g = Rand({8}, 124, 0.5, 1.5), be = Rand({8}, 125), w2 = Rand({8, 8}, 126, -0.5, 0.5);
  const Tensor t = Ids({1, 7, 0, 3, 3}, {5});
  CheckGrad({"mlp + layer_norm + cross_entropy",
             {x, w1, b1, g, be, w2, t},
             {true, true, true, true, true, true, false},
             [](const std::vector<Variable>& in) -> absl::StatusOr<Variable> {
               DT_ASSIGN_OR_RETURN(Variable h, Linear(in[0], in[1], in[2]));
               DT_ASSIGN_OR_RETURN(h, Gelu(h));
               DT_ASSIGN_OR_RETURN(Variable r, Add(h, in[0]));  // residual: x used twice
               DT_ASSIGN_OR_RETURN(Variable n, LayerNorm(r, in[3], in[4]));
               DT_ASSIGN_OR_RETURN(Variable logits, Linear(n, in[5]));
               return CrossEntropy(logits, in[6]);
             },
             {{S0, R, R, R, R, R, S0}, {R, S0, S0, R, R, R, R}, {R, R, R, R, R, S0, R}, {R, R, R, R, R, R, R}}});
}

}  // namespace
}  // namespace dtensor
