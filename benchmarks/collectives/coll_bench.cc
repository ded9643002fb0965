// coll_bench: dtensor's collectives in the nccl-tests format (see coll_bench_common.h for the
// conventions), on either CPU backend:
//   coll_bench --backend threads --ranks N [flags]            N threads of this process
//   dtrun --nproc-per-node N coll_bench --backend ucx [flags]  one process per rank
// Rank 0 prints one table per collective; exit status 1 if any element was wrong.
// benchmarks/collectives/compare.sh runs it beside Open MPI (mpi_coll_bench).
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "benchmarks/collectives/coll_bench_common.h"
#include "collectives/communicator.h"
#include "collectives/threads/threads_communicator.h"
#include "collectives/ucx/ucx_communicator.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::bench {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(120);

// A Backend over one rank's Communicator; buffers are contiguous 1-d float32 CPU tensors.
class CommBackend : public Backend {
 public:
  explicit CommBackend(Communicator& comm) : comm_(comm), scalar_(Make(1, DType::kInt64)) {}

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }

  void Allocate(int64_t in_count, int64_t out_count) override {
    in_ = Make(0, DType::kFloat32);  // free the old buffers first
    out_ = Make(0, DType::kFloat32);
    in_ = Make(in_count, DType::kFloat32);
    out_ = Make(out_count, DType::kFloat32);
  }
  float* in() override { return in_.data<float>(); }
  float* out() override { return out_.data<float>(); }

  void Run(Coll c) override {
    absl::Status s;
    switch (c) {
      case Coll::kAllReduce:
        s = comm_.AllReduce(in_, out_, CommReduceOp::kSum);
        break;
      case Coll::kAllGather:
        s = comm_.AllGather(in_, out_);
        break;
      case Coll::kReduceScatter:
        s = comm_.ReduceScatter(in_, out_, CommReduceOp::kSum);
        break;
      case Coll::kAllToAll:
        s = comm_.AllToAll(in_, out_);
        break;
      case Coll::kBroadcast:
        s = comm_.Broadcast(in_, 0);
        break;
    }
    Check(s, CollName(c));
  }
  void Barrier() override { Check(comm_.Barrier(), "barrier"); }
  int64_t AllMax(int64_t v) override { return Reduce(v, CommReduceOp::kMax); }
  int64_t AllSum(int64_t v) override { return Reduce(v, CommReduceOp::kSum); }

 private:
  Tensor Make(int64_t n, DType dtype) {
    absl::StatusOr<Tensor> t = Tensor::Empty({n}, dtype);
    Check(t.status(), "allocation");
    return *std::move(t);
  }
  int64_t Reduce(int64_t v, CommReduceOp op) {
    *scalar_.data<int64_t>() = v;
    Check(comm_.AllReduce(scalar_, scalar_, op), "all_reduce of int64");
    return *scalar_.data<int64_t>();
  }
  void Check(const absl::Status& s, const char* what) const {
    if (!s.ok()) Fatal(comm_.rank(), std::string(what) + ": " + s.ToString());
  }

  Communicator& comm_;
  Tensor scalar_;
  Tensor in_, out_;
};

int RunThreads(int ranks, const Options& options) {
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms = MakeThreadGroup(ranks, kTimeout);
  if (!comms.ok()) Fatal(0, comms.status().ToString());
  std::vector<int64_t> wrong(ranks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      CommBackend backend(*(*comms)[r]);
      wrong[r] = RunAll(backend, options, "coll_bench: backend threads");
    });
  }
  for (std::thread& t : threads) t.join();
  return wrong[0] == 0 ? 0 : 1;
}

int RunUcx(const Options& options) {
  absl::StatusOr<std::unique_ptr<Communicator>> comm = MakeUcxCommunicatorFromEnv(kTimeout);
  if (!comm.ok()) Fatal(-1, comm.status().ToString());
  int64_t wrong = 0;
  {
    CommBackend backend(**comm);
    wrong = RunAll(backend, options, "coll_bench: backend ucx");
    backend.Barrier();  // rank 0 holds the store: every rank is done before it goes
  }
  return wrong == 0 ? 0 : 1;
}

int Main(int argc, char** argv) {
  Options options;
  std::string backend;
  int ranks = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (ParseCommonFlag(argc, argv, &i, &options)) continue;
    if (flag == "--backend" && i + 1 < argc) {
      backend = argv[++i];
    } else if (flag == "--ranks" && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: coll_bench --backend threads --ranks N [flags]\n"
                   "       dtrun --nproc-per-node N coll_bench --backend ucx [flags]\n%s",
                   kCommonUsage);
      return 2;
    }
  }
  if (backend == "threads" && ranks >= 1) return RunThreads(ranks, options);
  if (backend == "ucx") return RunUcx(options);
  std::fprintf(stderr, "coll_bench: need --backend threads --ranks N (N >= 1) or --backend ucx\n");
  return 2;
}

}  // namespace
}  // namespace dtensor::bench

int main(int argc, char** argv) { return dtensor::bench::Main(argc, argv); }
