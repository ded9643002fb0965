// The "ucx" backend: ranks that are processes (one host or many), moving CPU tensors over UCX
// (shared memory / CMA between processes of one host, TCP or RDMA between hosts).
//
//   DT_ASSIGN_OR_RETURN(LaunchInfo info, LaunchInfoFromEnv());          // under dtrun / torchrun
//   DT_ASSIGN_OR_RETURN(auto store, ConnectStore(info, absl::Seconds(60)));
//   DT_ASSIGN_OR_RETURN(auto comm, MakeUcxCommunicator(info, *store));
//   DT_RETURN_IF_ERROR(comm->AllReduce(grad, grad, CommReduceOp::kAvg));
// or simply `DT_ASSIGN_OR_RETURN(auto comm, MakeUcxCommunicatorFromEnv());`.
//
// Setup: every rank creates one UCP context and worker, publishes the worker's address (and
// its host name and pid) in the store under "ucx/<n>/..." (n counts the communicators this
// rank made, so ranks must create them in the same order) and opens an endpoint to every peer.
// Peers on this host are watched through a pidfd and get endpoints without UCX error handling
// (UCX 1.13 allows only TCP with it), so they talk over shared memory / CMA; peers on other
// hosts get UCX peer-failure handling. The store is used only while MakeUcxCommunicator runs
// (which ends with a Barrier over UCX that also wires up every endpoint, then the shared-memory
// setup below).
//
// Messages are UCP tag messages; a tag is [communicator id:16][sender rank:16][call
// sequence:16][step:16], receives are posted before sends, and progress is driven by the
// waiting call itself (no helper thread): it spins on ucp_worker_progress for a few
// microseconds, then yields, then sleeps on the worker's event fd until the deadline.
//
// Shared memory: a communicator whose ranks all live on this host (the usual case under one
// dtrun) also maps one POSIX shared-memory segment (made by its rank 0 when it is created,
// unlinked once every rank has it; see ucx_shm.h) and runs AllReduce, ReduceScatter(V),
// AllGather(V), AllToAll, AllToAllBlocks, Broadcast and Barrier through it: each rank
// copies its part into its own slot, the ranks meet at a flag barrier, and each reads /
// reduces straight from the others' slots, in slot-sized (512 KiB) steps that stay in cache.
// Small AllReduces are one copy, one barrier and a reduction of all slots in rank order (about
// 1 us on 2 ranks); large ones are a ReduceScatter into the rank's block of the output and an
// AllGather from there when every rank has a CPU, and otherwise (ranks sharing CPUs) one
// barrier per step: each rank reduces 1/P of the step into a shared result that every rank
// copies out. AllToAllBlocks copies each window straight from the send views into the slot and
// out of the peers' slots into the receive views (strided views are never packed); without
// `uniform` the ranks first all-gather their block counts, so a sender / receiver mismatch is
// InvalidArgument on every rank (on every path, between hosts too).
// Single copy: from 16 KiB blocks (128 KiB when ranks share CPUs) the ranks skip the slots'
// copy in + copy out and move bytes between their own buffers with Linux cross-memory attach
// (process_vm_readv / writev; probed once at setup, every rank agreeing): each publishes its
// buffer's address in its slot, and after one barrier AllGather / AllToAll read each peer's
// block straight into the output; Broadcast (past 32 KiB, or 256 KiB when ranks share CPUs;
// below, the root copies into its ring places and goes on, readers copy out) has the root
// write 1/P of the buffer into each reader while the readers read the rest (so the root's core
// works too); ReduceScatter and AllReduce
// up to 2 MiB blocks read the peers' pieces of this rank's block into cache, reduce, and (for
// AllReduce) write the result into every peer's output; a second barrier keeps each rank's
// buffers unchanged until every peer is done with them. Past 2 MiB blocks AllReduce runs the
// slots' reduce-scatter steps and writes each reduced window into the peers' outputs from
// cache (the kernel's copy is slower than memcpy here, so large reductions keep the slots).
// AllToAllBlocks always uses the slots (the kernel's per-range cost loses on strided rows).
// DTENSOR_UCX_CMA=0 turns single copy off, DTENSOR_UCX_CMA_MIN=<bytes> moves the threshold.
// Zero copy: once a communicator with single copy is made (and no rank sets
// DTENSOR_UCX_ZERO_COPY=0), CPU tensors of 16 KiB or more are allocated in shared blocks
// (dtensor/tensor/shared_cpu_block.h); a buffer in one is published with its block, and the
// peers map the block (once, cached) and copy with memcpy instead of process_vm_readv /
// writev, each rank per peer buffer (a private buffer, e.g. a tensor made before the
// communicator, still moves through the kernel). Single copy then starts at 8 KiB blocks for
// buffers of 16 KiB or more, also when ranks share CPUs (and for AllReduces small enough that
// every rank would otherwise reduce everything), and AllReduce past 2 MiB blocks stays single
// copy when every rank's input and output are shared (one extra barrier per call agrees on
// it; else the slots as above), ReduceScatter likewise for inputs. A single-copy read or
// write past a peer's buffer (ranks whose calls disagree on sizes) is InvalidArgument.
// Reductions take the slots in rank order, in float32 for bfloat16 / float16 (rounded once),
// so every rank gets the same bits. Waits spin briefly (when every rank has a CPU), then
// yield, then nap, and check the deadline and the peers' pidfds and failed flags: the failure
// behaviour below holds alike. AllToAllV and Send / Recv always use UCX. DTENSOR_UCX_SHM=0
// turns the channel off (everything over UCX, as between hosts).
// Every setting that picks an algorithm is agreed when the communicator is made, so ranks with
// different environments or CPU affinities still take the same paths: the channel only if no
// rank refuses it, single copy only if every rank wants it and can, zero copy only if every
// rank wants it, the largest DTENSOR_UCX_CMA_MIN any rank sets, "ranks share CPUs" unless the ranks' CPU affinity masks
// give each rank a CPU of its own (RanksHaveOwnCpus in collectives/store/cpus.h: two ranks
// bound to a core each by dtrun have their own; two ranks bound to one CPU, or three unbound
// on two CPUs, share), and the debug checks below if any rank sets DTENSOR_DEBUG.
//
// Algorithms over UCX (P ranks, m bytes): below 64 KiB, AllReduce / ReduceScatter / AllGather send
// every rank's data straight to the ranks that need it (one hop; reductions in rank order, in
// float32 for bfloat16 / float16, rounded once). Above, AllReduce is a ring reduce-scatter
// followed by a ring all-gather, AllGather and ReduceScatter are rings, all pipelined in chunks
// of 64 KiB..1 MiB so that reductions overlap transfers. On the ring path partial sums travel
// in the tensor's dtype, so bfloat16 / float16 are rounded once per hop (as NCCL does).
// AllToAll(V) posts every receive and then sends to rank + 1, rank + 2, ...; Broadcast sends
// straight from the root below 64 KiB and down a chunked chain above; Barrier is an exchange
// of empty messages. Integers reduce exactly (sums / products wrap, avg truncates toward
// zero); bool uses or (sum, max) and and (min, product), avg on bool is InvalidArgument;
// float8 can be moved but not reduced (Unimplemented). Max / min propagate NaN like torch.
// In-place calls (input == output, AllGather input == its own output block, ReduceScatter
// output == its own input block) work; other overlaps of input and output are staged
// through a private copy. Scratch buffers belong to the communicator and are reused.
//
// Async forms: the collective is checked on the calling thread (bad arguments come back from
// the *Async call) and then runs on a comm thread of the process (collectives/comm_thread.h,
// one per world, started by the first *Async call), in issue order, while the caller goes on:
// FSDP's prefetched all_gathers and reduce_scatters progress during compute. The blocking
// forms and every other call (Barrier, Split, AllToAllBlocks, Send / Recv and their Works)
// run on the calling thread once the comm thread is idle, so the calls of one process keep
// their order and the worker is used by one thread at a time. (Ranks bound to one CPU each
// share it with their comm thread: waits spin briefly, then yield, as described below.)
// SendAsync / RecvAsync post the message and return; Wait() progresses it (so two ranks may
// both SendAsync before they Recv). Messages between one pair of ranks match in posting order.
// Dropping an unfinished Send / Recv Work is for error paths: its receive is cancelled (it
// still used up its place in the pair's message order), its send finishes in the background;
// either way the tensor's storage is kept alive until UCX is done with it.
//
// Failures: every wait honours timeout() and gives DeadlineExceeded, e.g. "[AllReduce] rank 1
// timed out after 2s waiting for rank 0". A peer process that exits is noticed at once on one
// host (its pidfd becomes readable), otherwise when UCX reports its endpoint broken; the
// calls waiting for it get Unavailable, e.g. "[AllGather] rank 0: peer rank 2 is gone
// (process 1234 exited)". After a transport error or a timeout every communicator sharing the
// worker (the world and its splits) is failed: later calls return the same error at once.
// Validation errors (InvalidArgument, Unimplemented for CUDA tensors) are local and leave it
// usable. Sends abandoned after a failure are released at teardown (UCX may log "was not
// returned to mpool" warnings then).
//
// Debug mode (DTENSOR_DEBUG=1 on any rank when the communicator is made): before each collective the ranks
// exchange what they were called with (op, dtype, element count, reduction, root, a hash of
// the V counts) and on a mismatch every rank returns InvalidArgument naming both calls, e.g.
// "[Debug] rank 0 called AllReduce(float32, 12 elements, sum) but rank 1 called
// AllGather(float32, 3 elements)". Nothing has moved then, so the communicator stays usable.
// (AllToAllV compares op and dtype only: its counts differ by rank.)
//
// Split() reuses the parent's worker and endpoints with a new communicator id (agreed through
// an all-gather over the parent, unique among the communicators of each process); children
// keep the worker alive. A communicator and all communicators split from it must be used by
// one thread at a time (besides the comm thread, which they drain). Ids are 15 bits: a process may make
// up to 32767 communicators per world.
#ifndef DTENSOR_COLLECTIVES_UCX_UCX_COMMUNICATOR_H_
#define DTENSOR_COLLECTIVES_UCX_UCX_COMMUNICATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/collectives/store/rendezvous.h"
#include "dtensor/collectives/store/tcp_store.h"

namespace dtensor {

// The world communicator of a run: info.rank of info.world_size, rendezvous through `store`
// (every rank calls this collectively). `timeout` bounds the rendezvous and becomes the
// communicator's timeout. Errors: Unavailable / DeadlineExceeded from UCX or the store,
// InvalidArgument for an inconsistent info.
absl::StatusOr<std::unique_ptr<Communicator>> MakeUcxCommunicator(const LaunchInfo& info, StoreClient& store,
                                                                  absl::Duration timeout = DefaultTimeout());

// LaunchInfoFromEnv() + ConnectStore() + MakeUcxCommunicator(). The store connection stays
// alive inside the communicator (rank 0's holds the server, so rank 0 should be destroyed
// last, e.g. after a final Barrier()).
absl::StatusOr<std::unique_ptr<Communicator>> MakeUcxCommunicatorFromEnv(absl::Duration timeout = DefaultTimeout());

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_UCX_UCX_COMMUNICATOR_H_
