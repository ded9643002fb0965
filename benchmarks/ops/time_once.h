// TimeOnce: seconds per call of a function, for the ops benchmarks' own timing loops.
//
//   const double s = bench::TimeOnce([&] { Matmul(a, b); }, /*min_seconds=*/0.2);
//
// Calls f once to warm up (allocator cache, page faults, the thread pool), then until about
// min_seconds have passed and at least 3 times, and returns the mean time per call.
#ifndef DTENSOR_BENCHMARKS_OPS_TIME_ONCE_H_
#define DTENSOR_BENCHMARKS_OPS_TIME_ONCE_H_

#include <chrono>
#include <functional>

namespace dtensor::bench {

inline double TimeOnce(const std::function<void()>& f, double min_seconds) {
  using Clock = std::chrono::steady_clock;
  f();
  int iters = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  do {
    f();
    ++iters;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < min_seconds || iters < 3);
  return elapsed / iters;
}

}  // namespace dtensor::bench

#endif  // DTENSOR_BENCHMARKS_OPS_TIME_ONCE_H_
