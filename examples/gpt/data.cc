#include "examples/gpt/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/tensor/status.h"

namespace dtensor::gpt {
namespace {

static_assert(std::endian::native == std::endian::little,
              "llm.c files are little-endian; big-endian hosts would need byte swapping");

namespace fs = std::filesystem;

// Fortune files: text files whose fortunes are separated by lines holding only "%".
void AppendFortunes(absl::string_view text, std::string* out) {
  std::vector<absl::string_view> lines;
  auto flush = [&]() {
    // Drop blank lines at either end of a fortune; skip empty fortunes.
    size_t begin = 0, end = lines.size();
    while (begin < end && lines[begin].find_first_not_of(" \t\r") == absl::string_view::npos) ++begin;
    while (end > begin && lines[end - 1].find_first_not_of(" \t\r") == absl::string_view::npos) --end;
    if (begin < end) {
      if (!out->empty()) out->push_back('\n');  // blank line between fortunes
      for (size_t i = begin; i < end; ++i) absl::StrAppend(out, lines[i], "\n");
    }
    lines.clear();
  };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == absl::string_view::npos) nl = text.size();
    absl::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line == "%" || line == "%\r") {
      flush();
    } else {
      lines.push_back(line);
    }
  }
  flush();
}

}  // namespace

absl::StatusOr<std::vector<uint16_t>> LoadTextTokens(const std::string& path) {
  DT_ASSIGN_OR_RETURN(std::string text, ReadFileBytes("LoadTextTokens", path));
  if (text.empty()) return InvalidArg("LoadTextTokens", "file '", path, "' is empty");
  std::vector<uint16_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

absl::StatusOr<std::vector<uint16_t>> LoadLlmcTokens(const std::string& path) {
  constexpr const char* kOp = "LoadLlmcTokens";
  DT_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(kOp, path));
  constexpr size_t kHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);
  if (bytes.size() < kHeaderBytes) {
    return InvalidArg(kOp, "file '", path, "' has ", bytes.size(), " bytes, less than the ", kHeaderBytes,
                      "-byte header of an llm.c token file");
  }
  int32_t header[kLlmcHeaderInts];
  std::memcpy(header, bytes.data(), kHeaderBytes);
  if (header[0] != kLlmcTokensMagic) {
    return InvalidArg(kOp, "file '", path, "' has magic ", header[0], ", expected ", kLlmcTokensMagic,
                      " (an llm.c token file)", header[0] == 20240326 ? "; this is an llm.c model checkpoint" : "");
  }
  if (header[1] != kLlmcTokensVersion) {
    return InvalidArg(kOp, "file '", path, "' has version ", header[1], ", only version ", kLlmcTokensVersion,
                      " is supported");
  }
  const int64_t count = header[2];
  if (count <= 0) return InvalidArg(kOp, "file '", path, "' declares ", count, " tokens");
  const uint64_t expected = kHeaderBytes + static_cast<uint64_t>(count) * sizeof(uint16_t);
  if (bytes.size() != expected) {
    return InvalidArg(kOp, "file '", path, "' declares ", count, " tokens, so ", expected, " bytes, but has ",
                      bytes.size(), " bytes");
  }
  std::vector<uint16_t> tokens(static_cast<size_t>(count));
  std::memcpy(tokens.data(), bytes.data() + kHeaderBytes, tokens.size() * sizeof(uint16_t));
  return tokens;
}

absl::Status WriteLlmcTokens(const std::string& path, absl::Span<const uint16_t> tokens) {
  if (tokens.empty() || tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return InvalidArg("WriteLlmcTokens", "cannot write ", tokens.size(), " tokens to '", path,
                      "' (an llm.c token file holds 1 to 2^31-1)");
  }
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = kLlmcTokensMagic;
  header[1] = kLlmcTokensVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  const absl::string_view pieces[] = {
      absl::string_view(reinterpret_cast<const char*>(header), sizeof(header)),
      absl::string_view(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(uint16_t))};
  return WriteFileAtomically("WriteLlmcTokens", path, pieces);
}

absl::Status ValidateTokens(absl::Span<const uint16_t> tokens, int64_t vocab_size, const std::string& source) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab_size) {
      return InvalidArg("ValidateTokens", "token ", tokens[i], " at position ", i, " of '", source,
                        "' is outside the model's vocabulary of ", vocab_size);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TokenLoader> TokenLoader::Create(std::vector<uint16_t> tokens, int64_t B, int64_t T) {
  if (B <= 0 || T <= 0)
    return InvalidArg("TokenLoader", "batch size B=", B, " and sequence length T=", T, " must be positive");
  if (B > (int64_t{1} << 40) / T) {  // B*T+1 must not overflow; far more tokens than any file
    return InvalidArg("TokenLoader", "a batch of B=", B, " x T=", T, " is too large");
  }
  if (static_cast<int64_t>(tokens.size()) < B * T + 1) {
    return InvalidArg("TokenLoader", "a batch of B=", B, " x T=", T, " needs B*T+1 = ", B * T + 1,
                      " tokens, but there are ", tokens.size());
  }
  return TokenLoader(std::move(tokens), B, T);
}

absl::Status TokenLoader::set_position(int64_t pos) {
  if (pos < 0 || pos >= num_tokens()) {
    return absl::InvalidArgumentError(
        absl::StrCat("[TokenLoader] position ", pos, " is outside [0, ", num_tokens(), ")"));
  }
  pos_ = pos;
  return absl::OkStatus();
}

Batch TokenLoader::Next() {
  const int64_t n = B_ * T_;
  // A position set too close to the end for this batch (a checkpoint saved with a smaller
  // batch or a longer corpus) starts the next epoch, as the end of a batch does below.
  if (pos_ + n + 1 > num_tokens()) pos_ = 0;
  Batch batch;
  batch.inputs.resize(static_cast<size_t>(n));
  batch.targets.resize(static_cast<size_t>(n));
  const uint16_t* src = tokens_.data() + pos_;
  for (int64_t i = 0; i < n; ++i) {
    batch.inputs[static_cast<size_t>(i)] = src[i];
    batch.targets[static_cast<size_t>(i)] = src[i + 1];
  }
  pos_ += n;
  if (pos_ + n + 1 > num_tokens()) pos_ = 0;
  return batch;
}

absl::StatusOr<std::string> PrepareFortunesCorpus(const std::string& out_path, const std::vector<std::string>& dirs) {
  constexpr const char* kOp = "PrepareFortunesCorpus";
  std::string corpus;
  int files = 0;
  for (const std::string& dir : dirs) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<std::string> names;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.empty() || name[0] == '.') continue;
      if (name.ends_with(".dat") || name.ends_with(".u8")) continue;
      std::error_code sec;
      // symlink_status: symlinks (the *.u8 duplicates) and directories (off/) are skipped.
      if (!fs::is_regular_file(it->symlink_status(sec)) || sec) continue;
      names.push_back(name);
    }
    if (ec) return absl::InternalError(absl::StrCat("[", kOp, "] cannot list '", dir, "': ", ec.message()));
    std::sort(names.begin(), names.end());
    for (const std::string& name : names) {
      const std::string path = (fs::path(dir) / name).string();
      DT_ASSIGN_OR_RETURN(std::string text, ReadFileBytes(kOp, path));
      if (text.find('\0') != std::string::npos) continue;  // not a text file
      AppendFortunes(text, &corpus);
      ++files;
    }
  }
  if (files == 0 || corpus.empty()) {
    return absl::NotFoundError(absl::StrCat("[", kOp, "] no fortune files with text in ", absl::StrJoin(dirs, ", "),
                                            " (install Debian's fortunes package: apt-get install fortunes)"));
  }
  const absl::string_view pieces[] = {corpus};
  DT_RETURN_IF_ERROR(WriteFileAtomically(kOp, out_path, pieces));
  return out_path;
}

}  // namespace dtensor::gpt
