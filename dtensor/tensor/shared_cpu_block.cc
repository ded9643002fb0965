#include "dtensor/tensor/shared_cpu_block.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dtensor {
namespace {

constexpr uint64_t kMagic = 0x6474736861726564ull;  // "dtshared"

// The first bytes of a shared block's mapping.
struct PageHeader {
  uint64_t magic;
  uint64_t id;
  uint32_t released;  // 1 once the owner gave the block back (atomic_ref)
};
static_assert(sizeof(PageHeader) <= 64);

PageHeader* HeaderAt(char* base) { return reinterpret_cast<PageHeader*>(base); }

}  // namespace

namespace internal {

uint64_t MaxSharedCpuBlockBytes() {
  static const uint64_t max = [] {
    uint64_t m = UINT64_MAX;
    struct sysinfo si {};
    if (sysinfo(&si) == 0) m = static_cast<uint64_t>(si.totalram) * si.mem_unit / 2;
    rlimit r{};
    if (getrlimit(RLIMIT_FSIZE, &r) == 0 && r.rlim_cur != RLIM_INFINITY) m = std::min<uint64_t>(m, r.rlim_cur);
    return m > kSharedCpuPage ? m - kSharedCpuPage : 0;
  }();
  return max;
}

std::optional<OwnedSharedCpuBlock> CreateSharedCpuBlock(size_t user_bytes, uint64_t id) {
  if (user_bytes > MaxSharedCpuBlockBytes()) return std::nullopt;
  const uint64_t bytes = kSharedCpuPage + user_bytes;
  const int fd = memfd_create("dtensor-block", MFD_CLOEXEC);
  if (fd < 0) return std::nullopt;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return std::nullopt;
  }
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return std::nullopt;
  }
  char* base = static_cast<char*>(m);
  // A fork()ed child must not share the parent's tensors (it would write into them): it gets
  // no mapping at all, as with memory registered for RDMA.
  madvise(base, bytes, MADV_DONTFORK);
  madvise(base, bytes, MADV_HUGEPAGE);  // where shmem_enabled allows huge pages
  PageHeader* h = HeaderAt(base);
  h->magic = kMagic;
  h->id = id;
  std::atomic_ref<uint32_t>(h->released).store(0, std::memory_order_release);
  return OwnedSharedCpuBlock{base + kSharedCpuPage, fd, bytes};
}

namespace {
std::atomic<uint64_t>& ReleasedCount() {
  static std::atomic<uint64_t> count{0};  // a fact about this process, like its blocks
  return count;
}
}  // namespace

void ReleaseSharedCpuBlock(const OwnedSharedCpuBlock& b) {
  char* base = b.user - kSharedCpuPage;
  std::atomic_ref<uint32_t>(HeaderAt(base)->released).store(1, std::memory_order_release);
  munmap(base, b.map_bytes);
  close(b.fd);
  ReleasedCount().fetch_add(1, std::memory_order_release);
}

uint64_t SharedCpuBlocksReleased() { return ReleasedCount().load(std::memory_order_acquire); }

}  // namespace internal

absl::StatusOr<PeerSharedCpuBlock> PeerSharedCpuBlock::Open(pid_t pid, const SharedCpuRange& r) {
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", r.fd);
  if (r.id == 0 || r.map_bytes < internal::kSharedCpuPage) {
    return absl::InvalidArgumentError(
        absl::StrCat("[PeerSharedCpuBlock] ", path, ": not a shared block (id ", r.id, ", ", r.map_bytes, " bytes)"));
  }
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    const std::string msg = absl::StrCat("[PeerSharedCpuBlock] cannot open ", path, ": ", std::strerror(e));
    return e == EACCES || e == EPERM ? absl::PermissionDeniedError(msg) : absl::NotFoundError(msg);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != r.map_bytes) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat("[PeerSharedCpuBlock] ", path, " is not block ", r.id, " of ",
                                                      r.map_bytes, " bytes (size ", st.st_size, ")"));
  }
  void* m = mmap(nullptr, r.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);  // the mapping keeps the memory
  if (m == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("[PeerSharedCpuBlock] mmap of ", path, " (", r.map_bytes, " bytes): ", std::strerror(errno)));
  }
  char* base = static_cast<char*>(m);
  madvise(base, r.map_bytes, MADV_DONTFORK);
  PeerSharedCpuBlock block(base, r.map_bytes, r.id);
  const PageHeader* h = HeaderAt(base);
  if (h->magic != kMagic || h->id != r.id || block.released()) {
    return absl::FailedPreconditionError(absl::StrCat("[PeerSharedCpuBlock] ", path, " holds block ", h->id,
                                                      h->magic != kMagic ? " (not a dtensor block)" : "", ", not ",
                                                      r.id, block.released() ? " (released)" : ""));
  }
  return block;
}

PeerSharedCpuBlock::PeerSharedCpuBlock(PeerSharedCpuBlock&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), id_(std::exchange(o.id_, 0)) {}

PeerSharedCpuBlock& PeerSharedCpuBlock::operator=(PeerSharedCpuBlock&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) munmap(base_, bytes_);
    base_ = std::exchange(o.base_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    id_ = std::exchange(o.id_, 0);
  }
  return *this;
}

PeerSharedCpuBlock::~PeerSharedCpuBlock() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

bool PeerSharedCpuBlock::released() const {
  return std::atomic_ref<uint32_t>(HeaderAt(base_)->released).load(std::memory_order_acquire) != 0;
}

}  // namespace dtensor
