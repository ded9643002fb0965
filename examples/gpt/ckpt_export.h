// Exports of a distributed checkpoint (dtensor/checkpoint/checkpoint.h, as gpt_train --ckpt-dir
// writes it: the parameters under "model.<state_dict name>", AdamW's moments under "optim.",
// the progress) to one full-tensor file: Hugging Face GPT-2 safetensors (hf_gpt2.h) or an llm.c
// checkpoint (llmc.h). Whatever parallelism saved it, the pieces are read with LoadCheckpoint
// one tensor at a time: at most one parameter (and its converted copy) is in memory at once,
// and the output file is written as it goes (atomically: a temporary file renamed at the end).
//
//   DT_ASSIGN_OR_RETURN(nn::GPTConfig cfg, gpt::GptConfigOfCheckpoint("/ckpt/step-00000100"));
//   DT_RETURN_IF_ERROR(gpt::ExportCheckpointToHf("/ckpt/step-00000100", cfg, "/out/gpt2-hf"));
//   DT_RETURN_IF_ERROR(gpt::ExportCheckpointToLlmc("/ckpt/step-00000100", cfg, "/out/model.bin"));
//
// The tool: examples/gpt/gpt_export --ckpt-dir D --format hf|llmc --out PATH [--n-head H].
#ifndef DTENSOR_EXAMPLES_GPT_CKPT_EXPORT_H_
#define DTENSOR_EXAMPLES_GPT_CKPT_EXPORT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dtensor/nn/gpt.h"

namespace dtensor::gpt {

// The checkpoint tensor (int64 [1]) holding a GPT's number of heads, which its parameters'
// shapes do not tell.
inline constexpr char kHeadsTensor[] = "train.n_head";

// The GPT-2 config of the parameters in checkpoint directory `dir` (one holding metadata.json):
// vocab_size and n_embd from model.transformer.wte.weight, block_size from wpe, n_layer from
// the h.<i> blocks present. The number of heads: the int64 [1] tensor "train.n_head" that
// gpt_train saves beside the model (a positive `n_head` that differs from it is InvalidArgument:
// the same weights split into other heads make another model), else `n_head` when positive,
// else that of the preset (GptPreset) with the same n_layer and n_embd; InvalidArgument asking
// for it when none says. NotFound for a directory without metadata.json, DataLoss for a
// metadata.json that is not a checkpoint's (as CheckpointTensors: deep nesting included);
// InvalidArgument naming the tensor for a model entry missing, misshapen or not of a float dtype.
absl::StatusOr<nn::GPTConfig> GptConfigOfCheckpoint(const std::string& dir, int64_t n_head = 0);

// Writes `out_dir`/model.safetensors and config.json as WriteHfGpt2 does, from the "model."
// tensors of checkpoint `dir` (the checkpoint's errors pass through, naming the tensor and file).
absl::Status ExportCheckpointToHf(const std::string& dir, const nn::GPTConfig& config, const std::string& out_dir);

// Writes a version-3 (float32) llm.c checkpoint to `out_path` as WriteLlmcCheckpoint does
// (wte padded with zero rows to a multiple of 128), from the "model." tensors of checkpoint `dir`.
// A config value llm.c's 32-bit header cannot hold (a vocab_size above 2^31 - 1, padded
// included) is InvalidArgument naming it.
absl::Status ExportCheckpointToLlmc(const std::string& dir, const nn::GPTConfig& config, const std::string& out_path);

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_CKPT_EXPORT_H_
