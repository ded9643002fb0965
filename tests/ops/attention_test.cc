// Causal attention on the CPU backend against a naive float64 reference; its backward against
// central finite differences of the float64 forward (L = sum(out * R)).
#include <cmath>
#include <string>
#include <vector>

#include "dtensor/ops/ops.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;
using testing::Values;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// One head: out [T, D] and lse [T] of softmax(scale * q k^T, causal) v; q, k, v [T, D].
void RefHead(const double* q, const double* k, const double* v, int64_t t, int64_t d, double scale, double* out,
             double* lse) {
  std::vector<double> s(t);
  for (int64_t i = 0; i < t; ++i) {
    double m = -INFINITY;
    for (int64_t j = 0; j <= i; ++j) {
      double dot = 0;
      for (int64_t x = 0; x < d; ++x) dot += q[i * d + x] * k[j * d + x];
      s[j] = scale * dot;
      m = std::max(m, s[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j <= i; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    for (int64_t x = 0; x < d; ++x) {
      double o = 0;
      for (int64_t j = 0; j <= i; ++j) o += s[j] / sum * v[j * d + x];
      out[i * d + x] = o;
    }
    lse[i] = m + std::log(sum);
  }
}

struct Ref {
  std::vector<double> out, lse;
};
Ref RefAttention(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v, int64_t t,
                 int64_t d, double scale) {
  const int64_t heads = static_cast<int64_t>(q.size()) / (t * d);
  Ref r;
  r.out.resize(q.size());
  r.lse.resize(static_cast<size_t>(heads * t));
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t o = h * t * d;
    RefHead(&q[o], &k[o], &v[o], t, d, scale, &r.out[o], &r.lse[h * t]);
  }
  return r;
}

struct Case {
  int64_t b, h, t, d;
};
// T = 130 and 300 cross the kernel's 128-row query blocks; 4x12x64x64 is GPT-2 small's shape
// (heads split across threads); 1x1x300x3 runs heads in turn.
constexpr Case kCases[] = {{1, 1, 1, 1},   {1, 2, 7, 5},    {2, 3, 33, 13}, {1, 1, 130, 8},
                           {1, 1, 300, 3}, {4, 12, 64, 64}, {2, 1, 1, 7}};

std::string What(DType dt, const Case& c) {
  return std::string(DTypeName(dt)) + " " + ShapeString({c.b, c.h, c.t, c.d});
}

testing::Tolerance ForwardTol(DType dt) {
  return dt == DType::kFloat32 ? testing::Tolerance{2e-5, 2e-5} : testing::Tol(dt);
}

TEST(CpuAttentionTest, ForwardMatchesReference) {
  for (DType dt : kFloatTypes) {
    for (const Case& c : kCases) {
      for (float scale : {0.0f, 0.3f}) {
        const Shape shape = {c.b, c.h, c.t, c.d};
        const Tensor q = testing::Random(shape, dt, 1, -2.0, 2.0);
        const Tensor k = testing::Random(shape, dt, 2, -2.0, 2.0);
        const Tensor v = testing::Random(shape, dt, 3);
        const AttentionOutput o = Unwrap(CausalAttention(q, k, v, scale));
        ASSERT_EQ(o.out.shape(), IntSpan(shape));
        ASSERT_EQ(o.lse.shape(), IntSpan(Shape{c.b, c.h, c.t}));
        const double s = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(c.d));
        const Ref ref = RefAttention(Values(q), Values(k), Values(v), c.t, c.d, s);
        const std::string what = What(dt, c) + " scale " + std::to_string(scale);
        testing::ExpectNear(Values(o.out), ref.out, ForwardTol(dt), what + " out");
        testing::ExpectNear(Values(o.lse), ref.lse, {1e-5, 1e-5}, what + " lse");
      }
    }
  }
}

TEST(CpuAttentionTest, FirstRowCopiesFirstValue) {
  // Row 0 sees only key 0, whatever the scores: out[0] = v[0] and lse[0] = scale * q0.k0.
  const Tensor q = testing::Random({1, 1, 5, 3}, DType::kFloat32, 4, -50.0, 50.0);
  const Tensor k = testing::Random({1, 1, 5, 3}, DType::kFloat32, 5, -50.0, 50.0);
  const Tensor v = testing::Random({1, 1, 5, 3}, DType::kFloat32, 6);
  const AttentionOutput o = Unwrap(CausalAttention(q, k, v, 1.0f));
  const std::vector<double> out = Values(o.out), vv = Values(v), qv = Values(q), kv = Values(k);
  for (int x = 0; x < 3; ++x) EXPECT_EQ(out[x], vv[x]);
  EXPECT_NEAR(Values(o.lse)[0], qv[0] * kv[0] + qv[1] * kv[1] + qv[2] * kv[2], 1e-3);
  // Large scores elsewhere stay finite (max-shifted softmax).
  for (double x : out) EXPECT_TRUE(std::isfinite(x));
}

TEST(CpuAttentionTest, NonContiguousInputsFromTransposedHeads) {
  // The GPT layout: q, k, v are [B, T, H, D] buffers viewed as [B, H, T, D].
  const Tensor base = testing::Random({2, 9, 3, 6}, DType::kFloat32, 7);
  const Tensor q = Unwrap(base.Transpose(1, 2));
  ASSERT_FALSE(q.is_contiguous());
  const Tensor k = testing::Random({2, 3, 9, 6}, DType::kFloat32, 8);
  const Tensor v = testing::NonContiguous(testing::Random({2, 3, 9, 6}, DType::kFloat32, 9));
  const AttentionOutput o = Unwrap(CausalAttention(q, k, v));
  const Ref ref = RefAttention(Values(q), Values(k), Values(v), 9, 6, 1.0 / std::sqrt(6.0));
  testing::ExpectNear(Values(o.out), ref.out, ForwardTol(DType::kFloat32), "transposed out");
}

// The heads of a fused qkv projection [B, T, 3C], as a GPT block makes them: q, k, v are
// [B, H, T, D] views of one buffer (rows 3C + pad apart), read where they lie.
struct QkvViews {
  Tensor buffer, q, k, v;
};
QkvViews HeadsOf(const Case& c, DType dt, int64_t pad, uint64_t seed) {
  const int64_t cc = c.h * c.d;
  QkvViews r;
  r.buffer = testing::Random({c.b, c.t, 3 * cc + pad}, dt, seed, -1.5, 1.5);
  Tensor* heads[] = {&r.q, &r.k, &r.v};
  for (int64_t j = 0; j < 3; ++j) {
    const Tensor part = Unwrap(r.buffer.Narrow(2, j * cc, cc));
    *heads[j] = Unwrap(Unwrap(part.View({c.b, c.t, c.h, c.d})).Transpose(1, 2));
  }
  return r;
}
Shape StridesOf(const Tensor& t) { return Shape(t.strides().begin(), t.strides().end()); }

// Results take the inputs' layout (ops.h): out as [B, T, H, D] so that the heads merge back into
// [B, T, C] as a view; dq, dk, dv in one [B, T, 3, H, D] buffer laid out as q, k, v are, so that
// their concatenation is the projection's gradient as a view. The values are those of the
// contiguous tensors; with rows padded (not one qkv buffer) each gradient is [B, T, H, D].
TEST(CpuAttentionTest, FusedQkvHeadsAreReadAndWrittenWhereTheyLie) {
  constexpr Case kLayoutCases[] = {{2, 3, 9, 6}, {1, 2, 130, 8}, {2, 1, 5, 4}, {2, 3, 1, 4}, {1, 4, 33, 16}};
  for (DType dt : kFloatTypes) {
    for (const Case& c : kLayoutCases) {
      for (int64_t pad : {0, 8}) {
        const std::string what = What(dt, c) + " pad " + std::to_string(pad);
        const QkvViews in = HeadsOf(c, dt, pad, 21);
        ASSERT_FALSE(in.q.is_contiguous()) << what;
        const Tensor cq = Unwrap(Contiguous(in.q)), ck = Unwrap(Contiguous(in.k)), cv = Unwrap(Contiguous(in.v));
        const AttentionOutput o = Unwrap(CausalAttention(in.q, in.k, in.v));
        const AttentionOutput co = Unwrap(CausalAttention(cq, ck, cv));
        const bool time_major = c.h > 1 && c.t > 1;
        const int64_t cc = c.h * c.d;
        if (time_major) {
          EXPECT_EQ(StridesOf(o.out), Shape({c.t * cc, c.d, cc, 1})) << what << ": out laid out as [B, T, H, D]";
        } else {
          EXPECT_TRUE(o.out.is_contiguous()) << what;
        }
        const Ref ref =
            RefAttention(Values(cq), Values(ck), Values(cv), c.t, c.d, 1.0 / std::sqrt(static_cast<double>(c.d)));
        testing::ExpectNear(Values(o.out), ref.out, ForwardTol(dt), what + " out");
        testing::ExpectNear(Values(o.lse), ref.lse, {1e-5, 1e-5}, what + " lse");

        // Backward, dout laid out as the merged heads' gradient is: [B, T, H, D] seen as [B, H, T, D].
        const Tensor dout_btHd = testing::Random({c.b, c.t, c.h, c.d}, dt, 23);
        const Tensor d_out = Unwrap(dout_btHd.Transpose(1, 2));
        const AttentionGrads g = Unwrap(CausalAttentionBackward(d_out, in.q, in.k, in.v, o));
        const AttentionGrads cg = Unwrap(CausalAttentionBackward(Unwrap(Contiguous(d_out)), cq, ck, cv, co));
        const testing::Tolerance tol = dt == DType::kFloat32 ? testing::Tolerance{1e-5, 1e-6} : testing::Tol(dt);
        testing::ExpectNear(Values(g.dq), Values(cg.dq), tol, what + " dq");
        testing::ExpectNear(Values(g.dk), Values(cg.dk), tol, what + " dk");
        testing::ExpectNear(Values(g.dv), Values(cg.dv), tol, what + " dv");
        if (pad == 0 && c.t > 1 && c.h > 1) {
          // One buffer, laid out as q, k, v.
          EXPECT_EQ(g.dk.storage(), g.dq.storage()) << what;
          EXPECT_EQ(g.dv.storage(), g.dq.storage()) << what;
          EXPECT_EQ(StridesOf(g.dq), StridesOf(in.q)) << what;
          EXPECT_EQ(g.dk.storage_offset(), g.dq.storage_offset() + cc) << what;
          EXPECT_EQ(g.dv.storage_offset(), g.dk.storage_offset() + cc) << what;
        } else if (time_major) {
          EXPECT_NE(g.dk.storage(), g.dq.storage()) << what;
          for (const Tensor* x : {&g.dq, &g.dk, &g.dv}) {
            EXPECT_EQ(StridesOf(*x), Shape({c.t * cc, c.d, cc, 1})) << what << ": [B, T, H, D]";
          }
        }
      }
    }
  }
}

TEST(CpuAttentionTest, BackwardMatchesFiniteDifferences) {
  for (DType dt : kFloatTypes) {
    for (const Case& c : kCases) {
      const Shape shape = {c.b, c.h, c.t, c.d};
      const Tensor q = testing::Random(shape, dt, 11, -1.5, 1.5);
      const Tensor k = testing::Random(shape, dt, 12, -1.5, 1.5);
      const Tensor v = testing::Random(shape, dt, 13);
      const Tensor r = testing::Random(shape, dt, 14);
      const float scale = c.d == 5 ? 0.7f : 0.0f;
      const AttentionOutput o = Unwrap(CausalAttention(q, k, v, scale));
      const AttentionGrads g = Unwrap(CausalAttentionBackward(r, q, k, v, o, scale));
      const double s = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(c.d));
      const std::vector<double> qv = Values(q), kv = Values(k), vv = Values(v), rv = Values(r);
      const std::vector<double> grads[3] = {Values(g.dq), Values(g.dk), Values(g.dv)};
      const int64_t head = c.t * c.d;
      // A perturbation of element i only changes head i / head: differentiate that head's loss.
      std::vector<double> got, fd;
      const size_t n = qv.size();
      const size_t stride = std::max<size_t>(1, n / 40);
      for (int which = 0; which < 3; ++which) {
        for (size_t i = (which * 7) % stride; i < n; i += stride) {
          const int64_t h0 = static_cast<int64_t>(i) / head * head;
          std::vector<double> hq(qv.begin() + h0, qv.begin() + h0 + head);
          std::vector<double> hk(kv.begin() + h0, kv.begin() + h0 + head);
          std::vector<double> hv(vv.begin() + h0, vv.begin() + h0 + head);
          std::vector<double>* target = which == 0 ? &hq : which == 1 ? &hk : &hv;
          auto loss = [&] {
            std::vector<double> out(head), lse(c.t);
            RefHead(hq.data(), hk.data(), hv.data(), c.t, c.d, s, out.data(), lse.data());
            double l = 0;
            for (int64_t x = 0; x < head; ++x) l += out[x] * rv[h0 + x];
            return l;
          };
          const double h = 1e-4;
          double& e = (*target)[i - h0];
          const double orig = e;
          e = orig + h;
          const double fp = loss();
          e = orig - h;
          const double fm = loss();
          e = orig;
          fd.push_back((fp - fm) / (2 * h));
          got.push_back(grads[which][i]);
        }
      }
      const testing::Tolerance tol = dt == DType::kFloat32 ? testing::Tolerance{1e-4, 1e-4} : testing::Tol(dt);
      testing::ExpectNear(got, fd, tol, What(dt, c) + " dq/dk/dv");
    }
  }
}

TEST(CpuAttentionTest, BackwardSingleTokenHasZeroQueryAndKeyGradients) {
  // T = 1: out = v, so dq = dk = 0 and dv = dout.
  const Tensor q = testing::Random({2, 2, 1, 5}, DType::kFloat32, 15);
  const Tensor dout = testing::Random({2, 2, 1, 5}, DType::kFloat32, 16);
  const AttentionOutput o = Unwrap(CausalAttention(q, q, q));
  const AttentionGrads g = Unwrap(CausalAttentionBackward(dout, q, q, q, o));
  // (dP - dout.out is 0 up to float rounding: sgemm and a dot product sum in different orders.)
  testing::ExpectNear(Values(g.dq), std::vector<double>(20, 0.0), {0, 1e-6}, "dq = 0");
  testing::ExpectNear(Values(g.dk), std::vector<double>(20, 0.0), {0, 1e-6}, "dk = 0");
  testing::ExpectNear(Values(g.dv), Values(dout), {1e-6, 1e-7}, "dv = dout");
}

}  // namespace
}  // namespace dtensor
