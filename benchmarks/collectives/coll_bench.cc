// coll_bench: dtensor's collectives in the nccl-tests format (see coll_bench_common.h for the
// conventions), on any backend:
//   coll_bench --backend threads --ranks N [flags]             N threads of this process
//   dtrun --nproc-per-node N coll_bench --backend ucx [flags]   one process per rank
//   dtrun --nproc-per-node N coll_bench --backend nccl [--gpu G] [flags]
//                                                              one process per GPU, buffers in its
//                                                              memory: cuda:G, else cuda:LOCAL_RANK
//                                                              (cuda:0 if CUDA_VISIBLE_DEVICES
//                                                              leaves one GPU, as gpt_train does)
// Rank 0 prints one table per collective; exit status 1 if any element was wrong.
// benchmarks/collectives/compare.sh runs it beside Open MPI (mpi_coll_bench).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "benchmarks/collectives/coll_bench_common.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/collectives/nccl/local_gpu.h"
#include "dtensor/collectives/nccl/nccl_communicator.h"
#include "dtensor/collectives/store/rendezvous.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/collectives/ucx/ucx_communicator.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/device.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::bench {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(120);

// A Backend over one rank's Communicator; buffers are contiguous 1-d float32 tensors on the
// communicator's device. On a GPU the host views are separate CPU tensors, copied over by
// Upload() / Download() outside the timed calls.
class CommBackend : public Backend {
 public:
  explicit CommBackend(Communicator& comm)
      : comm_(comm), device_(comm.device()), scalar_(Make(1, DType::kInt64, Device::Cpu())) {
    if (!device_.is_cpu()) scalar_dev_ = Make(1, DType::kInt64, device_);
  }

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }

  void Allocate(int64_t in_count, int64_t out_count) override {
    in_ = out_ = host_in_ = host_out_ = Tensor();  // free the old buffers first
    in_ = Make(in_count, DType::kFloat32, device_);
    out_ = Make(out_count, DType::kFloat32, device_);
    host_in_ = device_.is_cpu() ? in_ : Make(in_count, DType::kFloat32, Device::Cpu());
    host_out_ = device_.is_cpu() ? out_ : Make(out_count, DType::kFloat32, Device::Cpu());
  }
  float* in() override { return host_in_.data<float>(); }
  float* out() override { return host_out_.data<float>(); }
  void Upload() override { Move(in_, host_in_, out_, host_out_); }
  void Download() override { Move(host_in_, in_, host_out_, out_); }

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
  Tensor Make(int64_t n, DType dtype, Device device) {
    absl::StatusOr<Tensor> t = Tensor::Empty({n}, dtype, device);
    Check(t.status(), "allocation");
    return *std::move(t);
  }
  // dst_a = src_a, dst_b = src_b across devices, finished when it returns (nothing where the
  // host views are the buffers themselves).
  void Move(const Tensor& dst_a, const Tensor& src_a, const Tensor& dst_b, const Tensor& src_b) {
    if (device_.is_cpu()) return;
    Check(Copy_(dst_a, src_a), "copy between host and device");
    Check(Copy_(dst_b, src_b), "copy between host and device");
    Check(Synchronize(device_), "synchronize");
  }
  int64_t Reduce(int64_t v, CommReduceOp op) {
    *scalar_.data<int64_t>() = v;
    if (device_.is_cpu()) {
      Check(comm_.AllReduce(scalar_, scalar_, op), "all_reduce of int64");
    } else {
      Check(Copy_(scalar_dev_, scalar_), "copy to device");
      Check(comm_.AllReduce(scalar_dev_, scalar_dev_, op), "all_reduce of int64");
      Check(Copy_(scalar_, scalar_dev_), "copy to host");
      Check(Synchronize(device_), "synchronize");
    }
    return *scalar_.data<int64_t>();
  }
  void Check(const absl::Status& s, const char* what) const {
    if (!s.ok()) Fatal(comm_.rank(), std::string(what) + ": " + s.ToString());
  }

  Communicator& comm_;
  Device device_;
  Tensor scalar_, scalar_dev_;
  Tensor in_, out_;            // what the collectives run on
  Tensor host_in_, host_out_;  // the host views (in_ / out_ themselves on the CPU)
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

// One process per rank on cuda:`gpu` (-1: see the top), joined through the launcher's store
// (rank 0 holds it, so every rank ends with a barrier before it goes).
int RunNccl(const Options& options, int gpu) {
  absl::StatusOr<LaunchInfo> info = LaunchInfoFromEnv();
  if (!info.ok()) Fatal(-1, info.status().ToString());
  if (gpu < 0) {
    absl::StatusOr<int> local = LocalGpu(info->local_rank, info->local_world_size, CudaDeviceCount(),
                                         std::getenv("CUDA_VISIBLE_DEVICES") != nullptr);
    if (!local.ok()) Fatal(info->rank, absl::StrCat(local.status().message(), "; or pass --gpu G"));
    gpu = *local;
  }
  absl::StatusOr<std::unique_ptr<StoreClient>> store = ConnectStore(*info, kTimeout);
  if (!store.ok()) Fatal(info->rank, store.status().ToString());
  absl::StatusOr<std::unique_ptr<Communicator>> comm = MakeNcclCommunicator(*info, **store, gpu, kTimeout);
  if (!comm.ok()) Fatal(info->rank, comm.status().ToString());
  int64_t wrong = 0;
  {
    CommBackend backend(**comm);
    wrong = RunAll(backend, options, "coll_bench: backend nccl, cuda:" + std::to_string(gpu) + " per rank");
    backend.Barrier();
  }
  return wrong == 0 ? 0 : 1;
}

int Main(int argc, char** argv) {
  Options options;
  std::string backend;
  int ranks = 0;
  int gpu = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (ParseCommonFlag(argc, argv, &i, &options)) continue;
    if (flag == "--backend" && i + 1 < argc) {
      backend = argv[++i];
    } else if (flag == "--ranks" && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
    } else if (flag == "--gpu" && i + 1 < argc) {
      gpu = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: coll_bench --backend threads --ranks N [flags]\n"
                   "       dtrun --nproc-per-node N coll_bench --backend ucx [flags]\n"
                   "       dtrun --nproc-per-node N coll_bench --backend nccl [--gpu G] [flags]\n%s",
                   kCommonUsage);
      return 2;
    }
  }
  if (backend == "threads" && ranks >= 1) return RunThreads(ranks, options);
  if (backend == "ucx") return RunUcx(options);
  if (backend == "nccl") return RunNccl(options, gpu);
  std::fprintf(stderr, "coll_bench: need --backend threads --ranks N (N >= 1), ucx or nccl\n");
  return 2;
}

}  // namespace
}  // namespace dtensor::bench

int main(int argc, char** argv) { return dtensor::bench::Main(argc, argv); }
