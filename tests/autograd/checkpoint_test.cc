// ActivationCheckpoint (autograd/checkpoint.h) against the same function run without it: the
// gradients of the inputs and of the leaves the function uses are bit-identical; the function
// runs once in forward and once per backward; parameters get gradients when no input needs
// one; retain_graph recomputes again; state captured at the forward (a dropout counter) is put
// back for the recomputation and returned after; a function that changes on recomputation is
// refused; selective checkpointing hands the saved ops' outputs back instead of running them.
#include "dtensor/autograd/checkpoint.h"

#include <cstdint>
#include <string>
#include <vector>

#include "dtensor/autograd/ops.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

constexpr int64_t kRows = 6, kIn = 10, kOut = 14;

// The leaves of the test function: a LayerNorm's weight and bias, a Linear's weight and bias.
struct Params {
  Variable g, b, w, bias;
  std::vector<Variable*> All() { return {&g, &b, &w, &bias}; }
};

Params MakeParams(bool requires_grad = true) {
  Params p;
  p.g = Variable::Leaf(testing::Random({kIn}, DType::kFloat32, 11, 0.5, 1.5), requires_grad, "g");
  p.b = Variable::Leaf(testing::Random({kIn}, DType::kFloat32, 12), requires_grad, "b");
  p.w = Variable::Leaf(testing::Random({kOut, kIn}, DType::kFloat32, 13), requires_grad, "w");
  p.bias = Variable::Leaf(testing::Random({kOut}, DType::kFloat32, 14), requires_grad, "bias");
  return p;
}

// gelu(linear(layer_norm(x))) * (1 + dropout(that)) with the dropout seed drawn from *counter.
absl::StatusOr<Variable> Body(Params& p, const Variable& x, uint64_t* counter = nullptr) {
  DT_ASSIGN_OR_RETURN(Variable h, LayerNorm(x, p.g, p.b));
  DT_ASSIGN_OR_RETURN(h, Linear(h, p.w, p.bias));
  DT_ASSIGN_OR_RETURN(h, Gelu(h));
  if (counter == nullptr) return h;
  DT_ASSIGN_OR_RETURN(Variable d, Dropout(h, 0.3, 1000 + (*counter)++));
  DT_ASSIGN_OR_RETURN(Variable one, AddScalar(d, 1.0));
  return Mul(h, one);
}

// sum(y * c) for a fixed c, so that every element's gradient differs.
absl::StatusOr<Variable> Loss(const Variable& y) {
  Variable c = Variable::Constant(testing::Random(y.value().shape(), DType::kFloat32, 99));
  DT_ASSIGN_OR_RETURN(Variable m, Mul(y, c));
  return Sum(m);
}

struct Grads {
  std::vector<double> loss;
  std::vector<std::vector<double>> grads;  // x, then the parameters
};

Grads Collect(const Variable& loss, const Variable& x, Params& p) {
  Grads out;
  out.loss = testing::Values(loss.value().local());
  out.grads.push_back(x.grad().defined() ? testing::Values(x.grad().local()) : std::vector<double>{});
  for (Variable* v : p.All()) {
    out.grads.push_back(v->grad().defined() ? testing::Values(v->grad().local()) : std::vector<double>{});
  }
  return out;
}

void ExpectBitwise(const Grads& a, const Grads& b) {
  EXPECT_EQ(a.loss, b.loss);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << "gradient " << i;
}

Variable Input(bool requires_grad = true) {
  return Variable::Leaf(testing::Random({kRows, kIn}, DType::kFloat32, 7), requires_grad, "x");
}

Grads Reference(bool x_requires_grad = true, uint64_t* counter = nullptr) {
  Params p = MakeParams();
  Variable x = Input(x_requires_grad);
  Variable y = Unwrap(Body(p, x, counter));
  Variable loss = Unwrap(Loss(y));
  EXPECT_TRUE(Backward(loss).ok());
  return Collect(loss, x, p);
}

TEST(ActivationCheckpoint, GradientsAreBitIdenticalAndFnRunsTwice) {
  const Grads want = Reference();
  Params p = MakeParams();
  Variable x = Input();
  int runs = 0;
  auto fn = [&](const Variable& in) -> absl::StatusOr<Variable> {
    ++runs;
    return Body(p, in);
  };
  Variable y = Unwrap(ActivationCheckpoint(fn, x));
  EXPECT_EQ(runs, 1);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_STREQ(y.grad_fn()->name(), "Checkpoint");
  Variable loss = Unwrap(Loss(y));
  ASSERT_TRUE(Backward(loss).ok());
  EXPECT_EQ(runs, 2);
  ExpectBitwise(Collect(loss, x, p), want);
  for (double g : want.grads[3]) {  // the reference is not trivially zero
    if (g != 0) return;
  }
  ADD_FAILURE() << "w's reference gradient is all zeros";
}

TEST(ActivationCheckpoint, NoGradModeJustRuns) {
  Params p = MakeParams();
  int runs = 0;
  NoGradGuard no_grad;
  Variable y = Unwrap(ActivationCheckpoint(
      [&](const Variable& in) -> absl::StatusOr<Variable> {
        ++runs;
        return Body(p, in);
      },
      Input()));
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(y.requires_grad());
}

TEST(ActivationCheckpoint, ParametersGetGradientsWhenNoInputNeedsOne) {
  const Grads want = Reference(/*x_requires_grad=*/false);
  Params p = MakeParams();
  Variable x = Input(false);
  Variable y = Unwrap(ActivationCheckpoint([&](const Variable& in) { return Body(p, in); }, x));
  Variable loss = Unwrap(Loss(y));
  ASSERT_TRUE(Backward(loss).ok());
  const Grads got = Collect(loss, x, p);
  EXPECT_TRUE(got.grads[0].empty());  // x needs none
  ExpectBitwise(got, want);
}

TEST(ActivationCheckpoint, RetainGraphRecomputesAgainAndWithoutItRefuses) {
  Grads want;
  {
    Params p = MakeParams();
    Variable x = Input();
    Variable loss = Unwrap(Loss(Unwrap(Body(p, x))));
    ASSERT_TRUE(Backward(loss, /*retain_graph=*/true).ok());
    ASSERT_TRUE(Backward(loss).ok());
    want = Collect(loss, x, p);
  }
  Params p = MakeParams();
  Variable x = Input();
  int runs = 0;
  Variable y = Unwrap(ActivationCheckpoint(
      [&](const Variable& in) -> absl::StatusOr<Variable> {
        ++runs;
        return Body(p, in);
      },
      x));
  Variable loss = Unwrap(Loss(y));
  ASSERT_TRUE(Backward(loss, /*retain_graph=*/true).ok());
  ASSERT_TRUE(Backward(loss).ok());
  EXPECT_EQ(runs, 3);
  ExpectBitwise(Collect(loss, x, p), want);
  absl::Status again = Backward(loss);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
}

TEST(ActivationCheckpoint, CapturedStateReplaysTheForwardsDropoutMask) {
  uint64_t ref_counter = 5;
  const Grads want = Reference(true, &ref_counter);
  ASSERT_EQ(ref_counter, 6u);

  CheckpointOptions o;
  uint64_t counter = 5;
  o.capture_state = [&counter]() -> std::function<void()> {
    const uint64_t at = counter;
    return [&counter, at] { counter = at; };
  };
  Params p = MakeParams();
  Variable x = Input();
  Variable y = Unwrap(ActivationCheckpoint([&](const Variable& in) { return Body(p, in, &counter); }, x, o));
  EXPECT_EQ(counter, 6u);
  counter = 40;  // other forwards ran meanwhile: the recomputation must not see or change this
  Variable loss = Unwrap(Loss(y));
  ASSERT_TRUE(Backward(loss).ok());
  EXPECT_EQ(counter, 40u);
  ExpectBitwise(Collect(loss, x, p), want);

  // Without the state the recomputation draws another mask: the gradients differ.
  counter = 5;
  Params q = MakeParams();
  Variable x2 = Input();
  Variable y2 = Unwrap(ActivationCheckpoint([&](const Variable& in) { return Body(q, in, &counter); }, x2));
  Variable loss2 = Unwrap(Loss(y2));
  ASSERT_TRUE(Backward(loss2).ok());
  EXPECT_NE(Collect(loss2, x2, q).grads[3], want.grads[3]);
}

TEST(ActivationCheckpoint, RefusesAFunctionThatChangesOnRecomputation) {
  Params p = MakeParams();
  int runs = 0;
  Variable y = Unwrap(ActivationCheckpoint(
      [&](const Variable& in) -> absl::StatusOr<Variable> {
        DT_ASSIGN_OR_RETURN(Variable h, Body(p, in));
        if (++runs == 1) return h;
        return Narrow(h, 0, 0, 2);  // another shape on recomputation
      },
      Input()));
  absl::Status s = Backward(Unwrap(Sum(y)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("not deterministic"), std::string::npos) << s;
}

TEST(ActivationCheckpoint, MultipleInputsAndOutputs) {
  Params p = MakeParams();
  Variable a = Input(), b = Variable::Leaf(testing::Random({kRows, kIn}, DType::kFloat32, 8), true, "b");
  auto fn = [&](absl::Span<const Variable> in) -> absl::StatusOr<std::vector<Variable>> {
    DT_ASSIGN_OR_RETURN(Variable s, Add(in[0], in[1]));
    DT_ASSIGN_OR_RETURN(Variable h, Body(p, s));
    DT_ASSIGN_OR_RETURN(Variable m, Mul(in[0], in[0]));
    return std::vector<Variable>{h, m};
  };
  auto run = [&](bool checkpoint) {
    for (Variable* v : {&a, &b}) v->reset_grad();
    for (Variable* v : p.All()) v->reset_grad();
    std::vector<Variable> ins = {a, b};
    std::vector<Variable> out = checkpoint ? Unwrap(ActivationCheckpoint(fn, ins)) : Unwrap(fn(ins));
    Variable l = Unwrap(Add(Unwrap(Loss(out[0])), Unwrap(Loss(out[1]))));
    EXPECT_TRUE(Backward(l).ok());
    Grads g = Collect(l, a, p);
    g.grads.push_back(testing::Values(b.grad().local()));
    return g;
  };
  const Grads want = run(false);
  ExpectBitwise(run(true), want);
}

// Selective checkpointing keeps the linear ops' outputs ("linear", and "linear_bias" where the
// layer has a bias): changing w in place between forward and backward then affects the
// gradients as it does without checkpointing (the Linear node's backward reads w; its output
// is the forward's), while full recomputation computes a new output from the new w.
TEST(ActivationCheckpoint, SelectiveReusesTheSavedOpsOutputs) {
  auto run = [](int mode) {  // 0: no checkpoint, 1: full, 2: selective
    Params p = MakeParams();
    Variable x = Input();
    CheckpointOptions o;
    if (mode == 2) o.save_ops = {"linear", "linear_bias", "linear_bias_gelu"};
    auto fn = [&](const Variable& in) { return Body(p, in); };
    Variable y = mode == 0 ? Unwrap(fn(x)) : Unwrap(ActivationCheckpoint(fn, x, o));
    EXPECT_TRUE(Fill_(p.w.value().local(), 0.25).ok());
    Variable loss = Unwrap(Loss(y));
    EXPECT_TRUE(Backward(loss).ok());
    return Collect(loss, x, p);
  };
  const Grads plain = run(0), full = run(1), selective = run(2);
  ExpectBitwise(selective, plain);
  EXPECT_NE(full.grads[0], plain.grads[0]);
}

// The fused linear + GELU keeps only its pre-activation and rebuilds the activation from it
// (OpDef::ac_rebuild): the same gradients as without checkpointing, bit for bit, and its matrix
// multiply is not run again (changing w between forward and backward leaves the saved values
// alone, as without checkpointing; full recomputation sees the new w).
TEST(ActivationCheckpoint, SelectiveRebuildsTheFusedGeluFromItsPreActivation) {
  auto run = [](int mode) {  // 0: no checkpoint, 1: full, 2: selective
    Params p = MakeParams();
    Variable x = Input();
    CheckpointOptions o;
    if (mode == 2) o.save_ops = {"linear_bias_gelu"};
    auto fn = [&](const Variable& in) -> absl::StatusOr<Variable> {
      DT_ASSIGN_OR_RETURN(Variable h, LayerNorm(in, p.g, p.b));
      return LinearGelu(h, p.w, p.bias);
    };
    Variable y = mode == 0 ? Unwrap(fn(x)) : Unwrap(ActivationCheckpoint(fn, x, o));
    EXPECT_TRUE(Fill_(p.w.value().local(), 0.25).ok());
    Variable loss = Unwrap(Loss(y));
    EXPECT_TRUE(Backward(loss).ok());
    return Collect(loss, x, p);
  };
  const Grads plain = run(0), full = run(1), selective = run(2);
  ExpectBitwise(selective, plain);
  EXPECT_NE(full.grads[0], plain.grads[0]);
}

// The fused MLP (mlp_gelu) keeps its output and pre-activation, and its backward rebuilds
// gelu(pre): the same gradients as without checkpointing, bit for bit, and neither matrix
// multiply runs again (w_fc changed between forward and backward leaves the saved values alone;
// full recomputation sees the new w_fc).
TEST(ActivationCheckpoint, SelectiveKeepsTheFusedMlpsOutputAndPreActivation) {
  auto run = [](int mode) {  // 0: no checkpoint, 1: full, 2: selective
    Params p = MakeParams();
    Variable w_proj = Variable::Leaf(testing::Random({kIn, kOut}, DType::kFloat32, 15), true, "w_proj");
    Variable b_proj = Variable::Leaf(testing::Random({kIn}, DType::kFloat32, 16), true, "b_proj");
    Variable x = Input();
    CheckpointOptions o;
    if (mode == 2) o.save_ops = {"mlp_gelu"};
    auto fn = [&](const Variable& in) -> absl::StatusOr<Variable> {
      DT_ASSIGN_OR_RETURN(Variable h, LayerNorm(in, p.g, p.b));
      return MlpGelu(h, p.w, p.bias, w_proj, b_proj);
    };
    Variable y = mode == 0 ? Unwrap(fn(x)) : Unwrap(ActivationCheckpoint(fn, x, o));
    EXPECT_TRUE(Fill_(p.w.value().local(), 0.25).ok());
    Variable loss = Unwrap(Loss(y));
    EXPECT_TRUE(Backward(loss).ok());
    Grads g = Collect(loss, x, p);
    g.grads.push_back(testing::Values(w_proj.grad().local()));
    g.grads.push_back(testing::Values(b_proj.grad().local()));
    return g;
  };
  const Grads plain = run(0), full = run(1), selective = run(2);
  ExpectBitwise(selective, plain);
  EXPECT_NE(full.grads[0], plain.grads[0]);
}

TEST(ActivationCheckpoint, SelectiveIsBitIdenticalWithEveryMatmulSaved) {
  const Grads want = Reference();
  Params p = MakeParams();
  Variable x = Input();
  CheckpointOptions o;
  o.save_ops = {"linear", "linear_bias", "linear_bias_gelu", "matmul", "causal_attention", "layer_norm"};
  Variable y = Unwrap(ActivationCheckpoint([&](const Variable& in) { return Body(p, in); }, x, o));
  Variable loss = Unwrap(Loss(y));
  ASSERT_TRUE(Backward(loss).ok());
  ExpectBitwise(Collect(loss, x, p), want);
}

}  // namespace
}  // namespace dtensor
