// gpt_train: trains a GPT-2-style model on real text, data-parallel over N ranks: FSDP (the
// default, as TorchTitan's), DDP, or both (HSDP).
//
//   gpt_train --text corpus.txt --steps 200                 # 1 rank
//   gpt_train --text corpus.txt --ranks 2                   # 2 ranks as threads: FSDP over both
//   gpt_train --text corpus.txt --ranks 4 --dp-replicate 2  # HSDP: 2 replicas of 2-way FSDP
//   dtrun --nproc-per-node 2 gpt_train --text corpus.txt    # 2 processes over UCX
//   gpt_train --text corpus.txt --ranks 4 --tp 2 --explain  # FSDP x TP: layouts, collectives, bytes
//
// Reads top to bottom like llm.c's train_gpt2.c: build the mesh, build the GPT, shard it,
// then per step: read the global batch, shard it, forward, backward, reduce the gradients,
// clip, step. Parallelism is nothing but layouts: the batch is Shard(0) over the data-parallel
// mesh dims; with FSDP (FullyShard, nn/parallel/) each parameter is Shard(0) over "dp_shard"
// and gathered per block for its forward and backward, its gradient reduce-scattered back to
// Shard(0); with DDP (--dp-shard 1) parameters are Replicate, so each gradient comes out
// Partial(sum) from DTensor's own autograd and ReduceGradients turns it Replicate in a few
// bucketed all_reduces. Every rank reads the same global batches, so losses do not depend on
// the parallelism (one rank runs the same code on plain Tensors, without a mesh). GPUs: one
// process per GPU under dtrun, over NCCL. Legend: B batch (global), T sequence length, C
// channels, V vocabulary.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "dtensor/autograd/ops.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/collectives/agree.h"
#include "dtensor/collectives/nccl/local_gpu.h"
#include "dtensor/collectives/nccl/nccl_communicator.h"
#include "dtensor/collectives/store/cpus.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/collectives/ucx/ucx_communicator.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/optim.h"
#include "dtensor/nn/parallel/activation_checkpoint.h"
#include "dtensor/nn/parallel/explain.h"
#include "dtensor/nn/parallel/fully_shard.h"
#include "dtensor/nn/parallel/gpt_plan.h"
#include "dtensor/nn/parallel/plan_file.h"
#include "dtensor/nn/safetensors.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "examples/gpt/ckpt_export.h"
#include "examples/gpt/data.h"
#include "examples/gpt/flags.h"
#include "examples/gpt/hf_gpt2.h"
#include "examples/gpt/llmc.h"
#include "examples/gpt/report.h"
#include "examples/gpt/tokenizer.h"
#include "nlohmann/json.hpp"

// ---- Flags (absl::flags; --help lists them). Spelled with dashes or underscores: --n-layer
// and --n_layer are the same flag. Booleans take --flag, --noflag, --flag=true or --flag true.
ABSL_FLAG(std::string, text, "", "train on this text file");
ABSL_FLAG(std::string, fortunes, "",
          "write an English corpus from the fortunes package's files to this path and train on it");
ABSL_FLAG(std::string, train_bin, "", "train on an llm.c token file (GPT-2 tokens)");
ABSL_FLAG(std::string, tokenizer, "byte", "how text is tokenized: byte (vocab 256) or gpt2 (GPT-2's BPE)");
ABSL_FLAG(std::string, bpe_dir, "", "directory of GPT-2's encoder.json and vocab.bpe (default: setup's copy)");
ABSL_FLAG(std::string, init_llmc, "", "start from an llm.c GPT-2 checkpoint");
// Model.
ABSL_FLAG(std::string, model, "",
          "an architecture preset: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl (the flags below override it)");
ABSL_FLAG(int64_t, n_layer, 4, "transformer blocks");
ABSL_FLAG(int64_t, n_head, 4, "attention heads");
ABSL_FLAG(int64_t, n_embd, 128, "channels");
ABSL_FLAG(int64_t, vocab, 256, "vocabulary size (--tokenizer gpt2: 50257, padded to a multiple of 128)");
ABSL_FLAG(int64_t, seq, 64, "sequence length T (the model's block size)");
ABSL_FLAG(double, dropout, 0.0, "dropout probability");
ABSL_FLAG(std::string, ac, "none",
          "activation checkpointing: none, full, selective (every 2nd block), selective:N, selective:op");
// Training.
ABSL_FLAG(int64_t, batch, 8, "global batch size B (rows of T tokens)");
ABSL_FLAG(int64_t, steps, 50, "optimizer steps");
ABSL_FLAG(double, lr, 1e-3, "learning rate (the peak, under cosine)");
ABSL_FLAG(std::string, lr_schedule, "constant", "constant or cosine (linear warmup, cosine decay to --min-lr)");
ABSL_FLAG(int64_t, warmup, 0, "warmup steps of the cosine schedule");
ABSL_FLAG(double, min_lr, 0.0, "the cosine schedule's final learning rate");
ABSL_FLAG(double, weight_decay, 0.0, "AdamW weight decay");
ABSL_FLAG(double, beta1, 0.9, "AdamW beta1");
ABSL_FLAG(double, beta2, 0.999, "AdamW beta2");
ABSL_FLAG(double, eps, 1e-8, "AdamW epsilon");
ABSL_FLAG(double, grad_clip, 0.0, "clip the gradients' global norm to this (0: no clipping)");
ABSL_FLAG(uint64_t, seed, 1337, "seed of the initial weights, dropout and sampling");
// Parallelism (TorchTitan's dims: dp_replicate x dp_shard x tp = ranks).
ABSL_FLAG(int, ranks, 1, "ranks as threads of this process (under dtrun: one process per rank instead)");
ABSL_FLAG(int64_t, dp_shard, -1, "FSDP degree (-1: the ranks left)");
ABSL_FLAG(int64_t, dp_replicate, 1, "DDP degree (with --dp-shard > 1: HSDP)");
ABSL_FLAG(int64_t, tp, 1, "tensor-parallel degree (the GPT plan)");
ABSL_FLAG(bool, sequence_parallel, true, "tensor parallelism shards LayerNorm/dropout regions over the sequence");
ABSL_FLAG(std::string, plan, "", "a tensor-parallel plan file (its degrees and rules)");
ABSL_FLAG(bool, reshard_after_forward, true, "FSDP frees gathered parameters after each block's forward");
ABSL_FLAG(bool, prefetch, true, "FSDP gathers the next block's parameters ahead");
ABSL_FLAG(std::string, param_dtype, "fp32", "FSDP mixed precision: compute dtype of the parameters, fp32 or bf16");
ABSL_FLAG(std::string, reduce_dtype, "fp32", "FSDP mixed precision: gradient reduction dtype, fp32 or bf16");
ABSL_FLAG(int64_t, grad_accum, 1, "micro-batches per step");
ABSL_FLAG(std::string, grad_sync, "every", "FSDP under --grad-accum: reduce every micro-batch or the last only");
ABSL_FLAG(bool, explain, false,
          "print each parameter's layout, each phase's collectives and the bytes per rank of one step; train nothing");
ABSL_FLAG(std::string, device, "auto", "auto, cpu or cuda (auto: one GPU per process over NCCL when GPUs exist)");
// Output.
ABSL_FLAG(std::string, metrics, "", "write one JSON object per step to this file (JSONL)");
ABSL_FLAG(int64_t, log_every, 1, "print a line every N steps");
ABSL_FLAG(std::string, progress, "auto", "a progress bar with ETA: auto (on a terminal), true or false");
ABSL_FLAG(std::string, read_loss, "auto",
          "when a step's loss and grad norm are read to the host: now (the device idles from that read until the "
          "next step's first kernel), next (once the next step is queued; the copy is queued behind that step, so "
          "the read waits for it too; steps that validate or checkpoint, and the last, read at once), auto (next "
          "on a GPU, now on the CPU)");
ABSL_FLAG(double, peak_flops, 0.0,
          "peak FLOP/s of one rank's device for MFU (0: the GPU's by model; on CPUs measured by a short GEMM)");
ABSL_FLAG(int64_t, sample_tokens, 200, "tokens to sample at the end (0: none)");
ABSL_FLAG(std::string, save_final, "", "write the trained parameters, whole, as safetensors");
// Validation.
ABSL_FLAG(int64_t, val_every, 0,
          "validation loss every N steps and at the end (0: never); without --val-bin the last --val-fraction "
          "(5%) of the data is held out from training for it");
ABSL_FLAG(std::string, val_bin, "", "validation tokens (llm.c token file); default: a held-out tail of the data");
ABSL_FLAG(double, val_fraction, 0.05, "with --val-every and no --val-bin: the tail of the data held out");
ABSL_FLAG(int64_t, val_batches, 4, "batches per validation");
// Checkpoints.
ABSL_FLAG(std::string, ckpt_dir, "", "directory of the distributed checkpoints");
ABSL_FLAG(int64_t, ckpt_every, 0, "save a checkpoint every N steps (0: never)");
ABSL_FLAG(int64_t, ckpt_keep, 0, "keep K checkpoints: the one saved and the newest before it (0: all)");
ABSL_FLAG(bool, ckpt_async, false, "write checkpoints in the background (committed at the next save or the end)");
ABSL_FLAG(bool, resume, false, "resume from the newest complete checkpoint in --ckpt-dir, under any parallelism");

namespace dtensor {
namespace {

struct Flags {
  std::string text, train_bin, init_llmc, metrics, fortunes, save_final, ckpt_dir, val_bin;
  std::string tokenizer = "byte", bpe_dir, model, ac = "none", progress = "auto", read_loss = "auto";
  int64_t ckpt_every = 0, ckpt_keep = 0;
  bool resume = false, ckpt_async = false;
  bool ranks_given = false;        // --ranks on the command line (refused under a launcher)
  std::vector<std::string> notes;  // flags given without effect, said at the start
  int64_t n_layer = 4, n_head = 4, n_embd = 128, vocab = 256, seq = 64, batch = 8, steps = 50;
  int64_t block_size = 64;  // positions of the model: --seq, or the --model preset's
  double lr = 1e-3, weight_decay = 0.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, grad_clip = 0.0, dropout = 0.0;
  std::string device = "auto";
  std::string lr_schedule = "constant";
  int64_t warmup = 0;
  double min_lr = 0.0, peak_flops = 0.0, val_fraction = 0.05;
  uint64_t seed = 1337;
  int ranks = 1;
  int64_t sample_tokens = 200, log_every = 1, val_every = 0, val_batches = 4;
  int64_t dp_shard = -1, dp_replicate = 1, tp = 1, grad_accum = 1;
  bool reshard_after_forward = true, prefetch = true, sequence_parallel = true, explain = false;
  std::string plan;
  std::string param_dtype = "fp32", reduce_dtype = "fp32";
  std::string grad_sync = "every";
};

// The parsed flags, checked: InvalidArgument naming the flag and its value.
absl::StatusOr<Flags> ReadFlags(const std::set<std::string>& given_flags) {
  Flags f;
  f.text = absl::GetFlag(FLAGS_text);
  f.fortunes = absl::GetFlag(FLAGS_fortunes);
  f.train_bin = absl::GetFlag(FLAGS_train_bin);
  f.tokenizer = absl::GetFlag(FLAGS_tokenizer);
  f.bpe_dir = absl::GetFlag(FLAGS_bpe_dir);
  f.init_llmc = absl::GetFlag(FLAGS_init_llmc);
  f.model = absl::GetFlag(FLAGS_model);
  f.n_layer = absl::GetFlag(FLAGS_n_layer);
  f.n_head = absl::GetFlag(FLAGS_n_head);
  f.n_embd = absl::GetFlag(FLAGS_n_embd);
  f.vocab = absl::GetFlag(FLAGS_vocab);
  f.seq = absl::GetFlag(FLAGS_seq);
  f.dropout = absl::GetFlag(FLAGS_dropout);
  f.ac = absl::GetFlag(FLAGS_ac);
  f.batch = absl::GetFlag(FLAGS_batch);
  f.steps = absl::GetFlag(FLAGS_steps);
  f.lr = absl::GetFlag(FLAGS_lr);
  f.lr_schedule = absl::GetFlag(FLAGS_lr_schedule);
  f.warmup = absl::GetFlag(FLAGS_warmup);
  f.min_lr = absl::GetFlag(FLAGS_min_lr);
  f.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  f.beta1 = absl::GetFlag(FLAGS_beta1);
  f.beta2 = absl::GetFlag(FLAGS_beta2);
  f.eps = absl::GetFlag(FLAGS_eps);
  f.grad_clip = absl::GetFlag(FLAGS_grad_clip);
  f.seed = absl::GetFlag(FLAGS_seed);
  f.ranks = absl::GetFlag(FLAGS_ranks);
  f.dp_shard = absl::GetFlag(FLAGS_dp_shard);
  f.dp_replicate = absl::GetFlag(FLAGS_dp_replicate);
  f.tp = absl::GetFlag(FLAGS_tp);
  f.sequence_parallel = absl::GetFlag(FLAGS_sequence_parallel);
  f.plan = absl::GetFlag(FLAGS_plan);
  f.reshard_after_forward = absl::GetFlag(FLAGS_reshard_after_forward);
  f.prefetch = absl::GetFlag(FLAGS_prefetch);
  f.param_dtype = absl::GetFlag(FLAGS_param_dtype);
  f.reduce_dtype = absl::GetFlag(FLAGS_reduce_dtype);
  f.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  f.grad_sync = absl::GetFlag(FLAGS_grad_sync);
  f.explain = absl::GetFlag(FLAGS_explain);
  f.device = absl::GetFlag(FLAGS_device);
  f.metrics = absl::GetFlag(FLAGS_metrics);
  f.log_every = absl::GetFlag(FLAGS_log_every);
  f.progress = absl::GetFlag(FLAGS_progress);
  f.read_loss = absl::GetFlag(FLAGS_read_loss);
  f.peak_flops = absl::GetFlag(FLAGS_peak_flops);
  f.sample_tokens = absl::GetFlag(FLAGS_sample_tokens);
  f.save_final = absl::GetFlag(FLAGS_save_final);
  f.val_every = absl::GetFlag(FLAGS_val_every);
  f.val_bin = absl::GetFlag(FLAGS_val_bin);
  f.val_fraction = absl::GetFlag(FLAGS_val_fraction);
  f.val_batches = absl::GetFlag(FLAGS_val_batches);
  f.ckpt_dir = absl::GetFlag(FLAGS_ckpt_dir);
  f.ckpt_every = absl::GetFlag(FLAGS_ckpt_every);
  f.ckpt_keep = absl::GetFlag(FLAGS_ckpt_keep);
  f.ckpt_async = absl::GetFlag(FLAGS_ckpt_async);
  f.resume = absl::GetFlag(FLAGS_resume);

  auto bad = [](absl::string_view flag, const auto& value, absl::string_view want) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", value, ": ", want));
  };
  auto one_of = [](const std::string& v, std::initializer_list<const char*> allowed) {
    for (const char* a : allowed) {
      if (v == a) return true;
    }
    return false;
  };
  if (!f.fortunes.empty() && !f.text.empty()) {
    return absl::InvalidArgumentError("give one of --fortunes (which builds its corpus) and --text");
  }
  if (!f.fortunes.empty()) f.text = f.fortunes;
  // A --model preset sets the architecture; flags given on the command line override it.
  auto given = [&](const std::string& name) { return given_flags.count(name) > 0; };
  f.ranks_given = given("ranks");
  f.block_size = f.seq;
  if (!f.model.empty()) {
    absl::StatusOr<nn::GPTConfig> preset = gpt::GptPreset(f.model);
    if (!preset.ok()) return bad("model", f.model, preset.status().message());
    if (!given("n_layer")) f.n_layer = preset->n_layer;
    if (!given("n_head")) f.n_head = preset->n_head;
    if (!given("n_embd")) f.n_embd = preset->n_embd;
    if (!given("vocab")) f.vocab = preset->vocab_size;
    f.block_size = std::max(f.seq, preset->block_size);
  }
  // GPT-2's tokens: the vocabulary padded to a multiple of 128 (llm.c's padded_vocab_size; the
  // padding rows are never a target and never sampled).
  if (f.tokenizer == "gpt2" && !given("vocab")) f.vocab = (gpt::Gpt2Tokenizer::kGpt2VocabSize + 127) / 128 * 128;
  if (f.text.empty() == f.train_bin.empty()) {
    return absl::InvalidArgumentError("give exactly one of --text (or --fortunes) and --train-bin");
  }
  if (f.ranks < 1) return bad("ranks", f.ranks, "must be >= 1");
  if (f.batch < 1) return bad("batch", f.batch, "must be >= 1");
  if (f.seq < 1) return bad("seq", f.seq, "must be >= 1");
  if (f.steps < 0) return bad("steps", f.steps, "must be >= 0");
  if (f.log_every < 1) return bad("log-every", f.log_every, "must be >= 1");
  if (f.grad_accum < 1) return bad("grad-accum", f.grad_accum, "must be >= 1");
  if (f.n_layer < 1) return bad("n-layer", f.n_layer, "must be >= 1");
  if (f.warmup < 0) return bad("warmup", f.warmup, "must be >= 0");
  if (!(f.grad_clip >= 0)) return bad("grad-clip", f.grad_clip, "must be >= 0 (0: no clipping)");
  if (!(f.lr >= 0)) return bad("lr", f.lr, "must be >= 0");
  if (!(f.min_lr >= 0)) return bad("min-lr", f.min_lr, "must be >= 0");
  if (f.min_lr > f.lr) return bad("min-lr", f.min_lr, absl::StrCat("must be <= --lr ", f.lr, " (cosine decays to it)"));
  if (!(f.dropout >= 0 && f.dropout < 1)) return bad("dropout", f.dropout, "must be in [0, 1)");
  if (f.sample_tokens < 0) return bad("sample-tokens", f.sample_tokens, "must be >= 0 (0: no sample)");
  if (!(f.weight_decay >= 0)) return bad("weight-decay", f.weight_decay, "must be >= 0");
  if (!one_of(f.lr_schedule, {"constant", "cosine"})) return bad("lr-schedule", f.lr_schedule, "constant|cosine");
  if (!one_of(f.device, {"auto", "cpu", "cuda"})) return bad("device", f.device, "auto|cpu|cuda");
  if (!one_of(f.param_dtype, {"fp32", "bf16"})) return bad("param-dtype", f.param_dtype, "fp32|bf16");
  if (!one_of(f.reduce_dtype, {"fp32", "bf16"})) return bad("reduce-dtype", f.reduce_dtype, "fp32|bf16");
  if (!one_of(f.grad_sync, {"every", "last"})) return bad("grad-sync", f.grad_sync, "every|last");
  if (!one_of(f.tokenizer, {"byte", "gpt2"})) return bad("tokenizer", f.tokenizer, "byte|gpt2");
  if (!one_of(f.progress, {"auto", "true", "false"})) return bad("progress", f.progress, "auto|true|false");
  if (!one_of(f.read_loss, {"auto", "now", "next"})) return bad("read-loss", f.read_loss, "auto|now|next");
  if (absl::StatusOr<nn::AcOptions> ac = nn::ParseAcMode(f.ac); !ac.ok()) return bad("ac", f.ac, ac.status().message());
  if (f.ckpt_every < 0) return bad("ckpt-every", f.ckpt_every, "must be >= 0");
  if (f.ckpt_keep < 0) return bad("ckpt-keep", f.ckpt_keep, "must be >= 0");
  if ((f.ckpt_every > 0 || f.resume) && f.ckpt_dir.empty()) {
    return absl::InvalidArgumentError("--ckpt-every N > 0 and --resume need --ckpt-dir");
  }
  if (f.batch % f.grad_accum != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch ", f.batch, " must be a multiple of --grad-accum ", f.grad_accum));
  }
  if (!(f.peak_flops >= 0)) return bad("peak-flops", f.peak_flops, "must be >= 0");
  if (!f.save_final.empty()) {  // checked now, not after the whole run
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::path(f.save_final).parent_path();
    if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
      return bad("save-final", f.save_final, absl::StrCat("its folder ", dir.string(), " does not exist"));
    }
  }
  if (f.val_every < 0) return bad("val-every", f.val_every, "must be >= 0");
  if (f.val_batches < 1) return bad("val-batches", f.val_batches, "must be >= 1");
  if (!(f.val_fraction > 0 && f.val_fraction < 1)) return bad("val-fraction", f.val_fraction, "must be in (0, 1)");
  if (f.tokenizer == "gpt2" && !f.train_bin.empty()) {
    return absl::InvalidArgumentError("--tokenizer gpt2 tokenizes --text; --train-bin is already GPT-2 tokens");
  }
  // (After the checks of the values themselves, which name a bad value first.)
  // Flags that only mean something beside another are refused alone, not ignored.
  auto needs = [&](std::initializer_list<const char*> flags, bool present, const char* what) -> absl::Status {
    for (const char* flag : flags) {
      if (given(flag) && !present) {
        std::string name(flag);
        std::replace(name.begin(), name.end(), '_', '-');
        return absl::InvalidArgumentError(absl::StrCat("--", name, " applies ", what));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = needs({"val_bin", "val_fraction", "val_batches"}, f.val_every > 0,
                             "with --val-every N > 0 (validation is off without it)");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = needs({"warmup", "min_lr"}, f.lr_schedule == "cosine",
                             "to --lr-schedule cosine (the constant schedule has neither)");
      !s.ok()) {
    return s;
  }
  // (Checkpoint flags kept on a command line rerun without saving are said, not refused.)
  for (const absl::Status& s :
       {needs({"ckpt_dir"}, f.ckpt_every > 0 || f.resume, "with --ckpt-every N > 0 or --resume: nothing is saved"),
        needs({"ckpt_keep", "ckpt_async"}, f.ckpt_every > 0, "with --ckpt-every N > 0: nothing is saved")}) {
    if (!s.ok()) f.notes.push_back(std::string(s.message()));
  }
  // An llm.c checkpoint brings its own shape: flags that would set another are refused (they
  // were silently ignored: --n-layer 6 trained the checkpoint's 2 layers).
  if (absl::Status s = needs({"model", "n_layer", "n_head", "n_embd", "vocab"}, f.init_llmc.empty(),
                             "to a model from flags; --init-llmc takes its shape from the checkpoint");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = needs({"tp", "dp_shard", "dp_replicate", "sequence_parallel"}, f.plan.empty(),
                             "without --plan (a plan file sets the mesh degrees and the tensor-parallel rules)");
      !s.ok()) {
    return s;
  }
  return f;
}

// The sampled ids as text: GPT-2's BPE decoded, bytes for byte-level data, else "<id>"s.
std::string Decode(const std::vector<int64_t>& ids, bool bytes, const gpt::Gpt2Tokenizer* tokenizer) {
  if (tokenizer != nullptr) {
    absl::StatusOr<std::string> text = tokenizer->Decode(std::vector<int32_t>(ids.begin(), ids.end()));
    if (text.ok()) return *text;
  }
  std::string s;
  for (int64_t id : ids) {
    if (bytes) {
      s.push_back(static_cast<char>(id));
    } else {
      absl::StrAppend(&s, "<", id, ">");
    }
  }
  return s;
}

// One rank's whole run. `world` is this rank's communicator (threads or UCX).
absl::Status TrainRank(Communicator& world, const Flags& f, Device device) {
  const bool lead = world.rank() == 0;
  auto say = [&](const char* fmt, auto... args) {
    if (lead) std::printf(fmt, args...), std::fflush(stdout);
  };

  // ---- The mesh (TorchTitan's parallel dims): dp_replicate x dp_shard x tp = world ----
  // FSDP shards over "dp_shard" (also over one rank, when a mixed-precision policy asks for
  // its casts); DDP replicates over "dp_replicate"; both: HSDP; tensor parallelism splits
  // layers over "tp" by a plan (the GPT plan, or --plan FILE with its own degrees). One rank
  // without any of them needs no mesh: plain Tensors.
  nn::ParallelDims want{.dp_replicate = f.dp_replicate, .dp_shard = f.dp_shard, .tp = f.tp};
  nn::ParallelizePlan tp_plan;
  if (!f.plan.empty()) {
    DT_ASSIGN_OR_RETURN(nn::PlanFile file, nn::ReadPlanFile(f.plan));
    want = file.dims;
    tp_plan = file.plan;
  } else if (f.tp > 1) {
    tp_plan = nn::GptTensorParallelPlan(f.sequence_parallel);
  }
  DT_ASSIGN_OR_RETURN(const nn::ParallelDims dims, want.Resolve(world.size()));
  const bool tensor_parallel = dims.tp > 1 || !f.plan.empty();
  const bool mixed = f.param_dtype != "fp32" || f.reduce_dtype != "fp32";
  const bool fsdp = dims.dp_shard > 1 || mixed;
  if (f.grad_sync == "last" && !fsdp) {  // DDP reduces the accumulated gradients once per step anyway
    return absl::InvalidArgumentError(
        "--grad-sync last applies to FSDP (--dp-shard > 1, or --param-dtype / --reduce-dtype bf16); without it "
        "gradients are reduced once per step, after the last micro-batch, already");
  }
  std::vector<int64_t> mesh_shape;
  std::vector<std::string> mesh_names;
  if (dims.dp_replicate > 1) {
    mesh_shape.push_back(dims.dp_replicate);
    mesh_names.push_back("dp_replicate");
  }
  if (fsdp) {
    mesh_shape.push_back(dims.dp_shard);
    mesh_names.push_back("dp_shard");
  }
  if (tensor_parallel) {
    mesh_shape.push_back(dims.tp);
    mesh_names.push_back("tp");
  }
  DeviceMesh mesh;
  if (!mesh_shape.empty()) {
    DT_ASSIGN_OR_RETURN(mesh, DeviceMesh::Create(world, mesh_shape, mesh_names));
  }
  // The batch: Shard(0) over every data-parallel dim, whole on every tp rank.
  Placements batch_placements;
  for (const std::string& n : mesh_names) batch_placements.push_back(n == "tp" ? Placement(Replicate()) : Shard(0));
  const Layout batch_layout(batch_placements);

  // ---- Data: a token stream read sequentially in global batches of B*T+1 tokens ----
  // Text is read byte by byte (vocab 256) or through GPT-2's BPE (--tokenizer gpt2).
  std::vector<uint16_t> tokens;
  std::optional<gpt::Gpt2Tokenizer> tokenizer;
  if (f.tokenizer == "gpt2") {
    absl::StatusOr<gpt::Gpt2Tokenizer> loaded =
        gpt::Gpt2Tokenizer::Load(f.bpe_dir.empty() ? gpt::Gpt2Tokenizer::DefaultDir() : f.bpe_dir);
    if (absl::IsNotFound(loaded.status())) {
      return absl::NotFoundError(absl::StrCat(loaded.status().message(),
                                              " (GPT-2's BPE files: scripts/setup.sh fetches them; --bpe-dir DIR or "
                                              "DTENSOR_GPT2_BPE_DIR names another folder)"));
    }
    DT_ASSIGN_OR_RETURN(tokenizer, std::move(loaded));
    DT_ASSIGN_OR_RETURN(std::string text, ReadFileBytes("[gpt_train] --text", f.text));
    const std::vector<int32_t> ids = tokenizer->Encode(text);
    tokens.assign(ids.begin(), ids.end());
    if (tokens.empty()) return absl::InvalidArgumentError("[gpt_train] --text " + f.text + " has no tokens");
  } else if (!f.text.empty()) {
    DT_ASSIGN_OR_RETURN(tokens, gpt::LoadTextTokens(f.text));
  } else {
    DT_ASSIGN_OR_RETURN(tokens, gpt::LoadLlmcTokens(f.train_bin));
  }

  // ---- The model: from flags, or from an llm.c checkpoint ----
  nn::GPTConfig cfg{.vocab_size = f.vocab,
                    .block_size = f.block_size,
                    .n_layer = f.n_layer,
                    .n_head = f.n_head,
                    .n_embd = f.n_embd,
                    .dropout = f.dropout,
                    .dropout_seed = f.seed};
  gpt::LlmcCheckpoint ckpt;
  if (!f.init_llmc.empty()) {
    DT_ASSIGN_OR_RETURN(ckpt, gpt::ReadLlmcCheckpoint(f.init_llmc));
    cfg.vocab_size = ckpt.config.vocab_size;
    cfg.block_size = ckpt.config.max_seq_len;
    cfg.n_layer = ckpt.config.num_layers;
    cfg.n_head = ckpt.config.num_heads;
    cfg.n_embd = ckpt.config.channels;
    if (f.seq > cfg.block_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("[gpt_train] --seq ", f.seq, " exceeds the checkpoint's max_seq_len ", cfg.block_size));
    }
  }
  DT_RETURN_IF_ERROR(gpt::ValidateTokens(tokens, cfg.vocab_size, f.text.empty() ? f.train_bin : f.text));
  // Validation tokens: --val-bin, or the tail of the data (held out from training).
  std::vector<uint16_t> val_tokens;
  if (f.val_every > 0 && !f.val_bin.empty()) {
    DT_ASSIGN_OR_RETURN(val_tokens, gpt::LoadLlmcTokens(f.val_bin));
    DT_RETURN_IF_ERROR(gpt::ValidateTokens(val_tokens, cfg.vocab_size, f.val_bin));
  } else if (f.val_every > 0) {
    const size_t keep = tokens.size() - static_cast<size_t>(static_cast<double>(tokens.size()) * f.val_fraction);
    val_tokens.assign(tokens.begin() + static_cast<std::ptrdiff_t>(keep), tokens.end());
    tokens.resize(keep);
  }
  DT_ASSIGN_OR_RETURN(gpt::TokenLoader loader, gpt::TokenLoader::Create(std::move(tokens), f.batch, f.seq));
  std::optional<gpt::TokenLoader> val_loader;
  if (f.val_every > 0) {
    absl::StatusOr<gpt::TokenLoader> v = gpt::TokenLoader::Create(std::move(val_tokens), f.batch / f.grad_accum, f.seq);
    if (!v.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("[gpt_train] validation data (",
                                                     f.val_bin.empty() ? "--val-fraction of the data" : f.val_bin,
                                                     "): ", v.status().message()));
    }
    val_loader = *std::move(v);
  }
  DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> model, nn::GPT::Create(cfg));
  if (f.init_llmc.empty()) {
    DT_RETURN_IF_ERROR(model->InitWeights(f.seed));  // the same values on every rank
  } else {
    DT_RETURN_IF_ERROR(model->LoadStateDict(ckpt.params));
  }
  DT_RETURN_IF_ERROR(model->To(device));  // this rank's device (a no-op on the CPU)
  if (mixed && device != world.device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "[gpt_train] a mixed-precision policy runs through FSDP, whose mesh must be on ", device.ToString(),
        "; thread ranks communicate on the CPU: on a GPU start the trainer under dtrun (--nproc-per-node 1 for one)"));
  }
  if (tensor_parallel && cfg.n_head % dims.tp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("[gpt_train] ", cfg.n_head, " heads do not divide over tp ", dims.tp, " (c_attn splits heads)"));
  }
  // Tensor parallelism first (parameters placed on "tp", Replicate elsewhere), then FSDP over
  // the data-parallel dims, which shards what TP left (TorchTitan's order).
  if (tensor_parallel) DT_RETURN_IF_ERROR(nn::ParallelizeModule(*model, mesh, tp_plan, "tp"));
  if (fsdp) {
    // FSDP: each block one group, then the root (wte, wpe, ln_f), as TorchTitan; the last
    // block keeps its parameters after forward (its backward comes first).
    nn::FsdpOptions o{.prefetch = f.prefetch, .shard_dim = "dp_shard"};
    if (dims.dp_replicate > 1) o.replicate_dim = "dp_replicate";
    if (tensor_parallel) o.shard_dim_fn = nn::GptFsdpShardDim;  // c_attn's stacked q, k, v: dim 1
    if (f.param_dtype == "bf16") o.mp_policy.param_dtype = DType::kBFloat16;
    if (f.reduce_dtype == "bf16") o.mp_policy.reduce_dtype = DType::kBFloat16;
    for (int64_t i = 0; i < cfg.n_layer; ++i) {
      o.reshard_after_forward = f.reshard_after_forward && i + 1 < cfg.n_layer;
      DT_RETURN_IF_ERROR(nn::FullyShard(*model->block(i), mesh, o).status());
    }
    DT_RETURN_IF_ERROR(nn::FullyShard(*model, mesh, o).status());
  } else if (mesh.defined() && !tensor_parallel) {
    // DDP: parameters Replicate (each rank keeps its copy; no communication).
    DT_RETURN_IF_ERROR(nn::DistributeModule(*model, mesh));
  }
  // Activation checkpointing: blocks keep only their input in forward and recompute the rest in
  // backward (inside FSDP's and TP's hooks, so no collective runs twice).
  DT_ASSIGN_OR_RETURN(const nn::AcOptions ac, nn::ParseAcMode(f.ac));
  if (ac.mode != nn::AcOptions::Mode::kNone) DT_RETURN_IF_ERROR(nn::ApplyActivationCheckpointing(*model, ac));
  const std::string blas = device.is_cpu() ? ", OpenBLAS " + BlasCoreName() : "";
  std::vector<std::string> kinds;
  if (dims.dp_replicate > 1 && !fsdp) kinds.push_back("DDP");
  if (fsdp) kinds.push_back(dims.dp_replicate > 1 ? "HSDP" : "FSDP");
  if (tensor_parallel) kinds.push_back(f.plan.empty() ? (f.sequence_parallel ? "TP+SP" : "TP") : "plan");
  const std::string extras = absl::StrCat(tokenizer ? ", GPT-2 tokenizer" : "",
                                          ac.mode != nn::AcOptions::Mode::kNone ? ", AC " + ac.ToString() : "");
  const std::string parallel =
      !mesh.defined() ? "" : absl::StrCat(", ", absl::StrJoin(kinds, " x "), " ", mesh.ToString());
  say("gpt_train: %d rank(s) on %s (%s%s%s), %lld parameters, %lld layers, %lld heads, C=%lld, V=%lld, B=%lld "
      "(global), T=%lld, %lld tokens%s\n",
      world.size(), device.ToString().c_str(), world.backend(), blas.c_str(), parallel.c_str(),
      static_cast<long long>(model->NumParameters()), static_cast<long long>(cfg.n_layer),
      static_cast<long long>(cfg.n_head), static_cast<long long>(cfg.n_embd), static_cast<long long>(cfg.vocab_size),
      static_cast<long long>(f.batch), static_cast<long long>(f.seq), static_cast<long long>(loader.num_tokens()),
      extras.c_str());

  // ---- --explain: what one step will cost this rank, from the layouts; trains nothing ----
  if (f.explain) {
    DT_ASSIGN_OR_RETURN(nn::StepExplanation e, nn::ExplainGptStep(*model, mesh,
                                                                  {.batch = f.batch / f.grad_accum,
                                                                   .seq = f.seq,
                                                                   .grad_accum = f.grad_accum,
                                                                   .grad_sync_every = !(fsdp && f.grad_sync == "last"),
                                                                   .plan = tp_plan,
                                                                   .ac = ac}));
    say("%s", e.ToString().c_str());
    if (lead && !f.metrics.empty()) {  // the explanation as one JSON object
      std::ofstream out(f.metrics, std::ios::trunc);
      out << e.ToJson().dump() << "\n";
      if (!out.flush()) return absl::InvalidArgumentError("[gpt_train] cannot write --metrics " + f.metrics);
    }
    return absl::OkStatus();
  }

  // ---- What the step lines report: MFU from FLOPs per token and the device's peak ----
  const double flops_per_token = gpt::FlopsPerToken(cfg, model->NumParameters(), f.seq);
  double peak_flops = f.peak_flops;
  if (peak_flops == 0) {
    DT_ASSIGN_OR_RETURN(peak_flops, gpt::PeakFlops(device, f.param_dtype == "bf16", omp_get_max_threads()));
  }
  const double device_memory = static_cast<double>(gpt::DeviceMemoryBytes(device));
  // Thread ranks share the process's allocator: its memory figures are the process's.
  const bool shared_allocator = f.ranks > 1;
  say("peak %.3g TFLOP/s per rank (%s), %.3g GFLOP per token; logged: loss, grad norm, lr, peak memory%s, tokens/s "
      "per rank, TFLOP/s and MFU per rank\n",
      peak_flops / 1e12,
      f.peak_flops > 0 ? "--peak-flops" : (device.is_cuda() ? "the GPU's data sheet" : "measured: float32 GEMM"),
      flops_per_token / 1e9,
      shared_allocator ? " (of the process: its thread ranks share one allocator; param/grad bytes are per rank)" : "");
  const bool progress_bar = lead && (f.progress == "true" || (f.progress == "auto" && isatty(STDOUT_FILENO)));

  std::vector<Variable*> params = model->Parameters();
  nn::AdamW opt(params, {.lr = f.lr, .beta1 = f.beta1, .beta2 = f.beta2, .eps = f.eps, .weight_decay = f.weight_decay});
  // The moments now (zeros, as the first update would make them): made there, they would take
  // cached blocks that the second step's activations then allocate anew.
  DT_RETURN_IF_ERROR(opt.InitState());

  // ---- Checkpoints (dtensor/checkpoint/): the parameters, AdamW's moments laid out as their
  // parameters, and the progress (next step, loader position, AdamW's step counts). Saved
  // every --ckpt-every steps; --resume loads the newest onto whatever layouts this run has ----
  const std::vector<std::pair<std::string, Variable*>> named = model->NamedParameters();
  const int64_t n_params = static_cast<int64_t>(named.size());
  // With dropout, each layer's call count (which picks its next mask) is saved too, so a
  // resumed run draws the masks the uninterrupted one would.
  std::vector<nn::Dropout*> dropouts;
  if (f.dropout > 0) {
    for (auto& [name, m] : model->NamedModules()) {
      if (auto* d = dynamic_cast<nn::Dropout*>(m)) dropouts.push_back(d);
    }
  }
  const int64_t n_dropouts = static_cast<int64_t>(dropouts.size());
  // Every rank's verdict on a step each did alone (loading, opening a file): all fail when one
  // does, the others naming it and its error, instead of waiting for it in the next collective.
  auto agree = [&](const absl::Status& mine, const std::string& what) -> absl::Status {
    return AgreeOnStatus(world, mine, absl::StrCat("[gpt_train] rank ", world.rank(), ": ", what));
  };
  auto checkpoint_state = [&](const Tensor& progress, const Tensor& dropout_calls) -> absl::StatusOr<CheckpointState> {
    DT_RETURN_IF_ERROR(opt.InitState());
    CheckpointState state;
    for (size_t i = 0; i < named.size(); ++i) {
      DT_RETURN_IF_ERROR(named[i].second->Settle());  // the shard itself, not a gathered copy
      const Value& v = named[i].second->value();
      auto as_param = [&](const Tensor& t) -> StateTensor {  // a piece laid out as the parameter
        if (!v.is_dtensor()) return t;
        return DTensor::WrapTrusted(t, v.dtensor().mesh(), v.dtensor().layout(),
                                    Shape(v.shape().begin(), v.shape().end()));
      };
      // Stored in the registered shape (GPT-2's fused c_attn, which TP views stacked), so a
      // checkpoint loads under any parallelism.
      const Shape registered = model->RegisteredShapeOf(*named[i].second);
      std::vector<int64_t> stored;
      if (registered != IntSpan(v.shape())) stored.assign(registered.begin(), registered.end());
      state.push_back({"model." + named[i].first, as_param(v.local()), stored});
      state.push_back({"optim." + named[i].first + ".exp_avg", as_param(opt.exp_avg(i)), stored});
      state.push_back({"optim." + named[i].first + ".exp_avg_sq", as_param(opt.exp_avg_sq(i)), stored});
    }
    state.push_back({"train.progress", progress});
    if (n_dropouts > 0) state.push_back({"train.dropout_calls", dropout_calls});
    return state;
  };
  // The model's tensors in a checkpoint against this run's, before a load: a model of another
  // size (--n-layer: other names; --n-embd, --vocab, ...: other shapes) is named as such, not
  // as the first mismatch the load meets.
  auto check_model = [&](const std::string& dir, const CheckpointState& state) -> absl::Status {
    DT_ASSIGN_OR_RETURN(std::vector<CheckpointTensor> saved, CheckpointTensors(dir));
    std::map<std::string, Shape> theirs, ours;
    for (const CheckpointTensor& t : saved) {
      if (absl::StartsWith(t.name, "model.")) theirs[t.name] = t.shape;
    }
    for (const StateEntry& e : state) {
      if (!absl::StartsWith(e.name, "model.")) continue;
      const DTensor* d = std::get_if<DTensor>(&e.tensor);
      const IntSpan shape = d != nullptr ? d->shape() : std::get<Tensor>(e.tensor).shape();
      ours[e.name] = e.stored_shape.empty() ? Shape(shape.begin(), shape.end())
                                            : Shape(e.stored_shape.begin(), e.stored_shape.end());
    }
    auto some = [](const std::vector<std::string>& names) {
      std::vector<std::string> head(names.begin(), names.begin() + std::min<size_t>(names.size(), 3));
      return absl::StrCat(absl::StrJoin(head, ", "), names.size() > 3 ? ", ..." : "", " (", names.size(), ")");
    };
    std::vector<std::string> extra, missing, reshaped;
    for (const auto& [name, shape] : theirs) {
      auto it = ours.find(name);
      if (it == ours.end()) {
        extra.push_back(name);
      } else if (it->second != shape) {
        reshaped.push_back(absl::StrCat(name, " ", ShapeString(shape), " there, ", ShapeString(it->second), " here"));
      }
    }
    for (const auto& [name, shape] : ours) {
      if (!theirs.count(name)) missing.push_back(name);
    }
    if (extra.empty() && missing.empty() && reshaped.empty()) return absl::OkStatus();
    std::vector<std::string> what;
    if (!extra.empty()) what.push_back(absl::StrCat("parameters this run lacks: ", some(extra)));
    if (!missing.empty()) what.push_back(absl::StrCat("this run's parameters it lacks: ", some(missing)));
    if (!reshaped.empty()) what.push_back(absl::StrCat("other shapes: ", some(reshaped)));
    return absl::InvalidArgumentError(
        absl::StrCat("[gpt_train] ", dir, " holds another model than this run's (", cfg.n_layer, " layers, n_embd ",
                     cfg.n_embd, ", vocab ", cfg.vocab_size, "): ", absl::StrJoin(what, "; "),
                     ". Resume with the flags it was trained with (--n-layer, --n-embd, --vocab, ...)"));
  };
  int64_t first_step = 0;
  std::unique_ptr<AsyncCheckpointSave> pending_save;  // --ckpt-async: written in the background
  if (f.resume) {
    DT_ASSIGN_OR_RETURN(const std::string dir, LatestCheckpoint(f.ckpt_dir));
    DT_ASSIGN_OR_RETURN(Tensor progress, Zeros({3 + n_params}, DType::kInt64));
    DT_ASSIGN_OR_RETURN(Tensor dropout_calls, Zeros({std::max<int64_t>(n_dropouts, 1)}, DType::kInt64));
    DT_ASSIGN_OR_RETURN(CheckpointState state, checkpoint_state(progress, dropout_calls));
    DT_RETURN_IF_ERROR(agree(check_model(dir, state), "checking " + dir));
    // The dropout masks drawn so far: absent from a checkpoint saved without dropout, whose
    // run drew none (a resume with --dropout p starts the masks there).
    std::erase_if(state, [](const StateEntry& e) { return e.name == "train.dropout_calls"; });
    DT_RETURN_IF_ERROR(agree(LoadCheckpoint(dir, state), "loading " + dir));
    if (n_dropouts > 0) {
      const absl::Status calls = LoadCheckpoint(dir, {{"train.dropout_calls", dropout_calls}});
      DT_RETURN_IF_ERROR(agree(absl::IsNotFound(calls) ? absl::OkStatus() : calls, "loading " + dir));
    }
    for (int64_t i = 0; i < n_dropouts; ++i) {
      dropouts[static_cast<size_t>(i)]->set_calls(static_cast<uint64_t>(dropout_calls.data<int64_t>()[i]));
    }
    // The head count, which no parameter's shape tells: a checkpoint of 2 heads would train on
    // as another model under --n-head 4. (Checkpoints without it are taken as they are.)
    DT_ASSIGN_OR_RETURN(Tensor heads, Zeros({1}, DType::kInt64));
    const absl::Status heads_read = LoadCheckpoint(dir, {{gpt::kHeadsTensor, heads}});
    if (heads_read.ok() && heads.data<int64_t>()[0] != cfg.n_head) {
      return absl::InvalidArgumentError(absl::StrCat("[gpt_train] ", dir, " was saved with ", heads.data<int64_t>()[0],
                                                     " heads; this run has --n-head ", cfg.n_head));
    }
    const int64_t* pr = progress.data<int64_t>();
    if (pr[0] < 0) {
      return absl::DataLossError(absl::StrCat("[gpt_train] ", dir, " holds step ", pr[0], " in train.progress"));
    }
    first_step = pr[0];
    DT_RETURN_IF_ERROR(loader.set_position(pr[1]));
    DT_RETURN_IF_ERROR(opt.set_steps(pr[2], std::vector<int64_t>(pr + 3, pr + 3 + n_params)));
    say("resumed from %s: step %lld\n", dir.c_str(), static_cast<long long>(first_step));
    if (first_step >= f.steps) {
      say("nothing to train: the checkpoint is at step %lld and --steps is %lld\n", static_cast<long long>(first_step),
          static_cast<long long>(f.steps));
    }
  }
  // A fresh run (no --resume) into a --ckpt-dir that holds a complete checkpoint (another
  // run's: a later --resume would continue that run, and --ckpt-keep prune its checkpoints),
  // and a name this run will save under that --ckpt-dir already holds, are refused now, not at
  // the first save after minutes of training.
  if (f.ckpt_every > 0) {
    if (!f.resume) {
      absl::Status fresh;
      if (lead) {
        if (absl::StatusOr<std::string> newest = LatestCheckpoint(f.ckpt_dir); newest.ok()) {
          fresh = absl::InvalidArgumentError(absl::StrCat("[gpt_train] --ckpt-dir ", f.ckpt_dir,
                                                          " holds checkpoints of another run (newest ",
                                                          std::filesystem::path(*newest).filename().string(),
                                                          "): continue it with --resume or use another folder"));
        }
      }
      DT_RETURN_IF_ERROR(agree(fresh, "checking --ckpt-dir"));
    }
    // And a folder that cannot be made or written (a file's path, no permission) is named now;
    // one made here is made durable (MakeCheckpointRoot fsyncs each new directory's parent).
    {
      std::error_code ec;
      const absl::Status made = MakeCheckpointRoot(f.ckpt_dir);
      absl::Status usable;
      if (!std::filesystem::is_directory(f.ckpt_dir, ec)) {
        usable = absl::FailedPreconditionError(
            absl::StrCat("[gpt_train] --ckpt-dir ", f.ckpt_dir, " is not a folder and cannot be made one"));
      } else {
        const std::filesystem::path probe =
            std::filesystem::path(f.ckpt_dir) / absl::StrFormat(".write-test-%d-%d", getpid(), world.rank());
        if (!std::ofstream(probe).good()) {
          usable = absl::FailedPreconditionError(
              absl::StrCat("[gpt_train] --ckpt-dir ", f.ckpt_dir, " is not writable (", std::strerror(errno), ")"));
        }
        std::filesystem::remove(probe, ec);
        if (usable.ok()) usable = made;
      }
      DT_RETURN_IF_ERROR(agree(usable, "checking --ckpt-dir"));
    }
    int64_t first_clash = 0;  // the earliest such step
    std::string clash_name;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(f.ckpt_dir, ec)) {
      const std::string n = entry.path().filename().string();
      if (!lead || n.size() <= 5 || n.rfind("step-", 0) != 0 || n.size() > 5 + 18 ||
          n.find_first_not_of("0123456789", 5) != std::string::npos) {
        continue;
      }
      const int64_t at = std::stoll(n.substr(5));
      if (n != absl::StrFormat("step-%08lld", static_cast<long long>(at))) continue;  // not a name it writes
      if (at > first_step && at <= f.steps && at % f.ckpt_every == 0 && (first_clash == 0 || at < first_clash)) {
        first_clash = at;
        clash_name = n;
      }
    }
    absl::Status clash;
    if (first_clash > 0) {
      clash = absl::AlreadyExistsError(absl::StrCat(
          "[gpt_train] --ckpt-dir ", f.ckpt_dir, " already holds ", clash_name, ", which this run would save at step ",
          first_clash, f.resume ? "" : " (not a complete checkpoint)", ", or use another --ckpt-dir"));
    }
    DT_RETURN_IF_ERROR(agree(clash, "checking --ckpt-dir"));
  }
  std::ofstream metrics;
  bool metrics_ok = true;
  if (lead && !f.metrics.empty()) {
    // A resumed run adds its steps to the file (the earlier steps' lines stay).
    metrics.open(f.metrics, f.resume ? std::ios::app : std::ios::trunc);
    metrics_ok = static_cast<bool>(metrics);
  }
  // Every rank stops when rank 0 cannot write (else they wait for it).
  DT_RETURN_IF_ERROR(agree(metrics_ok ? absl::OkStatus()
                                      : absl::InvalidArgumentError(absl::StrCat("[gpt_train] rank ", world.rank(),
                                                                                ": cannot open --metrics ", f.metrics)),
                           "opening --metrics " + f.metrics));

  // ---- Training ----
  // What each phase sent, per collective kind (the mesh's CommCounter, switched per phase), and
  // the peak of FSDP's gathered parameters: in the metrics, as --explain predicts them.
  std::array<CommCounter, 3> comm;  // forward, backward, update
  auto count = [&](int phase) {
    if (mesh.defined()) SetCommCounter(mesh, &comm[static_cast<size_t>(phase)]);
  };
  nn::FsdpGroup* root_group = fsdp ? nn::FsdpGroupOf(*model) : nullptr;
  // The mean loss over --val-batches batches from the start of the validation data (the same
  // batches every time), without gradients; each rank's rows as in training.
  auto validate = [&]() -> absl::StatusOr<double> {
    NoGradGuard no_grad;
    model->Eval();
    val_loader->Reset();
    double sum = 0;
    // --val-batches batches of --batch rows, read as K micro-batches each (the memory of one):
    // the same rows, and so the same mean, whatever --grad-accum is.
    const int64_t micro_batches = f.val_batches * f.grad_accum;
    for (int64_t k = 0; k < micro_batches; ++k) {
      gpt::Batch batch = val_loader->Next();
      const int64_t rows = val_loader->batch_size();
      DT_ASSIGN_OR_RETURN(Tensor xi, Tensor::FromVector<int32_t>(batch.inputs, {rows, f.seq}));
      DT_ASSIGN_OR_RETURN(Tensor yi, Tensor::FromVector<int32_t>(batch.targets, {rows, f.seq}));
      DT_ASSIGN_OR_RETURN(xi, To(xi, device));
      DT_ASSIGN_OR_RETURN(yi, To(yi, device));
      Value x = xi, y = yi;
      if (mesh.defined()) {
        DT_ASSIGN_OR_RETURN(x, DTensor::Distribute(xi, mesh, batch_layout, {.src_rank = std::nullopt}));
        DT_ASSIGN_OR_RETURN(y, DTensor::Distribute(yi, mesh, batch_layout, {.src_rank = std::nullopt}));
      }
      // The loss is backpropagated scaled by 1/K: its fused gradient is computed for that.
      DT_ASSIGN_OR_RETURN(nn::GPT::Output out, model->Forward(Variable::Constant(x), Variable::Constant(y),
                                                              1.0 / static_cast<double>(f.grad_accum)));
      Value loss = out.loss.value();
      if (loss.is_dtensor()) {
        DT_ASSIGN_OR_RETURN(DTensor r, loss.dtensor().Redistribute(Layout(Placements(mesh_shape.size(), Replicate()))));
        loss = r;
      }
      DT_ASSIGN_OR_RETURN(std::vector<double> lv, ToDoubleVector(loss.local()));
      sum += lv[0];
    }
    model->Train();
    return sum / static_cast<double>(micro_batches);
  };
  // What one step leaves for its log line: everything but the loss and grad norm is known when
  // its update is queued; those two are read from the device by ReadLoss, at once (--read-loss
  // now) or after the next step is queued (next: the device then runs from one step into the
  // next without waiting for the host, as in llm.c).
  using Clock = std::chrono::steady_clock;
  const Clock::time_point run_start = Clock::now();
  struct StepRecord {
    int64_t step = 0;
    std::vector<Value> losses;  // one per micro-batch, Partial(sum) over the batch shards
    Tensor norm_on_device;      // on a GPU; else `norm` is already known
    double norm = 0, loss = 0, lr = 0, fwd_ms = 0, bwd_ms = 0;
    Clock::time_point t0, t_update, t_queued, t_read;
    int64_t param_bytes = 0, grad_bytes = 0;
    AllocatorStats mem;
    std::array<CommCounter, 3> comm;  // forward, backward, update
    int64_t peak_unsharded = 0;
  };
  const bool read_next = f.read_loss == "next" || (f.read_loss == "auto" && device.is_cuda());
  auto read_loss = [&](StepRecord& r) -> absl::Status {
    // Each loss is Partial(sum) over the batch shards: one scalar all_reduce to read it, counted
    // in its step's update phase.
    if (mesh.defined()) SetCommCounter(mesh, &r.comm[2]);
    double loss_sum = 0;
    for (Value& loss : r.losses) {
      if (loss.is_dtensor()) {
        DT_ASSIGN_OR_RETURN(DTensor t, loss.dtensor().Redistribute(Layout(Placements(mesh_shape.size(), Replicate()))));
        loss = t;
      }
      DT_ASSIGN_OR_RETURN(std::vector<double> lv, ToDoubleVector(loss.local()));
      loss_sum += lv[0];
    }
    if (mesh.defined()) SetCommCounter(mesh, nullptr);
    r.losses.clear();
    r.loss = loss_sum / static_cast<double>(f.grad_accum);
    if (r.norm_on_device.defined()) {
      DT_ASSIGN_OR_RETURN(std::vector<double> nv, ToDoubleVector(r.norm_on_device));
      r.norm = nv[0];
      r.norm_on_device = Tensor();
    }
    r.t_read = Clock::now();
    return absl::OkStatus();
  };
  // The step's time runs to the read of its loss, from its start or, where it started before
  // the previous step's read (--read-loss next), from that read: what the device spent on it.
  Clock::time_point last_read{};
  auto report = [&](const StepRecord& r, double ckpt_ms, std::optional<double> val_loss) {
    auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    const double dt = std::chrono::duration<double>(r.t_read - std::max(r.t0, last_read)).count();
    last_read = r.t_read;
    const double tok_s = static_cast<double>(f.batch * f.seq) / dt;
    // TorchTitan's line: tokens/s and MFU per rank (the global batch's tokens over the ranks).
    const double tok_s_rank = tok_s / static_cast<double>(world.size());
    const double mfu = gpt::Mfu(flops_per_token, tok_s_rank, peak_flops);
    const double peak_gib = static_cast<double>(r.mem.peak_bytes_in_use) / (1 << 30);
    const std::string val_text = val_loss ? absl::StrFormat("  val_loss: %.5f", *val_loss) : "";
    if (progress_bar) say("%s", "\r\033[K");
    if (r.step % f.log_every == 0 || r.step + 1 == f.steps || val_loss.has_value()) {
      say("step: %4lld  loss: %8.5f  grad_norm: %7.4f  lr: %.2e  memory: %5.2fGiB(%.2f%%)  tps: %s  tflops: %.3f  "
          "mfu: %.2f%%  time: %.0fms%s\n",
          static_cast<long long>(r.step), r.loss, r.norm, r.lr, peak_gib,
          device_memory > 0 ? 100.0 * static_cast<double>(r.mem.peak_bytes_in_use) / device_memory : 0.0,
          absl::StrCat(static_cast<int64_t>(std::llround(tok_s_rank))).c_str(), flops_per_token * tok_s_rank / 1e12,
          100.0 * mfu, dt * 1e3, val_text.c_str());
    }
    if (progress_bar) {
      say("%s", gpt::ProgressBar(r.step + 1 - first_step, f.steps - first_step,
                                 std::chrono::duration<double>(Clock::now() - run_start).count(), 30)
                    .c_str());
      if (r.step + 1 == f.steps) say("%s", "\n");
    }
    if (metrics.is_open()) {
      nlohmann::json line{{"step", r.step},
                          {"loss", r.loss},
                          {"lr", r.lr},
                          {"grad_norm", r.norm},
                          {"step_ms", dt * 1e3},
                          {"tokens_per_s", tok_s},
                          {"tokens_per_s_per_rank", tok_s_rank},
                          {"tflops_per_rank", flops_per_token * tok_s_rank / 1e12},
                          {"mfu", mfu},
                          {"ranks", world.size()},
                          {"forward_ms", r.fwd_ms},
                          {"backward_ms", r.bwd_ms},
                          // To the loss's read where it is read at once; else until queued.
                          {"update_ms", ms(r.t_update, read_next ? r.t_queued : r.t_read)},
                          {"param_bytes", r.param_bytes},
                          {"grad_bytes", r.grad_bytes},
                          {"optim_bytes", opt.StateBytes()},
                          {"bytes_in_use", r.mem.bytes_in_use},
                          {"peak_bytes", r.mem.peak_bytes_in_use},
                          {"reserved_bytes", r.mem.bytes_in_use + r.mem.bytes_cached},
                          {"system_allocs", r.mem.num_system_allocs},
                          {"memory_of", shared_allocator ? "process" : "rank"},  // bytes_in_use .. system_allocs
                          {"peak_unsharded_bytes", r.peak_unsharded},
                          {"comm", nn::CommToJson(r.comm)},
                          {"loss_read", read_next ? "next" : "now"},
                          {"ckpt_ms", ckpt_ms}};
      if (val_loss) line["val_loss"] = *val_loss;
      metrics << line.dump() << "\n" << std::flush;
    }
  };
  Allocator& allocator = DefaultAllocator(device);
  const int64_t micro = f.batch / f.grad_accum;  // rows per micro-batch (global)
  // The batches go to the device from two pinned host buffers in turn, without waiting
  // (To's non_blocking): buffer step % 2 is refilled two steps later, after this step's loss
  // was read, which waits for everything queued before it (its copy included). Training on the
  // CPU the buffers are ordinary memory (pinning would start a CUDA context on a machine with a
  // GPU), and each is the batch tensor itself.
  auto host_buffer = [&]() -> absl::StatusOr<Tensor> {
    return device.is_cuda() ? Tensor::EmptyPinned({f.batch, f.seq}, DType::kInt32)
                            : Tensor::Empty({f.batch, f.seq}, DType::kInt32);
  };
  std::array<Tensor, 2> host_inputs, host_targets;
  for (size_t i = 0; i < 2; ++i) {
    DT_ASSIGN_OR_RETURN(host_inputs[i], host_buffer());
    DT_ASSIGN_OR_RETURN(host_targets[i], host_buffer());
  }
  std::optional<StepRecord> pending;  // --read-loss next: the queued step whose loss is unread
  for (int64_t step = first_step; step < f.steps; ++step) {
    StepRecord rec;
    rec.step = step;
    rec.t0 = Clock::now();
    if (lead || !shared_allocator) allocator.ResetPeakStats();  // once per step for the process
    for (CommCounter& c : comm) c.Reset();
    if (root_group != nullptr) root_group->ResetPeakUnshardedBytes();
    gpt::Batch batch = loader.Next();  // the global batch [B, T], the same on every rank
    const size_t buf = static_cast<size_t>(step % 2);
    std::memcpy(host_inputs[buf].data<int32_t>(), batch.inputs.data(), batch.inputs.size() * sizeof(int32_t));
    std::memcpy(host_targets[buf].data<int32_t>(), batch.targets.data(), batch.targets.size() * sizeof(int32_t));
    DT_ASSIGN_OR_RETURN(Tensor inputs, To(host_inputs[buf], device, {.non_blocking = true}));
    DT_ASSIGN_OR_RETURN(Tensor targets, To(host_targets[buf], device, {.non_blocking = true}));

    // K micro-batches of B/K rows; each backward adds 1/K of its mean loss's gradient, so the
    // step sees the gradient of the global batch's mean loss, as with K = 1.
    for (int64_t k = 0; k < f.grad_accum; ++k) {
      DT_ASSIGN_OR_RETURN(Tensor xi, inputs.Narrow(0, k * micro, micro));
      DT_ASSIGN_OR_RETURN(Tensor yi, targets.Narrow(0, k * micro, micro));
      // Shard(0): each rank keeps its rows of the batch (torch.chunk; no communication).
      Value x = xi, y = yi;
      if (mesh.defined()) {
        DT_ASSIGN_OR_RETURN(x, DTensor::Distribute(xi, mesh, batch_layout, {.src_rank = std::nullopt}));
        DT_ASSIGN_OR_RETURN(y, DTensor::Distribute(yi, mesh, batch_layout, {.src_rank = std::nullopt}));
      }
      if (fsdp && f.grad_sync == "last") nn::SetRequiresGradientSync(*model, k + 1 == f.grad_accum);
      const auto f0 = Clock::now();
      count(0);
      // The loss is backpropagated scaled by 1/K: its fused gradient is computed for that.
      DT_ASSIGN_OR_RETURN(nn::GPT::Output out, model->Forward(Variable::Constant(x), Variable::Constant(y),
                                                              1.0 / static_cast<double>(f.grad_accum)));
      Variable loss = out.loss;
      out.logits = Variable();  // the loss keeps their gradient, not them: free them now
      if (f.grad_accum > 1) {
        DT_ASSIGN_OR_RETURN(loss, Scale(out.loss, 1.0 / static_cast<double>(f.grad_accum)));
      }
      const auto f1 = Clock::now();
      // Gradients: FSDP reduce-scatters them to Shard(0) during backward; DDP leaves them
      // Partial(sum).
      count(1);
      DT_RETURN_IF_ERROR(Backward(loss));
      const auto f2 = Clock::now();
      rec.fwd_ms += std::chrono::duration<double, std::milli>(f1 - f0).count();
      rec.bwd_ms += std::chrono::duration<double, std::milli>(f2 - f1).count();
      rec.losses.push_back(out.loss.value());
    }
    rec.t_update = Clock::now();
    count(2);
    if (!fsdp) DT_RETURN_IF_ERROR(nn::ReduceGradients(params));  // DDP: -> Replicate, bucketed all_reduces
    // On a GPU the norm stays on the device until the loss is read: no host sync between
    // backward and the update. Without clipping the norm is only reported: the update reads it
    // in its own pass over the gradients (the same value), where clipping needs it before.
    rec.lr = f.lr_schedule == "cosine"
                 ? nn::WarmupCosineLr(step, {.max_lr = f.lr, .min_lr = f.min_lr, .warmup = f.warmup, .total = f.steps})
                 : f.lr;
    opt.set_lr(rec.lr);
    if (f.grad_clip == 0) {
      if (device.is_cuda()) {
        DT_ASSIGN_OR_RETURN(rec.norm_on_device, opt.StepWithGradNormAsync());
      } else {
        DT_ASSIGN_OR_RETURN(rec.norm, opt.StepWithGradNorm());
      }
    } else if (device.is_cuda()) {  // clipping: the update reads the gradients times the factor
      DT_ASSIGN_OR_RETURN(rec.norm_on_device, opt.StepWithClipAsync(f.grad_clip));
    } else {
      DT_ASSIGN_OR_RETURN(rec.norm, opt.StepWithClip(f.grad_clip));
    }
    // Memory at rest (parameters, gradients, optimizer state on this rank), before the
    // gradients are dropped.
    for (Variable* p : params) {
      rec.param_bytes += static_cast<int64_t>(p->value().local().nbytes());
      if (p->grad().defined()) rec.grad_bytes += static_cast<int64_t>(p->grad().local().nbytes());
    }
    rec.mem = allocator.Stats();
    opt.ZeroGrad();
    if (mesh.defined()) SetCommCounter(mesh, nullptr);
    rec.comm = comm;
    rec.peak_unsharded = root_group ? root_group->tree_peak_unsharded_bytes() : 0;
    rec.t_queued = Clock::now();

    // The previous step's line, now that this one is queued.
    if (pending) {
      DT_RETURN_IF_ERROR(read_loss(*pending));
      report(*pending, 0, std::nullopt);
      pending.reset();
    }
    const bool save = f.ckpt_every > 0 && (step + 1) % f.ckpt_every == 0;
    const bool validate_now = f.val_every > 0 && ((step > 0 && step % f.val_every == 0) || step + 1 == f.steps);
    if (read_next && !save && !validate_now && step + 1 < f.steps) {
      pending = std::move(rec);
      continue;
    }
    DT_RETURN_IF_ERROR(read_loss(rec));
    // A checkpoint after the update; the time it blocks training goes into the metrics.
    double ckpt_ms = 0;
    if (save) {
      const auto c0 = Clock::now();
      std::vector<int64_t> progress = {step + 1, loader.position(), opt.step_count()};
      for (int64_t s : opt.param_steps()) progress.push_back(s);
      DT_ASSIGN_OR_RETURN(Tensor pt, Tensor::FromVector<int64_t>(progress, {3 + n_params}));
      std::vector<int64_t> calls;
      for (nn::Dropout* d : dropouts) calls.push_back(static_cast<int64_t>(d->calls()));
      if (calls.empty()) calls.push_back(0);
      DT_ASSIGN_OR_RETURN(Tensor dc, Tensor::FromVector<int64_t>(calls, {static_cast<int64_t>(calls.size())}));
      DT_ASSIGN_OR_RETURN(CheckpointState state, checkpoint_state(pt, dc));
      // The number of heads, which the parameters' shapes do not tell (for gpt_generate and
      // gpt_export; a resume does not read it).
      DT_ASSIGN_OR_RETURN(Tensor heads, Tensor::FromVector<int64_t>({cfg.n_head}, {1}));
      state.push_back({gpt::kHeadsTensor, heads});
      const std::string name = absl::StrFormat("step-%08lld", static_cast<long long>(step + 1));
      if (pending_save != nullptr) {  // the previous asynchronous save commits first
        DT_RETURN_IF_ERROR(pending_save->Finish());
        pending_save.reset();
      }
      if (f.ckpt_async) {
        DT_ASSIGN_OR_RETURN(pending_save,
                            AsyncCheckpointSave::Start(world, f.ckpt_dir, name, state, {.keep = f.ckpt_keep}));
      } else {
        DT_RETURN_IF_ERROR(SaveCheckpoint(world, f.ckpt_dir, name, state, {.keep = f.ckpt_keep}));
      }
      ckpt_ms = std::chrono::duration<double, std::milli>(Clock::now() - c0).count();
    }
    std::optional<double> val_loss;
    if (validate_now) {
      DT_ASSIGN_OR_RETURN(val_loss, validate());
    }
    report(rec, ckpt_ms, val_loss);
  }
  if (pending_save != nullptr) DT_RETURN_IF_ERROR(pending_save->Finish());

  // ---- The trained parameters, gathered whole (collective), written by rank 0 ----
  if (!f.save_final.empty()) {
    DT_ASSIGN_OR_RETURN(auto state, model->StateDict());
    DT_RETURN_IF_ERROR(
        agree(lead ? WriteSafetensors(f.save_final, state) : absl::OkStatus(), "writing --save-final " + f.save_final));
  }

  // ---- Sampling: every rank runs the same seeded draws (on gathered parameters) ----
  if (f.sample_tokens > 0) {
    NoGradGuard no_grad;
    model->Eval();
    std::mt19937_64 rng(f.seed);
    // The first token: GPT-2's <|endoftext|> for GPT-2 tokens, a newline for bytes.
    std::vector<int64_t> ids = {f.text.empty() || tokenizer ? 50256 : '\n'};
    // Only ids the data can hold are drawn: bytes of --text, GPT-2's 50257 tokens (--tokenizer
    // gpt2, --train-bin), not the rows padding the vocabulary beyond them.
    const bool bytes = !f.text.empty() && !tokenizer;
    const int64_t real_vocab =
        std::min<int64_t>(cfg.vocab_size, tokenizer             ? tokenizer->vocab_size()
                                          : bytes               ? 256
                                          : f.train_bin.empty() ? cfg.vocab_size
                                                                : gpt::Gpt2Tokenizer::kGpt2VocabSize);
    if (cfg.vocab_size <= ids[0]) ids[0] = 0;
    for (int64_t i = 0; i < f.sample_tokens; ++i) {
      const int64_t t = std::min<int64_t>(static_cast<int64_t>(ids.size()), cfg.block_size);
      std::vector<int64_t> ctx(ids.end() - t, ids.end());
      DT_ASSIGN_OR_RETURN(Tensor in, Tensor::FromVector<int64_t>(ctx, {1, t}));
      DT_ASSIGN_OR_RETURN(in, To(in, device));
      DT_ASSIGN_OR_RETURN(nn::GPT::Output out, model->Forward(Variable::Constant(in)));
      const Value& lv = out.logits.value();
      DT_ASSIGN_OR_RETURN(Tensor logits,
                          lv.is_dtensor() ? lv.dtensor().FullTensor() : absl::StatusOr<Tensor>(lv.local()));
      DT_ASSIGN_OR_RETURN(Tensor last, logits.Select(1, t - 1));
      DT_ASSIGN_OR_RETURN(Tensor probs, dtensor::Softmax(last, -1));
      DT_ASSIGN_OR_RETURN(std::vector<double> p, ToDoubleVector(probs));
      if (static_cast<int64_t>(p.size()) > real_vocab) p.resize(static_cast<size_t>(real_vocab));
      std::discrete_distribution<int64_t> pick(p.begin(), p.end());
      ids.push_back(pick(rng));
    }
    say("---- sample ----\n%s\n----------------\n",
        Decode(std::vector<int64_t>(ids.begin() + 1, ids.end()), bytes, tokenizer ? &*tokenizer : nullptr).c_str());
  }
  return absl::OkStatus();
}

bool LaunchedAsProcess() {
  return std::getenv("WORLD_SIZE") != nullptr || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||
         std::getenv("SLURM_NTASKS") != nullptr;
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  using namespace dtensor;
  // First: OpenBLAS picks its kernels when it loads, and falls back to generic SSE3 ones on CPUs
  // newer than its table (4-5x slower GEMMs). Where so, this restarts the program with the
  // faster set named (OPENBLAS_CORETYPE). It returns where there is nothing to do, or the restart
  // failed (then training goes on, slower).
  if (absl::Status blas = ReexecWithFasterBlasCore(argv); !blas.ok()) {
    std::fprintf(stderr, "gpt_train: %s\n", blas.ToString().c_str());
  }
  absl::SetProgramUsageMessage(
      "trains a GPT on text, data- and tensor-parallel over N ranks.\n"
      "  gpt_train --fortunes /tmp/fortunes.txt --tokenizer gpt2 --ranks 2   # FSDP over 2 thread ranks\n"
      "  dtrun --nproc-per-node 2 gpt_train --text corpus.txt                # 2 processes over UCX\n"
      "Flags are listed with underscores; --n-layer and --n_layer are the same flag.");
  std::vector<std::string> arg_storage;
  std::vector<char*> args = gpt::AbslStyleArgs(argc, argv, arg_storage);
  const std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (rest.size() > 1) {
    std::fprintf(stderr, "gpt_train: unexpected argument '%s' (flags are --name value or --name=value; see --help)\n",
                 rest[1]);
    return 2;
  }
  absl::StatusOr<Flags> flags = ReadFlags(gpt::GivenFlagNames(arg_storage));
  if (!flags.ok()) {
    std::fprintf(stderr, "gpt_train: %s (see --help)\n", std::string(flags.status().message()).c_str());
    return 2;
  }
  const Flags& f = *flags;
  for (const std::string& note : f.notes) std::fprintf(stderr, "gpt_train: note: %s\n", note.c_str());
  if (!f.fortunes.empty()) {  // every process may do this: the file is replaced atomically
    auto corpus = gpt::PrepareFortunesCorpus(f.fortunes);
    if (!corpus.ok()) {
      std::fprintf(stderr, "gpt_train: %s\n", corpus.status().ToString().c_str());
      return 1;
    }
  }
  if (absl::Status t = TimeoutFromEnv().status(); !t.ok()) {
    std::fprintf(stderr, "gpt_train: %s\n", std::string(t.message()).c_str());
    return 2;
  }
  // The CPUs this process may use (a launcher may have bound it to its share: dtrun does).
  const int online = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int cores = std::max<int>(1, static_cast<int>(AllowedCpus().size()));
  const bool gpus = CudaDeviceCount() > 0;
  if (f.device == "cuda" && !gpus) {
    std::fprintf(stderr, "gpt_train: --device cuda but no CUDA device is visible (CUDA built: %s)\n",
                 CudaBuilt() ? "yes" : "no");
    return 1;
  }
  if (LaunchedAsProcess() && f.ranks_given && f.ranks > 1) {
    std::fprintf(stderr,
                 "gpt_train: --ranks %lld runs thread ranks in one process, but a launcher started this one as a "
                 "rank of its own (WORLD_SIZE / OMPI_COMM_WORLD_SIZE / SLURM_NTASKS is set): drop --ranks\n",
                 static_cast<long long>(f.ranks));
    return 2;
  }
  if (LaunchedAsProcess()) {
    // One process per rank (dtrun, mpirun, srun): NCCL on GPUs, else UCX.
    const bool use_cuda = f.device == "cuda" || (f.device == "auto" && gpus);
    // Bound to fewer CPUs than the host has: those are this rank's own. Otherwise the host's
    // processes share them.
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    gpt::SetRankThreads(cores < online ? cores : std::max(1, cores / std::max(1, local ? std::atoi(local) : 1)));
    absl::StatusOr<std::unique_ptr<Communicator>> comm;
    std::unique_ptr<StoreClient> store;  // NCCL's rendezvous store lives as long as the run
    Device device = Device::Cpu();
    if (use_cuda) {
      auto info = LaunchInfoFromEnv();
      absl::StatusOr<int> gpu = info.ok() ? LocalGpu(info->local_rank, info->local_world_size, CudaDeviceCount(),
                                                     std::getenv("CUDA_VISIBLE_DEVICES") != nullptr)
                                          : absl::StatusOr<int>(info.status());
      if (!gpu.ok() && absl::IsFailedPrecondition(gpu.status())) {
        gpu = absl::FailedPreconditionError(
            absl::StrCat(gpu.status().message(), "; --device cpu trains on CPU ranks over UCX instead"));
      }
      auto s =
          gpu.ok() ? ConnectStore(*info, DefaultTimeout()) : absl::StatusOr<std::unique_ptr<StoreClient>>(gpu.status());
      if (s.ok()) {
        store = *std::move(s);
        device = Device::Cuda(*gpu);
        comm = MakeNcclCommunicator(*info, *store, device.index);
      } else {
        comm = s.status();
      }
    } else {
      comm = MakeUcxCommunicatorFromEnv();
    }
    if (!comm.ok()) {
      std::fprintf(stderr, "gpt_train: %s\n", comm.status().ToString().c_str());
      return 1;
    }
    absl::Status s = TrainRank(**comm, f, device);
    if (!s.ok()) std::fprintf(stderr, "gpt_train rank %d: %s\n", (*comm)->rank(), s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  // Thread ranks share one process: one rank may run on cuda:0; several run on the CPU ("auto"
  // picks the CPU for them; NCCL wants one process per GPU).
  const bool use_cuda = f.device == "cuda" || (f.device == "auto" && gpus && f.ranks == 1);
  if (use_cuda && f.ranks > 1) {
    std::fprintf(stderr,
                 "gpt_train: thread ranks run on the CPU; for GPUs start one process per GPU with dtrun "
                 "(or pass --device cpu)\n");
    return 1;
  }
  // N ranks as threads of this process; one OpenMP team per rank, sharing the cores.
  auto comms = MakeThreadGroup(f.ranks);
  if (!comms.ok()) {
    std::fprintf(stderr, "gpt_train: %s\n", comms.status().ToString().c_str());
    return 1;
  }
  std::vector<absl::Status> status(static_cast<size_t>(f.ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < f.ranks; ++r) {
    threads.emplace_back([&, r] {
      gpt::SetRankThreads(cores / f.ranks);
      status[static_cast<size_t>(r)] =
          TrainRank(*(*comms)[static_cast<size_t>(r)], f, use_cuda ? Device::Cuda(0) : Device::Cpu());
    });
  }
  for (auto& t : threads) t.join();
  int rc = 0;
  for (int r = 0; r < f.ranks; ++r) {
    if (!status[static_cast<size_t>(r)].ok()) {
      std::fprintf(stderr, "gpt_train rank %d: %s\n", r, status[static_cast<size_t>(r)].ToString().c_str());
      rc = 1;
    }
  }
  return rc;
}
