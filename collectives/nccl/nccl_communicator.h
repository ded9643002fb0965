// The "nccl" backend: one rank per process (or per thread), one CUDA device per rank, moving
// CUDA tensors with NCCL.
//
//   DT_ASSIGN_OR_RETURN(LaunchInfo info, LaunchInfoFromEnv());
//   DT_ASSIGN_OR_RETURN(auto store, ConnectStore(info, absl::Seconds(60)));
//   DT_ASSIGN_OR_RETURN(auto comm, MakeNcclCommunicator(info, *store, info.local_rank));
//   DT_RETURN_IF_ERROR(comm->AllReduce(grad, grad, CommReduceOp::kAvg));   // grad on cuda:local_rank
//
// One GPU per rank: NCCL refuses two ranks of one host on one GPU. (Tests and checks can still
// run several ranks on one GPU as processes that each claim a host of their own through
// NCCL_HOSTID, then meet over NCCL's sockets: tests/testing/nccl_process_gpu.h.)
//
// Every collective is one NCCL call (AllToAll / the *V variants / Send / Recv: ncclSend and
// ncclRecv inside ncclGroupStart/End) with counts in elements. Dtypes: float32, bfloat16,
// float16, int32, int64 for everything; bool, float8_e4m3 and float8_e5m2 move as bytes and
// bool reduces as or (sum, max) / and (min, product) like the threads backend (avg on bool is
// InvalidArgument, reducing float8 is Unimplemented). kAvg is ncclAvg, as in PyTorch
// (integers: the sum divided by the group size, truncated toward zero, summed in the dtype;
// bfloat16 / float16: NCCL scales each input by 1/size rounded to the dtype, so a group of 3,
// 6 or 7 ranks averages about 0.2% off; the threads and ucx backends sum in float32 and
// divide once).
// Point to point: each SendAsync / RecvAsync is its own NCCL call on the communication
// stream, in posting order. Unlike the threads and ucx backends, two ranks that both send
// before they receive wait for each other (NCCL needs the matching receive to be in the same
// group; always on a first exchange between two ranks, and past NCCL's buffer for large
// messages) until the timeout: exchange with BatchSendRecv (one NCCL group for all of a
// batch's sends and receives, as torch.distributed.batch_isend_irecv), or AllToAllV.
//
// Streams and lifetimes. Collectives run on a stream owned by the communicator, ordered
// after the calling thread's compute stream (cudaStreamPerThread of the communicator's
// device, where dtensor's CUDA kernels run): each *Async call records an event there and
// makes the communication stream wait for it, so the collective sees every kernel queued
// before it, while the compute stream runs on without waiting. The returned Work holds an
// event recorded after the collective and references to its tensors, so the inputs and
// outputs stay allocated until it completes even if the caller drops them.
//   IsCompleted() = cudaEventQuery (non-blocking).
//   Wait()        = HOST wait: polls the event and ncclCommGetAsyncError until the collective
//                   is done, fails, or the timeout passes; after an OK Wait() the outputs are
//                   final for every stream and for the host. (Because Wait() blocks the host,
//                   the host cannot queue kernels past it; overlap comes from issuing the
//                   *Async call early and waiting late.)
// Destroying a Work that was not waited for makes the issuing thread's compute stream wait
// for its event (no host block), so memory its tensors free is only reused after it; on
// another thread (whose compute stream is another) it waits on the host for the event, up to
// the timeout, and past that leaks the tensors rather than free memory NCCL may still write.
//
// Failures. The NCCL communicator is non-blocking (ncclConfig_t::blocking = 0): init,
// split and every enqueue are polled with the communicator's timeout, so a dead or missing
// peer cannot hang the host. Past the timeout the communicator is aborted (ncclCommAbort) and
// the call returns DeadlineExceeded naming the operation, this rank and the peer (or "all
// ranks" for collectives: NCCL cannot tell which one is missing); an asynchronous NCCL error
// (a peer's connection broke) gives Unavailable. Either way the communicator is then dead:
// every later call fails at once with FailedPrecondition quoting the first error.
// Validation errors ("[Op] rank r: ...": undefined, non-contiguous, wrong device, dtype or
// size mismatch, bad counts or peers) are local and leave the communicator usable (the other
// ranks of that collective will then time out).
// Abort(why) calls ncclCommAbort on this communicator only (not its splits; untested: no GPU
// in CI) and fails its later calls quoting why. NCCL tells the peers nothing: a peer already
// blocked in a collective with this rank still waits until its own timeout (NCCL has no abort
// message; a store-based notice would be the next step).
// Debug mode: with DTENSOR_DEBUG=1 in the environment when a communicator is made, every
// collective first all-gathers a description of each rank's call (op, dtype, element count,
// reduction or root) and a mismatch returns InvalidArgument on every rank naming both calls,
// e.g. "[Debug] rank 0 called AllReduce(float32, 12 elements, sum) but rank 1 called
// AllGather(float32, 3 elements)". It costs a small all-gather and a host sync per call.
//
// A communicator (and its Works) belongs to one thread at a time; it is not thread safe.
// Split(color, key) is ncclCommSplit; its children are nccl communicators on the same device
// with the parent's timeout. Builds without CUDA/NCCL have a stub whose factory returns
// FailedPrecondition.
#ifndef DTENSOR_COLLECTIVES_NCCL_NCCL_COMMUNICATOR_H_
#define DTENSOR_COLLECTIVES_NCCL_NCCL_COMMUNICATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/collectives/store/rendezvous.h"
#include "dtensor/collectives/store/tcp_store.h"

namespace dtensor {

// True when this build has the NCCL backend (CUDA Toolkit and NCCL found); the factory of a
// build without it always returns FailedPrecondition.
bool NcclBuilt();

// Joins the NCCL group of info.world_size ranks as rank info.rank on CUDA device
// `device_index` (usually info.local_rank). Collective: every rank of the run calls it, in the
// same order as its other calls of MakeNcclCommunicator on the same store. Rank 0 creates the
// ncclUniqueId and publishes it through `store` (key "dtensor/nccl/<n>/id" for the n-th
// communicator of the run); the others read it from there. `timeout` bounds the rendezvous and
// the NCCL init and becomes the communicator's timeout.
// Errors: FailedPrecondition without CUDA/NCCL or when device_index is not a visible device;
// InvalidArgument for a bad rank / world size; DeadlineExceeded when the peers do not join in
// time; other NCCL failures as their codes map (see nccl_communicator.cc).
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const LaunchInfo& info, StoreClient& store,
                                                                   int device_index,
                                                                   absl::Duration timeout = DefaultTimeout());

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_NCCL_NCCL_COMMUNICATOR_H_
