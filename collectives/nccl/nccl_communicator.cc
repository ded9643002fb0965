// The nccl backend (see nccl_communicator.h for the contract). Structure:
//   NcclState        the ncclComm_t, the communication stream and the failure state, shared by
//                    the communicator and its pending Works (a Work may outlive its
//                    communicator); all polling with timeouts and ncclCommAbort live here.
//   NcclWork         one launched call: its completion event and the tensors it keeps alive.
//   NcclCommunicator validation ("[Op] rank r: ...") and the mapping of each call to NCCL.
//
// The NCCL communicator is created non-blocking (blocking = 0): any NCCL call may return
// ncclInProgress, after which ncclCommGetAsyncError is polled until the communicator leaves
// that state, before anything else is called on it. NCCL error codes map to absl codes as
// ncclInvalidArgument -> InvalidArgument, ncclInvalidUsage -> FailedPrecondition,
// ncclRemoteError / ncclSystemError -> Unavailable (a peer or the network is gone), the rest
// -> Internal.
#include "dtensor/collectives/nccl/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dtensor/collectives/checks.h"
#include "dtensor/collectives/nccl/nccl_api.h"
#include "dtensor/kernels/cuda/cuda_common.h"
#include "dtensor/tensor/status.h"

namespace dtensor {

bool NcclBuilt() { return true; }

namespace {

using internal::CheckContiguous;
using internal::CheckCounts;
using internal::CheckNumel;
using internal::CheckReducible;
using internal::CheckSameDType;
using internal::DeviceGuard;
using internal::Nccl;
using internal::Overlap;
using internal::PrefixOffsets;
using internal::ToStatus;

// ---------------------------------------------------------------------------------------------
// Owners of the raw CUDA / NCCL handles.

struct StreamDeleter {
  void operator()(cudaStream_t s) const {
    if (s != nullptr) cudaStreamDestroy(s);
  }
};
struct EventDeleter {
  void operator()(cudaEvent_t e) const {
    if (e != nullptr) cudaEventDestroy(e);  // fine while pending: released once it completes
  }
};
// A healthy communicator is finalized (polled) before it gets here; a failed one is released
// into ncclCommAbort instead (NcclState::Abort).
struct CommDeleter {
  void operator()(ncclComm_t c) const {
    if (c != nullptr) Nccl().ncclCommDestroy(c);
  }
};
using StreamPtr = std::unique_ptr<CUstream_st, StreamDeleter>;
using EventPtr = std::unique_ptr<CUevent_st, EventDeleter>;
using CommPtr = std::unique_ptr<ncclComm, CommDeleter>;

absl::StatusOr<EventPtr> NewEvent(const char* op, int device) {
  cudaEvent_t e = nullptr;
  DT_RETURN_IF_ERROR(ToStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), op, device));
  return EventPtr(e);
}

// ---------------------------------------------------------------------------------------------
// Errors.

absl::StatusCode NcclCode(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
      return absl::StatusCode::kInvalidArgument;
    case ncclInvalidUsage:
      return absl::StatusCode::kFailedPrecondition;
    case ncclRemoteError:
    case ncclSystemError:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

// "[op] rank r (cuda:d): NCCL <error string>: <ncclGetLastError>"; OK for ncclSuccess.
absl::Status NcclStatus(ncclResult_t r, const char* op, int rank, int device, ncclComm_t comm) {
  if (r == ncclSuccess) return absl::OkStatus();
  const char* last = Nccl().ncclGetLastError(comm);
  std::string msg = absl::StrCat("[", op, "] rank ", rank, " (cuda:", device, "): NCCL ", Nccl().ncclGetErrorString(r));
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&msg, ": ", last);
  return absl::Status(NcclCode(r), msg);
}

// Sleeps a little longer the longer a wait lasts: yields for the first ~100 us (collectives
// of a few KiB finish in that time), then sleeps up to 1 ms.
void Backoff(int iteration) {
  if (iteration < 200) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(10 * std::min(100, iteration - 199)));
  }
}

// Polls a non-blocking communicator until it leaves ncclInProgress or `deadline` passes
// (then *timed_out is set and ncclInProgress returned). `first` is the result of the call
// that started the work.
ncclResult_t PollComm(ncclComm_t comm, ncclResult_t first, absl::Time deadline, bool* timed_out) {
  *timed_out = false;
  if (first != ncclInProgress) return first;
  for (int i = 0;; ++i) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = Nccl().ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (absl::Now() >= deadline) {
      *timed_out = true;
      return ncclInProgress;
    }
    Backoff(i);
  }
}

// Whom a call waits for, as its timeout and error messages name them: one peer, the peers of
// a BatchSendRecv, or every rank (a collective: -1 or no peers).
class WaitTarget {
 public:
  WaitTarget(int peer) {  // NOLINT(google-explicit-constructor): a peer, or -1 for every rank
    if (peer >= 0) peers_.push_back(peer);
  }
  explicit WaitTarget(absl::InlinedVector<int, 2> peers) : peers_(std::move(peers)) {}
  std::string Describe(int size) const {
    if (peers_.empty()) return absl::StrCat("all ", size, " ranks (NCCL cannot tell which is missing)");
    if (peers_.size() == 1) return internal::RanksPhrase(peers_);
    return absl::StrCat(internal::RanksPhrase(peers_), " (NCCL cannot tell which is missing)");
  }

 private:
  absl::InlinedVector<int, 2> peers_;
};

// ---------------------------------------------------------------------------------------------
// NcclState

class NcclState : public std::enable_shared_from_this<NcclState> {
 public:
  // Takes a ready (initialized) communicator; creates the stream and the ordering event.
  static absl::StatusOr<std::shared_ptr<NcclState>> Create(ncclComm_t raw, int device, absl::Duration timeout) {
    CommPtr comm(raw);
    const char* op = "MakeNcclCommunicator";
    DeviceGuard guard(device);
    if (!guard.ok()) return ToStatus(guard.error(), op, device);
    int rank = 0, size = 0;
    ncclResult_t r = Nccl().ncclCommUserRank(comm.get(), &rank);
    if (r == ncclSuccess) r = Nccl().ncclCommCount(comm.get(), &size);
    if (r != ncclSuccess) {
      const absl::Status s = NcclStatus(r, op, rank, device, comm.get());
      Nccl().ncclCommAbort(comm.release());
      return s;
    }
    cudaStream_t stream = nullptr;
    absl::Status s = ToStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), op, device);
    StreamPtr stream_ptr(stream);
    absl::StatusOr<EventPtr> ready = s.ok() ? NewEvent(op, device) : absl::StatusOr<EventPtr>(s);
    if (!ready.ok()) {
      Nccl().ncclCommAbort(comm.release());
      return ready.status();
    }
    return std::shared_ptr<NcclState>(
        new NcclState(std::move(comm), std::move(stream_ptr), *std::move(ready), device, rank, size, timeout));
  }

  ~NcclState() {
    DeviceGuard guard(device_);
    if (comm_ != nullptr) {
      // Flush outstanding work (polled, so a dead peer cannot hang the destructor), then
      // destroy; abort if that fails or takes longer than the timeout.
      bool timed_out = false;
      const ncclResult_t r =
          PollComm(comm_.get(), Nccl().ncclCommFinalize(comm_.get()), absl::Now() + timeout_, &timed_out);
      if (r != ncclSuccess || timed_out) Nccl().ncclCommAbort(comm_.release());
      comm_.reset();
    }
    // scratch_ (and the stream, the event) are released after this body, once the
    // communicator is gone.
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  absl::Duration timeout() const { return timeout_; }
  void set_timeout(absl::Duration t) { timeout_ = t; }
  ncclComm_t comm() const { return comm_.get(); }

  // FailedPrecondition quoting the first failure, once the communicator is dead.
  absl::Status CheckAlive(const char* op) const {
    if (failure_.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("[", op, "] rank ", rank_, " (cuda:", device_,
                                                      "): the nccl communicator failed earlier: ", failure_.message()));
  }

  // Records the first failure, aborts the NCCL communicator and returns `s`.
  absl::Status Fail(absl::Status s) {
    if (failure_.ok()) failure_ = s;
    if (comm_ != nullptr) {
      DeviceGuard guard(device_);
      Nccl().ncclCommAbort(comm_.release());
    }
    return s;
  }

  // Makes the communication stream wait for everything queued so far on the calling thread's
  // compute stream (cudaStreamPerThread). The device must be current.
  absl::Status OrderAfterCompute(const char* op) {
    DT_RETURN_IF_ERROR(ToStatus(cudaEventRecord(ready_.get(), cudaStreamPerThread), op, device_));
    return ToStatus(cudaStreamWaitEvent(stream_.get(), ready_.get(), 0), op, device_);
  }

  // Copies `bytes` from src to dst on the communication stream, after the compute stream
  // (a later Launch on this communicator is ordered after it).
  absl::Status CopyOnStream(const char* op, void* dst, const void* src, size_t bytes) {
    DT_RETURN_IF_ERROR(CheckAlive(op));
    if (bytes == 0 || dst == src) return absl::OkStatus();
    DeviceGuard guard(device_);
    if (!guard.ok()) return ToStatus(guard.error(), op, device_);
    DT_RETURN_IF_ERROR(OrderAfterCompute(op));
    return ToStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_.get()), op, device_);
  }

  // A private contiguous copy of `t` made on the communication stream (for inputs that
  // overlap outputs in ways NCCL does not allow). The caller keeps it alive in its Work.
  absl::StatusOr<Tensor> StageCopy(const char* op, const Tensor& t) {
    DT_ASSIGN_OR_RETURN(Tensor copy, Tensor::Empty(t.shape(), t.dtype(), Device::Cuda(device_)));
    DT_RETURN_IF_ERROR(CopyOnStream(op, copy.raw_data(), t.raw_data(), t.nbytes()));
    return copy;
  }

  // Settles the result of an NCCL call that enqueued work: polls ncclInProgress away; an
  // error or the timeout kills the communicator.
  absl::Status Settle(const char* op, const WaitTarget& who, ncclResult_t r) {
    bool timed_out = false;
    r = PollComm(comm_.get(), r, absl::Now() + timeout_, &timed_out);
    if (timed_out) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          "[", op, "] rank ", rank_, " (cuda:", device_, "): NCCL did not accept the call within ",
          absl::FormatDuration(timeout_), " waiting for ", who.Describe(size_), "; communicator aborted")));
    }
    if (r != ncclSuccess) return Fail(NcclStatus(r, op, rank_, device_, comm_.get()));
    return absl::OkStatus();
  }

  // Waits (host side) until `event` has completed, NCCL reports an error, or the timeout.
  absl::Status WaitEvent(cudaEvent_t event, const char* op, const WaitTarget& who, absl::Duration timeout) {
    DeviceGuard guard(device_);
    if (!guard.ok()) return ToStatus(guard.error(), op, device_);
    const absl::Time deadline = absl::Now() + timeout;
    for (int i = 0;; ++i) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return Fail(ToStatus(q, op, device_));
      DT_RETURN_IF_ERROR(CheckAlive(op));  // aborted by another Work of this communicator
      ncclResult_t async = ncclSuccess;
      const ncclResult_t r = Nccl().ncclCommGetAsyncError(comm_.get(), &async);
      if (r != ncclSuccess) return Fail(NcclStatus(r, op, rank_, device_, comm_.get()));
      if (async != ncclSuccess && async != ncclInProgress) {
        const absl::Status s = NcclStatus(async, op, rank_, device_, comm_.get());
        return Fail(absl::Status(s.code(), absl::StrCat(s.message(), " (while waiting for ", who.Describe(size_),
                                                        "; communicator aborted)")));
      }
      if (absl::Now() >= deadline) {
        return Fail(absl::DeadlineExceededError(absl::StrCat(
            "[", op, "] rank ", rank_, " (cuda:", device_, "): timed out after ", absl::FormatDuration(timeout),
            " waiting for ", who.Describe(size_), "; communicator aborted")));
      }
      Backoff(i);
    }
  }

  // Runs `enqueue(comm, stream)` (NCCL calls returning ncclResult_t) on the communication
  // stream, after the compute stream, and returns a Work completing with it.
  template <typename F>
  absl::StatusOr<std::unique_ptr<Work>> Launch(const char* op, WaitTarget who, std::vector<Tensor> keep, F&& enqueue);

  // A 1-element float32 buffer for Barrier.
  absl::StatusOr<Tensor> Scratch() {
    if (!scratch_.defined()) {
      DT_ASSIGN_OR_RETURN(scratch_, Tensor::Empty({1}, DType::kFloat32, Device::Cuda(device_)));
      DeviceGuard guard(device_);
      DT_RETURN_IF_ERROR(ToStatus(cudaMemsetAsync(scratch_.raw_data(), 0, 4, cudaStreamPerThread), "Barrier", device_));
    }
    return scratch_;
  }

 private:
  NcclState(CommPtr comm, StreamPtr stream, EventPtr ready, int device, int rank, int size, absl::Duration timeout)
      : comm_(std::move(comm)),
        stream_(std::move(stream)),
        ready_(std::move(ready)),
        device_(device),
        rank_(rank),
        size_(size),
        timeout_(timeout) {}

  CommPtr comm_;  // null once aborted
  StreamPtr stream_;
  EventPtr ready_;  // recorded on the compute stream before each call
  const int device_;
  const int rank_;
  const int size_;
  absl::Duration timeout_;
  absl::Status failure_;  // the first fatal error
  Tensor scratch_;
};

// ---------------------------------------------------------------------------------------------
// NcclWork

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> state, EventPtr done, const char* op, WaitTarget who, absl::Duration timeout,
           std::vector<Tensor> keep)
      : state_(std::move(state)),
        done_event_(std::move(done)),
        op_(op),
        who_(std::move(who)),
        timeout_(timeout),
        keep_(std::move(keep)) {}

  ~NcclWork() override {
    if (done_event_ == nullptr) return;
    DeviceGuard guard(state_->device());
    bool leak = false;
    if (!finished_ && std::this_thread::get_id() == owner_) {
      // Not waited for: blocks freed below must not be reused by compute-stream work before
      // the collective is done with them.
      leak = cudaStreamWaitEvent(cudaStreamPerThread, done_event_.get(), 0) != cudaSuccess;
    } else if (!finished_) {
      // Destroyed on another thread: its cudaStreamPerThread is not the stream the owner's
      // next kernels run on, so making it wait would not protect the blocks. Wait on the
      // host for the event instead (no NCCL call: the communicator is the owner's), up to
      // the timeout; past it, or on a CUDA error, leak the buffers.
      const absl::Time deadline = absl::Now() + timeout_;
      cudaError_t q = cudaEventQuery(done_event_.get());
      for (int i = 0; q == cudaErrorNotReady && absl::Now() < deadline; ++i) {
        Backoff(i);
        q = cudaEventQuery(done_event_.get());
      }
      leak = q != cudaSuccess;
    } else if (!status_.ok() && cudaEventQuery(done_event_.get()) == cudaErrorNotReady) {
      // Failed and (after the abort) possibly still touching its buffers.
      leak = true;
    }
    // Leak rather than let the allocator hand the blocks out again while NCCL may write them.
    if (leak) new std::vector<Tensor>(std::move(keep_));
  }

  absl::Status Wait() override {
    if (finished_) return status_;
    status_ = state_->WaitEvent(done_event_.get(), op_, who_, timeout_);
    finished_ = true;
    if (status_.ok()) keep_.clear();  // done with the buffers; a failed Work keeps them (see ~NcclWork)
    return status_;
  }

  // The compute stream waits for the event (no host wait); buffers stay referenced until
  // Wait() or the destructor, which then finds the event done or waits for it as above.
  absl::Status WaitStream() override {
    if (finished_) return status_;
    DT_RETURN_IF_ERROR(state_->CheckAlive(op_));
    DeviceGuard guard(state_->device());
    if (!guard.ok()) return ToStatus(guard.error(), op_, state_->device());
    return ToStatus(cudaStreamWaitEvent(cudaStreamPerThread, done_event_.get(), 0), op_, state_->device());
  }

  bool IsCompleted() override {
    if (finished_) return true;
    DeviceGuard guard(state_->device());
    const cudaError_t q = cudaEventQuery(done_event_.get());
    if (q != cudaErrorNotReady) return true;  // done, or a CUDA error Wait() returns at once
    if (!state_->CheckAlive(op_).ok()) return true;
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = Nccl().ncclCommGetAsyncError(state_->comm(), &async);
    return r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress);
  }

 private:
  std::shared_ptr<NcclState> state_;
  EventPtr done_event_;
  const char* op_;
  WaitTarget who_;
  absl::Duration timeout_;
  std::vector<Tensor> keep_;
  bool finished_ = false;
  absl::Status status_;
  std::thread::id owner_ = std::this_thread::get_id();  // the thread that issued the collective
};

template <typename F>
absl::StatusOr<std::unique_ptr<Work>> NcclState::Launch(const char* op, WaitTarget who, std::vector<Tensor> keep,
                                                        F&& enqueue) {
  DT_RETURN_IF_ERROR(CheckAlive(op));
  DeviceGuard guard(device_);
  if (!guard.ok()) return ToStatus(guard.error(), op, device_);
  DT_RETURN_IF_ERROR(OrderAfterCompute(op));
  DT_ASSIGN_OR_RETURN(EventPtr done, NewEvent(op, device_));  // before the enqueue: it may fail
  DT_RETURN_IF_ERROR(Settle(op, who, enqueue(comm_.get(), stream_.get())));
  const absl::Status recorded = ToStatus(cudaEventRecord(done.get(), stream_.get()), op, device_);
  if (!recorded.ok()) {
    // The collective is queued with no way to tell when it ends: the communicator is dead,
    // and its buffers are leaked rather than handed out again while it may still use them.
    new std::vector<Tensor>(std::move(keep));
    return Fail(recorded);
  }
  return std::unique_ptr<Work>(
      std::make_unique<NcclWork>(shared_from_this(), std::move(done), op, std::move(who), timeout_, std::move(keep)));
}

// ncclGroupStart(); body(); ncclGroupEnd() — the group is closed even when body fails.
template <typename F>
ncclResult_t Grouped(F&& body) {
  ncclResult_t r = Nccl().ncclGroupStart();
  if (r != ncclSuccess) return r;
  const ncclResult_t first = body();
  const ncclResult_t end = Nccl().ncclGroupEnd();
  return first != ncclSuccess ? first : end;
}

// ---------------------------------------------------------------------------------------------
// Validation and type mapping.

// NCCL type that moves `dtype` (bytes for the storage-only types).
ncclDataType_t MoveType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
    case DType::kBool:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return ncclUint8;
  }
  return ncclUint8;
}

struct Reduction {
  ncclDataType_t type;
  ncclRedOp_t op;
};

absl::StatusOr<Reduction> ReduceType(const char* op, int rank, DType dtype, CommReduceOp rop) {
  DT_RETURN_IF_ERROR(CheckReducible(op, rank, dtype, rop));
  if (dtype == DType::kBool) {  // 0/1 bytes: or = max, and = min
    switch (rop) {
      case CommReduceOp::kSum:
      case CommReduceOp::kMax:
        return Reduction{ncclUint8, ncclMax};
      case CommReduceOp::kMin:
      case CommReduceOp::kProduct:
        return Reduction{ncclUint8, ncclMin};
      case CommReduceOp::kAvg:
        break;
    }
    return InvalidArg(op, "rank ", rank, ": avg is not defined for bool");
  }
  switch (rop) {
    case CommReduceOp::kSum:
      return Reduction{MoveType(dtype), ncclSum};
    case CommReduceOp::kAvg:
      return Reduction{MoveType(dtype), ncclAvg};
    case CommReduceOp::kMax:
      return Reduction{MoveType(dtype), ncclMax};
    case CommReduceOp::kMin:
      return Reduction{MoveType(dtype), ncclMin};
    case CommReduceOp::kProduct:
      return Reduction{MoveType(dtype), ncclProd};
  }
  return InvalidArg(op, "rank ", rank, ": unknown reduction ", static_cast<int>(rop));
}

bool AllEqual(absl::Span<const int64_t> counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
}

const char* At(const Tensor& t, int64_t elements) {
  return static_cast<const char*>(t.raw_data()) + elements * static_cast<int64_t>(ElementSize(t.dtype()));
}
char* MutAt(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.raw_data()) + elements * static_cast<int64_t>(ElementSize(t.dtype()));
}

// ---------------------------------------------------------------------------------------------
// NcclCommunicator

// Every communicator split (transitively) from one MakeNcclCommunicator: an Abort on any of
// them aborts them all on this rank (ncclCommAbort each), as the threads and UCX backends do, so
// that the rank's later calls on any mesh dim's group fail at once. A split made after the abort
// fails at once too.
class NcclFamily {
 public:
  void Join(const std::shared_ptr<NcclState>& state) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.ok()) {
      (void)state->Fail(aborted_);
      return;
    }
    members_.push_back(state);
  }
  void Abort(const absl::Status& why) {
    std::vector<std::shared_ptr<NcclState>> live;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_.ok()) aborted_ = why;
      for (const std::weak_ptr<NcclState>& m : members_) {
        if (std::shared_ptr<NcclState> s = m.lock()) live.push_back(std::move(s));
      }
      members_.clear();
    }
    for (const std::shared_ptr<NcclState>& s : live) (void)s->Fail(why);
  }

 private:
  std::mutex mu_;
  std::vector<std::weak_ptr<NcclState>> members_;
  absl::Status aborted_;
};

class NcclCommunicator final : public Communicator {
 public:
  // `debug`: the DTENSOR_DEBUG checks, agreed by all ranks (MakeNcclCommunicator; a split
  // inherits its parent's).
  NcclCommunicator(std::shared_ptr<NcclState> state, bool debug, std::shared_ptr<NcclFamily> family)
      : state_(std::move(state)), debug_(debug), family_(std::move(family)) {
    family_->Join(state_);
  }

  int rank() const override { return state_->rank(); }
  int size() const override { return state_->size(); }
  Device device() const override { return Device::Cuda(state_->device()); }
  const char* backend() const override { return "nccl"; }
  void SetTimeout(absl::Duration timeout) override { state_->set_timeout(timeout); }
  absl::Duration timeout() const override { return state_->timeout(); }

  // ncclCommAbort on this communicator and every one of its family (NcclFamily); later calls
  // fail quoting `why` (CheckAlive).
  void Abort(const absl::Status& why) override {
    family_->Abort(absl::AbortedError(
        absl::StrCat("rank ", rank(), " aborted the communicator: ", why.ok() ? "no reason given" : why.ToString())));
  }

  absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const Tensor& input, const Tensor& output,
                                                       CommReduceOp op) override {
    const char* kOp = "AllReduce";
    DT_RETURN_IF_ERROR(CheckPair(kOp, input, output));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "output", output, input.numel(), "same as input"));
    DT_ASSIGN_OR_RETURN(const Reduction red, ReduceType(kOp, rank(), input.dtype(), op));
    DT_ASSIGN_OR_RETURN(Tensor in, Staged(kOp, input, output, input.raw_data() == output.raw_data()));
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, input.dtype(), input.numel(), static_cast<int64_t>(op)));
    const size_t n = static_cast<size_t>(input.numel());
    return state_->Launch(kOp, -1, {in, output}, [&](ncclComm_t comm, cudaStream_t stream) {
      return n == 0 ? ncclSuccess
                    : Nccl().ncclAllReduce(in.raw_data(), output.raw_data(), n, red.type, red.op, comm, stream);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const Tensor& input, const Tensor& output) override {
    const char* kOp = "AllGather";
    DT_RETURN_IF_ERROR(CheckPair(kOp, input, output));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "output", output, size() * input.numel(), "group size * input"));
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, input.dtype(), input.numel(), -1));
    const bool in_place = input.raw_data() == At(output, rank() * input.numel());
    DT_ASSIGN_OR_RETURN(Tensor in, Staged(kOp, input, output, in_place));
    const size_t n = static_cast<size_t>(input.numel());
    const ncclDataType_t type = MoveType(input.dtype());
    return state_->Launch(kOp, -1, {in, output}, [&](ncclComm_t comm, cudaStream_t stream) {
      return n == 0 ? ncclSuccess : Nccl().ncclAllGather(in.raw_data(), output.raw_data(), n, type, comm, stream);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const Tensor& input, const Tensor& output,
                                                           CommReduceOp op) override {
    const char* kOp = "ReduceScatter";
    DT_RETURN_IF_ERROR(CheckPair(kOp, input, output));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "input", input, size() * output.numel(), "group size * output"));
    DT_ASSIGN_OR_RETURN(const Reduction red, ReduceType(kOp, rank(), input.dtype(), op));
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, input.dtype(), input.numel(), static_cast<int64_t>(op)));
    const bool in_place = output.raw_data() == At(input, rank() * output.numel());
    DT_ASSIGN_OR_RETURN(Tensor in, Staged(kOp, input, output, in_place));
    const size_t n = static_cast<size_t>(output.numel());
    return state_->Launch(kOp, -1, {in, output}, [&](ncclComm_t comm, cudaStream_t stream) {
      return n == 0 ? ncclSuccess
                    : Nccl().ncclReduceScatter(in.raw_data(), output.raw_data(), n, red.type, red.op, comm, stream);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllAsync(const Tensor& input, const Tensor& output) override {
    const char* kOp = "AllToAll";
    DT_RETURN_IF_ERROR(CheckPair(kOp, input, output));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "output", output, input.numel(), "same as input"));
    if (input.numel() % size() != 0) {
      return InvalidArg(kOp, "rank ", rank(), ": input has ", input.numel(),
                        " elements, not a multiple of the group size ", size());
    }
    const std::vector<int64_t> counts(static_cast<size_t>(size()), input.numel() / size());
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, input.dtype(), input.numel(), -1));
    return AllToAllImpl(kOp, input, output, counts, counts);
  }

  absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(const Tensor& tensor, int root) override {
    const char* kOp = "Broadcast";
    DT_RETURN_IF_ERROR(CheckTensor(kOp, "tensor", tensor));
    DT_RETURN_IF_ERROR(CheckPeer(kOp, "root", root));
    const size_t n = static_cast<size_t>(tensor.numel());
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, tensor.dtype(), tensor.numel(), root));
    const ncclDataType_t type = MoveType(tensor.dtype());
    return state_->Launch(kOp, -1, {tensor}, [&](ncclComm_t comm, cudaStream_t stream) {
      return n == 0 ? ncclSuccess
                    : Nccl().ncclBroadcast(tensor.raw_data(), tensor.raw_data(), n, type, root, comm, stream);
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> SendAsync(const Tensor& tensor, int peer) override {
    return P2P("Send", tensor, peer, /*is_send=*/true);
  }
  absl::StatusOr<std::unique_ptr<Work>> RecvAsync(const Tensor& tensor, int peer) override {
    return P2P("Recv", tensor, peer, /*is_send=*/false);
  }

  // One NCCL group: every send and receive of the batch is queued before any waits for its
  // peer. NCCL matches sends to this rank with its receives from it, in order, itself.
  absl::StatusOr<std::unique_ptr<Work>> BatchSendRecvAsync(absl::Span<const PeerOp> ops) override {
    constexpr const char* kOp = "BatchSendRecv";
    DT_RETURN_IF_ERROR(internal::CheckPeerOps(kOp, rank(), size(), device(), ops).status());
    if (ops.empty()) return internal::MakeCompletedWork(absl::OkStatus());
    std::vector<Tensor> keep;
    absl::InlinedVector<int, 2> peers;  // the other ranks of the batch, named by a timeout
    for (const PeerOp& o : ops) {
      keep.push_back(o.tensor);
      if (o.peer != rank() && std::find(peers.begin(), peers.end(), o.peer) == peers.end()) peers.push_back(o.peer);
    }
    std::sort(peers.begin(), peers.end());
    return state_->Launch(
        kOp, WaitTarget(std::move(peers)), std::move(keep), [&](ncclComm_t comm, cudaStream_t stream) {
          return Grouped([&]() -> ncclResult_t {
            for (const PeerOp& o : ops) {
              const size_t n = static_cast<size_t>(o.tensor.numel());
              if (n == 0) continue;
              const ncclDataType_t type = MoveType(o.tensor.dtype());
              const ncclResult_t r = o.kind == PeerOp::Kind::kSend
                                         ? Nccl().ncclSend(o.tensor.raw_data(), n, type, o.peer, comm, stream)
                                         : Nccl().ncclRecv(o.tensor.raw_data(), n, type, o.peer, comm, stream);
              if (r != ncclSuccess) return r;
            }
            return ncclSuccess;
          });
        });
  }

  absl::StatusOr<std::unique_ptr<Work>> AllGatherVAsync(const Tensor& input, const Tensor& output,
                                                        absl::Span<const int64_t> counts) override {
    const char* kOp = "AllGatherV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckCounts(kOp, rank(), "counts", counts, size()));
    const int64_t mine = counts[static_cast<size_t>(rank())];
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "input", input, mine, "counts[rank]"));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "output", output, total, "sum of counts"));
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, input.dtype(), total, -1));
    const std::vector<int64_t> offsets = PrefixOffsets(counts);
    const bool in_place = input.raw_data() == At(output, offsets[static_cast<size_t>(rank())]);
    DT_ASSIGN_OR_RETURN(Tensor in, Staged(kOp, input, output, in_place));
    const ncclDataType_t type = MoveType(input.dtype());
    if (AllEqual(counts)) {
      return state_->Launch(kOp, -1, {in, output}, [&](ncclComm_t comm, cudaStream_t stream) {
        return mine == 0 ? ncclSuccess
                         : Nccl().ncclAllGather(in.raw_data(), output.raw_data(), static_cast<size_t>(mine), type, comm,
                                                stream);
      });
    }
    // Own block: a copy on the communication stream; the others: grouped send / recv.
    const int me = rank();
    DT_RETURN_IF_ERROR(
        state_->CopyOnStream(kOp, MutAt(output, offsets[static_cast<size_t>(me)]), in.raw_data(), in.nbytes()));
    return state_->Launch(kOp, -1, {in, output}, [&](ncclComm_t comm, cudaStream_t stream) {
      return Grouped([&]() -> ncclResult_t {
        for (int j = 0; j < size(); ++j) {
          if (j == me) continue;
          const size_t uj = static_cast<size_t>(j);
          if (mine > 0) {
            const ncclResult_t r = Nccl().ncclSend(in.raw_data(), static_cast<size_t>(mine), type, j, comm, stream);
            if (r != ncclSuccess) return r;
          }
          if (counts[uj] > 0) {
            const ncclResult_t r =
                Nccl().ncclRecv(MutAt(output, offsets[uj]), static_cast<size_t>(counts[uj]), type, j, comm, stream);
            if (r != ncclSuccess) return r;
          }
        }
        return ncclSuccess;
      });
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> ReduceScatterVAsync(const Tensor& input, const Tensor& output,
                                                            absl::Span<const int64_t> counts,
                                                            CommReduceOp op) override {
    const char* kOp = "ReduceScatterV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t total, CheckCounts(kOp, rank(), "counts", counts, size()));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "input", input, total, "sum of counts"));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "output", output, counts[static_cast<size_t>(rank())], "counts[rank]"));
    DT_ASSIGN_OR_RETURN(const Reduction red, ReduceType(kOp, rank(), input.dtype(), op));
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, input.dtype(), total, static_cast<int64_t>(op)));
    const std::vector<int64_t> offsets = PrefixOffsets(counts);
    const bool in_place = output.raw_data() == At(input, offsets[static_cast<size_t>(rank())]);
    DT_ASSIGN_OR_RETURN(Tensor in, Staged(kOp, input, output, in_place));
    if (AllEqual(counts)) {
      return state_->Launch(kOp, -1, {in, output}, [&](ncclComm_t comm, cudaStream_t stream) {
        return output.numel() == 0
                   ? ncclSuccess
                   : Nccl().ncclReduceScatter(in.raw_data(), output.raw_data(), static_cast<size_t>(output.numel()),
                                              red.type, red.op, comm, stream);
      });
    }
    // One ncclReduce per destination rank, grouped (root j receives block j in its output).
    const int me = rank();
    return state_->Launch(kOp, -1, {in, output}, [&](ncclComm_t comm, cudaStream_t stream) {
      return Grouped([&]() -> ncclResult_t {
        for (int j = 0; j < size(); ++j) {
          const size_t uj = static_cast<size_t>(j);
          if (counts[uj] == 0) continue;
          // Only the root's recvbuff is written; the others pass their (valid) sendbuff.
          const char* send = At(in, offsets[uj]);
          void* recv = j == me ? output.raw_data() : const_cast<char*>(send);
          const ncclResult_t r =
              Nccl().ncclReduce(send, recv, static_cast<size_t>(counts[uj]), red.type, red.op, j, comm, stream);
          if (r != ncclSuccess) return r;
        }
        return ncclSuccess;
      });
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(const Tensor& input, const Tensor& output,
                                                       absl::Span<const int64_t> send_counts,
                                                       absl::Span<const int64_t> recv_counts) override {
    const char* kOp = "AllToAllV";
    DT_RETURN_IF_ERROR(CheckPair(kOp, input, output));
    DT_ASSIGN_OR_RETURN(const int64_t sends, CheckCounts(kOp, rank(), "send_counts", send_counts, size()));
    DT_ASSIGN_OR_RETURN(const int64_t recvs, CheckCounts(kOp, rank(), "recv_counts", recv_counts, size()));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "input", input, sends, "sum of send_counts"));
    DT_RETURN_IF_ERROR(CheckNumel(kOp, rank(), "output", output, recvs, "sum of recv_counts"));
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, input.dtype(), -1, -1));
    return AllToAllImpl(kOp, input, output, send_counts, recv_counts);
  }

  absl::Status Barrier() override {
    const char* kOp = "Barrier";
    DT_RETURN_IF_ERROR(state_->CheckAlive(kOp));
    DT_RETURN_IF_ERROR(CheckSameCall(kOp, DType::kFloat32, -1, -1));
    DT_ASSIGN_OR_RETURN(Tensor scratch, state_->Scratch());
    DT_ASSIGN_OR_RETURN(auto work, state_->Launch(kOp, -1, {scratch}, [&](ncclComm_t comm, cudaStream_t stream) {
      return Nccl().ncclAllReduce(scratch.raw_data(), scratch.raw_data(), 1, ncclFloat32, ncclSum, comm, stream);
    }));
    return work->Wait();  // host wait: every rank has reached the barrier when it returns
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    const char* kOp = "Split";
    DT_RETURN_IF_ERROR(state_->CheckAlive(kOp));
    const int device = state_->device();
    DeviceGuard guard(device);
    if (!guard.ok()) return ToStatus(guard.error(), kOp, device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    const ncclResult_t r =
        Nccl().ncclCommSplit(state_->comm(), color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config);
    // The split is collective over this communicator and runs as an NCCL job attached to it,
    // which writes `child` when it completes (the call may return before that, even with
    // ncclSuccess): poll this communicator until the job is done whatever the call returned,
    // so `child` is final (and no job writes to this frame after we return). Then the child.
    absl::Status s = state_->Settle(kOp, -1, r == ncclSuccess ? ncclInProgress : r);
    if (s.ok() && color >= 0 && child == nullptr) {
      s = absl::InternalError(absl::StrCat("[", kOp, "] rank ", rank(), " (cuda:", device,
                                           "): NCCL completed the split but returned no communicator for color ",
                                           color));
    }
    bool timed_out = false;
    ncclResult_t cr = ncclSuccess;
    if (s.ok() && child != nullptr) {
      cr = PollComm(child, ncclInProgress, absl::Now() + state_->timeout(), &timed_out);
      if (timed_out) {
        s = absl::DeadlineExceededError(absl::StrCat("[", kOp, "] rank ", rank(), " (cuda:", device,
                                                     "): the new communicator (color ", color, ") did not form within ",
                                                     absl::FormatDuration(state_->timeout())));
      } else if (cr != ncclSuccess) {
        s = NcclStatus(cr, kOp, rank(), device, child);
      }
    }
    if (!s.ok()) {
      if (child != nullptr) Nccl().ncclCommAbort(child);
      return s;
    }
    if (child == nullptr) return std::unique_ptr<Communicator>();  // negative color
    DT_ASSIGN_OR_RETURN(auto state, NcclState::Create(child, device, state_->timeout()));
    return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(std::move(state), debug_, family_));
  }

 private:
  absl::Status CheckTensor(const char* op, const char* name, const Tensor& t) const {
    if (!t.defined()) return InvalidArg(op, "rank ", rank(), ": ", name, " is undefined");
    if (t.device() != device()) {
      return InvalidArg(op, "rank ", rank(), ": ", name, " is on ", t.device().ToString(), "; this nccl communicator ",
                        "moves ", device().ToString(), " tensors");
    }
    return CheckContiguous(op, rank(), name, t);
  }

  absl::Status CheckPair(const char* op, const Tensor& in, const Tensor& out) const {
    DT_RETURN_IF_ERROR(CheckTensor(op, "input", in));
    DT_RETURN_IF_ERROR(CheckTensor(op, "output", out));
    return CheckSameDType(op, rank(), in, out);
  }

  absl::Status CheckPeer(const char* op, const char* what, int peer) const {
    return internal::CheckPeer(op, rank(), what, peer, size());
  }

  // `input` itself, or a private copy when it overlaps `output` other than in the one
  // in-place layout NCCL supports for the call.
  absl::StatusOr<Tensor> Staged(const char* op, const Tensor& input, const Tensor& output, bool supported_in_place) {
    if (supported_in_place || !Overlap(input, output)) return input;
    DT_RETURN_IF_ERROR(state_->CheckAlive(op));
    return state_->StageCopy(op, input);
  }

  absl::StatusOr<std::unique_ptr<Work>> AllToAllImpl(const char* op, const Tensor& input, const Tensor& output,
                                                     absl::Span<const int64_t> send_counts,
                                                     absl::Span<const int64_t> recv_counts) {
    // Sends and receives of one group run concurrently: an overlapping input is staged.
    DT_ASSIGN_OR_RETURN(Tensor in, Staged(op, input, output, /*supported_in_place=*/false));
    const std::vector<int64_t> send_off = PrefixOffsets(send_counts);
    const std::vector<int64_t> recv_off = PrefixOffsets(recv_counts);
    const ncclDataType_t type = MoveType(input.dtype());
    return state_->Launch(op, -1, {in, output}, [&](ncclComm_t comm, cudaStream_t stream) {
      return Grouped([&]() -> ncclResult_t {
        for (int j = 0; j < size(); ++j) {
          const size_t uj = static_cast<size_t>(j);
          if (send_counts[uj] > 0) {
            const ncclResult_t r =
                Nccl().ncclSend(At(in, send_off[uj]), static_cast<size_t>(send_counts[uj]), type, j, comm, stream);
            if (r != ncclSuccess) return r;
          }
          if (recv_counts[uj] > 0) {
            const ncclResult_t r = Nccl().ncclRecv(MutAt(output, recv_off[uj]), static_cast<size_t>(recv_counts[uj]),
                                                   type, j, comm, stream);
            if (r != ncclSuccess) return r;
          }
        }
        return ncclSuccess;
      });
    });
  }

  absl::StatusOr<std::unique_ptr<Work>> P2P(const char* op, const Tensor& tensor, int peer, bool is_send) {
    DT_RETURN_IF_ERROR(CheckTensor(op, "tensor", tensor));
    DT_RETURN_IF_ERROR(CheckPeer(op, "peer", peer));
    if (peer == rank()) return InvalidArg(op, "rank ", rank(), ": peer is this rank (", peer, ")");
    const size_t n = static_cast<size_t>(tensor.numel());
    const ncclDataType_t type = MoveType(tensor.dtype());
    return state_->Launch(op, peer, {tensor}, [&](ncclComm_t comm, cudaStream_t stream) {
      if (n == 0) return ncclSuccess;
      return is_send ? Nccl().ncclSend(tensor.raw_data(), n, type, peer, comm, stream)
                     : Nccl().ncclRecv(tensor.raw_data(), n, type, peer, comm, stream);
    });
  }

  // DTENSOR_DEBUG=1: before each collective every rank all-gathers a description of its call
  // (op, dtype, element count, reduction or root; -1 where ranks may legitimately differ) and
  // compares; a mismatch is InvalidArgument on every rank, naming both calls. Costs one small
  // all-gather and a host sync per call, so it is off by default.
  absl::Status CheckSameCall(const char* op, DType dtype, int64_t count, int64_t extra) {
    if (!debug_) return absl::OkStatus();
    constexpr int kWords = 4;
    const int64_t mine[kWords] = {OpIndex(op), static_cast<int64_t>(dtype), count, extra};
    const int dev = state_->device();
    if (!debug_buf_.defined()) {
      DT_ASSIGN_OR_RETURN(debug_buf_, Tensor::Empty({int64_t{size()} * kWords}, DType::kInt64, Device::Cuda(dev)));
    }
    int64_t* buf = debug_buf_.data<int64_t>();
    {
      DeviceGuard guard(dev);
      if (!guard.ok()) return ToStatus(guard.error(), op, dev);
      // On the compute stream: Launch orders the communication stream after it.
      DT_RETURN_IF_ERROR(ToStatus(
          cudaMemcpyAsync(buf + rank() * kWords, mine, sizeof(mine), cudaMemcpyHostToDevice, cudaStreamPerThread), op,
          dev));
    }
    DT_ASSIGN_OR_RETURN(auto work, state_->Launch(op, -1, {debug_buf_}, [&](ncclComm_t comm, cudaStream_t stream) {
      return Nccl().ncclAllGather(buf + rank() * kWords, buf, kWords, ncclInt64, comm, stream);
    }));
    DT_RETURN_IF_ERROR(work->Wait());
    std::vector<int64_t> all(static_cast<size_t>(size()) * kWords);
    {
      DeviceGuard guard(dev);
      if (!guard.ok()) return ToStatus(guard.error(), op, dev);
      DT_RETURN_IF_ERROR(ToStatus(
          cudaMemcpyAsync(all.data(), buf, all.size() * sizeof(int64_t), cudaMemcpyDeviceToHost, cudaStreamPerThread),
          op, dev));
      DT_RETURN_IF_ERROR(ToStatus(cudaStreamSynchronize(cudaStreamPerThread), op, dev));
    }
    for (int j = 0; j < size(); ++j) {
      const int64_t* theirs = all.data() + static_cast<size_t>(j) * kWords;
      if (!std::equal(theirs, theirs + kWords, mine)) {
        return absl::InvalidArgumentError(absl::StrCat("[Debug] rank ", rank(), " called ", DescribeCall(mine),
                                                       " but rank ", j, " called ", DescribeCall(theirs)));
      }
    }
    return absl::OkStatus();
  }

  static constexpr const char* kCallNames[] = {"AllReduce",  "AllGather",      "ReduceScatter", "AllToAll", "Broadcast",
                                               "AllGatherV", "ReduceScatterV", "AllToAllV",     "Barrier"};
  static int64_t OpIndex(const char* op) {
    for (size_t i = 0; i < std::size(kCallNames); ++i) {
      if (std::strcmp(kCallNames[i], op) == 0) return static_cast<int64_t>(i);
    }
    return -1;
  }
  // "AllReduce(float32, 12 elements, sum)", "Broadcast(bfloat16, 3 elements, root 1)".
  static std::string DescribeCall(const int64_t* d) {
    const bool known_op = d[0] >= 0 && d[0] < static_cast<int64_t>(std::size(kCallNames));
    std::string s = absl::StrCat(known_op ? kCallNames[d[0]] : "unknown op", "(");
    const bool reduces = d[0] == 0 || d[0] == 2 || d[0] == 6;
    absl::StrAppend(&s, d[1] >= 0 && d[1] <= static_cast<int64_t>(DType::kFloat8E5M2)
                            ? DTypeName(static_cast<DType>(d[1]))
                            : "unknown dtype");
    if (d[2] >= 0) absl::StrAppend(&s, ", ", d[2], " elements");
    if (reduces && d[3] >= 0 && d[3] <= static_cast<int64_t>(CommReduceOp::kProduct)) {
      absl::StrAppend(&s, ", ", CommReduceOpName(static_cast<CommReduceOp>(d[3])));
    } else if (d[0] == 4) {
      absl::StrAppend(&s, ", root ", d[3]);
    }
    return absl::StrCat(s, ")");
  }

  std::shared_ptr<NcclState> state_;
  const bool debug_;                    // CheckSameCall on every call
  std::shared_ptr<NcclFamily> family_;  // this communicator and its splits
  Tensor debug_buf_;                    // [size * 4] int64 on the device, for CheckSameCall
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const LaunchInfo& info, StoreClient& store,
                                                                   int device_index, absl::Duration timeout) {
  const char* kOp = "MakeNcclCommunicator";
  if (info.world_size < 1 || info.rank < 0 || info.rank >= info.world_size) {
    return InvalidArg(kOp, "rank ", info.rank, " is not in a world of size ", info.world_size);
  }
  const int count = CudaDeviceCount();
  if (device_index < 0 || device_index >= count) {
    return absl::FailedPreconditionError(absl::StrCat("[", kOp, "] rank ", info.rank, ": cuda:", device_index,
                                                      " is not a visible device (", count, " CUDA devices visible)"));
  }

  // Loads NCCL (nccl_api.h), or says it is missing, before meeting the peers.
  if (absl::Status loaded = internal::LoadNccl(); !loaded.ok()) {
    return absl::Status(loaded.code(), absl::StrCat("[", kOp, "] rank ", info.rank, ": ", loaded.message()));
  }

  // The n-th communicator of this rank on this store meets the n-th of every other rank.
  DT_ASSIGN_OR_RETURN(const int64_t n, store.Add(absl::StrCat("dtensor/nccl/created/", info.rank), 1));
  const std::string key = absl::StrCat("dtensor/nccl/", n, "/id");
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (info.rank == 0) {
    DT_RETURN_IF_ERROR(NcclStatus(Nccl().ncclGetUniqueId(&id), kOp, info.rank, device_index, nullptr));
    DT_RETURN_IF_ERROR(store.Set(key, std::string(id.internal, sizeof(id.internal))));
  } else {
    DT_ASSIGN_OR_RETURN(const std::string bytes, store.Get(key));
    if (bytes.size() != sizeof(id.internal)) {
      return absl::InternalError(absl::StrCat("[", kOp, "] rank ", info.rank, ": store key ", key, " holds ",
                                              bytes.size(), " bytes, not an ncclUniqueId (", sizeof(id.internal), ")"));
    }
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }

  // DTENSOR_DEBUG=1 on any rank turns the call checks on for all (a check is a collective: ranks
  // that disagreed would hang). Every rank counts itself in before the group forms, so once it
  // has formed the count is final.
  const char* debug_env = std::getenv("DTENSOR_DEBUG");
  const std::string debug_key = absl::StrCat("dtensor/nccl/", n, "/debug");
  DT_RETURN_IF_ERROR(store.Add(debug_key, debug_env != nullptr && std::strcmp(debug_env, "1") == 0 ? 1 : 0).status());

  DeviceGuard guard(device_index);
  if (!guard.ok()) return ToStatus(guard.error(), kOp, device_index);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const absl::Time deadline = absl::Now() + timeout;
  bool timed_out = false;
  const ncclResult_t started = Nccl().ncclCommInitRankConfig(&comm, info.world_size, id, info.rank, &config);
  // Polled even after ncclSuccess: the init job may still be finishing in the background.
  const ncclResult_t r = comm != nullptr && (started == ncclSuccess || started == ncclInProgress)
                             ? PollComm(comm, ncclInProgress, deadline, &timed_out)
                             : started;
  if (timed_out || r != ncclSuccess) {
    const absl::Status s = timed_out
                               ? absl::DeadlineExceededError(absl::StrCat(
                                     "[", kOp, "] rank ", info.rank, " (cuda:", device_index, "): the NCCL group of ",
                                     info.world_size, " ranks did not form within ", absl::FormatDuration(timeout),
                                     " (are all ranks running, each on its own GPU?)"))
                               : NcclStatus(r, kOp, info.rank, device_index, comm);
    if (comm != nullptr) Nccl().ncclCommAbort(comm);
    return s;
  }
  absl::StatusOr<int64_t> debug_count = store.Add(debug_key, 0);
  if (!debug_count.ok()) {
    Nccl().ncclCommAbort(comm);
    return debug_count.status();
  }
  DT_ASSIGN_OR_RETURN(auto state, NcclState::Create(comm, device_index, timeout));
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(std::move(state), *debug_count > 0, std::make_shared<NcclFamily>()));
}

}  // namespace dtensor
