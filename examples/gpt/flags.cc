#include "examples/gpt/flags.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dtensor::gpt {

std::vector<char*> AbslStyleArgs(int argc, char** argv, std::vector<std::string>& storage) {
  storage.clear();
  storage.reserve(static_cast<size_t>(argc));
  auto is_bool_word = [](const char* w) {
    return std::strcmp(w, "true") == 0 || std::strcmp(w, "false") == 0 || std::strcmp(w, "yes") == 0 ||
           std::strcmp(w, "no") == 0;
  };
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i > 0 && absl::StartsWith(a, "--") && a.size() > 2) {
      const size_t eq = a.find('=');
      std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      std::replace(name.begin(), name.end(), '-', '_');
      std::string value = eq == std::string::npos ? "" : a.substr(eq);
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (eq == std::string::npos && flag != nullptr && flag->IsOfType<bool>() && i + 1 < argc &&
          is_bool_word(argv[i + 1])) {
        value = absl::StrCat("=", argv[++i]);
      }
      a = absl::StrCat("--", name, value);
    }
    storage.push_back(std::move(a));
  }
  std::vector<char*> out;
  out.reserve(storage.size());
  for (std::string& s : storage) out.push_back(s.data());
  return out;
}

std::set<std::string> GivenFlagNames(const std::vector<std::string>& args) {
  std::set<std::string> names;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--") break;  // the rest are not flags
    if (absl::StartsWith(args[i], "--") && args[i].size() > 2) names.insert(args[i].substr(2, args[i].find('=') - 2));
  }
  return names;
}

void SetRankThreads(int n) {
  if (std::getenv("OMP_NUM_THREADS") == nullptr) omp_set_num_threads(n < 1 ? 1 : n);
}

}  // namespace dtensor::gpt
