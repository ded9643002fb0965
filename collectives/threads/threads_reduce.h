// The threads backend's reduction kernel (internal to collectives/threads/; not installed): the
// elementwise reduce of AllReduce and ReduceScatter(V), over the ranks' buffers in rank order.
//
//   // Rank r of `size` reduces block r of every rank's input into its output:
//   std::vector<const char*> srcs = ...;  // one input per rank, rank order
//   const int64_t begin = numel / size * r, count = numel / size;
//   ReduceInRankOrder(DType::kFloat32, CommReduceOp::kSum, srcs, begin, count, out);
//
// Rank order makes the result the same bits on every rank that reduces the same elements.
// Arithmetic: float32 for bfloat16 / float16 (rounded once at the store); integers wrap (sums
// and products in uint64, then truncated), kAvg on integers truncates toward zero; bool is or
// (sum, max) and and (min, product); max / min propagate NaN like torch.maximum.
#ifndef DTENSOR_COLLECTIVES_THREADS_THREADS_REDUCE_H_
#define DTENSOR_COLLECTIVES_THREADS_THREADS_REDUCE_H_

#include <cstdint>

#include "absl/types/span.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/tensor/dtype.h"

namespace dtensor::internal {

// Reduces elements [begin, begin + n) of every source into dst[0, n) (counts in elements of
// `dtype`; srcs[j] points at element 0 of source j). kAvg divides by srcs.size(). dst may be
// one of the sources offset by begin (in place): every element is loaded from every source
// before it is stored. n <= 0 writes nothing. Precondition: the dtype and op passed
// CheckReducible (collectives/checks.h), which refuses float8 and avg on bool.
void ReduceInRankOrder(DType dtype, CommReduceOp op, absl::Span<const char* const> srcs, int64_t begin, int64_t n,
                       char* dst);

}  // namespace dtensor::internal

#endif  // DTENSOR_COLLECTIVES_THREADS_THREADS_REDUCE_H_
