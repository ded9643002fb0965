// dtrun: starts the local ranks of a multi-process run, torchrun style.
//
//   dtrun --nproc-per-node 4 ./train --steps 100
//   dtrun --nproc-per-node 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 ./train
//
// Each rank gets RANK (node_rank * nproc + local rank), WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (127.0.0.1 and a free port on a single node).
// On a single node dtrun binds the store's port itself and hands the listening socket to rank 0
// (DTENSOR_STORE_FD), so no other process can take the port before rank 0 serves the store.
// Every rank gets DTENSOR_STORE_SECRET, a fresh random secret per job (or the one in dtrun's
// environment: on a multi-node job export the same one on every node, else the store is
// unauthenticated); the store admits only processes that prove they hold it.
// Every line a rank writes to stdout/stderr is copied to dtrun's stdout/stderr prefixed
// "[rank R] ", one write per line (a last line without newline gets one; lines over 64 KiB are
// split). SIGINT/SIGTERM/SIGHUP are forwarded to the ranks. When a rank
// fails (non-zero exit or a signal), the others get SIGTERM, then SIGKILL after the grace period.
// Exit status: 0 if all ranks succeed, else the first failure's code (128 + signal for a
// signal); 2 for usage errors; 1 when the ranks succeeded but dtrun had to drop some of their
// output (its own stdout or stderr, non-blocking, stayed full for a minute: said on stderr).
// A failed rank's peers first get --failure-wait-s (default 1 s) to notice it and exit with
// their own error, which names the operation and the peer (a dead peer is seen within
// milliseconds); stopped ranks (SIGSTOP) are sent SIGCONT with the SIGTERM.
// A rank that dies without exiting cleanly (a signal, _exit) leaves its OpenMP runtime's
// registration file behind (LLVM libomp: /dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>); dtrun
// removes the files of its exited ranks while their pids are still reserved (see below).
// dtrun raises its soft RLIMIT_NOFILE (which the ranks inherit) toward world + 2 x local ranks
// + 256 within the hard limit, since rank 0's store holds a connection per rank (a warning says
// when the hard limit is lower).
// Each rank runs in its own process group (so the signal reaches its children too, also
// after the rank itself exited) and dies with dtrun (PR_SET_PDEATHSIG);
// when every rank has exited, what is left in their groups is killed. Ranks read /dev/null as
// stdin (a background group reading the terminal would stop).
// CPU binding (--cpu-bind auto, the default): when this node has at least as many CPUs as ranks
// (in dtrun's own affinity), each rank is bound to its own share of them, whole cores first
// (SplitCpus: 2 ranks on 2 cores get a core each; on 8 cores with hyperthreads, 4 cores each),
// as Open MPI binds ranks to cores. Unbound ranks that wake each other through futexes tend
// to be placed on one core by the scheduler and run at half speed for a whole run; bound ones
// cannot. With fewer CPUs than ranks, each rank is bound to one CPU, consecutive ranks
// sharing one (StackCpus: 4 ranks on 2 CPUs, two per CPU) so that the scheduler cannot move
// them; with --cpu-bind none ranks keep dtrun's affinity. Two dtrun jobs on one host each
// split all the CPUs they may use, so their ranks stack on the same CPUs: give each job its
// own (taskset -c 0-7 dtrun ..., taskset -c 8-15 dtrun ...) or pass --cpu-bind none.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dtensor/collectives/store/cpus.h"
#include "dtensor/collectives/store/tcp_store.h"

extern char** environ;

namespace {

constexpr char kUsage[] =
    "usage: dtrun --nproc-per-node N [--nnodes M --node-rank K] [--master-addr A] [--master-port P]\n"
    "             [--grace-period-s S] [--failure-wait-s S] [--cpu-bind auto|none] [--] PROGRAM [ARGS...]\n"
    "  --nproc-per-node N  ranks to start on this node (required, >= 1)\n"
    "  --nnodes M          nodes in the run (default 1)\n"
    "  --node-rank K       this node's index, 0..M-1 (default 0)\n"
    "  --master-addr A     address of rank 0's store (default 127.0.0.1)\n"
    "  --master-port P     its port (default: a free port when M == 1, else 29500)\n"
    "  --grace-period-s S  seconds between SIGTERM and SIGKILL when stopping ranks (default 5)\n"
    "  --failure-wait-s S  seconds the other ranks get after a rank failed to exit with their own\n"
    "                      error before they are sent SIGTERM (default 1)\n"
    "  --cpu-bind auto|none  auto (default): bind each rank to its own share of this node's CPUs\n"
    "                      (whole cores), or with more ranks than CPUs consecutive ranks to one\n"
    "                      CPU each; two jobs on one host: give each its own CPUs (taskset) or\n"
    "                      pass none\n";

struct Options {
  int nproc = 0;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = -1;
  double grace_s = 5;
  double failure_wait_s = 1;
  bool cpu_bind = true;
  std::vector<std::string> command;
};

int UsageError(const std::string& msg) {
  std::fprintf(stderr, "dtrun: error: %s\n%s", msg.c_str(), kUsage);
  return 2;
}

// Parses argv into `opt`; returns -1 to go on, else an exit code.
int ParseArgs(int argc, char** argv, Options& opt) {
  bool have_nproc = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (arg.rfind("--", 0) != 0) break;  // the program
    std::string value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else {
      if (i + 1 >= argc) return UsageError(absl::StrCat(arg, " needs a value"));
      value = argv[++i];
    }
    auto int_opt = [&](int lo, int hi, int& out) -> bool {
      return absl::SimpleAtoi(value, &out) && out >= lo && out <= hi;
    };
    bool ok = true;
    if (arg == "--nproc-per-node" || arg == "--nproc_per_node") {
      ok = int_opt(1, 4096, opt.nproc);
      have_nproc = true;
    } else if (arg == "--nnodes") {
      ok = int_opt(1, 1 << 16, opt.nnodes);
    } else if (arg == "--node-rank" || arg == "--node_rank") {
      ok = int_opt(0, 1 << 16, opt.node_rank);
    } else if (arg == "--master-addr" || arg == "--master_addr") {
      ok = !value.empty();
      opt.master_addr = value;
    } else if (arg == "--master-port" || arg == "--master_port") {
      ok = int_opt(1, 65535, opt.master_port);
    } else if (arg == "--cpu-bind" || arg == "--cpu_bind") {
      ok = value == "auto" || value == "none";
      opt.cpu_bind = value == "auto";
    } else if (arg == "--grace-period-s") {
      ok = absl::SimpleAtod(value, &opt.grace_s) && opt.grace_s >= 0 && opt.grace_s <= 3600;
    } else if (arg == "--failure-wait-s") {
      ok = absl::SimpleAtod(value, &opt.failure_wait_s) && opt.failure_wait_s >= 0 && opt.failure_wait_s <= 3600;
    } else {
      return UsageError(absl::StrCat("unknown option ", arg));
    }
    if (!ok) return UsageError(absl::StrCat("bad value '", value, "' for ", arg));
  }
  for (; i < argc; ++i) opt.command.emplace_back(argv[i]);
  if (!have_nproc) return UsageError("--nproc-per-node is required");
  if (opt.command.empty()) return UsageError("no program given");
  if (opt.node_rank >= opt.nnodes) {
    return UsageError(absl::StrCat("--node-rank ", opt.node_rank, " is not below --nnodes ", opt.nnodes));
  }
  if (static_cast<int64_t>(opt.nnodes) * opt.nproc > (1 << 24)) return UsageError("world size too large");
  return -1;
}

int g_signal_pipe = -1;
void OnSignal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = write(g_signal_pipe, &b, 1);
  errno = saved;
}

// Bytes of the ranks' output dtrun could not write because its own stdout or stderr stayed
// full (a non-blocking descriptor whose reader fell behind for kMaxStallMs): reported at the
// end, and the exit status is then 1 where it would have been 0.
int64_t g_output_dropped = 0;
constexpr int kMaxStallMs = 60'000;

void WriteAll(int fd, const std::string& s) {
  size_t done = 0;
  int stalled_ms = 0;
  while (done < s.size()) {
    const ssize_t n = write(fd, s.data() + done, s.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
      stalled_ms = 0;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN && stalled_ms < kMaxStallMs) {
      // A non-blocking descriptor (a parent may hand one over) whose reader is behind: wait for
      // room as a blocking write would, instead of dropping the line.
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, 100) == 0) stalled_ms += 100;
      continue;
    }
    if (n < 0 && errno == EAGAIN) g_output_dropped += static_cast<int64_t>(s.size() - done);
    return;  // our own output is gone (or stuck); keep supervising the ranks
  }
}

// One output stream of one rank: bytes are forwarded line by line with the rank's prefix.
struct Stream {
  int fd = -1;     // read end, -1 once closed
  int out_fd = 1;  // dtrun's stdout or stderr
  std::string prefix;
  std::string partial;

  void Emit(const char* data, size_t n) {
    std::string line;
    line.reserve(prefix.size() + n + 1);
    line += prefix;
    line.append(data, n);
    if (line.back() != '\n') line += '\n';
    WriteAll(out_fd, line);
  }
  // Returns false at EOF.
  bool Pump() {
    char buf[1 << 16];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (n <= 0) {
      Flush();
      close(fd);
      fd = -1;
      return false;
    }
    partial.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1) {
      Emit(partial.data() + start, nl - start + 1);
    }
    partial.erase(0, start);
    if (partial.size() >= (1 << 16)) Flush();  // bound memory for endless lines
    return true;
  }
  void Flush() {
    if (!partial.empty()) Emit(partial.data(), partial.size());
    partial.clear();
  }
};

struct Rank {
  int global_rank = 0;
  pid_t pid = -1;
  bool running = false;  // not exited; an exited rank stays unreaped (a zombie) until the end,
                         // so that its pid, and with it its process group id, is not reused
  Stream out, err;
};

// A rank's exit as waitid reports it: the code dtrun returns for it (128 + signal when killed).
int ExitCode(const siginfo_t& info) { return info.si_code == CLD_EXITED ? info.si_status : 128 + info.si_status; }
std::string DescribeExit(const siginfo_t& info) {
  if (info.si_code == CLD_EXITED) return absl::StrCat("exited with code ", info.si_status);
  return absl::StrCat("was killed by signal ", info.si_status, " (", strsignal(info.si_status), ")");
}

// LLVM libomp's registration file of process `pid` (/dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>,
// older releases without _<uid>), which it removes only at a clean exit. Call while `pid` is an
// unreaped zombie, so that no other process can own it.
void RemoveOpenMpFiles(pid_t pid) {
  unlink(absl::StrCat("/dev/shm/__KMP_REGISTERED_LIB_", pid, "_", getuid()).c_str());
  unlink(absl::StrCat("/dev/shm/__KMP_REGISTERED_LIB_", pid).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (const int rc = ParseArgs(argc, argv, opt); rc >= 0) return rc;
  // The store's listening socket, for rank 0 (single node); -1 once handed over.
  int store_fd = -1;
  if (opt.nnodes == 1) {
    absl::StatusOr<dtensor::StoreListener> listener =
        dtensor::ListenForStore(opt.master_addr, std::max(opt.master_port, 0));
    if (!listener.ok()) {
      std::fprintf(stderr, "dtrun: error: %s\n", listener.status().ToString().c_str());
      return 1;
    }
    store_fd = listener->fd;
    if (store_fd < 3) {  // started with stdio closed: keep clear of the fds the ranks' stdio take
      store_fd = fcntl(listener->fd, F_DUPFD_CLOEXEC, 3);
      close(listener->fd);
    }
    opt.master_port = listener->port;
  } else if (opt.master_port < 0) {
    opt.master_port = 29500;
  }
  std::string secret_env;  // "DTENSOR_STORE_SECRET=..." when dtrun makes the secret
  const char* given_secret = std::getenv(dtensor::kStoreSecretEnv);
  if (given_secret != nullptr && given_secret[0] != '\0' &&
      static_cast<int64_t>(std::strlen(given_secret)) < dtensor::kStoreMinSecretBytes) {
    return UsageError(
        absl::StrCat(dtensor::kStoreSecretEnv, " has fewer than ", dtensor::kStoreMinSecretBytes, " characters"));
  }
  if (given_secret == nullptr || given_secret[0] == '\0') {
    if (opt.nnodes == 1) {
      absl::StatusOr<std::string> secret = dtensor::NewStoreSecret();
      if (!secret.ok()) {
        std::fprintf(stderr, "dtrun: error: %s\n", secret.status().ToString().c_str());
        return 1;
      }
      secret_env = absl::StrCat(dtensor::kStoreSecretEnv, "=", *secret);
    } else {
      std::fprintf(stderr,
                   "dtrun: warning: %s is unset: this multi-node job's store admits any process that can reach it "
                   "(export the same secret on every node, e.g. from `openssl rand -hex 32`)\n",
                   dtensor::kStoreSecretEnv);
    }
  }
  const int world = opt.nnodes * opt.nproc;
  // Descriptors: rank 0's store holds one per rank, dtrun two pipes per local rank. Raise the
  // soft RLIMIT_NOFILE (inherited by the ranks) toward what that needs, within the hard limit.
  if (rlimit lim{}; getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    const rlim_t need = static_cast<rlim_t>(world) + 2 * static_cast<rlim_t>(opt.nproc) + 256;
    if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < need) {
      rlimit raised = lim;
      raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? need : std::min(need, lim.rlim_max);
      if (setrlimit(RLIMIT_NOFILE, &raised) != 0 || raised.rlim_cur < need) {
        std::fprintf(stderr,
                     "dtrun: warning: %d ranks need about %llu open files, above RLIMIT_NOFILE's hard limit %llu: "
                     "the store may refuse ranks (raise it: `ulimit -Hn`)\n",
                     world, static_cast<unsigned long long>(need), static_cast<unsigned long long>(lim.rlim_max));
      }
    }
  }

  int sig_pipe[2];
  if (pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::perror("dtrun: pipe");
    return 1;
  }
  g_signal_pipe = sig_pipe[1];
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaction(sig, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  // The environment every rank shares, minus the variables we set per rank.
  std::vector<std::string> base_env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (name == "RANK" || name == "WORLD_SIZE" || name == "LOCAL_RANK" || name == "LOCAL_WORLD_SIZE" ||
        name == "MASTER_ADDR" || name == "MASTER_PORT" || name == "DTENSOR_STORE_FD" ||
        (!secret_env.empty() && name == dtensor::kStoreSecretEnv)) {
      continue;
    }
    base_env.push_back(kv);
  }
  if (!secret_env.empty()) base_env.push_back(secret_env);
  std::vector<char*> child_argv;
  for (std::string& a : opt.command) child_argv.push_back(a.data());
  child_argv.push_back(nullptr);

  // Each rank's CPU set, made before fork (the child only calls sched_setaffinity).
  std::vector<cpu_set_t*> bind(opt.nproc, nullptr);
  size_t bind_bytes = 0;
  if (opt.cpu_bind) {
    const std::vector<int> cpus = dtensor::AllowedCpus();
    const std::vector<int64_t> keys = dtensor::CoreKeys(cpus);
    std::vector<std::vector<int>> shares = dtensor::SplitCpus(cpus, keys, opt.nproc);
    if (shares.empty()) shares = dtensor::StackCpus(cpus, keys, opt.nproc);
    if (!shares.empty()) {
      const int max_cpu = cpus.back() + 1;
      bind_bytes = CPU_ALLOC_SIZE(max_cpu);
      for (int local = 0; local < opt.nproc; ++local) {
        bind[local] = CPU_ALLOC(max_cpu);
        if (bind[local] == nullptr) continue;
        CPU_ZERO_S(bind_bytes, bind[local]);
        for (int c : shares[local]) CPU_SET_S(c, bind_bytes, bind[local]);
      }
    }
  }

  const pid_t self = getpid();
  std::vector<Rank> ranks(opt.nproc);
  int first_failure = 0;
  int received_signal = 0;
  bool stopping = false;
  absl::Time kill_at = absl::InfiniteFuture();

  // A rank's whole process group, also after the rank itself exited: what it started in the
  // background goes too. (Exited ranks stay unreaped until the end, so the group id cannot
  // have passed to another process.)
  auto signal_all = [&](int sig) {
    for (Rank& r : ranks) {
      if (r.pid > 0) kill(-r.pid, sig);
    }
  };
  auto stop_all = [&] {
    if (stopping) return;
    stopping = true;
    signal_all(SIGTERM);
    signal_all(SIGCONT);  // a stopped rank acts on SIGTERM only once continued
    kill_at = absl::Now() + absl::Seconds(opt.grace_s);
  };
  // After a rank failed: the others get failure_wait_s to exit on their own (with an error
  // naming the failed peer), then stop_all.
  absl::Time stop_at = absl::InfiniteFuture();

  for (int local = 0; local < opt.nproc; ++local) {
    Rank& r = ranks[local];
    r.global_rank = opt.node_rank * opt.nproc + local;
    std::vector<std::string> env = base_env;
    env.push_back(absl::StrCat("RANK=", r.global_rank));
    env.push_back(absl::StrCat("WORLD_SIZE=", world));
    env.push_back(absl::StrCat("LOCAL_RANK=", local));
    env.push_back(absl::StrCat("LOCAL_WORLD_SIZE=", opt.nproc));
    env.push_back(absl::StrCat("MASTER_ADDR=", opt.master_addr));
    env.push_back(absl::StrCat("MASTER_PORT=", opt.master_port));
    const bool gets_store_fd = r.global_rank == 0 && store_fd >= 0;
    if (gets_store_fd) env.push_back(absl::StrCat("DTENSOR_STORE_FD=", store_fd));
    std::vector<char*> envp;
    for (std::string& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    int out_pipe[2], err_pipe[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
      std::perror("dtrun: pipe");
      stop_all();
      first_failure = 1;
      break;
    }
    const std::string exec_error = absl::StrCat("dtrun: cannot execute ", opt.command[0], ": ");
    const pid_t pid = fork();
    if (pid == 0) {
      // Child: async-signal-safe calls only, up to exec.
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != self) _exit(127);  // dtrun died before prctl
      // No terminal input: a rank is in a background process group, where reading the
      // terminal would stop it (SIGTTIN) and dtrun with it.
      const int null_in = open("/dev/null", O_RDONLY);
      if (null_in > 0) {
        dup2(null_in, 0);
        close(null_in);
      }
      if (bind[local] != nullptr) sched_setaffinity(0, bind_bytes, bind[local]);  // unbound if it fails
      if (gets_store_fd) fcntl(store_fd, F_SETFD, 0);                             // rank 0 inherits the store's socket
      dup2(out_pipe[1], 1);
      dup2(err_pipe[1], 2);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) sigaction(sig, &dfl, nullptr);
      execvpe(child_argv[0], child_argv.data(), envp.data());
      const char* why = strerror(errno);
      [[maybe_unused]] ssize_t n = write(2, exec_error.data(), exec_error.size());
      n = write(2, why, strlen(why));
      n = write(2, "\n", 1);
      _exit(127);
    }
    close(out_pipe[1]);
    close(err_pipe[1]);
    if (gets_store_fd) {  // rank 0 has it now (or failed to start: then nobody serves it)
      close(store_fd);
      store_fd = -1;
    }
    if (pid < 0) {
      std::perror("dtrun: fork");
      close(out_pipe[0]);
      close(err_pipe[0]);
      stop_all();
      first_failure = 1;
      break;
    }
    setpgid(pid, pid);  // also here, so that kill(-pid) works before the child runs
    r.pid = pid;
    r.running = true;
    const std::string prefix = absl::StrCat("[rank ", r.global_rank, "] ");
    r.out = Stream{out_pipe[0], 1, prefix, {}};
    r.err = Stream{err_pipe[0], 2, prefix, {}};
  }

  absl::Time all_exited_at = absl::InfiniteFuture();
  std::vector<pollfd> pfds;
  std::vector<Stream*> streams;
  for (;;) {
    // Reap.
    for (Rank& r : ranks) {
      if (!r.running) continue;
      siginfo_t info{};
      // WNOWAIT: the rank stays a zombie (reaped at the end), keeping its group id reserved.
      if (waitid(P_PID, static_cast<id_t>(r.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != r.pid) {
        continue;
      }
      r.running = false;
      RemoveOpenMpFiles(r.pid);  // stale whatever the exit: left by a signal or _exit
      const int code = ExitCode(info);
      if (code != 0 && first_failure == 0) {
        first_failure = code;
        if (!stopping) {
          std::fprintf(stderr, "dtrun: rank %d %s; stopping the other ranks\n", r.global_rank,
                       DescribeExit(info).c_str());
        }
        stop_at = absl::Now() + absl::Seconds(opt.failure_wait_s);
      }
    }
    bool any_running = false, any_open = false;
    for (const Rank& r : ranks) {
      any_running |= r.running;
      any_open |= r.out.fd >= 0 || r.err.fd >= 0;
    }
    const absl::Time now = absl::Now();
    if (!any_running && all_exited_at == absl::InfiniteFuture()) all_exited_at = now;
    // Done when every rank is reaped and its output drained (grandchildren that keep the pipes
    // open get one second).
    if (!any_running && (!any_open || now - all_exited_at > absl::Seconds(1))) break;
    if (any_running && now >= stop_at) {
      stop_all();
      stop_at = absl::InfiniteFuture();
    }
    if (any_running && now >= kill_at) {
      signal_all(SIGKILL);
      kill_at = absl::InfiniteFuture();
    }

    pfds.clear();
    streams.clear();
    pfds.push_back({sig_pipe[0], POLLIN, 0});
    for (Rank& r : ranks) {
      for (Stream* s : {&r.out, &r.err}) {
        if (s->fd < 0) continue;
        pfds.push_back({s->fd, POLLIN, 0});
        streams.push_back(s);
      }
    }
    int wait_ms = 100;
    for (const absl::Time at : {kill_at, stop_at}) {
      if (at != absl::InfiniteFuture()) {
        wait_ms =
            std::min(wait_ms, static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(at - now) + 1, 0, 100)));
      }
    }
    if (poll(pfds.data(), pfds.size(), wait_ms) < 0 && errno != EINTR) break;
    if (pfds[0].revents & POLLIN) {
      unsigned char sigs[64];
      const ssize_t n = read(sig_pipe[0], sigs, sizeof(sigs));
      for (ssize_t k = 0; k < n; ++k) {
        const int sig = sigs[k];
        if (sig == SIGCHLD) continue;
        if (received_signal == 0) received_signal = sig;
        signal_all(sig);
        if (!stopping) {
          stopping = true;
          kill_at = absl::Now() + absl::Seconds(opt.grace_s);
        }
      }
    }
    for (size_t k = 1; k < pfds.size(); ++k) {
      if (pfds[k].revents != 0) streams[k - 1]->Pump();
    }
  }
  for (Rank& r : ranks) {
    for (Stream* s : {&r.out, &r.err}) {
      if (s->fd >= 0) {
        s->Flush();
        close(s->fd);
      }
    }
  }
  for (cpu_set_t* set : bind) {
    if (set != nullptr) CPU_FREE(set);
  }
  if (store_fd >= 0) close(store_fd);  // rank 0 was never started
  signal_all(SIGKILL);                 // every rank has exited: nothing it started outlives the run
  for (Rank& r : ranks) {
    if (r.pid > 0) waitpid(r.pid, nullptr, 0);  // now the zombies go
  }
  if (g_output_dropped > 0) {
    const std::string msg = absl::StrCat("dtrun: ", g_output_dropped,
                                         " bytes of the ranks' output were dropped: dtrun's output stayed full for ",
                                         kMaxStallMs / 1000, " s\n");
    [[maybe_unused]] const ssize_t n = write(2, msg.data(), msg.size());
  }
  if (first_failure != 0) return first_failure;
  if (received_signal != 0) return 128 + received_signal;
  return g_output_dropped > 0 ? 1 : 0;
}
