// TCP key-value store: how the ranks of a multi-process run find each other.
//
// One process (rank 0, "the master") runs a StoreServer; every rank, the master included,
// talks to it through a StoreClient. Transports publish their addresses through it (UCX worker
// addresses, the NCCL unique id), and it doubles as a slow barrier.
//
//   DT_ASSIGN_OR_RETURN(auto server, StoreServer::Start("127.0.0.1", 0));      // rank 0 only
//   DT_ASSIGN_OR_RETURN(auto store, StoreClient::Connect("127.0.0.1", server->port(),
//                                                        absl::Seconds(30)));
//   DT_RETURN_IF_ERROR(store->Set("nccl/id", id_bytes));
//   DT_ASSIGN_OR_RETURN(std::string id, store->Get("nccl/id"));   // blocks until it is set
//   DT_ASSIGN_OR_RETURN(int64_t arrived, store->Add("barrier/0", 1));
//
// Keys are 1..4 KiB of arbitrary bytes, values up to 64 MiB. Add() keeps its counter as a
// decimal string, so Get() of a counter returns e.g. "4". Values are never deleted.
//
// Authentication: a server started with a secret (dtrun makes one per job and passes it to its
// ranks as DTENSOR_STORE_SECRET) admits a client only after a mutual challenge-response on it
// (HMAC-SHA256 over fresh random nonces from both ends; the secret never crosses the socket).
// A client without the secret, or with a wrong one, is refused and its connection closed (the
// server logs the peer's address); the other clients are undisturbed. A client with a secret
// likewise refuses a server that cannot prove it knows the same secret. Without a secret the
// store is open to any process that can connect (bind it to loopback).
//
// Errors: InvalidArgument for keys/values out of bounds; DeadlineExceeded when a call did not
// finish within the client's timeout (names the key and the server's address); Unavailable when
// the server cannot be reached or the connection breaks. After an error the client reconnects
// on its next call. The wire protocol is private to tcp_store.cc (both ends are built from it).
#ifndef DTENSOR_COLLECTIVES_STORE_TCP_STORE_H_
#define DTENSOR_COLLECTIVES_STORE_TCP_STORE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace dtensor {

// Bounds enforced by both ends; a server receiving more drops that connection after an error.
inline constexpr int64_t kStoreMaxKeyBytes = 4096;
inline constexpr int64_t kStoreMaxValueBytes = int64_t{64} << 20;
inline constexpr int kStoreMaxWaitKeys = 1024;  // keys per Wait()
// Connections a server holds at once by default: one per rank, for the largest world a
// transport takes (ucx: 65535 ranks).
inline constexpr int kStoreMaxClients = 65536;
inline constexpr int kStoreMinSecretBytes = 16;  // a shorter non-empty secret is refused

// The environment variable that carries a job's store secret from dtrun to its ranks.
inline constexpr char kStoreSecretEnv[] = "DTENSOR_STORE_SECRET";
// A fresh random secret: 64 hex digits (32 bytes from OpenSSL's CSPRNG). Unavailable if the
// generator fails.
absl::StatusOr<std::string> NewStoreSecret();

// A bound, listening TCP socket for a StoreServer that starts later, possibly in another
// process: dtrun binds the store's port and hands the socket to rank 0 (DTENSOR_STORE_FD), so
// no other process can take the port in between. The fd is close-on-exec; the caller owns it.
struct StoreListener {
  int fd = -1;
  int port = 0;
};
// host and port as for StoreServer::Start (port 0: a free one).
absl::StatusOr<StoreListener> ListenForStore(const std::string& host, int port);
// The port of a listening TCP socket, or -1 if fd is not one.
int ListeningPort(int fd);

// Serves one store from a background thread (one poll loop; blocked Get/Wait calls are parked
// in the server, not in threads). Binds only the given address. Destruction stops the thread and
// closes every connection; clients still blocked then get Unavailable.
class StoreServer {
 public:
  // host: a numeric address or a name that resolves locally (e.g. "127.0.0.1", "localhost").
  // port 0 picks a free port; port() reports it. A connection that sent part of a message and
  // then nothing for `message_timeout` is closed (half-sent messages would otherwise hold one
  // of the max_clients places for ever); idle connections between messages stay.
  // A non-empty `secret` (at least kStoreMinSecretBytes bytes) makes the server authenticate
  // every client; a connection that has not completed authentication within `message_timeout`
  // is closed too.
  // A client beyond `max_clients` connections held at once, or one the process has no file
  // descriptor left for (RLIMIT_NOFILE; the server holds one per client), is answered
  // ResourceExhausted naming the limit, on its first call (a client with a secret: on
  // Connect), and closed; the server logs it. The clients already in are undisturbed.
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(const std::string& host, int port,
                                                            absl::Duration message_timeout = absl::Seconds(30),
                                                            std::string secret = {},
                                                            int max_clients = kStoreMaxClients);
  // The same on a socket from ListenForStore() (or inherited from dtrun); takes ownership of
  // listen_fd (also on error). InvalidArgument if it is not a listening socket.
  static absl::StatusOr<std::unique_ptr<StoreServer>> StartOnSocket(int listen_fd, const std::string& host,
                                                                    absl::Duration message_timeout = absl::Seconds(30),
                                                                    std::string secret = {},
                                                                    int max_clients = kStoreMaxClients);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  const std::string& host() const { return host_; }
  int port() const { return port_; }
  bool authenticated() const { return !secret_.empty(); }

  struct State;  // private to tcp_store.cc

 private:
  StoreServer(std::string host, int port, int listen_fd, int wake_read_fd, int wake_write_fd);
  void Loop();

  std::string host_;
  int port_;
  absl::Duration message_timeout_ = absl::Seconds(30);
  std::string secret_;
  int listen_fd_;
  int wake_read_fd_;
  int wake_write_fd_;
  std::unique_ptr<State> state_;
  std::thread thread_;
};

// A connection to a StoreServer. Thread-safe (calls are serialized on one connection).
class StoreClient {
 public:
  // Connects, retrying until `timeout` while the server is not up yet (ranks start in any
  // order). `timeout` also becomes the timeout of every later call. With a non-empty `secret`
  // every connection (also a reconnection) first authenticates with the server, both ways.
  static absl::StatusOr<std::unique_ptr<StoreClient>> Connect(const std::string& host, int port, absl::Duration timeout,
                                                              std::string secret = {});
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  // Sets key to value (overwriting), and wakes every Get/Wait blocked on it.
  absl::Status Set(std::string_view key, std::string_view value);
  // The value of key, waiting up to timeout() for some rank to set it.
  absl::StatusOr<std::string> Get(std::string_view key);
  // Atomically adds delta to the counter at key (absent counts as 0) and returns the new value.
  // FailedPrecondition if the key holds something that is not a decimal int64.
  absl::StatusOr<int64_t> Add(std::string_view key, int64_t delta);
  // Waits up to timeout() until every key exists (1..kStoreMaxWaitKeys keys).
  absl::Status Wait(absl::Span<const std::string> keys);
  // Closes the connection; a later call reconnects. Idempotent.
  void Close();

  void SetTimeout(absl::Duration timeout);
  absl::Duration timeout() const;
  const std::string& host() const { return host_; }
  int port() const { return port_; }
  bool authenticated() const { return !secret_.empty(); }

  // Makes this client own `server` (the master's store); it is shut down after this client's
  // connection is closed, on destruction.
  void AdoptServer(std::unique_ptr<StoreServer> server);

 private:
  StoreClient(std::string host, int port, absl::Duration timeout, std::string secret);
  // Sends one request and reads its response; `what` names the call in errors.
  absl::StatusOr<std::string> Call(uint8_t op, absl::Span<const std::string_view> fields, const std::string& what);
  absl::Status EnsureConnected(absl::Time deadline);
  // The client's side of the handshake on a fresh connection `fd`.
  absl::Status Authenticate(int fd, absl::Time deadline);
  void CloseLocked();

  const std::string host_;
  const int port_;
  const std::string secret_;
  mutable std::mutex mu_;
  absl::Duration timeout_;
  int fd_ = -1;
  std::unique_ptr<StoreServer> server_;  // destroyed after fd_ is closed
};

// The server's parse of the request at the front of `bytes`, for tests and fuzzing (the wire
// format stays private): the number of bytes the first request takes when `bytes` starts with a
// whole valid one; 0 when it starts with a valid prefix and more bytes are needed; otherwise
// InvalidArgument with the reason the server gives when it drops the connection.
absl::StatusOr<size_t> ParseStoreRequest(std::string_view bytes);

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_STORE_TCP_STORE_H_
