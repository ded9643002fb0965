// dispatch_bench: the op dispatcher's overhead on tiny tensors (issue 5's target: a DTensor op
// adds < 1 us over the same local op; PyTorch's C++ fast path adds ~20 us: 24-26 us per
// DTensor op against 4.8 us for a plain tensor). Google Benchmark, every contender in one run:
//   local      dtensor::Add / Gelu / Matmul(x, w^T) on Tensors (dtensor/ops/ops.h)
//   fn_plain   fn::Add / fn::Unary(kGelu) / fn::Linear on plain-Tensor Values (no mesh)
//   fn_dt      the same on DTensors, Replicate on a 1-rank mesh (strategy cache hit; the
//              chosen strategy may redistribute the inputs first)
//   fn_dt_s0   the same with inputs already as the dispatcher's first strategy wants them
//              (x Shard(0), w Replicate): no redistribution, the dispatch path alone
//   var_grad   the Variable op on DTensor values with requires_grad (records a node)
//   var_nograd the same under NoGradGuard
//   var_plain  the Variable op on plain Tensors with requires_grad (autograd cost alone)
// for add (binary), gelu (unary) and linear, on float32 [1] and [4] (linear: x [1, n],
// w [n, n]). After the runs two tables give the median and the minimum CPU time per call
// over repetitions and added_us = fn_dt - local, from the numbers of this run. Then the
// cache-miss path: the first call of an op on a fresh mesh (empty strategy cache), timed once
// per mesh with steady_clock, median over meshes. Before timing, every path's result is
// checked against the local op (exit 1 on a mismatch).
//   dispatch_bench [--miss_samples=N] [Google Benchmark flags]
// On a busy machine: --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true
// --benchmark_report_aggregates_only=true (the table uses the medians).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/autograd/functional.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/autograd/variable.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/ops/ops.h"

namespace dtensor {
namespace {

[[noreturn]] void Fatal(const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "dispatch_bench: %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) Fatal(std::string(what) + ": " + v.status().ToString());
  return *std::move(v);
}

enum class Op { kAdd, kGelu, kLinear };
const char* OpName(Op op) { return op == Op::kAdd ? "add" : op == Op::kGelu ? "gelu" : "linear"; }
constexpr Op kOps[] = {Op::kAdd, Op::kGelu, Op::kLinear};
constexpr int64_t kSizes[] = {1, 4};
const char* const kPaths[] = {"local", "fn_plain", "fn_dt", "fn_dt_s0", "var_grad", "var_nograd", "var_plain"};

// The two operands of `op` at size n (gelu uses only a): add: [n] + [n]; gelu: [n];
// linear: x [1, n], w [n, n].
struct Operands {
  Tensor a, b;
};
Operands MakeOperands(Op op, int64_t n) {
  std::vector<float> va, vb;
  for (int64_t i = 0; i < n; ++i) va.push_back(0.5f + 0.25f * static_cast<float>(i));
  if (op == Op::kLinear) {
    for (int64_t i = 0; i < n * n; ++i) vb.push_back(-0.75f + 0.125f * static_cast<float>(i));
    return {Must(Tensor::FromVector<float>(va, {1, n}), "x"), Must(Tensor::FromVector<float>(vb, {n, n}), "w")};
  }
  for (int64_t i = 0; i < n; ++i) vb.push_back(1.25f - 0.5f * static_cast<float>(i));
  return {Must(Tensor::FromVector<float>(va, {n}), "a"), Must(Tensor::FromVector<float>(vb, {n}), "b")};
}

absl::StatusOr<Tensor> RunLocal(Op op, const Tensor& a, const Tensor& b) {
  switch (op) {
    case Op::kAdd:
      return Add(a, b);
    case Op::kGelu:
      return Gelu(a);
    case Op::kLinear:
      return Matmul(a, b, false, true);
  }
  return absl::InternalError("op");
}
absl::StatusOr<Value> RunFn(Op op, const Value& a, const Value& b) {
  switch (op) {
    case Op::kAdd:
      return fn::Add(a, b);
    case Op::kGelu:
      return fn::Unary(UnaryOp::kGelu, a);
    case Op::kLinear:
      return fn::Linear(a, b);
  }
  return absl::InternalError("op");
}
absl::StatusOr<Variable> RunVar(Op op, const Variable& a, const Variable& b) {
  switch (op) {
    case Op::kAdd:
      return Add(a, b);
    case Op::kGelu:
      return Gelu(a);
    case Op::kLinear:
      return Linear(a, b);
  }
  return absl::InternalError("op");
}

// The 1-rank world and mesh every DTensor lives on.
struct World {
  std::vector<std::unique_ptr<Communicator>> comms;
  DeviceMesh mesh;
};
World& TheWorld() {
  static World* w = [] {
    auto* world = new World;
    world->comms = Must(MakeThreadGroup(1), "MakeThreadGroup(1)");
    const int64_t shape[] = {1};
    world->mesh = Must(DeviceMesh::Create(*world->comms[0], shape), "DeviceMesh::Create");
    return world;
  }();
  return *w;
}

Value Replicated(const Tensor& t, const DeviceMesh& mesh) {
  return Value(Must(DTensor::FromLocal(t, mesh, Layout({Replicate()})), "FromLocal"));
}
// Operand `which` (0: a, 1: b) laid out as the first strategy of `op` wants it: Shard(0),
// except linear's weight (Replicate).
Value FirstStrategyLayout(Op op, int which, const Tensor& t, const DeviceMesh& mesh) {
  if (op == Op::kLinear && which == 1) return Replicated(t, mesh);
  return Value(Must(DTensor::FromLocal(t, mesh, Layout({Shard(0)})), "FromLocal"));
}

// ---- The benchmarks ----

void BmLocal(benchmark::State& state, Op op, int64_t n) {
  const Operands o = MakeOperands(op, n);
  for (auto _ : state) {
    absl::StatusOr<Tensor> r = RunLocal(op, o.a, o.b);
    if (!r.ok()) return state.SkipWithError(r.status().ToString().c_str());
    benchmark::DoNotOptimize(r);
  }
}

enum class Inputs { kPlain, kReplicate, kFirstStrategy };
void BmFn(benchmark::State& state, Op op, int64_t n, Inputs in) {
  const Operands o = MakeOperands(op, n);
  const DeviceMesh& mesh = TheWorld().mesh;
  const Value a = in == Inputs::kPlain       ? Value(o.a)
                  : in == Inputs::kReplicate ? Replicated(o.a, mesh)
                                             : FirstStrategyLayout(op, 0, o.a, mesh);
  const Value b = in == Inputs::kPlain       ? Value(o.b)
                  : in == Inputs::kReplicate ? Replicated(o.b, mesh)
                                             : FirstStrategyLayout(op, 1, o.b, mesh);
  for (auto _ : state) {
    absl::StatusOr<Value> r = RunFn(op, a, b);
    if (!r.ok()) return state.SkipWithError(r.status().ToString().c_str());
    benchmark::DoNotOptimize(r);
  }
}

void BmVar(benchmark::State& state, Op op, int64_t n, bool dist, bool grad) {
  const Operands o = MakeOperands(op, n);
  const Variable a = Variable::Leaf(dist ? Replicated(o.a, TheWorld().mesh) : Value(o.a), /*requires_grad=*/true, "a");
  const Variable b = Variable::Leaf(dist ? Replicated(o.b, TheWorld().mesh) : Value(o.b), /*requires_grad=*/true, "b");
  std::unique_ptr<NoGradGuard> no_grad;
  if (!grad) no_grad = std::make_unique<NoGradGuard>();
  for (auto _ : state) {
    absl::StatusOr<Variable> r = RunVar(op, a, b);
    if (!r.ok()) return state.SkipWithError(r.status().ToString().c_str());
    if (r->requires_grad() != grad) return state.SkipWithError("requires_grad of the result is wrong");
    benchmark::DoNotOptimize(r);
  }
}

std::string BenchName(Op op, int64_t n, const char* path) {
  return std::string(OpName(op)) + "/n:" + std::to_string(n) + "/" + path;
}

double MinOf(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

void RegisterAll() {
  std::vector<benchmark::internal::Benchmark*> all;
  for (Op op : kOps) {
    for (int64_t n : kSizes) {
      all.push_back(benchmark::RegisterBenchmark(BenchName(op, n, "local").c_str(), BmLocal, op, n));
      all.push_back(benchmark::RegisterBenchmark(BenchName(op, n, "fn_plain").c_str(), BmFn, op, n, Inputs::kPlain));
      all.push_back(benchmark::RegisterBenchmark(BenchName(op, n, "fn_dt").c_str(), BmFn, op, n, Inputs::kReplicate));
      all.push_back(
          benchmark::RegisterBenchmark(BenchName(op, n, "fn_dt_s0").c_str(), BmFn, op, n, Inputs::kFirstStrategy));
      all.push_back(benchmark::RegisterBenchmark(BenchName(op, n, "var_grad").c_str(), BmVar, op, n, true, true));
      all.push_back(benchmark::RegisterBenchmark(BenchName(op, n, "var_nograd").c_str(), BmVar, op, n, true, false));
      all.push_back(benchmark::RegisterBenchmark(BenchName(op, n, "var_plain").c_str(), BmVar, op, n, false, true));
    }
  }
  for (benchmark::internal::Benchmark* b : all) b->ComputeStatistics("min", MinOf);
}

// ---- Correctness of every path (against the local op) ----

void ExpectSame(const Tensor& got, const Tensor& want, const std::string& what) {
  const std::vector<double> g = Must(ToDoubleVector(got), "ToDoubleVector");
  const std::vector<double> w = Must(ToDoubleVector(want), "ToDoubleVector");
  if (got.shape() != want.shape() || g != w) Fatal(what + ": result differs from the local op");
}

void CheckAll() {
  const DeviceMesh& mesh = TheWorld().mesh;
  for (Op op : kOps) {
    for (int64_t n : kSizes) {
      const Operands o = MakeOperands(op, n);
      const Tensor want = Must(RunLocal(op, o.a, o.b), "local op");
      // An independent check of the local op itself on element 0.
      const double a0 = o.a.data<float>()[0], b0 = o.b.data<float>()[0];
      double ref = 0;
      if (op == Op::kAdd) ref = a0 + b0;
      if (op == Op::kGelu) ref = 0.5 * a0 * (1 + std::tanh(std::sqrt(2 / M_PI) * (a0 + 0.044715 * a0 * a0 * a0)));
      if (op == Op::kLinear) {
        for (int64_t k = 0; k < n; ++k) ref += static_cast<double>(o.a.data<float>()[k]) * o.b.data<float>()[k];
      }
      if (std::fabs(want.data<float>()[0] - ref) > 1e-5 * (1 + std::fabs(ref))) {
        Fatal(BenchName(op, n, "local") + ": " + std::to_string(want.data<float>()[0]) + " != " + std::to_string(ref));
      }
      const std::string name = BenchName(op, n, "");
      ExpectSame(Must(RunFn(op, o.a, o.b), "fn_plain").local(), want, name + "fn_plain");
      const Value da = Replicated(o.a, mesh), db = Replicated(o.b, mesh);
      for (int rep = 0; rep < 2; ++rep) {  // a cache miss, then a hit
        const Value r = Must(RunFn(op, da, db), "fn_dt");
        if (!r.is_dtensor()) Fatal(name + "fn_dt: not a DTensor");
        ExpectSame(r.local(), want, name + "fn_dt");
        if (rep == 0 && n == 1) {
          std::printf("%s on Replicate inputs -> %s\n", OpName(op), r.dtensor().layout().ToString().c_str());
        }
        const Value s =
            Must(RunFn(op, FirstStrategyLayout(op, 0, o.a, mesh), FirstStrategyLayout(op, 1, o.b, mesh)), "fn_dt_s0");
        ExpectSame(s.local(), want, name + "fn_dt_s0");
      }
      const Variable va = Variable::Leaf(da, true), vb = Variable::Leaf(db, true);
      const Variable y = Must(RunVar(op, va, vb), "var_grad");
      if (y.grad_fn() == nullptr) Fatal(name + "var_grad: no node recorded");
      ExpectSame(y.value().local(), want, name + "var_grad");
      NoGradGuard no_grad;
      const Variable z = Must(RunVar(op, va, vb), "var_nograd");
      if (z.grad_fn() != nullptr) Fatal(name + "var_nograd: a node was recorded");
      ExpectSame(z.value().local(), want, name + "var_nograd");
    }
  }
}

// ---- The table ----

// Keeps the CPU time per iteration (ns) of every run, by benchmark name (CPU time: other
// processes on a loaded machine inflate the real time of a single-threaded loop, not this),
// and the "median" and "min" aggregates of repeated runs.
class CollectingReporter : public benchmark::ConsoleReporter {
 public:
  explicit CollectingReporter(OutputOptions options) : ConsoleReporter(options) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      const double ns = r.GetAdjustedCPUTime() * (1e9 / benchmark::GetTimeUnitMultiplier(r.time_unit));
      if (r.run_type == Run::RT_Iteration) {
        times_[r.run_name.str()].push_back(ns);
      } else if (r.aggregate_name == "median" || r.aggregate_name == "min") {
        aggregates_[r.aggregate_name][r.run_name.str()] = ns;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  // The "median" or "min" over repetitions (of the runs themselves without aggregates); NaN
  // when the benchmark did not run.
  double Ns(const std::string& stat, const std::string& name) const {
    if (auto a = aggregates_.find(stat); a != aggregates_.end()) {
      if (auto m = a->second.find(name); m != a->second.end()) return m->second;
    }
    auto it = times_.find(name);
    if (it == times_.end()) return NAN;
    std::vector<double> v = it->second;
    std::sort(v.begin(), v.end());
    return stat == "min" ? v.front() : v[v.size() / 2];
  }

 private:
  std::map<std::string, std::vector<double>> times_;
  std::map<std::string, std::map<std::string, double>> aggregates_;  // [stat][name]
};

void PrintTable(const CollectingReporter& rep, const std::string& stat) {
  std::printf("\nus of CPU per call (%s over repetitions); added_us = fn_dt - local, +grad = var_grad - fn_dt\n",
              stat.c_str());
  std::printf("%-8s %3s", "op", "n");
  for (const char* p : kPaths) std::printf(" %10s", p);
  std::printf(" %9s %9s\n", "added_us", "+grad");
  for (Op op : kOps) {
    for (int64_t n : kSizes) {
      std::printf("%-8s %3lld", OpName(op), static_cast<long long>(n));
      for (const char* p : kPaths) std::printf(" %10.3f", rep.Ns(stat, BenchName(op, n, p)) / 1e3);
      const double local = rep.Ns(stat, BenchName(op, n, "local")), dt = rep.Ns(stat, BenchName(op, n, "fn_dt"));
      std::printf(" %9.3f %9.3f\n", (dt - local) / 1e3, (rep.Ns(stat, BenchName(op, n, "var_grad")) - dt) / 1e3);
    }
  }
}

// The first call of each op on `samples` fresh meshes (each with an empty strategy cache),
// then the second call (a hit); medians in us.
void MeasureMiss(int samples) {
  if (samples <= 0) return;
  World& world = TheWorld();
  std::printf("\ncache miss (first call on a fresh mesh), median of %d meshes, n = 1\n", samples);
  std::printf("%-8s %12s %12s\n", "op", "miss_us", "2nd_call_us");
  for (Op op : kOps) {
    const Operands o = MakeOperands(op, 1);
    std::vector<double> first, second;
    for (int s = 0; s < samples; ++s) {
      const int64_t shape[] = {1};
      const DeviceMesh mesh = Must(DeviceMesh::Create(*world.comms[0], shape), "DeviceMesh::Create");
      const Value a = Replicated(o.a, mesh), b = Replicated(o.b, mesh);
      for (std::vector<double>* out : {&first, &second}) {
        const auto start = std::chrono::steady_clock::now();
        absl::StatusOr<Value> r = RunFn(op, a, b);
        const auto end = std::chrono::steady_clock::now();
        benchmark::DoNotOptimize(r);
        if (!r.ok()) Fatal(r.status().ToString());
        out->push_back(std::chrono::duration<double, std::micro>(end - start).count());
      }
      const DispatchStats st = DispatchStatsOf(mesh);
      if (st.misses != 1 || st.hits != 1) Fatal(std::string(OpName(op)) + ": expected one miss then one hit");
    }
    std::sort(first.begin(), first.end());
    std::sort(second.begin(), second.end());
    std::printf("%-8s %12.3f %12.3f\n", OpName(op), first[first.size() / 2], second[second.size() / 2]);
  }
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  int miss_samples = 200;
  // Our own flags first (Google Benchmark refuses flags it does not know).
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--miss_samples=", 15) == 0) {
      miss_samples = std::atoi(argv[i] + 15);
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  dtensor::CheckAll();
  dtensor::RegisterAll();
  dtensor::CollectingReporter reporter(isatty(fileno(stdout)) ? benchmark::ConsoleReporter::OO_Defaults
                                                              : benchmark::ConsoleReporter::OO_None);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  dtensor::PrintTable(reporter, "median");
  dtensor::PrintTable(reporter, "min");
  dtensor::MeasureMiss(miss_samples);
  benchmark::Shutdown();
  return 0;
}
