// GPT-2 tokenizer throughput: examples/gpt/tokenizer.h beside the reference, the npm package
// gpt-3-encoder's encode() under node (tests/gpt/reference_encode.js), on the same text: by
// default every fortunes file and every Debian license text, concatenated (about 3 MB).
// "cold" is the first encode (empty per-word caches: each distinct word goes through BPE once),
// "warm" the fastest of --reps encodes (caches full). node's clock is around its encode() calls
// only; it is given the text line by line (cut where the cut cannot change the tokens) because
// its encode() is quadratic in its input's length. The ids of both must be identical (#wrong
// counts the positions that differ; the exit code is 1 if any do).
//
//   build/benchmarks/tokenizer_bench                   # fortunes + licenses, 3 reps
//   build/benchmarks/tokenizer_bench --quick           # licenses only, 1 rep
//   build/benchmarks/tokenizer_bench --reps 5 FILE...  # other text
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "examples/gpt/tokenizer.h"

namespace {

namespace fs = std::filesystem;

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    const std::string candidate = std::string(dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// Regular files of `dir` (no symlinks, no fortune index files), sorted.
std::vector<std::string> TextFiles(const std::string& dir) {
  std::vector<std::string> files;
  if (!fs::is_directory(dir)) return files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string ext = entry.path().extension().string();
    if (entry.is_regular_file() && !entry.is_symlink() && ext != ".dat" && ext != ".u8") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

struct Result {
  double cold_s = 0, warm_s = 0;
  std::vector<int32_t> ids;
};

void PrintRow(const char* name, int64_t bytes, const Result& r) {
  std::printf("%-22s %10lld %9zu %9.4f %9.2f %9.4f %9.2f\n", name, static_cast<long long>(bytes), r.ids.size(),
              r.cold_s, bytes / r.cold_s / 1e6, r.warm_s, bytes / r.warm_s / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 3;
  bool quick = false;
  std::string bpe_dir = dtensor::gpt::Gpt2Tokenizer::DefaultDir();
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--reps" && i + 1 < argc && absl::SimpleAtoi(argv[i + 1], &reps) && reps > 0) {
      ++i;
    } else if (arg == "--bpe-dir" && i + 1 < argc) {
      bpe_dir = argv[++i];
    } else if (arg == "--quick") {
      quick = true;
      reps = 1;
    } else if (!arg.empty() && arg[0] != '-') {
      files.push_back(arg);
    } else {
      std::fprintf(stderr, "usage: tokenizer_bench [--quick] [--reps N] [--bpe-dir DIR] [FILE...]\n");
      return 2;
    }
  }
  if (files.empty()) {
    if (!quick) files = TextFiles("/usr/share/games/fortunes");
    for (const std::string& f : TextFiles("/usr/share/common-licenses")) files.push_back(f);
  }
  std::string text;
  for (const std::string& f : files) text += ReadBytes(f);
  if (text.empty()) {
    std::fprintf(stderr, "tokenizer_bench: no text (install fortunes, or name files)\n");
    return 1;
  }
  const int64_t bytes = static_cast<int64_t>(text.size());

  double t0 = Now();
  absl::StatusOr<dtensor::gpt::Gpt2Tokenizer> tok = dtensor::gpt::Gpt2Tokenizer::Load(bpe_dir);
  if (!tok.ok()) {
    std::fprintf(stderr, "tokenizer_bench: %s (run scripts/setup.sh)\n", std::string(tok.status().message()).c_str());
    return 1;
  }
  const double load_s = Now() - t0;
  Result ours;
  for (int rep = 0; rep < reps; ++rep) {
    t0 = Now();
    ours.ids = tok->Encode(text);
    const double s = Now() - t0;
    if (rep == 0) ours.cold_s = ours.warm_s = s;
    ours.warm_s = std::min(ours.warm_s, s);
  }
  std::printf("# GPT-2 BPE encode of %zu files (%lld bytes); loading encoder.json + vocab.bpe took %.3f s\n",
              files.size(), static_cast<long long>(bytes), load_s);
  std::printf("%-22s %10s %9s %9s %9s %9s %9s\n", "encoder", "bytes", "tokens", "cold_s", "cold_MB/s", "warm_s",
              "warm_MB/s");
  PrintRow("dtensor (C++)", bytes, ours);

  const std::string node = FindOnPath("node");
  const std::string script = std::string(DTENSOR_SOURCE_DIR) + "/tests/gpt/reference_encode.js";
  if (node.empty() || !fs::exists(bpe_dir + "/index.js")) {
    std::printf("# reference not run: %s\n", node.empty() ? "node is not on PATH" : "no gpt-3-encoder package here");
    return 0;
  }
  // node reads the text from a file: write the concatenation once.
  char tmp[] = "/tmp/tokenizer_bench_XXXXXX";
  const int fd = mkstemp(tmp);
  if (fd < 0 || write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    std::fprintf(stderr, "tokenizer_bench: cannot write %s\n", tmp);
    return 1;
  }
  close(fd);
  const std::string command =
      "'" + node + "' '" + script + "' '" + bpe_dir + "' --bench " + std::to_string(reps) + " '" + tmp + "'";
  FILE* pipe = popen(command.c_str(), "r");
  std::string out;
  if (pipe != nullptr) {
    char buf[1 << 16];
    size_t n = 0;
    while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  }
  const int rc = pipe != nullptr ? pclose(pipe) : -1;
  unlink(tmp);
  std::vector<absl::string_view> lines = absl::StrSplit(out, '\n');
  Result ref;
  std::vector<absl::string_view> times =
      lines.empty() ? std::vector<absl::string_view>{} : absl::StrSplit(lines[0], ' ');
  if (rc != 0 || lines.size() < 2 || times.size() != 2 || !absl::SimpleAtod(times[0], &ref.cold_s) ||
      !absl::SimpleAtod(times[1], &ref.warm_s)) {
    std::fprintf(stderr, "tokenizer_bench: %s failed (exit %d)\n", command.c_str(), rc);
    return 1;
  }
  for (absl::string_view word : absl::StrSplit(lines[1], ' ', absl::SkipEmpty())) {
    int32_t id = -1;
    ref.ids.push_back(absl::SimpleAtoi(word, &id) ? id : -1);
  }
  PrintRow("gpt-3-encoder (node)", bytes, ref);
  int64_t wrong = std::abs(static_cast<int64_t>(ours.ids.size()) - static_cast<int64_t>(ref.ids.size()));
  for (size_t i = 0; i < std::min(ours.ids.size(), ref.ids.size()); ++i) wrong += ours.ids[i] != ref.ids[i];
  std::printf("# dtensor / node speed: cold %.1fx, warm %.1fx; #wrong %lld\n", ref.cold_s / ours.cold_s,
              ref.warm_s / ours.warm_s, static_cast<long long>(wrong));
  return wrong == 0 ? 0 : 1;
}
