#include "dtensor/collectives/nccl/local_gpu.h"

#include "absl/strings/str_cat.h"

namespace dtensor {

absl::StatusOr<int> LocalGpu(int local_rank, int local_world_size, int visible_gpus, bool visible_devices_set) {
  if (local_world_size < 1 || local_rank < 0 || local_rank >= local_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("[LocalGpu] local rank ", local_rank, " is not in a host of ", local_world_size, " process(es)"));
  }
  if (visible_gpus < 1) return absl::FailedPreconditionError("[LocalGpu] no CUDA device visible");
  if (visible_gpus >= local_world_size) return local_rank;
  if (visible_gpus == 1 && visible_devices_set) return 0;
  return absl::FailedPreconditionError(
      absl::StrCat("[LocalGpu] ", local_world_size, " processes on this host but ", visible_gpus,
                   " CUDA device(s) visible: NCCL needs one GPU per process (start at most ", visible_gpus,
                   " per host, or give each process one GPU with CUDA_VISIBLE_DEVICES)"));
}

}  // namespace dtensor
