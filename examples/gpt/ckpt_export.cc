#include "examples/gpt/ckpt_export.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/nn/file_io.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "examples/gpt/hf_gpt2.h"
#include "examples/gpt/llmc.h"
#include "examples/gpt/tokenizer.h"
#include "nlohmann/json.hpp"

namespace dtensor::gpt {
namespace {

namespace fs = std::filesystem;
constexpr const char* kModel = "model.";  // gpt_train's prefix of the parameters

struct Stored {
  Shape shape;
  DType dtype = DType::kFloat32;
};

// The checkpoint's "model." tensors (state_dict name -> global shape and dtype), as
// CheckpointTensors reads them from its metadata.json (checked, deep nesting refused).
absl::StatusOr<std::map<std::string, Stored>> ReadModelIndex(const std::string& dir) {
  DT_ASSIGN_OR_RETURN(const std::vector<CheckpointTensor> tensors, CheckpointTensors(dir));
  std::map<std::string, Stored> index;
  for (const CheckpointTensor& t : tensors) {
    if (!absl::StartsWith(t.name, kModel)) continue;
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kBFloat16 && t.dtype != DType::kFloat16) {
      return InvalidArg("ExportCheckpoint", "'", dir, "': tensor '", t.name, "' is ", DTypeName(t.dtype),
                        ", not a float dtype (float32, bfloat16, float16)");
    }
    index[t.name.substr(std::char_traits<char>::length(kModel))] = Stored{.shape = t.shape, .dtype = t.dtype};
  }
  return index;
}

// Our parameter `name` [shape], read whole from checkpoint `dir` and widened to float32.
absl::StatusOr<Tensor> LoadParam(const std::string& dir, const std::map<std::string, Stored>& index,
                                 const std::string& name, const Shape& shape) {
  auto it = index.find(name);
  if (it == index.end()) return InvalidArg("ExportCheckpoint", "'", dir, "' has no tensor '", kModel, name, "'");
  if (it->second.shape != shape) {
    return InvalidArg("ExportCheckpoint", "'", dir, "': tensor '", kModel, name, "' is ", ShapeString(it->second.shape),
                      ", expected ", ShapeString(shape));
  }
  DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(shape, it->second.dtype));
  DT_RETURN_IF_ERROR(LoadCheckpoint(dir, {StateEntry{.name = kModel + name, .tensor = t}}));
  return Cast(t, DType::kFloat32);
}

// `c` as llm.c's header holds it (32-bit ints: a value beyond is InvalidArgument naming it).
absl::StatusOr<LlmcConfig> LlmcOf(const nn::GPTConfig& c) {
  const int64_t padded_vocab = c.vocab_size > std::numeric_limits<int64_t>::max() - 127
                                   ? std::numeric_limits<int64_t>::max()
                                   : (c.vocab_size + 127) / 128 * 128;
  const std::pair<const char*, int64_t> fields[] = {
      {"block_size", c.block_size}, {"vocab_size", c.vocab_size}, {"padded vocab_size", padded_vocab},
      {"n_layer", c.n_layer},       {"n_head", c.n_head},         {"n_embd", c.n_embd}};
  for (const auto& [field, v] : fields) {
    if (v < 0 || v > std::numeric_limits<int32_t>::max()) {
      return InvalidArg("ExportCheckpoint", field, " ", v, " does not fit llm.c's 32-bit header (0 to ",
                        std::numeric_limits<int32_t>::max(), ")");
    }
  }
  LlmcConfig l;
  l.max_seq_len = static_cast<int>(c.block_size);
  l.vocab_size = static_cast<int>(c.vocab_size);
  l.padded_vocab_size = static_cast<int>(padded_vocab);
  l.num_layers = static_cast<int>(c.n_layer);
  l.num_heads = static_cast<int>(c.n_head);
  l.channels = static_cast<int>(c.n_embd);
  return l;
}

// A file written piece by piece to a temporary name and renamed over `path` by Commit (then
// the directory fsync'ed); destroyed uncommitted, it removes the temporary file.
class AtomicFile {
 public:
  static absl::StatusOr<std::unique_ptr<AtomicFile>> Create(const std::string& path) {
    static std::atomic<uint64_t> counter{0};
    auto f = std::unique_ptr<AtomicFile>(new AtomicFile(path));
    f->tmp_ = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
    f->fd_ = ::open(f->tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (f->fd_ < 0) return f->Error("cannot create", f->tmp_);
    return f;
  }
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  absl::Status Append(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return Error("cannot write", tmp_);
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }
  absl::Status Commit() {
    if (::fsync(fd_) != 0) return Error("cannot fsync", tmp_);
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) return Error("cannot close", tmp_);
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) return Error("cannot rename the temporary file to", path_);
    committed_ = true;
    const std::string dir = fs::path(path_).parent_path().string();
    const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      const int err = ::fsync(dfd) == 0 ? 0 : errno;
      ::close(dfd);
      if (err != 0 && err != EINVAL && err != ENOTSUP) {
        errno = err;
        return Error("cannot fsync the directory of", path_);
      }
    }
    return absl::OkStatus();
  }

 private:
  explicit AtomicFile(std::string path) : path_(std::move(path)) {}
  absl::Status Error(const char* what, const std::string& p) const {
    return absl::ErrnoToStatus(errno, absl::StrCat("[ExportCheckpoint] ", what, " '", p, "'"));
  }
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

absl::StatusOr<nn::GPTConfig> GptConfigOfCheckpoint(const std::string& dir, int64_t n_head) {
  constexpr const char* kOp = "GptConfigOfCheckpoint";
  DT_ASSIGN_OR_RETURN(auto index, ReadModelIndex(dir));
  auto wte = index.find("transformer.wte.weight");
  auto wpe = index.find("transformer.wpe.weight");
  if (wte == index.end() || wpe == index.end() || wte->second.shape.size() != 2 || wpe->second.shape.size() != 2) {
    return InvalidArg(kOp, "'", dir, "' holds no GPT-2 (model.transformer.wte.weight and wpe.weight, 2-d each)");
  }
  nn::GPTConfig c;
  c.vocab_size = wte->second.shape[0];
  c.n_embd = wte->second.shape[1];
  c.block_size = wpe->second.shape[0];
  c.n_layer = 0;
  while (index.count(absl::StrCat("transformer.h.", c.n_layer, ".ln_1.weight"))) ++c.n_layer;
  if (absl::StatusOr<Tensor> heads = Zeros({1}, DType::kInt64);
      heads.ok() && LoadCheckpoint(dir, {{std::string(kHeadsTensor), *heads}}).ok()) {
    c.n_head = heads->data<int64_t>()[0];  // gpt_train records it
    if (c.n_head <= 0) return InvalidArg(kOp, "'", dir, "': ", kHeadsTensor, " is ", c.n_head);
    if (n_head > 0 && n_head != c.n_head) {  // the same weights split into other heads: another model
      return InvalidArg(kOp, "'", dir, "' was trained with ", c.n_head, " heads, not ", n_head,
                        " (leave --n-head out to use the recorded count)");
    }
  } else if (n_head > 0) {
    c.n_head = n_head;
  } else {
    c.n_head = 0;
    for (const std::string& name : GptPresetNames()) {
      const nn::GPTConfig p = *GptPreset(name);
      if (p.n_layer == c.n_layer && p.n_embd == c.n_embd) c.n_head = p.n_head;
    }
    if (c.n_head == 0) {
      return InvalidArg(kOp, "'", dir, "': a GPT-2 with ", c.n_layer, " layers and n_embd ", c.n_embd,
                        " matches no preset; give its number of heads (--n-head)");
    }
  }
  if (c.n_embd % c.n_head != 0) {
    return InvalidArg(kOp, "'", dir, "': n_embd ", c.n_embd, " is not a multiple of n_head ", c.n_head);
  }
  return c;
}

absl::Status ExportCheckpointToHf(const std::string& dir, const nn::GPTConfig& config, const std::string& out_dir) {
  constexpr const char* kOp = "ExportCheckpointToHf";
  DT_RETURN_IF_ERROR(GptConfigFromHfJson(HfJsonFromGptConfig(config), "the config").status());
  DT_ASSIGN_OR_RETURN(auto index, ReadModelIndex(dir));
  DT_ASSIGN_OR_RETURN(LlmcConfig lc, LlmcOf(config));
  lc.padded_vocab_size = lc.vocab_size;
  const auto shapes = LlmcParamShapes(lc);
  // The header first (every tensor F32, in our order; Conv1D shapes transposed), then the data.
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  for (const auto& [name, shape] : shapes) {
    Shape hf_shape = shape;
    if (IsHfConv1DWeight(name)) std::swap(hf_shape[0], hf_shape[1]);
    const int64_t bytes = NumElements(shape) * 4;
    header[name] = {{"dtype", "F32"}, {"shape", hf_shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t len = text.size();
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("[", kOp, "] cannot create '", out_dir, "': ", ec.message()));
  DT_ASSIGN_OR_RETURN(auto file, AtomicFile::Create((fs::path(out_dir) / "model.safetensors").string()));
  DT_RETURN_IF_ERROR(file->Append(&len, 8));  // little-endian hosts only, as the rest of dtensor
  DT_RETURN_IF_ERROR(file->Append(text.data(), text.size()));
  for (const auto& [name, shape] : shapes) {
    DT_ASSIGN_OR_RETURN(Tensor t, LoadParam(dir, index, name, shape));
    DT_ASSIGN_OR_RETURN(auto hf, ToHfGpt2Tensor(name, t));
    DT_RETURN_IF_ERROR(file->Append(hf.second.data<float>(), static_cast<size_t>(hf.second.numel()) * 4));
  }
  DT_RETURN_IF_ERROR(file->Commit());
  const std::string json = HfJsonFromGptConfig(config);
  const absl::string_view pieces[] = {json};
  return WriteFileAtomically(kOp, (fs::path(out_dir) / "config.json").string(), pieces);
}

absl::Status ExportCheckpointToLlmc(const std::string& dir, const nn::GPTConfig& config, const std::string& out_path) {
  DT_ASSIGN_OR_RETURN(auto index, ReadModelIndex(dir));
  DT_ASSIGN_OR_RETURN(const LlmcConfig c, LlmcOf(config));  // c.vocab_size: the checkpoint's rows
  std::map<std::string, Shape> shapes;
  for (const auto& [name, shape] : LlmcParamShapes(c)) shapes[name] = shape;
  // llm.c's vocab_size is the real vocabulary (what it samples from and checks tokens
  // against): a GPT-2 vocabulary padded by gpt_train (50304 rows) is GPT-2's 50257.
  LlmcConfig in_header = c;
  if (config.vocab_size >= Gpt2Tokenizer::kGpt2VocabSize) in_header.vocab_size = Gpt2Tokenizer::kGpt2VocabSize;
  const std::vector<int32_t> header = LlmcFp32Header(in_header);
  DT_ASSIGN_OR_RETURN(auto file, AtomicFile::Create(out_path));
  DT_RETURN_IF_ERROR(file->Append(header.data(), header.size() * sizeof(int32_t)));
  auto put = [&](const std::string& name) -> absl::Status {
    DT_ASSIGN_OR_RETURN(Tensor t, LoadParam(dir, index, name, shapes.at(name)));
    return file->Append(t.data<float>(), static_cast<size_t>(t.numel()) * 4);
  };
  DT_RETURN_IF_ERROR(put("transformer.wte.weight"));
  const std::vector<float> pad(static_cast<size_t>(c.padded_vocab_size - c.vocab_size) * c.channels, 0.f);
  DT_RETURN_IF_ERROR(file->Append(pad.data(), pad.size() * 4));
  DT_RETURN_IF_ERROR(put("transformer.wpe.weight"));
  // llm.c's order: each kind for every layer, kind after kind (see llmc.h).
  for (const char* kind :
       {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
        "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"}) {
    for (int64_t l = 0; l < c.num_layers; ++l) DT_RETURN_IF_ERROR(put(absl::StrCat("transformer.h.", l, ".", kind)));
  }
  DT_RETURN_IF_ERROR(put("transformer.ln_f.weight"));
  DT_RETURN_IF_ERROR(put("transformer.ln_f.bias"));
  return file->Commit();
}

}  // namespace dtensor::gpt
