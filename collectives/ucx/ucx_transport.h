// Private to the ucx backend: one process's UCP context, worker and endpoints (UcxWorld),
// the requests posted on it, the progress / wait loop, and the reduction kernels.
#ifndef DTENSOR_COLLECTIVES_UCX_UCX_TRANSPORT_H_
#define DTENSOR_COLLECTIVES_UCX_UCX_TRANSPORT_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dtensor/collectives/comm_thread.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/collectives/store/rendezvous.h"
#include "dtensor/collectives/store/tcp_store.h"
#include "dtensor/tensor/dtype.h"

namespace dtensor::internal {

// One posted send or receive. `peer` is the group rank (for messages), `world_peer` the world
// rank (for liveness). Bookkeeping only: UCX never points into it, so it may be moved.
struct UcxRequest {
  void* req = nullptr;  // UCX request while in flight
  int peer = -1;
  int world_peer = -1;
  bool is_recv = false;
  bool done = false;
  size_t expect = 0;  // receives: the expected length in bytes
  ucs_status_t status = UCS_OK;
  size_t received = 0;
};

// What a wait reports in its errors.
struct UcxWaitContext {
  const char* op = "";
  int rank = 0;  // this rank in the group
  absl::Duration timeout = absl::InfiniteDuration();
  // Steady-clock nanoseconds at which the call's waits give up. Set by the first wait that
  // has to block (now + timeout), so a call whose peers are already there never reads the
  // clock; 0 = not yet.
  mutable int64_t deadline_ns = 0;

  int64_t DeadlineNs(int64_t now) const {
    if (deadline_ns == 0) {
      // A timeout past the clock's range (infinite, or ~292 years: ToInt64Nanoseconds
      // saturates and the sum would wrap negative) waits without limit.
      const int64_t ns = absl::ToInt64Nanoseconds(timeout);
      deadline_ns = timeout == absl::InfiniteDuration() || ns > INT64_MAX - now ? INT64_MAX : now + ns;
    }
    return deadline_ns;
  }
};

// How a wait's errors name this rank and the peer: their ranks in the group, and in a split
// whose numbering differs from the world's also their world ranks (the numbers RANK and
// dtrun's "[rank N]" prefixes use), e.g. "rank 1 (world rank 2)" / "rank 0 (world rank 0)".
struct UcxRankNames {
  std::string self, peer;
};
UcxRankNames NameRanks(int rank, int world_rank, int peer, int peer_world_rank);

// A process's UCX state for one world, shared by the world communicator, its splits and their
// pending point-to-point Works. Used by one thread at a time (the caller or its comm thread).
class UcxWorld {
 public:
  static absl::StatusOr<std::shared_ptr<UcxWorld>> Create(const LaunchInfo& info, StoreClient& store,
                                                          absl::Duration timeout);
  ~UcxWorld();
  UcxWorld(const UcxWorld&) = delete;
  UcxWorld& operator=(const UcxWorld&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Posts a tagged send / receive of `bytes` bytes (a receive matches exactly `tag`).
  // On a posting error returns it (Unavailable naming op, rank and peer).
  absl::StatusOr<UcxRequest> PostSend(const UcxWaitContext& ctx, int peer, int world_peer, uint64_t tag,
                                      const void* buf, size_t bytes);
  absl::StatusOr<UcxRequest> PostRecv(const UcxWaitContext& ctx, int peer, int world_peer, uint64_t tag, void* buf,
                                      size_t bytes);
  // Waits for r to complete (progressing the worker), honouring ctx's deadline and peer liveness.
  absl::Status Wait(UcxRequest& r, const UcxWaitContext& ctx);
  // Non-blocking: progresses once and reports whether r completed.
  bool Test(UcxRequest& r);
  // Cancels and releases what is still in flight (after an error); bounded.
  void Abandon(std::vector<UcxRequest>& reqs);
  void Abandon(UcxRequest& r);
  // A request nobody will wait for (a dropped Work): a receive is cancelled; `keep` (the
  // buffer's owner) stays alive until UCX is done with it.
  void Orphan(UcxRequest r, std::shared_ptr<const void> keep);

  // Sticky failure: after a transport error or a timeout every call fails with it.
  const absl::Status& failure() const { return failure_; }
  void Fail(const absl::Status& s) {
    if (failure_.ok()) failure_ = s;
  }

  // Aborts (Communicator::Abort): a tagged message to every peer, which each world keeps a
  // receive posted for from setup on. Abort() fails this world with `status` (unless it failed
  // already) and sends its message (`status`'s text) to every peer that is not gone, waiting up
  // to 0.5 s for the sends to leave. PollAbort() (no progress of its own: the waits progress)
  // fails this world with a peer's abort once it arrived; true once this world is aborted.
  void Abort(const absl::Status& status);
  bool PollAbort();
  // The world's failure as ctx's call reports it (an abort gets the call's "[op] rank r: ").
  absl::Status Failed(const UcxWaitContext& ctx) const;
  // The tag of an abort from world rank `from` (ranks < 65535, so the [sender:16] field of
  // every other message is never 0xffff).
  static uint64_t AbortTag(int from) { return (uint64_t{0xffffffff} << 32) | static_cast<uint32_t>(from); }

  // Communicator ids: every id handed out is larger than all ids this process saw before.
  uint16_t next_comm_id() const { return next_comm_id_; }
  void set_next_comm_id(uint16_t id) { next_comm_id_ = id; }

  // Called from UCX's endpoint error handler.
  void MarkPeerGone(int world_rank, const std::string& why);

  // Runs the *Async collectives of every communicator on this worker, in order; every other
  // use of the worker drains it first (so the worker, single-threaded, is never used by two
  // threads at once).
  CommThread& comm_thread() { return comm_thread_; }

  // For the shared-memory channel (ucx_shm.h): one round of UCX progress; a look at the peers'
  // pidfds; why a peer is gone (empty while alive); whether a peer is a process of this host
  // watched through its pidfd.
  void Progress() { ucp_worker_progress(worker_); }
  void PollPeers() { Sleep(0); }
  const std::string& gone(int world_rank) const { return gone_[static_cast<size_t>(world_rank)]; }
  bool OnThisHost(int world_rank) const { return world_rank == rank_ || pidfds_[static_cast<size_t>(world_rank)] >= 0; }

 private:
  UcxWorld() = default;
  absl::Status Setup(const LaunchInfo& info, StoreClient& store, absl::Duration timeout);
  bool Complete(UcxRequest& r);  // checks r's UCX request; true once it finished
  absl::Status Finish(UcxRequest& r, const UcxWaitContext& ctx);
  // Waits on the worker's event fd and the peers' pidfds for up to `ms` milliseconds.
  void Sleep(int ms);

  struct EpArg {
    UcxWorld* world;
    int rank;
  };

  int rank_ = 0;
  int size_ = 1;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;
  std::vector<std::unique_ptr<EpArg>> ep_args_;
  std::vector<std::string> gone_;  // per world rank: why it is gone, empty while alive
  std::vector<int> pids_;
  std::vector<int> pidfds_;
  int efd_ = -1;
  int epfd_ = -1;
  absl::Status failure_;
  uint16_t next_comm_id_ = 1;
  std::vector<std::pair<UcxRequest, std::shared_ptr<const void>>> orphans_;
  CommThread comm_thread_;  // idle by the time the world goes (communicators drain it)
  // A peer's abort message lands here (PollAbort).
  static constexpr size_t kAbortBytes = 2048;
  std::vector<char> abort_buf_ = std::vector<char>(kAbortBytes);
  UcxRequest abort_recv_;
  std::string abort_text_;  // what this rank's Abort sent
};

// out[i] = srcs[0][i] (op) srcs[1][i] (op) ..., combined in source order, in float32 for
// bfloat16 / float16 (rounded once), wrapping for integers, or / and for bool. With
// avg_divisor > 0, kAvg divides the sum by it; with 0, kAvg is a plain sum (partial results).
// dst may be one of the sources. Precondition: dtype and op are reducible (see the header).
void Reduce(DType dtype, CommReduceOp op, const void* const* srcs, int nsrcs, int64_t n, void* dst, int avg_divisor);

}  // namespace dtensor::internal

#endif  // DTENSOR_COLLECTIVES_UCX_UCX_TRANSPORT_H_
