#include "benchmarks/gpu/kernel_table.h"

#include <cxxabi.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace dtensor::bench {
namespace {

// One row of the table: `name` padded to `width` (it is at most that long: Fit).
std::string Row(const std::string& rank, const std::string& name, int width, int64_t calls, double total_ms,
                double step_ms, double percent) {
  char line[512];
  std::snprintf(line, sizeof(line), "%5s | %-*s | %9lld | %10.3f | %9.3f | %5.1f%%\n", rank.c_str(), width,
                name.c_str(), static_cast<long long>(calls), total_ms, step_ms, percent);
  return line;
}

std::string Fit(const std::string& name, int width) {
  if (width < 4 || static_cast<int>(name.size()) <= width) return name;
  return name.substr(0, static_cast<size_t>(width - 3)) + "...";
}

bool ParseInt(std::string_view s, int64_t* out) {
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

}  // namespace

void KernelTable::Add(std::string_view name, int64_t calls, int64_t ns) {
  std::string key(name);
  std::replace_if(
      key.begin(), key.end(), [](char c) { return c == '\t' || c == '\n' || c == '\r'; }, ' ');
  KernelStat& s = stats_[key];
  s.calls += calls;
  s.ns += ns;
}

void KernelTable::Subtract(const KernelTable& other) {
  for (const auto& [name, o] : other.stats_) {
    auto it = stats_.find(name);
    if (it == stats_.end()) continue;
    it->second.calls = std::max<int64_t>(0, it->second.calls - o.calls);
    it->second.ns = std::max<int64_t>(0, it->second.ns - o.ns);
    if (it->second.calls == 0 && it->second.ns == 0) stats_.erase(it);
  }
}

int64_t KernelTable::total_ns() const {
  int64_t t = 0;
  for (const auto& [name, s] : stats_) t += s.ns;
  return t;
}

int64_t KernelTable::total_calls() const {
  int64_t t = 0;
  for (const auto& [name, s] : stats_) t += s.calls;
  return t;
}

std::string KernelTable::ToTsv() const {
  std::string out;
  for (const auto& [name, s] : stats_) {
    out += name + "\t" + std::to_string(s.calls) + "\t" + std::to_string(s.ns) + "\n";
  }
  return out;
}

std::optional<KernelTable> KernelTable::FromTsv(std::string_view tsv, std::string* error) {
  KernelTable t;
  int line_no = 0;
  while (!tsv.empty()) {
    const size_t eol = tsv.find('\n');
    const std::string_view line = tsv.substr(0, eol);
    tsv = eol == std::string_view::npos ? std::string_view() : tsv.substr(eol + 1);
    ++line_no;
    if (line.empty()) continue;
    const size_t a = line.find('\t');
    const size_t b = a == std::string_view::npos ? a : line.find('\t', a + 1);
    int64_t calls = 0, ns = 0;
    if (b == std::string_view::npos || a == 0 || !ParseInt(line.substr(a + 1, b - a - 1), &calls) ||
        !ParseInt(line.substr(b + 1), &ns) || calls < 0 || ns < 0) {
      if (error != nullptr) {
        *error = "line " + std::to_string(line_no) + " is not 'name<TAB>calls<TAB>ns': '" + std::string(line) + "'";
      }
      return std::nullopt;
    }
    t.Add(line.substr(0, a), calls, ns);
  }
  return t;
}

std::string KernelTable::Format(const FormatOptions& options) const {
  const int64_t steps = std::max<int64_t>(1, options.steps);
  const int width = std::clamp(options.name_width, 10, 300);
  std::vector<std::pair<std::string, KernelStat>> rows(stats_.begin(), stats_.end());
  std::stable_sort(rows.begin(), rows.end(), [](const auto& x, const auto& y) { return x.second.ns > y.second.ns; });
  const double total_ms = static_cast<double>(total_ns()) / 1e6;
  auto percent = [&](int64_t ns) { return total_ms > 0 ? static_cast<double>(ns) / 1e4 / total_ms : 0.0; };
  char head[512];
  std::snprintf(head, sizeof(head),
                "GPU time by kernel%s%s: %lld activities, %.3f ms in all, %.3f ms per step (%lld)\n",
                options.title.empty() ? "" : ", ", options.title.c_str(), static_cast<long long>(total_calls()),
                total_ms, total_ms / static_cast<double>(steps), static_cast<long long>(steps));
  std::string out = head;
  std::snprintf(head, sizeof(head), "%5s | %-*s | %9s | %10s | %9s | %6s\n", "#", width, "kernel", "calls", "total ms",
                "ms/step", "%");
  out += head;
  out += std::string(static_cast<size_t>(5 + 3 + width + 3 + 9 + 3 + 10 + 3 + 9 + 3 + 6), '-') + "\n";
  const size_t shown = options.top <= 0 ? rows.size() : std::min(rows.size(), static_cast<size_t>(options.top));
  for (size_t i = 0; i < shown; ++i) {
    const KernelStat& s = rows[i].second;
    const double ms = static_cast<double>(s.ns) / 1e6;
    out += Row(std::to_string(i + 1), Fit(rows[i].first, width), width, s.calls, ms, ms / static_cast<double>(steps),
               percent(s.ns));
  }
  if (shown < rows.size()) {
    KernelStat rest;
    for (size_t i = shown; i < rows.size(); ++i) {
      rest.calls += rows[i].second.calls;
      rest.ns += rows[i].second.ns;
    }
    const double ms = static_cast<double>(rest.ns) / 1e6;
    // (snprintf, not "(" + std::string: g++ 12 at -O3 warns falsely, -Wrestrict, on the latter)
    char more[32];
    std::snprintf(more, sizeof(more), "(%zu more)", rows.size() - shown);
    out += Row("", Fit(more, width), width, rest.calls, ms, ms / static_cast<double>(steps), percent(rest.ns));
  }
  out += Row("", "total", width, total_calls(), total_ms, total_ms / static_cast<double>(steps),
             total_ms > 0 ? 100.0 : 0.0);
  return out;
}

std::string ShortKernelName(const char* symbol) {
  if (symbol == nullptr) return "(unnamed)";
  int status = 0;
  char* demangled = abi::__cxa_demangle(symbol, nullptr, nullptr, &status);
  if (status != 0 || demangled == nullptr) {
    std::free(demangled);
    return symbol;
  }
  std::string name(demangled);
  std::free(demangled);
  // The parameter list: the parenthesis that closes the name, matched backwards.
  size_t end = name.size();
  while (end > 0 && name[end - 1] == ' ') --end;
  if (end > 0 && name[end - 1] == ')') {
    int depth = 0;
    for (size_t i = end; i-- > 0;) {
      if (name[i] == ')') ++depth;
      if (name[i] == '(' && --depth == 0) {
        name.resize(i);
        break;
      }
    }
  }
  if (name.rfind("void ", 0) == 0) name.erase(0, 5);
  constexpr std::string_view kAnon = "(anonymous namespace)::";
  for (size_t at = name.find(kAnon); at != std::string::npos; at = name.find(kAnon, at)) name.erase(at, kAnon.size());
  return name;
}

}  // namespace dtensor::bench
