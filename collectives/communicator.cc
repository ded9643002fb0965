#include "dtensor/collectives/communicator.h"

#include <cmath>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/collectives/checks.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

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

absl::StatusOr<absl::Duration> TimeoutFromEnv() {
  const char* env = std::getenv("DTENSOR_TIMEOUT_S");
  if (env == nullptr) return absl::Seconds(300);
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(s >= 0.001)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DTENSOR_TIMEOUT_S='", env, "' is not a number of seconds >= 0.001 (or inf for no limit)"));
  }
  return std::isinf(s) ? absl::InfiniteDuration() : absl::Seconds(s);
}

absl::Duration DefaultTimeout() { return TimeoutFromEnv().value_or(absl::Seconds(300)); }

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
absl::Status Communicator::BatchSendRecv(absl::Span<const PeerOp> ops) { return WaitOn(BatchSendRecvAsync(ops)); }
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

namespace {

// The first non-empty block when the blocks' bytes already lie back to back, each block
// contiguous, in one storage (then one flat view over them needs no copy); else null.
const Tensor* BackToBack(absl::Span<const Tensor> blocks) {
  const Tensor* first = nullptr;
  const char* next = nullptr;
  for (const Tensor& b : blocks) {
    if (b.numel() == 0) continue;
    if (!b.is_contiguous()) return nullptr;
    if (first != nullptr && (b.storage() != first->storage() || b.raw_data() != next)) return nullptr;
    if (first == nullptr) first = &b;
    next = static_cast<const char*>(b.raw_data()) + b.nbytes();
  }
  return first;
}

// A flat tensor of `total` elements: a view over back-to-back blocks, or a new buffer.
absl::StatusOr<Tensor> FlatOf(absl::Span<const Tensor> blocks, int64_t total, DType dtype, Device device,
                              bool* is_view) {
  const Tensor* first = BackToBack(blocks);
  *is_view = first != nullptr;
  if (first != nullptr) return first->AsStrided({total}, {1}, first->storage_offset());
  return Tensor::Empty({total}, dtype, device);
}

// Packs (or unpacks, when `pack` is false) the blocks into / out of the flat `flat`.
absl::Status CopyBlocks(absl::Span<const Tensor> blocks, const Tensor& flat, bool pack) {
  int64_t at = 0;
  for (const Tensor& b : blocks) {
    if (b.numel() == 0) continue;
    DT_ASSIGN_OR_RETURN(Tensor piece, flat.Narrow(0, at, b.numel()));
    DT_ASSIGN_OR_RETURN(piece, piece.View(b.shape()));
    DT_RETURN_IF_ERROR(pack ? CopyBlock(piece, b) : CopyBlock(b, piece));
    at += b.numel();
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Communicator::AllToAllBlocks(absl::Span<const Tensor> sends, absl::Span<const Tensor> recvs,
                                          bool uniform) {
  constexpr const char* kOp = "AllToAllBlocks";
  DT_ASSIGN_OR_RETURN(const DType dtype, internal::CheckBlocks(kOp, rank(), sends, recvs, size()));
  std::vector<int64_t> send_counts, recv_counts;
  for (const Tensor& b : sends) send_counts.push_back(b.numel());
  for (const Tensor& b : recvs) recv_counts.push_back(b.numel());
  const int64_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
  const int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  if (uniform) DT_RETURN_IF_ERROR(internal::CheckUniformBlocks(kOp, rank(), sends, recvs));  // before any copying
  bool send_view = false, recv_view = false;
  DT_ASSIGN_OR_RETURN(Tensor send, FlatOf(sends, send_total, dtype, device(), &send_view));
  if (!send_view) DT_RETURN_IF_ERROR(CopyBlocks(sends, send, /*pack=*/true));
  DT_ASSIGN_OR_RETURN(Tensor recv, FlatOf(recvs, recv_total, dtype, device(), &recv_view));
  if (uniform) {
    DT_RETURN_IF_ERROR(AllToAll(send, recv));
  } else {
    DT_RETURN_IF_ERROR(AllToAllV(send, recv, send_counts, recv_counts));
  }
  return recv_view ? absl::OkStatus() : CopyBlocks(recvs, recv, /*pack=*/false);
}

// Transports whose sends and receives are posted without waiting (threads, ucx): every receive,
// then every send, each through the transport's own P2P; sends to this rank are copies.
absl::StatusOr<std::unique_ptr<Work>> Communicator::BatchSendRecvAsync(absl::Span<const PeerOp> ops) {
  constexpr const char* kOp = "BatchSendRecv";
  DT_ASSIGN_OR_RETURN(const auto self_pairs, internal::CheckPeerOps(kOp, rank(), size(), device(), ops));
  std::vector<std::unique_ptr<Work>> works;
  for (const PeerOp::Kind kind : {PeerOp::Kind::kRecv, PeerOp::Kind::kSend}) {
    for (const PeerOp& o : ops) {
      if (o.kind != kind || o.peer == rank()) continue;
      DT_ASSIGN_OR_RETURN(std::unique_ptr<Work> w,
                          kind == PeerOp::Kind::kSend ? SendAsync(o.tensor, o.peer) : RecvAsync(o.tensor, o.peer));
      works.push_back(std::move(w));
    }
  }
  for (const auto& [send, recv] : self_pairs) {
    const int64_t n = ops[send].tensor.numel();
    if (n == 0) continue;
    DT_ASSIGN_OR_RETURN(Tensor dst, ops[recv].tensor.View({n}));
    DT_ASSIGN_OR_RETURN(Tensor src, ops[send].tensor.View({n}));
    DT_RETURN_IF_ERROR(CopyBlock(dst, src));
  }
  return internal::MakeWorkOfAll(std::move(works));
}

}  // namespace dtensor
