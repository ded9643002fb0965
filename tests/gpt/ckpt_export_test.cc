// Exports of distributed checkpoints (examples/gpt/ckpt_export.h, the gpt_export tool): the
// trainer saves a checkpoint under FSDP, TP and FSDP x TP and also writes its final parameters
// whole (--save-final, gathered by StateDict); exporting the checkpoint tensor by tensor must
// give exactly those tensors, in Hugging Face's layout and in llm.c's.
#include "examples/gpt/ckpt_export.h"

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/nn/safetensors.h"
#include "examples/gpt/hf_gpt2.h"
#include "examples/gpt/llmc.h"
#include "gtest/gtest.h"
#include "tests/testing/run_process.h"
#include "tests/testing/test_util.h"

namespace dtensor::gpt {
namespace {

using testing::Unwrap;

class CkptExportTest : public ::testing::Test {
 protected:
  // Trains the 2-layer model for 2 steps with `flags`, checkpointing at step 2 into
  // <tag>/ckpt and writing the final parameters to <tag>.safetensors; the checkpoint's path.
  std::string Train(const std::string& flags, const std::string& tag) {
    std::string text;
    for (int i = 0; i < 20; ++i)
      text += "It was the best of times, it was the worst of times, it was the age of wisdom.\n";
    testing::WriteBytes(dir_.Path("corpus.txt"), text);
    std::vector<std::string> argv = {GPT_TRAIN_PATH};
    const std::string all = "--text " + dir_.Path("corpus.txt") +
                            " --n-layer 2 --n-head 2 --n-embd 32 --seq 16 --batch 4 --steps 2 --sample-tokens 0"
                            " --device cpu --ckpt-every 2 --ckpt-dir " +
                            dir_.Path(tag + "-ckpt") + " --save-final " + dir_.Path(tag + ".safetensors") + " " + flags;
    for (const auto& w : absl::StrSplit(all, ' ', absl::SkipEmpty())) argv.emplace_back(w);
    testing::ProcessOptions options;
    options.merge_output = true;
    options.timeout = absl::Minutes(5);
    const testing::ProcessRun run = testing::RunProcess(argv, options);
    EXPECT_EQ(run.code, 0) << flags << ":\n" << run.out;
    return Unwrap(LatestCheckpoint(dir_.Path(tag + "-ckpt")));
  }

  void ExpectExportsEqualFinal(const std::string& flags, const std::string& tag) {
    SCOPED_TRACE(flags);
    const std::string ckpt = Train(flags, tag);
    const NamedTensors final_params = Unwrap(ReadSafetensors(dir_.Path(tag + ".safetensors")));
    const nn::GPTConfig config = Unwrap(GptConfigOfCheckpoint(ckpt, /*n_head=*/2));
    EXPECT_EQ(config.n_layer, 2);
    EXPECT_EQ(config.n_embd, 32);
    EXPECT_EQ(config.block_size, 16);

    // Hugging Face: read back (transposed to our layout again) equals the final state dict.
    ASSERT_TRUE(ExportCheckpointToHf(ckpt, config, dir_.Path(tag + "-hf")).ok());
    const HfGpt2 hf = Unwrap(ReadHfGpt2(dir_.Path(tag + "-hf")));
    ASSERT_EQ(hf.params.size(), final_params.tensors.size());
    for (const auto& [name, t] : hf.params) {
      const Tensor* want = final_params.Find(name);
      ASSERT_NE(want, nullptr) << name;
      EXPECT_EQ(Unwrap(t.ToVector<float>()), Unwrap(want->ToVector<float>())) << name;
    }
    // The same bytes as WriteHfGpt2 of the gathered state.
    ASSERT_TRUE(WriteHfGpt2(dir_.Path(tag + "-hf-ref"), config, final_params.tensors).ok());
    EXPECT_EQ(testing::ReadBytes(dir_.Path(tag + "-hf/model.safetensors")),
              testing::ReadBytes(dir_.Path(tag + "-hf-ref/model.safetensors")));

    // llm.c: byte-identical to WriteLlmcCheckpoint of the gathered state.
    ASSERT_TRUE(ExportCheckpointToLlmc(ckpt, config, dir_.Path(tag + ".bin")).ok());
    LlmcConfig lc;
    lc.max_seq_len = 16;
    lc.vocab_size = static_cast<int>(config.vocab_size);
    lc.num_layers = 2;
    lc.num_heads = 2;
    lc.channels = 32;
    ASSERT_TRUE(WriteLlmcCheckpoint(dir_.Path(tag + "-ref.bin"), lc, final_params.tensors).ok());
    const std::string got = testing::ReadBytes(dir_.Path(tag + ".bin"));
    EXPECT_FALSE(got.empty());
    EXPECT_TRUE(got == testing::ReadBytes(dir_.Path(tag + "-ref.bin")));
  }

  testing::ScopedTempDir dir_{"ckpt_export"};
};

TEST_F(CkptExportTest, FsdpCheckpointExportsTheFullStateDict) { ExpectExportsEqualFinal("--ranks 2", "f2"); }

TEST_F(CkptExportTest, TpAndFsdpTimesTpCheckpointsExportTheFullStateDict) {
  ExpectExportsEqualFinal("--ranks 2 --tp 2", "t2");
  ExpectExportsEqualFinal("--ranks 4 --tp 2", "ft4");
}

TEST_F(CkptExportTest, ToolAndErrors) {
  const std::string ckpt = Train("--ranks 2", "tool");
  // gpt_train records the number of heads (2 layers x 32 dims match no preset).
  absl::StatusOr<nn::GPTConfig> recorded = GptConfigOfCheckpoint(ckpt);
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  EXPECT_EQ(recorded->n_head, 2);
  EXPECT_EQ(recorded->n_layer, 2);
  EXPECT_EQ(Unwrap(GptConfigOfCheckpoint(ckpt, 2)).n_head, 2);
  // Another count than the recorded one splits the same weights into other heads: another
  // model, refused (it used to win and generate garbage).
  const absl::Status other = GptConfigOfCheckpoint(ckpt, 4).status();
  EXPECT_TRUE(absl::IsInvalidArgument(other)) << other;
  EXPECT_NE(other.message().find("was trained with 2 heads, not 4"), std::string::npos) << other;
  // A checkpoint of the parameters alone does not tell: an error asking for --n-head.
  {
    auto comms = Unwrap(MakeThreadGroup(1));
    auto model =
        Unwrap(nn::GPT::Create({.vocab_size = 256, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32}));
    CheckpointState state;
    for (auto& [name, p] : model->NamedParameters()) state.push_back({"model." + name, p->value().local()});
    ASSERT_TRUE(SaveCheckpoint(*comms[0], dir_.Path("bare"), "step-00000001", state).ok());
    absl::StatusOr<nn::GPTConfig> no_heads = GptConfigOfCheckpoint(dir_.Path("bare") + "/step-00000001");
    ASSERT_FALSE(no_heads.ok());
    EXPECT_NE(no_heads.status().message().find("--n-head"), std::string::npos) << no_heads.status();
    EXPECT_EQ(Unwrap(GptConfigOfCheckpoint(dir_.Path("bare") + "/step-00000001", 2)).n_head, 2);  // the caller's
  }
  absl::StatusOr<nn::GPTConfig> missing = GptConfigOfCheckpoint(dir_.Path("nowhere"), 2);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();

  // The tool, on the root directory (it takes the newest checkpoint), in both formats; llmc's
  // command line spells its flags --flag=value.
  for (const std::string format : {"hf", "llmc"}) {
    const std::string out = dir_.Path("tool-" + format + (format == "llmc" ? ".bin" : ""));
    testing::ProcessOptions options;
    options.merge_output = true;
    const std::vector<std::string> args =
        format == "hf" ? std::vector<std::string>{GPT_EXPORT_PATH,
                                                  "--ckpt-dir",
                                                  dir_.Path("tool-ckpt"),
                                                  "--format",
                                                  format,
                                                  "--out",
                                                  out,
                                                  "--n-head",
                                                  "2"}
                       : std::vector<std::string>{GPT_EXPORT_PATH, "--ckpt-dir=" + dir_.Path("tool-ckpt"),
                                                  "--format=" + format, "--out=" + out, "--n-head=2"};
    const testing::ProcessRun run = testing::RunProcess(args, options);
    EXPECT_EQ(run.code, 0) << run.out;
    EXPECT_TRUE(std::filesystem::exists(format == "hf" ? out + "/model.safetensors" : out)) << run.out;
  }
  const HfGpt2 hf = Unwrap(ReadHfGpt2(dir_.Path("tool-hf")));
  const NamedTensors final_params = Unwrap(ReadSafetensors(dir_.Path("tool.safetensors")));
  for (const auto& [name, t] : hf.params) {
    EXPECT_EQ(Unwrap(t.ToVector<float>()), Unwrap(final_params.Find(name)->ToVector<float>())) << name;
  }
  testing::ProcessOptions options;
  options.merge_output = true;
  const testing::ProcessRun bad =
      testing::RunProcess({GPT_EXPORT_PATH, "--ckpt-dir", ckpt, "--format", "onnx", "--out", dir_.Path("x")}, options);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("onnx"), std::string::npos) << bad.out;
}

// Metadata nested far deeper than a checkpoint's (which nests 6 levels) is an error, not a stack
// overflow in parsing or in printing it into a message; a config llm.c's 32-bit header cannot
// hold is named with its value, not a wrapped-around one.
TEST_F(CkptExportTest, DeepMetadataAndAVocabBeyondInt32AreErrors) {
  auto comms = Unwrap(MakeThreadGroup(1));
  auto model = Unwrap(nn::GPT::Create({.vocab_size = 256, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16}));
  CheckpointState state;
  for (auto& [name, p] : model->NamedParameters()) state.push_back({"model." + name, p->value().local()});
  ASSERT_TRUE(SaveCheckpoint(*comms[0], dir_.Path("small"), "step-1", state).ok());
  const std::string good = dir_.Path("small") + "/step-1";
  nn::GPTConfig big = Unwrap(GptConfigOfCheckpoint(good, 2));
  big.vocab_size = int64_t{3567587328};  // 2^32 - 727379968: int32 would print -727379968
  const absl::Status huge = ExportCheckpointToLlmc(good, big, dir_.Path("huge.bin"));
  EXPECT_TRUE(absl::IsInvalidArgument(huge)) << huge;
  EXPECT_NE(huge.message().find("3567587328"), std::string::npos) << huge;
  EXPECT_EQ(huge.message().find("-727379968"), std::string::npos) << huge;
  EXPECT_FALSE(std::filesystem::exists(dir_.Path("huge.bin")));

  const std::string deep = dir_.Path("deep");
  std::filesystem::create_directories(deep);
  const int depth = 200000;
  testing::WriteBytes(deep + "/metadata.json",
                      R"({"format": "dtensor-checkpoint", "version": 1, "block_bytes": 1048576, "tensors": )"
                      R"({"model.transformer.wte.weight": {"shape": )" +
                          std::string(depth, '[') + std::string(depth, ']') + "}}}");
  const absl::Status config = GptConfigOfCheckpoint(deep, 2).status();
  EXPECT_TRUE(absl::IsDataLoss(config)) << config.ToString().substr(0, 300);
  EXPECT_NE(config.message().find("nests deeper"), std::string::npos) << config.ToString().substr(0, 300);
  EXPECT_LT(config.message().size(), 1000u);
  const absl::Status exported =
      ExportCheckpointToLlmc(deep, Unwrap(GptConfigOfCheckpoint(good, 2)), dir_.Path("d.bin"));
  EXPECT_TRUE(absl::IsDataLoss(exported)) << exported.ToString().substr(0, 300);
}

}  // namespace
}  // namespace dtensor::gpt
