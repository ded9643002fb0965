// Training data for the GPT trainer: token streams from a text file (byte-level) or from
// llm.c's token files, a sequential batch loader with llm.c's semantics, and a real English
// corpus built from Debian's fortunes package.
//
//   DT_ASSIGN_OR_RETURN(std::string path, gpt::PrepareFortunesCorpus("/tmp/fortunes.txt"));
//   DT_ASSIGN_OR_RETURN(std::vector<uint16_t> tokens, gpt::LoadTextTokens(path));  // vocab 256
//   DT_RETURN_IF_ERROR(gpt::ValidateTokens(tokens, /*vocab_size=*/256, path));
//   DT_ASSIGN_OR_RETURN(gpt::TokenLoader loader, gpt::TokenLoader::Create(std::move(tokens), B, T));
//   for (int step = 0; step < steps; ++step) {
//     gpt::Batch batch = loader.Next();  // batch.inputs / batch.targets: B*T ints, row-major [B, T]
//     ...
//   }
//
// llm.c token file (e.g. from llm.c's dev/data/*.py): 256 little-endian int32 header words
// ([0] magic 20240520, [1] version 1, [2] token count N), then N uint16 tokens; the file size
// must be exactly 1024 + 2 N bytes.
#ifndef DTENSOR_EXAMPLES_GPT_DATA_H_
#define DTENSOR_EXAMPLES_GPT_DATA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "dtensor/nn/file_io.h"  // WriteFileAtomically, ReadFileBytes

namespace dtensor::gpt {

inline constexpr int32_t kLlmcTokensMagic = 20240520;
inline constexpr int32_t kLlmcTokensVersion = 1;
inline constexpr int kLlmcHeaderInts = 256;  // header words of llm.c's token and model files

// The bytes of a text file, one token per byte (vocab 256). NotFound for a missing file,
// InvalidArgument for an empty one.
absl::StatusOr<std::vector<uint16_t>> LoadTextTokens(const std::string& path);

// The tokens of an llm.c token file. NotFound for a missing file; InvalidArgument naming the
// file and the values for a short header, wrong magic, unknown version, a non-positive count or
// a count that disagrees with the file size.
absl::StatusOr<std::vector<uint16_t>> LoadLlmcTokens(const std::string& path);

// Writes `tokens` as an llm.c token file (version 1), atomically.
absl::Status WriteLlmcTokens(const std::string& path, absl::Span<const uint16_t> tokens);

// InvalidArgument naming `source`, the first offending position and value when a token is
// >= vocab_size (e.g. GPT-2 tokens fed to a byte-level model).
absl::Status ValidateTokens(absl::Span<const uint16_t> tokens, int64_t vocab_size, const std::string& source);

// One batch: inputs[b*T + t] = tokens[pos + b*T + t], targets[b*T + t] = tokens[pos + b*T + t + 1].
struct Batch {
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
};

// Sequential loader over a token stream, as llm.c's dataloader without shuffling: each batch
// reads B*T+1 tokens from the current position and advances it by B*T (row j of the batch is
// the j-th run of T tokens); when the next batch would read past the end, the position wraps
// to 0 (a new epoch).
class TokenLoader {
 public:
  // InvalidArgument when B or T is not positive or there are fewer than B*T+1 tokens.
  static absl::StatusOr<TokenLoader> Create(std::vector<uint16_t> tokens, int64_t B, int64_t T);

  // The batch at position(), then advances (and wraps) the position.
  Batch Next();
  // Back to the start of the stream.
  void Reset() { pos_ = 0; }
  // Where the next batch starts (a resumed run continues from a checkpoint's position);
  // InvalidArgument outside [0, num_tokens()). A position too close to the end for one batch
  // (saved with a smaller batch) starts the next epoch at Next().
  absl::Status set_position(int64_t pos);
  // Index of the first token of the next batch.
  int64_t position() const { return pos_; }
  int64_t batch_size() const { return B_; }
  int64_t seq_len() const { return T_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  // Batches per epoch before the position wraps.
  int64_t batches_per_epoch() const { return (num_tokens() - 1) / (B_ * T_); }
  const std::vector<uint16_t>& tokens() const { return tokens_; }

 private:
  TokenLoader(std::vector<uint16_t> tokens, int64_t B, int64_t T) : tokens_(std::move(tokens)), B_(B), T_(T) {}

  std::vector<uint16_t> tokens_;
  int64_t B_;
  int64_t T_;
  int64_t pos_ = 0;
};

// Builds an English text corpus from fortune(6) data files: every regular file directly in
// each of `dirs` (in that order; per directory sorted by name), except *.dat indexes, *.u8
// symlinks and other symlinks, hidden files, subdirectories (so Debian's offensive `off/` is
// skipped) and binary files (holding a NUL byte). The "%" separator lines are dropped; the
// fortunes are written one after another with a blank line between them. Missing directories
// are skipped; NotFound when no fortune file was found at all. Writes `out_path` atomically and
// returns it.
absl::StatusOr<std::string> PrepareFortunesCorpus(const std::string& out_path,
                                                  const std::vector<std::string>& dirs = {"/usr/share/games/fortunes"});

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_DATA_H_
