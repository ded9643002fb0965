// fsdp_bench: GPT training steps under FSDP with prefetch off and on, alternating step by step
// in one run (so the host's drift falls on both alike), and how much of the communication
// compute hides.
//
//   dtrun --nproc-per-node 2 build/benchmarks/fsdp_bench            # 2 UCX processes
//   build/benchmarks/fsdp_bench --ranks 2                           # 2 thread ranks
//   build/benchmarks/fsdp_bench --n-layer 6 --n-embd 384 --steps 20 # another model
//
// Per configuration rank 0 prints the median step time and the median exposed communication:
// the time its thread waited for FSDP's all_gathers and reduce_scatters (FsdpGroup::stats).
// With prefetch off every collective is awaited right after it is issued, so its exposed time
// is the collectives' whole time; with prefetch on the next group's all_gather runs while this
// group computes (the ucx backend runs *Async collectives on its comm thread), and the
// reduce_scatters are awaited one group later. overlap = 1 - exposed(on) / exposed(off): the
// share of communication time that compute hid. (Thread ranks run *Async collectives at once,
// so there prefetch only reorders them.)
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/store/cpus.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/collectives/ucx/ucx_communicator.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/optim.h"
#include "dtensor/nn/parallel/fully_shard.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

struct Flags {
  int64_t n_layer = 4, n_head = 4, n_embd = 256, vocab = 256, seq = 64, batch = 8;
  int steps = 10, warmup = 2, ranks = 2;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

absl::Status RunRank(Communicator& world, const Flags& f) {
  DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, {world.size()}, {"dp_shard"}));
  nn::GPTConfig cfg{
      .vocab_size = f.vocab, .block_size = f.seq, .n_layer = f.n_layer, .n_head = f.n_head, .n_embd = f.n_embd};
  DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> model, nn::GPT::Create(cfg));
  DT_RETURN_IF_ERROR(model->InitWeights(1));
  std::vector<nn::FsdpGroup*> groups;
  for (int64_t i = 0; i < f.n_layer; ++i) {
    DT_ASSIGN_OR_RETURN(nn::FsdpGroup * g,
                        nn::FullyShard(*model->block(i), mesh, {.reshard_after_forward = i + 1 < f.n_layer}));
    groups.push_back(g);
  }
  DT_ASSIGN_OR_RETURN(nn::FsdpGroup * root, nn::FullyShard(*model, mesh));
  groups.push_back(root);
  nn::AdamW opt(model->Parameters(), {.lr = 1e-4});
  std::vector<int32_t> ids(static_cast<size_t>(f.batch * f.seq));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 31 + 7) % static_cast<size_t>(f.vocab));
  DT_ASSIGN_OR_RETURN(Tensor batch, Tensor::FromVector<int32_t>(ids, {f.batch, f.seq}));
  DT_ASSIGN_OR_RETURN(DTensor x, DTensor::Distribute(batch, mesh, {Shard(0)}, {.src_rank = std::nullopt}));

  std::vector<double> step_ms[2], wait_ms[2], gather_ms[2], reduce_ms[2];
  int64_t gathers[2] = {0, 0}, reduces[2] = {0, 0};
  for (int i = 0; i < 2 * (f.warmup + f.steps); ++i) {
    const int on = i % 2;  // off, on, off, on, ...
    for (nn::FsdpGroup* g : groups) {
      g->set_prefetch(on != 0);
      g->ResetStats();
    }
    DT_RETURN_IF_ERROR(world.Barrier());
    const auto t0 = std::chrono::steady_clock::now();
    DT_ASSIGN_OR_RETURN(nn::GPT::Output out, model->Forward(Variable::Constant(x), Variable::Constant(x)));
    DT_RETURN_IF_ERROR(Backward(out.loss));
    DT_RETURN_IF_ERROR(opt.Step());
    opt.ZeroGrad();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i < 2 * f.warmup) continue;
    double gather = 0, reduce = 0;
    gathers[on] = reduces[on] = 0;
    for (nn::FsdpGroup* g : groups) {
      gather += 1e3 * g->stats().gather_wait_s;
      reduce += 1e3 * g->stats().reduce_wait_s;
      gathers[on] += g->stats().gathers;
      reduces[on] += g->stats().reduces;
    }
    step_ms[on].push_back(ms);
    wait_ms[on].push_back(gather + reduce);
    gather_ms[on].push_back(gather);
    reduce_ms[on].push_back(reduce);
  }
  if (world.rank() == 0) {
    std::printf(
        "# fsdp_bench: %d ranks (%s), GPT %lld layers, C=%lld, V=%lld, B=%lld, T=%lld, %lld parameters; "
        "%d steps per configuration, alternating\n",
        world.size(), world.backend(), static_cast<long long>(f.n_layer), static_cast<long long>(f.n_embd),
        static_cast<long long>(f.vocab), static_cast<long long>(f.batch), static_cast<long long>(f.seq),
        static_cast<long long>(model->NumParameters()), f.steps);
    std::printf("%-9s %10s %18s %13s %13s %12s %13s\n", "prefetch", "step (ms)", "exposed comm (ms)", "in gathers",
                "in reduces", "all_gathers", "reduce_scat.");
    for (int on : {0, 1}) {
      std::printf("%-9s %10.2f %18.2f %13.2f %13.2f %12lld %13lld\n", on ? "on" : "off", Median(step_ms[on]),
                  Median(wait_ms[on]), Median(gather_ms[on]), Median(reduce_ms[on]),
                  static_cast<long long>(gathers[on]), static_cast<long long>(reduces[on]));
    }
    const double off = Median(wait_ms[0]), on = Median(wait_ms[1]);
    std::printf("overlap: %.0f%% of the communication hidden (exposed %.2f -> %.2f ms); step %.2f -> %.2f ms\n",
                off > 0 ? 100.0 * (1.0 - on / off) : 0.0, off, on, Median(step_ms[0]), Median(step_ms[1]));
  }
  return world.Barrier();
}

bool Parse(int argc, char** argv, Flags* f) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string n = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (n == "--n-layer")
      f->n_layer = v;
    else if (n == "--n-head")
      f->n_head = v;
    else if (n == "--n-embd")
      f->n_embd = v;
    else if (n == "--vocab")
      f->vocab = v;
    else if (n == "--seq")
      f->seq = v;
    else if (n == "--batch")
      f->batch = v;
    else if (n == "--steps")
      f->steps = static_cast<int>(v);
    else if (n == "--warmup")
      f->warmup = static_cast<int>(v);
    else if (n == "--ranks")
      f->ranks = static_cast<int>(v);
    else
      return false;
  }
  return argc % 2 == 1 && f->steps > 0 && f->ranks > 0;
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  using namespace dtensor;
  if (absl::Status s = ReexecWithFasterBlasCore(argv); !s.ok())
    std::fprintf(stderr, "fsdp_bench: %s\n", s.ToString().c_str());
  Flags f;
  if (!Parse(argc, argv, &f)) {
    std::fprintf(stderr,
                 "usage: fsdp_bench [--ranks 2] [--n-layer 4 --n-head 4 --n-embd 256 --vocab 256 --seq 64 --batch 8] "
                 "[--steps 10 --warmup 2]\n");
    return 2;
  }
  const int cores = std::max<int>(1, static_cast<int>(AllowedCpus().size()));
  if (std::getenv("WORLD_SIZE") != nullptr) {  // a process of dtrun / torchrun: UCX
    omp_set_num_threads(cores);
    auto comm = MakeUcxCommunicatorFromEnv();
    if (!comm.ok()) {
      std::fprintf(stderr, "fsdp_bench: %s\n", comm.status().ToString().c_str());
      return 1;
    }
    const absl::Status s = RunRank(**comm, f);
    if (!s.ok()) std::fprintf(stderr, "fsdp_bench rank %d: %s\n", (*comm)->rank(), s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  auto comms = MakeThreadGroup(f.ranks);
  if (!comms.ok()) return 1;
  std::vector<absl::Status> status(static_cast<size_t>(f.ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < f.ranks; ++r) {
    threads.emplace_back([&, r] {
      omp_set_num_threads(std::max(1, cores / f.ranks));
      status[static_cast<size_t>(r)] = RunRank(*(*comms)[static_cast<size_t>(r)], f);
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) {
      std::fprintf(stderr, "fsdp_bench: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  return 0;
}
