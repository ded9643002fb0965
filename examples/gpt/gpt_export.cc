// gpt_export: a distributed checkpoint (gpt_train --ckpt-dir) to one full-tensor file.
//
//   gpt_export --ckpt-dir /ckpt [--format hf|llmc] --out PATH [--n-head H]
//
// --ckpt-dir: a checkpoint directory (one holding metadata.json) or a root of them (the newest
// complete one is taken). --format hf (default): PATH is a directory that gets model.safetensors
// and config.json in Hugging Face GPT-2's layout; llmc: PATH is an llm.c checkpoint file.
// --n-head: the checkpoint does not record it; by default that of the GPT-2 preset with the
// same layers and width. Tensors are read and written one at a time (examples/gpt/ckpt_export.h).
#include <cstdio>
#include <filesystem>
#include <string>

#include "absl/strings/numbers.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/tensor/status.h"
#include "examples/gpt/ckpt_export.h"

namespace {

constexpr const char* kUsage = "usage: gpt_export --ckpt-dir DIR [--format hf|llmc] --out PATH [--n-head H]\n";

absl::Status Run(int argc, char** argv) {
  using namespace dtensor;
  std::string ckpt_dir, format = "hf", out;
  int64_t n_head = 0;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      return absl::OkStatus();
    }
    // "--flag value" or "--flag=value", as the other tools take.
    std::string value;
    if (const size_t eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError("[gpt_export] " + flag + " needs a value\n" + kUsage);
    }
    if (flag == "--ckpt-dir") {
      ckpt_dir = value;
    } else if (flag == "--format") {
      format = value;
    } else if (flag == "--out") {
      out = value;
    } else if (flag == "--n-head") {
      if (!absl::SimpleAtoi(value, &n_head) || n_head <= 0) {
        return absl::InvalidArgumentError("[gpt_export] --n-head must be a positive integer, got '" + value + "'");
      }
    } else {
      return absl::InvalidArgumentError("[gpt_export] unknown flag '" + flag + "'\n" + kUsage);
    }
  }
  if (ckpt_dir.empty() || out.empty()) return absl::InvalidArgumentError(std::string("[gpt_export] ") + kUsage);
  if (format != "hf" && format != "llmc") {
    return absl::InvalidArgumentError("[gpt_export] --format must be hf or llmc, got '" + format + "'");
  }
  std::string dir = ckpt_dir;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "metadata.json")) {
    DT_ASSIGN_OR_RETURN(dir, LatestCheckpoint(ckpt_dir));
  }
  DT_ASSIGN_OR_RETURN(nn::GPTConfig config, gpt::GptConfigOfCheckpoint(dir, n_head));
  if (format == "hf") {
    DT_RETURN_IF_ERROR(gpt::ExportCheckpointToHf(dir, config, out));
  } else {
    DT_RETURN_IF_ERROR(gpt::ExportCheckpointToLlmc(dir, config, out));
  }
  std::printf("exported %s (%lld layers, %lld heads, n_embd %lld, vocab %lld) to %s (%s)\n", dir.c_str(),
              static_cast<long long>(config.n_layer), static_cast<long long>(config.n_head),
              static_cast<long long>(config.n_embd), static_cast<long long>(config.vocab_size), out.c_str(),
              format.c_str());
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::Status s = Run(argc, argv);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
