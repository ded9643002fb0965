// gpt_generate: continues a prompt with a GPT-2-style model, token by token, with a KV cache;
// on one rank or tensor-parallel over N thread ranks (heads split over them; the same tokens).
//
//   gpt_generate --hf gpt2/model.safetensors --prompt "The meaning of life is" --temperature 0
//   gpt_generate --llmc gpt2_124M.bin --prompt-ids "15496 11 314 716" --max-new-tokens 64
//   gpt_generate --ckpt-dir ckpt --prompt "Q: Why" --temperature 0.8 --top-k 40 --seed 7
//   gpt_generate --llmc gpt2_124M.bin --prompt "Hello," --ranks 2 --tp 2 --top-p 0.9
//
// Reads top to bottom: the weights (a Hugging Face GPT-2 safetensors with its config.json, an
// llm.c checkpoint, or the newest checkpoint a gpt_train run wrote under --ckpt-dir), the
// prompt (text through GPT-2's tokenizer for a GPT-2 vocabulary, bytes for vocab 256, or ids),
// then per rank: the mesh, the GPT, its tensor-parallel plan, the weights into it, and Generate
// (examples/gpt/generate.h): the prompt in one forward that fills the KV cache, then one
// position per new token, each picked by a Sampler (sampler.h) from the gathered logits with
// the same seed on every rank (never a row padding GPT-2's vocabulary). Rank 0 prints the ids,
// the text and tokens/s.
//
// Flags are Abseil flags (--help lists them); they are written with dashes as above or with
// underscores as Abseil names them (--max_new_tokens). A checkpoint directory holds tensors,
// not the architecture: the vocabulary, width, layers and block size are read from the tensor
// shapes in its metadata.json, the number of heads from what gpt_train records (or --n-head).
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/collectives/store/cpus.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/kernels/cpu/blas_core.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/parallel/gpt_plan.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "examples/gpt/ckpt_export.h"
#include "examples/gpt/flags.h"
#include "examples/gpt/generate.h"
#include "examples/gpt/hf_gpt2.h"
#include "examples/gpt/llmc.h"
#include "examples/gpt/sampler.h"
#include "examples/gpt/tokenizer.h"

ABSL_FLAG(std::string, llmc, "", "weights: an llm.c GPT-2 checkpoint (.bin, version 3 or 5)");
ABSL_FLAG(std::string, ckpt_dir, "", "weights: the newest complete checkpoint under this directory (gpt_train)");
ABSL_FLAG(std::string, hf, "", "weights: a Hugging Face GPT-2 model.safetensors (config.json beside it)");
ABSL_FLAG(int64_t, n_head, 0, "heads, for --ckpt-dir (0: as gpt_train recorded, or a matching preset)");
ABSL_FLAG(std::string, prompt_ids, "", "the prompt as token ids, e.g. \"15496 11 314\"");
ABSL_FLAG(std::string, prompt, "", "the prompt as text (through --tokenizer)");
ABSL_FLAG(std::string, tokenizer, "auto",
          "text <-> ids: byte (vocab 256), gpt2 (GPT-2's BPE), auto (gpt2 for a vocabulary of 50257 or more, byte for "
          "256)");
ABSL_FLAG(std::string, bpe_dir, "", "directory of GPT-2's encoder.json and vocab.bpe (default: setup's copy)");
ABSL_FLAG(int64_t, max_new_tokens, 64, "tokens to generate");
ABSL_FLAG(double, temperature, 1.0, "softmax temperature; 0 is greedy");
ABSL_FLAG(int64_t, top_k, 0, "keep the k most likely tokens (0: all)");
ABSL_FLAG(double, top_p, 1.0, "keep the smallest set of most likely tokens holding this probability, in (0, 1]");
ABSL_FLAG(uint64_t, seed, 1337, "sampling seed (the same tokens for the same seed on every rank and run)");
ABSL_FLAG(int64_t, stop_token, -1, "stop after this token (-1: never)");
ABSL_FLAG(bool, cache, true, "use the KV cache (false: recompute the whole context for every token)");
ABSL_FLAG(int, ranks, 1, "ranks, as threads of this process");
ABSL_FLAG(int, tp, 0, "tensor-parallel degree (0: --ranks); must equal --ranks");
ABSL_FLAG(bool, sequence_parallel, false, "tensor parallel with sequence parallel (the training default)");
ABSL_FLAG(std::string, device, "cpu", "cpu, or cuda (one rank)");

namespace dtensor {
namespace {

struct Setup {
  nn::GPTConfig config;
  std::vector<int64_t> prompt;
  // --llmc, --hf: the parameters, read once and shared by the ranks.
  std::vector<std::pair<std::string, Tensor>> params;
  std::string ckpt;  // --ckpt-dir: the checkpoint directory picked
  bool byte_level = false;
  std::optional<gpt::Gpt2Tokenizer> tokenizer;  // GPT-2 text (rank 0 decodes the output)
};

absl::StatusOr<Setup> Prepare() {
  Setup s;
  const std::string llmc = absl::GetFlag(FLAGS_llmc), ckpt_dir = absl::GetFlag(FLAGS_ckpt_dir),
                    hf = absl::GetFlag(FLAGS_hf);
  if (llmc.empty() + ckpt_dir.empty() + hf.empty() != 2) {
    return absl::InvalidArgumentError("[gpt_generate] give exactly one of --llmc, --ckpt-dir and --hf");
  }
  if (!llmc.empty()) {
    DT_ASSIGN_OR_RETURN(gpt::LlmcCheckpoint file, gpt::ReadLlmcCheckpoint(llmc));
    s.config = {.vocab_size = file.config.vocab_size,
                .block_size = file.config.max_seq_len,
                .n_layer = file.config.num_layers,
                .n_head = file.config.num_heads,
                .n_embd = file.config.channels};
    s.params = std::move(file.params);
  } else if (!ckpt_dir.empty()) {
    DT_ASSIGN_OR_RETURN(s.ckpt, LatestCheckpoint(ckpt_dir));
    DT_ASSIGN_OR_RETURN(s.config, gpt::GptConfigOfCheckpoint(s.ckpt, absl::GetFlag(FLAGS_n_head)));
  } else {  // Hugging Face: config.json and the safetensors, transposed to our layout
    DT_ASSIGN_OR_RETURN(gpt::HfGpt2 file, gpt::ReadHfGpt2(hf));
    s.config = file.config;
    s.params = std::move(file.params);
  }
  // Text <-> ids: GPT-2's BPE for a GPT-2 vocabulary (50257, or padded), bytes for vocab 256.
  std::string tok = absl::GetFlag(FLAGS_tokenizer);
  if (tok == "auto") tok = s.config.vocab_size >= gpt::Gpt2Tokenizer::kGpt2VocabSize ? "gpt2" : "byte";
  if (tok == "gpt2") {
    if (s.config.vocab_size < gpt::Gpt2Tokenizer::kGpt2VocabSize) {
      return absl::InvalidArgumentError(absl::StrCat("[gpt_generate] --tokenizer gpt2 needs a vocabulary of at least ",
                                                     gpt::Gpt2Tokenizer::kGpt2VocabSize, ", the model has ",
                                                     s.config.vocab_size));
    }
    const std::string dir = absl::GetFlag(FLAGS_bpe_dir);
    DT_ASSIGN_OR_RETURN(s.tokenizer, gpt::Gpt2Tokenizer::Load(dir.empty() ? gpt::Gpt2Tokenizer::DefaultDir() : dir));
  } else if (tok != "byte") {
    return absl::InvalidArgumentError(absl::StrCat("[gpt_generate] --tokenizer ", tok, ": byte|gpt2|auto"));
  }
  const std::string ids = absl::GetFlag(FLAGS_prompt_ids), text = absl::GetFlag(FLAGS_prompt);
  if (ids.empty() == text.empty())
    return absl::InvalidArgumentError("[gpt_generate] give one of --prompt-ids and --prompt");
  s.byte_level = s.config.vocab_size == 256;
  if (!ids.empty()) {
    // Below the tokenizer's vocabulary where one decodes the text (GPT-2's 50257, not the
    // model's padded 50304: a padding id would generate, then fail to decode).
    const int64_t limit =
        s.tokenizer ? std::min<int64_t>(s.config.vocab_size, s.tokenizer->vocab_size()) : s.config.vocab_size;
    for (absl::string_view w : absl::StrSplit(ids, absl::ByAnyChar(" ,\t\n"), absl::SkipEmpty())) {
      int64_t id = 0;
      if (!absl::SimpleAtoi(w, &id) || id < 0 || id >= limit) {
        return absl::InvalidArgumentError(
            absl::StrCat("[gpt_generate] --prompt-ids: '", w, "' is not a token id below the vocabulary size ", limit));
      }
      s.prompt.push_back(id);
    }
  } else if (s.tokenizer) {
    for (int32_t id : s.tokenizer->Encode(text)) s.prompt.push_back(id);
  } else {
    if (!s.byte_level) {
      return absl::InvalidArgumentError(
          absl::StrCat("[gpt_generate] --prompt as bytes needs a byte-level model (vocab 256); "
                       "this model's vocabulary is ",
                       s.config.vocab_size, ": give --prompt-ids or --tokenizer gpt2"));
    }
    for (unsigned char ch : text) s.prompt.push_back(ch);
  }
  if (s.prompt.empty()) return absl::InvalidArgumentError("[gpt_generate] the prompt is empty");
  return s;
}

std::string Text(const std::vector<int64_t>& ids) {
  std::string out;
  for (int64_t id : ids) out.push_back(static_cast<char>(id));
  return out;
}

// One rank: the mesh, the model, its weights, the generation.
absl::Status GenerateRank(Communicator& world, const Setup& s, Device device) {
  const bool lead = world.rank() == 0;
  DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> model, nn::GPT::Create(s.config));
  if (!s.params.empty()) DT_RETURN_IF_ERROR(model->LoadStateDict(s.params));
  DT_RETURN_IF_ERROR(model->To(device));
  // Tensor parallel over every rank: each holds its heads' q, k, v (and KV cache), its columns
  // of c_fc, its rows of the c_proj's, its rows of the vocabulary.
  DeviceMesh mesh;
  if (world.size() > 1) {
    if (s.config.n_head % world.size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat("[gpt_generate] ", s.config.n_head, " heads do not divide over ",
                                                     world.size(), " tensor-parallel ranks"));
    }
    DT_ASSIGN_OR_RETURN(mesh, DeviceMesh::Create(world, {world.size()}, {"tp"}));
    DT_RETURN_IF_ERROR(
        nn::ParallelizeModule(*model, mesh, nn::GptTensorParallelPlan(absl::GetFlag(FLAGS_sequence_parallel)), "tp"));
  }
  if (!s.ckpt.empty()) {  // each rank reads the pieces of its own layout
    CheckpointState state;
    for (auto& [name, p] : model->NamedParameters()) {
      const Value& v = p->value();
      const Shape registered = model->RegisteredShapeOf(*p);
      std::vector<int64_t> stored;
      if (registered != IntSpan(v.shape())) stored.assign(registered.begin(), registered.end());
      state.push_back({"model." + name, v.is_dtensor() ? StateTensor(v.dtensor()) : StateTensor(v.local()), stored});
    }
    DT_RETURN_IF_ERROR(LoadCheckpoint(s.ckpt, state));
  }
  if (lead) {
    std::printf(
        "gpt_generate: %d rank(s)%s on %s, %lld parameters, %lld layers, %lld heads, C=%lld, V=%lld, "
        "block %lld; prompt %zu tokens\n",
        world.size(), world.size() > 1 ? " tensor-parallel" : "", device.ToString().c_str(),
        static_cast<long long>(model->NumParameters()), static_cast<long long>(s.config.n_layer),
        static_cast<long long>(s.config.n_head), static_cast<long long>(s.config.n_embd),
        static_cast<long long>(s.config.vocab_size), static_cast<long long>(s.config.block_size), s.prompt.size());
  }
  DT_ASSIGN_OR_RETURN(gpt::Sampler sampler, gpt::Sampler::Create({.temperature = absl::GetFlag(FLAGS_temperature),
                                                                  .top_k = absl::GetFlag(FLAGS_top_k),
                                                                  .top_p = absl::GetFlag(FLAGS_top_p),
                                                                  .seed = absl::GetFlag(FLAGS_seed)}));
  DT_ASSIGN_OR_RETURN(gpt::GenerateResult out,
                      gpt::Generate(*model, s.prompt, sampler,
                                    {.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens),
                                     .use_cache = absl::GetFlag(FLAGS_cache),
                                     .stop_token = absl::GetFlag(FLAGS_stop_token),
                                     .device = device,
                                     .vocab_limit = s.tokenizer ? s.tokenizer->vocab_size() : 0}));
  if (lead) {
    std::printf("ids: %s\n", absl::StrJoin(out.tokens, " ").c_str());
    if (s.tokenizer) {
      std::vector<int32_t> all(s.prompt.begin(), s.prompt.end());
      all.insert(all.end(), out.tokens.begin(), out.tokens.end());
      DT_ASSIGN_OR_RETURN(std::string decoded, s.tokenizer->Decode(all));
      std::printf("text: %s\n", decoded.c_str());
    } else if (s.byte_level) {
      std::printf("text: %s%s\n", Text(s.prompt).c_str(), Text(out.tokens).c_str());
    }
    const double n = static_cast<double>(out.tokens.size());
    std::printf(
        "prefill %zu tokens + first pick: %.1f ms; %lld more tokens: %.1f ms (%.2f ms/token, %.1f tokens/s, "
        "%s)\n",
        s.prompt.size(), out.prefill_s * 1e3, static_cast<long long>(n - 1), out.decode_s * 1e3,
        n > 1 ? out.decode_s * 1e3 / (n - 1) : 0.0, n > 1 && out.decode_s > 0 ? (n - 1) / out.decode_s : 0.0,
        absl::GetFlag(FLAGS_cache) ? "KV cache" : "recompute");
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  using namespace dtensor;
  if (absl::Status blas = ReexecWithFasterBlasCore(argv); !blas.ok()) {  // as gpt_train
    std::fprintf(stderr, "gpt_generate: %s\n", blas.ToString().c_str());
  }
  absl::SetProgramUsageMessage("continues a prompt with a GPT (KV cache; tensor parallel over --ranks threads)");
  std::vector<std::string> storage;
  std::vector<char*> args = gpt::AbslStyleArgs(argc, argv, storage);
  const std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (rest.size() > 1) {
    std::fprintf(stderr, "gpt_generate: unexpected argument '%s' (see --help)\n", rest[1]);
    return 2;
  }
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int tp = absl::GetFlag(FLAGS_tp) == 0 ? ranks : absl::GetFlag(FLAGS_tp);
  const std::string dev = absl::GetFlag(FLAGS_device);
  if (ranks < 1 || tp != ranks || (dev != "cpu" && dev != "cuda") || (dev == "cuda" && ranks > 1)) {
    std::fprintf(stderr,
                 "gpt_generate: --ranks must be >= 1 and --tp equal to it (generation is tensor parallel only); "
                 "--device cpu|cuda (cuda: one rank); got --ranks %d --tp %d --device %s\n",
                 ranks, tp, dev.c_str());
    return 2;
  }
  absl::StatusOr<Setup> setup = Prepare();
  if (!setup.ok()) {
    std::fprintf(stderr, "gpt_generate: %s\n", setup.status().ToString().c_str());
    return 2;
  }
  auto comms = MakeThreadGroup(ranks);
  if (!comms.ok()) {
    std::fprintf(stderr, "gpt_generate: %s\n", comms.status().ToString().c_str());
    return 1;
  }
  const int cores = std::max<int>(1, static_cast<int>(AllowedCpus().size()));
  std::vector<absl::Status> status(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      gpt::SetRankThreads(cores / ranks);
      status[static_cast<size_t>(r)] =
          GenerateRank(*(*comms)[static_cast<size_t>(r)], *setup, dev == "cuda" ? Device::Cuda(0) : Device::Cpu());
    });
  }
  for (auto& t : threads) t.join();
  int rc = 0;
  for (int r = 0; r < ranks; ++r) {
    if (!status[static_cast<size_t>(r)].ok()) {
      std::fprintf(stderr, "gpt_generate rank %d: %s\n", r, status[static_cast<size_t>(r)].ToString().c_str());
      rc = 1;
    }
  }
  return rc;
}
