// The measuring loop shared by coll_bench (dtensor's threads / ucx backends) and
// mpi_coll_bench (Open MPI), so both time, check and print exactly alike. Header-only and free
// of dtensor and MPI: each program implements Backend for its transport and calls RunAll().
//
// Conventions are nccl-tests' (doc/PERFORMANCE.md), float32, out-of-place (broadcast is in
// place, root 0):
//   size   bytes of the larger buffer: all_reduce / broadcast the buffer, all_gather the
//          output, reduce_scatter the input, all_to_all either; count = size / 4 elements,
//          rounded down to a multiple of the rank count P where it is split in P blocks.
//   algbw  size / time;  busbw = algbw * 2(P-1)/P for all_reduce, (P-1)/P for all_gather,
//          reduce_scatter and all_to_all, 1 for broadcast.
//   time   per-call time of a trial (a barrier, then `iters` back-to-back calls) as the
//          slowest rank saw it (all-reduced with max); the median over trials is printed.
//   #wrong elements of every rank's output differing from the value computed here from the
//          ranks' inputs (summed over ranks), after one more call on freshly filled buffers.
#ifndef DTENSOR_BENCHMARKS_COLLECTIVES_COLL_BENCH_COMMON_H_
#define DTENSOR_BENCHMARKS_COLLECTIVES_COLL_BENCH_COMMON_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace dtensor::bench {

enum class Coll { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kBroadcast };

inline const char* CollName(Coll c) {
  switch (c) {
    case Coll::kAllReduce:
      return "all_reduce";
    case Coll::kAllGather:
      return "all_gather";
    case Coll::kReduceScatter:
      return "reduce_scatter";
    case Coll::kAllToAll:
      return "all_to_all";
    case Coll::kBroadcast:
      return "broadcast";
  }
  return "?";
}

inline const std::vector<Coll>& AllColls() {
  static const std::vector<Coll> kAll = {Coll::kAllReduce, Coll::kAllGather, Coll::kReduceScatter, Coll::kAllToAll,
                                         Coll::kBroadcast};
  return kAll;
}

// nccl-tests' bus bandwidth factor for P ranks.
inline double BusFactor(Coll c, int p) {
  switch (c) {
    case Coll::kAllReduce:
      return 2.0 * (p - 1) / p;
    case Coll::kBroadcast:
      return 1.0;
    default:
      return static_cast<double>(p - 1) / p;
  }
}

// Element counts of one call for `bytes` (the larger buffer, see above). Broadcast works in
// place on the input buffer (out == 0).
struct Counts {
  int64_t total;  // the printed count: elements of the larger buffer
  int64_t in;
  int64_t out;
};

inline Counts CountsFor(Coll c, int64_t bytes, int p) {
  const int64_t n = bytes / 4;
  const int64_t blocked = n / p * p;
  switch (c) {
    case Coll::kAllReduce:
      return {n, n, n};
    case Coll::kAllGather:
      return {blocked, blocked / p, blocked};
    case Coll::kReduceScatter:
      return {blocked, blocked, blocked / p};
    case Coll::kAllToAll:
      return {blocked, blocked, blocked};
    case Coll::kBroadcast:
      return {n, n, 0};
  }
  return {0, 0, 0};
}

// Rank r's input element i: a small integer, so sums over up to 64 ranks are exact in float32
// whatever the reduction order; it differs between ranks and between the blocks of one rank.
inline float InputValue(int r, int64_t i) { return static_cast<float>((i * 7 + (i >> 10) + r * 13) % 31 - 15); }

// What a transport must provide. Every call is collective except rank() / size() / buffers.
// Implementations report errors themselves and end the process (Fatal()); a benchmark has
// nothing to recover.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // (Re)allocates the buffers of the next collective: in [in_count], out [out_count].
  virtual void Allocate(int64_t in_count, int64_t out_count) = 0;
  // Host views of the buffers, where inputs are filled and results checked.
  virtual float* in() = 0;
  virtual float* out() = 0;
  // Where the collective runs on other memory (a GPU): Upload() copies both host views there
  // after they were filled, Download() brings them back before they are checked.
  virtual void Upload() {}
  virtual void Download() {}
  // One call of `c` on the allocated buffers (sum for reductions, root 0 for broadcast).
  virtual void Run(Coll c) = 0;
  virtual void Barrier() = 0;
  virtual int64_t AllMax(int64_t v) = 0;
  virtual int64_t AllSum(int64_t v) = 0;
};

[[noreturn]] inline void Fatal(int rank, const std::string& what) {
  std::fprintf(stderr, "coll_bench: rank %d: %s\n", rank, what.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(1);
}

struct Options {
  int64_t min_bytes = 4096;
  int64_t max_bytes = int64_t{64} << 20;
  int64_t step = 4;        // size multiplier
  int trials = 7;          // median over this many trials
  double trial_ms = 20.0;  // calls per trial chosen so that a trial lasts about this long
  int warmup = 2;          // untimed calls before the trials
  std::vector<Coll> colls = AllColls();
};

inline const char* kCommonUsage =
    "  --quick                   4 KiB, 128 KiB, 4 MiB; 3 trials of ~5 ms\n"
    "  --min-bytes B --max-bytes B --step F   sizes (default 4096 .. 67108864, x4)\n"
    "  --trials N --trial-ms T --warmup W     (default 7, 20, 2)\n"
    "  --ops a,b,...             of all_reduce,all_gather,reduce_scatter,all_to_all,broadcast\n";

// Consumes the common flag at argv[*i] (and its value); false if it is not one of them.
// Exits with status 2 on a bad value.
inline bool ParseCommonFlag(int argc, char** argv, int* i, Options* o) {
  const std::string flag = argv[*i];
  auto value = [&]() -> std::string {
    if (*i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", flag.c_str());
      std::exit(2);
    }
    return argv[++*i];
  };
  auto number = [&]() -> double {
    const std::string v = value();
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(d > 0)) {
      std::fprintf(stderr, "%s: bad value '%s'\n", flag.c_str(), v.c_str());
      std::exit(2);
    }
    return d;
  };
  if (flag == "--quick") {
    o->min_bytes = 4096;
    o->max_bytes = int64_t{4} << 20;
    o->step = 32;
    o->trials = 3;
    o->trial_ms = 5;
    o->warmup = 1;
  } else if (flag == "--min-bytes") {
    o->min_bytes = static_cast<int64_t>(number());
  } else if (flag == "--max-bytes") {
    o->max_bytes = static_cast<int64_t>(number());
  } else if (flag == "--step") {
    o->step = std::max<int64_t>(2, static_cast<int64_t>(number()));
  } else if (flag == "--trials") {
    o->trials = static_cast<int>(number());
  } else if (flag == "--trial-ms") {
    o->trial_ms = number();
  } else if (flag == "--warmup") {
    o->warmup = static_cast<int>(number());
  } else if (flag == "--ops") {
    o->colls.clear();
    std::string list = value() + ",";
    for (size_t start = 0, comma; (comma = list.find(',', start)) != std::string::npos; start = comma + 1) {
      const std::string name = list.substr(start, comma - start);
      bool found = false;
      for (Coll c : AllColls()) {
        if (name == CollName(c)) {
          o->colls.push_back(c);
          found = true;
        }
      }
      if (!found) {
        std::fprintf(stderr, "--ops: unknown collective '%s'\n", name.c_str());
        std::exit(2);
      }
    }
  } else {
    return false;
  }
  return true;
}

namespace internal {

inline void FillInputs(Coll c, Backend& b, const Counts& n) {
  float* in = b.in();
  for (int64_t i = 0; i < n.in; ++i) in[i] = InputValue(b.rank(), i);
  if (c != Coll::kBroadcast) std::fill(b.out(), b.out() + n.out, std::numeric_limits<float>::quiet_NaN());
}

// Elements of this rank's result that differ from the expected value.
inline int64_t CountWrong(Coll c, Backend& b, const Counts& n) {
  const int p = b.size();
  const int r = b.rank();
  const float* out = c == Coll::kBroadcast ? b.in() : b.out();
  const int64_t block = n.total / p;
  auto sum_over_ranks = [p](int64_t i) {
    float s = 0;
    for (int q = 0; q < p; ++q) s += InputValue(q, i);
    return s;
  };
  int64_t wrong = 0;
  for (int64_t i = 0; i < (c == Coll::kBroadcast ? n.in : n.out); ++i) {
    float want = 0;
    switch (c) {
      case Coll::kAllReduce:
        want = sum_over_ranks(i);
        break;
      case Coll::kAllGather:  // block q comes from rank q
        want = InputValue(static_cast<int>(i / block), i % block);
        break;
      case Coll::kReduceScatter:  // block r of every rank, summed
        want = sum_over_ranks(r * block + i);
        break;
      case Coll::kAllToAll:  // block q is rank q's block r
        want = InputValue(static_cast<int>(i / block), r * block + i % block);
        break;
      case Coll::kBroadcast:
        want = InputValue(0, i);
        break;
    }
    wrong += out[i] != want;  // NaN (never written) counts as wrong
  }
  return wrong;
}

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Per-call nanoseconds of `iters` calls after a barrier, as the slowest rank saw it.
inline int64_t TimedCalls(Coll c, Backend& b, int64_t iters) {
  b.Barrier();
  const int64_t t0 = NowNs();
  for (int64_t i = 0; i < iters; ++i) b.Run(c);
  return b.AllMax((NowNs() - t0) / iters);
}

}  // namespace internal

// Runs every collective of `o` over every size on `b` (all ranks call it alike); rank 0
// prints the tables. Returns the number of wrong elements over everything.
inline int64_t RunAll(Backend& b, const Options& o, const std::string& title) {
  const int p = b.size();
  const bool print = b.rank() == 0;
  if (print) {
    std::printf("# %s, %d ranks, float32, out-of-place (broadcast in place, root 0)\n", title.c_str(), p);
    std::printf("# time: median over %d trials of the slowest rank's per-call time (trials of ~%.0f ms)\n", o.trials,
                o.trial_ms);
  }
  int64_t all_wrong = 0;
  for (Coll c : o.colls) {
    if (print) {
      std::printf("#\n# collective %s\n", CollName(c));
      std::printf("# %10s  %12s  %8s  %6s  %6s  %9s  %7s  %7s  %6s\n", "size", "count", "type", "redop", "root", "time",
                  "algbw", "busbw", "#wrong");
      std::printf("# %10s  %12s  %8s  %6s  %6s  %9s  %7s  %7s  %6s\n", "(B)", "(elements)", "", "", "", "(us)",
                  "(GB/s)", "(GB/s)", "");
    }
    double bus_sum = 0;
    int rows = 0;
    for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.step) {
      const Counts n = CountsFor(c, bytes, p);
      if (n.total == 0) continue;
      b.Allocate(n.in, n.out);
      internal::FillInputs(c, b, n);
      b.Upload();
      // Warm-up, then a probe of ~1/10 trial sizes the trials (every rank gets the same max).
      for (int i = 0; i < o.warmup; ++i) b.Run(c);
      const double trial_ns = o.trial_ms * 1e6;
      int64_t call_ns = std::max<int64_t>(1, internal::TimedCalls(c, b, 1));
      const int64_t probe = std::clamp<int64_t>(static_cast<int64_t>(trial_ns / 10 / call_ns), 1, 1000);
      if (probe > 1) call_ns = std::max<int64_t>(1, internal::TimedCalls(c, b, probe));
      const int64_t iters = std::clamp<int64_t>(static_cast<int64_t>(trial_ns / call_ns), 1, 100000);
      std::vector<int64_t> trials;
      for (int t = 0; t < o.trials; ++t) trials.push_back(internal::TimedCalls(c, b, iters));
      std::sort(trials.begin(), trials.end());
      const double us = trials[trials.size() / 2] / 1e3;
      // Check one more call on freshly filled buffers.
      internal::FillInputs(c, b, n);
      b.Upload();
      b.Run(c);
      b.Download();
      const int64_t wrong = b.AllSum(internal::CountWrong(c, b, n));
      all_wrong += wrong;
      const int64_t size = n.total * 4;
      const double algbw = static_cast<double>(size) / us / 1e3;
      const double busbw = algbw * BusFactor(c, p);
      bus_sum += busbw;
      ++rows;
      if (print) {
        const bool reduces = c == Coll::kAllReduce || c == Coll::kReduceScatter;
        std::printf("  %10lld  %12lld  %8s  %6s  %6d  %9.2f  %7.3f  %7.3f  %6lld\n", static_cast<long long>(size),
                    static_cast<long long>(n.total), "float", reduces ? "sum" : "none", c == Coll::kBroadcast ? 0 : -1,
                    us, algbw, busbw, static_cast<long long>(wrong));
        std::fflush(stdout);
      }
    }
    b.Allocate(0, 0);
    if (print && rows > 0) std::printf("# Avg bus bandwidth    : %.3f\n", bus_sum / rows);
  }
  if (print) {
    std::printf("#\n# Out of bounds values : %lld %s\n", static_cast<long long>(all_wrong),
                all_wrong == 0 ? "OK" : "FAILED");
    std::fflush(stdout);
  }
  return all_wrong;
}

}  // namespace dtensor::bench

#endif  // DTENSOR_BENCHMARKS_COLLECTIVES_COLL_BENCH_COMMON_H_
