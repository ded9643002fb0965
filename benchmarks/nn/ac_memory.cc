// ac_memory: what activation checkpointing saves. One GPT (GPT-2 124M by default), one
// forward + backward per mode on 1 CPU rank, and per mode: the bytes the graph keeps at the
// end of the forward (saved: what checkpointing reduces), the allocator's peak bytes in use,
// the activation bytes (that peak minus the parameters and gradients live before the step)
// and the step time. With GPT-2's vocabulary and few tokens, the peak falls at the end of
// backward, where the tied wte/lm_head gradient is held several times over (the lm_head's
// [V, C] gradient waits for the embedding's, then their sum): then act is alike for all
// modes and saved shows the difference; with more tokens (--batch 8 --seq 128) the blocks'
// activations set the peak.
//
//   build/benchmarks/ac_memory                         # GPT-2 124M, B = 4, T = 64
//   build/benchmarks/ac_memory --batch 8 --seq 128 --n-layer 6
//
// The gradients of the first (warm-up) step stay allocated, zeroed before each mode, so every
// mode starts from the same bytes in use. The table checks itself: each mode's loss and the
// bytes of every gradient must equal those of "none" (#wrong counts the parameters whose
// gradient differs in any bit).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/autograd/ops.h"
#include "dtensor/collectives/store/cpus.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/parallel/activation_checkpoint.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/allocator.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

struct Flags {
  int64_t n_layer = 12, n_head = 12, n_embd = 768, vocab = 50257, block = 1024, seq = 64, batch = 4;
};

struct Result {
  int64_t peak = 0, base = 0, after_forward = 0;
  double ms = 0, loss = 0;
  std::vector<std::vector<float>> grads;  // every gradient
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double MiB(int64_t b) { return static_cast<double>(b) / (1 << 20); }

absl::StatusOr<Result> Step(nn::GPT& model, const Tensor& ids, const Tensor& targets) {
  Result r;
  for (Variable* p : model.Parameters()) {
    if (p->grad().defined()) DT_RETURN_IF_ERROR(Fill_(p->grad().local(), 0.0));
  }
  Allocator& alloc = DefaultAllocator(Device::Cpu());
  r.base = alloc.Stats().bytes_in_use;
  alloc.ResetPeakStats();
  const auto t0 = std::chrono::steady_clock::now();
  {
    DT_ASSIGN_OR_RETURN(nn::GPT::Output o, model.Forward(Variable::Constant(ids), Variable::Constant(targets)));
    r.after_forward = alloc.Stats().bytes_in_use;
    DT_RETURN_IF_ERROR(Backward(o.loss));
    DT_ASSIGN_OR_RETURN(std::vector<float> l, o.loss.value().local().ToVector<float>());
    r.loss = l[0];
  }
  r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  r.peak = alloc.Stats().peak_bytes_in_use;
  for (Variable* p : model.Parameters()) {
    DT_ASSIGN_OR_RETURN(std::vector<float> g, p->grad().local().ToVector<float>());
    r.grads.push_back(std::move(g));
  }
  return r;
}

absl::Status Run(const Flags& f) {
  nn::GPTConfig cfg{
      .vocab_size = f.vocab, .block_size = f.block, .n_layer = f.n_layer, .n_head = f.n_head, .n_embd = f.n_embd};
  DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> model, nn::GPT::Create(cfg));
  DT_RETURN_IF_ERROR(model->InitWeights(1));
  std::vector<int32_t> x(static_cast<size_t>(f.batch * f.seq)), y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<int32_t>((i * 31 + 7) % static_cast<size_t>(f.vocab));
    y[i] = static_cast<int32_t>((i * 17 + 3) % static_cast<size_t>(f.vocab));
  }
  DT_ASSIGN_OR_RETURN(Tensor ids, Tensor::FromVector<int32_t>(x, {f.batch, f.seq}));
  DT_ASSIGN_OR_RETURN(Tensor targets, Tensor::FromVector<int32_t>(y, {f.batch, f.seq}));
  int64_t param_bytes = 0;
  for (Variable* p : model->Parameters()) param_bytes += static_cast<int64_t>(p->value().local().nbytes());
  std::printf(
      "# GPT n_layer %lld n_head %lld n_embd %lld vocab %lld, %.1fM parameters (%.0f MiB), B %lld T %lld, "
      "%d threads\n",
      static_cast<long long>(f.n_layer), static_cast<long long>(f.n_head), static_cast<long long>(f.n_embd),
      static_cast<long long>(f.vocab), static_cast<double>(model->NumParameters()) / 1e6, MiB(param_bytes),
      static_cast<long long>(f.batch), static_cast<long long>(f.seq), omp_get_max_threads());
  DT_ASSIGN_OR_RETURN(Result warm, Step(*model, ids, targets));  // allocates the gradients
  std::printf("# warm-up step %.0f ms\n", warm.ms);
  std::printf("%-13s %9s %16s %13s %9s %8s %9s %10s %7s\n", "mode", "blocks_ac", "params+grads_MiB", "saved_MiB",
              "saved_%", "peak_MiB", "act_MiB", "step_ms", "#wrong");
  Result none;
  for (const char* mode : {"none", "selective:op", "selective:2", "full"}) {
    DT_ASSIGN_OR_RETURN(nn::AcOptions ac, nn::ParseAcMode(mode));
    for (int64_t i = 0; i < f.n_layer; ++i) model->block(i)->SetForwardWrapper(nullptr);
    DT_RETURN_IF_ERROR(nn::ApplyActivationCheckpointing(*model, ac));
    DT_ASSIGN_OR_RETURN(Result r, Step(*model, ids, targets));
    if (std::strcmp(mode, "none") == 0) none = r;
    int wrong = r.loss == none.loss ? 0 : 1;
    for (size_t i = 0; i < r.grads.size(); ++i) wrong += SameBits(r.grads[i], none.grads[i]) ? 0 : 1;
    const int64_t act = r.peak - r.base;
    const int64_t saved = r.after_forward - r.base;
    std::printf("%-13s %9zu %16.1f %13.1f %8.1f%% %8.1f %9.1f %10.0f %7d\n", mode,
                nn::CheckpointedBlocks(f.n_layer, ac).size(), MiB(r.base), MiB(saved),
                100.0 * static_cast<double>(saved) / static_cast<double>(none.after_forward - none.base), MiB(r.peak),
                MiB(act), r.ms, wrong);
  }
  std::printf(
      "# saved = bytes in use after the forward - before it: what the graph keeps for backward (with the loss)\n"
      "# act = peak - (params + grads in use before the step): activations and the transients of backward\n");
  return absl::OkStatus();
}

bool Parse(int argc, char** argv, Flags* f) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string n = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (v <= 0) return false;
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
    else
      return false;
  }
  f->block = std::max(f->block, f->seq);
  return argc % 2 == 1;
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  using namespace dtensor;
  if (absl::Status s = ReexecWithFasterBlasCore(argv); !s.ok())
    std::fprintf(stderr, "ac_memory: %s\n", s.ToString().c_str());
  Flags f;
  if (!Parse(argc, argv, &f)) {
    std::fprintf(stderr, "usage: ac_memory [--n-layer 12 --n-head 12 --n-embd 768 --vocab 50257 --seq 64 --batch 4]\n");
    return 2;
  }
  omp_set_num_threads(std::max<int>(1, static_cast<int>(AllowedCpus().size())));
  const absl::Status s = Run(f);
  if (!s.ok()) {
    std::fprintf(stderr, "ac_memory: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
