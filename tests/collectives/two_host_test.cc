// The ucx backend across two "hosts": two network namespaces on this machine joined by a veth
// pair (scripts/netns_two_hosts.sh), each with its own hostname, one dtrun per namespace
// (--nnodes 2), the store on node 0's veth address, and UCX on its TCP transport over the veth.
// Checks the whole ucx_test_child battery on 1 and 2 ranks per node (and that its traffic really
// crossed the veth), a rank dying mid-collective on the other host, and the other host's dtrun
// being killed mid-run: errors within bounded time, never a hang. Skipped, with the reason, where
// namespaces cannot be made (not root, no iproute2, no CAP_SYS_ADMIN, ...). Every process and
// namespace is removed at the end, also when a check fails.
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dtensor/collectives/store/tcp_store.h"
#include "gtest/gtest.h"
#include "tests/testing/run_process.h"
#include "tests/testing/test_util.h"

#if defined(UCX_TEST_CHILD_PATH) && defined(DTRUN_PATH) && defined(NETNS_TWO_HOSTS_SCRIPT)

namespace {

constexpr char kMasterAddr[] = "10.231.7.1";  // node 0's veth address (see the script)
constexpr char kMasterPort[] = "29517";       // the namespaces are fresh: nothing else listens there

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A child process in its own process group, stdout and stderr going to files.
class Process {
 public:
  Process(const std::vector<std::string>& args, const std::vector<std::string>& env, const std::string& out_path,
          const std::string& err_path)
      : out_path_(out_path), err_path_(err_path), start_(absl::Now()) {
    std::vector<std::string> argv_s = args;
    std::vector<char*> argv;
    for (std::string& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with the test, even if the test is killed
      for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
      const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      dup2(out, 1);
      dup2(err, 2);
      execv(argv[0], argv.data());
      _exit(127);
    }
    if (pid_ > 0) setpgid(pid_, pid_);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() { Kill(); }

  // Waits until the process exits or `deadline`; true if it exited.
  bool Wait(absl::Time deadline) {
    while (running()) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        code_ = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        exited_ = true;
        took_ = absl::Now() - start_;
        break;
      }
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return exited_;
  }
  // SIGKILL to the whole process group (dtrun's ranks die with it through PR_SET_PDEATHSIG).
  void Kill() {
    if (!running()) return;
    kill(-pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  bool running() const { return pid_ > 0 && !exited_; }
  bool exited() const { return exited_; }
  int code() const { return code_; }  // exit code or 128 + signal; -1 if it did not exit itself
  absl::Duration took() const { return took_; }
  std::string out() const { return dtensor::testing::ReadBytes(out_path_); }
  std::string err() const { return dtensor::testing::ReadBytes(err_path_); }

 private:
  std::string out_path_, err_path_;
  absl::Time start_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int code_ = -1;
  absl::Duration took_;
};

// Runs a short command to completion (at most `limit`, then killed): exit code and stdout+stderr.
std::pair<int, std::string> RunCommand(const std::vector<std::string>& args, const std::string& dir,
                                       absl::Duration limit = absl::Seconds(30)) {
  Process p(args, {}, dir + "/cmd_out", dir + "/cmd_err");
  if (!p.Wait(absl::Now() + limit)) {
    p.Kill();
    return {-1, absl::StrCat("timed out after ", absl::FormatDuration(limit), ": ", p.out(), p.err())};
  }
  return {p.code(), p.out() + p.err()};
}

// The two namespaces of one test, and everything started in them; the destructor kills the
// processes and removes the namespaces, whatever happened.
class TwoHosts {
 public:
  TwoHosts() {
    static int serial = 0;
    tag_ = absl::StrCat(getpid() % 10000000, std::string(1, static_cast<char>('a' + serial++ % 26)));
  }
  TwoHosts(const TwoHosts&) = delete;
  TwoHosts& operator=(const TwoHosts&) = delete;
  ~TwoHosts() {
    procs_.clear();  // kills what still runs
    if (up_) {
      auto [code, out] = RunCommand({"/bin/bash", NETNS_TWO_HOSTS_SCRIPT, "down", tag_}, dir_);
      EXPECT_EQ(code, 0) << "removing the namespaces: " << out;
    }
  }

  // Makes the namespaces. Returns "" when done, else why they cannot be made here (then the test
  // skips); a failure of the script for any other reason fails the test. The tag starts with
  // our pid: `up` also removes namespaces left by a test process that was killed.
  std::string Up() {
    if (dir_.empty()) return "cannot make a temporary directory";
    if (access("/bin/bash", X_OK) != 0) return "cannot make network namespaces: no /bin/bash";
    up_ = true;  // `down` is harmless if `up` made nothing
    auto [code, out] = RunCommand({"/bin/bash", NETNS_TWO_HOSTS_SCRIPT, "up", tag_}, dir_);
    if (code == 77) return std::string(absl::StripTrailingAsciiWhitespace(out));
    EXPECT_EQ(code, 0) << out;
    return code == 0 ? "" : absl::StrCat("netns_two_hosts.sh up failed: ", out);
  }

  // Starts `dtrun --nnodes 2 --node-rank node ...` in namespace `node` with UCX on TCP over the
  // veth (with `pin_veth` false the ranks choose UCX's interfaces themselves).
  Process& StartNode(int node, int nproc, const std::string& mode, bool pin_veth = true) {
    const std::string n = std::to_string(node);
    std::vector<std::string> args = {"/bin/bash", NETNS_TWO_HOSTS_SCRIPT, "exec", tag_, n, DTRUN_PATH};
    args.insert(args.end(), {"--nnodes", "2", "--node-rank", n, "--nproc-per-node", std::to_string(nproc)});
    args.insert(args.end(), {"--master-addr", kMasterAddr, "--master-port", kMasterPort, "--grace-period-s", "2"});
    args.insert(args.end(), {UCX_TEST_CHILD_PATH, mode});
    // Between the hosts only TCP is reachable anyway (different hostnames give peer-failure
    // endpoints); UCX_TLS and UCX_NET_DEVICES make sure it is TCP over the veth, not loopback.
    std::vector<std::string> env = {"UCX_TLS=tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS=n", "DTENSOR_TIMEOUT_S=20",
                                    // Both nodes' dtrun pass the job's secret on: an authenticated store.
                                    absl::StrCat(dtensor::kStoreSecretEnv, "=", secret_)};
    env.push_back(pin_veth ? absl::StrCat("UCX_NET_DEVICES=dtv", node, "_", tag_) : "DTENSOR_UCX_INFO=1");
    procs_.push_back(std::make_unique<Process>(args, env, absl::StrCat(dir_, "/out", node, "_", procs_.size()),
                                               absl::StrCat(dir_, "/err", node, "_", procs_.size())));
    return *procs_.back();
  }

  // Bytes node `node` has sent over its veth end so far, or -1.
  int64_t TxBytes(int node) {
    auto [code, out] = RunCommand({"/bin/bash", NETNS_TWO_HOSTS_SCRIPT, "txbytes", tag_, std::to_string(node)}, dir_);
    int64_t bytes = -1;
    if (code != 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(out), &bytes)) return -1;
    return bytes;
  }

 private:
  std::string tag_;
  const std::string secret_ = dtensor::NewStoreSecret().value_or("");
  dtensor::testing::ScopedTempDir temp_{"two_host_test"};  // removed after the destructor's body
  const std::string& dir_ = temp_.path();
  bool up_ = false;
  std::vector<std::unique_ptr<Process>> procs_;
};

#define MAKE_TWO_HOSTS_OR_SKIP(hosts)                     \
  TwoHosts hosts;                                         \
  if (const std::string why = hosts.Up(); !why.empty()) { \
    if (!HasFailure()) GTEST_SKIP() << why;               \
    return;                                               \
  }

class TwoHostBatteryTest : public testing::TestWithParam<int> {};

TEST_P(TwoHostBatteryTest, EveryCollectiveMatchesItsReference) {
  const int nproc = GetParam();
  MAKE_TWO_HOSTS_OR_SKIP(hosts);
  const int64_t tx0 = hosts.TxBytes(0), tx1 = hosts.TxBytes(1);
  Process& node0 = hosts.StartNode(0, nproc, "battery");
  Process& node1 = hosts.StartNode(1, nproc, "battery");
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  ASSERT_TRUE(node0.Wait(deadline)) << "node 0 hung: " << node0.out() << node0.err();
  ASSERT_TRUE(node1.Wait(deadline)) << "node 1 hung: " << node1.out() << node1.err();
  EXPECT_EQ(node0.code(), 0) << node0.out() << node0.err();
  EXPECT_EQ(node1.code(), 0) << node1.out() << node1.err();
  for (int r = 0; r < 2 * nproc; ++r) {
    const std::string out = r < nproc ? node0.out() : node1.out();
    EXPECT_TRUE(Contains(out, absl::StrCat("[rank ", r, "] ")) && Contains(out, " checks, 0 failures"))
        << "rank " << r << ": " << out;
  }
  EXPECT_FALSE(Contains(node0.err() + node1.err(), "FAIL")) << node0.err() << node1.err();
  // The battery moves tens of MB between the hosts; all of it must have crossed the veth.
  EXPECT_GT(hosts.TxBytes(0) - tx0, int64_t{1} << 20);
  EXPECT_GT(hosts.TxBytes(1) - tx1, int64_t{1} << 20);
  std::printf("2 nodes x %d ranks: %.2f s\n", nproc, absl::ToDoubleSeconds(node0.took()));
}

INSTANTIATE_TEST_SUITE_P(RanksPerNode, TwoHostBatteryTest, testing::Values(1, 2),
                         [](const testing::TestParamInfo<int>& info) { return absl::StrCat("P", info.param); });

// Left to choose, the ranks of a two-host job listen only on the interface that reaches the
// other host (the veth): not on loopback, where UCX's TCP transport also listens by default.
TEST(TwoHostListenTest, RanksListenOnlyOnTheInterfaceToTheOtherHost) {
  MAKE_TWO_HOSTS_OR_SKIP(hosts);
  Process& node0 = hosts.StartNode(0, 2, "listening", /*pin_veth=*/false);
  Process& node1 = hosts.StartNode(1, 2, "listening", /*pin_veth=*/false);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  ASSERT_TRUE(node0.Wait(deadline)) << "node 0 hung: " << node0.out() << node0.err();
  ASSERT_TRUE(node1.Wait(deadline)) << "node 1 hung: " << node1.out() << node1.err();
  ASSERT_EQ(node0.code(), 0) << node0.out() << node0.err();
  ASSERT_EQ(node1.code(), 0) << node1.out() << node1.err();
  EXPECT_TRUE(Contains(node0.err(), "[rank 0] dtensor ucx: network interfaces: dtv0_")) << node0.err();
  for (int r = 0; r < 4; ++r) {
    const std::string veth = r < 2 ? "10.231.7.1:" : "10.231.7.2:";
    const std::vector<std::string> addrs =
        dtensor::testing::LinesAfter(r < 2 ? node0.out() : node1.out(), absl::StrCat("[rank ", r, "] listening "));
    ASSERT_FALSE(addrs.empty() || addrs.back() != "done") << "rank " << r << ": " << node0.out() << node1.out();
    EXPECT_GE(addrs.size(), 2u) << "rank " << r << " has no UCX listener: " << node0.out() << node1.out();
    for (size_t i = 0; i + 1 < addrs.size(); ++i) {
      EXPECT_EQ(addrs[i].rfind(veth, 0), 0u) << "rank " << r << " listens on " << addrs[i];
    }
  }
}

TEST(TwoHostFailureTest, DeadPeerOnOtherHostGivesUnavailable) {
  // Rank 1 (node 1) exits with code 9 while rank 0 (node 0) is inside a 4 MiB AllReduce. The
  // hosts differ, so rank 0 cannot watch rank 1's process: UCX's TCP endpoint must report it.
  MAKE_TWO_HOSTS_OR_SKIP(hosts);
  Process& node0 = hosts.StartNode(0, 1, "dead-peer");
  Process& node1 = hosts.StartNode(1, 1, "dead-peer");
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  ASSERT_TRUE(node1.Wait(deadline)) << "node 1 hung: " << node1.out() << node1.err();
  ASSERT_TRUE(node0.Wait(deadline)) << "node 0 hung: " << node0.out() << node0.err();
  EXPECT_EQ(node1.code(), 9) << node1.out() << node1.err();
  EXPECT_EQ(node0.code(), 0) << node0.out() << node0.err();
  EXPECT_TRUE(Contains(node0.out(), "[rank 0] dead-peer after ")) << node0.out() << node0.err();
  EXPECT_TRUE(Contains(node0.out(), "UNAVAILABLE: [AllReduce] rank 0: peer rank 1")) << node0.out();
  EXPECT_LT(node0.took(), absl::Seconds(15)) << node0.out() << node0.err();
}

TEST(TwoHostFailureTest, KilledNodeMidRunFailsTheOtherNode) {
  // Node 1's dtrun is killed (SIGKILL; its rank dies with it) once the ranks are exchanging
  // data; node 0's rank must fail its collectives and exit non-zero, in bounded time.
  MAKE_TWO_HOSTS_OR_SKIP(hosts);
  const int64_t tx1 = hosts.TxBytes(1);
  Process& node0 = hosts.StartNode(0, 1, "bench");
  Process& node1 = hosts.StartNode(1, 1, "bench");
  const absl::Time busy_by = absl::Now() + absl::Seconds(30);
  while (hosts.TxBytes(1) - tx1 < (int64_t{4} << 20) && node1.running() && absl::Now() < busy_by) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(node1.running()) << "node 1 ended before it could be killed: " << node1.out() << node1.err();
  ASSERT_GE(hosts.TxBytes(1) - tx1, int64_t{4} << 20) << "no traffic: " << node1.out() << node1.err();
  node1.Kill();
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(node0.Wait(killed + absl::Seconds(30))) << "node 0 hung: " << node0.out() << node0.err();
  EXPECT_NE(node0.code(), 0) << node0.out() << node0.err();
  EXPECT_LT(absl::Now() - killed, absl::Seconds(25)) << node0.out() << node0.err();
}

}  // namespace

#else

TEST(TwoHostTest, NotBuilt) { GTEST_SKIP() << "the ucx backend, dtrun or scripts/netns_two_hosts.sh is not built"; }

#endif
