#include "tests/fuzz/fuzz_util.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace dtensor::fuzz {
namespace {

std::string& TempDirStorage() {
  static std::string dir;
  return dir;
}

void RemoveTempDir() {
  std::error_code ec;
  std::filesystem::remove_all(TempDirStorage(), ec);
}

}  // namespace

const std::string& TempDir() {
  std::string& dir = TempDirStorage();
  if (dir.empty()) {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/dtensor-fuzz-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    dir = pattern;
    std::atexit(RemoveTempDir);
  }
  return dir;
}

std::string WriteTempFile(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = TempDir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::abort();
  }
  return path;
}

bool IsCleanError(const absl::Status& s) {
  return !s.ok() && s.code() != absl::StatusCode::kUnknown && s.code() != absl::StatusCode::kInternal &&
         !s.message().empty();
}

}  // namespace dtensor::fuzz
