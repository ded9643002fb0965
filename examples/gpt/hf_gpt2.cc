#include "examples/gpt/hf_gpt2.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/nn/file_io.h"
#include "dtensor/nn/safetensors.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "examples/gpt/llmc.h"
#include "examples/gpt/tokenizer.h"
#include "nlohmann/json.hpp"

namespace dtensor::gpt {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPrefix = "transformer.";
constexpr double kLayerNormEps = 1e-5;  // nn::GPT's LayerNorms

struct Preset {
  const char* name;
  nn::GPTConfig config;
};

nn::GPTConfig MakeConfig(int64_t vocab, int64_t positions, int64_t layers, int64_t heads, int64_t embd) {
  nn::GPTConfig c;
  c.vocab_size = vocab;
  c.block_size = positions;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_embd = embd;
  return c;
}

const std::vector<Preset>& Presets() {
  static const auto* presets = new std::vector<Preset>{
      {"gpt2", MakeConfig(50257, 1024, 12, 12, 768)},
      {"gpt2-medium", MakeConfig(50257, 1024, 24, 16, 1024)},
      {"gpt2-large", MakeConfig(50257, 1024, 36, 20, 1280)},
      {"gpt2-xl", MakeConfig(50257, 1024, 48, 25, 1600)},
      {"tiny", MakeConfig(256, 64, 4, 4, 128)},
  };
  return *presets;
}

LlmcConfig ShapesConfig(const nn::GPTConfig& c) {
  LlmcConfig l;
  l.max_seq_len = static_cast<int>(c.block_size);
  l.vocab_size = static_cast<int>(c.vocab_size);
  l.padded_vocab_size = l.vocab_size;
  l.num_layers = static_cast<int>(c.n_layer);
  l.num_heads = static_cast<int>(c.n_head);
  l.channels = static_cast<int>(c.n_embd);
  return l;
}

// For "h.<i>.<rest>": i (>= 0) and rest; -1 otherwise.
int64_t LayerOf(const std::string& base, std::string* rest) {
  if (!absl::StartsWith(base, "h.")) return -1;
  const size_t dot = base.find('.', 2);
  if (dot == std::string::npos) return -1;
  int64_t i = -1;
  const std::string digits = base.substr(2, dot - 2);
  if (digits.empty() || (digits.size() > 1 && digits[0] == '0') || !absl::SimpleAtoi(digits, &i) || i < 0) return -1;
  *rest = base.substr(dot + 1);
  return i;
}

// Checks a causal-mask buffer h.<i>.attn.bias: [1, 1, P, P], 1 on and below the diagonal, 0 above.
absl::Status CheckMask(const char* op, const std::string& file, const std::string& name, const Tensor& t,
                       int64_t positions) {
  const Shape want = {1, 1, positions, positions};
  if (Shape(t.shape().begin(), t.shape().end()) != want) {
    return InvalidArg(op, "'", file, "': causal-mask buffer '", name, "' has shape ", ShapeString(t.shape()),
                      ", expected ", ShapeString(want), " (n_positions ", positions, ")");
  }
  absl::StatusOr<Tensor> f = Cast(t, DType::kFloat32);
  if (!f.ok()) {
    return InvalidArg(op, "'", file, "': causal-mask buffer '", name, "' has dtype ", DTypeName(t.dtype()),
                      " that cannot be checked: ", f.status().message());
  }
  DT_ASSIGN_OR_RETURN(std::vector<float> v, f->ToVector<float>());
  for (int64_t r = 0; r < positions; ++r) {
    for (int64_t c = 0; c < positions; ++c) {
      const float expect = c <= r ? 1.f : 0.f;
      if (v[static_cast<size_t>(r * positions + c)] != expect) {
        return InvalidArg(op, "'", file, "': causal-mask buffer '", name, "' holds ",
                          v[static_cast<size_t>(r * positions + c)], " at row ", r, ", column ", c, ", expected ",
                          expect, " (a lower-triangular mask of ones)");
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PositiveInt(const nlohmann::json& j, const char* key, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end()) return InvalidArg("GptConfigFromHfJson", "'", source, "': missing \"", key, "\"");
  // (At most INT32_MAX: llm.c's header and the shapes derived from these hold int.)
  if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > std::numeric_limits<int32_t>::max()) {
    return InvalidArg("GptConfigFromHfJson", "'", source, "': \"", key,
                      "\" must be a positive integer of at most 2^31 - 1, got ", it->dump());
  }
  return it->get<int64_t>();
}

}  // namespace

bool IsHfConv1DWeight(const std::string& name) {
  return absl::EndsWith(name, ".attn.c_attn.weight") || absl::EndsWith(name, ".attn.c_proj.weight") ||
         absl::EndsWith(name, ".mlp.c_fc.weight") || absl::EndsWith(name, ".mlp.c_proj.weight");
}

absl::StatusOr<nn::GPTConfig> GptPreset(const std::string& name) {
  for (const Preset& p : Presets()) {
    if (name == p.name) return p.config;
  }
  return InvalidArg("GptPreset", "unknown model '", name, "'; known: ", absl::StrJoin(GptPresetNames(), ", "));
}

std::vector<std::string> GptPresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : Presets()) names.emplace_back(p.name);
  return names;
}

absl::StatusOr<nn::GPTConfig> GptConfigFromHfJson(const std::string& json_text, const std::string& source) {
  constexpr const char* kOp = "GptConfigFromHfJson";
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArg(kOp, "'", source, "' is not valid JSON");
  if (!j.is_object()) return InvalidArg(kOp, "'", source, "' is not a JSON object");
  auto unsupported = [&](const char* key, const nlohmann::json& value, const char* supported) {
    return absl::InvalidArgumentError(absl::StrCat("[", kOp, "] '", source, "': unsupported \"", key,
                                                   "\": ", value.dump(), " (nn::GPT supports ", supported, ")"));
  };
  if (auto it = j.find("model_type"); it != j.end() && *it != "gpt2") return unsupported("model_type", *it, "\"gpt2\"");
  if (auto it = j.find("activation_function"); it != j.end() && *it != "gelu_new" && *it != "gelu_pytorch_tanh") {
    return unsupported("activation_function", *it, "\"gelu_new\", the tanh approximation");
  }
  if (auto it = j.find("layer_norm_epsilon");
      it != j.end() && (!it->is_number() || std::abs(it->get<double>() - kLayerNormEps) > 1e-12)) {
    return unsupported("layer_norm_epsilon", *it, "1e-05");
  }
  if (auto it = j.find("scale_attn_weights"); it != j.end() && *it != true) {
    return unsupported("scale_attn_weights", *it, "true");
  }
  if (auto it = j.find("scale_attn_by_inverse_layer_idx"); it != j.end() && *it != false) {
    return unsupported("scale_attn_by_inverse_layer_idx", *it, "false");
  }
  if (auto it = j.find("add_cross_attention"); it != j.end() && *it != false) {
    return unsupported("add_cross_attention", *it, "false");
  }
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && *it != true) {
    return unsupported("tie_word_embeddings", *it, "true: the LM head tied to wte");
  }
  nn::GPTConfig c;
  DT_ASSIGN_OR_RETURN(c.vocab_size, PositiveInt(j, "vocab_size", source));
  DT_ASSIGN_OR_RETURN(c.block_size, PositiveInt(j, "n_positions", source));
  DT_ASSIGN_OR_RETURN(c.n_embd, PositiveInt(j, "n_embd", source));
  DT_ASSIGN_OR_RETURN(c.n_layer, PositiveInt(j, "n_layer", source));
  DT_ASSIGN_OR_RETURN(c.n_head, PositiveInt(j, "n_head", source));
  if (c.n_embd % c.n_head != 0) {
    return InvalidArg(kOp, "'", source, "': n_embd ", c.n_embd, " is not a multiple of n_head ", c.n_head);
  }
  // n_inner is compared as n_inner / 4 == n_embd: 4 * n_embd may not fit in 64 bits.
  if (auto it = j.find("n_inner");
      it != j.end() && !it->is_null() &&
      !(it->is_number_integer() && it->get<int64_t>() % 4 == 0 && it->get<int64_t>() / 4 == c.n_embd)) {
    return unsupported("n_inner", *it, absl::StrCat("null or 4 * n_embd = 4 * ", c.n_embd).c_str());
  }
  return c;
}

std::string HfJsonFromGptConfig(const nn::GPTConfig& c) {
  // GPT-2's <|endoftext|> where the vocabulary is GPT-2's (50257, or padded as gpt_train pads
  // it: the rows past 50257 are never produced); else the last id.
  const int64_t eos =
      c.vocab_size >= Gpt2Tokenizer::kGpt2VocabSize ? Gpt2Tokenizer::kGpt2VocabSize - 1 : c.vocab_size - 1;
  nlohmann::json j = {
      {"activation_function", "gelu_new"},
      {"architectures", {"GPT2LMHeadModel"}},
      {"attn_pdrop", 0.1},
      {"bos_token_id", eos},
      {"embd_pdrop", 0.1},
      {"eos_token_id", eos},
      {"initializer_range", 0.02},
      {"layer_norm_epsilon", kLayerNormEps},
      {"model_type", "gpt2"},
      {"n_ctx", c.block_size},
      {"n_embd", c.n_embd},
      {"n_head", c.n_head},
      {"n_inner", nullptr},
      {"n_layer", c.n_layer},
      {"n_positions", c.block_size},
      {"reorder_and_upcast_attn", false},
      {"resid_pdrop", 0.1},
      {"scale_attn_by_inverse_layer_idx", false},
      {"scale_attn_weights", true},
      {"tie_word_embeddings", true},
      {"use_cache", true},
      {"vocab_size", c.vocab_size},
  };
  return j.dump(2) + "\n";
}

const Tensor* HfGpt2::Find(const std::string& name) const {
  for (const auto& [n, t] : params) {
    if (n == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<HfGpt2> ReadHfGpt2(const std::string& path) {
  constexpr const char* kOp = "ReadHfGpt2";
  std::error_code ec;
  const bool is_dir = fs::is_directory(path, ec);
  const std::string file = is_dir ? (fs::path(path) / "model.safetensors").string() : path;
  const std::string config_path = (fs::path(file).parent_path() / "config.json").string();
  DT_ASSIGN_OR_RETURN(std::string config_text, ReadFileBytes(kOp, config_path));
  HfGpt2 out;
  DT_ASSIGN_OR_RETURN(out.config, GptConfigFromHfJson(config_text, config_path));
  DT_ASSIGN_OR_RETURN(NamedTensors st, ReadSafetensors(file));

  const nn::GPTConfig& c = out.config;
  const std::vector<std::pair<std::string, Shape>> shapes = LlmcParamShapes(ShapesConfig(c));
  std::map<std::string, size_t> index;  // our name -> position in shapes
  for (size_t i = 0; i < shapes.size(); ++i) index[shapes[i].first] = i;
  std::vector<Tensor> ours(shapes.size());
  std::vector<std::string> file_names(shapes.size());  // the name each came under
  const Tensor* lm_head = nullptr;
  std::string first_prefixed, first_bare;  // one name of each form, to refuse a mix

  for (const auto& [name, t] : st.tensors) {
    if (name == "lm_head.weight") {
      lm_head = &t;
      continue;
    }
    const bool prefixed = absl::StartsWith(name, kPrefix);
    const std::string base = prefixed ? name.substr(std::char_traits<char>::length(kPrefix)) : name;
    (prefixed ? first_prefixed : first_bare) = name;
    if (!first_prefixed.empty() && !first_bare.empty()) {
      return InvalidArg(kOp, "'", file, "' mixes GPT2LMHeadModel names ('", first_prefixed,
                        "') with GPT2Model names ('", first_bare, "')");
    }
    std::string rest;
    const int64_t layer = LayerOf(base, &rest);
    if (layer >= 0 && layer < c.n_layer && rest == "attn.bias") {
      DT_RETURN_IF_ERROR(CheckMask(kOp, file, name, t, c.block_size));
      continue;
    }
    if (layer >= 0 && layer < c.n_layer && rest == "attn.masked_bias") {
      if (t.numel() != 1) {
        return InvalidArg(kOp, "'", file, "': buffer '", name, "' has shape ", ShapeString(t.shape()),
                          ", expected a scalar");
      }
      continue;
    }
    auto it = index.find(absl::StrCat(kPrefix, base));
    if (it == index.end()) {
      return InvalidArg(kOp, "'", file, "': unknown tensor '", name, "' (not part of a GPT-2 with ", c.n_layer,
                        " layers)");
    }
    const size_t k = it->second;
    if (ours[k].defined()) {
      return InvalidArg(kOp, "'", file, "': tensor '", name, "' given twice (as '", file_names[k], "' too)");
    }
    if (t.dtype() != DType::kFloat32 && t.dtype() != DType::kBFloat16 && t.dtype() != DType::kFloat16) {
      return InvalidArg(kOp, "'", file, "': tensor '", name, "' has dtype ", SafetensorsDTypeName(t.dtype()),
                        ", expected F32 (BF16 and F16 are widened)");
    }
    const bool conv = IsHfConv1DWeight(base);
    Shape want = shapes[k].second;
    if (conv) std::swap(want[0], want[1]);
    if (Shape(t.shape().begin(), t.shape().end()) != want) {
      return InvalidArg(kOp, "'", file, "': tensor '", name, "' has shape ", ShapeString(t.shape()), ", expected ",
                        ShapeString(want), conv ? " (Conv1D [in, out])" : "", " for n_embd ", c.n_embd, ", vocab ",
                        c.vocab_size, ", n_positions ", c.block_size, " of '", config_path, "'");
    }
    if (t.dtype() != DType::kFloat32) out.widened = true;
    DT_ASSIGN_OR_RETURN(Tensor f32, Cast(t, DType::kFloat32));
    if (conv) {
      DT_ASSIGN_OR_RETURN(f32, f32.Transpose(0, 1));
    }
    DT_ASSIGN_OR_RETURN(ours[k], Contiguous(f32));
    file_names[k] = name;
  }
  const std::string form = first_prefixed.empty() ? "" : kPrefix;
  for (size_t k = 0; k < shapes.size(); ++k) {
    if (!ours[k].defined()) {
      const std::string base = shapes[k].first.substr(std::char_traits<char>::length(kPrefix));
      return InvalidArg(kOp, "'", file, "': missing tensor '", form, base, "'");
    }
  }
  if (lm_head != nullptr) {
    const Tensor& wte = ours[0];
    bool tied =
        Shape(lm_head->shape().begin(), lm_head->shape().end()) == Shape(wte.shape().begin(), wte.shape().end());
    if (tied) {
      DT_ASSIGN_OR_RETURN(Tensor f32, Cast(*lm_head, DType::kFloat32));
      DT_ASSIGN_OR_RETURN(std::vector<float> a, f32.ToVector<float>());
      DT_ASSIGN_OR_RETURN(std::vector<float> b, wte.ToVector<float>());
      tied = a == b;
    }
    if (!tied) {
      return InvalidArg(kOp, "'", file, "': tensor 'lm_head.weight' differs from '", file_names[0],
                        "'; nn::GPT ties the LM head to the token embedding");
    }
  }
  for (size_t k = 0; k < shapes.size(); ++k) out.params.emplace_back(shapes[k].first, std::move(ours[k]));
  return out;
}

absl::StatusOr<std::pair<std::string, Tensor>> ToHfGpt2Tensor(const std::string& name, const Tensor& t) {
  if (!absl::StartsWith(name, kPrefix) || !t.defined()) {
    return InvalidArg("ToHfGpt2Tensor", "'", name, "' is not a GPT-2 parameter of nn::GPT");
  }
  DT_ASSIGN_OR_RETURN(Tensor cpu, To(t, Device::Cpu()));
  DT_ASSIGN_OR_RETURN(Tensor f32, Cast(cpu, DType::kFloat32));
  if (IsHfConv1DWeight(name)) {
    if (f32.dim() != 2) {
      return InvalidArg("ToHfGpt2Tensor", "'", name, "' has shape ", ShapeString(t.shape()), ", expected 2 dims");
    }
    DT_ASSIGN_OR_RETURN(f32, f32.Transpose(0, 1));
  }
  DT_ASSIGN_OR_RETURN(Tensor out, Contiguous(f32));
  return std::make_pair(name, std::move(out));
}

absl::Status WriteHfGpt2(const std::string& dir, const nn::GPTConfig& config,
                         absl::Span<const std::pair<std::string, Tensor>> params) {
  constexpr const char* kOp = "WriteHfGpt2";
  DT_RETURN_IF_ERROR(GptConfigFromHfJson(HfJsonFromGptConfig(config), "the config").status());
  const std::vector<std::pair<std::string, Shape>> shapes = LlmcParamShapes(ShapesConfig(config));
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < shapes.size(); ++i) index[shapes[i].first] = i;
  std::vector<std::pair<std::string, Tensor>> hf(shapes.size());
  for (const auto& [name, t] : params) {
    auto it = index.find(name);
    if (it == index.end()) {
      return InvalidArg(kOp, "parameter '", name, "' is not part of a GPT-2 with ", config.n_layer,
                        " layers, writing '", dir, "'");
    }
    if (hf[it->second].second.defined()) {
      return InvalidArg(kOp, "parameter '", name, "' given twice, writing '", dir, "'");
    }
    if (!t.defined() || Shape(t.shape().begin(), t.shape().end()) != shapes[it->second].second ||
        !IsComputeFloat(t.dtype())) {
      return InvalidArg(kOp, "parameter '", name, "' is ",
                        t.defined() ? absl::StrCat(DTypeName(t.dtype()), " ", ShapeString(t.shape())) : "undefined",
                        ", expected a float tensor of shape ", ShapeString(shapes[it->second].second), ", writing '",
                        dir, "'");
    }
    DT_ASSIGN_OR_RETURN(hf[it->second], ToHfGpt2Tensor(name, t));
  }
  for (size_t k = 0; k < shapes.size(); ++k) {
    if (!hf[k].second.defined())
      return InvalidArg(kOp, "parameter '", shapes[k].first, "' missing, writing '", dir, "'");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("[", kOp, "] cannot create '", dir, "': ", ec.message()));
  DT_RETURN_IF_ERROR(WriteSafetensors((fs::path(dir) / "model.safetensors").string(), hf, {{"format", "pt"}}));
  const std::string text = HfJsonFromGptConfig(config);
  const absl::string_view pieces[] = {text};
  return WriteFileAtomically(kOp, (fs::path(dir) / "config.json").string(), pieces);
}

}  // namespace dtensor::gpt
