// Every OpDef (autograd/ops/op_defs.h) under every sharding strategy equals its single-rank
// result.
//
// For each op, representative global inputs (uneven sizes where the op allows; a backward op's
// saved inputs come from a single-rank forward) are run once on plain Tensors (Dispatch calls
// the local function). Then, on meshes [2], [4] and [2, 2] of thread ranks, every strategy of
// EnumerateStrategies runs with DispatchWith on inputs already laid out as it asks; each output
// must have the strategy's layout and its full value (Partial outputs reduced) must equal the
// single-rank output (1e-5 relative and absolute). Partial inputs hold unequal parts on the
// ranks of their Partial mesh dims (sum: random parts that add up to the value; avg: parts
// around it; max / min: each element's value on one rank, less / more on the others), so a
// strategy that treats a Partial input as if it were the full value fails. Deliberately wrong
// rules (EveryStrategyHarness) show that the sweep catches them.
//
// One summary line per op and mesh tells how many strategies were checked; every op must have
// at least 2 (one besides Replicate everywhere) on the 2-rank mesh.
//
// Besides: Replicate inputs stay Replicate (the dispatcher's tie-break), with no communication.
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/autograd/dispatch.h"
#include "dtensor/autograd/ops/op_defs.h"
#include "dtensor/ops/ops.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/autograd/autograd_test_util.h"

namespace dtensor {
namespace {

using agtest::Ids;
using agtest::Rand;
using testing::Unwrap;

struct Case {
  std::string name;
  std::vector<Tensor> inputs;
  OpArgs args;
  testing::Tolerance tol = agtest::kTight;
};

OpArgs Args(std::vector<int64_t> ints, std::vector<double> floats = {}) {
  OpArgs a;
  a.ints.assign(ints.begin(), ints.end());
  a.floats.assign(floats.begin(), floats.end());
  return a;
}

int64_t I(BinaryOp op) { return static_cast<int64_t>(op); }
int64_t I(UnaryOp op) { return static_cast<int64_t>(op); }
int64_t I(ReduceOp op) { return static_cast<int64_t>(op); }

// The plain-tensor outputs of `op` (its local function on one rank).
std::vector<Tensor> RunPlain(const OpDef& op, const std::vector<Tensor>& inputs, const OpArgs& args) {
  std::vector<Value> plain(inputs.begin(), inputs.end());
  std::vector<Value> out = Unwrap(Dispatch(op, plain, args), op.name);
  std::vector<Tensor> r;
  for (const Value& v : out) r.push_back(v.local());
  return r;
}

Tensor Scalar0d(double v) { return testing::FromDoubles({v}, {}, DType::kFloat32); }

// `x` with some elements of `y` copied in (so that Equal has both outcomes).
Tensor SomeEqual(const Tensor& x, const Tensor& y) {
  std::vector<double> a = testing::Values(x), b = testing::Values(y);
  for (size_t i = 0; i < a.size(); i += 3) a[i] = b[i];
  return testing::FromDoubles(a, x.shape(), x.dtype());
}

// ---- The cases of every op ----

std::vector<Case> BinaryCases() {
  const Tensor a = Rand({5, 6}, 1), b6 = Rand({6}, 2), b51 = Rand({5, 1}, 3), b = Rand({5, 6}, 4);
  const Tensor pos = Rand({5, 6}, 5, 0.5, 1.5), a3 = Rand({3, 5, 6}, 6), pos6 = Rand({6}, 7, 0.5, 1.5);
  return {
      {"add [5,6]+[6]", {a, b6}, Args({I(BinaryOp::kAdd)})},
      {"sub [5,6]-[5,1]", {a, b51}, Args({I(BinaryOp::kSub)})},
      {"mul [5,6]*[5,6]", {a, b}, Args({I(BinaryOp::kMul)})},
      {"mul [6]*[3,5,6]", {b6, a3}, Args({I(BinaryOp::kMul)})},
      {"div [5,6]/[5,6]", {a, pos}, Args({I(BinaryOp::kDiv)})},
      {"div [5,1]/[6]", {b51, pos6}, Args({I(BinaryOp::kDiv)})},
      {"max [5,6],[5,1]", {a, b51}, Args({I(BinaryOp::kMax)})},
      {"min [3,5,6],[5,6]", {a3, b}, Args({I(BinaryOp::kMin)})},
  };
}

std::vector<Case> ScalarCases() {
  const Tensor a = Rand({5, 6}, 11), pos = Rand({5, 6}, 12, 0.5, 1.5), a3 = Rand({3, 5, 2}, 13);
  return {
      {"x*2.5", {a}, Args({I(BinaryOp::kMul), 0}, {2.5})}, {"x+1.5 [3,5,2]", {a3}, Args({I(BinaryOp::kAdd), 0}, {1.5})},
      {"x/3", {a}, Args({I(BinaryOp::kDiv), 0}, {3.0})},   {"2/x", {pos}, Args({I(BinaryOp::kDiv), 1}, {2.0})},
      {"2-x", {a}, Args({I(BinaryOp::kSub), 1}, {2.0})},   {"max(x, 0.2)", {a}, Args({I(BinaryOp::kMax), 0}, {0.2})},
  };
}

std::vector<Case> UnaryCases() {
  const Tensor a = Rand({5, 7}, 21, -2, 2), pos = Rand({5, 7}, 22, 0.5, 2), a3 = Rand({3, 5, 2}, 23, -2, 2);
  std::vector<Case> cs;
  for (UnaryOp op : {UnaryOp::kGelu, UnaryOp::kNeg, UnaryOp::kExp, UnaryOp::kTanh, UnaryOp::kRelu, UnaryOp::kAbs,
                     UnaryOp::kSquare}) {
    cs.push_back({absl::StrCat("unary ", I(op), " [5,7]"), {a}, Args({I(op)})});
  }
  cs.push_back({"neg [3,5,2]", {a3}, Args({I(UnaryOp::kNeg)})});
  for (UnaryOp op : {UnaryOp::kSqrt, UnaryOp::kLog, UnaryOp::kRsqrt}) {
    cs.push_back({absl::StrCat("unary ", I(op), " [5,7] positive"), {pos}, Args({I(op)})});
  }
  return cs;
}

std::vector<Case> UnaryBackwardCases() {
  const Tensor dy = Rand({5, 7}, 31), a = Rand({5, 7}, 32, -2, 2), pos = Rand({5, 7}, 33, 0.5, 2);
  std::vector<Case> cs;
  for (UnaryOp op : {UnaryOp::kGelu, UnaryOp::kTanh, UnaryOp::kExp, UnaryOp::kRelu}) {
    cs.push_back({absl::StrCat("unary_backward ", I(op)), {dy, a}, Args({I(op)})});
  }
  for (UnaryOp op : {UnaryOp::kSqrt, UnaryOp::kLog}) {
    cs.push_back({absl::StrCat("unary_backward ", I(op), " positive"), {dy, pos}, Args({I(op)})});
  }
  return cs;
}

std::vector<Case> DropoutCases() {
  return {
      {"dropout [5,7] p=0.3", {Rand({5, 7}, 41)}, Args({1234}, {0.3})},
      {"dropout [3,5,2] p=0.5", {Rand({3, 5, 2}, 42)}, Args({99}, {0.5})},
  };
}

std::vector<Case> ReduceCases() {
  // [5, 6, 3]: 5 over 4 ranks is 2,2,1,0 and 3 over 4 is 1,1,1,0 (an empty piece).
  const Tensor x = Rand({5, 6, 3}, 51);
  struct R1 {
    ReduceOp op;
    std::vector<int64_t> dims;  // normalised, sorted
    bool keepdim;
  };
  const std::vector<R1> rs = {
      {ReduceOp::kSum, {0, 1, 2}, false}, {ReduceOp::kSum, {1}, false},    {ReduceOp::kSum, {0, 2}, true},
      {ReduceOp::kMean, {0}, false},      {ReduceOp::kMean, {2}, true},    {ReduceOp::kMean, {0, 1, 2}, false},
      {ReduceOp::kMax, {0}, false},       {ReduceOp::kMax, {1, 2}, false}, {ReduceOp::kMax, {0, 1, 2}, false},
      {ReduceOp::kMin, {2}, true},        {ReduceOp::kMin, {0, 1}, false},
  };
  std::vector<Case> cs;
  for (const R1& r : rs) {
    std::vector<int64_t> ints = {I(r.op), r.keepdim ? 1 : 0};
    ints.insert(ints.end(), r.dims.begin(), r.dims.end());
    cs.push_back({absl::StrCat("reduce op ", I(r.op), " dims [", absl::StrJoin(r.dims, ","), "] keepdim ", r.keepdim),
                  {x},
                  Args(ints)});
  }
  return cs;
}

// args.ints = {keepdim, ndim, shape..., dims...}
OpArgs ExpandArgs(bool keepdim, std::vector<int64_t> shape, std::vector<int64_t> dims) {
  std::vector<int64_t> ints = {keepdim ? 1 : 0, static_cast<int64_t>(shape.size())};
  ints.insert(ints.end(), shape.begin(), shape.end());
  ints.insert(ints.end(), dims.begin(), dims.end());
  return Args(ints);
}

std::vector<Case> ExpandCases() {
  return {
      {"[5,3] -> [5,6,3] over 1", {Rand({5, 3}, 61)}, ExpandArgs(false, {5, 6, 3}, {1})},
      {"[1,6,1] -> [5,6,3] over 0,2 keepdim", {Rand({1, 6, 1}, 62)}, ExpandArgs(true, {5, 6, 3}, {0, 2})},
      {"[6] -> [5,6,3] over 0,2", {Rand({6}, 63)}, ExpandArgs(false, {5, 6, 3}, {0, 2})},
      {"[] -> [5,7] over 0,1", {Scalar0d(0.3)}, ExpandArgs(false, {5, 7}, {0, 1})},
  };
}

std::vector<Case> EqualCases() {
  const Tensor x = Rand({5, 6}, 71), x3 = Rand({5, 6, 3}, 72);
  return {
      {"equal [5,6]", {x, SomeEqual(Rand({5, 6}, 73), x)}, {}},
      {"equal [5,6,3]", {SomeEqual(Rand({5, 6, 3}, 74), x3), x3}, {}},
  };
}

std::vector<Case> ReshapeCases() {
  // Groups that keep a shard: [4,6] -> [24] (4 and 24 divide over 2 and 4 ranks), [8,3,5] ->
  // [24,5], [12,2] -> [8,3], [6,10] -> [6,2,5] (10 and 2 divide over 2 only), [5,6,4] ->
  // [5,24] (5 -> 5 one to one, uneven). And groups that do not: [5,6] -> [30], [2,3,4] -> [6,4]
  // on 4 ranks. Divisibility counts the shards of the group, not the mesh: [4,12] -> [4,2,6]
  // keeps 12's shard on one mesh dim of 2 beside dim 0's shard on the other (attention's
  // [B, T, C] -> [B, T, H, D] with the batch over data parallelism and C over tp), not over
  // both.
  auto c = [](std::string name, Shape in, std::vector<int64_t> out, uint64_t seed) {
    return Case{name, {Rand(in, seed)}, Args(out)};
  };
  return {
      c("[4,6] -> [24]", {4, 6}, {24}, 81),           c("[24] -> [4,6]", {24}, {4, 6}, 82),
      c("[8,3,5] -> [24,5]", {8, 3, 5}, {24, 5}, 83), c("[12,2] -> [8,3]", {12, 2}, {8, 3}, 84),
      c("[6,10] -> [6,2,5]", {6, 10}, {6, 2, 5}, 85), c("[5,6,4] -> [5,24]", {5, 6, 4}, {5, 24}, 86),
      c("[5,6] -> [30]", {5, 6}, {30}, 87),           c("[2,3,4] -> [6,4]", {2, 3, 4}, {6, 4}, 88),
      c("[5,1,6] -> [5,6]", {5, 1, 6}, {5, 6}, 89),   c("[4,12] -> [4,2,6]", {4, 12}, {4, 2, 6}, 90),
  };
}

std::vector<Case> PermuteCases() {
  return {
      {"[5,6,3] perm 2,0,1", {Rand({5, 6, 3}, 91)}, Args({2, 0, 1})},
      {"[5,7] perm 1,0", {Rand({5, 7}, 92)}, Args({1, 0})},
  };
}

std::vector<Case> NarrowCases() {
  return {
      {"[5,7] dim 1 [2,6)", {Rand({5, 7}, 101)}, Args({1, 2, 4})},
      {"[5,7] dim 0 [1,4)", {Rand({5, 7}, 102)}, Args({0, 1, 3})},
      {"[3,5,6] dim 2 [5,6)", {Rand({3, 5, 6}, 103)}, Args({2, 5, 1})},
  };
}

// args.ints = {dim, start, ndim, shape...}
std::vector<Case> NarrowBackwardCases() {
  return {
      {"[5,4] -> [5,7] dim 1 at 2", {Rand({5, 4}, 111)}, Args({1, 2, 2, 5, 7})},
      {"[3,7] -> [5,7] dim 0 at 1", {Rand({3, 7}, 112)}, Args({0, 1, 2, 5, 7})},
      {"[3,5,1] -> [3,5,6] dim 2 at 5", {Rand({3, 5, 1}, 113)}, Args({2, 5, 3, 3, 5, 6})},
  };
}

// (g0, g1, ...) -> their concatenation; args.ints = {dim}
std::vector<Case> SplitBackwardCases() {
  return {
      {"3 x [2,3,4] dim 2", {Rand({2, 3, 4}, 114), Rand({2, 3, 4}, 115), Rand({2, 3, 4}, 116)}, Args({2})},
      {"[4,5] + [2,5] dim 0", {Rand({4, 5}, 117), Rand({2, 5}, 118)}, Args({0})},
  };
}

std::vector<Case> ContiguousCases() {
  return {
      {"[5,6] non-contiguous", {testing::NonContiguous(Rand({5, 6}, 121))}, {}},
      {"[5,6,3]", {Rand({5, 6, 3}, 122)}, {}},
  };
}

std::vector<Case> LinearCases() {
  return {
      {"[5,10] x [7,10]", {Rand({5, 10}, 131), Rand({7, 10}, 132)}, {}},
      {"[2,5,10] x [7,10]", {Rand({2, 5, 10}, 133), Rand({7, 10}, 134)}, {}},
      {"[5,6] x [3,6] (empty pieces)", {Rand({5, 6}, 135), Rand({3, 6}, 136)}, {}},
  };
}

std::vector<Case> LinearBiasCases() {
  return {
      {"[5,10] x [7,10] + b", {Rand({5, 10}, 137), Rand({7, 10}, 138), Rand({7}, 139)}, Args({0})},
      {"[2,5,10] x [7,10] + b", {Rand({2, 5, 10}, 140), Rand({7, 10}, 141), Rand({7}, 142)}, Args({0})},
      {"[5,6] x [3,6] + b (empty pieces)", {Rand({5, 6}, 143), Rand({3, 6}, 144), Rand({3}, 145)}, Args({0})},
  };
}

std::vector<Case> LinearBiasGeluCases() {
  return {
      {"[5,10] x [7,10] + b", {Rand({5, 10}, 237), Rand({7, 10}, 238), Rand({7}, 239)}, Args({1})},
      {"[2,5,10] x [7,10] + b", {Rand({2, 5, 10}, 240), Rand({7, 10}, 241), Rand({7}, 242)}, Args({1})},
      {"[5,6] x [3,6] + b (empty pieces)", {Rand({5, 6}, 246), Rand({3, 6}, 247), Rand({3}, 248)}, Args({1})},
  };
}

std::vector<Case> LinearDxCases() {
  return {
      {"dy [5,7] w [7,10]", {Rand({5, 7}, 141), Rand({7, 10}, 142)}, {}},
      {"dy [2,5,7] w [7,10]", {Rand({2, 5, 7}, 143), Rand({7, 10}, 144)}, {}},
      {"dy [5,3] w [3,6] (empty pieces)", {Rand({5, 3}, 145), Rand({3, 6}, 146)}, {}},
  };
}

std::vector<Case> LinearDwCases() {
  return {
      {"dy [5,7] x [5,10]", {Rand({5, 7}, 151), Rand({5, 10}, 152)}, {}},
      {"dy [2,5,7] x [2,5,10]", {Rand({2, 5, 7}, 153), Rand({2, 5, 10}, 154)}, {}},
      {"dy [5,3] x [5,6] (empty pieces)", {Rand({5, 3}, 155), Rand({5, 6}, 156)}, {}},
  };
}

std::vector<Case> LinearDwBiasCases() {
  return {
      {"dy [5,7] x [5,10]", {Rand({5, 7}, 351), Rand({5, 10}, 352)}, {}},
      {"dy [2,5,7] x [2,5,10]", {Rand({2, 5, 7}, 353), Rand({2, 5, 10}, 354)}, {}},
      {"dy [5,3] x [5,6] (empty pieces)", {Rand({5, 3}, 355), Rand({5, 6}, 356)}, {}},
  };
}

std::vector<Case> LinearDxGeluCases() {
  return {
      {"dy [5,7] w [7,10] pre [5,10]", {Rand({5, 7}, 361), Rand({7, 10}, 362), Rand({5, 10}, 363)}, {}},
      {"dy [2,5,7] w [7,10] pre [2,5,10]", {Rand({2, 5, 7}, 364), Rand({7, 10}, 365), Rand({2, 5, 10}, 366)}, {}},
      {"dy [5,3] w [3,6] pre [5,6] (empty pieces)", {Rand({5, 3}, 367), Rand({3, 6}, 368), Rand({5, 6}, 369)}, {}},
  };
}

std::vector<Case> MlpGeluCases() {
  return {
      {"x [5,10] fc [12,10] proj [7,12]",
       {Rand({5, 10}, 371), Rand({12, 10}, 372), Rand({12}, 373), Rand({7, 12}, 374), Rand({7}, 375)},
       {}},
      {"x [2,5,10] fc [12,10] proj [7,12]",
       {Rand({2, 5, 10}, 376), Rand({12, 10}, 377), Rand({12}, 378), Rand({7, 12}, 379), Rand({7}, 380)},
       {}},
      {"x [5,6] fc [3,6] proj [4,3] (empty pieces)",
       {Rand({5, 6}, 381), Rand({3, 6}, 382), Rand({3}, 383), Rand({4, 3}, 384), Rand({4}, 385)},
       {}},
  };
}

std::vector<Case> MatmulCases() {
  return {
      {"[5,4] x [4,3]", {Rand({5, 4}, 161), Rand({4, 3}, 162)}, Args({0, 0})},
      {"[4,5]^T x [4,3]", {Rand({4, 5}, 163), Rand({4, 3}, 164)}, Args({1, 0})},
      {"[5,4] x [3,4]^T", {Rand({5, 4}, 165), Rand({3, 4}, 166)}, Args({0, 1})},
      {"[4,5]^T x [3,4]^T", {Rand({4, 5}, 167), Rand({3, 4}, 168)}, Args({1, 1})},
      {"[3,5,4] x [3,4,2]", {Rand({3, 5, 4}, 169), Rand({3, 4, 2}, 170)}, Args({0, 0})},
      {"[3,4,5]^T x [3,2,4]^T", {Rand({3, 4, 5}, 171), Rand({3, 2, 4}, 172)}, Args({1, 1})},
      {"[3,5,4] x [4,2]", {Rand({3, 5, 4}, 173), Rand({4, 2}, 174)}, Args({0, 0})},
      {"[3,5,4] x [2,4]^T", {Rand({3, 5, 4}, 175), Rand({2, 4}, 176)}, Args({0, 1})},
  };
}

std::vector<Case> LayerNormCases() {
  return {
      {"[5,3,8]", {Rand({5, 3, 8}, 181, -2, 2), Rand({8}, 182, 0.5, 1.5), Rand({8}, 183)}, Args({}, {1e-5})},
      {"[5,6]", {Rand({5, 6}, 184, -2, 2), Rand({6}, 185, 0.5, 1.5), Rand({6}, 186)}, Args({}, {1e-5})},
  };
}

std::vector<Case> LayerNormBackwardCases() {
  std::vector<Case> cs;
  for (const Case& f : LayerNormCases()) {
    const std::vector<Tensor> y = RunPlain(op_defs::LayerNorm(), f.inputs, f.args);  // y, mean, rstd
    if (y.size() != 3) return {};
    const Tensor dy = Rand(f.inputs[0].shape(), 187);
    cs.push_back({f.name, {dy, f.inputs[0], f.inputs[1], y[1], y[2]}, {}});
  }
  return cs;
}

std::vector<Case> AddLayerNormCases() {
  return {
      {"[5,3,8]",
       {Rand({5, 3, 8}, 2101, -2, 2), Rand({5, 3, 8}, 2102, -2, 2), Rand({8}, 2103, 0.5, 1.5), Rand({8}, 2104)},
       Args({}, {1e-5})},
      {"[5,6]",
       {Rand({5, 6}, 2105, -2, 2), Rand({5, 6}, 2106, -2, 2), Rand({6}, 2107, 0.5, 1.5), Rand({6}, 2108)},
       Args({}, {1e-5})},
  };
}

std::vector<Case> AddLayerNormBackwardCases() {
  std::vector<Case> cs;
  for (const Case& f : AddLayerNormCases()) {
    const std::vector<Tensor> y = RunPlain(op_defs::AddLayerNorm(), f.inputs, f.args);  // x1, y, mean, rstd
    if (y.size() != 4) return {};
    const Tensor dy = Rand(f.inputs[0].shape(), 2111), dx1 = Rand(f.inputs[0].shape(), 2112);
    cs.push_back({f.name, {dy, y[0], f.inputs[2], y[2], y[3], dx1}, {}});
  }
  return cs;
}

std::vector<Case> RmsNormCases() {
  return {
      {"[5,8]", {Rand({5, 8}, 191, -2, 2), Rand({8}, 192, 0.5, 1.5)}, Args({}, {1e-6})},
      {"[3,5,4]", {Rand({3, 5, 4}, 193, -2, 2), Rand({4}, 194, 0.5, 1.5)}, Args({}, {1e-6})},
  };
}

std::vector<Case> RmsNormBackwardCases() {
  std::vector<Case> cs;
  for (const Case& f : RmsNormCases()) {
    const std::vector<Tensor> y = RunPlain(op_defs::RmsNorm(), f.inputs, f.args);  // y, rstd
    if (y.size() != 2) return {};
    cs.push_back({f.name, {Rand(f.inputs[0].shape(), 195), f.inputs[0], f.inputs[1], y[1]}, {}});
  }
  return cs;
}

std::vector<Case> SoftmaxCases() {
  const Tensor x2 = Rand({5, 7}, 201, -3, 3), x3 = Rand({3, 5, 4}, 202, -3, 3);
  std::vector<Case> cs;
  for (int64_t log : {0, 1}) {
    const std::string n = log ? "log_softmax" : "softmax";
    cs.push_back({n + " [5,7] dim 1", {x2}, Args({1, log})});
    cs.push_back({n + " [5,7] dim 0", {x2}, Args({0, log})});
    cs.push_back({n + " [3,5,4] dim 1", {x3}, Args({1, log})});
  }
  return cs;
}

std::vector<Case> SoftmaxBackwardCases() {
  std::vector<Case> cs;
  for (const Case& f : SoftmaxCases()) {
    const std::vector<Tensor> y = RunPlain(op_defs::Softmax(), f.inputs, f.args);
    if (y.size() != 1) return {};
    cs.push_back({f.name, {Rand(f.inputs[0].shape(), 203), y[0]}, f.args});
  }
  return cs;
}

std::vector<Case> AttentionCases() {
  // B=3, H=5: uneven over 2 and 4 on both the batch and the head dim (empty pieces on 4).
  const Shape s = {3, 5, 4, 2};
  return {{"[3,5,4,2]", {Rand(s, 211), Rand(s, 212), Rand(s, 213)}, Args({}, {1.0 / std::sqrt(2.0)})},
          {"[2,2,3,4] scale 0.3",
           {Rand({2, 2, 3, 4}, 214), Rand({2, 2, 3, 4}, 215), Rand({2, 2, 3, 4}, 216)},
           Args({}, {0.3})}};
}

std::vector<Case> AttentionBackwardCases() {
  std::vector<Case> cs;
  for (const Case& f : AttentionCases()) {
    const std::vector<Tensor> y = RunPlain(op_defs::Attention(), f.inputs, f.args);  // out, lse
    if (y.size() != 2) return {};
    cs.push_back({f.name, {Rand(f.inputs[0].shape(), 217), f.inputs[0], f.inputs[1], f.inputs[2], y[0], y[1]}, f.args});
  }
  return cs;
}

std::vector<Case> CrossEntropyCases() {
  const OpArgs ignore = Args({-100});
  return {
      // 5 rows (uneven batch); the last two ignored, so on 4 ranks one piece has no target.
      {"[5,7]", {Rand({5, 7}, 221, -3, 3), Ids({3, 6, 0, -100, -100}, {5})}, ignore},
      // The first two ignored: rank 0's rows over 4 ranks count 0.
      {"[5,7] first rows ignored", {Rand({5, 7}, 222, -3, 3), Ids({-100, -100, 6, 1, 4}, {5})}, ignore},
      {"[2,3,11]", {Rand({2, 3, 11}, 223, -3, 3), Ids({1, 10, 2, 0, -100, 5}, {2, 3})}, ignore},
      // A vocabulary of 6 over 4 ranks leaves one rank an empty vocab piece; ignore_index 2.
      {"[5,6] ignore 2", {Rand({5, 6}, 224, -3, 3), Ids({3, 5, 0, 2, 1}, {5})}, Args({2})},
  };
}

std::vector<Case> CrossEntropyBackwardCases() {
  std::vector<Case> cs;
  for (const Case& f : CrossEntropyCases()) {
    // loss, lse, count (the global count of targets != ignore_index)
    const std::vector<Tensor> y = RunPlain(op_defs::CrossEntropy(), f.inputs, f.args);
    if (y.size() != 3) return {};
    cs.push_back({f.name, {Scalar0d(0.7), f.inputs[0], f.inputs[1], y[1], y[2]}, f.args});
  }
  return cs;
}

// The cases above; every other one for an upstream gradient of 0.5 instead of 1.
std::vector<Case> CrossEntropyFusedCases() {
  std::vector<Case> cs = CrossEntropyCases();
  for (size_t i = 0; i < cs.size(); ++i) cs[i].args.floats.push_back(i % 2 == 0 ? 1.0 : 0.5);
  return cs;
}

std::vector<Case> EmbeddingCases() {
  const Tensor w = Rand({11, 4}, 231);  // 11 rows: uneven over 2 and 4
  const Tensor w6 = Rand({6, 5}, 232);  // 5 channels, 6 rows (an empty piece over 4)
  return {
      {"[11,4] ids [2,5]", {w, Ids({0, 10, 3, 3, 7, 5, 1, 10, 2, 9}, {2, 5})}, {}},
      {"[11,4] ids [5]", {w, Ids({4, 0, 10, 6, 6}, {5})}, {}},
      // Regression: the rank with the empty vocab piece (S(0), R -> P(sum) on 4 ranks) once
      // failed "[Embedding] id 0 at position 0 is outside [0, 0)".
      {"[6,5] ids [3]", {w6, Ids({5, 0, 5}, {3})}, {}},
  };
}

std::vector<Case> EmbeddingBackwardCases() {
  return {
      {"dout [2,5,4] V=11", {Rand({2, 5, 4}, 241), Ids({0, 10, 3, 3, 7, 5, 1, 10, 2, 9}, {2, 5})}, Args({11})},
      {"dout [5,4] V=11", {Rand({5, 4}, 242), Ids({4, 0, 10, 6, 6}, {5})}, Args({11})},
      {"dout [3,5] V=6", {Rand({3, 5}, 243), Ids({5, 0, 5}, {3})}, Args({6})},
  };
}

// ---- Running every strategy ----

// What CheckOp found: strategies checked (or skipped as known bugs) per mesh, and failures.
struct Outcome {
  std::map<std::string, int64_t> checked;  // per mesh name
  std::map<std::string, int64_t> skipped;
  std::vector<std::string> failures;
};

// A known bug: the reason to skip this strategy for this case (empty: run it).
using SkipFn = std::string (*)(const Case& c, IntSpan mesh_shape, const OpStrategy& s);

std::string StrategyString(const OpStrategy& s) {
  return absl::StrCat(agtest::LayoutsString(s.inputs), " -> ", agtest::LayoutsString(s.outputs));
}

// Empty when actual matches expected (|a - e| <= atol + rtol |e|, NaN matches NaN).
std::string Mismatch(const std::vector<double>& a, const std::vector<double>& e, testing::Tolerance tol) {
  if (a.size() != e.size()) return absl::StrCat(a.size(), " elements, expected ", e.size());
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(e[i])) continue;
    if (std::abs(a[i] - e[i]) <= tol.atol + tol.rtol * std::abs(e[i])) continue;
    if (bad++ == 0) first = absl::StrCat("element ", i, " is ", a[i], ", expected ", e[i]);
  }
  return bad == 0 ? "" : absl::StrCat(bad, " of ", a.size(), " elements differ; ", first);
}

// Runs every strategy of `op` for every case on every mesh shape. Collective errors are agreed
// on by all ranks before the next collective, so a failing strategy never leaves a rank waiting.
Outcome CheckOp(const OpDef& op, const std::vector<Case>& cases, SkipFn skip) {
  Outcome res;
  std::mutex mu;
  auto fail = [&](std::string f) {
    std::lock_guard<std::mutex> lock(mu);
    res.failures.push_back(std::move(f));
  };
  if (cases.empty()) fail(absl::StrCat(op.name, ": no cases (a forward for the saved inputs failed?)"));
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    std::vector<Value> plain(c.inputs.begin(), c.inputs.end());
    auto ref_or = Dispatch(op, plain, c.args);
    if (!ref_or.ok()) {
      fail(absl::StrCat(op.name, " ", c.name, " single rank: ", ref_or.status().ToString()));
      continue;
    }
    std::vector<std::vector<double>> ref;
    for (const Value& v : *ref_or) ref.push_back(testing::Values(v.local()));
    std::vector<TensorMeta> metas;
    for (const Tensor& t : c.inputs) metas.push_back({Shape(t.shape().begin(), t.shape().end()), t.dtype()});
    for (const Shape& ms : agtest::MeshShapes()) {
      const std::string mesh_name = agtest::MeshName(ms);
      auto strategies = EnumerateStrategies(op, metas, c.args, ms);
      if (!strategies.ok()) {
        fail(absl::StrCat(op.name, " ", c.name, " on ", mesh_name, ": ", strategies.status().ToString()));
        continue;
      }
      int64_t checked = 0, skipped = 0;
      // A strategy whose pieces fail FromLocal's check on some rank aborts that world (ranks fail
      // together): the remaining strategies then run on a fresh one.
      size_t next = 0;
      while (next < strategies->size()) {
        size_t resume = strategies->size();  // written by rank 0 only
        agtest::RunMesh(ms, [&](const DeviceMesh& mesh) {
          const int rank = mesh.world().rank();
          const bool leader = rank == 0;
          for (size_t k = next; k < strategies->size(); ++k) {
            const OpStrategy& s = (*strategies)[k];
            const std::string what =
                absl::StrCat(op.name, " ", c.name, " on ", mesh_name, " strategy ", StrategyString(s));
            if (skip != nullptr) {
              const std::string why = skip(c, ms, s);
              if (!why.empty()) {
                if (leader) {
                  ++skipped;
                  std::printf("[ SKIPPED  ] %s: known bug: %s\n", what.c_str(), why.c_str());
                }
                continue;
              }
            }
            std::vector<Value> in =
                agtest::DistributeParts(c.inputs, mesh, s.inputs, 1000 * static_cast<uint64_t>(ci) + k);
            auto out = DispatchWith(op, s, in, c.args);
            bool aborted = false;
            if (!agtest::AllOk(mesh, out.ok(), &aborted)) {
              if (!out.ok()) fail(absl::StrCat(what, ": rank ", rank, ": ", out.status().ToString()));
              if (aborted) {
                if (leader) resume = k + 1;
                return;
              }
              continue;
            }
            if (leader) ++checked;
            if (out->size() != ref.size()) {  // the same on every rank
              if (leader) fail(absl::StrCat(what, ": ", out->size(), " outputs, expected ", ref.size()));
              continue;
            }
            for (size_t o = 0; o < ref.size(); ++o) {
              const Value& v = (*out)[o];
              if (!v.is_dtensor()) {  // the same on every rank
                if (leader) fail(absl::StrCat(what, ": output ", o, " is not a DTensor"));
                continue;
              }
              if (leader && v.dtensor().layout() != s.outputs[o]) {
                fail(absl::StrCat(what, ": output ", o, " has layout ", v.dtensor().layout().ToString()));
              }
              // The full value: Partial mesh dims reduced, then gathered (collective).
              auto full = v.dtensor().FullTensor();
              if (!agtest::AllOk(mesh, full.ok())) {
                if (!full.ok())
                  fail(absl::StrCat(what, ": output ", o, ": rank ", rank, ": ", full.status().ToString()));
                continue;
              }
              const std::string m = Mismatch(testing::Values(*full), ref[o], c.tol);
              if (!m.empty()) fail(absl::StrCat(what, ": output ", o, " on rank ", rank, ": ", m));
            }
          }
        });
        next = resume;
      }
      res.checked[mesh_name] += checked;
      res.skipped[mesh_name] += skipped;
    }
  }
  return res;
}

struct OpSpec {
  const char* test_name;
  const OpDef& (*op)();
  std::vector<Case> (*cases)();
  SkipFn skip = nullptr;
};

// Every OpDef of op_defs.h.
const OpSpec kSpecs[] = {
    {"Attention", op_defs::Attention, AttentionCases},
    {"AttentionBackward", op_defs::AttentionBackward, AttentionBackwardCases},
    {"Embedding", op_defs::Embedding, EmbeddingCases},
    {"EmbeddingBackward", op_defs::EmbeddingBackward, EmbeddingBackwardCases},
    {"CrossEntropy", op_defs::CrossEntropy, CrossEntropyCases},
    {"CrossEntropyBackward", op_defs::CrossEntropyBackward, CrossEntropyBackwardCases},
    {"CrossEntropyFused", op_defs::CrossEntropyFused, CrossEntropyFusedCases},
    {"Linear", op_defs::Linear, LinearCases},
    {"LinearBias", op_defs::LinearBias, LinearBiasCases},
    {"LinearBiasGelu", op_defs::LinearBiasGelu, LinearBiasGeluCases},
    {"LinearDx", op_defs::LinearDx, LinearDxCases},
    {"LinearDw", op_defs::LinearDw, LinearDwCases},
    {"LinearDwBias", op_defs::LinearDwBias, LinearDwBiasCases},
    {"LinearDxGelu", op_defs::LinearDxGelu, LinearDxGeluCases},
    {"MlpGelu", op_defs::MlpGelu, MlpGeluCases},
    {"Matmul", op_defs::Matmul, MatmulCases},
    {"LayerNorm", op_defs::LayerNorm, LayerNormCases},
    {"LayerNormBackward", op_defs::LayerNormBackward, LayerNormBackwardCases},
    {"AddLayerNorm", op_defs::AddLayerNorm, AddLayerNormCases},
    {"AddLayerNormBackward", op_defs::AddLayerNormBackward, AddLayerNormBackwardCases},
    {"RmsNorm", op_defs::RmsNorm, RmsNormCases},
    {"RmsNormBackward", op_defs::RmsNormBackward, RmsNormBackwardCases},
    {"Softmax", op_defs::Softmax, SoftmaxCases},
    {"SoftmaxBackward", op_defs::SoftmaxBackward, SoftmaxBackwardCases},
    {"Binary", op_defs::Binary, BinaryCases},
    {"Scalar", op_defs::Scalar, ScalarCases},
    {"Unary", op_defs::Unary, UnaryCases},
    {"UnaryBackward", op_defs::UnaryBackward, UnaryBackwardCases},
    {"Dropout", op_defs::Dropout, DropoutCases},
    {"Reduce", op_defs::Reduce, ReduceCases},
    {"Expand", op_defs::Expand, ExpandCases},
    {"Equal", op_defs::Equal, EqualCases},
    {"Reshape", op_defs::Reshape, ReshapeCases},
    {"Permute", op_defs::Permute, PermuteCases},
    {"Narrow", op_defs::Narrow, NarrowCases},
    {"NarrowBackward", op_defs::NarrowBackward, NarrowBackwardCases},
    {"SplitBackward", op_defs::SplitBackward, SplitBackwardCases},
    {"Contiguous", op_defs::Contiguous, ContiguousCases},
};
constexpr int kNumSpecs = static_cast<int>(sizeof(kSpecs) / sizeof(kSpecs[0]));

class EveryStrategy : public ::testing::TestWithParam<int> {};

TEST_P(EveryStrategy, MatchesSingleRank) {
  const OpSpec& spec = kSpecs[GetParam()];
  const OpDef& op = spec.op();
  const Outcome res = CheckOp(op, spec.cases(), spec.skip);
  std::vector<std::string> parts;
  for (const Shape& ms : agtest::MeshShapes()) {
    const std::string m = agtest::MeshName(ms);
    const int64_t sk = res.skipped.count(m) ? res.skipped.at(m) : 0;
    parts.push_back(absl::StrCat(m, " ", res.checked.count(m) ? res.checked.at(m) : 0,
                                 sk ? absl::StrCat(" (", sk, " skipped)") : ""));
  }
  std::printf("[ STRATEGY ] %s: strategies checked: %s\n", op.name, absl::StrJoin(parts, ", ").c_str());
  const std::string m2 = agtest::MeshName(Shape{2});
  EXPECT_GE(res.checked.count(m2) ? res.checked.at(m2) : 0, 2) << op.name << ": too few strategies checked on " << m2;
  for (size_t i = 0; i < res.failures.size() && i < 20; ++i) ADD_FAILURE() << res.failures[i];
  EXPECT_TRUE(res.failures.empty()) << res.failures.size() << " failures";
}

INSTANTIATE_TEST_SUITE_P(OpDefs, EveryStrategy, ::testing::Range(0, kNumSpecs),
                         [](const ::testing::TestParamInfo<int>& info) { return kSpecs[info.param].test_name; });

TEST(EveryStrategyTable, CoversEveryOpDefOnce) {
  EXPECT_EQ(kNumSpecs, 38);
  for (int i = 0; i < kNumSpecs; ++i) {
    for (int j = 0; j < i; ++j) {
      EXPECT_NE(&kSpecs[i].op(), &kSpecs[j].op()) << kSpecs[i].test_name << " and " << kSpecs[j].test_name;
    }
  }
}

// ---- Replicate inputs stay Replicate ----

// Every strategy costs 0 bytes for Replicate inputs (slicing a replicated tensor to a shard is
// free), so the tie-break on the number of redistributed inputs decides: nothing moves.
TEST(EveryStrategyTieBreak, ReplicateInputsStayReplicate) {
  const Tensor a = Rand({6, 8}, 301), b = Rand({6, 8}, 302), w = Rand({4, 8}, 303);
  const Layout r1({Replicate()});
  agtest::RunMesh({2}, [&](const DeviceMesh& mesh) {
    struct Call {
      std::string name;
      std::function<absl::StatusOr<Value>(const std::vector<Value>&)> run;
      std::vector<Tensor> inputs;
    };
    const std::vector<Call> calls = {
        {"add", [](const std::vector<Value>& in) { return fn::Add(in[0], in[1]); }, {a, b}},
        {"gelu", [](const std::vector<Value>& in) { return fn::Unary(UnaryOp::kGelu, in[0]); }, {a}},
        {"linear", [](const std::vector<Value>& in) { return fn::Linear(in[0], in[1]); }, {a, w}},
    };
    for (const Call& c : calls) {
      std::vector<Value> in = agtest::DistributeAll(c.inputs, mesh, std::vector<Layout>(c.inputs.size(), r1));
      CommCounter counter;
      SetCommCounter(mesh, &counter);
      auto out = c.run(in);
      SetCommCounter(mesh, nullptr);
      if (!agtest::AllOk(mesh, out.ok())) {
        if (!out.ok()) ADD_FAILURE() << c.name << ": " << out.status();
        continue;
      }
      ASSERT_TRUE(out->is_dtensor()) << c.name;
      EXPECT_EQ(out->dtensor().layout(), r1) << c.name;
      EXPECT_EQ(counter.total_calls(), 0) << c.name << ": " << counter.ToString();
      // The local piece is the whole result already (no gather needed).
      std::vector<Value> plain(c.inputs.begin(), c.inputs.end());
      const Tensor ref = Unwrap(c.run(plain)).local();
      testing::ExpectNear(testing::Values(out->local()), testing::Values(ref), agtest::kTight, c.name);
    }
    // ExplainStrategy: the same choice, cost 0 (the Values keep their layouts: pure).
    std::vector<Value> ab = agtest::DistributeAll({a, b}, mesh, {r1, r1});
    std::vector<Value> aw = agtest::DistributeAll({a, w}, mesh, {r1, r1});
    OpArgs add;
    add.ints.push_back(static_cast<int64_t>(BinaryOp::kAdd));
    OpArgs gelu;
    gelu.ints.push_back(static_cast<int64_t>(UnaryOp::kGelu));
    EXPECT_EQ(Unwrap(ExplainStrategy(op_defs::Binary(), ab, add)), "binary: R, R -> R (cost 0)");
    EXPECT_EQ(Unwrap(ExplainStrategy(op_defs::Unary(), {ab[0]}, gelu)), "unary: R -> R (cost 0)");
    EXPECT_EQ(Unwrap(ExplainStrategy(op_defs::Linear(), aw, {})), "linear: R, R -> R (cost 0)");
  });
}

// ---- The harness can fail: deliberately wrong rules are caught ----

absl::StatusOr<std::vector<TensorMeta>> SameMeta(absl::Span<const TensorMeta> in, const OpArgs&) {
  return std::vector<TensorMeta>{in[0]};
}
absl::StatusOr<std::vector<TensorMeta>> DropDim(absl::Span<const TensorMeta> in, int64_t d) {
  Shape s = in[0].shape;
  s.erase(s.begin() + d);
  return std::vector<TensorMeta>{{s, in[0].dtype}};
}
absl::StatusOr<std::vector<Tensor>> OneOut(absl::StatusOr<Tensor> t) {
  if (!t.ok()) return t.status();
  return std::vector<Tensor>{*std::move(t)};
}

// exp with P(sum) -> P(sum) (exp is not linear).
const OpDef kBadExp = {"bad_exp",
                       [](absl::Span<const TensorMeta> in, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
                         for (int64_t d = 0; d < static_cast<int64_t>(in[0].shape.size()); ++d)
                           s->push_back({{Shard(d)}, {Shard(d)}});
                         s->push_back({{Partial(PartialOp::kSum)}, {Partial(PartialOp::kSum)}});
                       },
                       SameMeta, [](const LocalCall& c) { return OneOut(dtensor::Unary(UnaryOp::kExp, c.inputs[0])); }};
// max over dim 0 with S(0) -> P(sum) (should be P(max)).
const OpDef kBadMax = {
    "bad_max",
    [](absl::Span<const TensorMeta>, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
      s->push_back({{Shard(0)}, {Partial(PartialOp::kSum)}});
      s->push_back({{Shard(1)}, {Shard(0)}});
    },
    [](absl::Span<const TensorMeta> in, const OpArgs&) { return DropDim(in, 0); },
    [](const LocalCall& c) { return OneOut(dtensor::Reduce(ReduceOp::kMax, c.inputs[0], {0}, false)); }};
// sum over dim 1 with P(max) -> P(max) (a sum of maxima is not the maximum of sums).
const OpDef kBadSum = {"bad_sum",
                       [](absl::Span<const TensorMeta>, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
                         s->push_back({{Shard(0)}, {Shard(0)}});
                         s->push_back({{Partial(PartialOp::kMax)}, {Partial(PartialOp::kMax)}});
                       },
                       [](absl::Span<const TensorMeta> in, const OpArgs&) { return DropDim(in, 1); },
                       [](const LocalCall& c) { return OneOut(dtensor::Sum(c.inputs[0], {1}, false)); }};
// neg with S(0) -> S(1) (the output pieces have the wrong shape).
const OpDef kBadNeg = {"bad_neg",
                       [](absl::Span<const TensorMeta>, const OpArgs&, IntSpan, std::vector<DimStrategy>* s) {
                         s->push_back({{Shard(0)}, {Shard(1)}});
                       },
                       SameMeta, [](const LocalCall& c) { return OneOut(dtensor::Unary(UnaryOp::kNeg, c.inputs[0])); }};

TEST(EveryStrategyHarness, CatchesWrongRules) {
  struct Bad {
    const OpDef* op;
    Shape shape;
    std::string marker;  // in every failing strategy (and in no correct one)
  };
  for (const Bad& b : std::vector<Bad>{{&kBadExp, {5, 6}, "P(sum)"},
                                       {&kBadMax, {8, 6}, "P(sum)"},
                                       {&kBadSum, {5, 6}, "P(max)"},
                                       {&kBadNeg, {6, 6}, "S(1)"}}) {
    const Outcome res = CheckOp(*b.op, {{"x", {Rand(b.shape, 401)}, {}}}, nullptr);
    EXPECT_FALSE(res.failures.empty()) << b.op->name << ": the wrong rule went unnoticed";
    std::map<std::string, int> per_mesh;
    for (const std::string& f : res.failures) {
      EXPECT_THAT(f, ::testing::HasSubstr(b.marker)) << b.op->name << ": a correct strategy failed";
      for (const Shape& ms : agtest::MeshShapes())
        per_mesh[agtest::MeshName(ms)] += absl::StrContains(f, agtest::MeshName(ms));
    }
    for (const Shape& ms : agtest::MeshShapes()) {
      EXPECT_GT(per_mesh[agtest::MeshName(ms)], 0) << b.op->name << " on " << agtest::MeshName(ms);
    }
  }
}

}  // namespace
}  // namespace dtensor
