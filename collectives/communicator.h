// Communicator: collectives over a group of ranks, on Tensors of any dtype and device.
//
//   std::vector<std::unique_ptr<Communicator>> comms = ...;   // e.g. MakeThreadGroup(4)
//   Communicator& comm = *comms[rank];                          // one per rank (thread or process)
//   DT_RETURN_IF_ERROR(comm.AllReduce(grad, grad, CommReduceOp::kAvg));      // in place
//   DT_ASSIGN_OR_RETURN(auto work, comm.AllGatherAsync(shard, full));        // overlap...
//   ...compute...
//   DT_RETURN_IF_ERROR(work->Wait());                                        // ...then wait
//
// One argument order for every collective, as NCCL: (input, output, [op], [root | peer]).
// Counts are elements, never bytes, and come from the tensors:
//   AllReduce       input [n]        -> output [n]               (in place allowed)
//   AllGather       input [n]        -> output [size * n]        (rank r's block at r * n)
//   ReduceScatter   input [size * n] -> output [n]               (rank r gets block r)
//   AllToAll        input [size * n] -> output [size * n]        (block j goes to rank j)
//   Broadcast       tensor [n], root                              (in place)
//   Send / Recv     tensor [n], peer
//   BatchSendRecv   {Send(tensor, peer) | Recv(tensor, peer), ...}   (all posted at once)
// Tensors must be contiguous, of one dtype and on the communicator's device; "[n]" means any
// shape with n elements (blocks are along the flat, row-major order, which is dim 0 for a
// contiguous tensor). The *V variants take per-rank counts for torch.chunk-style uneven shards.
// Every blocking call honours the communicator's timeout and then returns DeadlineExceeded
// naming the operation, this rank and the peer it waited for; a peer that is gone gives
// Unavailable (sooner, where the transport can tell). Mismatched calls across ranks are a
// usage error; with DTENSOR_DEBUG=1 they are detected and reported with both sides' calls.
//
// Ranks fail together: a rank that cannot take part in a collective its peers will enter
// (its own arguments failed their checks) calls Abort(why) instead of leaving them waiting:
//   if (!checked.ok()) { comm.Abort(checked); return checked; }
// Every peer's pending and later calls then return Aborted naming this rank and `why`, e.g.
// "[AllGather] rank 2 stopped waiting for rank(s) 0: rank 0 aborted the communicator:
// INVALID_ARGUMENT: [FromLocal] local shape [3, 3] is not ...", within milliseconds (threads:
// at once; ucx: a message every waiting rank polls); this rank's own later calls fail the
// same way. An abort
// reaches the whole family: the communicator it is called on, the one it was split from and
// every communicator split from either (a DeviceMesh's groups), on every rank.
#ifndef DTENSOR_COLLECTIVES_COMMUNICATOR_H_
#define DTENSOR_COLLECTIVES_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

// Reductions of AllReduce / ReduceScatter. kAvg divides the sum by the group size.
enum class CommReduceOp : uint8_t { kSum, kAvg, kMax, kMin, kProduct };

// "sum", "avg", "max", "min", "product".
const char* CommReduceOpName(CommReduceOp op);

// A pending collective. Wait() returns the collective's status; after it returns, the output
// tensors hold the result and the inputs may be reused.
class Work {
 public:
  virtual ~Work() = default;
  virtual absl::Status Wait() = 0;
  // Non-blocking: true once Wait() would return at once.
  virtual bool IsCompleted() = 0;
  // Orders the calling thread's later device work after the collective without blocking the
  // host where the transport can: on NCCL the thread's compute stream waits for the
  // collective's event (kernels queued afterwards see the outputs; failures show in a later
  // Wait()). CPU transports have no stream: this is Wait().
  virtual absl::Status WaitStream() { return Wait(); }
};

// One send or receive of a batch (Communicator::BatchSendRecvAsync).
struct PeerOp {
  enum class Kind : uint8_t { kSend, kRecv };
  static PeerOp Send(Tensor tensor, int peer) { return PeerOp{Kind::kSend, std::move(tensor), peer}; }
  static PeerOp Recv(Tensor tensor, int peer) { return PeerOp{Kind::kRecv, std::move(tensor), peer}; }
  Kind kind = Kind::kSend;
  Tensor tensor;
  int peer = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The device whose tensors this communicator moves (CPU for threads and ucx).
  virtual Device device() const = 0;
  // Name of the transport: "threads", "ucx" or "nccl".
  virtual const char* backend() const = 0;

  // Timeout of every blocking call (default 300 s, or DTENSOR_TIMEOUT_S from the environment).
  virtual void SetTimeout(absl::Duration timeout) = 0;
  virtual absl::Duration timeout() const = 0;

  // Marks this communicator's family unusable (see the top of this file) and tells every peer,
  // which then fails with Aborted naming this rank and `why` (one that aborted already keeps
  // its first reason). Not a collective: any one rank calls it, any number of times, from the
  // thread that owns the communicator. nccl: ncclCommAbort on this communicator (its peers
  // learn nothing from NCCL itself: see nccl_communicator.h). The default (test doubles) does
  // nothing.
  virtual void Abort(const absl::Status& why) { (void)why; }

  // ---- Asynchronous collectives (the synchronous forms below wait on these) ----
  virtual absl::StatusOr<std::unique_ptr<Work>> AllReduceAsync(const Tensor& input, const Tensor& output,
                                                               CommReduceOp op) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> AllGatherAsync(const Tensor& input, const Tensor& output) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> ReduceScatterAsync(const Tensor& input, const Tensor& output,
                                                                   CommReduceOp op) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> AllToAllAsync(const Tensor& input, const Tensor& output) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> BroadcastAsync(const Tensor& tensor, int root) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> SendAsync(const Tensor& tensor, int peer) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> RecvAsync(const Tensor& tensor, int peer) = 0;
  // Uneven variants. counts[r] is rank r's element count (torch.chunk shards may be empty).
  //   AllGatherV:     input [counts[rank]] -> output [sum(counts)], rank r's block at prefix(r)
  //   ReduceScatterV: input [sum(counts)]  -> output [counts[rank]]
  //   AllToAllV:      input [sum(send_counts)] -> output [sum(recv_counts)]; send_counts[j]
  //                   elements go to rank j, recv_counts[j] come from rank j.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllGatherVAsync(const Tensor& input, const Tensor& output,
                                                                absl::Span<const int64_t> counts) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> ReduceScatterVAsync(const Tensor& input, const Tensor& output,
                                                                    absl::Span<const int64_t> counts,
                                                                    CommReduceOp op) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> AllToAllVAsync(const Tensor& input, const Tensor& output,
                                                               absl::Span<const int64_t> send_counts,
                                                               absl::Span<const int64_t> recv_counts) = 0;
  virtual absl::Status Barrier() = 0;

  // Sends and receives posted together and completing together, as
  // torch.distributed.batch_isend_irecv: the ops of a batch never wait for one another, so an
  // exchange (each rank of a pair sending first, or a ring shift) cannot deadlock. On NCCL the
  // batch is one group; there a lone Send before a Recv on both ranks of a pair would wait for
  // the peer's Recv until the timeout. Messages between two ranks match in the order posted
  // (within and across batches), as for Send / Recv. A peer may be this rank: the k-th send to
  // itself lands in the k-th receive from itself (a copy), and the counts of both must agree.
  // Every op's arguments are checked before any is posted; an empty batch is a completed Work.
  // Should posting fail part-way (a peer left, the group failed), the ops already posted are
  // dropped as an unfinished Send / Recv Work is (see the transport).
  virtual absl::StatusOr<std::unique_ptr<Work>> BatchSendRecvAsync(absl::Span<const PeerOp> ops);

  // All-to-all of blocks given as views of any strides (the column blocks of a row-major
  // matrix, say): sends[j] goes to rank j and lands in recvs[j], element for element in
  // row-major order, so sends[j].numel() on rank i must equal recvs[i].numel() on rank j.
  // One dtype for every block; blocks may be empty. Transports that read a peer's memory
  // directly (threads) move each block once, from view to view, and ucx ranks of one host copy
  // the views straight into and out of their shared-memory slots; the default (nccl, ucx
  // between hosts) packs blocks that are not already back to back into contiguous buffers
  // around AllToAllV (and unpacks).
  // `uniform`: every block of every rank has the same element count, which all ranks pass
  // alike (then the default uses the even AllToAll, which some transports do faster).
  virtual absl::Status AllToAllBlocks(absl::Span<const Tensor> sends, absl::Span<const Tensor> recvs,
                                      bool uniform = false);

  // Sub-communicators: ranks calling with the same color form a group ordered by (key, rank);
  // a negative color joins no group and gets nullptr. Collective over this communicator.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) = 0;

  // ---- Synchronous forms ----
  // The *Async call and its Wait(); a transport whose *Async forms hand the work to a thread
  // (ucx) runs the collectives here on the calling thread instead.
  virtual absl::Status AllReduce(const Tensor& input, const Tensor& output, CommReduceOp op);
  virtual absl::Status AllGather(const Tensor& input, const Tensor& output);
  virtual absl::Status ReduceScatter(const Tensor& input, const Tensor& output, CommReduceOp op);
  virtual absl::Status AllToAll(const Tensor& input, const Tensor& output);
  virtual absl::Status Broadcast(const Tensor& tensor, int root);
  absl::Status Send(const Tensor& tensor, int peer);
  absl::Status Recv(const Tensor& tensor, int peer);
  absl::Status BatchSendRecv(absl::Span<const PeerOp> ops);
  virtual absl::Status AllGatherV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts);
  virtual absl::Status ReduceScatterV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts,
                                      CommReduceOp op);
  virtual absl::Status AllToAllV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> send_counts,
                                 absl::Span<const int64_t> recv_counts);
};

// DTENSOR_TIMEOUT_S from the environment: unset, 300 s; set, seconds (a decimal number of at
// least 0.001, or "inf": no limit). Anything else (e.g. "10s", "abc", "0", "1e-300") is
// InvalidArgument naming the value.
absl::StatusOr<absl::Duration> TimeoutFromEnv();
// The timeout a new communicator starts with: TimeoutFromEnv(), or 300 s where that is an
// error (MakeUcxCommunicatorFromEnv returns that error instead, as gpt_train reports it).
absl::Duration DefaultTimeout();

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_COMMUNICATOR_H_
