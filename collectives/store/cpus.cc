#include "dtensor/collectives/store/cpus.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace dtensor {
namespace {

// The integer in a one-number sysfs file, or -1.
int64_t ReadNumber(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return -1;
  long long v = -1;
  if (std::fscanf(f, "%lld", &v) != 1) v = -1;
  std::fclose(f);
  return v;
}

// The first line of a sysfs file, or "".
std::string ReadLine(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return "";
  char buf[4096];
  std::string line = std::fgets(buf, sizeof(buf), f) != nullptr ? buf : "";
  std::fclose(f);
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

}  // namespace

std::vector<int> ParseCpuList(absl::string_view text) {
  std::vector<int> cpus;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    const size_t dash = part.find('-');
    int lo = 0, hi = 0;
    if (!absl::SimpleAtoi(part.substr(0, dash), &lo) || lo < 0) return {};
    hi = lo;
    if (dash != absl::string_view::npos && (!absl::SimpleAtoi(part.substr(dash + 1), &hi) || hi < lo)) return {};
    if (hi - lo > (1 << 20)) return {};
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::vector<int> AllowedCpus() {
  // Sized for hosts with more CPUs than a fixed cpu_set_t holds (1024).
  for (int n = 1024; n <= (1 << 16); n *= 4) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) return {};
    const size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      std::vector<int> cpus;
      for (int c = 0; c < n; ++c) {
        if (CPU_ISSET_S(c, bytes, set)) cpus.push_back(c);
      }
      CPU_FREE(set);
      return cpus;
    }
    CPU_FREE(set);  // EINVAL: the kernel's mask is larger; try a larger set
  }
  return {};
}

std::vector<int64_t> CoreKeys(absl::Span<const int> cpus) {
  std::vector<int64_t> keys;
  keys.reserve(cpus.size());
  for (int c : cpus) {
    const std::string dir = absl::StrCat("/sys/devices/system/cpu/cpu", c, "/topology/");
    const int64_t package = std::max<int64_t>(0, ReadNumber(dir + "physical_package_id"));
    // The core: its first hardware thread (core_id is not unique within a package everywhere).
    std::vector<int> siblings = ParseCpuList(ReadLine(dir + "core_cpus_list"));
    if (siblings.empty()) siblings = ParseCpuList(ReadLine(dir + "thread_siblings_list"));
    const int64_t first = siblings.empty() ? c : siblings.front();
    keys.push_back((package << 32) | first);
  }
  return keys;
}

std::vector<std::vector<int>> SplitCpus(absl::Span<const int> cpus, absl::Span<const int64_t> keys, int ranks) {
  if (ranks < 1 || keys.size() != cpus.size() || cpus.size() < static_cast<size_t>(ranks)) return {};
  std::vector<std::pair<int, int64_t>> sorted;
  for (size_t i = 0; i < cpus.size(); ++i) sorted.emplace_back(cpus[i], keys[i]);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(
      std::unique(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first == b.first; }),
      sorted.end());
  if (sorted.size() < static_cast<size_t>(ranks)) return {};  // duplicates hid a shortage
  // Cores in order of their keys, each with its CPUs ascending.
  std::map<int64_t, std::vector<int>> by_key;
  for (const auto& [cpu, key] : sorted) by_key[key].push_back(cpu);
  std::vector<std::vector<int>> cores;
  for (auto& [key, core] : by_key) cores.push_back(std::move(core));
  if (cores.size() < static_cast<size_t>(ranks)) {  // fewer cores than ranks: split threads
    cores.clear();
    for (const auto& [cpu, key] : sorted) cores.push_back({cpu});
  }
  const size_t c = cores.size(), n = static_cast<size_t>(ranks);
  std::vector<std::vector<int>> shares(n);
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = i * c / n; k < (i + 1) * c / n; ++k) {
      shares[i].insert(shares[i].end(), cores[k].begin(), cores[k].end());
    }
  }
  return shares;
}

std::vector<std::vector<int>> StackCpus(absl::Span<const int> cpus, absl::Span<const int64_t> keys, int ranks) {
  if (ranks < 1 || keys.size() != cpus.size()) return {};
  std::vector<int> distinct(cpus.begin(), cpus.end());
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  const int n = static_cast<int>(distinct.size());
  if (n == 0 || n >= ranks) return {};
  const std::vector<std::vector<int>> one = SplitCpus(cpus, keys, n);  // a CPU each, in order
  if (static_cast<int>(one.size()) != n) return {};
  std::vector<std::vector<int>> shares(static_cast<size_t>(ranks));
  for (int i = 0; i < ranks; ++i) {
    shares[static_cast<size_t>(i)] = one[static_cast<size_t>(static_cast<int64_t>(i) * n / ranks)];
  }
  return shares;
}

bool RanksHaveOwnCpus(absl::Span<const std::vector<int>> cpus) {
  // Bipartite matching of ranks to CPUs by augmenting paths (Kuhn): a handful of ranks.
  std::map<int, size_t> owner;  // CPU -> the rank matched to it
  for (size_t r = 0; r < cpus.size(); ++r) {
    std::map<int, bool> visited;
    std::function<bool(size_t)> place = [&](size_t rank) {
      for (int c : cpus[rank]) {
        if (visited[c]) continue;
        visited[c] = true;
        auto it = owner.find(c);
        if (it == owner.end() || place(it->second)) {
          owner[c] = rank;
          return true;
        }
      }
      return false;
    };
    if (!place(r)) return false;
  }
  return true;
}

std::string FormatCpuList(absl::Span<const int> cpus) {
  if (cpus.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    absl::StrAppend(&out, out.empty() ? "" : ",", cpus[i]);
    if (j > i) absl::StrAppend(&out, "-", cpus[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace dtensor
