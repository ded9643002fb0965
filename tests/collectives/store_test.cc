// TCP store: semantics across clients and threads, timeouts, and robustness against raw
// malformed traffic (the server must keep serving well-behaved clients).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dtensor/collectives/store/tcp_store.h"
#include "gtest/gtest.h"

namespace dtensor {
namespace {

std::unique_ptr<StoreServer> StartServer(const std::string& host = "127.0.0.1") {
  auto server = StoreServer::Start(host, 0);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<StoreClient> ConnectTo(const StoreServer& server, absl::Duration timeout = absl::Seconds(10)) {
  auto client = StoreClient::Connect(server.host(), server.port(), timeout);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// ---- Raw socket helpers speaking (or abusing) the wire protocol ----
// With rcvbuf > 0 the socket's receive buffer is set to that many bytes before connecting.
int RawConnect(int port, const char* addr = "127.0.0.1", int rcvbuf = 0) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, addr, &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}
void Le(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
std::string Header(uint8_t op, uint32_t nfields, uint32_t magic = 0x31535444) {
  std::string s;
  Le(s, magic, 4);
  s.push_back(static_cast<char>(op));
  Le(s, nfields, 4);
  return s;
}
void SendRaw(int fd, const std::string& bytes) {
  ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}
// Reads until the server closes the connection (or 5 s pass); returns what came, and whether it closed.
std::pair<std::string, bool> ReadUntilClosed(int fd) {
  std::string got;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return {got, true};
    got.append(buf, static_cast<size_t>(n));
  }
  return {got, false};
}

// A GET of `key` on the wire.
std::string GetRequest(const std::string& key) {
  std::string s = Header(2, 1);
  Le(s, key.size(), 8);
  return s + key;
}
// Reads until `want` bytes came, the server closed, or `timeout` passed; with `pause_every`,
// sleeps 50 ms after every that many bytes (a slow reader).
std::string ReadAtLeast(int fd, size_t want, absl::Duration timeout, size_t pause_every = 0) {
  std::string got;
  const absl::Time deadline = absl::Now() + timeout;
  size_t next_pause = pause_every;
  while (got.size() < want && absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[1 << 16];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
    if (pause_every > 0 && got.size() >= next_pause) {
      usleep(50 * 1000);
      next_pause += pause_every;
    }
  }
  return got;
}

void ExpectServerHealthy(const StoreServer& server, const std::string& key) {
  auto c = ConnectTo(server, absl::Seconds(5));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Set(key, "alive").ok());
  auto v = c->Get(key);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "alive");
}

TEST(TcpStoreTest, SetGetAcrossThreadsAndBinarySafe) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  EXPECT_GT(server->port(), 0);
  std::string binary_key("k\0\xff", 3);
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 2654435761u) >> 13);
  std::thread writer([&] {
    auto c = ConnectTo(*server);
    ASSERT_NE(c, nullptr);
    EXPECT_TRUE(c->Set("a", "1").ok());
    EXPECT_TRUE(c->Set("a", "2").ok());  // overwrites
    EXPECT_TRUE(c->Set("empty", "").ok());
    EXPECT_TRUE(c->Set(binary_key, std::string("v\0v", 3)).ok());
    EXPECT_TRUE(c->Set("big", big).ok());
  });
  writer.join();
  auto c = ConnectTo(*server);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->Get("a").value_or("?"), "2");
  EXPECT_EQ(c->Get("empty").value_or("?"), "");
  EXPECT_EQ(c->Get(binary_key).value_or("?"), std::string("v\0v", 3));
  auto got = c->Get("big");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == big);
}

TEST(TcpStoreTest, BlockingGetAndWaitReleasedByLaterSet) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  std::atomic<bool> set_done{false};
  std::string got;
  absl::Status wait_status = absl::UnknownError("not run");
  std::thread getter([&] {
    auto c = ConnectTo(*server);
    auto v = c->Get("later");
    EXPECT_TRUE(set_done.load()) << "Get returned before the key was set";
    got = v.value_or("error: " + v.status().ToString());
  });
  std::thread waiter([&] {
    auto c = ConnectTo(*server);
    wait_status = c->Wait({"later", "later2"});
    EXPECT_TRUE(set_done.load());
  });
  absl::SleepFor(absl::Milliseconds(150));
  auto c = ConnectTo(*server);
  set_done = true;
  ASSERT_TRUE(c->Set("later", "value").ok());
  ASSERT_TRUE(c->Set("later2", "x").ok());
  getter.join();
  waiter.join();
  EXPECT_EQ(got, "value");
  EXPECT_TRUE(wait_status.ok()) << wait_status;
}

// A client with no time limit waits for the key (its poll() got a timeout of 0 from the
// overflowing infinite deadline: DeadlineExceeded 'timed out after inf' at once).
TEST(TcpStoreTest, AnInfiniteTimeoutWaits) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    auto c = ConnectTo(*server);
    ASSERT_TRUE(c->Set("k", "v").ok());
  });
  auto c = ConnectTo(*server, absl::InfiniteDuration());
  ASSERT_NE(c, nullptr);
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(c->Get("k").value_or("error"), "v");
  EXPECT_TRUE(c->Wait({"k"}).ok());
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(250));
  setter.join();
}

TEST(TcpStoreTest, ConcurrentAddsGiveExactTotalsAndDistinctResults) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  constexpr int kClients = 12, kAdds = 150;
  std::vector<std::vector<int64_t>> results(kClients);
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      auto c = ConnectTo(*server);
      ASSERT_NE(c, nullptr);
      for (int i = 0; i < kAdds; ++i) {
        auto v = c->Add("ones", 1);
        ASSERT_TRUE(v.ok()) << v.status();
        results[t].push_back(*v);
        ASSERT_TRUE(c->Add("weighted", t + 1).ok());
        ASSERT_TRUE(c->Add("mixed", (i % 2 == 0) ? 5 : -3).ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  std::set<int64_t> seen;
  for (const auto& r : results) seen.insert(r.begin(), r.end());
  // Every increment observed a distinct value: exactly 1..N.
  ASSERT_EQ(seen.size(), static_cast<size_t>(kClients * kAdds));
  EXPECT_EQ(*seen.begin(), 1);
  EXPECT_EQ(*seen.rbegin(), kClients * kAdds);
  auto c = ConnectTo(*server);
  int64_t weighted = 0, mixed = 0;
  for (int t = 0; t < kClients; ++t) {
    weighted += int64_t{kAdds} * (t + 1);
    for (int i = 0; i < kAdds; ++i) mixed += (i % 2 == 0) ? 5 : -3;
  }
  EXPECT_EQ(c->Add("weighted", 0).value_or(-1), weighted);
  EXPECT_EQ(c->Get("weighted").value_or("?"), std::to_string(weighted));  // counters are decimal
  EXPECT_EQ(c->Add("mixed", 0).value_or(-1), mixed);
}

TEST(TcpStoreTest, AddOnNonIntegerAndOverflowFailWithoutBreakingTheConnection) {
  auto server = StartServer();
  auto c = ConnectTo(*server);
  ASSERT_TRUE(c->Set("text", "hello").ok());
  EXPECT_EQ(c->Add("text", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->Add("big", std::numeric_limits<int64_t>::max()).ok());
  EXPECT_EQ(c->Add("big", 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(c->Add("neg", -7).value_or(0), -7);
}

TEST(TcpStoreTest, TimeoutsNameKeyAndAddressAndClientRecovers) {
  auto server = StartServer();
  auto c = ConnectTo(*server, absl::Milliseconds(150));
  ASSERT_NE(c, nullptr);
  const absl::Time start = absl::Now();
  auto v = c->Get("never/set");
  const absl::Duration took = absl::Now() - start;
  ASSERT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded) << v.status();
  EXPECT_NE(v.status().message().find("never/set"), absl::string_view::npos) << v.status();
  EXPECT_NE(v.status().message().find("127.0.0.1:" + std::to_string(server->port())), absl::string_view::npos)
      << v.status();
  EXPECT_GE(took, absl::Milliseconds(140));
  EXPECT_LT(took, absl::Seconds(3));
  EXPECT_EQ(c->Wait({"a", "never"}).code(), absl::StatusCode::kDeadlineExceeded);
  // A later call works (on a fresh connection), and a key set meanwhile is seen.
  ASSERT_TRUE(c->Set("never/set", "now").ok());
  EXPECT_EQ(c->Get("never/set").value_or("?"), "now");
}

TEST(TcpStoreTest, ClientRejectsBadKeysAndSizes) {
  auto server = StartServer();
  auto c = ConnectTo(*server);
  EXPECT_EQ(c->Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Get(std::string(kStoreMaxKeyBytes + 1, 'k')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->Set(std::string(kStoreMaxKeyBytes, 'k'), "max key").ok());
  EXPECT_EQ(c->Set("v", std::string(kStoreMaxValueBytes + 1, 'x')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Wait({}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StoreClient::Connect("127.0.0.1", 70000, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Get(std::string(kStoreMaxKeyBytes, 'k')).value_or("?"), "max key");
}

TEST(TcpStoreTest, OversizeRawMessagesGetAnErrorAndTheServerKeepsServing) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  struct Case {
    const char* name;
    std::string bytes;
  };
  std::vector<Case> cases;
  {
    std::string s = Header(1, 2);
    Le(s, kStoreMaxKeyBytes + 1, 8);  // key too long (body never sent)
    cases.push_back({"long key", s});
  }
  {
    std::string s = Header(1, 2);
    Le(s, 1, 8);
    s += "k";
    Le(s, uint64_t{1} << 62, 8);  // value far too long
    cases.push_back({"huge value", s});
  }
  {
    std::string s = Header(2, 1);
    Le(s, 0, 8);  // empty key
    cases.push_back({"empty key", s});
  }
  {
    std::string s = Header(3, 2);
    Le(s, 1, 8);
    s += "k";
    Le(s, 3, 8);  // ADD delta not 8 bytes
    cases.push_back({"short delta", s});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int fd = RawConnect(server->port());
    ASSERT_GE(fd, 0);
    SendRaw(fd, c.bytes);
    auto [reply, closed] = ReadUntilClosed(fd);
    close(fd);
    EXPECT_TRUE(closed);
    ASSERT_GE(reply.size(), 9u);
    EXPECT_EQ(static_cast<int>(reply[0]), static_cast<int>(absl::StatusCode::kInvalidArgument));
    ExpectServerHealthy(*server, c.name);
  }
}

// A client that pipelines many GETs of a large value before reading any reply: the server
// stops reading it while more than 1 MiB of replies wait (it would otherwise hold a copy of
// the value per request), and goes on answering as the replies drain: all of them arrive,
// in order and whole.
TEST(TcpStoreTest, PipelinedLargeRepliesAllArrive) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto c = ConnectTo(*server);
  ASSERT_NE(c, nullptr);
  std::string value(3 << 20, '\0');
  for (size_t i = 0; i < value.size(); ++i) value[i] = static_cast<char>(i * 7 + 1);
  ASSERT_TRUE(c->Set("big", value).ok());
  const int fd = RawConnect(server->port());
  ASSERT_GE(fd, 0);
  constexpr int kRequests = 24;
  std::string requests;
  for (int i = 0; i < kRequests; ++i) requests += GetRequest("big");
  SendRaw(fd, requests);
  usleep(200 * 1000);  // let the server hit the backlog before anything is read
  const size_t want = kRequests * (9 + value.size());
  const std::string got = ReadAtLeast(fd, want, absl::Seconds(20));
  close(fd);
  ASSERT_EQ(got.size(), want);
  for (int i = 0; i < kRequests; ++i) {
    const size_t at = static_cast<size_t>(i) * (9 + value.size());
    EXPECT_EQ(static_cast<int>(got[at]), 0) << "reply " << i;
    EXPECT_TRUE(got.compare(at + 9, value.size(), value) == 0) << "reply " << i;
  }
  ExpectServerHealthy(*server, "after-pipeline");
}

// A slow reader of large pipelined replies is not a half-sent message: with a 300 ms message
// timeout, replies that take longer than that to drain still all arrive.
TEST(TcpStoreTest, SlowReaderIsNotTimedOut) {
  auto started = StoreServer::Start("127.0.0.1", 0, absl::Milliseconds(300));
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<StoreServer> server = std::move(*started);
  auto c = ConnectTo(*server);
  ASSERT_NE(c, nullptr);
  const std::string value(3 << 20, 'x');
  ASSERT_TRUE(c->Set("big", value).ok());
  // A small receive buffer keeps the replies on the server's side until this slow reader
  // takes them. With loopback's megabytes of buffering, the server hands the last ~4 MiB over
  // at once; reading them slowly after that can outlast the 300 ms (seen under load in CI),
  // and the server, which cannot see a peer's receive buffer, rightly counts that as idle.
  const int fd = RawConnect(server->port(), "127.0.0.1", 64 << 10);
  ASSERT_GE(fd, 0);
  constexpr int kRequests = 4;
  std::string requests;
  for (int i = 0; i < kRequests; ++i) requests += GetRequest("big");
  const std::string fifth_request = GetRequest("big");
  requests += fifth_request.substr(0, 9);  // and the start of a fifth, finished only after the replies
  SendRaw(fd, requests);
  const size_t want = kRequests * (9 + value.size());
  // ~12 pauses of 50 ms: draining takes ~0.6 s.
  const std::string got = ReadAtLeast(fd, want, absl::Seconds(20), /*pause_every=*/1 << 20);
  EXPECT_EQ(got.size(), want) << "the connection was closed while its replies drained";
  SendRaw(fd, fifth_request.substr(9));
  const std::string fifth = ReadAtLeast(fd, 9 + value.size(), absl::Seconds(20));
  EXPECT_EQ(fifth.size(), 9 + value.size());
  close(fd);
}

TEST(TcpStoreTest, MalformedRawMessagesDropOnlyThatClient) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  // A healthy client holds a parked Get across all the abuse below.
  std::string parked;
  std::thread getter([&] {
    auto c = ConnectTo(*server);
    parked = c->Get("after-abuse").value_or("error");
  });
  std::vector<std::pair<const char*, std::string>> cases = {
      {"bad magic", Header(1, 2, 0xdeadbeef)},
      {"bad op", Header(99, 1)},
      {"zero op", Header(0, 1)},
      {"wrong field count", Header(1, 7)},
      {"too many wait keys", Header(4, kStoreMaxWaitKeys + 1)},
  };
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    const int fd = RawConnect(server->port());
    ASSERT_GE(fd, 0);
    SendRaw(fd, bytes + std::string(64, 'x'));
    auto [reply, closed] = ReadUntilClosed(fd);
    close(fd);
    EXPECT_TRUE(closed);
    EXPECT_TRUE(reply.empty());
  }
  // Random garbage, half-sent messages abandoned mid-way, and an idle half-message left open.
  std::mt19937 rng(1234);
  for (int i = 0; i < 100; ++i) {
    const int fd = RawConnect(server->port());
    ASSERT_GE(fd, 0);
    std::string junk(1 + rng() % 300, '\0');
    for (char& ch : junk) ch = static_cast<char>(rng());
    if (i % 3 == 0) junk = Header(1 + rng() % 4, 1 + rng() % 2) + junk.substr(0, junk.size() % 13);
    SendRaw(fd, junk);
    close(fd);
  }
  const int idle = RawConnect(server->port());
  ASSERT_GE(idle, 0);
  {
    std::string s = Header(1, 2);
    Le(s, 5, 8);
    s += "ke";  // stops mid-key and stays connected
    SendRaw(idle, s);
  }
  ExpectServerHealthy(*server, "healthy");
  auto c = ConnectTo(*server);
  ASSERT_TRUE(c->Set("after-abuse", "ok").ok());
  getter.join();
  EXPECT_EQ(parked, "ok");
  close(idle);
}

// A connection that sends part of a message and then nothing is closed after the server's
// message timeout (here 300 ms); one that is idle between messages stays open and is served.
TEST(TcpStoreTest, HalfSentMessagesTimeOutIdleConnectionsStay) {
  auto started = StoreServer::Start("127.0.0.1", 0, absl::Milliseconds(300));
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<StoreServer> server = std::move(*started);
  auto c = ConnectTo(*server);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Set("k", "v").ok());
  const int half = RawConnect(server->port());
  const int idle = RawConnect(server->port());
  ASSERT_GE(half, 0);
  ASSERT_GE(idle, 0);
  SendRaw(half, GetRequest("k").substr(0, 17));  // a GET whose key never comes
  const absl::Time start = absl::Now();
  auto [reply, closed] = ReadUntilClosed(half);
  close(half);
  EXPECT_TRUE(closed) << "the half-sent message was kept";
  EXPECT_TRUE(reply.empty());
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  // The idle connection (no bytes at all for longer than the timeout) still gets answers.
  SendRaw(idle, GetRequest("k"));
  const std::string got = ReadAtLeast(idle, 10, absl::Seconds(5));
  close(idle);
  ASSERT_EQ(got.size(), 10u);
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(got.back(), 'v');
  EXPECT_TRUE(c->Get("k").ok()) << "the client's own idle connection was dropped";
}

TEST(TcpStoreTest, ManyClientsAtOnce) {
  auto server = StartServer();
  constexpr int kClients = 64;
  std::vector<std::unique_ptr<StoreClient>> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(ConnectTo(*server));
    ASSERT_NE(clients.back(), nullptr);
  }
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  // (absl::StrCat rather than "k" + std::to_string(i): g++ 12 -Wrestrict false positive.)
  std::vector<std::string> keys;
  for (int j = 0; j < kClients; ++j) keys.push_back(absl::StrCat("k", j));
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      // Everyone waits for everyone: all 64 are parked in the server at once.
      if (!clients[i]->Set(keys[i], absl::StrCat(i)).ok()) return;
      const int next = (i + 1) % kClients;
      if (clients[i]->Wait(keys).ok() && clients[i]->Get(keys[next]).value_or("") == absl::StrCat(next)) ++ok;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kClients);
}

TEST(TcpStoreTest, ConnectRetriesUntilTheServerComesUp) {
  int port = 0;
  {
    auto probe = StartServer();
    port = probe->port();
  }
  absl::Status status = absl::UnknownError("not run");
  std::thread client([&] {
    auto c = StoreClient::Connect("127.0.0.1", port, absl::Seconds(10));
    status = c.ok() ? c.value()->Set("x", "y") : c.status();
  });
  absl::SleepFor(absl::Milliseconds(300));
  auto server = StoreServer::Start("127.0.0.1", port);
  ASSERT_TRUE(server.ok()) << server.status();
  client.join();
  EXPECT_TRUE(status.ok()) << status;
}

TEST(TcpStoreTest, ConnectToNothingIsUnavailableAfterTheTimeout) {
  int port = 0;
  {
    auto probe = StartServer();
    port = probe->port();
  }
  const absl::Time start = absl::Now();
  auto c = StoreClient::Connect("127.0.0.1", port, absl::Milliseconds(300));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(290));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_NE(c.status().message().find(std::to_string(port)), absl::string_view::npos);
}

TEST(TcpStoreTest, ServerBindsOnlyTheGivenAddress) {
  // 127.0.0.0/8 is all loopback on Linux: a server on 127.0.0.2 is not reachable via 127.0.0.1.
  auto server = StartServer("127.0.0.2");
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(RawConnect(server->port(), "127.0.0.1"), -1);
  auto wrong = StoreClient::Connect("127.0.0.1", server->port(), absl::Milliseconds(100));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnavailable);
  auto right = StoreClient::Connect("127.0.0.2", server->port(), absl::Seconds(5));
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_TRUE((*right)->Set("a", "b").ok());
}

TEST(TcpStoreTest, ServerShutdownReleasesBlockedClients) {
  auto server = StartServer();
  auto c = ConnectTo(*server, absl::Seconds(30));
  absl::Status status;
  std::thread getter([&] { status = c->Get("never").status(); });
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  server.reset();
  getter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
}

// A connection the server closed between calls (here: the server restarted on the same port)
// is replaced before the next call, which succeeds instead of failing once.
TEST(TcpStoreTest, ClientReconnectsWhenTheServerClosedBetweenCalls) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  auto c = ConnectTo(*server);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Set("a", "1").ok());
  server.reset();
  auto again = StoreServer::Start("127.0.0.1", port);
  ASSERT_TRUE(again.ok()) << again.status();
  absl::SleepFor(absl::Milliseconds(50));  // the old connection's close has reached the client
  EXPECT_TRUE(c->Set("b", "2").ok());
  auto v = c->Get("b");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "2");
}

TEST(TcpStoreTest, ClientOwnsAdoptedServer) {
  auto server = StartServer();
  const int port = server->port();
  auto c = ConnectTo(*server);
  c->AdoptServer(std::move(server));
  ASSERT_TRUE(c->Set("a", "1").ok());
  c.reset();  // closes the connection, then stops the server
  EXPECT_EQ(RawConnect(port), -1);
}

// ---- Authentication ----

std::string Secret() {
  auto s = NewStoreSecret();
  EXPECT_TRUE(s.ok()) << s.status();
  return s.value_or(std::string(64, 'a'));
}

std::unique_ptr<StoreServer> StartWithSecret(const std::string& secret,
                                             absl::Duration message_timeout = absl::Seconds(30)) {
  auto server = StoreServer::Start("127.0.0.1", 0, message_timeout, secret);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<StoreClient> ConnectWith(const StoreServer& server, const std::string& secret) {
  auto client = StoreClient::Connect(server.host(), server.port(), absl::Seconds(10), secret);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

TEST(TcpStoreAuthTest, SecretsAreFreshHex) {
  const std::string a = Secret(), b = Secret();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

TEST(TcpStoreAuthTest, ClientsWithTheSecretShareTheStore) {
  const std::string secret = Secret();
  auto server = StartWithSecret(secret);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(server->authenticated());
  auto a = ConnectWith(*server, secret);
  auto b = ConnectWith(*server, secret);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(a->authenticated());
  std::string got;
  std::thread getter([&] { got = b->Get("k").value_or("error"); });  // parked until a sets k
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(a->Set("k", std::string("v\0w", 3)).ok());
  getter.join();
  EXPECT_EQ(got, std::string("v\0w", 3));
  EXPECT_EQ(a->Add("n", 2).value_or(-1), 2);
  EXPECT_EQ(b->Add("n", 3).value_or(-1), 5);
  // A reconnection authenticates again.
  a->Close();
  EXPECT_EQ(a->Get("n").value_or("error"), "5");
}

// Clients with a wrong secret or none are refused with an error naming the store; the server
// logs their address; a legitimate client's parked Get and data are undisturbed.
TEST(TcpStoreAuthTest, WrongOrMissingSecretIsRefusedAndTheJobContinues) {
  const std::string secret = Secret();
  auto server = StartWithSecret(secret);
  ASSERT_NE(server, nullptr);
  const std::string where = absl::StrCat("127.0.0.1:", server->port());
  auto legit = ConnectWith(*server, secret);
  ASSERT_NE(legit, nullptr);
  ASSERT_TRUE(legit->Set("before", "1").ok());
  std::string parked;
  std::thread getter([&] {
    auto c = ConnectWith(*server, secret);
    parked = c == nullptr ? "error" : c->Get("after").value_or("error");
  });

  ::testing::internal::CaptureStderr();
  std::string wrong_secret = secret;
  wrong_secret[0] = wrong_secret[0] == '0' ? '1' : '0';
  auto wrong = StoreClient::Connect("127.0.0.1", server->port(), absl::Seconds(5), wrong_secret);
  auto none = StoreClient::Connect("127.0.0.1", server->port(), absl::Seconds(5));
  ASSERT_TRUE(none.ok()) << none.status();  // a client without a secret learns at its first call
  const absl::Status none_set = (*none)->Set("before", "overwritten");
  const absl::Status none_get = (*none)->Get("before").status();  // reconnects: refused again
  absl::SleepFor(absl::Milliseconds(100));                        // the server thread's log lines
  const std::string log = ::testing::internal::GetCapturedStderr();

  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kPermissionDenied) << wrong.status();
  EXPECT_NE(wrong.status().message().find(where), absl::string_view::npos) << wrong.status();
  for (const absl::Status& st : {none_set, none_get}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
    EXPECT_NE(st.message().find(where), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("DTENSOR_STORE_SECRET"), absl::string_view::npos) << st;
  }
  EXPECT_NE(log.find(absl::StrCat("store at ", where, " refused the client at 127.0.0.1:")), std::string::npos) << log;
  EXPECT_NE(log.find("does not match"), std::string::npos) << log;
  EXPECT_NE(log.find("without authenticating"), std::string::npos) << log;

  // Nothing of theirs reached the data; the legitimate clients carry on.
  EXPECT_EQ(legit->Get("before").value_or("error"), "1");
  ASSERT_TRUE(legit->Set("after", "ok").ok());
  getter.join();
  EXPECT_EQ(parked, "ok");
}

// Mutual: a client with a secret refuses a store without one and a store that cannot prove it
// holds the same secret (a fake server that answers the handshake with random bytes).
TEST(TcpStoreAuthTest, ClientRefusesOpenAndFakeServers) {
  const std::string secret = Secret();
  auto open_server = StartServer();
  ASSERT_NE(open_server, nullptr);
  auto to_open = StoreClient::Connect("127.0.0.1", open_server->port(), absl::Seconds(5), secret);
  ASSERT_FALSE(to_open.ok());
  EXPECT_EQ(to_open.status().code(), absl::StatusCode::kUnauthenticated) << to_open.status();
  EXPECT_NE(to_open.status().message().find(absl::StrCat("127.0.0.1:", open_server->port())), absl::string_view::npos)
      << to_open.status();
  ExpectServerHealthy(*open_server, "open-still-serves");

  auto listener = ListenForStore("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  std::string proof_received;
  std::thread fake([&, fd = listener->fd] {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 5000) != 1) return;
    const int conn = accept(fd, nullptr, nullptr);
    if (conn < 0) return;
    std::mt19937 rng(7);
    auto respond = [&](size_t n) {  // response OK with n random bytes
      std::string r(1, '\0');
      Le(r, n, 8);
      for (size_t i = 0; i < n; ++i) r.push_back(static_cast<char>(rng()));
      send(conn, r.data(), r.size(), MSG_NOSIGNAL);
    };
    ReadAtLeast(conn, 36, absl::Seconds(5));  // magic + client nonce
    respond(32);                              // server nonce
    proof_received = ReadAtLeast(conn, 32, absl::Seconds(5));
    respond(32);  // a proof made without the secret
    ReadUntilClosed(conn);
    close(conn);
  });
  auto to_fake = StoreClient::Connect("127.0.0.1", listener->port, absl::Seconds(5), secret);
  fake.join();
  close(listener->fd);
  ASSERT_FALSE(to_fake.ok());
  EXPECT_EQ(to_fake.status().code(), absl::StatusCode::kPermissionDenied) << to_fake.status();
  EXPECT_NE(to_fake.status().message().find("failed to prove"), absl::string_view::npos) << to_fake.status();
  // The secret itself never crossed the socket: the client sent a 32-byte MAC, not the secret.
  EXPECT_EQ(proof_received.size(), 32u);
  EXPECT_EQ(proof_received.find(secret.substr(0, 16)), std::string::npos);
}

// Raw traffic to a store with a secret: malformed openings, oversize requests without a
// handshake, wrong proofs and silent connections are all dropped; the server keeps serving.
TEST(TcpStoreAuthTest, UnauthenticatedRawTrafficIsDropped) {
  const std::string secret = Secret();
  auto server = StartWithSecret(secret, absl::Milliseconds(300));
  ASSERT_NE(server, nullptr);
  std::string big = Header(1, 2);
  Le(big, 4, 8);
  big += "key!";
  Le(big, uint64_t{1} << 40, 8);  // an oversize value, never authenticated
  std::string opening;
  Le(opening, 0x31415444, 4);  // "DTA1"
  opening += std::string(32, 'n');
  const std::vector<std::pair<const char*, std::string>> cases = {
      {"garbage", std::string(100, 'x')},
      {"oversize request", big},
      {"wrong proof", opening + std::string(32, 'p')},
      {"opening only, then silence", opening},
      {"silence", ""},
  };
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    const int fd = RawConnect(server->port());
    ASSERT_GE(fd, 0);
    if (!bytes.empty()) SendRaw(fd, bytes);
    auto [reply, closed] = ReadUntilClosed(fd);
    close(fd);
    EXPECT_TRUE(closed);
    // A refusal is a response frame with the error's code (or nothing for silence).
    if (std::string(name) == "oversize request") {
      ASSERT_FALSE(reply.empty());
      EXPECT_EQ(reply[0], static_cast<char>(absl::StatusCode::kUnauthenticated));
    }
    if (std::string(name) == "wrong proof") {
      ASSERT_GT(reply.size(), 9u + 32u);  // the server nonce, then the refusal
      EXPECT_EQ(reply[9 + 32], static_cast<char>(absl::StatusCode::kPermissionDenied));
    }
  }
  auto c = ConnectWith(*server, secret);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Set("healthy", "yes").ok());
  EXPECT_EQ(c->Get("healthy").value_or("error"), "yes");
}

TEST(TcpStoreAuthTest, ShortSecretsAreRejected) {
  EXPECT_EQ(StoreServer::Start("127.0.0.1", 0, absl::Seconds(1), "short").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(StoreClient::Connect("127.0.0.1", server->port(), absl::Seconds(1), "short").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ListenForStore holds the port from the moment it returns: nobody else can bind it, and a
// server started on the socket later serves the clients that connected in between.
TEST(TcpStoreTest, ServerOnAnEarlierBoundSocket) {
  auto listener = ListenForStore("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto taken = StoreServer::Start("127.0.0.1", listener->port);
  EXPECT_FALSE(taken.ok());
  const std::string secret = Secret();
  std::string got;
  std::thread early([&] {  // connects before any server runs
    auto c = StoreClient::Connect("127.0.0.1", listener->port, absl::Seconds(10), secret);
    got = c.ok() ? (*c)->Get("k").value_or("error") : c.status().ToString();
  });
  absl::SleepFor(absl::Milliseconds(200));
  auto server = StoreServer::StartOnSocket(listener->fd, "127.0.0.1", absl::Seconds(30), secret);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->port(), listener->port);
  auto c = ConnectWith(**server, secret);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Set("k", "v").ok());
  early.join();
  EXPECT_EQ(got, "v");
  // Not a listening socket: InvalidArgument (and the fd is closed).
  const int plain = socket(AF_INET, SOCK_STREAM, 0);
  auto bad = StoreServer::StartOnSocket(plain, "127.0.0.1");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
}

// ---- Limits: clients beyond what the server admits are told why, the rest keep serving ----

// Until `deadline`, retries `call` while it fails (the server notices a closed client when it
// next polls).
template <typename Call>
absl::Status EventuallyOk(Call call, absl::Duration within = absl::Seconds(5)) {
  const absl::Time deadline = absl::Now() + within;
  absl::Status st = call();
  while (!st.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    st = call();
  }
  return st;
}

TEST(TcpStoreLimitTest, ClientsBeyondMaxClientsGetResourceExhaustedAndTheOthersServe) {
  for (const bool with_secret : {false, true}) {
    SCOPED_TRACE(with_secret ? "with a secret" : "open");
    const std::string secret = with_secret ? Secret() : "";
    auto server = StoreServer::Start("127.0.0.1", 0, absl::Seconds(30), secret, /*max_clients=*/3);
    ASSERT_TRUE(server.ok()) << server.status();
    auto connect = [&] { return StoreClient::Connect("127.0.0.1", (*server)->port(), absl::Seconds(3), secret); };
    std::vector<std::unique_ptr<StoreClient>> in;
    for (int i = 0; i < 3; ++i) {
      auto c = connect();
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_TRUE((*c)->Set(absl::StrCat("k", i), "v").ok());
      in.push_back(std::move(*c));
    }
    // The fourth: refused with the reason, on Connect (secret) or its first call (open),
    // promptly rather than after its timeout.
    const absl::Time t0 = absl::Now();
    auto fourth = connect();
    absl::Status refused = fourth.ok() ? (*fourth)->Set("k3", "v") : fourth.status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_NE(refused.message().find("holds 3 connections, its limit"), std::string::npos) << refused;
    EXPECT_LT(absl::Now() - t0, absl::Seconds(2)) << refused;
    for (int i = 0; i < 3; ++i) {
      auto v = in[i]->Get(absl::StrCat("k", (i + 1) % 3));
      EXPECT_TRUE(v.ok()) << v.status();
    }
    // A client that leaves makes room for another.
    in[0].reset();
    absl::Status later = EventuallyOk([&]() -> absl::Status {
      auto c = connect();
      return c.ok() ? (*c)->Set("k4", "v") : c.status();
    });
    EXPECT_TRUE(later.ok()) << later;
  }
}

// The default admits a world of more than 1024 ranks (the old limit closed the 1025th
// connection without a word). Needs about two descriptors per client in this process.
TEST(TcpStoreLimitTest, MoreThan1024ClientsAtOnce) {
  constexpr int kClients = 1100;
  rlimit lim{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &lim), 0);
  const rlim_t want = 2 * kClients + 256;
  if (lim.rlim_cur < want) {
    if (lim.rlim_max < want) GTEST_SKIP() << "RLIMIT_NOFILE's hard limit " << lim.rlim_max << " < " << want;
    rlimit raised = lim;
    raised.rlim_cur = want;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &raised), 0);
  }
  {
    auto server = StartServer();
    ASSERT_NE(server, nullptr);
    std::vector<std::unique_ptr<StoreClient>> clients;
    for (int i = 0; i < kClients; ++i) {
      auto c = StoreClient::Connect("127.0.0.1", server->port(), absl::Seconds(10));
      ASSERT_TRUE(c.ok()) << "client " << i << ": " << c.status();
      auto n = (*c)->Add("arrived", 1);
      ASSERT_TRUE(n.ok()) << "client " << i << ": " << n.status();
      EXPECT_EQ(*n, i + 1);
      clients.push_back(std::move(*c));
    }
    // Every connection is still served.
    for (int i = 0; i < kClients; i += 99) {
      EXPECT_EQ(clients[i]->Get("arrived").value_or("error"), absl::StrCat(kClients)) << "client " << i;
    }
  }
  setrlimit(RLIMIT_NOFILE, &lim);
}

// A process out of descriptors (RLIMIT_NOFILE) cannot accept a client at all; the server then
// tells the client so (it used to leave it waiting out its timeout while the listening socket,
// readable and never accepted, kept the server's loop spinning). The server runs in a child
// with a small limit, every descriptor but two taken.
TEST(TcpStoreLimitTest, AServerOutOfDescriptorsTellsTheClientWhyWithoutSpinning) {
  auto listener = ListenForStore("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(ready[0]);
    auto server = StoreServer::StartOnSocket(listener->fd, "127.0.0.1");
    if (!server.ok()) _exit(2);
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = 256;
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) _exit(3);
    std::vector<int> fillers;
    for (int fd; (fd = open("/dev/null", O_RDONLY)) >= 0;) fillers.push_back(fd);
    if (fillers.size() < 2) _exit(4);
    close(fillers.back());
    fillers.pop_back();
    close(fillers.back());
    fillers.pop_back();
    const char b = 1;
    if (write(ready[1], &b, 1) != 1) _exit(5);
    for (;;) pause();  // killed by the parent
  }
  close(listener->fd);
  close(ready[1]);
  char b = 0;
  ASSERT_EQ(read(ready[0], &b, 1), 1) << "the child's server did not start";
  close(ready[0]);
  const int port = listener->port;
  auto connect = [&] { return StoreClient::Connect("127.0.0.1", port, absl::Seconds(3)); };
  std::vector<std::unique_ptr<StoreClient>> in;
  for (int i = 0; i < 2; ++i) {
    auto c = connect();
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->Set(absl::StrCat("k", i), "v").ok());
    in.push_back(std::move(*c));
  }
  auto cpu_ticks = [&] {  // the child's user + system time, in clock ticks
    std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
    std::string line;
    std::getline(stat, line);
    std::istringstream rest(line.substr(line.rfind(')') + 2));
    std::string field;
    long ticks = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {
      if (i >= 14) ticks += std::stol(field);
    }
    return ticks;
  };
  const absl::Time t0 = absl::Now();
  auto third = connect();
  const absl::Status refused = third.ok() ? (*third)->Set("k2", "v") : third.status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("at most 256 files (RLIMIT_NOFILE"), std::string::npos) << refused;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2)) << refused;
  // Idle with a client refused: the server's loop sleeps (a spinning one burns ~100 ticks a second).
  const long before = cpu_ticks();
  absl::SleepFor(absl::Seconds(1));
  EXPECT_LT(cpu_ticks() - before, 20) << "the server's loop spins";
  EXPECT_TRUE(in[1]->Get("k0").ok());
  // A client that leaves frees a descriptor for the next.
  in[0].reset();
  absl::Status later = EventuallyOk([&]() -> absl::Status {
    auto c = connect();
    return c.ok() ? (*c)->Set("k3", "v") : c.status();
  });
  EXPECT_TRUE(later.ok()) << later;
  kill(pid, SIGKILL);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  EXPECT_TRUE(WIFSIGNALED(wstatus)) << "the child exited with " << WEXITSTATUS(wstatus) << " before the test ended";
}

}  // namespace
}  // namespace dtensor
