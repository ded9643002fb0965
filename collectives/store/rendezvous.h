// Rendezvous: who am I in a multi-process run, and where is the master's store.
//
// Launchers describe each process through environment variables; LaunchInfoFromEnv() reads
// the three common schemes, and ConnectStore() joins the run's TCP store (rank 0 hosts it):
//
//   DT_ASSIGN_OR_RETURN(LaunchInfo info, LaunchInfoFromEnv());
//   DT_ASSIGN_OR_RETURN(auto store, ConnectStore(info, absl::Seconds(60)));
//   DT_ASSIGN_OR_RETURN(int64_t n, store->Add("joined", 1));
//
// Schemes, tried in this order (the first whose rank variable is set wins):
//   torchrun / dtrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   Open MPI:         OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   Slurm (srun):     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID and
//                     SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE
//                     ("4(x2),3" form); the master defaults to the first host of
//                     SLURM_STEP_NODELIST / SLURM_NODELIST.
// In every scheme MASTER_ADDR / MASTER_PORT override the master (defaults 127.0.0.1 and 29500;
// port 0, "any free port", when the world has one rank). LOCAL_* default to a single node
// (local rank = rank). With none of the rank variables set, the process is a world of one
// (WORLD_SIZE other than 1 without RANK is an error).
// In every scheme DTENSOR_STORE_SECRET (set by dtrun: a fresh random secret per job; set it to
// the same value on every node of a multi-node job) makes the store authenticate every rank;
// without it the store admits any process that can connect, and rank 0 says so on stderr.
// DTENSOR_STORE_FD (set by dtrun for rank 0 only) is the store's listening socket, bound by
// dtrun, so that no other process can take the port before rank 0 serves on it.
// Errors are InvalidArgument naming the variable and its value.
#ifndef DTENSOR_COLLECTIVES_STORE_RENDEZVOUS_H_
#define DTENSOR_COLLECTIVES_STORE_RENDEZVOUS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dtensor/collectives/store/tcp_store.h"

namespace dtensor {

inline constexpr int kDefaultMasterPort = 29500;

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string scheme = "none";  // "torchrun", "ompi", "slurm" or "none"
  std::string store_secret;     // DTENSOR_STORE_SECRET; empty: an unauthenticated store
  int store_fd = -1;            // DTENSOR_STORE_FD: rank 0's inherited listening socket, or -1
};

// From an explicit environment (for tests) or from the process environment.
absl::StatusOr<LaunchInfo> LaunchInfoFromEnv(const std::map<std::string, std::string>& env);
absl::StatusOr<LaunchInfo> LaunchInfoFromEnv();

// Connects to the run's store at master_addr:master_port within `timeout` (also the timeout of
// every later call). Rank 0 first starts the server there and the returned client owns it, so
// rank 0 should outlive the other ranks' use of the store (e.g. end with a store barrier).
// Rank 0 serves on info.store_fd when that is a listening socket on master_port (the first call
// in the process; else it binds the port itself). Every client authenticates with info.store_secret when it is set.
absl::StatusOr<std::unique_ptr<StoreClient>> ConnectStore(const LaunchInfo& info, absl::Duration timeout);

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_STORE_RENDEZVOUS_H_
