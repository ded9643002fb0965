#include "dtensor/kernels/cpu/blas_core.h"

#include <cblas.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dtensor {

CpuVectorIsa HostVectorIsa() {
  CpuVectorIsa isa;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  isa.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  isa.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
#endif
  return isa;
}

bool BlasChoosesCoreAtLoad() {
  const char* config = openblas_get_config();
  return config != nullptr && std::strstr(config, "DYNAMIC_ARCH") != nullptr;
}

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name != nullptr ? std::string(name) : std::string();
}

std::string FasterBlasCoreType(const std::string& core, CpuVectorIsa isa) {
  // OpenBLAS's x86 sets without AVX2: what its detection falls back to for a CPU model it does
  // not know, and the right choice only on CPUs without AVX2.
  static constexpr const char* kPreAvx2[] = {
      "prescott", "katmai", "coppermine", "northwood", "banias",       "core2",     "penryn", "dunnington",  "nehalem",
      "atom",     "nano",   "athlon",     "opteron",   "opteron_sse3", "barcelona", "bobcat", "sandybridge", "unknown"};
  const std::string lower = absl::AsciiStrToLower(core);
  bool generic = false;
  for (const char* name : kPreAvx2) generic = generic || lower == name;
  if (!generic) return "";
  if (isa.avx512) return "SkylakeX";
  if (isa.avx2_fma) return "Haswell";
  return "";
}

absl::Status ReexecWithFasterBlasCore(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || !BlasChoosesCoreAtLoad()) return absl::OkStatus();
  const std::string core = BlasCoreName();
  const std::string faster = FasterBlasCoreType(core, HostVectorIsa());
  if (faster.empty()) return absl::OkStatus();
  if (setenv("OPENBLAS_CORETYPE", faster.c_str(), /*overwrite=*/1) != 0) {
    return absl::InternalError(absl::StrCat("setenv(OPENBLAS_CORETYPE=", faster, ") failed: ", std::strerror(errno)));
  }
  // The file itself rather than the /proc link, whose name ("exe") the process would take in
  // ps, top and pkill; the link where the file is gone (" (deleted)") or cannot be read.
  std::string self = "/proc/self/exe";
  char path[PATH_MAX];
  const ssize_t n = readlink(self.c_str(), path, sizeof(path) - 1);
  if (n > 0) {
    const std::string target(path, static_cast<size_t>(n));
    if (!absl::EndsWith(target, " (deleted)")) self = target;
  }
  execv(self.c_str(), argv);
  const int err = errno;  // only reached where the exec failed
  unsetenv("OPENBLAS_CORETYPE");
  return absl::InternalError(absl::StrCat("re-executing ", self, " with OPENBLAS_CORETYPE=", faster,
                                          " (OpenBLAS runs its ", core, " kernels here) failed: ", std::strerror(err)));
}

}  // namespace dtensor
