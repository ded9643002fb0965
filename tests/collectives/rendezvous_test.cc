// Rendezvous: launcher environments (torchrun, Open MPI, Slurm), their errors, and ConnectStore.
#include "dtensor/collectives/store/rendezvous.h"

#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "dtensor/collectives/communicator.h"
#include "gtest/gtest.h"

namespace dtensor {
namespace {

using Env = std::map<std::string, std::string>;

LaunchInfo MustParse(const Env& env) {
  auto info = LaunchInfoFromEnv(env);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.value_or(LaunchInfo{});
}

void ExpectError(const Env& env, const std::vector<std::string>& needles) {
  auto info = LaunchInfoFromEnv(env);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& n : needles) {
    EXPECT_NE(info.status().message().find(n), absl::string_view::npos)
        << "'" << n << "' missing from: " << info.status();
  }
}

TEST(RendezvousTest, Torchrun) {
  const LaunchInfo info = MustParse({{"RANK", "5"},
                                     {"WORLD_SIZE", "8"},
                                     {"LOCAL_RANK", "1"},
                                     {"LOCAL_WORLD_SIZE", "4"},
                                     {"MASTER_ADDR", "10.1.2.3"},
                                     {"MASTER_PORT", "29400"}});
  EXPECT_EQ(info.scheme, "torchrun");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, 29400);
}

TEST(RendezvousTest, TorchrunDefaultsToOneNodeAndDefaultMaster) {
  const LaunchInfo info = MustParse({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 3);
  EXPECT_EQ(info.master_addr, "127.0.0.1");
  EXPECT_EQ(info.master_port, kDefaultMasterPort);
}

TEST(RendezvousTest, OpenMpi) {
  const LaunchInfo info = MustParse({{"OMPI_COMM_WORLD_RANK", "3"},
                                     {"OMPI_COMM_WORLD_SIZE", "4"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                     {"MASTER_ADDR", "node7"}});
  EXPECT_EQ(info.scheme, "ompi");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "node7");
  EXPECT_EQ(info.master_port, kDefaultMasterPort);
}

TEST(RendezvousTest, SlurmWithTasksPerNodeListAndNodeList) {
  const LaunchInfo info = MustParse({{"SLURM_PROCID", "9"},
                                     {"SLURM_NTASKS", "11"},
                                     {"SLURM_LOCALID", "1"},
                                     {"SLURM_NODEID", "2"},
                                     {"SLURM_TASKS_PER_NODE", "4(x2),3"},
                                     {"SLURM_NODELIST", "gpu[03-05,9],cpu1"},
                                     {"MASTER_PORT", "1234"}});
  EXPECT_EQ(info.scheme, "slurm");
  EXPECT_EQ(info.rank, 9);
  EXPECT_EQ(info.world_size, 11);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 3);  // node 2 of "4,4,3"
  EXPECT_EQ(info.master_addr, "gpu03");
  EXPECT_EQ(info.master_port, 1234);

  const LaunchInfo simple = MustParse({{"SLURM_PROCID", "0"},
                                       {"SLURM_NTASKS", "2"},
                                       {"SLURM_LOCALID", "0"},
                                       {"SLURM_NTASKS_PER_NODE", "2"},
                                       {"SLURM_NODELIST", "hostA"}});
  EXPECT_EQ(simple.local_world_size, 2);
  EXPECT_EQ(simple.master_addr, "hostA");

  // Text after a bracket, and several brackets in one name.
  for (const auto& [list, first] : std::vector<std::pair<std::string, std::string>>{
           {"gpu[1-2]-ib", "gpu1-ib"}, {"rack[07-08]-node[5,9]-ib,cpu1", "rack07-node5-ib"}, {"n[3]", "n3"}}) {
    const LaunchInfo info = MustParse({{"SLURM_PROCID", "0"},
                                       {"SLURM_NTASKS", "2"},
                                       {"SLURM_LOCALID", "0"},
                                       {"SLURM_NTASKS_PER_NODE", "2"},
                                       {"SLURM_NODELIST", list}});
    EXPECT_EQ(info.master_addr, first) << list;
  }
}

TEST(RendezvousTest, TorchrunVariablesWinOverOthersAndNoneIsAWorldOfOne) {
  const LaunchInfo info = MustParse({{"RANK", "1"},
                                     {"WORLD_SIZE", "2"},
                                     {"OMPI_COMM_WORLD_RANK", "0"},
                                     {"OMPI_COMM_WORLD_SIZE", "5"},
                                     {"SLURM_PROCID", "3"}});
  EXPECT_EQ(info.scheme, "torchrun");
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 2);

  EXPECT_EQ(MustParse({{"WORLD_SIZE", "1"}}).world_size, 1);
  EXPECT_EQ(MustParse({{"SLURM_NTASKS", "4"}}).world_size, 1);  // an allocation's shell
  const LaunchInfo alone = MustParse({{"PATH", "/bin"}});
  EXPECT_EQ(alone.scheme, "none");
  EXPECT_EQ(alone.rank, 0);
  EXPECT_EQ(alone.world_size, 1);
  EXPECT_EQ(alone.master_port, 0);
}

TEST(RendezvousTest, ErrorsNameTheVariableAndValue) {
  ExpectError({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, {"RANK", "abc"});
  ExpectError({{"RANK", "4"}, {"WORLD_SIZE", "4"}}, {"RANK=4", "WORLD_SIZE=4"});
  ExpectError({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, {"RANK=-1"});
  ExpectError({{"RANK", "0"}}, {"WORLD_SIZE"});
  ExpectError({{"WORLD_SIZE", "4"}}, {"WORLD_SIZE=4 is set but RANK is not"});
  ExpectError({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE=0"});
  ExpectError({{"RANK", "0"}, {"WORLD_SIZE", "2x"}}, {"WORLD_SIZE", "2x"});
  ExpectError({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, {"MASTER_PORT=70000"});
  ExpectError({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}, {"MASTER_PORT", "http"});
  ExpectError({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}}, {"MASTER_PORT=0"});
  ExpectError({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}}, {"MASTER_ADDR"});
  ExpectError({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
              {"LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"});
  ExpectError({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "3"}},
              {"LOCAL_WORLD_SIZE=3", "WORLD_SIZE=2"});
  ExpectError({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}}, {"OMPI_COMM_WORLD_RANK=2"});
  ExpectError({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_TASKS_PER_NODE", "4(x"}},
              {"SLURM_TASKS_PER_NODE", "4(x"});
  ExpectError({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NODEID", "3"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}},
              {"SLURM_NODEID=3"});
}

// DTENSOR_TIMEOUT_S: seconds, or inf; a malformed value is an error naming it (it silently
// became 300 s), and so is one that rounds to nothing.
TEST(RendezvousTest, TimeoutFromTheEnvironment) {
  const char* saved = std::getenv("DTENSOR_TIMEOUT_S");
  const std::string keep = saved != nullptr ? saved : "";
  ASSERT_EQ(unsetenv("DTENSOR_TIMEOUT_S"), 0);
  EXPECT_EQ(TimeoutFromEnv().value_or(absl::ZeroDuration()), absl::Seconds(300));
  for (const auto& [value, want] : std::vector<std::pair<std::string, absl::Duration>>{
           {"10", absl::Seconds(10)}, {"0.5", absl::Milliseconds(500)}, {"inf", absl::InfiniteDuration()}}) {
    ASSERT_EQ(setenv("DTENSOR_TIMEOUT_S", value.c_str(), 1), 0);
    EXPECT_EQ(TimeoutFromEnv().value_or(absl::ZeroDuration()), want) << value;
    EXPECT_EQ(DefaultTimeout(), want) << value;
  }
  for (const std::string value : {"10s", "abc", "0", "-3", "1e-300", "", "nan"}) {
    ASSERT_EQ(setenv("DTENSOR_TIMEOUT_S", value.c_str(), 1), 0);
    const absl::StatusOr<absl::Duration> t = TimeoutFromEnv();
    EXPECT_TRUE(absl::IsInvalidArgument(t.status())) << value << ": " << t.status();
    EXPECT_NE(t.status().message().find("DTENSOR_TIMEOUT_S='" + value + "'"), std::string::npos) << t.status();
    EXPECT_EQ(DefaultTimeout(), absl::Seconds(300)) << value;
  }
  if (saved != nullptr) {
    setenv("DTENSOR_TIMEOUT_S", keep.c_str(), 1);
  } else {
    unsetenv("DTENSOR_TIMEOUT_S");
  }
}

TEST(RendezvousTest, ReadsTheProcessEnvironment) {
  // Each test runs in its own process under ctest; restore anyway.
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "3", 1);
  setenv("MASTER_PORT", "4567", 1);
  auto info = LaunchInfoFromEnv();
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("MASTER_PORT");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->rank, 1);
  EXPECT_EQ(info->world_size, 3);
  EXPECT_EQ(info->master_port, 4567);
}

TEST(RendezvousTest, ConnectStoreWorldOfOne) {
  LaunchInfo info;  // rank 0 of 1, port 0 = any
  auto store = ConnectStore(info, absl::Seconds(5));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Add("n", 1).value_or(-1), 1);
}

TEST(RendezvousTest, ConnectStoreRanksJoinInAnyOrder) {
  int port = 0;
  {
    auto probe = StoreServer::Start("127.0.0.1", 0);
    ASSERT_TRUE(probe.ok());
    port = (*probe)->port();
  }
  constexpr int kWorld = 3;
  std::vector<std::string> seen(kWorld);
  std::vector<std::thread> threads;
  // Ranks 2 and 1 start before the master (rank 0) hosts the store.
  for (int rank = kWorld - 1; rank >= 0; --rank) {
    threads.emplace_back([&, rank] {
      LaunchInfo info;
      info.rank = rank;
      info.world_size = kWorld;
      info.master_port = port;
      auto store = ConnectStore(info, absl::Seconds(10));
      ASSERT_TRUE(store.ok()) << store.status();
      auto n = (*store)->Add("joined", 1);
      ASSERT_TRUE(n.ok());
      if (*n == kWorld) {
        ASSERT_TRUE((*store)->Set("all", "in").ok());
      }
      seen[rank] = (*store)->Get("all").value_or("error");
      ASSERT_TRUE((*store)->Set("ack" + std::to_string(rank), "").ok());
      if (rank == 0) {
        ASSERT_TRUE((*store)->Wait({"ack0", "ack1", "ack2"}).ok());
      }
    });
    if (rank > 0) absl::SleepFor(absl::Milliseconds(100));
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(seen[r], "in") << "rank " << r;
}

TEST(RendezvousTest, StoreSecretAndInheritedSocketFromTheEnvironment) {
  const std::string secret(64, 'c');
  LaunchInfo info =
      MustParse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"DTENSOR_STORE_SECRET", secret}, {"DTENSOR_STORE_FD", "7"}});
  EXPECT_EQ(info.store_secret, secret);
  EXPECT_EQ(info.store_fd, 7);
  LaunchInfo plain = MustParse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"DTENSOR_STORE_SECRET", ""}});
  EXPECT_EQ(plain.store_secret, "");  // empty counts as unset
  EXPECT_EQ(plain.store_fd, -1);
  ExpectError({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"DTENSOR_STORE_SECRET", "short"}},
              {"DTENSOR_STORE_SECRET", "5 characters"});
  ExpectError({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"DTENSOR_STORE_FD", "x"}}, {"DTENSOR_STORE_FD", "'x'"});
}

// As dtrun runs a job: the port is bound before any rank starts (rank 0 serves on the inherited
// socket), and every rank authenticates with the job's secret.
TEST(RendezvousTest, ConnectStoreServesOnTheInheritedSocketWithTheSecret) {
  auto listener = ListenForStore("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto secret = NewStoreSecret();
  ASSERT_TRUE(secret.ok());
  constexpr int kWorld = 3;
  std::vector<std::string> seen(kWorld);
  std::vector<std::thread> threads;
  for (int rank = kWorld - 1; rank >= 0; --rank) {  // the master last
    threads.emplace_back([&, rank] {
      LaunchInfo info;
      info.rank = rank;
      info.world_size = kWorld;
      info.master_port = listener->port;
      info.store_secret = *secret;
      if (rank == 0) info.store_fd = listener->fd;
      auto store = ConnectStore(info, absl::Seconds(10));
      ASSERT_TRUE(store.ok()) << store.status();
      EXPECT_TRUE((*store)->authenticated());
      if ((*store)->Add("joined", 1).value_or(-1) == kWorld) {
        ASSERT_TRUE((*store)->Set("all", "in").ok());
      }
      seen[rank] = (*store)->Get("all").value_or("error");
      ASSERT_TRUE((*store)->Set("ack" + std::to_string(rank), "").ok());
      if (rank == 0) {
        ASSERT_TRUE((*store)->Wait({"ack0", "ack1", "ack2"}).ok());
      }
    });
    absl::SleepFor(absl::Milliseconds(100));
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(seen[r], "in") << "rank " << r;
}

}  // namespace
}  // namespace dtensor
