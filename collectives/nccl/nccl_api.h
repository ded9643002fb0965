// NcclApi: the NCCL functions the nccl backend calls, loaded with dlopen on first use
// (internal).
//
//   DT_RETURN_IF_ERROR(LoadNccl());   // FailedPrecondition naming libnccl.so.2 when absent
//   Nccl().ncclAllReduce(...);         // the same names and types as nccl.h's functions
//
// The nccl component links no NCCL library: a program built with it starts, and runs on CPU,
// where NCCL is not installed; creating an NCCL communicator loads libnccl.so.<major> (the
// major version of the headers dtensor was built with) or fails saying what is missing. Every
// pointer has the type of nccl.h's declaration (decltype), so a signature change does not
// build.
#ifndef DTENSOR_COLLECTIVES_NCCL_NCCL_API_H_
#define DTENSOR_COLLECTIVES_NCCL_NCCL_API_H_

#include <nccl.h>

#include "absl/status/status.h"

namespace dtensor::internal {

struct NcclApi {
  decltype(&::ncclAllGather) ncclAllGather = nullptr;
  decltype(&::ncclAllReduce) ncclAllReduce = nullptr;
  decltype(&::ncclBroadcast) ncclBroadcast = nullptr;
  decltype(&::ncclCommAbort) ncclCommAbort = nullptr;
  decltype(&::ncclCommCount) ncclCommCount = nullptr;
  decltype(&::ncclCommDestroy) ncclCommDestroy = nullptr;
  decltype(&::ncclCommFinalize) ncclCommFinalize = nullptr;
  decltype(&::ncclCommGetAsyncError) ncclCommGetAsyncError = nullptr;
  decltype(&::ncclCommInitRankConfig) ncclCommInitRankConfig = nullptr;
  decltype(&::ncclCommSplit) ncclCommSplit = nullptr;
  decltype(&::ncclCommUserRank) ncclCommUserRank = nullptr;
  decltype(&::ncclGetErrorString) ncclGetErrorString = nullptr;
  decltype(&::ncclGetLastError) ncclGetLastError = nullptr;
  decltype(&::ncclGetUniqueId) ncclGetUniqueId = nullptr;
  decltype(&::ncclGroupEnd) ncclGroupEnd = nullptr;
  decltype(&::ncclGroupStart) ncclGroupStart = nullptr;
  decltype(&::ncclRecv) ncclRecv = nullptr;
  decltype(&::ncclReduce) ncclReduce = nullptr;
  decltype(&::ncclReduceScatter) ncclReduceScatter = nullptr;
  decltype(&::ncclSend) ncclSend = nullptr;
};

// Loads the library once per process (a failure is remembered and returned again).
absl::Status LoadNccl();

// The loaded functions; only after LoadNccl() succeeded.
const NcclApi& Nccl();

// The library file name dlopen is asked for ("libnccl.so.2").
const char* NcclLibraryName();

}  // namespace dtensor::internal

#endif  // DTENSOR_COLLECTIVES_NCCL_NCCL_API_H_
