// The "threads" backend: a group of ranks that are threads of one process, moving CPU tensors
// through shared memory.
//
//   DT_ASSIGN_OR_RETURN(auto comms, MakeThreadGroup(4, absl::Seconds(30)));
//   std::vector<std::thread> threads;
//   for (int r = 0; r < 4; ++r) {
//     threads.emplace_back([&, r] { Status s = comms[r]->AllReduce(grad[r], grad[r], CommReduceOp::kSum); });
//   }
//   for (auto& t : threads) t.join();
//
// Communicator r belongs to the one thread that runs rank r (it is not thread safe); the
// group's shared state is owned jointly by its communicators (no global state). Destroying a
// communicator marks its rank gone: peers waiting for it get Unavailable naming it.
//
// Algorithms: every rank publishes pointers to its buffers, then reads its share straight
// from its peers' buffers (AllReduce: rank r reduces block r of all inputs and copies each
// reduced chunk into every output while it is in cache; ReduceScatter: rank r reduces block
// r; AllGather / AllToAll / Broadcast: each rank copies what it needs), between two barriers;
// a rank copies its own block (AllGather, AllToAll) while it waits at the first.
// AllReduce writes its results with streaming stores once the group's inputs reach 16 MiB
// (DTENSOR_THREADS_STREAMING=0 / 1 forces them off / on).
// Small calls take one barrier instead: each rank (Broadcast: the root) copies its input into
// a mailbox of the group and every rank reads its share from the mailboxes (reductions: reduces it; AllReduce: all of
// it, each rank alike). Small means up to these many input bytes where ranks share CPUs / where
// each has a CPU of its own: AllReduce 4 KiB / 512 B, ReduceScatter(V) 16 / 2 KiB, AllGather(V)
// 4 / 1 KiB (V: its largest block), AllToAll 4 / 2 KiB, Broadcast 16 / 4 KiB. A small
// Broadcast does not even meet the group: its root copies the tensor into one of 32 slots of
// the group and returns, as NCCL's and ucx's roots return once the message is out, and each
// receiver waits for the root alone; a root runs at most 32 small Broadcasts ahead of its
// slowest receiver (unless DTENSOR_DEBUG=1, where every rank meets the others). A rank
// waiting at a barrier spins (when every rank has a CPU: more CPUs than MakeThreadGroup's
// ranks, and no peer last seen on its own CPU), then yields, then sleeps on a futex. Reductions run in float32 for
// bfloat16 / float16 (rounded once), exactly (wrapping) for int32 / int64, with kAvg on integers dividing the sum by
// the group size with truncation toward zero; bool uses or (sum, max) and and (min, product), avg on bool is
// InvalidArgument; float8 tensors can be moved but not reduced (Unimplemented). Max / min propagate NaN like torch.
// In-place calls (input == output, or AllGather input == its own output block, ReduceScatter output == its own input
// block) work; other overlaps of input and output are staged through a private copy.
//
// Calls are checked across ranks on every collective (shared memory makes it free, so it is
// always on, DTENSOR_DEBUG or not): mismatched ops, dtypes, counts, reductions or roots give
// InvalidArgument on every rank, e.g. "[Debug] rank 0 called AllReduce(float32, 12 elements,
// sum) but rank 2 called AllGather(float32, 3 elements)". Where a small Broadcast is involved
// (its root returned already) or a rank is out of step (it skipped or added a call), the rank
// that finds it fails the group with that InvalidArgument: the others fail in their current or
// next call, and the group stays failed. With DTENSOR_DEBUG=1 a mismatched small Broadcast
// fails on every rank in the call itself, as the other collectives do.
//
// Async forms: collectives run eagerly inside the *Async call and return a completed Work
// (no overlap with compute on this backend). SendAsync / RecvAsync post the message and
// return at once; the copy happens when the matching Recv / Send is posted (by whichever
// side comes second), and Wait() waits for it. A blocking Send waits until it is received,
// so two ranks that both Send before they Recv deadlock (until the timeout): use SendAsync
// or BatchSendRecv.
// Messages between one pair of ranks match in posting order. Dropping an unfinished Send /
// Recv Work takes it back if no peer has matched it yet (else it completes).
//
// Failures: a wait past the timeout gives DeadlineExceeded naming the missing ranks; it
// marks the group failed, and every later call on the group (and every rank still waiting in
// it, even one whose peers have all arrived) fails at once with the same code; so a rank that
// was descheduled past the timeout may report a failure for a call its peers completed. After such a failure, buffers
// passed to the failed call may still be read by slower peers until they notice: treat the group as dead. (They are
// never written after the call returns: in AllReduce and a large Broadcast, where ranks write into their peers'
// outputs, a failing rank first waits for the peers that passed the first barrier to finish their writes.) Validation
// errors (InvalidArgument / Unimplemented, messages "[Op] rank r: ...") are local and leave the group usable; the other
// ranks of that collective will then time out, unless it calls Abort(why): that fails every
// group of the family (MakeThreadGroup's and all splits made from it) at once, waking every
// waiter, which returns Aborted with "rank r aborted the communicator: <why>" ("rank r (world rank w)" when the
// aborting group is a split).
#ifndef DTENSOR_COLLECTIVES_THREADS_THREADS_COMMUNICATOR_H_
#define DTENSOR_COLLECTIVES_THREADS_THREADS_COMMUNICATOR_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dtensor/collectives/communicator.h"

namespace dtensor {

// world_size communicators of one group; element r has rank r. 1 <= world_size < 2^24 - 1
// (else InvalidArgument). DTENSOR_DEBUG=1 in the environment is recorded: the checks are always
// on here, and with it small Broadcasts meet the group too (see above).
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeThreadGroup(int world_size,
                                                                           absl::Duration timeout = DefaultTimeout());

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_THREADS_THREADS_COMMUNICATOR_H_
