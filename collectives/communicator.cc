#include "collectives/communicator.h"

#include <cstdlib>
#include <string>

namespace dtensor {

const char* CommReduceOpName(CommReduceOp op) {
  switch (op) {
    case CommReduceOp::kSum:
      return "sum";
    case CommReduceOp::kAvg:
      return "avg";
    case CommReduceOp::kMax:
      return "max";
    case CommReduceOp::kMin:
      return "min";
    case CommReduceOp::kProduct:
      return "product";
  }
  return "unknown";
}

absl::Duration DefaultTimeout() {
  if (const char* env = std::getenv("DTENSOR_TIMEOUT_S")) {
    char* end = nullptr;
    const double s = std::strtod(env, &end);
    if (end != env && *end == '\0' && s > 0) return absl::Seconds(s);
  }
  return absl::Seconds(300);
}

namespace {
absl::Status WaitOn(absl::StatusOr<std::unique_ptr<Work>> work) {
  if (!work.ok()) return work.status();
  return (*work)->Wait();
}
}  // namespace

absl::Status Communicator::AllReduce(const Tensor& input, const Tensor& output, CommReduceOp op) {
  return WaitOn(AllReduceAsync(input, output, op));
}
absl::Status Communicator::AllGather(const Tensor& input, const Tensor& output) {
  return WaitOn(AllGatherAsync(input, output));
}
absl::Status Communicator::ReduceScatter(const Tensor& input, const Tensor& output, CommReduceOp op) {
  return WaitOn(ReduceScatterAsync(input, output, op));
}
absl::Status Communicator::AllToAll(const Tensor& input, const Tensor& output) {
  return WaitOn(AllToAllAsync(input, output));
}
absl::Status Communicator::Broadcast(const Tensor& tensor, int root) { return WaitOn(BroadcastAsync(tensor, root)); }
absl::Status Communicator::Send(const Tensor& tensor, int peer) { return WaitOn(SendAsync(tensor, peer)); }
absl::Status Communicator::Recv(const Tensor& tensor, int peer) { return WaitOn(RecvAsync(tensor, peer)); }
absl::Status Communicator::AllGatherV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts) {
  return WaitOn(AllGatherVAsync(input, output, counts));
}
absl::Status Communicator::ReduceScatterV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> counts,
                                          CommReduceOp op) {
  return WaitOn(ReduceScatterVAsync(input, output, counts, op));
}
absl::Status Communicator::AllToAllV(const Tensor& input, const Tensor& output, absl::Span<const int64_t> send_counts,
                                     absl::Span<const int64_t> recv_counts) {
  return WaitOn(AllToAllVAsync(input, output, send_counts, recv_counts));
}

}  // namespace dtensor
