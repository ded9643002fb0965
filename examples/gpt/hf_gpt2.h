// Hugging Face GPT-2 checkpoints (a model.safetensors and its config.json, as on the hub or as
// GPT2LMHeadModel.save_pretrained writes them), read into and written from nn::GPT's
// nanoGPT / PyTorch state_dict names.
//
//   DT_ASSIGN_OR_RETURN(gpt::HfGpt2 hf, gpt::ReadHfGpt2("/models/gpt2"));  // or .../model.safetensors
//   DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> model, nn::GPT::Create(hf.config));
//   DT_RETURN_IF_ERROR(model->LoadStateDict(hf.params));
//   ...
//   DT_ASSIGN_OR_RETURN(auto state, model->StateDict());
//   DT_RETURN_IF_ERROR(gpt::WriteHfGpt2("/out/gpt2-tuned", model->config(), state));
//   DT_ASSIGN_OR_RETURN(nn::GPTConfig xl, gpt::GptPreset("gpt2-xl"));
//
// The two layouts. Ours (nn::GPT, LlmcParamShapes in llmc.h): transformer.wte.weight [V, C],
// transformer.wpe.weight [P, C], transformer.h.{i}.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,
// mlp.c_proj}.{weight,bias}, transformer.ln_f.{weight,bias}; Linear weights nn.Linear's
// [out, in]; the LM head tied to wte (no lm_head.weight). Hugging Face's: the same names, but
// attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj are Conv1D modules whose weights are stored
// [in, out] (transposed against ours); GPT2LMHeadModel's names carry the "transformer." prefix,
// GPT2Model's (the hub's gpt2 model.safetensors) do not.
//
// Reading accepts either name form (not both in one file) and
//  - skips the causal-mask buffers h.{i}.attn.bias after checking them: shape
//    [1, 1, P, P], ones on and below the diagonal and zeros above (old transformers versions
//    saved them; any dtype the safetensors reader has, so not U8), and h.{i}.attn.masked_bias
//    (a one-element scalar, -1e4 in old files);
//  - accepts lm_head.weight only when it equals wte.weight (a tied head written out);
//  - widens BF16 and F16 tensors to F32 (exact); other dtypes are refused;
//  - refuses, with InvalidArgument naming the tensor and the file: an unknown name (a layer
//    index >= n_layer too), a name given twice, a missing tensor, a shape that differs from
//    the config's, another dtype, a wrong mask buffer, an untied lm_head.
// config.json is required (beside the .safetensors file, or in the directory) and is read by
// GptConfigFromHfJson.
// Writing produces GPT2LMHeadModel's form: "transformer."-prefixed names, Conv1D weights
// [in, out], no lm_head.weight and no mask buffers, all F32, metadata {"format": "pt"} (which
// transformers' from_pretrained requires), plus config.json; each file is written atomically.
#ifndef DTENSOR_EXAMPLES_GPT_HF_GPT2_H_
#define DTENSOR_EXAMPLES_GPT_HF_GPT2_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::gpt {

// The architecture presets by name: "gpt2" (124M: 12 layers, 12 heads, 768 dims), "gpt2-medium"
// (350M: 24, 16, 1024), "gpt2-large" (774M: 36, 20, 1280), "gpt2-xl" (1558M: 48, 25, 1600), all
// with vocab 50257 and 1024 positions; and "tiny" (4 layers, 4 heads, 128 dims, 64 positions,
// vocab 256: gpt_train's default byte-level model; a trainer sets vocab_size from its tokenizer).
// InvalidArgument naming the unknown name and listing the known ones.
absl::StatusOr<nn::GPTConfig> GptPreset(const std::string& name);
std::vector<std::string> GptPresetNames();

// nn::GPTConfig from the text of a Hugging Face GPT-2 config.json (`source` names it in
// errors). Reads vocab_size, n_positions, n_embd, n_layer, n_head (required, positive, n_embd
// a multiple of n_head). Refuses, naming the key and value, what nn::GPT does not compute:
// model_type other than "gpt2", activation_function other than "gelu_new" / "gelu_pytorch_tanh"
// (the same tanh GELU), layer_norm_epsilon other than 1e-5, n_inner other than null or 4 n_embd,
// scale_attn_weights false, scale_attn_by_inverse_layer_idx true, add_cross_attention true,
// tie_word_embeddings false. Other keys (dropouts, token ids, n_ctx, ...) are ignored: the
// config's dropout stays 0 (pdrops are training settings).
absl::StatusOr<nn::GPTConfig> GptConfigFromHfJson(const std::string& json_text, const std::string& source);
// The config.json text WriteHfGpt2 writes for `config` (GPT2Config's fields, dropouts 0.1 as
// GPT2Config's defaults).
std::string HfJsonFromGptConfig(const nn::GPTConfig& config);

struct HfGpt2 {
  nn::GPTConfig config;
  // float32 CPU tensors in our names, order (LlmcParamShapes) and layout.
  std::vector<std::pair<std::string, Tensor>> params;
  // True when some tensor was stored as BF16 or F16 (and widened).
  bool widened = false;
  const Tensor* Find(const std::string& name) const;  // nullptr when absent
};

// Reads `path`: a directory holding model.safetensors and config.json, or a .safetensors file
// with config.json in the same directory. NotFound for a missing file.
absl::StatusOr<HfGpt2> ReadHfGpt2(const std::string& path);

// Writes `dir`/model.safetensors and `dir`/config.json (creating `dir`). `params` must hold
// exactly our names for `config` (LlmcParamShapes), each with our shape; any float dtype and
// device (converted to F32 on the host). InvalidArgument naming the parameter otherwise.
absl::Status WriteHfGpt2(const std::string& dir, const nn::GPTConfig& config,
                         absl::Span<const std::pair<std::string, Tensor>> params);

// True for the weights Hugging Face keeps in Conv1D modules, stored [in, out] (transposed
// against ours): attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj (either name form).
bool IsHfConv1DWeight(const std::string& name);

// One tensor from our layout to Hugging Face's: the GPT2LMHeadModel name and, for the Conv1D
// weights, the transposed (contiguous, F32, CPU) tensor. InvalidArgument for a name that is
// not one of ours. For writers that go tensor by tensor.
absl::StatusOr<std::pair<std::string, Tensor>> ToHfGpt2Tensor(const std::string& name, const Tensor& ours);

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_HF_GPT2_H_
