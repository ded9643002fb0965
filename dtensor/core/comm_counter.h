// CommCounter: what collectives DTensor issued — calls and bytes per collective type, like
// PyTorch's CommDebugMode. Attach one to a mesh (dtensor.h: SetCommCounter); every
// redistribution, distribute, full_tensor and from_local check on that mesh (or a view of it)
// records into it, on this rank.
//
//   CommCounter counter;
//   SetCommCounter(mesh, &counter);
//   DT_ASSIGN_OR_RETURN(DTensor y, x.Redistribute({Replicate(), Replicate()}));
//   counter.calls(CommKind::kAllGather);   // 1
//   counter.bytes(CommKind::kAllGather);   // bytes of the gathered output on this rank
//   std::cout << counter.ToString();       // "all_gather: 1 call, 4096 bytes"
//
// Bytes are the collective's payload on this rank in nccl-tests' convention: the output for
// all_gather, the input for all_reduce, reduce_scatter and all_to_all (all blocks, including
// the one a rank keeps), the tensor for broadcast. RedistributePlan::PredictComm predicts the
// same records, so a test can check that the executor moved what the planner said.
#ifndef DTENSOR_CORE_COMM_COUNTER_H_
#define DTENSOR_CORE_COMM_COUNTER_H_

#include <array>
#include <cstdint>
#include <string>

namespace dtensor {

enum class CommKind : uint8_t { kAllGather, kAllReduce, kReduceScatter, kAllToAll, kBroadcast };
inline constexpr int kNumCommKinds = 5;

// "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast".
const char* CommKindName(CommKind kind);

class CommCounter {
 public:
  void Record(CommKind kind, int64_t bytes) {
    calls_[static_cast<size_t>(kind)] += 1;
    bytes_[static_cast<size_t>(kind)] += bytes;
  }
  int64_t calls(CommKind kind) const { return calls_[static_cast<size_t>(kind)]; }
  int64_t bytes(CommKind kind) const { return bytes_[static_cast<size_t>(kind)]; }
  int64_t total_calls() const;
  int64_t total_bytes() const;
  void Reset() { *this = CommCounter(); }
  // One line per kind with calls, "all_gather: 2 calls, 4096 bytes"; "no collectives" if none.
  std::string ToString() const;

 private:
  std::array<int64_t, kNumCommKinds> calls_{};
  std::array<int64_t, kNumCommKinds> bytes_{};
};

}  // namespace dtensor

#endif  // DTENSOR_CORE_COMM_COUNTER_H_
