// Which GPU a process takes when a launcher (dtrun, torchrun, mpirun, srun) starts one process
// per GPU: the rule the trainer and coll_bench --backend nccl share.
//
//   DT_ASSIGN_OR_RETURN(LaunchInfo info, LaunchInfoFromEnv());
//   DT_ASSIGN_OR_RETURN(int gpu, LocalGpu(info.local_rank, info.local_world_size, CudaDeviceCount(),
//                                         std::getenv("CUDA_VISIBLE_DEVICES") != nullptr));
//
// As torchrun users expect: with at least one visible GPU per process on the host, process
// local_rank takes cuda:local_rank. With exactly one visible GPU where CUDA_VISIBLE_DEVICES is
// set, each process was handed its own (srun --gpus-per-task=1, or a per-rank mask) and takes
// cuda:0; should the processes in fact share it, NCCL refuses the group ("Duplicate GPU").
// Otherwise fewer GPUs than processes cannot give each one its own: FailedPrecondition, before
// NCCL is asked.
#ifndef DTENSOR_COLLECTIVES_NCCL_LOCAL_GPU_H_
#define DTENSOR_COLLECTIVES_NCCL_LOCAL_GPU_H_

#include "absl/status/statusor.h"

namespace dtensor {

absl::StatusOr<int> LocalGpu(int local_rank, int local_world_size, int visible_gpus, bool visible_devices_set);

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_NCCL_LOCAL_GPU_H_
