#include "dtensor/nn/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "absl/strings/str_cat.h"

namespace dtensor {
namespace {

absl::Status ErrnoError(const char* op, const std::string& what, const std::string& path, int err) {
  return absl::ErrnoToStatus(err, absl::StrCat("[", op, "] ", what, " '", path, "'"));
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::StatusOr<std::string> ReadFileBytes(const char* op, const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("[", op, "] no such file '", path, "'"));
    return ErrnoError(op, "cannot open", path, errno);
  }
  std::string data;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) data.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  while (true) {
    ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoError(op, "cannot read", path, err);
    }
    if (r == 0) break;
    data.append(buf, static_cast<size_t>(r));
  }
  ::close(fd);
  return data;
}

absl::Status WriteFileAtomically(const char* op, const std::string& path, absl::Span<const absl::string_view> pieces) {
  static std::atomic<uint64_t> counter{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) return ErrnoError(op, "cannot create temporary file", tmp, errno);
  }
  if (fd < 0) {
    return absl::AlreadyExistsError(absl::StrCat("[", op, "] no free temporary file name next to '", path, "'"));
  }
  auto fail = [&](const char* what, const std::string& p, int err) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return ErrnoError(op, what, p, err);
  };
  for (absl::string_view piece : pieces) {
    if (!WriteAll(fd, piece.data(), piece.size())) return fail("cannot write", tmp, errno);
  }
  if (::fsync(fd) != 0) return fail("cannot fsync", tmp, errno);
  const int rc = ::close(fd);
  fd = -1;
  if (rc != 0) return fail("cannot close", tmp, errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = errno;  // before the message is built
    return fail(("cannot rename '" + tmp + "' to").c_str(), path, rename_err);
  }
  // Make the rename itself durable. The file is in place and whole either way; a failure here
  // means a crash could still bring back the old one, so the caller hears of it. Filesystems
  // that cannot sync a directory (EINVAL, ENOTSUP) give no more than the rename.
  const std::string dir = DirectoryOf(path);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) {
    const int open_err = errno;  // before anything else can touch it
    return ErrnoError(op, absl::StrCat("wrote '", path, "' but cannot open its directory"), dir, open_err);
  }
  int sync_err = ::fsync(dfd) == 0 ? 0 : errno;
  ::close(dfd);
  if (sync_err == EINVAL || sync_err == ENOTSUP) sync_err = 0;
  if (sync_err != 0) {
    return ErrnoError(op, absl::StrCat("wrote '", path, "' but cannot fsync its directory"), dir, sync_err);
  }
  return absl::OkStatus();
}

}  // namespace dtensor
