// The ucx backend end to end: runs collectives/ucx/ucx_test_child under the real launcher on 2, 3
// and 4 processes (every collective, dtype and size class checked against references the child
// computes itself), and checks that a dead peer and a stalled peer give errors, not hangs.
#include <ifaddrs.h>
#include <linux/membarrier.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/collectives/store/cpus.h"
#include "gtest/gtest.h"
#include "tests/testing/run_process.h"

#if defined(UCX_TEST_CHILD_PATH) && defined(DTRUN_PATH)

namespace {

using dtensor::AllowedCpus;
using dtensor::CoreKeys;
using dtensor::FormatCpuList;
using dtensor::SplitCpus;

using dtensor::testing::ProcessRun;
using RunResult = ProcessRun;

// Runs dtrun with `args` and extra environment `env` ("NAME=value"; the settings that pick
// paths start unset, whatever the test's own environment says); with `cpus` dtrun may use only
// those CPUs. Killed after 60 s.
RunResult RunDtrun(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                   const std::vector<int>& cpus = {}) {
  std::vector<std::string> argv = {DTRUN_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  return dtensor::testing::RunProcess(
      argv, {.env = env,
             .unset = {"DTENSOR_UCX_SHM", "DTENSOR_UCX_CMA", "DTENSOR_UCX_CMA_MIN", "DTENSOR_DEBUG", "DTENSOR_UCX_INFO",
                       "DTENSOR_TIMEOUT_S", "DTENSOR_UCX_ZERO_COPY", "DTENSOR_UCX_STREAMING"},
             .cpus = cpus});
}

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The test's first two CPUs, or nothing on a one-CPU host.
std::vector<int> FirstTwoCpus() {
  const std::vector<int> cpus = AllowedCpus();
  return cpus.size() < 2 ? std::vector<int>{} : std::vector<int>{cpus[0], cpus[1]};
}

// (ranks, extra environment, name): the shared-memory channel (the default on one host), UCX
// alone (DTENSOR_UCX_SHM=0, the path between hosts), the debug mode's call checks, and the
// shared-memory channel with every block read from the peers' memory (DTENSOR_UCX_CMA_MIN=0)
// or none (DTENSOR_UCX_CMA=0: every byte through the slots), single copy through the
// kernel only (DTENSOR_UCX_ZERO_COPY=0: no tensor in a shared block), and every byte through
// the slots written with streaming stores (DTENSOR_UCX_STREAMING=1, see ShmGroup::CopyIn).
struct BatteryCase {
  int ranks;
  std::vector<std::string> env;
  std::string name;
};

void PrintTo(const BatteryCase& c, std::ostream* os) { *os << c.name; }

class UcxBatteryTest : public testing::TestWithParam<BatteryCase> {};

TEST_P(UcxBatteryTest, EveryCollectiveMatchesItsReference) {
  const int n = GetParam().ranks;
  RunResult run = RunDtrun({"--nproc-per-node", std::to_string(n), UCX_TEST_CHILD_PATH, "battery"}, GetParam().env);
  EXPECT_EQ(run.code, 0) << run.out << run.err;
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(Contains(run.out, absl::StrCat("[rank ", r, "] ")) && Contains(run.out, " checks, 0 failures"))
        << run.out << run.err;
  }
  EXPECT_FALSE(Contains(run.err, "FAIL")) << run.err;
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, UcxBatteryTest,
    testing::Values(BatteryCase{1, {}, "P1"}, BatteryCase{2, {}, "P2"}, BatteryCase{3, {}, "P3"},
                    BatteryCase{4, {}, "P4"}, BatteryCase{2, {"DTENSOR_UCX_SHM=0"}, "P2NoShm"},
                    BatteryCase{3, {"DTENSOR_UCX_SHM=0"}, "P3NoShm"}, BatteryCase{4, {"DTENSOR_UCX_SHM=0"}, "P4NoShm"},
                    BatteryCase{3, {"DTENSOR_DEBUG=1"}, "P3Debug"},
                    BatteryCase{2, {"DTENSOR_UCX_CMA_MIN=0"}, "P2AllSingleCopy"},
                    BatteryCase{3, {"DTENSOR_UCX_CMA_MIN=0"}, "P3AllSingleCopy"},
                    BatteryCase{2, {"DTENSOR_UCX_ZERO_COPY=0"}, "P2NoZeroCopy"},
                    BatteryCase{3, {"DTENSOR_UCX_ZERO_COPY=0"}, "P3NoZeroCopy"},
                    BatteryCase{2, {"DTENSOR_UCX_CMA=0"}, "P2SlotsOnly"},
                    BatteryCase{4, {"DTENSOR_UCX_CMA=0"}, "P4SlotsOnly"},
                    BatteryCase{2, {"DTENSOR_UCX_CMA=0", "DTENSOR_UCX_STREAMING=1"}, "P2Streaming"},
                    BatteryCase{4, {"DTENSOR_UCX_CMA=0", "DTENSOR_UCX_STREAMING=1"}, "P4Streaming"}),
    [](const testing::TestParamInfo<BatteryCase>& info) { return info.param.name; });

// A setting on odd ranks only (ranks, setting, environment of all ranks, name): every input to
// a path choice is agreed at setup, so the battery passes however the ranks' own answers
// differ: single copy refused (DTENSOR_UCX_CMA=0) or its threshold moved (DTENSOR_UCX_CMA_MIN)
// on some ranks, the shared-memory channel refused on some (DTENSOR_UCX_SHM=0), tensors in
// shared blocks on some ranks only (DTENSOR_UCX_ZERO_COPY=0 on the others), the debug
// checks asked for by some (DTENSOR_DEBUG=1: then every rank makes them), some ranks writing
// the slots with streaming stores (a local choice: DTENSOR_UCX_STREAMING=1), or some ranks
// moved onto rank 0's CPU (the ranks then share CPUs, which picks other all-reduce paths).
struct MixedCase {
  int ranks;
  std::string setting;
  std::vector<std::string> env;
  std::string name;
  bool two_cpus = false;  // dtrun confined to the test's first two CPUs (one-cpu then shares)
};

void PrintTo(const MixedCase& c, std::ostream* os) { *os << c.name; }

class UcxMixedTest : public testing::TestWithParam<MixedCase> {};

TEST_P(UcxMixedTest, RanksThatDisagreeTakeOnePath) {
  const MixedCase& c = GetParam();
  std::vector<std::string> env = c.env;
  env.push_back("DTENSOR_TIMEOUT_S=20");
  RunResult run =
      RunDtrun({"--nproc-per-node", std::to_string(c.ranks), UCX_TEST_CHILD_PATH, "battery-mixed", c.setting}, env,
               c.two_cpus ? FirstTwoCpus() : std::vector<int>{});
  EXPECT_EQ(run.code, 0) << run.out << run.err;
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_TRUE(Contains(run.out, absl::StrCat("[rank ", r, "] ")) && Contains(run.out, " checks, 0 failures"))
        << run.out << run.err;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Settings, UcxMixedTest,
    testing::Values(MixedCase{3, "DTENSOR_UCX_CMA=0", {"DTENSOR_UCX_CMA_MIN=0"}, "SingleCopyRefused"},
                    MixedCase{3, "DTENSOR_UCX_CMA_MIN=0", {}, "SingleCopyThreshold"},
                    MixedCase{3, "DTENSOR_UCX_SHM=0", {}, "SharedMemoryRefused"},
                    MixedCase{3, "DTENSOR_DEBUG=1", {}, "DebugOnSome"},
                    MixedCase{3, "DTENSOR_UCX_ZERO_COPY=0", {}, "ZeroCopyOnSome"},
                    MixedCase{3, "DTENSOR_UCX_STREAMING=1", {"DTENSOR_UCX_CMA=0"}, "StreamingOnSome"},
                    MixedCase{2, "one-cpu", {}, "SharingCores", true}),
    [](const testing::TestParamInfo<MixedCase>& info) { return info.param.name; });

// Zero copy: with it on (the default) every rank's large tensors are in shared blocks that
// the peers map (checked in /proc/self/maps), and blocks their owner gives back are unmapped
// by the peers at their next call; with DTENSOR_UCX_ZERO_COPY=0 nothing is shared or mapped.
// Results are checked in every case.
TEST(UcxZeroCopyTest, PeersMapEachOthersBlocksAndDropReleasedOnes) {
  for (int n : {2, 3, 4}) {
    RunResult run = RunDtrun({"--nproc-per-node", std::to_string(n), UCX_TEST_CHILD_PATH, "zero-copy", "on"}, {});
    EXPECT_EQ(run.code, 0) << n << " ranks\n" << run.out << run.err;
    EXPECT_TRUE(Contains(run.out, " checks, 0 failures")) << run.out << run.err;
  }
}

TEST(UcxZeroCopyTest, OffMapsNothing) {
  RunResult run =
      RunDtrun({"--nproc-per-node", "2", UCX_TEST_CHILD_PATH, "zero-copy", "off"}, {"DTENSOR_UCX_ZERO_COPY=0"});
  EXPECT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_TRUE(Contains(run.out, " checks, 0 failures")) << run.out << run.err;
}

// Calls whose sizes disagree between ranks (no DTENSOR_DEBUG): a single-copy read past a
// peer's buffer is InvalidArgument naming the sizes (it read the peer's neighbouring memory,
// or faulted past a mapped block), and the other ranks get an error too; nobody hangs.
TEST(UcxZeroCopyTest, RanksThatDisagreeOnSizesGetAnErrorNotAStrayRead) {
  for (const char* zero_copy : {"DTENSOR_UCX_ZERO_COPY=1", "DTENSOR_UCX_ZERO_COPY=0"}) {
    for (int n : {2, 3}) {
      RunResult run =
          RunDtrun({"--nproc-per-node", std::to_string(n), UCX_TEST_CHILD_PATH, "size-mismatch"}, {zero_copy});
      EXPECT_EQ(run.code, 0) << zero_copy << ", " << n << " ranks\n" << run.out << run.err;
      EXPECT_TRUE(Contains(run.out, "[rank 0] AllGather: INVALID_ARGUMENT")) << run.out << run.err;
    }
  }
}

// Ranks that wait long enough sleep on the late rank's futex word; it must wake them. With a
// CPU each (2 ranks bound by dtrun) arrivals are light (membarrier on the sleepers' side); 3
// ranks on 2 CPUs fence.
TEST(UcxWaitTest, LateRanksWakeTheirWaiters) {
  for (int n : {2, 3}) {
    RunResult run = RunDtrun({"--nproc-per-node", std::to_string(n), UCX_TEST_CHILD_PATH, "late-ranks"});
    EXPECT_EQ(run.code, 0) << n << " ranks\n" << run.out << run.err;
    EXPECT_TRUE(Contains(run.out, "[rank 0] 72 checks, 0 failures")) << run.out << run.err;
  }
}

// DTENSOR_UCX_INFO=1: rank 0 prints the paths the ranks agreed on. The CPU affinity decides
// whether the ranks spin (a CPU each) or give the CPU up at once (they share): dtrun binds
// ranks to a CPU each when there are enough, and the ranks compare their affinity masks.
const std::string kInfo = "[rank 0] dtensor ucx: communicator 0, ";

std::string InfoLine(const RunResult& run) {
  const size_t at = run.err.find(kInfo);
  return at == std::string::npos ? "" : run.err.substr(at, run.err.find('\n', at) - at);
}

// dtrun confined to two CPUs (on any host: so that the expected lines are known).
TEST(UcxInfoTest, RanksBoundByDtrunHaveACpuEach) {
  const std::vector<int> two = FirstTwoCpus();
  if (two.empty()) GTEST_SKIP() << "one CPU";
  RunResult run = RunDtrun({"--nproc-per-node", "2", UCX_TEST_CHILD_PATH, "setup"}, {"DTENSOR_UCX_INFO=1"}, two);
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  const std::string line = InfoLine(run);
  EXPECT_TRUE(Contains(line, "2 ranks on one host: shared memory, single copy ")) << run.err;
  // Single copy needs ptrace rights over the peer (Yama ptrace_scope, containers): either form.
  EXPECT_TRUE(Contains(line, "single copy from 16384 B blocks,") || Contains(line, "single copy off,")) << run.err;
  EXPECT_TRUE(Contains(line, absl::StrCat(", a CPU per rank (cpus ", two[0], " | ", two[1], ")"))) << run.err;
  // Arrivals without a fence need membarrier's global barrier (Linux 4.16+, not refused):
  // registering this process for it tells whether the ranks could.
  const long cmds = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  const long need = MEMBARRIER_CMD_GLOBAL_EXPEDITED | MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED;
  const bool barrier = cmds >= 0 && (cmds & need) == need &&
                       syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) == 0;
  EXPECT_TRUE(Contains(line, barrier ? "), light arrivals" : "), fenced arrivals")) << run.err;
}

TEST(UcxInfoTest, UnboundRanksSeeEveryCpu) {
  const std::vector<int> two = FirstTwoCpus();
  if (two.empty()) GTEST_SKIP() << "one CPU";
  RunResult run = RunDtrun({"--cpu-bind", "none", "--nproc-per-node", "2", UCX_TEST_CHILD_PATH, "setup"},
                           {"DTENSOR_UCX_INFO=1"}, two);
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  const std::string both = FormatCpuList(two);
  EXPECT_TRUE(Contains(InfoLine(run), absl::StrCat(", a CPU per rank (cpus ", both, " | ", both, ")"))) << run.err;
}

TEST(UcxInfoTest, MoreRanksThanCpusShare) {
  const std::vector<int> two = FirstTwoCpus();
  if (two.empty()) GTEST_SKIP() << "one CPU";
  RunResult run = RunDtrun({"--nproc-per-node", "3", UCX_TEST_CHILD_PATH, "setup"}, {"DTENSOR_UCX_INFO=1"}, two);
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  const std::string line = InfoLine(run);
  EXPECT_TRUE(Contains(line, "3 ranks on one host: shared memory, single copy ")) << run.err;
  EXPECT_TRUE(Contains(line, "single copy from 131072 B blocks,") || Contains(line, "single copy off,")) << run.err;
  EXPECT_TRUE(Contains(line, ", ranks share CPUs (cpus ")) << run.err;
  EXPECT_TRUE(Contains(line, "), fenced arrivals")) << run.err;  // they sleep at almost every wait
}

TEST(UcxInfoTest, ARankMovedOntoAnothersCpuShares) {
  const std::vector<int> two = FirstTwoCpus();
  if (two.empty()) GTEST_SKIP() << "one CPU";
  RunResult run =
      RunDtrun({"--nproc-per-node", "2", UCX_TEST_CHILD_PATH, "setup-mixed", "one-cpu"}, {"DTENSOR_UCX_INFO=1"}, two);
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_TRUE(Contains(InfoLine(run), absl::StrCat(", ranks share CPUs (cpus ", two[0], " | ", two[0], ")")))
      << run.err;
}

TEST(UcxInfoTest, WithoutTheChannel) {
  RunResult run =
      RunDtrun({"--nproc-per-node", "2", UCX_TEST_CHILD_PATH, "setup"}, {"DTENSOR_UCX_INFO=1", "DTENSOR_UCX_SHM=0"});
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_EQ(InfoLine(run),
            absl::StrCat(kInfo, "2 ranks: over UCX only (ranks on several hosts, more than 64, or DTENSOR_UCX_SHM=0)"))
      << run.err;
}

// /dev/shm too small for the channel's segment (a container's default 64 MiB fills up the same
// way): the ranks say so and run the battery over UCX (here its TCP transport, which does not
// use /dev/shm), where stores into pages that could not be allocated would have been SIGBUS.
TEST(UcxInfoTest, FullDevShmWarnsAndGoesOverUcx) {
  const std::string small_shm =
      "unshare -m /bin/sh -c 'mount -t tmpfs -o size=1m dtensor-test /dev/shm && exec \"$@\"' sh";
  const RunResult probe = dtensor::testing::RunProcess({"/bin/sh", "-c", small_shm + " true"});
  if (probe.code != 0) {
    GTEST_SKIP() << "cannot mount a small /dev/shm in a mount namespace of its own (needs root): " << probe.err;
  }
  std::vector<std::string> argv = {"/bin/sh",          "-c", small_shm + " \"$@\"", "sh",     DTRUN_PATH,
                                   "--nproc-per-node", "2",  UCX_TEST_CHILD_PATH,   "battery"};
  const RunResult run = dtensor::testing::RunProcess(
      argv, {.env = {"DTENSOR_UCX_INFO=1", "UCX_TLS=tcp,self"}, .unset = {"DTENSOR_UCX_SHM", "DTENSOR_UCX_CMA"}});
  EXPECT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_TRUE(Contains(run.err,
                       "[rank 0] dtensor ucx: warning: communicator 0, rank 0 of 2: no shared-memory "
                       "channel, collectives among the ranks of this host go over UCX only (allocating "
                       "the shared-memory segment /dev/shm/dtensor-ucx-"))
      << run.err;
  EXPECT_TRUE(Contains(run.err, "No space left on device; /dev/shm is full or too small")) << run.err;
  EXPECT_EQ(InfoLine(run), kInfo + "2 ranks: over UCX only (not every rank mapped the shared-memory segment)")
      << run.err;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(Contains(run.out, absl::StrCat("[rank ", r, "] ")) && Contains(run.out, " checks, 0 failures"))
        << run.out << run.err;
  }
  EXPECT_FALSE(Contains(run.err, "FAIL")) << run.err;
}

// DTENSOR_DEBUG=1: rank 1 calls AllGather while the others call AllReduce; every rank gets
// InvalidArgument naming both sides' calls, and the communicator stays usable.
class UcxDebugTest : public testing::TestWithParam<std::string> {};

TEST_P(UcxDebugTest, MismatchedCallsAreReportedOnEveryRank) {
  RunResult run = RunDtrun({"--nproc-per-node", "3", UCX_TEST_CHILD_PATH, "debug-mismatch"},
                           {"DTENSOR_DEBUG=1", "DTENSOR_UCX_SHM=" + GetParam()});
  EXPECT_EQ(run.code, 0) << run.out << run.err;
  const std::string all_reduce = "AllReduce(float32, 12 elements, sum)", all_gather = "AllGather(float32, 3 elements)";
  EXPECT_TRUE(Contains(run.out, absl::StrCat("[rank 0] mismatch: INVALID_ARGUMENT: [Debug] rank 0 called ", all_reduce,
                                             " but rank 1 called ", all_gather)))
      << run.out << run.err;
  EXPECT_TRUE(Contains(run.out, absl::StrCat("[rank 1] mismatch: INVALID_ARGUMENT: [Debug] rank 1 called ", all_gather,
                                             " but rank 0 called ", all_reduce)))
      << run.out << run.err;
  EXPECT_TRUE(Contains(run.out, absl::StrCat("[rank 2] mismatch: INVALID_ARGUMENT: [Debug] rank 2 called ", all_reduce,
                                             " but rank 1 called ", all_gather)))
      << run.out << run.err;
}

INSTANTIATE_TEST_SUITE_P(Channels, UcxDebugTest, testing::Values("1", "0"),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return info.param == "1" ? "SharedMemory" : "UcxOnly";
                         });

// Over the shared-memory channel ("1") and over UCX alone ("0").
class UcxFailureTest : public testing::TestWithParam<std::string> {};

TEST_P(UcxFailureTest, DeadPeerGivesUnavailableAndNoHang) {
  // Rank 2 exits (code 9) while ranks 0 and 1 are inside a 4 MiB AllReduce; they ignore dtrun's
  // SIGTERM, so they must notice on their own.
  RunResult run = RunDtrun({"--nproc-per-node", "3", "--grace-period-s", "20", UCX_TEST_CHILD_PATH, "dead-peer"},
                           {"DTENSOR_UCX_SHM=" + GetParam()});
  EXPECT_EQ(run.code, 9) << run.out << run.err;
  EXPECT_LT(run.took, absl::Seconds(10)) << run.out << run.err;
  for (int r = 0; r < 2; ++r) {
    const std::string want = absl::StrCat("[rank ", r, "] dead-peer after ");
    EXPECT_TRUE(Contains(run.out, want)) << run.out << run.err;
  }
  EXPECT_TRUE(Contains(run.out, "UNAVAILABLE: [AllReduce] rank 0: peer rank ")) << run.out;
  EXPECT_TRUE(Contains(run.out, "UNAVAILABLE: [AllReduce] rank 1: peer rank ")) << run.out;
  EXPECT_FALSE(Contains(run.err, "exited with code 4")) << run.err;  // a survivor saw another code
  EXPECT_FALSE(Contains(run.err, "exited with code 5")) << run.err;  // the failure was not sticky
}

TEST_P(UcxFailureTest, StalledPeerGivesDeadlineExceeded) {
  // Rank 1 never joins the AllReduce (it sleeps 2 s, then exits 0); rank 0 gives up after
  // DTENSOR_TIMEOUT_S = 0.5 s.
  RunResult run = RunDtrun({"--nproc-per-node", "2", UCX_TEST_CHILD_PATH, "timeout"},
                           {"DTENSOR_TIMEOUT_S=0.5", "DTENSOR_UCX_SHM=" + GetParam()});
  EXPECT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_TRUE(Contains(run.out, "[rank 0] timeout after 0.5")) << run.out;
  EXPECT_TRUE(Contains(run.out, "DEADLINE_EXCEEDED: [AllReduce] rank 0 timed out after 500ms waiting for rank 1"))
      << run.out;
  EXPECT_LT(run.took, absl::Seconds(10));
}

INSTANTIATE_TEST_SUITE_P(Channels, UcxFailureTest, testing::Values("1", "0"),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return info.param == "1" ? "SharedMemory" : "UcxOnly";
                         });

// Whether this host has an interface that is up, not loopback, with an IPv4 address: where
// UCX's TCP transport would listen by default.
bool HasExternalInterface() {
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return false;
  bool found = false;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    found = found || (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) != 0 &&
                      (i->ifa_flags & IFF_LOOPBACK) == 0);
  }
  freeifaddrs(ifs);
  return found;
}

bool IsLoopback(const std::string& addr) { return addr.rfind("127.", 0) == 0 || addr.rfind("[::1]:", 0) == 0; }

// A job whose ranks all share this host listens on loopback only: the store (rank 0) and every
// rank's UCX worker, whose TCP transport would otherwise listen on every interface of the host.
// With UCX_NET_DEVICES given (the user's choice, here every interface) UCX's default listens
// beyond loopback: the check sees UCX's sockets, so it can fail.
TEST(UcxListenTest, OneHostJobListensOnLoopbackOnly) {
  for (const bool users_choice : {false, true}) {
    std::vector<std::string> env = {"DTENSOR_UCX_INFO=1"};
    if (users_choice) env.push_back("UCX_NET_DEVICES=all");
    const RunResult run = RunDtrun({"--nproc-per-node", "2", UCX_TEST_CHILD_PATH, "listening"}, env);
    ASSERT_EQ(run.code, 0) << run.out << run.err;
    std::vector<std::string> beyond;
    for (int r = 0; r < 2; ++r) {
      const std::vector<std::string> addrs =
          dtensor::testing::LinesAfter(run.out, absl::StrCat("[rank ", r, "] listening "));
      ASSERT_FALSE(addrs.empty() || addrs.back() != "done") << run.out;
      ASSERT_GE(addrs.size(), r == 0 ? 2u : 1u) << "rank 0 serves the store: " << run.out;
      for (size_t i = 0; i + 1 < addrs.size(); ++i) {
        if (!IsLoopback(addrs[i])) beyond.push_back(absl::StrCat("rank ", r, ": ", addrs[i]));
      }
    }
    if (!users_choice) {
      EXPECT_TRUE(beyond.empty()) << testing::PrintToString(beyond) << "\n" << run.out;
      EXPECT_TRUE(Contains(run.err, "[rank 0] dtensor ucx: network interfaces: lo\n")) << run.err;
    } else if (HasExternalInterface()) {
      EXPECT_FALSE(beyond.empty()) << "UCX's default listened on loopback only: " << run.out;
      EXPECT_TRUE(Contains(run.err, "network interfaces: UCX_NET_DEVICES (the user's)")) << run.err;
    }
  }
}

}  // namespace

#else

TEST(UcxTest, NotBuilt) { GTEST_SKIP() << "the ucx backend or dtrun was not built"; }

#endif
