#include "dtensor/collectives/store/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dtensor/tensor/status.h"

namespace dtensor {

// ---- Wire protocol ----
// Request:  u32 magic | u8 op | u32 field_count | field_count x (u64 length | bytes)
// Response: u8 status (an absl::StatusCode) | u64 length | bytes (value, or error message)
// All integers little-endian. SET (key, value); GET (key) -> value; ADD (key, i64 delta) ->
// i64 new value; WAIT (key...) -> empty. GET and WAIT are answered once their keys exist.
//
// Authentication, when the server has a secret, before any request (nc, ns: 32 random bytes
// from the client and the server; HMAC is HMAC-SHA256 keyed with the secret):
//   client: u32 kAuthMagic | nc
//   server: response OK, payload ns
//   client: HMAC("dtensor-store client" | nc | ns)
//   server: response OK, payload HMAC("dtensor-store server" | nc | ns); or, if the client's
//           proof is wrong, PermissionDenied, and it closes the connection (and logs the peer)
//   client: admitted once the server's proof checks out (else it closes: PermissionDenied)
// A server with a secret answers a request sent without this with Unauthenticated and closes;
// a server without one answers the client's opening the same way. Labels keep either proof
// from serving as the other; fresh nonces on both sides keep a recorded exchange from being
// replayed. MACs are compared in constant time (CRYPTO_memcmp).
namespace {

constexpr uint32_t kMagic = 0x31535444;  // "DTS1"
constexpr uint8_t kOpSet = 1;
constexpr uint8_t kOpGet = 2;
constexpr uint8_t kOpAdd = 3;
constexpr uint8_t kOpWait = 4;
constexpr size_t kRequestHeader = 9;
constexpr size_t kResponseHeader = 9;
constexpr uint32_t kAuthMagic = 0x31415444;  // "DTA1"
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;  // SHA-256
constexpr char kServerLabel[] = "dtensor-store server";
constexpr char kClientLabel[] = "dtensor-store client";

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLE(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string EncodeResponse(absl::StatusCode code, std::string_view payload) {
  std::string out;
  out.reserve(kResponseHeader + payload.size());
  out.push_back(static_cast<char>(code));
  PutU64(out, payload.size());
  out.append(payload);
  return out;
}

std::string EncodeI64(int64_t v) {
  std::string s;
  PutU64(s, static_cast<uint64_t>(v));
  return s;
}

// A key for error messages: printable, at most ~80 characters.
std::string Printable(std::string_view key) {
  std::string out = "'";
  for (size_t i = 0; i < key.size() && i < 80; ++i) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (key.size() > 80) out += "...";
  return out + "'";
}

std::string Errno(int err) { return std::strerror(err); }

absl::Status CheckKey(std::string_view key) {
  if (key.empty() || static_cast<int64_t>(key.size()) > kStoreMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("[TcpStore] key ", Printable(key), " has ", key.size(),
                                                   " bytes; keys must have 1..", kStoreMaxKeyBytes));
  }
  return absl::OkStatus();
}

// Resolves host:port (numeric or name) to socket addresses, IPv4 first.
absl::StatusOr<std::vector<std::pair<sockaddr_storage, socklen_t>>> Resolve(const std::string& host, int port,
                                                                            bool passive) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("[TcpStore] port ", port, " is outside 0..65535"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("[TcpStore] cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<std::pair<sockaddr_storage, socklen_t>> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    sockaddr_storage ss{};
    std::memcpy(&ss, a->ai_addr, a->ai_addrlen);
    out.emplace_back(ss, a->ai_addrlen);
  }
  freeaddrinfo(res);
  std::stable_sort(out.begin(), out.end(), [](const auto& x, const auto& y) {
    return x.first.ss_family == AF_INET && y.first.ss_family != AF_INET;
  });
  if (out.empty()) return absl::UnavailableError(absl::StrCat("[TcpStore] '", host, "' has no address"));
  return out;
}

// poll()'s timeout for `deadline`: -1 (no limit) for an infinite one; long ones are capped at
// 2^30 ms, so a caller whose poll returns 0 checks the deadline before it gives up.
int MillisUntil(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  if (left >= absl::Milliseconds(1 << 30)) return 1 << 30;
  return static_cast<int>(absl::ToInt64Milliseconds(left) + 1);
}

absl::StatusOr<std::string> RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    return absl::UnavailableError("[TcpStore] OpenSSL's random generator failed");
  }
  return out;
}

// HMAC-SHA256(secret, label | nc | ns).
std::string Mac(const std::string& secret, const char* label, const std::string& nc, const std::string& ns) {
  const std::string msg = absl::StrCat(label, nc, ns);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac, &len) == nullptr ||
      len != kMacBytes) {
    return "";  // equal to no MAC (SameMac wants kMacBytes)
  }
  return std::string(reinterpret_cast<const char*>(mac), len);
}

bool SameMac(std::string_view a, std::string_view b) {
  return a.size() == kMacBytes && b.size() == kMacBytes && CRYPTO_memcmp(a.data(), b.data(), kMacBytes) == 0;
}

absl::Status CheckSecret(const std::string& secret) {
  if (!secret.empty() && static_cast<int64_t>(secret.size()) < kStoreMinSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("[TcpStore] a store secret of ", secret.size(),
                                                   " bytes is too short; use at least ", kStoreMinSecretBytes));
  }
  return absl::OkStatus();
}

std::string PeerName(const sockaddr_storage& ss) {
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&ss), sizeof(ss), host, sizeof(host), port, sizeof(port),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "an unknown address";
  }
  return ss.ss_family == AF_INET6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

// Blocking I/O on a non-blocking socket until `deadline`: 0 done, 1 timed out, 2 failed
// (errno tells), 3 closed by the peer (RecvAll only).
int SendAll(int fd, std::string_view bytes, absl::Time deadline) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN) return 2;
    pollfd p{fd, POLLOUT, 0};
    const int pr = poll(&p, 1, MillisUntil(deadline));
    if (pr == 0 && absl::Now() >= deadline) return 1;
    if (pr < 0 && errno != EINTR) return 2;
  }
  return 0;
}

int RecvAll(int fd, char* dst, size_t n, absl::Time deadline) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = recv(fd, dst + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return 3;
    if (errno == EINTR) continue;
    if (errno != EAGAIN) return 2;
    pollfd p{fd, POLLIN, 0};
    const int pr = poll(&p, 1, MillisUntil(deadline));
    if (pr == 0 && absl::Now() >= deadline) return 1;
    if (pr < 0 && errno != EINTR) return 2;
  }
  return 0;
}

}  // namespace

absl::StatusOr<std::string> NewStoreSecret() {
  DT_ASSIGN_OR_RETURN(std::string bytes, RandomBytes(32));
  return absl::BytesToHexString(bytes);
}

int ListeningPort(int fd) {
  int listening = 0;
  socklen_t len = sizeof(listening);
  sockaddr_storage ss{};
  socklen_t ss_len = sizeof(ss);
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || listening == 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &ss_len) != 0) {
    return -1;
  }
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return -1;
}

absl::StatusOr<StoreListener> ListenForStore(const std::string& host, int port) {
  DT_ASSIGN_OR_RETURN(auto addrs, Resolve(host, port, /*passive=*/true));
  std::string last_error;
  for (auto& [addr, len] : addrs) {
    const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      last_error = Errno(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 512) != 0) {
      last_error = Errno(errno);
      close(fd);
      continue;
    }
    return StoreListener{.fd = fd, .port = ListeningPort(fd)};
  }
  return absl::UnavailableError(absl::StrCat("[TcpStore] cannot listen on ", host, ":", port, ": ", last_error));
}

namespace {}  // namespace

// ---- Server ----

namespace {

// Replies a connection may have waiting to be sent before the server stops reading and
// answering its requests (a client that pipelines requests without reading the replies would
// otherwise make the server hold a copy of a 64 MiB value per request).
constexpr size_t kMaxUnsentBytes = size_t{1} << 20;
// Connections refused for want of room whose reason is still being delivered; past this many a
// further one is closed at once.
constexpr int kMaxRefusing = 64;

struct Conn {
  int fd = -1;
  std::string in;   // bytes received, not yet parsed
  std::string out;  // bytes to send
  size_t out_sent = 0;
  bool backlogged() const { return out.size() - out_sent > kMaxUnsentBytes; }
  // Since when the client has been the one to act: bytes arrived, or replies moved out.
  absl::Time last_progress = absl::Now();
  bool partial = false;  // the last parse found part of a message and wanted more
  // The client owes the rest of a message: a parse wanted more, nothing is parked, and every
  // reply has gone out (a request held back behind replies is the server's turn, not this).
  // Until it is admitted a client always owes the next step of the handshake.
  bool mid_message() const {
    return (partial || auth_stage < 2) && !closing && pending_op == 0 && out_sent >= out.size();
  }
  bool closing = false;  // close once `out` is sent; read nothing more
  // A refused client: once the reason is sent, the server shuts its side down and discards what
  // the client still sends until it closes (or message_timeout passes). Closing with unread
  // bytes would reset the connection, and the client could lose the reason.
  bool linger = false;
  bool draining = false;
  // Authentication (servers with a secret): 0 expects the client's opening, 1 its proof,
  // 2 admitted (where connections to a server without a secret start).
  int auth_stage = 2;
  std::string nonce_c, nonce_s;
  std::string peer;            // the client's address, for the log
  bool over_limit = false;     // refused for want of room: not counted against max_clients
  bool holds_reserve = false;  // accepted on the server's reserve descriptor (see reserve_fd)
  // A parked GET (one key) or WAIT (its keys), answered once every key exists.
  uint8_t pending_op = 0;
  std::vector<std::string> pending_keys;
};

// Outcome of parsing the front of a connection's input.
enum class Parse { kNeedMore, kMessage, kDrop, kErrorAndClose };

struct Request {
  uint8_t op = 0;
  std::vector<std::string> fields;
  size_t consumed = 0;
};

// Parses one request from `in`, checking every bound as soon as its header bytes are there, so
// an oversize message is rejected before its body is buffered.
Parse ParseRequest(const std::string& in, Request& req, std::string& error) {
  if (in.size() >= 4 && GetLE(in.data(), 4) != kMagic) {
    error = "bad magic";
    return Parse::kDrop;
  }
  if (in.size() < kRequestHeader) return Parse::kNeedMore;
  const uint8_t op = static_cast<uint8_t>(in[4]);
  const uint64_t count = GetLE(in.data() + 5, 4);
  bool count_ok = false;
  switch (op) {
    case kOpSet:
    case kOpAdd:
      count_ok = count == 2;
      break;
    case kOpGet:
      count_ok = count == 1;
      break;
    case kOpWait:
      count_ok = count >= 1 && count <= static_cast<uint64_t>(kStoreMaxWaitKeys);
      break;
    default:
      error = absl::StrCat("unknown op ", op);
      return Parse::kDrop;
  }
  if (!count_ok) {
    error = absl::StrCat("op ", op, " with ", count, " fields");
    return Parse::kDrop;
  }
  size_t pos = kRequestHeader;
  std::vector<std::pair<size_t, size_t>> spans;
  for (uint64_t i = 0; i < count; ++i) {
    if (in.size() < pos + 8) return Parse::kNeedMore;
    const uint64_t len = GetLE(in.data() + pos, 8);
    pos += 8;
    const bool is_value = (op == kOpSet && i == 1);
    const bool is_delta = (op == kOpAdd && i == 1);
    if (is_delta && len != 8) {
      error = absl::StrCat("ADD delta of ", len, " bytes (want 8)");
      return Parse::kErrorAndClose;
    }
    if (!is_value && !is_delta && (len == 0 || len > static_cast<uint64_t>(kStoreMaxKeyBytes))) {
      error = absl::StrCat("key of ", len, " bytes; keys must have 1..", kStoreMaxKeyBytes);
      return Parse::kErrorAndClose;
    }
    if (is_value && len > static_cast<uint64_t>(kStoreMaxValueBytes)) {
      error = absl::StrCat("value of ", len, " bytes exceeds ", kStoreMaxValueBytes);
      return Parse::kErrorAndClose;
    }
    if (in.size() < pos + len) return Parse::kNeedMore;
    spans.emplace_back(pos, len);
    pos += len;
  }
  req.op = op;
  req.fields.clear();
  for (const auto& [start, len] : spans) req.fields.emplace_back(in, start, len);
  req.consumed = pos;
  return Parse::kMessage;
}

}  // namespace

absl::StatusOr<size_t> ParseStoreRequest(std::string_view bytes) {
  Request req;
  std::string error;
  switch (ParseRequest(std::string(bytes), req, error)) {
    case Parse::kNeedMore:
      return size_t{0};
    case Parse::kMessage:
      return req.consumed;
    case Parse::kDrop:
    case Parse::kErrorAndClose:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("[ParseStoreRequest] ", error));
}

struct StoreServer::State {
  std::unordered_map<std::string, std::string> data;
  std::map<int, Conn> conns;  // by fd
  bool stop = false;
  std::string secret;  // empty: no authentication
  std::string where;   // host:port, for messages
  int max_clients = kStoreMaxClients;
  int over_limit = 0;  // connections in `conns` refused for want of room, until they close
  // Held open so that when the process runs out of descriptors (EMFILE) the server can still
  // accept a client to tell it so; otherwise the listening socket stays readable and the
  // loop spins while the client waits out its timeout.
  int reserve_fd = -1;
  absl::Time accept_paused_until = absl::InfinitePast();  // without a reserve: not to spin on EMFILE

  // Answers `c` with an error, closes it once that is sent, and logs the refusal.
  void Refuse(Conn& c, absl::StatusCode code, const std::string& why) {
    std::fprintf(stderr, "[TcpStore] store at %s refused the client at %s: %s\n", where.c_str(), c.peer.c_str(),
                 why.c_str());
    c.out += EncodeResponse(code, absl::StrCat("the store at ", where, " refused this client: ", why));
    c.closing = true;
    c.linger = true;
    c.in.clear();
  }

  // The process has no descriptor left for the client waiting on `listen_fd`: accepts it on the
  // reserve's descriptor and tells it why (the reserve is opened again once it has closed).
  // `err` is accept's errno.
  void RefuseForWantOfFiles(int listen_fd, int err) {
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    const std::string why =
        err == ENFILE ? std::string("the system's open-file table is full (ENFILE)")
                      : absl::StrCat("its process may open at most ", lim.rlim_cur,
                                     " files (RLIMIT_NOFILE; it needs one per client: raise `ulimit -n` for rank 0)");
    if (reserve_fd < 0) {  // in use: the client waits (or times out) until a descriptor frees
      accept_paused_until = absl::Now() + absl::Milliseconds(100);
      return;
    }
    const int connected = static_cast<int>(conns.size()) - over_limit;
    close(reserve_fd);
    reserve_fd = -1;
    sockaddr_storage peer{};
    socklen_t peer_len = sizeof(peer);
    const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&peer), &peer_len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
      return;
    }
    Conn& c = conns[fd];
    c.fd = fd;
    c.peer = PeerName(peer);
    c.over_limit = true;
    c.holds_reserve = true;
    ++over_limit;
    Refuse(c, absl::StatusCode::kResourceExhausted, absl::StrCat(why, "; ", connected, " clients connected"));
  }

  // Advances `c`'s handshake with what it sent; true once it is admitted.
  bool Authenticate(Conn& c) {
    if (c.auth_stage == 0) {
      if (c.in.size() >= 4 && GetLE(c.in.data(), 4) != kAuthMagic) {
        Refuse(c, absl::StatusCode::kUnauthenticated,
               GetLE(c.in.data(), 4) == kMagic
                   ? absl::StrCat("it sent a request without authenticating (the store requires the job's secret, ",
                                  kStoreSecretEnv, ")")
                   : "it sent something that is not a store handshake");
        return false;
      }
      if (c.in.size() < 4 + kNonceBytes) return false;
      c.nonce_c = c.in.substr(4, kNonceBytes);
      c.in.erase(0, 4 + kNonceBytes);
      absl::StatusOr<std::string> nonce = RandomBytes(kNonceBytes);
      if (!nonce.ok()) {
        Refuse(c, absl::StatusCode::kUnavailable, std::string(nonce.status().message()));
        return false;
      }
      c.nonce_s = *std::move(nonce);
      c.out += EncodeResponse(absl::StatusCode::kOk, c.nonce_s);
      c.auth_stage = 1;
    }
    if (c.auth_stage == 1) {
      if (c.in.size() < kMacBytes) return false;
      if (!SameMac(c.in.substr(0, kMacBytes), Mac(secret, kClientLabel, c.nonce_c, c.nonce_s))) {
        Refuse(c, absl::StatusCode::kPermissionDenied,
               absl::StrCat("its proof does not match the store's secret (", kStoreSecretEnv, " differs)"));
        return false;
      }
      c.in.erase(0, kMacBytes);
      c.out += EncodeResponse(absl::StatusCode::kOk, Mac(secret, kServerLabel, c.nonce_c, c.nonce_s));
      c.auth_stage = 2;
    }
    return true;
  }

  // Answers `c`'s parked request if all its keys exist now.
  void TryAnswer(Conn& c) {
    if (c.pending_op == 0) return;
    for (const std::string& k : c.pending_keys) {
      if (!data.contains(k)) return;
    }
    c.out += EncodeResponse(absl::StatusCode::kOk, c.pending_op == kOpGet ? data[c.pending_keys[0]] : "");
    c.pending_op = 0;
    c.pending_keys.clear();
  }
  void WakeWaiters() {
    for (auto& [fd, c] : conns) TryAnswer(c);
  }

  // Executes one request; may park it.
  void Execute(Conn& c, Request& req) {
    switch (req.op) {
      case kOpSet:
        data[req.fields[0]] = std::move(req.fields[1]);
        c.out += EncodeResponse(absl::StatusCode::kOk, "");
        WakeWaiters();
        return;
      case kOpAdd: {
        const int64_t delta = static_cast<int64_t>(GetLE(req.fields[1].data(), 8));
        int64_t current = 0;
        auto it = data.find(req.fields[0]);
        if (it != data.end() && !absl::SimpleAtoi(it->second, &current)) {
          c.out += EncodeResponse(absl::StatusCode::kFailedPrecondition,
                                  absl::StrCat("key ", Printable(req.fields[0]), " holds a non-integer value"));
          return;
        }
        int64_t next = 0;
        if (__builtin_add_overflow(current, delta, &next)) {
          c.out += EncodeResponse(absl::StatusCode::kOutOfRange, absl::StrCat("counter ", Printable(req.fields[0]),
                                                                              " overflows: ", current, " + ", delta));
          return;
        }
        data[req.fields[0]] = std::to_string(next);
        c.out += EncodeResponse(absl::StatusCode::kOk, EncodeI64(next));
        WakeWaiters();
        return;
      }
      case kOpGet:
      case kOpWait:
        c.pending_op = req.op;
        c.pending_keys = std::move(req.fields);
        TryAnswer(c);
        return;
      default:
        return;  // unreachable: ParseRequest validated the op
    }
  }

  // Parses and executes what `c` has buffered, one request at a time (a parked request blocks
  // the ones behind it).
  void Process(Conn& c) {
    if (c.auth_stage < 2 && !c.closing && !Authenticate(c)) return;
    if (secret.empty() && c.in.size() >= 4 && GetLE(c.in.data(), 4) == kAuthMagic) {
      Refuse(c, absl::StatusCode::kUnauthenticated,
             absl::StrCat("it wants to authenticate but this store has no secret (", kStoreSecretEnv, " unset)"));
      return;
    }
    while (!c.closing && c.pending_op == 0 && !c.backlogged()) {
      Request req;
      std::string error;
      const Parse p = ParseRequest(c.in, req, error);
      c.partial = p == Parse::kNeedMore && !c.in.empty();
      if (p == Parse::kNeedMore) return;
      if (p == Parse::kDrop) {
        c.closing = true;
        c.out.clear();
        c.out_sent = 0;
        return;
      }
      if (p == Parse::kErrorAndClose) {
        c.out += EncodeResponse(absl::StatusCode::kInvalidArgument, error);
        c.closing = true;
        c.in.clear();
        return;
      }
      c.in.erase(0, req.consumed);
      Execute(c, req);
    }
  }
};

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& host, int port,
                                                                absl::Duration message_timeout, std::string secret,
                                                                int max_clients) {
  DT_RETURN_IF_ERROR(CheckSecret(secret));
  DT_ASSIGN_OR_RETURN(StoreListener listener, ListenForStore(host, port));
  return StartOnSocket(listener.fd, host, message_timeout, std::move(secret), max_clients);
}

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::StartOnSocket(int listen_fd, const std::string& host,
                                                                        absl::Duration message_timeout,
                                                                        std::string secret, int max_clients) {
  const int actual_port = ListeningPort(listen_fd);
  if (actual_port < 0) {
    if (listen_fd >= 0) close(listen_fd);
    return absl::InvalidArgumentError(
        absl::StrCat("[TcpStore] fd ", listen_fd, " is not a listening socket (for the store on ", host, ")"));
  }
  if (absl::Status st = CheckSecret(secret); !st.ok()) {
    close(listen_fd);
    return st;
  }
  if (max_clients < 1) {
    close(listen_fd);
    return absl::InvalidArgumentError(absl::StrCat("[TcpStore] max_clients ", max_clients, " must be at least 1"));
  }
  // An inherited socket may be blocking and inheritable: the loop accepts until EAGAIN.
  fcntl(listen_fd, F_SETFL, fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
  fcntl(listen_fd, F_SETFD, FD_CLOEXEC);
  int wake[2];
  if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    const int err = errno;
    close(listen_fd);
    return absl::UnavailableError(absl::StrCat("[TcpStore] pipe: ", Errno(err)));
  }
  std::unique_ptr<StoreServer> server(new StoreServer(host, actual_port, listen_fd, wake[0], wake[1]));
  server->message_timeout_ = message_timeout;
  server->secret_ = secret;
  server->state_->secret = std::move(secret);
  server->state_->where = absl::StrCat(host, ":", actual_port);
  server->state_->max_clients = max_clients;
  server->state_->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

StoreServer::StoreServer(std::string host, int port, int listen_fd, int wake_read_fd, int wake_write_fd)
    : host_(std::move(host)),
      port_(port),
      listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      state_(std::make_unique<State>()) {}

StoreServer::~StoreServer() {
  const char b = 1;
  while (write(wake_write_fd_, &b, 1) < 0 && errno == EINTR) {
  }
  if (thread_.joinable()) thread_.join();
  for (auto& [fd, c] : state_->conns) close(fd);
  if (state_->reserve_fd >= 0) close(state_->reserve_fd);
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void StoreServer::Loop() {
  State& st = *state_;
  std::vector<pollfd> pfds;
  std::vector<char> buf(1 << 16);
  for (;;) {
    pfds.clear();
    pfds.push_back({wake_read_fd_, POLLIN, 0});
    const bool accepting = absl::Now() >= st.accept_paused_until;
    pfds.push_back({listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0});
    for (auto& [fd, c] : st.conns) {
      short events = (c.closing && !c.draining) || c.backlogged() ? 0 : POLLIN;
      if (c.out_sent < c.out.size()) events |= POLLOUT;
      pfds.push_back({fd, events, 0});
    }
    // Wake for the first half-sent message to expire.
    absl::Time expiry = accepting ? absl::InfiniteFuture() : st.accept_paused_until;
    for (auto& [fd, c] : st.conns) {
      if (c.mid_message() || c.draining) expiry = std::min(expiry, c.last_progress + message_timeout_);
    }
    const int wait_ms =
        expiry == absl::InfiniteFuture()
            ? -1
            : static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(expiry - absl::Now()) + 1, 0, 60'000));
    if (poll(pfds.data(), pfds.size(), wait_ms) < 0) {
      if (errno == EINTR) continue;
      return;  // cannot happen with valid fds; the destructor still cleans up
    }
    if (pfds[0].revents != 0) return;  // shutdown
    if (pfds[1].revents & POLLIN) {
      for (int i = 0; i < 64; ++i) {
        sockaddr_storage peer{};
        socklen_t peer_len = sizeof(peer);
        const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &peer_len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE) st.RefuseForWantOfFiles(listen_fd_, errno);
          break;
        }
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        const bool full = static_cast<int>(st.conns.size()) - st.over_limit >= st.max_clients;
        if (full && st.over_limit >= kMaxRefusing) {
          close(fd);  // refusals still being delivered are bounded too
          continue;
        }
        Conn& c = st.conns[fd];
        c.fd = fd;
        c.peer = PeerName(peer);
        if (!st.secret.empty()) c.auth_stage = 0;
        if (full) {
          c.over_limit = true;
          ++st.over_limit;
          st.Refuse(c, absl::StatusCode::kResourceExhausted,
                    absl::StrCat("it holds ", st.max_clients,
                                 " connections, its limit (one per rank: is the world larger than the store admits?)"));
        }
      }
    }
    std::vector<int> dead;
    for (size_t i = 2; i < pfds.size(); ++i) {
      const int fd = pfds[i].fd;
      auto it = st.conns.find(fd);
      if (it == st.conns.end()) continue;
      Conn& c = it->second;
      const short rev = pfds[i].revents;
      if (rev & (POLLERR | POLLNVAL)) {
        dead.push_back(fd);
        continue;
      }
      if (c.draining) {
        if (rev & (POLLIN | POLLHUP)) {
          const ssize_t n = read(fd, buf.data(), buf.size());
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) dead.push_back(fd);
        }
        continue;
      }
      if ((rev & (POLLIN | POLLHUP)) && !c.closing) {
        const ssize_t n = read(fd, buf.data(), buf.size());
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          dead.push_back(fd);
          continue;
        }
        if (n > 0) {
          c.last_progress = absl::Now();
          c.in.append(buf.data(), static_cast<size_t>(n));
          // A client must not pipeline past a parked request; bound what it may buffer.
          if (c.pending_op != 0 && c.in.size() > (1u << 20)) {
            dead.push_back(fd);
            continue;
          }
          st.Process(c);
        }
      } else if ((rev & POLLHUP) && c.closing && c.out_sent >= c.out.size()) {
        dead.push_back(fd);
        continue;
      }
    }
    // Sends (also for connections answered by another connection's SET/ADD above).
    for (auto& [fd, c] : st.conns) {
      if (c.draining) continue;
      // Requests behind a parked one, or held back while replies were backlogged: answered as
      // long as the replies drain.
      for (bool failed = false; !failed;) {
        const size_t unparsed = c.in.size();
        const bool tried = c.pending_op == 0 && !c.closing && !c.in.empty() && !c.backlogged();
        if (tried) st.Process(c);
        while (c.out_sent < c.out.size()) {
          const ssize_t n = send(fd, c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL);
          if (n > 0) {
            c.out_sent += static_cast<size_t>(n);
            c.last_progress = absl::Now();  // a slow reader is not a half-sent message
            continue;
          }
          if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
          dead.push_back(fd);
          failed = true;
          break;
        }
        if (failed || c.out_sent < c.out.size()) break;  // POLLOUT brings us back
        c.out.clear();
        c.out_sent = 0;
        if (c.closing) {
          if (c.linger) {
            shutdown(fd, SHUT_WR);
            c.draining = true;
            c.last_progress = absl::Now();
          } else {
            dead.push_back(fd);
          }
          break;
        }
        if (c.in.empty() || c.pending_op != 0 || (tried && c.in.size() == unparsed)) break;  // nothing to answer now
      }
    }
    const absl::Time now = absl::Now();
    for (auto& [fd, c] : st.conns) {
      if ((c.mid_message() || c.draining) && now - c.last_progress >= message_timeout_) dead.push_back(fd);
    }
    std::sort(dead.begin(), dead.end());
    dead.erase(std::unique(dead.begin(), dead.end()), dead.end());
    for (const int fd : dead) {
      close(fd);
      auto it = st.conns.find(fd);
      if (it != st.conns.end() && it->second.over_limit) --st.over_limit;
      if (it != st.conns.end() && it->second.holds_reserve) st.reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
      st.conns.erase(fd);
    }
  }
}

// ---- Client ----

StoreClient::StoreClient(std::string host, int port, absl::Duration timeout, std::string secret)
    : host_(std::move(host)), port_(port), secret_(std::move(secret)), timeout_(timeout) {}

StoreClient::~StoreClient() {
  Close();
  server_.reset();
}

absl::StatusOr<std::unique_ptr<StoreClient>> StoreClient::Connect(const std::string& host, int port,
                                                                  absl::Duration timeout, std::string secret) {
  if (port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("[TcpStore] port ", port, " is outside 1..65535"));
  }
  DT_RETURN_IF_ERROR(CheckSecret(secret));
  std::unique_ptr<StoreClient> client(new StoreClient(host, port, timeout, std::move(secret)));
  std::lock_guard<std::mutex> lock(client->mu_);
  DT_RETURN_IF_ERROR(client->EnsureConnected(absl::Now() + timeout));
  return client;
}

void StoreClient::AdoptServer(std::unique_ptr<StoreServer> server) {
  std::lock_guard<std::mutex> lock(mu_);
  server_ = std::move(server);
}

void StoreClient::SetTimeout(absl::Duration timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  timeout_ = timeout;
}

absl::Duration StoreClient::timeout() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timeout_;
}

void StoreClient::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  CloseLocked();
}

void StoreClient::CloseLocked() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

absl::Status StoreClient::EnsureConnected(absl::Time deadline) {
  if (fd_ >= 0) return absl::OkStatus();
  DT_ASSIGN_OR_RETURN(auto addrs, Resolve(host_, port_, /*passive=*/false));
  std::string last_error = "timed out";
  absl::Duration backoff = absl::Milliseconds(10);
  // Bounded by the deadline: each attempt waits at most until it.
  for (;;) {
    for (auto& [addr, len] : addrs) {
      const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) {
        last_error = Errno(errno);
        continue;
      }
      int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), len);
      int err = rc == 0 ? 0 : errno;
      if (rc != 0 && err == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        const int pr = poll(&p, 1, MillisUntil(deadline));
        if (pr <= 0) {
          err = pr == 0 ? ETIMEDOUT : errno;
        } else {
          socklen_t elen = sizeof(err);
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
        }
      }
      if (err == 0) {
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        if (!secret_.empty()) {
          // A refusal is final: retrying with the same secret cannot succeed.
          if (absl::Status st = Authenticate(fd, deadline); !st.ok()) {
            close(fd);
            return st;
          }
        }
        fd_ = fd;
        return absl::OkStatus();
      }
      last_error = Errno(err);
      close(fd);
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(200));
  }
  return absl::UnavailableError(absl::StrCat("[TcpStore] cannot connect to ", host_, ":", port_, " within ",
                                             absl::FormatDuration(timeout_), ": ", last_error));
}

absl::Status StoreClient::Authenticate(int fd, absl::Time deadline) {
  const std::string where = absl::StrCat(host_, ":", port_);
  auto io_error = [&](int rc, const char* step) {
    if (rc == 1) {
      return absl::DeadlineExceededError(absl::StrCat("[TcpStore] authenticating to the store at ", where,
                                                      ": no answer to the ", step, " within ",
                                                      absl::FormatDuration(timeout_)));
    }
    if (rc == 3) {
      return absl::UnauthenticatedError(absl::StrCat("[TcpStore] the store at ", where,
                                                     " closed the connection after the ", step,
                                                     " (does it hold the same secret, ", kStoreSecretEnv, "?)"));
    }
    return absl::UnavailableError(
        absl::StrCat("[TcpStore] authenticating to the store at ", where, ": ", step, " failed: ", Errno(errno)));
  };
  // One response frame; its status if it is not OK.
  auto read_response = [&](const char* step) -> absl::StatusOr<std::string> {
    char head[kResponseHeader];
    if (const int rc = RecvAll(fd, head, sizeof(head), deadline); rc != 0) return io_error(rc, step);
    const uint8_t code = static_cast<uint8_t>(head[0]);
    const uint64_t len = GetLE(head + 1, 8);
    if (len > 4096 || code > 16) {
      return absl::UnauthenticatedError(
          absl::StrCat("[TcpStore] the store at ", where, " answered the ", step, " with a malformed response"));
    }
    std::string payload(len, '\0');
    if (const int rc = RecvAll(fd, payload.data(), len, deadline); rc != 0) return io_error(rc, step);
    if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), absl::StrCat("[TcpStore] ", payload));
    return payload;
  };
  DT_ASSIGN_OR_RETURN(std::string nonce_c, RandomBytes(kNonceBytes));
  std::string hello;
  PutU32(hello, kAuthMagic);
  hello += nonce_c;
  if (const int rc = SendAll(fd, hello, deadline); rc != 0) return io_error(rc, "handshake");
  DT_ASSIGN_OR_RETURN(std::string nonce_s, read_response("handshake"));
  if (nonce_s.size() != kNonceBytes) {
    return absl::UnauthenticatedError(
        absl::StrCat("[TcpStore] the store at ", where, " answered the handshake with ", nonce_s.size(), " bytes"));
  }
  if (const int rc = SendAll(fd, Mac(secret_, kClientLabel, nonce_c, nonce_s), deadline); rc != 0) {
    return io_error(rc, "proof");
  }
  DT_ASSIGN_OR_RETURN(std::string server_proof, read_response("proof"));
  if (!SameMac(server_proof, Mac(secret_, kServerLabel, nonce_c, nonce_s))) {
    return absl::PermissionDeniedError(absl::StrCat("[TcpStore] the store at ", where,
                                                    " failed to prove it holds this client's secret (", kStoreSecretEnv,
                                                    " differs): not joining it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> StoreClient::Call(uint8_t op, absl::Span<const std::string_view> fields,
                                              const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time deadline = absl::Now() + timeout_;
  const std::string where = absl::StrCat(host_, ":", port_);
  if (fd_ >= 0) {
    // Between calls nothing arrives on a healthy connection: a readable socket means the
    // server closed it (after a message it refused, or a restart). Start afresh rather than
    // fail this call on a dead connection (nothing of this call has been sent yet).
    pollfd p{fd_, POLLIN | POLLRDHUP, 0};
    if (poll(&p, 1, 0) > 0) CloseLocked();
  }
  DT_RETURN_IF_ERROR(EnsureConnected(deadline));
  auto timed_out = [&] {
    CloseLocked();  // the response may still come: never reuse this connection
    return absl::DeadlineExceededError(
        absl::StrCat("[TcpStore] ", what, " timed out after ", absl::FormatDuration(timeout_), " waiting on ", where));
  };
  auto broken = [&](const std::string& why) {
    CloseLocked();
    return absl::UnavailableError(absl::StrCat("[TcpStore] ", what, ": connection to ", where, " ", why));
  };

  std::string header;
  PutU32(header, kMagic);
  header.push_back(static_cast<char>(op));
  PutU32(header, static_cast<uint32_t>(fields.size()));
  // Sends header, then each field's length and bytes, without copying large values.
  auto send_all = [&](std::string_view bytes) { return SendAll(fd_, bytes, deadline); };
  auto check = [&](int rc) -> absl::Status {
    if (rc == 1) return timed_out();
    if (rc == 2) return broken(absl::StrCat("failed: ", Errno(errno)));
    return absl::OkStatus();
  };
  DT_RETURN_IF_ERROR(check(send_all(header)));
  for (std::string_view f : fields) {
    std::string len;
    PutU64(len, f.size());
    DT_RETURN_IF_ERROR(check(send_all(len)));
    DT_RETURN_IF_ERROR(check(send_all(f)));
  }

  auto recv_all = [&](char* dst, size_t n) { return RecvAll(fd_, dst, n, deadline); };
  auto check_recv = [&](int rc) -> absl::Status {
    if (rc == 3) return broken("was closed by the server");
    return check(rc);
  };
  char head[kResponseHeader];
  DT_RETURN_IF_ERROR(check_recv(recv_all(head, sizeof(head))));
  const uint8_t code = static_cast<uint8_t>(head[0]);
  const uint64_t len = GetLE(head + 1, 8);
  if (len > static_cast<uint64_t>(kStoreMaxValueBytes) + 4096 || code > 16) {
    return broken("sent a malformed response");
  }
  std::string payload(len, '\0');
  DT_RETURN_IF_ERROR(check_recv(recv_all(payload.data(), len)));
  if (code != 0) {
    const auto status_code = static_cast<absl::StatusCode>(code);
    // A refused client: the server closes this connection; the next call starts afresh.
    if (status_code == absl::StatusCode::kUnauthenticated || status_code == absl::StatusCode::kPermissionDenied ||
        status_code == absl::StatusCode::kResourceExhausted) {
      CloseLocked();
    }
    return absl::Status(status_code, absl::StrCat("[TcpStore] ", what, ": ", payload));
  }
  return payload;
}

absl::Status StoreClient::Set(std::string_view key, std::string_view value) {
  DT_RETURN_IF_ERROR(CheckKey(key));
  if (static_cast<int64_t>(value.size()) > kStoreMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("[TcpStore] Set(", Printable(key), "): value of ", value.size(),
                                                   " bytes exceeds ", kStoreMaxValueBytes));
  }
  const std::string_view fields[] = {key, value};
  return Call(kOpSet, fields, absl::StrCat("Set(", Printable(key), ")")).status();
}

absl::StatusOr<std::string> StoreClient::Get(std::string_view key) {
  DT_RETURN_IF_ERROR(CheckKey(key));
  const std::string_view fields[] = {key};
  return Call(kOpGet, fields, absl::StrCat("Get(", Printable(key), ")"));
}

absl::StatusOr<int64_t> StoreClient::Add(std::string_view key, int64_t delta) {
  DT_RETURN_IF_ERROR(CheckKey(key));
  const std::string d = EncodeI64(delta);
  const std::string_view fields[] = {key, d};
  const std::string what = absl::StrCat("Add(", Printable(key), ", ", delta, ")");
  DT_ASSIGN_OR_RETURN(std::string r, Call(kOpAdd, fields, what));
  if (r.size() != 8) return absl::UnavailableError(absl::StrCat("[TcpStore] ", what, ": malformed response"));
  return static_cast<int64_t>(GetLE(r.data(), 8));
}

absl::Status StoreClient::Wait(absl::Span<const std::string> keys) {
  if (keys.empty() || static_cast<int>(keys.size()) > kStoreMaxWaitKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat("[TcpStore] Wait: ", keys.size(), " keys; must be 1..", kStoreMaxWaitKeys));
  }
  std::vector<std::string_view> fields;
  for (const std::string& k : keys) {
    DT_RETURN_IF_ERROR(CheckKey(k));
    fields.push_back(k);
  }
  std::string what = absl::StrCat("Wait(", Printable(keys[0]));
  if (keys.size() > 1) absl::StrAppend(&what, " and ", keys.size() - 1, " more");
  what += ")";
  return Call(kOpWait, fields, what).status();
}

}  // namespace dtensor
