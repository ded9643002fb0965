// The GPU of a test process that is one rank of an NCCL group (launched by dtrun, mpirun or
// srun): cuda:LOCAL_RANK where this host has a GPU for each local rank; else cuda:0, shared.
// NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"), so a sharing
// process first names itself a host of its own (NCCL_HOSTID, which NCCL reads once per
// process: call this before any NCCL call) and the ranks then meet through NCCL's socket
// transport, on loopback unless NCCL_SOCKET_IFNAME says otherwise. Slow, but every code path
// of the nccl backend runs, which is how its multi-rank tests run on a one-GPU machine.
#ifndef DTENSOR_TESTS_TESTING_NCCL_PROCESS_GPU_H_
#define DTENSOR_TESTS_TESTING_NCCL_PROCESS_GPU_H_

#include <cstdlib>
#include <string>

#include "dtensor/collectives/store/rendezvous.h"
#include "dtensor/tensor/device.h"

namespace dtensor::testing {

inline int NcclProcessGpu(const LaunchInfo& info) {
  const int gpus = CudaDeviceCount();
  if (gpus == 0 || gpus >= info.local_world_size) return info.local_rank;
  setenv("NCCL_HOSTID", ("dtensor-test-rank-" + std::to_string(info.rank)).c_str(), 1);
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  return 0;
}

}  // namespace dtensor::testing

#endif  // DTENSOR_TESTS_TESTING_NCCL_PROCESS_GPU_H_
