// The public API's misuse in one table: each row makes one wrong call (placements that do not
// fit, shapes, dtypes, devices, meshes, files, the trainer's flags) and names the error code
// and a fragment of the message the library must return. Nothing may abort (a row that
// crashes kills the test binary; the trainer's rows run as processes and must exit 1 or 2,
// never by a signal) and nothing may hang (collective rows run on 2 thread ranks with a
// 20 s communicator timeout; the trainer is killed after 60 s).
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/nn/parallel/activation_checkpoint.h"
#include "dtensor/nn/parallel/parallel_style.h"
#include "dtensor/nn/parallel/plan_file.h"
#include "dtensor/nn/safetensors.h"
#include "dtensor/ops/ops.h"
#include "dtensor/placements/layout.h"
#include "dtensor/placements/placement.h"
#include "dtensor/tensor/device.h"
#include "dtensor/tensor/status.h"
#include "dtensor/tensor/tensor.h"
#include "examples/gpt/data.h"
#include "examples/gpt/hf_gpt2.h"
#include "examples/gpt/llmc.h"
#include "examples/gpt/sampler.h"
#include "gtest/gtest.h"
#include "tests/testing/run_process.h"
#include "tests/testing/test_util.h"

#ifndef GPT_TRAIN_PATH
#error "tests/CMakeLists.txt defines GPT_TRAIN_PATH"
#endif

namespace dtensor {
namespace {

// What a row's call sees on its rank.
struct RankEnv {
  int rank = 0;
  Communicator* comm = nullptr;
  const DeviceMesh* mesh = nullptr;  // 1-D over both ranks
  std::string dir;                   // a scratch directory (shared by the ranks)
};

struct Row {
  std::string call;  // the call, as a user would write it
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string fragment;  // part of the message
  std::function<absl::Status(RankEnv&)> run = nullptr;
};

Tensor Make(std::initializer_list<int64_t> shape, DType dtype = DType::kFloat32) {
  return testing::Unwrap(Zeros(shape, dtype));
}

template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& v) {
  return v.status();
}

// The bad files the rows read, made before the rows run.
const std::vector<std::pair<std::string, std::string>>& BadFiles() {
  static const auto* files = new std::vector<std::pair<std::string, std::string>>{
      {"short.safetensors", "abc"},
      {"long.safetensors", std::string("\xff\xff\xff\xff\0\0\0\0{}", 10)},
      {"text.bin", std::string(2048, 'a')},
  };
  return *files;
}
std::string File(const RankEnv& env, const std::string& name) { return env.dir + "/" + name; }

// The trainer as a call: its exit and output become a Status. A Status error prints
// "gpt_train[ rank R]: CODE_NAME: message"; a usage error (exit 2, or Abseil's flag parser's
// "ERROR: ...") counts as InvalidArgument. Death by a signal or the timeout is Internal (the row fails).
absl::Status Trainer(const std::string& flags) {
  std::vector<std::string> argv = {GPT_TRAIN_PATH};
  for (absl::string_view w : absl::StrSplit(flags, ' ', absl::SkipEmpty())) argv.emplace_back(w);
  const testing::ProcessRun run =
      testing::RunProcess(argv, {.env = {"DTENSOR_TIMEOUT_S=30"}, .timeout = absl::Seconds(60), .merge_output = true});
  if (run.code == 0) return absl::OkStatus();
  if (run.code != 1 && run.code != 2) {
    return absl::InternalError(absl::StrCat("gpt_train ", flags, " exited with ", run.code, ":\n", run.out));
  }
  static const std::regex status_line("gpt_train(?: rank [0-9]+)?: ([A-Z_]+): (.*)");
  std::smatch m;
  if (std::regex_search(run.out, m, status_line)) {
    for (int c = 1; c <= 16; ++c) {
      const auto code = static_cast<absl::StatusCode>(c);
      if (absl::StatusCodeToString(code) == m[1].str()) return absl::Status(code, m[2].str());
    }
  }
  // Usage errors: the trainer's own (exit 2) and Abseil's flag parser's ("ERROR: Unknown
  // command line flag 'x'", exit 1).
  if (run.code == 2 || absl::StartsWith(run.out, "ERROR: ")) return absl::InvalidArgumentError(run.out);
  return absl::UnknownError(run.out);
}

std::vector<Row> Rows() {
  using absl::StatusCode;
  const auto kInvalid = StatusCode::kInvalidArgument;
  std::vector<Row> rows = {
      // ---- Tensors: shapes, dtypes, devices ----
      {"Tensor::Empty({2, -3}, f32)", kInvalid, "-3",
       [](RankEnv&) {
         return StatusOf(Tensor::Empty({2, -3}, DType::kFloat32));
       }},
      {"Tensor::FromVector<float>({1, 2, 3}, {2, 2})", kInvalid, "3 values do not fill shape [2, 2]",
       [](RankEnv&) {
         return StatusOf(Tensor::FromVector<float>({1.f, 2.f, 3.f}, {2, 2}));
       }},
      {"Reshape([2, 3], {4, 2})", kInvalid, "[4, 2] is invalid for 6 elements",
       [](RankEnv&) {
         return StatusOf(Reshape(Make({2, 3}), {4, 2}));
       }},
      {"Add([2, 3], [4])", kInvalid, "[2, 3] and [4] do not broadcast",
       [](RankEnv&) {
         return StatusOf(Add(Make({2, 3}), Make({4})));
       }},
      {"Matmul([2, 3], [4, 5])", kInvalid, "inner dims differ",
       [](RankEnv&) {
         return StatusOf(Matmul(Make({2, 3}), Make({4, 5})));
       }},
      {"Matmul(f32, i64)", kInvalid, "dtypes differ: float32 [2, 3] and int64 [3, 2]",
       [](RankEnv&) {
         return StatusOf(Matmul(Make({2, 3}), Make({3, 2}, DType::kInt64)));
       }},
      {"Cat({[2, 3], [2, 4]}, 0)", kInvalid, "tensor 1 has shape [2, 4]",
       [](RankEnv&) {
         const Tensor xs[] = {Make({2, 3}), Make({2, 4})};
         return StatusOf(Cat(xs, 0));
       }},
      {"Sum([2, 3], dims {5})", kInvalid, "5",
       [](RankEnv&) {
         return StatusOf(Sum(Make({2, 3}), {5}));
       }},
      {"Zeros({2}, f32, Cuda(77))", StatusCode::kFailedPrecondition, "cuda:77",
       [](RankEnv&) { return StatusOf(Zeros({2}, DType::kFloat32, Device::Cuda(77))); }},
      // ---- Meshes ----
      {"DeviceMesh::Create(world of 2, {3})", kInvalid, "has a dim of 3 ranks, more than the communicator's 2",
       [](RankEnv& e) { return StatusOf(DeviceMesh::Create(*e.comm, {3})); }},
      {"DeviceMesh::Create(world of 2, {2}, {\"dp\", \"tp\"})", kInvalid, "2 dim names [dp, tp] for mesh shape [2]",
       [](RankEnv& e) {
         return StatusOf(DeviceMesh::Create(*e.comm, {2}, {"dp", "tp"}));
       }},
      {"DeviceMesh::Create(world of 2, {0, 2})", kInvalid, "[0, 2] has a non-positive size",
       [](RankEnv& e) {
         return StatusOf(DeviceMesh::Create(*e.comm, {0, 2}));
       }},
      // ---- Placements that do not fit ----
      {"Distribute([4, 4], 1-D mesh, {S(2)})", kInvalid, "S(2): shard dim out of range for a 2-d tensor",
       [](RankEnv& e) {
         return StatusOf(DTensor::Distribute(Make({4, 4}), *e.mesh, {Shard(2)}));
       }},
      {"Distribute([4, 4], 1-D mesh, {S(0), R})", kInvalid, "2 placements (S(0)R) for a 1-d mesh",
       [](RankEnv& e) {
         return StatusOf(DTensor::Distribute(Make({4, 4}), *e.mesh, {Shard(0), Replicate()}));
       }},
      {"Redistribute S(0) -> P(sum)", kInvalid, "Shard -> Partial is not a legal move",
       [](RankEnv& e) -> absl::Status {
         DT_ASSIGN_OR_RETURN(DTensor x, DTensor::Distribute(Make({4, 4}), *e.mesh, {Shard(0)}));
         return StatusOf(x.Redistribute({Partial()}));
       }},
      {"FromLocal([3, 4] piece of global [4, 4] as S(0))", kInvalid,
       "local shape [3, 4] is not this rank's piece [2, 4]",
       [](RankEnv& e) {
         return StatusOf(DTensor::FromLocal(Make({3, 4}), *e.mesh, {Shard(0)}, {.global_shape = Shape{4, 4}}));
       }},
      {"Layout({S(0)}).WithShardOrder(0, {0, 0})", kInvalid, "shard order {0,0} for tensor dim 0",
       [](RankEnv&) {
         return StatusOf(Layout({Shard(0)}).WithShardOrder(0, std::vector<int>{0, 0}));
       }},
      {"ParsePlacement(\"S(x)\")", kInvalid, "S(x)", [](RankEnv&) { return StatusOf(nn::ParsePlacement("S(x)")); }},
      {"ParseStyle(\"Diagonalwise\")", kInvalid, "Diagonalwise",
       [](RankEnv&) { return StatusOf(nn::ParseStyle("Diagonalwise")); }},
      {"ParsePlanFile(\"{not json\")", kInvalid, "not a JSON object",
       [](RankEnv&) { return StatusOf(nn::ParsePlanFile("{not json")); }},
      {"ParsePlanFile(unknown style)", kInvalid, "Sideways",
       [](RankEnv&) {
         return StatusOf(nn::ParsePlanFile(
             R"({"mesh": {"tp": 2}, "rules": [{"module": "transformer.h.*.attn.c_attn", "style": "Sideways"}]})"));
       }},
      {"nn::ParseAcMode(\"bogus\")", kInvalid, "bogus", [](RankEnv&) { return StatusOf(nn::ParseAcMode("bogus")); }},
      {"nn::GPT::Create(n_embd 30, n_head 4)", kInvalid, "n_embd must be a multiple of n_head",
       [](RankEnv&) {
         return StatusOf(
             nn::GPT::Create({.vocab_size = 256, .block_size = 8, .n_layer = 1, .n_head = 4, .n_embd = 30}));
       }},
      {"gpt::GptPreset(\"gpt5\")", kInvalid, "gpt5", [](RankEnv&) { return StatusOf(gpt::GptPreset("gpt5")); }},
      {"gpt::Sampler::Create(temperature -1)", kInvalid, "temperature must be finite and >= 0, got -1",
       [](RankEnv&) { return StatusOf(gpt::Sampler::Create({.temperature = -1})); }},
      {"gpt::Sampler::Create(top_p 1.0000001)", kInvalid, "top_p must be in (0, 1], got 1.0000001",
       [](RankEnv&) { return StatusOf(gpt::Sampler::Create({.top_p = 1.0000001})); }},
      // ---- Files ----
      {"ReadSafetensors(missing file)", StatusCode::kNotFound, "/nonexistent/x.safetensors",
       [](RankEnv&) { return StatusOf(ReadSafetensors("/nonexistent/x.safetensors")); }},
      {"ReadSafetensors(3 bytes)", kInvalid, "file is 3 bytes, too short",
       [](RankEnv& e) { return StatusOf(ReadSafetensors(File(e, "short.safetensors"))); }},
      {"ReadSafetensors(header length past the end)", kInvalid, "header length 4294967295 is invalid",
       [](RankEnv& e) { return StatusOf(ReadSafetensors(File(e, "long.safetensors"))); }},
      {"LatestCheckpoint(empty dir)", StatusCode::kNotFound, "no complete checkpoint",
       [](RankEnv& e) { return StatusOf(LatestCheckpoint(e.dir)); }},
      {"LoadCheckpoint(missing dir)", StatusCode::kNotFound, "/nonexistent/ckpt/metadata.json",
       [](RankEnv&) { return LoadCheckpoint("/nonexistent/ckpt", {{.name = "w", .tensor = Make({2})}}); }},
      {"gpt::ReadLlmcCheckpoint(text file)", kInvalid, "magic",
       [](RankEnv& e) { return StatusOf(gpt::ReadLlmcCheckpoint(File(e, "text.bin"))); }},
      {"gpt::LoadLlmcTokens(text file)", kInvalid, "magic",
       [](RankEnv& e) { return StatusOf(gpt::LoadLlmcTokens(File(e, "text.bin"))); }},
      {"gpt::LoadTextTokens(missing file)", StatusCode::kNotFound, "/nonexistent/t.txt",
       [](RankEnv&) { return StatusOf(gpt::LoadTextTokens("/nonexistent/t.txt")); }},
      {"nn::ReadPlanFile(missing file)", StatusCode::kNotFound, "/nonexistent/plan.json",
       [](RankEnv&) { return StatusOf(nn::ReadPlanFile("/nonexistent/plan.json")); }},
  };
  return rows;
}

// The trainer's rows (processes; --text needs a real file: `corpus`).
std::vector<Row> TrainerRows(const std::string& corpus) {
  using absl::StatusCode;
  const auto kInvalid = StatusCode::kInvalidArgument;
  const std::string base = "--n-layer 1 --n-head 2 --n-embd 16 --seq 8 --steps 1 ";
  struct Flags {
    std::string flags;
    StatusCode code;
    std::string fragment;
  };
  const std::vector<Flags> flags = {
      {"--device tpu", kInvalid, "--device tpu"},
      {"--ranks 0", kInvalid, "--ranks 0"},
      {"--seq 0", kInvalid, "--seq 0"},
      {"--batch 6 --grad-accum 4", kInvalid, "--batch 6 must be a multiple of --grad-accum 4"},
      {"--ranks 4 --dp-shard 3", kInvalid, "does not make the world size 4"},
      {"--ranks 2 --tp 4 --n-head 2", kInvalid, "tp 4 does not make the world size 2"},
      {"--n-embd 30 --n-head 4", kInvalid, "n_embd must be a multiple of n_head"},
      {"--ac bogus", kInvalid, "bogus"},
      {"--model gpt5", kInvalid, "gpt5"},
      {"--lr-schedule wavy", kInvalid, "wavy"},
      {"--resume", kInvalid, "--ckpt-dir"},
      {"--plan /nonexistent/plan.json --ranks 2", StatusCode::kNotFound, "/nonexistent/plan.json"},
      {"--init-llmc " + corpus, kInvalid, "magic"},
      {"--init-llmc " + corpus + " --n-layer 2", kInvalid, "--n-layer applies to a model from flags"},
      {"--train-bin " + corpus, kInvalid, "magic"},
      {"--ranks 2 --plan " + corpus, kInvalid, "not a JSON object"},
      {"--ranks 2 --dp-shard 1 --dp-replicate 2 --grad-accum 2 --batch 4 --grad-sync last", kInvalid,
       "--grad-sync last applies to FSDP"},
      {"--vocab 10", kInvalid, "outside the model's vocabulary of 10"},
      {"--seq 100000", kInvalid, "B*T+1 = 800001 tokens"},
      {"--lr -1", kInvalid, "lr -1"},
      {"--warmup -1", kInvalid, "--warmup -1: must be >= 0"},
      {"--grad-clip -1", kInvalid, "--grad-clip -1: must be >= 0"},
      {"--n-layer 0", kInvalid, "--n-layer 0: must be >= 1"},
      {"--beta1 2", kInvalid, "got 2 and 0.999"},
      {"--dropout 2", kInvalid, "--dropout 2: must be in [0, 1)"},
      {"--batch 0", kInvalid, "--batch 0"},
      {"--metrics /proc/x.jsonl", kInvalid, "cannot open --metrics /proc/x.jsonl"},
      {"--save-final /proc/x.safetensors", StatusCode::kNotFound, "/proc/x.safetensors"},
      {"--param-dtype fp16", kInvalid, "fp16"},
      {"--stepz 3", kInvalid, "stepz"},
  };
  std::vector<Row> rows;
  for (const Flags& f : flags) {
    const std::string text = absl::StrContains(f.flags, "--train-bin") ? "" : "--text " + corpus + " ";
    // An llm.c checkpoint brings the model's shape: no shape flags beside it.
    const std::string common = absl::StrContains(f.flags, "--init-llmc") ? "--seq 8 --steps 1 " : base;
    rows.push_back({"gpt_train " + f.flags, f.code, f.fragment,
                    [flags = common + text + f.flags](RankEnv&) { return Trainer(flags); }});
  }
  rows.push_back({"gpt_train --text /nonexistent/corpus.txt", StatusCode::kNotFound, "/nonexistent/corpus.txt",
                  [](RankEnv&) { return Trainer("--text /nonexistent/corpus.txt --steps 1"); }});
  return rows;
}

// Runs `row` on 2 thread ranks (a fresh world and 1-D mesh per row: a row that fails one
// rank's own check aborts the mesh) and returns each rank's Status.
std::vector<absl::Status> RunOnRanks(const Row& row, const std::string& dir) {
  std::vector<absl::Status> out(2, absl::InternalError("not run"));
  auto comms = MakeThreadGroup(2, absl::Seconds(20));
  if (!comms.ok()) {
    ADD_FAILURE() << comms.status();
    return out;
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Communicator& comm = *(*comms)[static_cast<size_t>(r)];
      absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(comm, {2});
      if (!mesh.ok()) {
        out[static_cast<size_t>(r)] = mesh.status();
        return;
      }
      RankEnv env{.rank = r, .comm = &comm, .mesh = &*mesh, .dir = dir};
      comm.Barrier().IgnoreError();  // rank 0's files are written before a row reads them
      out[static_cast<size_t>(r)] = row.run(env);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(MisuseTest, EveryRowFailsWithItsCodeAndMessage) {
  testing::ScopedTempDir dir("misuse_test");
  const std::string corpus = dir.Path("corpus.txt");
  testing::WriteBytes(corpus, std::string(4000, 'a') + "It was the best of times.\n");
  for (const auto& [name, bytes] : BadFiles()) testing::WriteBytes(dir.Path(name), bytes);
  std::vector<Row> rows = Rows();
  for (Row& r : TrainerRows(corpus)) rows.push_back(std::move(r));
  for (const Row& row : rows) {
    SCOPED_TRACE(row.call);
    const absl::Time start = absl::Now();
    // Library rows run on both ranks; the trainer's (processes) once.
    const bool process = absl::StartsWith(row.call, "gpt_train");
    std::vector<absl::Status> statuses;
    if (process) {
      RankEnv env{.dir = dir.path()};
      statuses.push_back(row.run(env));
    } else {
      statuses = RunOnRanks(row, dir.path());
    }
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), row.code) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), row.fragment)) << "'" << row.fragment << "' not in: " << s;
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "slow: something waited for a timeout";
    std::printf("%-60s %s\n", row.call.c_str(), statuses[0].ToString().substr(0, 140).c_str());
  }
}

}  // namespace
}  // namespace dtensor
