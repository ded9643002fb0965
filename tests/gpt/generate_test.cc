// gpt::Generate: greedy with the KV cache is token-identical to a greedy loop written here on
// GPT::Forward over the whole context (argmax of the last row), for prompts of 1 and several
// tokens; seeded sampling too; tensor parallel over 2 and 4 thread ranks gives one rank's
// tokens on every rank. Too long a request is OutOfRange before any forward. gpt_generate
// (the binary) prints the same ids on 1 rank and on 2 tensor-parallel ranks from an llm.c
// checkpoint, and refuses bad flags naming them.
#include "examples/gpt/generate.h"

#include <algorithm>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/parallel/gpt_plan.h"
#include "dtensor/nn/safetensors.h"
#include "dtensor/ops/ops.h"
#include "examples/gpt/llmc.h"
#include "examples/gpt/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/testing/run_process.h"
#include "tests/testing/test_util.h"

namespace dtensor {
namespace {

using testing::Unwrap;

nn::GPTConfig Config() { return {.vocab_size = 67, .block_size = 40, .n_layer = 2, .n_head = 4, .n_embd = 32}; }

// Weights uniform in [-0.3, 0.3) (LayerNorms at 1 and 0): GPT-2's init (std 0.02) makes so
// flat a model that greedy decoding repeats one token, which would make a weak check.
std::unique_ptr<nn::GPT> Model() {
  auto model = Unwrap(nn::GPT::Create(Config()));
  std::vector<std::pair<std::string, Tensor>> state = Unwrap(model->StateDict());
  uint64_t seed = 100;
  for (auto& [name, t] : state) {
    if (name.find("ln_") == std::string::npos) t = testing::Random(t.shape(), DType::kFloat32, ++seed, -0.3, 0.3);
  }
  EXPECT_TRUE(model->LoadStateDict(state).ok());
  return model;
}

// The reference: whole context through Forward each step, argmax of the last position.
std::vector<int64_t> GreedyByRecompute(nn::GPT& model, std::vector<int64_t> context, int64_t n) {
  NoGradGuard no_grad;
  model.Eval();
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = static_cast<int64_t>(context.size());
    Tensor ids = Unwrap(Tensor::FromVector<int64_t>(context, {1, t}));
    nn::GPT::Output o = Unwrap(model.Forward(Variable::Constant(ids)));
    const std::vector<double> all = testing::Values(o.logits.value().local());
    const auto row = all.end() - Config().vocab_size;
    const int64_t next = std::max_element(row, all.end()) - row;
    out.push_back(next);
    context.push_back(next);
  }
  model.Train();
  return out;
}

std::vector<int64_t> Gen(nn::GPT& model, const std::vector<int64_t>& prompt, int64_t n, const gpt::SamplerOptions& so,
                         bool cache) {
  gpt::Sampler s = Unwrap(gpt::Sampler::Create(so));
  gpt::GenerateResult r = Unwrap(gpt::Generate(model, prompt, s, {.max_new_tokens = n, .use_cache = cache}));
  EXPECT_EQ(static_cast<int64_t>(r.tokens.size()), n);
  return r.tokens;
}

TEST(GenerateTest, GreedyWithCacheEqualsGreedyByFullRecompute) {
  auto model = Model();
  for (const std::vector<int64_t>& prompt : std::vector<std::vector<int64_t>>{{7}, {3, 14, 15, 9, 26, 5}}) {
    const int64_t n = 24;
    const std::vector<int64_t> want = GreedyByRecompute(*model, prompt, n);
    EXPECT_EQ(Gen(*model, prompt, n, {.temperature = 0}, /*cache=*/true), want) << "prompt " << prompt.size();
    EXPECT_EQ(Gen(*model, prompt, n, {.temperature = 0}, /*cache=*/false), want) << "prompt " << prompt.size();
    // Not a constant stream (the check would be weak).
    std::vector<int64_t> d = want;
    std::sort(d.begin(), d.end());
    EXPECT_GT(std::unique(d.begin(), d.end()) - d.begin(), 3);
  }
  EXPECT_TRUE(model->training());  // restored
}

TEST(GenerateTest, SeededSamplingWithCacheEqualsRecompute) {
  auto model = Model();
  const gpt::SamplerOptions so{.temperature = 1.0, .top_k = 20, .top_p = 0.9, .seed = 11};
  const std::vector<int64_t> prompt = {1, 2, 3};
  const std::vector<int64_t> cached = Gen(*model, prompt, 30, so, true);
  EXPECT_EQ(cached, Gen(*model, prompt, 30, so, false));
  EXPECT_EQ(cached, Gen(*model, prompt, 30, so, true));
}

TEST(GenerateTest, TensorParallelRanksPickOneRanksTokens) {
  const std::vector<int64_t> prompt = {5, 8, 13, 21};
  auto one = Model();
  const gpt::SamplerOptions greedy{.temperature = 0}, sampled{.temperature = 0.8, .top_k = 30, .seed = 4};
  const std::vector<int64_t> want_greedy = Gen(*one, prompt, 20, greedy, true);
  const std::vector<int64_t> want_sampled = Gen(*one, prompt, 20, sampled, true);
  for (int tp : {2, 4}) {
    auto comms = Unwrap(MakeThreadGroup(tp, absl::Seconds(60)));
    std::vector<std::vector<int64_t>> got_greedy(static_cast<size_t>(tp)), got_sampled(static_cast<size_t>(tp));
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r) {
      threads.emplace_back([&, r] {
        DeviceMesh mesh = Unwrap(DeviceMesh::Create(*comms[static_cast<size_t>(r)], {tp}, {"tp"}));
        auto model = Model();
        absl::Status s = nn::ParallelizeModule(*model, mesh, nn::GptTensorParallelPlan(false), "tp");
        ASSERT_TRUE(s.ok()) << s;
        got_greedy[static_cast<size_t>(r)] = Gen(*model, prompt, 20, greedy, true);
        got_sampled[static_cast<size_t>(r)] = Gen(*model, prompt, 20, sampled, true);
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < tp; ++r) {
      EXPECT_EQ(got_greedy[static_cast<size_t>(r)], want_greedy) << "TP " << tp << " rank " << r;
      EXPECT_EQ(got_sampled[static_cast<size_t>(r)], want_sampled) << "TP " << tp << " rank " << r;
    }
  }
}

TEST(GenerateTest, RequestsPastTheBlockAreOutOfRange) {
  auto model = Model();
  gpt::Sampler s = Unwrap(gpt::Sampler::Create({.temperature = 0}));
  std::vector<int64_t> prompt(30, 1);
  // 30 + 11 - 1 = 40 positions fit; 30 + 12 - 1 = 41 do not.
  EXPECT_TRUE(gpt::Generate(*model, prompt, s, {.max_new_tokens = 11}).ok());
  absl::StatusOr<gpt::GenerateResult> r = gpt::Generate(*model, prompt, s, {.max_new_tokens = 12});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange) << r.status();
  EXPECT_NE(r.status().message().find("40 positions of block_size (at most 11 new tokens fit)"), std::string::npos)
      << r.status();
  // A count near INT64_MAX is refused up front too (the sum once wrapped and passed the check).
  r = gpt::Generate(*model, prompt, s, {.max_new_tokens = std::numeric_limits<int64_t>::max()});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange) << r.status();
  EXPECT_EQ(gpt::Generate(*model, std::vector<int64_t>(41, 1), s, {}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(gpt::Generate(*model, {}, s, {}).status().code(), absl::StatusCode::kInvalidArgument);
  // A negative vocab_limit is refused (it meant "no limit" silently).
  r = gpt::Generate(*model, prompt, s, {.max_new_tokens = 1, .vocab_limit = -1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
}

// A stop token the sampler cannot pick (outside the vocabulary, or past vocab_limit) is refused:
// it would silently never stop. -1 (never) and the last pickable id are accepted.
TEST(GenerateTest, StopTokensOutsideWhatCanBePickedAreRefused) {
  auto model = Model();
  const int64_t v = Config().vocab_size;
  gpt::Sampler s = Unwrap(gpt::Sampler::Create({.temperature = 0}));
  const std::vector<int64_t> prompt = {1, 2};
  for (int64_t stop : {int64_t{-1}, v - 1}) {
    EXPECT_TRUE(gpt::Generate(*model, prompt, s, {.max_new_tokens = 2, .stop_token = stop}).ok()) << stop;
  }
  EXPECT_TRUE(gpt::Generate(*model, prompt, s, {.max_new_tokens = 2, .stop_token = 9, .vocab_limit = 10}).ok());
  for (auto [stop, limit] : {std::pair<int64_t, int64_t>{v, 0}, {-2, 0}, {10, 10}}) {
    absl::StatusOr<gpt::GenerateResult> r =
        gpt::Generate(*model, prompt, s, {.max_new_tokens = 2, .stop_token = stop, .vocab_limit = limit});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << stop << " " << limit << ": " << r.status();
    EXPECT_NE(r.status().message().find(absl::StrCat("stop_token ", stop, " is not an id the model can pick (0..",
                                                     (limit > 0 ? limit : v) - 1)),
              std::string::npos)
        << r.status();
  }
}

#ifdef GPT_GENERATE_PATH
// The binary: an llm.c checkpoint of this model, greedy on 1 and 2 ranks, and the ids printed
// equal Generate's.
TEST(GenerateTest, BinaryPrintsTheSameIdsOnOneAndTwoRanks) {
  testing::ScopedTempDir dir("gen");
  auto model = Model();
  auto state = Unwrap(model->StateDict());
  const nn::GPTConfig c = Config();
  ASSERT_TRUE(gpt::WriteLlmcCheckpoint(dir.Path("m.bin"),
                                       {.max_seq_len = static_cast<int>(c.block_size),
                                        .vocab_size = static_cast<int>(c.vocab_size),
                                        .num_layers = static_cast<int>(c.n_layer),
                                        .num_heads = static_cast<int>(c.n_head),
                                        .channels = static_cast<int>(c.n_embd)},
                                       state)
                  .ok());
  const std::vector<int64_t> want = Gen(*model, {5, 8, 13}, 16, {.temperature = 0}, true);
  const std::string want_line = "ids: " + absl::StrJoin(want, " ");
  for (const char* ranks : {"1", "2"}) {
    testing::ProcessRun run =
        testing::RunProcess({GPT_GENERATE_PATH, "--llmc", dir.Path("m.bin"), "--prompt-ids", "5 8 13",
                             "--max-new-tokens", "16", "--temperature", "0", "--ranks", ranks},
                            {.timeout = absl::Seconds(120)});
    EXPECT_EQ(run.code, 0) << run.err;
    EXPECT_NE(run.out.find(want_line), std::string::npos) << "ranks " << ranks << ":\n" << run.out;
    EXPECT_NE(run.out.find("tokens/s"), std::string::npos) << run.out;
  }
  testing::ProcessRun bad = testing::RunProcess(
      {GPT_GENERATE_PATH, "--llmc", dir.Path("m.bin"), "--prompt-ids", "5 8 999", "--max-new-tokens", "4"});
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("'999'"), std::string::npos) << bad.err;
  bad = testing::RunProcess({GPT_GENERATE_PATH, "--llmc", dir.Path("m.bin"), "--prompt-ids", "5", "--top-p", "1.5"});
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("top_p"), std::string::npos) << bad.err;
}

// Hugging Face weights end to end: the binary's greedy continuation of the golden prompt (KV
// cache, 1 rank and tensor-parallel over 2 and 4) is the independent PyTorch forward's
// (tests/golden/hf_gpt2_tiny, recomputing the context each step).
TEST(GenerateTest, BinaryContinuesLikePyTorchOnHuggingFaceWeights) {
  const std::string hf = std::string(DTENSOR_GOLDEN_DIR) + "/hf_gpt2_tiny";
  NamedTensors golden = Unwrap(ReadSafetensors(hf + "/golden.safetensors"));
  ASSERT_NE(golden.Find("prompt"), nullptr);
  ASSERT_NE(golden.Find("greedy"), nullptr);
  const std::vector<int64_t> prompt = Unwrap(golden.Find("prompt")->ToVector<int64_t>());
  const std::vector<int64_t> greedy = Unwrap(golden.Find("greedy")->ToVector<int64_t>());
  for (const char* ranks : {"1", "2", "4"}) {
    testing::ProcessRun run = testing::RunProcess(
        {GPT_GENERATE_PATH, "--hf", hf + "/model.safetensors", "--prompt-ids", absl::StrJoin(prompt, " "),
         "--max-new-tokens", absl::StrCat(greedy.size()), "--temperature", "0", "--ranks", ranks},
        {.timeout = absl::Seconds(120)});
    EXPECT_EQ(run.code, 0) << run.err;
    EXPECT_NE(run.out.find("ids: " + absl::StrJoin(greedy, " ") + "\n"), std::string::npos)
        << "ranks " << ranks << ":\n"
        << run.out;
  }
}

// Text in and out through GPT-2's tokenizer: a checkpoint of a model trained by gpt_train on
// GPT-2 tokens (vocabulary padded to 50304; 2 heads, which the checkpoint records) continues a
// text prompt; the printed text starts with the prompt and decodes the printed ids (checked
// with the tokenizer here).
TEST(GenerateTest, BinaryTakesAndPrintsTextThroughGpt2Tokenizer) {
  absl::StatusOr<gpt::Gpt2Tokenizer> tok = gpt::Gpt2Tokenizer::Load(gpt::Gpt2Tokenizer::DefaultDir());
  if (!tok.ok()) GTEST_SKIP() << "GPT-2's encoder files are not installed (scripts/setup.sh): " << tok.status();
  testing::ScopedTempDir dir("gen_text");
  std::string text;
  for (int i = 0; i < 30; ++i) text += "The quick brown fox jumps over the lazy dog. ";
  testing::WriteBytes(dir.Path("corpus.txt"), text);
  testing::ProcessRun train = testing::RunProcess({GPT_TRAIN_PATH,
                                                   "--text",
                                                   dir.Path("corpus.txt"),
                                                   "--tokenizer",
                                                   "gpt2",
                                                   "--n-layer",
                                                   "1",
                                                   "--n-head",
                                                   "2",
                                                   "--n-embd",
                                                   "16",
                                                   "--seq",
                                                   "16",
                                                   "--batch",
                                                   "2",
                                                   "--steps",
                                                   "2",
                                                   "--sample-tokens",
                                                   "0",
                                                   "--ckpt-dir",
                                                   dir.Path("ckpt"),
                                                   "--ckpt-every",
                                                   "2"},
                                                  {.timeout = absl::Seconds(120), .merge_output = true});
  ASSERT_EQ(train.code, 0) << train.out;
  const std::string prompt = "The quick brown";
  testing::ProcessRun run = testing::RunProcess({GPT_GENERATE_PATH, "--ckpt-dir", dir.Path("ckpt"), "--prompt", prompt,
                                                 "--max-new-tokens", "6", "--temperature", "0"},
                                                {.timeout = absl::Seconds(120)});
  ASSERT_EQ(run.code, 0) << run.err;
  const size_t ids_at = run.out.find("ids: "), text_at = run.out.find("text: ");
  ASSERT_NE(ids_at, std::string::npos) << run.out;
  ASSERT_NE(text_at, std::string::npos) << run.out;
  std::vector<int32_t> all = tok->Encode(prompt);
  for (absl::string_view w :
       absl::StrSplit(run.out.substr(ids_at + 5, run.out.find('\n', ids_at) - ids_at - 5), ' ', absl::SkipEmpty())) {
    int32_t id = 0;
    ASSERT_TRUE(absl::SimpleAtoi(w, &id)) << w;
    EXPECT_LT(id, tok->vocab_size());  // never a padding row
    all.push_back(id);
  }
  const std::string decoded = Unwrap(tok->Decode(all));
  EXPECT_EQ(run.out.substr(text_at + 6, decoded.size()), decoded) << run.out;
  EXPECT_EQ(decoded.rfind(prompt, 0), 0u);
  // A prompt id in the padding (50257 <= id < 50304) is refused before generating, naming the
  // tokenizer's vocabulary (it generated, then failed to decode); 50256 is a token.
  run = testing::RunProcess({GPT_GENERATE_PATH, "--ckpt-dir", dir.Path("ckpt"), "--prompt-ids", "50300 11",
                             "--max-new-tokens", "2", "--temperature", "0"},
                            {.timeout = absl::Seconds(120), .merge_output = true});
  EXPECT_NE(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("'50300' is not a token id below the vocabulary size 50257"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("text: "), std::string::npos) << run.out;  // nothing generated
  run = testing::RunProcess({GPT_GENERATE_PATH, "--ckpt-dir", dir.Path("ckpt"), "--prompt-ids", "50256 11",
                             "--max-new-tokens", "2", "--temperature", "0"},
                            {.timeout = absl::Seconds(120), .merge_output = true});
  EXPECT_EQ(run.code, 0) << run.out;
}
#endif

}  // namespace
}  // namespace dtensor
