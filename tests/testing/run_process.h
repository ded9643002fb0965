// Runs a program (dtrun and the rank programs it starts, in the tests that launch processes)
// with a bounded wait, and returns its exit code and output.
//
//   testing::ProcessRun run = testing::RunProcess({DTRUN_PATH, "--nproc-per-node", "2", CHILD},
//                                                 {.env = {"DTENSOR_DEBUG=1"}});
//   EXPECT_EQ(run.code, 0) << run.err;
#ifndef DTENSOR_TESTS_TESTING_RUN_PROCESS_H_
#define DTENSOR_TESTS_TESTING_RUN_PROCESS_H_

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace dtensor::testing {

struct ProcessRun {
  int code = -1;         // exit code, 128 + signal, or -1 if it was not started or was killed at the timeout
  std::string out, err;  // stdout and stderr (with merge_output: both in out, in order)
  absl::Duration took;
};

struct ProcessOptions {
  std::vector<std::string> env = {};            // "NAME=value" added to (or replacing in) this process's environment
  std::vector<std::string> unset = {};          // names removed from it first
  std::vector<int> cpus = {};                   // when not empty, the program may run only on these CPUs
  absl::Duration timeout = absl::Seconds(60);   // times TimeScale(); then its whole process group is killed
  bool merge_output = false;                    // stderr into out
  std::function<void(pid_t)> during = nullptr;  // runs once the program started (e.g. to signal it)
};

// argv[0] is the program's path. The program leads a process group of its own, so the
// timeout also kills what it started.
ProcessRun RunProcess(const std::vector<std::string>& argv, const ProcessOptions& options = {});

// The rest of every line of `out` that starts with `prefix`, in order (e.g. prefix
// "[rank 1] listening " for what dtrun's rank 1 printed after "listening ").
std::vector<std::string> LinesAfter(const std::string& out, const std::string& prefix);

}  // namespace dtensor::testing

#endif  // DTENSOR_TESTS_TESTING_RUN_PROCESS_H_
