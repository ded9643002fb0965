#include "collectives/ucx/ucx_shm.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace dtensor::internal {
namespace {

constexpr int64_t kSpinNs = 50'000;      // when every rank has a core of its own
constexpr int64_t kYieldNs = 2'000'000;  // then sched_yield, then naps of kNapUs
constexpr int kNapUs = 100;
constexpr int64_t kLongWaitNs = 50'000'000;  // after this, naps of kLongNapUs (a peer busy elsewhere)
constexpr int kLongNapUs = 1000;
constexpr int64_t kPeerCheckNs = 1'000'000;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

int CpuCount() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

}  // namespace

std::string ShmGroup::NewName(uint16_t comm_id) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat("/dtensor-ucx-", getpid(), "-", comm_id, "-", counter.fetch_add(1), "-", NowNs() % 1000000007);
}

absl::StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::Map(const std::string& name, bool create, int rank,
                                                        std::vector<int> members, UcxWorld* world) {
  const size_t p = members.size();
  const size_t ctl = (p * 64 + 4095) / 4096 * 4096;
  const size_t bytes = ctl + (2 * p + 2) * kSlotBytes;
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_open ", name, ": ", std::strerror(errno)));
  bool ok = true;
  if (create) {
    ok = ftruncate(fd, static_cast<off_t>(bytes)) == 0;
  } else {
    struct stat st {};
    ok = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes;
  }
  void* base = ok ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    return absl::UnavailableError(absl::StrCat("mapping ", name, ": ", std::strerror(err)));
  }
  std::unique_ptr<ShmGroup> g(new ShmGroup());
  g->base_ = static_cast<char*>(base);
  g->bytes_ = bytes;
  g->ctl_bytes_ = ctl;
  g->rank_ = rank;
  g->members_ = std::move(members);
  g->world_ = world;
  g->spin_ns_ = static_cast<int>(p) <= CpuCount() ? kSpinNs : 0;
  return g;
}

void ShmGroup::Unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmGroup::~ShmGroup() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

void ShmGroup::MarkFailed() { std::atomic_ref<uint32_t>(*failed_of(rank_)).store(1, std::memory_order_release); }

absl::Status ShmGroup::Sync(const UcxWaitContext& ctx) {
  const uint64_t e = ++epoch_;
  std::atomic_ref<uint64_t>(*epoch_of(rank_)).store(e, std::memory_order_release);
  for (int j = 0; j < static_cast<int>(members_.size()); ++j) {
    if (j == rank_) continue;
    std::atomic_ref<uint64_t> theirs(*epoch_of(j));
    bool arrived = false;
    for (int i = 0; i < 64 && !arrived; ++i) {
      arrived = theirs.load(std::memory_order_acquire) >= e;
      if (!arrived) CpuRelax();
    }
    if (!arrived) {
      absl::Status s = WaitFor(j, e, ctx);
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::WaitFor(int j, uint64_t epoch, const UcxWaitContext& ctx) {
  std::atomic_ref<uint64_t> theirs(*epoch_of(j));
  const int64_t start = NowNs();
  const int64_t deadline =
      ctx.deadline == absl::InfiniteFuture() ? INT64_MAX : start + absl::ToInt64Nanoseconds(ctx.deadline - absl::Now());
  int64_t last_check = start;
  for (;;) {
    for (int i = 0; i < 32; ++i) {
      if (theirs.load(std::memory_order_acquire) >= epoch) return absl::OkStatus();
      CpuRelax();
    }
    const int64_t now = NowNs();
    const int64_t waited = now - start;
    if (waited >= spin_ns_) world_->Progress();  // pending point-to-point messages keep moving
    if (now - last_check >= kPeerCheckNs || now >= deadline) {
      last_check = now;
      world_->PollPeers();
      for (size_t k = 0; k < members_.size(); ++k) {
        if (static_cast<int>(k) == rank_) continue;
        const std::string& gone = world_->gone(members_[k]);
        if (!gone.empty()) {
          return absl::UnavailableError(
              absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": peer rank ", k, " is gone (", gone, ")"));
        }
        if (std::atomic_ref<uint32_t>(*failed_of(static_cast<int>(k))).load(std::memory_order_acquire) != 0) {
          return absl::UnavailableError(
              absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": peer rank ", k, " failed (see its error)"));
        }
      }
      if (theirs.load(std::memory_order_acquire) >= epoch) return absl::OkStatus();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("[", ctx.op, "] rank ", ctx.rank, " timed out after ",
                                                        absl::FormatDuration(ctx.timeout), " waiting for rank ", j));
      }
    }
    if (waited < spin_ns_) continue;
    if (waited < kYieldNs) {
      sched_yield();
    } else {
      usleep(waited < kLongWaitNs ? kNapUs : kLongNapUs);
    }
  }
}

}  // namespace dtensor::internal
