// Built instead of the nccl backend when the CUDA Toolkit or NCCL is not found.
#include "absl/strings/str_cat.h"
#include "dtensor/collectives/nccl/nccl_communicator.h"

namespace dtensor {

bool NcclBuilt() { return false; }

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const LaunchInfo& info, StoreClient& /*store*/,
                                                                   int device_index, absl::Duration /*timeout*/) {
  return absl::FailedPreconditionError(absl::StrCat("[MakeNcclCommunicator] rank ", info.rank, ": cuda:", device_index,
                                                    " requested but dtensor was built without CUDA/NCCL"));
}

}  // namespace dtensor
