// The online softmax state of the CUDA softmax and cross-entropy kernels (device_common.cuh's
// WarpMaxSum / BlockMaxSum merge it across a row's threads): a running max m and the sum s of
// e^(x - m), rescaled when the max grows, so a row is read once. Host and device (no CUDA
// header): tests/ops/max_sum_test.cc checks it on the CPU against the CPU kernels.
//
// Special values give what the CPU kernels (cpu/softmax.cc, cpu/cross_entropy.cc) give, in any
// order of adds and merges:
//   - a NaN element makes the state NaN (m and s), whatever it is merged with: LogSumExp, and
//     every softmax output of the row (e^(x - m) / s), is NaN;
//   - a +inf element makes m = +inf and s = NaN (the element's own term is e^(inf - inf), as in
//     the CPU's sum): LogSumExp is +inf, the softmax outputs are NaN;
//   - -inf elements add nothing; a row of them only keeps {-inf, 0}: LogSumExp is -inf.
#ifndef DTENSOR_KERNELS_CUDA_MAX_SUM_H_
#define DTENSOR_KERNELS_CUDA_MAX_SUM_H_

#include <cmath>
#include <limits>

#include "dtensor/kernels/host_device.h"

namespace dtensor::internal::gpu {

struct MaxSum {
  float m;  // the largest element added; NaN once a NaN was
  float s;  // sum of e^(x - m) over the elements added
};

// The state of no elements.
DT_HOST_DEVICE MaxSum EmptyMaxSum() { return MaxSum{-INFINITY, 0.0f}; }

DT_HOST_DEVICE MaxSum MaxSumAdd(MaxSum a, float x) {
  if (x > a.m) {
    // The new max's own term is e^(x - x): 1, or NaN for x = +inf.
    a.s = a.s * expf(a.m - x) +
          (x == INFINITY ? std::numeric_limits<float>::quiet_NaN() : 1.0f);  // a.m = -inf at first: e^-inf = 0
    a.m = x;
  } else if (x != x) {
    a = MaxSum{x, x};
  } else if (x != -INFINITY) {
    a.s += expf(x - a.m);  // NaN where a.m is (or x = a.m = +inf)
  }
  return a;
}

DT_HOST_DEVICE MaxSum MaxSumMerge(MaxSum a, MaxSum b) {
  if (a.m != a.m) return a;
  if (b.m != b.m) return b;
  const float m = a.m > b.m ? a.m : b.m;
  if (m == -INFINITY) return MaxSum{m, a.s + b.s};
  const float sa = a.m == -INFINITY ? 0.0f : a.s * expf(a.m - m);
  const float sb = b.m == -INFINITY ? 0.0f : b.s * expf(b.m - m);
  return MaxSum{m, sa + sb};
}

// logsumexp of the elements added: an infinite max is the result itself (all -inf: -inf; a
// +inf element: +inf); NaN stays NaN.
DT_HOST_DEVICE float LogSumExp(MaxSum v) { return v.m == INFINITY || v.m == -INFINITY ? v.m : v.m + logf(v.s); }
// log(s), so that logsumexp = m + LogSum: 0 for an infinite max. Log-probabilities are formed as
// (x - m) - LogSum, as torch's: x - LogSumExp would round m + log(s) at the magnitude of m.
DT_HOST_DEVICE float LogSum(MaxSum v) { return v.m == INFINITY || v.m == -INFINITY ? 0.0f : logf(v.s); }
// Cross-entropy of a row whose target logit is xt: logsumexp - xt.
DT_HOST_DEVICE float RowLoss(MaxSum v, float xt) { return LogSum(v) - (xt - v.m); }

}  // namespace dtensor::internal::gpu

#endif  // DTENSOR_KERNELS_CUDA_MAX_SUM_H_
