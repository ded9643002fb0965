#include "dtensor/collectives/agree.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor {

absl::StatusOr<std::vector<std::string>> AllGatherText(Communicator& world, absl::string_view text) {
  const int n = world.size();
  DT_ASSIGN_OR_RETURN(Tensor len, Tensor::FromVector<int64_t>({static_cast<int64_t>(text.size())}, {1}));
  DT_ASSIGN_OR_RETURN(len, To(len, world.device()));
  DT_ASSIGN_OR_RETURN(Tensor lens, Tensor::Empty({n}, DType::kInt64, world.device()));
  DT_RETURN_IF_ERROR(world.AllGather(len, lens));
  DT_ASSIGN_OR_RETURN(lens, To(lens, Device::Cpu()));
  // Packed in 4-byte words (int32 elements), each rank's text zero-padded to whole words.
  std::vector<int64_t> words(static_cast<size_t>(n));
  int64_t total = 0;
  for (int r = 0; r < n; ++r) {
    const int64_t bytes = lens.data<int64_t>()[r];
    if (bytes < 0) return absl::DataLossError(absl::StrCat("[AllGatherText] rank ", r, " sent length ", bytes));
    words[static_cast<size_t>(r)] = (bytes + 3) / 4;
    total += words[static_cast<size_t>(r)];
  }
  std::vector<int32_t> packed(static_cast<size_t>(words[static_cast<size_t>(world.rank())]), 0);
  if (!text.empty()) std::memcpy(packed.data(), text.data(), text.size());
  DT_ASSIGN_OR_RETURN(Tensor in, Tensor::FromVector<int32_t>(packed, {static_cast<int64_t>(packed.size())}));
  DT_ASSIGN_OR_RETURN(in, To(in, world.device()));
  DT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({total}, DType::kInt32, world.device()));
  DT_RETURN_IF_ERROR(world.AllGatherV(in, out, words));
  DT_ASSIGN_OR_RETURN(out, To(out, Device::Cpu()));
  std::vector<std::string> texts;
  texts.reserve(static_cast<size_t>(n));
  const char* p = static_cast<const char*>(out.raw_data());
  for (int r = 0; r < n; ++r) {
    texts.emplace_back(p, static_cast<size_t>(lens.data<int64_t>()[r]));
    p += 4 * words[static_cast<size_t>(r)];
  }
  return texts;
}

absl::StatusOr<std::vector<int64_t>> AllGatherInts(Communicator& world, absl::Span<const int64_t> mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  DT_ASSIGN_OR_RETURN(Tensor send, Tensor::FromVector<int64_t>(mine, {n}));
  DT_ASSIGN_OR_RETURN(send, To(send, world.device()));
  DT_ASSIGN_OR_RETURN(Tensor all, Tensor::Empty({world.size() * n}, DType::kInt64, world.device()));
  DT_RETURN_IF_ERROR(world.AllGather(send, all));
  DT_ASSIGN_OR_RETURN(all, To(all, Device::Cpu()));
  const int64_t* v = all.data<int64_t>();
  return std::vector<int64_t>(v, v + all.numel());
}

absl::Status AgreeOnStatus(Communicator& world, const absl::Status& mine, absl::string_view what) {
  if (world.size() == 1) return mine;  // nothing to agree with
  DT_ASSIGN_OR_RETURN(Tensor flag, Tensor::FromVector<int32_t>({mine.ok() ? 1 : 0}, {1}));
  DT_ASSIGN_OR_RETURN(flag, To(flag, world.device()));
  DT_ASSIGN_OR_RETURN(Tensor all, Tensor::Empty({world.size()}, DType::kInt32, world.device()));
  if (absl::Status gathered = world.AllGather(flag, all); !gathered.ok()) {
    // A failed rank keeps its own error (its communicator may have failed with it).
    if (mine.ok()) return gathered;
    return absl::Status(
        mine.code(), absl::StrCat(mine.message(), " (then agreeing with the other ranks: ", gathered.ToString(), ")"));
  }
  DT_ASSIGN_OR_RETURN(all, To(all, Device::Cpu()));
  std::vector<int> failed;
  for (int r = 0; r < world.size(); ++r) {
    if (all.data<int32_t>()[r] == 0) failed.push_back(r);
  }
  if (failed.empty()) return absl::OkStatus();
  // Every rank learns the first failed rank's error: its code, a space, its message.
  absl::StatusOr<std::vector<std::string>> texts =
      AllGatherText(world, mine.ok() ? "" : absl::StrCat(static_cast<int>(mine.code()), " ", mine.message()));
  if (!mine.ok()) return mine;
  if (!texts.ok()) return texts.status();
  const std::string& first = (*texts)[static_cast<size_t>(failed[0])];
  const size_t space = first.find(' ');
  int code = std::atoi(first.substr(0, space).c_str());
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    code = static_cast<int>(absl::StatusCode::kUnknown);
  }
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat(what, " failed on rank(s) ", absl::StrJoin(failed, ", "), "; rank ", failed[0], ": ",
                                   space == std::string::npos ? "" : first.substr(space + 1)));
}

}  // namespace dtensor
