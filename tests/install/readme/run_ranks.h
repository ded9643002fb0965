// RunRanks: runs fn(world) on each rank of a group of n threads (MakeThreadGroup(n)), for the
// README block drivers; prints every rank's error and returns the process exit code.
//
//   int main() { return RunRanks(2, [](Communicator& world) { return Block(world); }); }
#ifndef DTENSOR_TESTS_INSTALL_README_RUN_RANKS_H_
#define DTENSOR_TESTS_INSTALL_README_RUN_RANKS_H_

#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "dtensor/collectives/threads/threads_communicator.h"

inline int RunRanks(int n, const std::function<absl::Status(dtensor::Communicator&)>& fn) {
  auto comms = dtensor::MakeThreadGroup(n);
  if (!comms.ok()) {
    std::fprintf(stderr, "MakeThreadGroup: %s\n", comms.status().ToString().c_str());
    return 1;
  }
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { status[r] = fn(*(*comms)[r]); });
  for (auto& t : threads) t.join();
  int rc = 0;
  for (int r = 0; r < n; ++r) {
    if (!status[r].ok()) {
      std::fprintf(stderr, "rank %d: %s\n", r, status[r].ToString().c_str());
      rc = 1;
    }
  }
  return rc;
}

#endif  // DTENSOR_TESTS_INSTALL_README_RUN_RANKS_H_
