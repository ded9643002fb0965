#include "examples/gpt/llmc.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"
#include "examples/gpt/data.h"

namespace dtensor::gpt {
namespace {

constexpr int64_t kHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

std::string LayerName(int64_t layer, const char* suffix) { return absl::StrCat("transformer.h.", layer, ".", suffix); }

// One run of elements in the file: `count` elements for params[index] (or skipped when index
// is -1), at element offset `offset` of that tensor.
struct Segment {
  int64_t index;
  int64_t offset;
  int64_t count;
};

// The file's parameter layout as segments of the state_dict tensors (LlmcParamShapes order).
std::vector<Segment> FileSegments(const LlmcConfig& c) {
  const int64_t L = c.num_layers, C = c.channels, V = c.vocab_size, Vp = c.padded_vocab_size;
  // Index in LlmcParamShapes: 0 wte, 1 wpe, 2 + 12 * layer + k for the layer tensors, then ln_f.
  auto layer_index = [](int64_t layer, int64_t k) { return 2 + 12 * layer + k; };
  std::vector<Segment> segs;
  segs.push_back({0, 0, V * C});
  if (Vp > V) segs.push_back({-1, 0, (Vp - V) * C});
  segs.push_back({1, 0, static_cast<int64_t>(c.max_seq_len) * C});
  // (position k of the tensor within a layer's 12, elements per layer) in llm.c's file order.
  const std::pair<int64_t, int64_t> per_layer[] = {
      {0, C},           // ln1w
      {1, C},           // ln1b
      {2, 3 * C * C},   // qkvw
      {3, 3 * C},       // qkvb
      {4, C * C},       // attprojw
      {5, C},           // attprojb
      {6, C},           // ln2w
      {7, C},           // ln2b
      {8, 4 * C * C},   // fcw
      {9, 4 * C},       // fcb
      {10, 4 * C * C},  // fcprojw
      {11, C},          // fcprojb
  };
  for (const auto& [k, n] : per_layer) {
    for (int64_t l = 0; l < L; ++l) segs.push_back({layer_index(l, k), 0, n});
  }
  segs.push_back({2 + 12 * L, 0, C});      // lnfw
  segs.push_back({2 + 12 * L + 1, 0, C});  // lnfb
  return segs;
}

absl::Status CheckConfig(const char* op, const std::string& path, const LlmcConfig& c) {
  if (c.max_seq_len <= 0 || c.vocab_size <= 0 || c.padded_vocab_size <= 0 || c.num_layers <= 0 || c.num_heads <= 0 ||
      c.channels <= 0) {
    return InvalidArg(op, "'", path, "': header values must be positive: max_seq_len=", c.max_seq_len,
                      " vocab_size=", c.vocab_size, " padded_vocab_size=", c.padded_vocab_size,
                      " num_layers=", c.num_layers, " num_heads=", c.num_heads, " channels=", c.channels);
  }
  if (c.padded_vocab_size < c.vocab_size) {
    return InvalidArg(op, "'", path, "': padded_vocab_size ", c.padded_vocab_size, " is less than vocab_size ",
                      c.vocab_size);
  }
  if (c.channels % c.num_heads != 0) {
    return InvalidArg(op, "'", path, "': channels ", c.channels, " is not divisible by num_heads ", c.num_heads);
  }
  return absl::OkStatus();
}

// Total parameter elements in the file (padded wte), computed without overflow; -1 when it
// exceeds 2^60 (no such file can exist).
int64_t FileElements(const LlmcConfig& c) {
  using u128 = unsigned __int128;
  const u128 L = static_cast<u128>(c.num_layers), C = static_cast<u128>(c.channels);
  const u128 n = static_cast<u128>(c.padded_vocab_size) * C + static_cast<u128>(c.max_seq_len) * C +
                 L * (12 * C * C + 13 * C) + 2 * C;
  // Past 2^60 elements no file holds them, and their bytes (x 4, plus the header) would not fit
  // int64 (2^62 let a fuzzed header overflow the byte count: UBSan,
  // tests/fuzz/regressions/llmc_checkpoint/bytes_overflow).
  return n > (static_cast<u128>(1) << 60) ? -1 : static_cast<int64_t>(n);
}

// Reads exactly n bytes from fd at its current position; false with errno set (0 at end of file).
bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (r == 0) {
      errno = 0;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

const Tensor* LlmcCheckpoint::Find(const std::string& name) const {
  for (const auto& [n, t] : params) {
    if (n == name) return &t;
  }
  return nullptr;
}

std::vector<std::pair<std::string, Shape>> LlmcParamShapes(const LlmcConfig& c) {
  const int64_t C = c.channels;
  std::vector<std::pair<std::string, Shape>> shapes;
  shapes.push_back({"transformer.wte.weight", {c.vocab_size, C}});
  shapes.push_back({"transformer.wpe.weight", {c.max_seq_len, C}});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    shapes.push_back({LayerName(l, "ln_1.weight"), {C}});
    shapes.push_back({LayerName(l, "ln_1.bias"), {C}});
    shapes.push_back({LayerName(l, "attn.c_attn.weight"), {3 * C, C}});
    shapes.push_back({LayerName(l, "attn.c_attn.bias"), {3 * C}});
    shapes.push_back({LayerName(l, "attn.c_proj.weight"), {C, C}});
    shapes.push_back({LayerName(l, "attn.c_proj.bias"), {C}});
    shapes.push_back({LayerName(l, "ln_2.weight"), {C}});
    shapes.push_back({LayerName(l, "ln_2.bias"), {C}});
    shapes.push_back({LayerName(l, "mlp.c_fc.weight"), {4 * C, C}});
    shapes.push_back({LayerName(l, "mlp.c_fc.bias"), {4 * C}});
    shapes.push_back({LayerName(l, "mlp.c_proj.weight"), {C, 4 * C}});
    shapes.push_back({LayerName(l, "mlp.c_proj.bias"), {C}});
  }
  shapes.push_back({"transformer.ln_f.weight", {C}});
  shapes.push_back({"transformer.ln_f.bias", {C}});
  return shapes;
}

std::vector<int32_t> LlmcFp32Header(const LlmcConfig& c) {
  std::vector<int32_t> header(kLlmcHeaderInts, 0);
  header[0] = kLlmcModelMagic;
  header[1] = kLlmcVersionFp32;
  header[2] = c.max_seq_len;
  header[3] = c.vocab_size;
  header[4] = c.num_layers;
  header[5] = c.num_heads;
  header[6] = c.channels;
  header[7] = c.padded_vocab_size;
  return header;
}

absl::StatusOr<LlmcCheckpoint> ReadLlmcCheckpoint(const std::string& path) {
  constexpr const char* kOp = "ReadLlmcCheckpoint";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("[", kOp, "] no such file '", path, "'"));
    return absl::ErrnoToStatus(errno, absl::StrCat("[", kOp, "] cannot open '", path, "'"));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("[", kOp, "] cannot stat '", path, "'"));
  const int64_t file_size = st.st_size;
  if (file_size < kHeaderBytes) {
    return InvalidArg(kOp, "'", path, "' has ", file_size, " bytes, less than the ", kHeaderBytes,
                      "-byte header of an llm.c checkpoint");
  }
  int32_t header[kLlmcHeaderInts];
  if (!ReadAll(fd, header, sizeof(header))) {
    return absl::ErrnoToStatus(errno, absl::StrCat("[", kOp, "] cannot read the header of '", path, "'"));
  }
  if (header[0] != kLlmcModelMagic) {
    return InvalidArg(kOp, "'", path, "' has magic ", header[0], ", expected ", kLlmcModelMagic,
                      " (an llm.c GPT-2 checkpoint)",
                      header[0] == kLlmcTokensMagic ? "; this is an llm.c token file (use --train-bin)" : "");
  }
  LlmcConfig c;
  c.version = header[1];
  if (c.version != kLlmcVersionFp32 && c.version != kLlmcVersionBf16) {
    return absl::UnimplementedError(absl::StrCat(
        "[", kOp, "] '", path, "' is an llm.c checkpoint of version ", c.version,
        "; only version 3 (float32) and version 5 (bfloat16) are supported (versions 1, 2 and 4 were llm.c "
        "development formats without padded vocab or with reordered layernorms: re-export with llm.c's "
        "train_gpt2.py)"));
  }
  c.max_seq_len = header[2];
  c.vocab_size = header[3];
  c.num_layers = header[4];
  c.num_heads = header[5];
  c.channels = header[6];
  c.padded_vocab_size = header[7];
  DT_RETURN_IF_ERROR(CheckConfig(kOp, path, c));
  const int64_t elements = FileElements(c);
  const int64_t elem_bytes = c.version == kLlmcVersionBf16 ? 2 : 4;
  const int64_t expected = elements < 0 ? -1 : kHeaderBytes + elements * elem_bytes;
  if (expected != file_size) {
    return InvalidArg(kOp, "'", path, "' has ", file_size, " bytes, but its header (version ", c.version,
                      ", max_seq_len=", c.max_seq_len, " padded_vocab_size=", c.padded_vocab_size,
                      " num_layers=", c.num_layers, " channels=", c.channels, ") implies ",
                      expected < 0 ? std::string("an impossible size") : absl::StrCat(expected, " bytes"),
                      file_size < expected || expected < 0 ? " (truncated?)" : " (trailing data?)");
  }

  LlmcCheckpoint ckpt;
  ckpt.config = c;
  std::vector<std::pair<std::string, Shape>> shapes = LlmcParamShapes(c);
  ckpt.params.reserve(shapes.size());
  for (auto& [name, shape] : shapes) {
    DT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(shape, DType::kFloat32));
    ckpt.params.emplace_back(std::move(name), std::move(t));
  }
  std::vector<uint16_t> buf;
  constexpr int64_t kChunk = 1 << 20;  // bf16 elements converted at a time
  for (const Segment& s : FileSegments(c)) {
    if (s.index < 0) {
      if (::lseek(fd, s.count * elem_bytes, SEEK_CUR) < 0) {
        return absl::ErrnoToStatus(errno, absl::StrCat("[", kOp, "] cannot seek in '", path, "'"));
      }
      continue;
    }
    float* dst = ckpt.params[static_cast<size_t>(s.index)].second.data<float>() + s.offset;
    bool ok = true;
    if (elem_bytes == 4) {
      ok = ReadAll(fd, dst, static_cast<size_t>(s.count) * 4);
    } else {
      for (int64_t done = 0; ok && done < s.count; done += kChunk) {
        const int64_t n = std::min(kChunk, s.count - done);
        buf.resize(static_cast<size_t>(n));
        ok = ReadAll(fd, buf.data(), static_cast<size_t>(n) * 2);
        for (int64_t i = 0; ok && i < n; ++i) dst[done + i] = Bf16ToFloat(buf[static_cast<size_t>(i)]);
      }
    }
    if (!ok) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat("[", kOp, "] cannot read '", ckpt.params[static_cast<size_t>(s.index)].first, "' from '",
                              path, "'"));
    }
  }
  return ckpt;
}

absl::Status WriteLlmcCheckpoint(const std::string& path, const LlmcConfig& config,
                                 absl::Span<const std::pair<std::string, Tensor>> params) {
  constexpr const char* kOp = "WriteLlmcCheckpoint";
  LlmcConfig c = config;
  c.version = kLlmcVersionFp32;
  if (c.padded_vocab_size <= 0 && c.vocab_size > 0) c.padded_vocab_size = (c.vocab_size + 127) / 128 * 128;
  DT_RETURN_IF_ERROR(CheckConfig(kOp, path, c));
  if (FileElements(c) < 0) return InvalidArg(kOp, "'", path, "': the config describes an impossibly large model");

  const std::vector<std::pair<std::string, Shape>> shapes = LlmcParamShapes(c);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < shapes.size(); ++i) index[shapes[i].first] = i;
  std::vector<Tensor> host(shapes.size());
  bool wte_padded = false;
  for (const auto& [name, t] : params) {
    auto it = index.find(name);
    if (it == index.end()) {
      return InvalidArg(kOp, "parameter '", name, "' is not part of a GPT-2 with ", c.num_layers, " layers, writing '",
                        path, "'");
    }
    if (host[it->second].defined()) return InvalidArg(kOp, "parameter '", name, "' given twice, writing '", path, "'");
    if (!t.defined()) return InvalidArg(kOp, "parameter '", name, "' is undefined, writing '", path, "'");
    const Shape& want = shapes[it->second].second;
    const bool is_wte = it->second == 0;
    const Shape padded = {c.padded_vocab_size, c.channels};
    const bool shape_ok = Shape(t.shape().begin(), t.shape().end()) == want ||
                          (is_wte && Shape(t.shape().begin(), t.shape().end()) == padded);
    if (!shape_ok) {
      return InvalidArg(kOp, "parameter '", name, "' has shape ", ShapeString(t.shape()), ", expected ",
                        ShapeString(want), is_wte ? absl::StrCat(" or ", ShapeString(padded)) : std::string(),
                        ", writing '", path, "'");
    }
    if (!IsComputeFloat(t.dtype())) {
      return InvalidArg(kOp, "parameter '", name, "' has dtype ", DTypeName(t.dtype()),
                        ", expected a floating point type, writing '", path, "'");
    }
    if (is_wte) wte_padded = t.size(0) == c.padded_vocab_size;
    DT_ASSIGN_OR_RETURN(Tensor cpu, To(t, Device::Cpu()));
    DT_ASSIGN_OR_RETURN(Tensor f32, Cast(cpu, DType::kFloat32));
    DT_ASSIGN_OR_RETURN(host[it->second], Contiguous(f32));
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (!host[i].defined()) return InvalidArg(kOp, "parameter '", shapes[i].first, "' missing, writing '", path, "'");
  }

  const std::vector<int32_t> header = LlmcFp32Header(c);
  const std::vector<float> zeros(
      wte_padded ? 0 : static_cast<size_t>(c.padded_vocab_size - c.vocab_size) * static_cast<size_t>(c.channels), 0.f);
  std::vector<absl::string_view> pieces;
  pieces.emplace_back(reinterpret_cast<const char*>(header.data()), header.size() * sizeof(int32_t));
  for (const Segment& s : FileSegments(c)) {
    if (s.index < 0) {
      if (!wte_padded) pieces.emplace_back(reinterpret_cast<const char*>(zeros.data()), zeros.size() * sizeof(float));
      continue;
    }
    const Tensor& t = host[static_cast<size_t>(s.index)];
    int64_t count = s.count;
    if (s.index == 0 && wte_padded) count = t.numel();  // wte given padded: write all Vp rows
    pieces.emplace_back(reinterpret_cast<const char*>(t.data<float>() + s.offset),
                        static_cast<size_t>(count) * sizeof(float));
  }
  return WriteFileAtomically(kOp, path, pieces);
}

}  // namespace dtensor::gpt
