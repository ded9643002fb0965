#include "tests/testing/run_process.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include "absl/time/clock.h"
#include "tests/testing/test_util.h"

extern char** environ;

namespace dtensor::testing {
namespace {

std::string NameOf(const std::string& entry) { return entry.substr(0, entry.find('=')); }

// This process's environment without `unset` and the names `env` sets, then `env`.
std::vector<std::string> ChildEnvironment(const ProcessOptions& o) {
  std::vector<std::string> dropped = o.unset;
  for (const std::string& e : o.env) dropped.push_back(NameOf(e));
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    bool keep = true;
    for (const std::string& name : dropped) keep = keep && NameOf(entry) != name;
    if (keep) out.push_back(entry);
  }
  out.insert(out.end(), o.env.begin(), o.env.end());
  return out;
}

std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

ProcessRun RunProcess(const std::vector<std::string>& argv, const ProcessOptions& options) {
  ProcessRun run;
  if (argv.empty()) {
    ADD_FAILURE() << "RunProcess: no program";
    return run;
  }
  ScopedTempDir dir("run_process");
  if (dir.path().empty()) return run;
  const std::string out_path = dir.Path("out"), err_path = dir.Path("err");
  // Everything the child needs is made before fork: it only makes system calls.
  std::vector<std::string> args = argv, env = ChildEnvironment(options);
  std::vector<char*> arg_ptrs = Pointers(args), env_ptrs = Pointers(env);
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : options.cpus) CPU_SET(c, &set);
  const bool merge = options.merge_output;
  const absl::Time start = absl::Now();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    if (!options.cpus.empty() && sched_setaffinity(0, sizeof(set), &set) != 0) _exit(125);
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int err = merge ? out : open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out < 0 || err < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0) _exit(125);
    execve(arg_ptrs[0], arg_ptrs.data(), env_ptrs.data());
    _exit(126);
  }
  if (pid < 0) {
    ADD_FAILURE() << "RunProcess: fork: " << std::strerror(errno);
    return run;
  }
  if (options.during) options.during(pid);
  int status = 0;
  bool done = false;
  // A sanitizer build runs the program several times slower (DTENSOR_TEST_TIME_SCALE).
  const absl::Time deadline = start + options.timeout * TimeScale();
  while (!done) {
    done = waitpid(pid, &status, WNOHANG) == pid;
    if (done || absl::Now() >= deadline) break;
    usleep(10 * 1000);
  }
  if (!done) {
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
  } else {
    run.code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
  }
  run.took = absl::Now() - start;
  run.out = ReadBytes(out_path);
  if (!merge) run.err = ReadBytes(err_path);
  return run;
}

std::vector<std::string> LinesAfter(const std::string& out, const std::string& prefix) {
  std::vector<std::string> found;
  for (size_t at = 0; at < out.size();) {
    size_t end = out.find('\n', at);
    if (end == std::string::npos) end = out.size();
    if (out.compare(at, prefix.size(), prefix) == 0 && end - at >= prefix.size()) {
      found.push_back(out.substr(at + prefix.size(), end - at - prefix.size()));
    }
    at = end + 1;
  }
  return found;
}

}  // namespace dtensor::testing
