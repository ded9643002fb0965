// Argument checks and small helpers shared by the transports (internal to collectives/; not
// installed).
//
//   DT_RETURN_IF_ERROR(CheckContiguous(op, rank, "input", input));
//   DT_RETURN_IF_ERROR(CheckNumel(op, rank, "output", output, size * input.numel(), "size x input"));
//   DT_ASSIGN_OR_RETURN(int64_t total, CheckCounts(op, rank, "counts", counts, size));
//
// Every message reads "[Op] rank R: ..." and names the offending values, so that a user can
// tell which rank passed what. Device checks stay with each transport (they differ: the
// threads backend rejects CUDA tensors as Unimplemented, nccl wants its own device).
#ifndef DTENSOR_COLLECTIVES_CHECKS_H_
#define DTENSOR_COLLECTIVES_CHECKS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor::internal {

// InvalidArgument unless `t` is defined and contiguous.
absl::Status CheckContiguous(const char* op, int rank, const char* name, const Tensor& t);
// InvalidArgument unless input and output have one dtype.
absl::Status CheckSameDType(const char* op, int rank, const Tensor& input, const Tensor& output);
// InvalidArgument unless t has `expected` elements; `why` states the count convention.
absl::Status CheckNumel(const char* op, int rank, const char* name, const Tensor& t, int64_t expected,
                        absl::string_view why);
// One non-negative count per rank; returns their sum.
absl::StatusOr<int64_t> CheckCounts(const char* op, int rank, const char* name, absl::Span<const int64_t> counts,
                                    int size);
// AllToAllBlocks' arguments: `size` defined blocks each way, one dtype (returned).
absl::StatusOr<DType> CheckBlocks(const char* op, int rank, absl::Span<const Tensor> sends,
                                  absl::Span<const Tensor> recvs, int size);
// AllToAllBlocks' `uniform` promise, as far as this rank can see it: every block, sent or
// received, has sends[0]'s element count.
absl::Status CheckUniformBlocks(const char* op, int rank, absl::Span<const Tensor> sends,
                                absl::Span<const Tensor> recvs);
// A root or peer index in [0, size).
absl::Status CheckPeer(const char* op, int rank, const char* what, int peer, int size);
// BatchSendRecv's ops: each tensor defined, contiguous and on `device`, each peer in [0, size),
// and this rank's sends to itself paired in order with its receives from itself (as many of
// each, elements and dtype alike). Returns the pairs as (send index, recv index) into ops.
absl::StatusOr<std::vector<std::pair<size_t, size_t>>> CheckPeerOps(const char* op, int rank, int size, Device device,
                                                                    absl::Span<const PeerOp> ops);
// Reductions: float8 is storage-only (Unimplemented); avg is not defined for bool.
absl::Status CheckReducible(const char* op, int rank, DType dtype, CommReduceOp rop);

// A Work over several: Wait() waits for each and returns the first error; IsCompleted() once
// all are.
std::unique_ptr<Work> MakeWorkOfAll(std::vector<std::unique_ptr<Work>> works);
// A Work that is already complete: Wait() returns `status` (transports that run a collective
// eagerly inside its *Async call return one).
std::unique_ptr<Work> MakeCompletedWork(absl::Status status);

// Whether the byte ranges that views a and b span (first to last element, any strides)
// overlap: conservative for interleaved strided views, which may span common bytes without
// sharing an element.
bool Overlap(const Tensor& a, const Tensor& b);
// "rank 3", "ranks 1 and 3", "ranks 1, 3 and 5" (in the order given; "no rank" if empty).
std::string RanksPhrase(absl::Span<const int> ranks);
// Exclusive prefix sums: offsets[j] = counts[0] + ... + counts[j - 1].
std::vector<int64_t> PrefixOffsets(absl::Span<const int64_t> counts);

}  // namespace dtensor::internal

#endif  // DTENSOR_COLLECTIVES_CHECKS_H_
