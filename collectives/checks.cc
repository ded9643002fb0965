#include "dtensor/collectives/checks.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {

absl::Status CheckContiguous(const char* op, int rank, const char* name, const Tensor& t) {
  if (!t.defined()) return InvalidArg(op, "rank ", rank, ": ", name, " is undefined");
  if (!t.is_contiguous()) {
    return InvalidArg(op, "rank ", rank, ": ", name, " is not contiguous (shape ", ShapeString(t.shape()), ", strides ",
                      ShapeString(t.strides()), ")");
  }
  return absl::OkStatus();
}

absl::Status CheckSameDType(const char* op, int rank, const Tensor& input, const Tensor& output) {
  if (input.dtype() != output.dtype()) {
    return InvalidArg(op, "rank ", rank, ": input is ", DTypeName(input.dtype()), " but output is ",
                      DTypeName(output.dtype()));
  }
  return absl::OkStatus();
}

absl::Status CheckNumel(const char* op, int rank, const char* name, const Tensor& t, int64_t expected,
                        absl::string_view why) {
  if (t.numel() != expected) {
    return InvalidArg(op, "rank ", rank, ": ", name, " has ", t.numel(), " elements, expected ", expected, " (", why,
                      ")");
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CheckCounts(const char* op, int rank, const char* name, absl::Span<const int64_t> counts,
                                    int size) {
  if (static_cast<int64_t>(counts.size()) != size) {
    return InvalidArg(op, "rank ", rank, ": ", name, " has ", counts.size(), " entries, expected ", size,
                      " (one per rank)");
  }
  // Far above any real tensor, and low enough that a sum, or a count times an element size,
  // cannot overflow: counts that wrap around would pass every later size check.
  constexpr int64_t kMaxElements = int64_t{1} << 56;
  int64_t sum = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    if (counts[j] < 0) return InvalidArg(op, "rank ", rank, ": ", name, "[", j, "] is ", counts[j]);
    if (counts[j] > kMaxElements - sum) {
      return InvalidArg(op, "rank ", rank, ": ", name, " sum past 2^56 elements at ", name, "[", j, "] = ", counts[j]);
    }
    sum += counts[j];
  }
  return sum;
}

absl::StatusOr<DType> CheckBlocks(const char* op, int rank, absl::Span<const Tensor> sends,
                                  absl::Span<const Tensor> recvs, int size) {
  for (const auto& [name, blocks] : {std::pair{"sends", sends}, std::pair{"recvs", recvs}}) {
    if (static_cast<int64_t>(blocks.size()) != size) {
      return InvalidArg(op, "rank ", rank, ": ", name, " has ", blocks.size(), " blocks, expected ", size,
                        " (one per rank)");
    }
    for (size_t j = 0; j < blocks.size(); ++j) {
      if (!blocks[j].defined()) return InvalidArg(op, "rank ", rank, ": ", name, "[", j, "] is undefined");
    }
  }
  const DType dtype = sends[0].dtype();
  for (const auto& [name, blocks] : {std::pair{"sends", sends}, std::pair{"recvs", recvs}}) {
    for (size_t j = 0; j < blocks.size(); ++j) {
      if (blocks[j].dtype() != dtype) {
        return InvalidArg(op, "rank ", rank, ": ", name, "[", j, "] is ", DTypeName(blocks[j].dtype()),
                          " but sends[0] is ", DTypeName(dtype));
      }
    }
  }
  return dtype;
}

absl::Status CheckUniformBlocks(const char* op, int rank, absl::Span<const Tensor> sends,
                                absl::Span<const Tensor> recvs) {
  const int64_t m = sends.empty() ? 0 : sends[0].numel();
  for (size_t j = 0; j < sends.size() && j < recvs.size(); ++j) {
    if (sends[j].numel() != m || recvs[j].numel() != m) {
      return InvalidArg(op, "rank ", rank, ": uniform, but the blocks' element counts differ (sends[", j, "] ",
                        sends[j].numel(), ", recvs[", j, "] ", recvs[j].numel(), ", sends[0] ", m, ")");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPeer(const char* op, int rank, const char* what, int peer, int size) {
  if (peer < 0 || peer >= size) {
    return InvalidArg(op, "rank ", rank, ": ", what, " ", peer, " is out of range for a group of size ", size);
  }
  return absl::OkStatus();
}

absl::Status CheckReducible(const char* op, int rank, DType dtype, CommReduceOp rop) {
  if (IsFloat8(dtype)) {
    return absl::UnimplementedError(absl::StrCat("[", op, "] rank ", rank, ": cannot reduce ", DTypeName(dtype),
                                                 " (a storage-only type); cast to a compute type first"));
  }
  if (dtype == DType::kBool && rop == CommReduceOp::kAvg) {
    return InvalidArg(op, "rank ", rank, ": avg is not defined for bool");
  }
  return absl::OkStatus();
}

namespace {
class CompletedWork final : public Work {
 public:
  explicit CompletedWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }
  bool IsCompleted() override { return true; }

 private:
  absl::Status status_;
};
}  // namespace

absl::StatusOr<std::vector<std::pair<size_t, size_t>>> CheckPeerOps(const char* op, int rank, int size, Device device,
                                                                    absl::Span<const PeerOp> ops) {
  std::vector<size_t> self_sends, self_recvs;
  for (size_t k = 0; k < ops.size(); ++k) {
    const PeerOp& o = ops[k];
    const bool send = o.kind == PeerOp::Kind::kSend;
    // The op's name, built only for an error message.
    auto name = [&] { return absl::StrCat("ops[", k, "] (", send ? "send to " : "recv from ", o.peer, ")"); };
    if (o.kind != PeerOp::Kind::kSend && o.kind != PeerOp::Kind::kRecv) {
      return InvalidArg(op, "rank ", rank, ": ops[", k, "] has kind ", static_cast<int>(o.kind));
    }
    if (o.peer < 0 || o.peer >= size) {
      return CheckPeer(op, rank, absl::StrCat("ops[", k, "] ", send ? "send" : "recv", " peer").c_str(), o.peer, size);
    }
    if (!o.tensor.defined() || !o.tensor.is_contiguous()) return CheckContiguous(op, rank, name().c_str(), o.tensor);
    if (o.tensor.device() != device) {
      return InvalidArg(op, "rank ", rank, ": ", name(), " is on ", o.tensor.device().ToString(),
                        " but the communicator moves ", device.ToString(), " tensors");
    }
    if (o.peer == rank) (send ? self_sends : self_recvs).push_back(k);
  }
  if (self_sends.size() != self_recvs.size()) {
    return InvalidArg(op, "rank ", rank, ": ", self_sends.size(), " send(s) to this rank but ", self_recvs.size(),
                      " receive(s) from it in one batch");
  }
  std::vector<std::pair<size_t, size_t>> pairs;
  for (size_t i = 0; i < self_sends.size(); ++i) {
    const Tensor& s = ops[self_sends[i]].tensor;
    const Tensor& r = ops[self_recvs[i]].tensor;
    if (s.numel() != r.numel() || s.dtype() != r.dtype()) {
      return InvalidArg(op, "rank ", rank, ": send to itself ops[", self_sends[i], "] has ", s.numel(), " ",
                        DTypeName(s.dtype()), " elements but its receive ops[", self_recvs[i], "] has ", r.numel(), " ",
                        DTypeName(r.dtype()));
    }
    pairs.emplace_back(self_sends[i], self_recvs[i]);
  }
  return pairs;
}

std::string RanksPhrase(absl::Span<const int> ranks) {
  if (ranks.empty()) return "no rank";
  if (ranks.size() == 1) return absl::StrCat("rank ", ranks[0]);
  std::string s = "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    absl::StrAppend(&s, i == 0 ? "" : (i + 1 == ranks.size() ? " and " : ", "), ranks[i]);
  }
  return s;
}

namespace {

class WorkOfAll final : public Work {
 public:
  explicit WorkOfAll(std::vector<std::unique_ptr<Work>> works) : works_(std::move(works)) {}
  absl::Status Wait() override {
    absl::Status first;
    for (auto& w : works_) first.Update(w->Wait());
    return first;
  }
  bool IsCompleted() override {
    for (auto& w : works_) {
      if (!w->IsCompleted()) return false;
    }
    return true;
  }

 private:
  std::vector<std::unique_ptr<Work>> works_;
};

}  // namespace

std::unique_ptr<Work> MakeWorkOfAll(std::vector<std::unique_ptr<Work>> works) {
  return std::make_unique<WorkOfAll>(std::move(works));
}

std::unique_ptr<Work> MakeCompletedWork(absl::Status status) {
  return std::make_unique<CompletedWork>(std::move(status));
}

namespace {

// The bytes [lo, hi) that a view may touch: from its lowest to just past its highest element
// (a strided view reaches beyond numel x element size from its first element).
std::pair<const char*, const char*> Extent(const Tensor& t) {
  const int64_t es = static_cast<int64_t>(ElementSize(t.dtype()));
  int64_t lo = 0, hi = 0;  // element offsets from the first element
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d);
    (reach < 0 ? lo : hi) += reach;
  }
  const char* p = static_cast<const char*>(t.raw_data());
  return {p + lo * es, p + (hi + 1) * es};
}

}  // namespace

bool Overlap(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [alo, ahi] = Extent(a);
  const auto [blo, bhi] = Extent(b);
  return alo < bhi && blo < ahi;
}

std::vector<int64_t> PrefixOffsets(absl::Span<const int64_t> counts) {
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t j = 1; j < counts.size(); ++j) offsets[j] = offsets[j - 1] + counts[j - 1];
  return offsets;
}

}  // namespace dtensor::internal
