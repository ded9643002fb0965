// dtrun end to end: runs the real launcher on the test rank program (dtrun_test_child) and checks
// the environment, output prefixes, exit codes, that no rank outlives a failure or dtrun, and a
// store rendezvous across 4 processes.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "dtensor/collectives/store/cpus.h"
#include "dtensor/collectives/store/tcp_store.h"
#include "gtest/gtest.h"
#include "tests/testing/run_process.h"
#include "tests/testing/test_util.h"

#if !defined(DTRUN_PATH) || !defined(DTRUN_TEST_CHILD_PATH)
#error "tests/CMakeLists.txt defines DTRUN_PATH and DTRUN_TEST_CHILD_PATH"
#endif

namespace {

using RunResult = dtensor::testing::ProcessRun;

using TempDir = dtensor::testing::ScopedTempDir;

// Runs dtrun with `args`; `during(pid)` runs once it started (e.g. to signal it); with `cpus`
// dtrun may use only those CPUs. Bounded: after 60 s the test kills dtrun's process group.
RunResult RunDtrun(const std::vector<std::string>& args, const std::function<void(pid_t)>& during = nullptr,
                   const std::vector<int>& cpus = {}) {
  std::vector<std::string> argv = {DTRUN_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  return dtensor::testing::RunProcess(argv, {.cpus = cpus, .during = during});
}

std::vector<std::string> Lines(const std::string& s) {
  std::vector<std::string> out = absl::StrSplit(s, '\n', absl::SkipEmpty());
  return out;
}

// Alive = exists and is not a zombie (orphans may wait a while for their reaper).
bool Alive(pid_t pid) {
  const std::string stat = dtensor::testing::ReadBytes("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

std::vector<pid_t> ReadPids(const std::string& dir, int n) {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const std::string s = dtensor::testing::ReadBytes(dir + "/" + std::to_string(r) + ".pid");
    if (!s.empty()) pids.push_back(std::atoi(s.c_str()));
  }
  return pids;
}

// Waits (bounded) until `n` pid files exist in dir.
bool WaitForPids(const std::string& dir, int n) {
  for (int i = 0; i < 1000; ++i) {
    if (static_cast<int>(ReadPids(dir, n).size()) == n) return true;
    usleep(10 * 1000);
  }
  return false;
}

void ExpectAllGone(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    bool alive = true;
    for (int i = 0; i < 300 && alive; ++i) {  // up to 3 s for PDEATHSIG kills to land
      alive = Alive(p);
      if (alive) usleep(10 * 1000);
    }
    EXPECT_FALSE(alive) << "rank process " << p << " was left behind";
    if (alive) kill(p, SIGKILL);
  }
}

TEST(DtrunTest, SetsTheLaunchEnvironment) {
  RunResult run = RunDtrun({"--nproc-per-node", "3", DTRUN_TEST_CHILD_PATH, "env"});
  ASSERT_EQ(run.code, 0) << run.err;
  std::set<std::string> lines;
  std::string port;
  for (const std::string& line : Lines(run.out)) {
    lines.insert(line);
    port = line.substr(line.rfind(' ') + 1);
  }
  ASSERT_EQ(lines.size(), 3u) << run.out;
  EXPECT_GT(std::atoi(port.c_str()), 0);
  for (int r = 0; r < 3; ++r) {
    const std::string want = "[rank " + std::to_string(r) + "] env " + std::to_string(r) + " 3 " + std::to_string(r) +
                             " 3 127.0.0.1 " + port;
    EXPECT_TRUE(lines.count(want)) << "missing '" << want << "' in:\n" << run.out;
  }
}

// Each rank's CPUs by local rank, from the "cpus" mode's lines ("[rank R] cpus L c0,c1,...").
std::map<int, std::set<int>> RankCpus(const std::string& out) {
  std::map<int, std::set<int>> cpus;
  for (const std::string& line : Lines(out)) {
    const std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f.size() != 5 || f[2] != "cpus") continue;
    std::set<int>& mine = cpus[std::atoi(f[3].c_str())];
    for (const std::string& c : std::vector<std::string>(absl::StrSplit(f[4], ',', absl::SkipEmpty())))
      mine.insert(std::atoi(c.c_str()));
  }
  return cpus;
}

std::set<int> Union(const std::map<int, std::set<int>>& cpus) {
  std::set<int> all;
  for (const auto& [rank, mine] : cpus) all.insert(mine.begin(), mine.end());
  return all;
}

TEST(DtrunTest, BindsEachRankToItsOwnCpus) {
  const std::vector<int> host = dtensor::AllowedCpus();
  const std::set<int> all(host.begin(), host.end());
  if (host.size() < 2) GTEST_SKIP() << "one CPU: there is nothing to split";
  const int n = static_cast<int>(std::min<size_t>(host.size(), 4));
  RunResult run = RunDtrun({"--nproc-per-node", std::to_string(n), DTRUN_TEST_CHILD_PATH, "cpus"});
  ASSERT_EQ(run.code, 0) << run.err;
  const std::map<int, std::set<int>> cpus = RankCpus(run.out);
  ASSERT_EQ(static_cast<int>(cpus.size()), n) << run.out;
  size_t total = 0;
  for (const auto& [rank, mine] : cpus) {
    EXPECT_FALSE(mine.empty()) << "rank " << rank << ":\n" << run.out;
    EXPECT_LT(mine.size(), host.size()) << "rank " << rank << " is not bound:\n" << run.out;
    total += mine.size();
  }
  EXPECT_EQ(total, Union(cpus).size()) << "two ranks share a CPU:\n" << run.out;
  EXPECT_EQ(Union(cpus), all) << run.out;
  // Local rank order follows CPU order: rank 0 has the lowest CPU.
  EXPECT_EQ(*cpus.at(0).begin(), host.front()) << run.out;
}

TEST(DtrunTest, NoBindingWhenAsked) {
  // dtrun confined to two CPUs: 2 ranks with --cpu-bind none keep both CPUs.
  const std::vector<int> host = dtensor::AllowedCpus();
  if (host.size() < 2) GTEST_SKIP() << "one CPU";
  const std::vector<int> two = {host[0], host[1]};
  RunResult run =
      RunDtrun({"--cpu-bind", "none", "--nproc-per-node", "2", DTRUN_TEST_CHILD_PATH, "cpus"}, nullptr, two);
  ASSERT_EQ(run.code, 0) << run.err;
  const std::map<int, std::set<int>> cpus = RankCpus(run.out);
  ASSERT_EQ(cpus.size(), 2u) << run.out;
  for (const auto& [rank, mine] : cpus) {
    EXPECT_EQ(mine, std::set<int>(two.begin(), two.end())) << "rank " << rank << ":\n" << run.out;
  }
}

TEST(DtrunTest, RanksOutnumberingCpusTakeOneCpuEachInBlocks) {
  // dtrun confined to two CPUs: 3 ranks are bound 0, 0, 1 and 4 ranks 0, 0, 1, 1 (StackCpus).
  const std::vector<int> host = dtensor::AllowedCpus();
  if (host.size() < 2) GTEST_SKIP() << "one CPU";
  const std::vector<int> two = {host[0], host[1]};
  for (int n : {3, 4}) {
    RunResult run = RunDtrun({"--nproc-per-node", std::to_string(n), DTRUN_TEST_CHILD_PATH, "cpus"}, nullptr, two);
    ASSERT_EQ(run.code, 0) << run.err;
    const std::map<int, std::set<int>> cpus = RankCpus(run.out);
    ASSERT_EQ(static_cast<int>(cpus.size()), n) << run.out;
    for (const auto& [rank, mine] : cpus) {
      EXPECT_EQ(mine, std::set<int>{two[static_cast<size_t>(rank * 2 / n)]}) << "rank " << rank << ":\n" << run.out;
    }
  }
}

TEST(DtrunTest, MultiNodeRanks) {
  RunResult run = RunDtrun({"--nproc-per-node=2", "--nnodes", "3", "--node-rank", "1", "--master-addr", "10.0.0.9",
                            "--master-port", "1234", "--", DTRUN_TEST_CHILD_PATH, "env"});
  ASSERT_EQ(run.code, 0) << run.err;
  std::set<std::string> lines;
  for (const std::string& line : Lines(run.out)) lines.insert(line);
  EXPECT_EQ(lines, (std::set<std::string>{"[rank 2] env 2 6 0 2 10.0.0.9 1234", "[rank 3] env 3 6 1 2 10.0.0.9 1234"}))
      << run.out;
}

TEST(DtrunTest, PrefixesEveryLineOfStdoutAndStderr) {
  RunResult run = RunDtrun({"--nproc-per-node", "4", DTRUN_TEST_CHILD_PATH, "print"});
  ASSERT_EQ(run.code, 0) << run.err;
  std::multiset<std::string> out, err;
  for (const std::string& line : Lines(run.out)) out.insert(line);
  for (const std::string& line : Lines(run.err)) err.insert(line);
  std::multiset<std::string> want_out, want_err;
  for (int r = 0; r < 4; ++r) {
    const std::string p = "[rank " + std::to_string(r) + "] ";
    want_out.insert(p + "hello from " + std::to_string(r));
    want_out.insert(p + "partial from " + std::to_string(r));  // flushed with a newline at exit
    want_err.insert(p + "warning from " + std::to_string(r));
  }
  EXPECT_EQ(out, want_out) << run.out;
  EXPECT_EQ(err, want_err) << run.err;
  EXPECT_EQ(run.out.back(), '\n');
}

// dtrun's stdout a non-blocking pipe (as some parents hand over) whose reader starts a second
// late: every line still arrives (a review saw 39311 of 40000, exit 0: EAGAIN counted as a
// failed try and the line dropped).
TEST(DtrunTest, ANonBlockingStdoutLosesNoLine) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  ASSERT_EQ(fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK), 0);
  constexpr int kLines = 20000;
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    close(fds[1]);
    const std::string n = std::to_string(kLines);
    execl(DTRUN_PATH, DTRUN_PATH, "--nproc-per-node", "2", DTRUN_TEST_CHILD_PATH, "lines", n.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  sleep(1);
  std::string out;
  char buf[1 << 16];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    ASSERT_GT(n, 0) << strerror(errno);
    out.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::set<std::string> lines;
  for (const std::string& line : Lines(out)) lines.insert(line);
  EXPECT_EQ(lines.size(), 2u * kLines);
  EXPECT_EQ(lines.count("[rank 1] line 1 19999"), 1u);
}

TEST(DtrunTest, FailingRankStopsTheOthersAndItsCodeIsReturned) {
  TempDir dir;
  RunResult run =
      RunDtrun({"--nproc-per-node", "3", "--grace-period-s", "5", DTRUN_TEST_CHILD_PATH, "fail", "1", "7", dir.path()});
  EXPECT_EQ(run.code, 7) << run.err;
  EXPECT_LT(run.took, absl::Seconds(4)) << "sleeping ranks were not stopped promptly";
  EXPECT_NE(run.err.find("rank 1 exited with code 7"), std::string::npos) << run.err;
  const std::vector<pid_t> pids = ReadPids(dir.path(), 3);
  EXPECT_EQ(pids.size(), 3u);
  ExpectAllGone(pids);
}

TEST(DtrunTest, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
  TempDir dir;
  RunResult run = RunDtrun({"--nproc-per-node", "3", "--grace-period-s", "1", DTRUN_TEST_CHILD_PATH, "fail", "2", "3",
                            dir.path(), "ignore-term"});
  EXPECT_EQ(run.code, 3) << run.err;
  EXPECT_GE(run.took, absl::Milliseconds(1100));  // 200 ms before the failure + 1 s grace
  EXPECT_LT(run.took, absl::Seconds(5));
  const std::vector<pid_t> pids = ReadPids(dir.path(), 3);
  EXPECT_EQ(pids.size(), 3u);
  ExpectAllGone(pids);
}

TEST(DtrunTest, RankKilledBySignalGives128PlusSignal) {
  TempDir dir;
  RunResult run =
      RunDtrun({"--nproc-per-node", "2", DTRUN_TEST_CHILD_PATH, "fail", "0", std::to_string(-SIGUSR1), dir.path()});
  EXPECT_EQ(run.code, 128 + SIGUSR1) << run.err;
  EXPECT_LT(run.took, absl::Seconds(4));
  ExpectAllGone(ReadPids(dir.path(), 2));
}

TEST(DtrunTest, SigtermIsForwardedAndNoRankIsLeft) {
  TempDir dir;
  std::vector<pid_t> pids;
  RunResult run = RunDtrun({"--nproc-per-node", "3", DTRUN_TEST_CHILD_PATH, "sleep", dir.path()}, [&](pid_t dtrun) {
    ASSERT_TRUE(WaitForPids(dir.path(), 3));
    pids = ReadPids(dir.path(), 3);
    kill(dtrun, SIGTERM);
  });
  EXPECT_EQ(run.code, 128 + SIGTERM) << run.err;
  EXPECT_LT(run.took, absl::Seconds(10));
  EXPECT_EQ(pids.size(), 3u);
  ExpectAllGone(pids);
}

TEST(DtrunTest, KillingDtrunKillsTheRanks) {
  TempDir dir;
  std::vector<pid_t> pids;
  RunResult run = RunDtrun({"--nproc-per-node", "2", DTRUN_TEST_CHILD_PATH, "sleep", dir.path()}, [&](pid_t dtrun) {
    ASSERT_TRUE(WaitForPids(dir.path(), 2));
    pids = ReadPids(dir.path(), 2);
    kill(dtrun, SIGKILL);  // no chance to clean up: PR_SET_PDEATHSIG must do it
  });
  EXPECT_EQ(run.code, 128 + SIGKILL);
  EXPECT_EQ(pids.size(), 2u);
  ExpectAllGone(pids);
}

// What a rank starts in the background goes with it: here rank 0 exits 0 and rank 1 exits 3,
// each leaving a sleep behind in its process group.
TEST(DtrunTest, ProcessesRanksLeaveBehindAreKilled) {
  TempDir dir;
  RunResult run = RunDtrun(
      {"--nproc-per-node", "2", "/bin/sh", "-c",
       "sleep 300 & echo $! > " + dir.path() + "/$LOCAL_RANK.pid; if [ $LOCAL_RANK = 1 ]; then sleep 0.2; exit 3; fi"});
  EXPECT_EQ(run.code, 3) << run.err;
  EXPECT_LT(run.took, absl::Seconds(5)) << run.err;
  const std::vector<pid_t> pids = ReadPids(dir.path(), 2);
  EXPECT_EQ(pids.size(), 2u);
  ExpectAllGone(pids);
}

TEST(DtrunTest, RanksReadDevNullAsStdin) {
  RunResult run = RunDtrun({"--nproc-per-node", "2", "/bin/sh", "-c", "readlink /proc/self/fd/0"});
  EXPECT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("[rank 0] /dev/null"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("[rank 1] /dev/null"), std::string::npos) << run.out;
}

// Rank 0's store holds a connection per rank: dtrun raises the soft RLIMIT_NOFILE its ranks
// inherit to world + 2 x local ranks + 256 (here 3 + 6 + 256) when it is lower.
TEST(DtrunTest, RaisesALowOpenFileLimitForItsRanks) {
  const std::string inner =
      absl::StrCat("ulimit -Sn 100 && exec ", DTRUN_PATH, " --nproc-per-node 3 /bin/sh -c 'ulimit -Sn'");
  RunResult run = dtensor::testing::RunProcess({"/bin/sh", "-c", inner});
  if (run.code != 0 && run.err.find("ulimit") != std::string::npos)
    GTEST_SKIP() << "cannot lower the limit: " << run.err;
  EXPECT_EQ(run.code, 0) << run.err;
  for (int r = 0; r < 3; ++r) EXPECT_NE(run.out.find(absl::StrCat("[rank ", r, "] 265")), std::string::npos) << run.out;
}

TEST(DtrunTest, UsageErrorsExitWith2) {
  const std::vector<std::vector<std::string>> bad = {
      {},
      {DTRUN_TEST_CHILD_PATH},                            // no --nproc-per-node
      {"--nproc-per-node", "2"},                          // no program
      {"--nproc-per-node", "0", DTRUN_TEST_CHILD_PATH},   // bad count
      {"--nproc-per-node", "x", DTRUN_TEST_CHILD_PATH},   //
      {"--nproc-per-node", "1", "--bogus", "1", "prog"},  // unknown option
      {"--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "prog"},
      {"--nproc-per-node", "1", "--master-port", "99999", "prog"},
      {"--nproc-per-node", "1", "--cpu-bind", "core", "prog"},
      {"--nproc-per-node"},  // missing value
  };
  for (const auto& args : bad) {
    RunResult run = RunDtrun(args);
    EXPECT_EQ(run.code, 2) << testing::PrintToString(args);
    EXPECT_NE(run.err.find("usage: dtrun"), std::string::npos) << run.err;
  }
  EXPECT_EQ(RunDtrun({"--help"}).code, 0);
}

TEST(DtrunTest, MissingProgramGives127) {
  RunResult run = RunDtrun({"--nproc-per-node", "2", "/nonexistent/program"});
  EXPECT_EQ(run.code, 127);
  EXPECT_NE(run.err.find("] dtrun: cannot execute /nonexistent/program"), std::string::npos) << run.err;
}

TEST(DtrunTest, StoreRendezvousAcrossFourProcesses) {
  RunResult run = RunDtrun({"--nproc-per-node", "4", DTRUN_TEST_CHILD_PATH, "store"});
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  std::set<std::string> lines;
  for (const std::string& line : Lines(run.out)) lines.insert(line);
  EXPECT_EQ(lines, (std::set<std::string>{"[rank 0] counter 4", "[rank 1] counter 4", "[rank 2] counter 4",
                                          "[rank 3] counter 4"}))
      << run.out << run.err;
}

// dtrun gives every rank a fresh secret (64 hex digits), rank 0 the store's socket, and the
// store admits only the ranks: rank 1's intruders (a wrong secret, none) are refused.
TEST(DtrunTest, JobStoreIsAuthenticatedAndRefusesIntruders) {
  RunResult run = RunDtrun({"--nproc-per-node", "3", DTRUN_TEST_CHILD_PATH, "auth"});
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  std::set<std::string> lines;
  for (const std::string& line : Lines(run.out)) lines.insert(line);
  EXPECT_EQ(lines, (std::set<std::string>{"[rank 0] auth 0 64 1 1", "[rank 1] auth 1 64 1 0", "[rank 2] auth 2 64 1 0",
                                          "[rank 1] intruders PERMISSION_DENIED UNAUTHENTICATED", "[rank 0] counter 3",
                                          "[rank 1] counter 3", "[rank 2] counter 3"}))
      << run.out << run.err;
  EXPECT_NE(run.err.find("refused the client at 127.0.0.1:"), std::string::npos) << run.err;
  EXPECT_EQ(run.err.find("unauthenticated"), std::string::npos) << run.err;
}

// A secret in dtrun's environment (the same on every node of a multi-node job) is passed on.
TEST(DtrunTest, GivenSecretIsPassedOn) {
  RunResult run = dtensor::testing::RunProcess({DTRUN_PATH, "--nproc-per-node", "2", DTRUN_TEST_CHILD_PATH, "auth"},
                                               {.env = {"DTENSOR_STORE_SECRET=" + std::string(20, 'z')}});
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_NE(run.out.find("[rank 0] auth 0 20 1 1"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("[rank 1] auth 1 20 1 0"), std::string::npos) << run.out;
}

// dtrun binds the store's port before it starts the ranks, so jobs started at the same moment
// cannot take each other's port (they did when dtrun only picked a free port for rank 0 to bind
// later). Several rounds of four simultaneous jobs.
TEST(DtrunTest, SimultaneousJobsNeverCollideOnTheStorePort) {
  constexpr int kRounds = 5, kJobs = 4;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<RunResult> runs(kJobs);
    std::vector<std::thread> threads;
    for (int j = 0; j < kJobs; ++j) {
      threads.emplace_back([&runs, j] {
        runs[j] = RunDtrun({"--cpu-bind", "none", "--nproc-per-node", "2", DTRUN_TEST_CHILD_PATH, "store"});
      });
    }
    for (auto& t : threads) t.join();
    for (int j = 0; j < kJobs; ++j) {
      EXPECT_EQ(runs[j].code, 0) << "round " << round << " job " << j << ":\n" << runs[j].out << runs[j].err;
      EXPECT_NE(runs[j].out.find("[rank 1] counter 2"), std::string::npos) << runs[j].out;
    }
  }
}

// A port that is taken fails the job at once, before any rank starts, naming the port.
TEST(DtrunTest, TakenMasterPortFailsBeforeStartingRanks) {
  auto held = dtensor::ListenForStore("127.0.0.1", 0);
  ASSERT_TRUE(held.ok()) << held.status();
  TempDir dir;
  RunResult run = RunDtrun({"--nproc-per-node", "2", "--master-port", std::to_string(held->port), DTRUN_TEST_CHILD_PATH,
                            "sleep", dir.path()});
  close(held->fd);
  EXPECT_EQ(run.code, 1) << run.out << run.err;
  EXPECT_NE(run.err.find("cannot listen on 127.0.0.1:" + std::to_string(held->port)), std::string::npos) << run.err;
  EXPECT_TRUE(ReadPids(dir.path(), 2).empty()) << "a rank started";
}

}  // namespace
