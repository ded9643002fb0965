// llm.c GPT-2 checkpoints (the .bin files written by llm.c's train_gpt2.py / train_gpt2.cu),
// read into and written from nanoGPT / PyTorch state_dict names.
//
//   DT_ASSIGN_OR_RETURN(gpt::LlmcCheckpoint ckpt, gpt::ReadLlmcCheckpoint("gpt2_124M.bin"));
//   std::cout << ckpt.config.num_layers << " layers, vocab " << ckpt.config.vocab_size << "\n";
//   for (const auto& [name, t] : ckpt.params) {   // "transformer.wte.weight" [V, C], ...
//     DT_RETURN_IF_ERROR(CopyInto(model.Param(name), t));
//   }
//   DT_RETURN_IF_ERROR(gpt::WriteLlmcCheckpoint("out.bin", ckpt.config, ckpt.params));
//
// File layout: 256 little-endian int32 header words
//   [0] magic 20240326, [1] version, [2] max_seq_len, [3] vocab_size, [4] num_layers,
//   [5] num_heads, [6] channels, [7] padded_vocab_size,
// then the parameters, each row-major with nn.Linear's [out, in] layout, in llm.c's order:
//   wte (Vp, C), wpe (maxT, C), ln1w (L, C), ln1b (L, C), qkvw (L, 3C, C), qkvb (L, 3C),
//   attprojw (L, C, C), attprojb (L, C), ln2w (L, C), ln2b (L, C), fcw (L, 4C, C), fcb (L, 4C),
//   fcprojw (L, C, 4C), fcprojb (L, C), lnfw (C), lnfb (C).
// Version 3: every parameter float32. Version 5: every parameter (layernorms too) bfloat16; it
// is read by widening to float32, which is exact. Other versions (1, 2 and 4 were short-lived
// llm.c development formats without padded vocab or with reordered layernorms) are refused.
// The file size must equal the header plus the parameters exactly.
//
// Reading returns the parameters split per layer, in nanoGPT's named_parameters order:
//   transformer.wte.weight [V, C]      (the Vp - V padding rows are dropped)
//   transformer.wpe.weight [maxT, C]
//   transformer.h.{i}.ln_1.weight/.bias [C]
//   transformer.h.{i}.attn.c_attn.weight [3C, C] / .bias [3C]
//   transformer.h.{i}.attn.c_proj.weight [C, C] / .bias [C]
//   transformer.h.{i}.ln_2.weight/.bias [C]
//   transformer.h.{i}.mlp.c_fc.weight [4C, C] / .bias [4C]
//   transformer.h.{i}.mlp.c_proj.weight [C, 4C] / .bias [C]
//   transformer.ln_f.weight/.bias [C]
// (the LM head is tied to wte, so there is no lm_head.weight).
#ifndef DTENSOR_EXAMPLES_GPT_LLMC_H_
#define DTENSOR_EXAMPLES_GPT_LLMC_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::gpt {

inline constexpr int32_t kLlmcModelMagic = 20240326;
inline constexpr int32_t kLlmcVersionFp32 = 3;  // float32 parameters, padded vocab
inline constexpr int32_t kLlmcVersionBf16 = 5;  // bfloat16 parameters, padded vocab

struct LlmcConfig {
  int max_seq_len = 0;
  int vocab_size = 0;
  // Rows of wte in the file (>= vocab_size). Writing with 0 pads vocab_size up to a multiple of
  // 128, as llm.c does.
  int padded_vocab_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int channels = 0;
  int version = kLlmcVersionFp32;  // as read; writing always produces version 3
};

struct LlmcCheckpoint {
  LlmcConfig config;
  // float32 CPU tensors, names and shapes as above.
  std::vector<std::pair<std::string, Tensor>> params;

  // The tensor named `name`, or nullptr.
  const Tensor* Find(const std::string& name) const;
};

// The state_dict names and shapes of a GPT-2 with `config`, in nanoGPT's named_parameters order
// (wte is [vocab_size, C]).
std::vector<std::pair<std::string, Shape>> LlmcParamShapes(const LlmcConfig& config);

// The 256-word header of a version-3 (float32) llm.c checkpoint of `config` (padded_vocab_size
// as given), which WriteLlmcCheckpoint writes.
std::vector<int32_t> LlmcFp32Header(const LlmcConfig& config);

// Reads an llm.c checkpoint. NotFound for a missing file; InvalidArgument naming the file and the
// values for a bad magic, a non-positive or inconsistent header (padded_vocab_size < vocab_size,
// channels not divisible by num_heads) or a size that is not header + parameters;
// Unimplemented for versions other than 3 and 5.
absl::StatusOr<LlmcCheckpoint> ReadLlmcCheckpoint(const std::string& path);

// Writes a version-3 (float32) llm.c checkpoint atomically. `params` must hold every name of
// LlmcParamShapes(config) with that shape (wte may also be given already padded, [Vp, C]); any
// float dtype and device, converted to float32 on the host. wte is padded with zero rows up to
// padded_vocab_size. Other names in `params` are an error (a model that is not a GPT-2).
absl::Status WriteLlmcCheckpoint(const std::string& path, const LlmcConfig& config,
                                 absl::Span<const std::pair<std::string, Tensor>> params);

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_LLMC_H_
