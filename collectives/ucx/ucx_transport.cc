#include "dtensor/collectives/ucx/ucx_transport.h"

#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "dtensor/collectives/cpu_primitives.h"
#include "dtensor/tensor/status.h"

namespace dtensor::internal {
namespace {

// Who "this host" is for the purpose of pidfds and shared memory: the same kernel (boot id),
// the same pid namespace (pids mean the same processes) and the same network namespace (UCX's
// shared-memory transports signal through abstract sockets, which do not cross network
// namespaces). A hostname alone is not enough: cloned machines and `ip netns exec` share one.
std::string HostIdentity() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  auto ns_inode = [](const char* path) -> unsigned long long {
    struct stat st {};
    return stat(path, &st) == 0 ? static_cast<unsigned long long>(st.st_ino) : 0ull;
  };
  return absl::StrCat(host, "/", boot_id, "/net:", ns_inode("/proc/self/ns/net"),
                      "/pid:", ns_inode("/proc/self/ns/pid"));
}

// The network interface this host reaches `addr` (the store's host) through: the source
// address the kernel picks for a datagram socket connected there, matched to an interface.
// Connecting a datagram socket sends nothing. Empty when it cannot be told (the caller then
// leaves UCX's choice alone).
std::string InterfaceToward(const std::string& addr) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(addr.c_str(), "9", &hints, &found) != 0 || found == nullptr) return "";
  std::string name;
  for (addrinfo* a = found; a != nullptr && name.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    const bool ok =
        connect(fd, a->ai_addr, a->ai_addrlen) == 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    close(fd);
    if (!ok) continue;
    ifaddrs* ifs = nullptr;
    if (getifaddrs(&ifs) != 0) continue;
    for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != local.ss_family) continue;
      const bool same = local.ss_family == AF_INET
                            ? reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr ==
                                  reinterpret_cast<sockaddr_in*>(&local)->sin_addr.s_addr
                            : std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                                          &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr, sizeof(in6_addr)) == 0;
      if (same) {
        name = i->ifa_name;
        break;
      }
    }
    freeifaddrs(ifs);
  }
  freeaddrinfo(found);
  return name;
}

// The interfaces UCX's network transports may use (and listen on), chosen from the hosts of
// the world's ranks: all on this host, loopback only ("lo"; between them the shared-memory
// transports carry the bytes, TCP over loopback where a peer needs error handling); ranks on
// other hosts too, the interface that reaches the store's host, so that no socket listens on
// an interface the job does not use. Empty: UCX's default (every interface), when the
// interface cannot be told. A UCX_NET_DEVICES in the environment overrides this (the caller
// does not ask then).
std::string JobNetDevices(const std::vector<std::string>& hosts, const std::string& self,
                          const std::string& master_addr) {
  if (std::all_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h == self; })) return "lo";
  return InterfaceToward(master_addr);
}

absl::Status UcsError(const std::string& what, ucs_status_t s) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ucs_status_string(s)));
}

constexpr int64_t kSpinNs = 20'000;      // pure progress
constexpr int64_t kYieldNs = 2'000'000;  // progress + sched_yield, then sleep on the event fd
constexpr int64_t kPeerCheckNs = 1'000'000;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Setup and teardown.

absl::StatusOr<std::shared_ptr<UcxWorld>> UcxWorld::Create(const LaunchInfo& info, StoreClient& store,
                                                           absl::Duration timeout) {
  std::shared_ptr<UcxWorld> world(new UcxWorld());
  DT_RETURN_IF_ERROR(world->Setup(info, store, timeout));
  return world;
}

absl::Status UcxWorld::Setup(const LaunchInfo& info, StoreClient& store, absl::Duration timeout) {
  constexpr const char* kOp = "[UcxCommunicator]";
  if (info.world_size < 1 || info.rank < 0 || info.rank >= info.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, " rank ", info.rank, " is out of range for world size ", info.world_size));
  }
  if (info.world_size > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, " world size ", info.world_size, " exceeds 65535"));
  }
  rank_ = info.rank;
  size_ = info.world_size;

  // Namespace: the how-manyth world communicator this rank makes. Before UCX starts, every
  // rank says which host it is on, so that its network transports listen only where the job
  // needs them (JobNetDevices).
  const std::string host = HostIdentity();
  const absl::Duration old_timeout = store.timeout();
  store.SetTimeout(timeout);
  std::string prefix;
  std::string net_devices;
  absl::Status status = [&]() -> absl::Status {
    DT_ASSIGN_OR_RETURN(const int64_t n, store.Add(absl::StrCat("ucx/made/", rank_), 1));
    prefix = absl::StrCat("ucx/", n, "/");
    DT_RETURN_IF_ERROR(store.Set(absl::StrCat(prefix, "host/", rank_), host));
    if (std::getenv("UCX_NET_DEVICES") != nullptr) return absl::OkStatus();  // the user's choice
    std::vector<std::string> hosts(static_cast<size_t>(size_), host);
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      DT_ASSIGN_OR_RETURN(hosts[static_cast<size_t>(j)], store.Get(absl::StrCat(prefix, "host/", j)));
    }
    net_devices = JobNetDevices(hosts, host, info.master_addr);
    return absl::OkStatus();
  }();
  store.SetTimeout(old_timeout);
  DT_RETURN_IF_ERROR(status);

  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcsError(absl::StrCat(kOp, " ucp_config_read"), st);
  if (!net_devices.empty()) {
    st = ucp_config_modify(config, "NET_DEVICES", net_devices.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return UcsError(absl::StrCat(kOp, " setting UCX's NET_DEVICES to ", net_devices), st);
    }
  }
  if (const char* v = std::getenv("DTENSOR_UCX_INFO"); rank_ == 0 && v != nullptr && std::string(v) == "1") {
    std::fprintf(stderr, "dtensor ucx: network interfaces: %s\n",
                 std::getenv("UCX_NET_DEVICES") != nullptr ? "UCX_NET_DEVICES (the user's)"
                 : net_devices.empty()                     ? "UCX's default (the store's interface was not found)"
                                                           : net_devices.c_str());
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.estimated_num_eps = static_cast<size_t>(size_);
  params.mt_workers_shared = 0;
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) return UcsError(absl::StrCat(kOp, " ucp_init"), st);

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // the caller and the comm thread, never at once
  st = ucp_worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) return UcsError(absl::StrCat(kOp, " ucp_worker_create"), st);
  st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) return UcsError(absl::StrCat(kOp, " ucp_worker_get_efd"), st);
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) return absl::UnavailableError(absl::StrCat(kOp, " epoll_create1: ", std::strerror(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u32 = 0;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, efd_, &ev) != 0) {
    return absl::UnavailableError(absl::StrCat(kOp, " epoll_ctl: ", std::strerror(errno)));
  }

  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  st = ucp_worker_get_address(worker_, &address, &address_len);
  if (st != UCS_OK) return UcsError(absl::StrCat(kOp, " ucp_worker_get_address"), st);
  std::string mine = absl::StrCat(host, "\n", getpid(), "\n");
  mine.append(reinterpret_cast<const char*>(address), address_len);
  ucp_worker_release_address(worker_, address);

  store.SetTimeout(timeout);
  status = [&]() -> absl::Status {
    DT_RETURN_IF_ERROR(store.Set(absl::StrCat(prefix, "addr/", rank_), mine));
    eps_.assign(static_cast<size_t>(size_), nullptr);
    gone_.assign(static_cast<size_t>(size_), "");
    pids_.assign(static_cast<size_t>(size_), -1);
    pidfds_.assign(static_cast<size_t>(size_), -1);
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      DT_ASSIGN_OR_RETURN(const std::string theirs, store.Get(absl::StrCat(prefix, "addr/", j)));
      const size_t a = theirs.find('\n');
      const size_t b = a == std::string::npos ? a : theirs.find('\n', a + 1);
      int pid = -1;
      if (b == std::string::npos || !absl::SimpleAtoi(theirs.substr(a + 1, b - a - 1), &pid)) {
        return absl::InternalError(absl::StrCat(kOp, " rank ", rank_, ": malformed address of rank ", j));
      }
      pids_[static_cast<size_t>(j)] = pid;
      bool watched = false;
      if (theirs.substr(0, a) == host) {  // same host: watch the peer process through a pidfd
        const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
        if (fd >= 0) {
          pidfds_[static_cast<size_t>(j)] = fd;
          epoll_event pev{};
          pev.events = EPOLLIN;
          pev.data.u32 = static_cast<uint32_t>(j + 1);
          epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &pev);
          watched = true;
        } else if (errno == ESRCH) {
          gone_[static_cast<size_t>(j)] = "exited";
        }
      }
      ep_args_.push_back(std::make_unique<EpArg>(EpArg{this, j}));
      ucp_ep_params_t ep_params{};
      ep_params.field_mask =
          UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep_params.address = reinterpret_cast<const ucp_address_t*>(theirs.data() + b + 1);
      // Peer-failure handling restricts UCX 1.13 to TCP, even between processes of one host;
      // a peer we watch through its pidfd gets the shared-memory transports instead.
      ep_params.err_mode = watched ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
      ep_params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t s) {
        auto* e = static_cast<EpArg*>(arg);
        e->world->MarkPeerGone(e->rank, ucs_status_string(s));
      };
      ep_params.err_handler.arg = ep_args_.back().get();
      const ucs_status_t est = ucp_ep_create(worker_, &ep_params, &eps_[static_cast<size_t>(j)]);
      if (est != UCS_OK) return UcsError(absl::StrCat(kOp, " rank ", rank_, ": ucp_ep_create to rank ", j), est);
    }
    return absl::OkStatus();
  }();
  store.SetTimeout(old_timeout);
  DT_RETURN_IF_ERROR(status);
  // Any peer's abort: the tag's high half, whatever the sender.
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  void* q =
      ucp_tag_recv_nbx(worker_, abort_buf_.data(), abort_buf_.size(), AbortTag(0), uint64_t{0xffffffff} << 32, &p);
  if (UCS_PTR_IS_ERR(q))
    return UcsError(absl::StrCat(kOp, " rank ", rank_, ": posting the abort receive"), UCS_PTR_STATUS(q));
  abort_recv_.req = q;
  abort_recv_.is_recv = true;
  abort_recv_.expect = abort_buf_.size();
  return absl::OkStatus();
}

void UcxWorld::Abort(const absl::Status& status) {
  if (!failure_.ok() && absl::IsAborted(failure_)) return;  // a peer's abort, or ours, came first
  Fail(status);
  // A member: a send that does not finish in time is released, not cancelled, so UCX may
  // read it later.
  abort_text_ = std::string(status.message().substr(0, kAbortBytes));
  const std::string& text = abort_text_;
  std::vector<void*> sends;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || !gone_[static_cast<size_t>(j)].empty()) continue;
    ucp_request_param_t p{};
    void* q = ucp_tag_send_nbx(eps_[static_cast<size_t>(j)], text.data(), text.size(), AbortTag(rank_), &p);
    if (UCS_PTR_IS_PTR(q)) sends.push_back(q);
  }
  // Let them leave before the caller, say, exits (bounded: a peer may be gone).
  const int64_t until = NowNs() + 500'000'000;
  for (void* q : sends) {
    while (ucp_request_check_status(q) == UCS_INPROGRESS && NowNs() < until) ucp_worker_progress(worker_);
    ucp_request_free(q);  // released by UCX once done
  }
  ucp_worker_progress(worker_);
}

bool UcxWorld::PollAbort() {
  if (abort_recv_.req != nullptr && !abort_recv_.done && Complete(abort_recv_) && abort_recv_.status == UCS_OK) {
    const std::string text(abort_buf_.data(), std::min(abort_recv_.received, abort_buf_.size()));
    // The world's first failure wins, unless it is a later one caused by this abort (a peer
    // that gave up: Unavailable): the abort says why.
    if (failure_.ok() || !absl::IsAborted(failure_)) failure_ = absl::AbortedError(text);
  }
  return absl::IsAborted(failure_);
}

UcxWorld::~UcxWorld() {
  if (worker_ != nullptr) {
    if (abort_recv_.req != nullptr && !abort_recv_.done) {
      ucp_request_cancel(worker_, abort_recv_.req);
      ucp_worker_progress(worker_);
      if (!Complete(abort_recv_)) ucp_request_free(abort_recv_.req);  // released once UCX is done
    }
    // Deliver what is still buffered (bounded), then drop the endpoints without a handshake:
    // peers may be gone already.
    ucp_request_param_t p{};
    void* flush = failure_.ok() ? ucp_worker_flush_nbx(worker_, &p) : nullptr;
    if (UCS_PTR_IS_PTR(flush)) {
      const int64_t until = NowNs() + 200'000'000;
      while (ucp_request_check_status(flush) == UCS_INPROGRESS && NowNs() < until) ucp_worker_progress(worker_);
      ucp_request_free(flush);
    }
    ucp_request_param_t cp{};
    cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    for (ucp_ep_h ep : eps_) {
      if (ep == nullptr) continue;
      void* r = ucp_ep_close_nbx(ep, &cp);
      if (UCS_PTR_IS_PTR(r)) {
        const int64_t until = NowNs() + 100'000'000;
        while (ucp_request_check_status(r) == UCS_INPROGRESS && NowNs() < until) ucp_worker_progress(worker_);
        ucp_request_free(r);
      }
    }
    for (auto& o : orphans_) {
      if (!Complete(o.first)) ucp_request_free(o.first.req);
    }
    orphans_.clear();
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
  for (int fd : pidfds_) {
    if (fd >= 0) close(fd);
  }
  if (epfd_ >= 0) close(epfd_);
}

void UcxWorld::MarkPeerGone(int world_rank, const std::string& why) {
  if (world_rank < 0 || world_rank >= size_) return;
  std::string& g = gone_[static_cast<size_t>(world_rank)];
  if (g.empty()) g = why.empty() ? "gone" : why;
}

// ---------------------------------------------------------------------------------------------
// Requests.

absl::StatusOr<UcxRequest> UcxWorld::PostSend(const UcxWaitContext& ctx, int peer, int world_peer, uint64_t tag,
                                              const void* buf, size_t bytes) {
  UcxRequest r;
  r.peer = peer;
  r.world_peer = world_peer;
  ucp_request_param_t p{};
  void* q = ucp_tag_send_nbx(eps_[static_cast<size_t>(world_peer)], buf, bytes, tag, &p);
  if (UCS_PTR_IS_ERR(q)) {
    return UcsError(absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": send to rank ", peer), UCS_PTR_STATUS(q));
  }
  r.req = q;
  r.done = q == nullptr;
  return r;
}

absl::StatusOr<UcxRequest> UcxWorld::PostRecv(const UcxWaitContext& ctx, int peer, int world_peer, uint64_t tag,
                                              void* buf, size_t bytes) {
  UcxRequest r;
  r.peer = peer;
  r.world_peer = world_peer;
  r.is_recv = true;
  r.expect = bytes;
  ucp_tag_recv_info_t info{};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.recv_info.tag_info = &info;
  void* q = ucp_tag_recv_nbx(worker_, buf, bytes, tag, ~uint64_t{0}, &p);
  if (UCS_PTR_IS_ERR(q)) {
    return UcsError(absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": receive from rank ", peer), UCS_PTR_STATUS(q));
  }
  r.req = q;
  if (q == nullptr) {
    r.done = true;
    r.received = info.length;
  }
  return r;
}

bool UcxWorld::Complete(UcxRequest& r) {
  if (r.done) return true;
  ucs_status_t s;
  if (r.is_recv) {
    ucp_tag_recv_info_t info{};
    s = ucp_tag_recv_request_test(r.req, &info);
    if (s == UCS_OK) r.received = info.length;
  } else {
    s = ucp_request_check_status(r.req);
  }
  if (s == UCS_INPROGRESS) return false;
  r.status = s;
  r.done = true;
  ucp_request_free(r.req);
  r.req = nullptr;
  return true;
}

absl::Status UcxWorld::Finish(UcxRequest& r, const UcxWaitContext& ctx) {
  if (r.status != UCS_OK) {
    std::string why = ucs_status_string(r.status);
    if (!gone_[static_cast<size_t>(r.world_peer)].empty()) why = gone_[static_cast<size_t>(r.world_peer)];
    absl::Status s = absl::UnavailableError(absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": ",
                                                         r.is_recv ? "receive from" : "send to", " rank ", r.peer,
                                                         " failed (", why, ")"));
    Fail(s);
    return s;
  }
  if (r.is_recv && r.received != r.expect) {
    absl::Status s = absl::InvalidArgumentError(absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": expected ", r.expect,
                                                             " bytes from rank ", r.peer, " but got ", r.received,
                                                             " (mismatched calls across ranks?)"));
    Fail(s);
    return s;
  }
  return absl::OkStatus();
}

bool UcxWorld::Test(UcxRequest& r) {
  if (r.done) return true;
  ucp_worker_progress(worker_);
  return Complete(r);
}

void UcxWorld::Sleep(int ms) {
  epoll_event events[16];
  const int n = epoll_wait(epfd_, events, 16, ms);
  for (int i = 0; i < n; ++i) {
    const uint32_t id = events[i].data.u32;
    if (id == 0) continue;  // the worker's event fd: progress picks it up
    const int peer = static_cast<int>(id) - 1;
    MarkPeerGone(peer, absl::StrCat("process ", pids_[static_cast<size_t>(peer)], " exited"));
    epoll_ctl(epfd_, EPOLL_CTL_DEL, pidfds_[static_cast<size_t>(peer)], nullptr);
  }
}

UcxRankNames NameRanks(int rank, int world_rank, int peer, int peer_world_rank) {
  if (rank == world_rank && peer == peer_world_rank) return {absl::StrCat("rank ", rank), absl::StrCat("rank ", peer)};
  return {absl::StrCat("rank ", rank, " (world rank ", world_rank, ")"),
          absl::StrCat("rank ", peer, " (world rank ", peer_world_rank, ")")};
}

absl::Status UcxWorld::Failed(const UcxWaitContext& ctx) const {
  if (!absl::IsAborted(failure_)) return failure_;
  return absl::AbortedError(absl::StrCat("[", ctx.op, "] rank ", ctx.rank, ": ", failure_.message()));
}

absl::Status UcxWorld::Wait(UcxRequest& r, const UcxWaitContext& ctx) {
  if (r.done) return Finish(r, ctx);
  if (!failure_.ok()) return Failed(ctx);
  const int64_t start = NowNs();
  const int64_t deadline = ctx.DeadlineNs(start);
  int64_t last_peer_check = start;
  for (int iter = 0;; ++iter) {
    ucp_worker_progress(worker_);
    if (Complete(r)) return Finish(r, ctx);
    if ((iter & 31) != 31) continue;
    const int64_t now = NowNs();
    if (!orphans_.empty()) {
      std::erase_if(orphans_, [this](auto& o) { return Complete(o.first); });
    }
    if (now - last_peer_check >= kPeerCheckNs) {
      PollPeers();
      last_peer_check = now;
    }
    if (PollAbort()) return Failed(ctx);
    const std::string& gone = gone_[static_cast<size_t>(r.world_peer)];
    if (!gone.empty()) {
      ucp_worker_progress(worker_);
      if (Complete(r)) return Finish(r, ctx);
      if (PollAbort()) return Failed(ctx);  // its abort arrived before it exited
      const UcxRankNames n = NameRanks(ctx.rank, rank_, r.peer, r.world_peer);
      absl::Status s =
          absl::UnavailableError(absl::StrCat("[", ctx.op, "] ", n.self, ": peer ", n.peer, " is gone (", gone, ")"));
      Fail(s);
      return s;
    }
    if (now >= deadline) {
      const UcxRankNames n = NameRanks(ctx.rank, rank_, r.peer, r.world_peer);
      absl::Status s = absl::DeadlineExceededError(absl::StrCat(
          "[", ctx.op, "] ", n.self, " timed out after ", absl::FormatDuration(ctx.timeout), " waiting for ", n.peer));
      Fail(s);
      return s;
    }
    const int64_t waited = now - start;
    if (waited < kSpinNs) continue;
    if (waited < kYieldNs) {
      sched_yield();
      continue;
    }
    while (ucp_worker_progress(worker_) != 0) {
    }
    if (Complete(r)) return Finish(r, ctx);
    const ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    const int64_t left_ms = deadline == INT64_MAX ? 100 : (deadline - now) / 1'000'000 + 1;
    Sleep(static_cast<int>(std::min<int64_t>(left_ms, 100)));
    last_peer_check = NowNs();
  }
}

void UcxWorld::Orphan(UcxRequest r, std::shared_ptr<const void> keep) {
  if (r.done) return;
  if (r.is_recv) ucp_request_cancel(worker_, r.req);
  ucp_worker_progress(worker_);
  if (Complete(r)) return;
  orphans_.emplace_back(std::move(r), std::move(keep));
}

void UcxWorld::Abandon(UcxRequest& r) {
  std::vector<UcxRequest> one;
  one.push_back(r);
  r.req = nullptr;
  r.done = true;
  Abandon(one);
}

// Cancelled receives complete within a few progress calls; sends cannot be cancelled (UCX
// releases them when they finish or their endpoint is closed), so they are let go at once.
void UcxWorld::Abandon(std::vector<UcxRequest>& reqs) {
  for (UcxRequest& r : reqs) {
    if (!r.done && r.is_recv && r.req != nullptr) ucp_request_cancel(worker_, r.req);
  }
  const int64_t until = NowNs() + 50'000'000;
  for (UcxRequest& r : reqs) {
    while (r.is_recv && !Complete(r) && NowNs() < until) ucp_worker_progress(worker_);
    if (!r.done) {
      ucp_request_free(r.req);
      r.req = nullptr;
      r.done = true;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Reductions.

namespace {

constexpr int64_t kChunk = 256;

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    uint32_t fb;
    std::memcpy(&fb, &f, 4);
    bits = sign | fb;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

template <typename T>
inline float LoadF(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return HalfToFloat(v.bits);
  }
}

template <typename T>
inline T StoreF(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    return T(f);
  }
}

template <typename T, typename A, typename Load, typename Combine, typename Store>
void ReduceChunks(const void* const* srcs, int nsrcs, int64_t n, void* dst, Load load, Combine combine, Store store) {
  // A left fold in source order, fused so that two sources take one pass (and more take one
  // pass each, through a cache-resident accumulator).
  T* d = static_cast<T*>(dst);
  const T* s0 = static_cast<const T*>(srcs[0]);
  if (nsrcs == 1) {
    for (int64_t i = 0; i < n; ++i) d[i] = store(load(s0[i]));
    return;
  }
  const T* s1 = static_cast<const T*>(srcs[1]);
  if (nsrcs == 2) {
    StoreFoldsInBlocksOf8<A>(
        d, srcs, 2, n, [&](int64_t i) { return combine(load(s0[i]), load(s1[i])); }, store);
    return;
  }
  A acc[kChunk];
  const T* last = static_cast<const T*>(srcs[nsrcs - 1]);
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t m = std::min(kChunk, n - c);
    for (int64_t i = 0; i < m; ++i) acc[i] = combine(load(s0[c + i]), load(s1[c + i]));
    for (int j = 2; j + 1 < nsrcs; ++j) {
      const T* s = static_cast<const T*>(srcs[j]) + c;
      for (int64_t i = 0; i < m; ++i) acc[i] = combine(acc[i], load(s[i]));
    }
    for (int64_t i = 0; i < m; ++i) d[c + i] = store(combine(acc[i], load(last[c + i])));
  }
}

template <typename T>
void ReduceFloat(CommReduceOp op, const void* const* srcs, int nsrcs, int64_t n, void* dst, int avg_divisor) {
  auto load = [](T v) { return LoadF<T>(v); };
  auto store = [](float v) { return StoreF<T>(v); };
  auto add = [](float a, float b) { return a + b; };
  switch (op) {
    case CommReduceOp::kSum:
      return ReduceChunks<T, float>(srcs, nsrcs, n, dst, load, add, store);
    case CommReduceOp::kAvg:
      if (avg_divisor <= 0) return ReduceChunks<T, float>(srcs, nsrcs, n, dst, load, add, store);
      {
        const float div = static_cast<float>(avg_divisor);
        return ReduceChunks<T, float>(srcs, nsrcs, n, dst, load, add, [div](float v) { return StoreF<T>(v / div); });
      }
    case CommReduceOp::kMax:  // NaN wins, as torch.maximum
      return ReduceChunks<T, float>(
          srcs, nsrcs, n, dst, load, [](float a, float b) { return (a != a || a > b) ? a : b; }, store);
    case CommReduceOp::kMin:
      return ReduceChunks<T, float>(
          srcs, nsrcs, n, dst, load, [](float a, float b) { return (a != a || a < b) ? a : b; }, store);
    case CommReduceOp::kProduct:
      return ReduceChunks<T, float>(
          srcs, nsrcs, n, dst, load, [](float a, float b) { return a * b; }, store);
  }
}

template <typename T>
void ReduceInt(CommReduceOp op, const void* const* srcs, int nsrcs, int64_t n, void* dst, int avg_divisor) {
  // Sums and products wrap (in the unsigned type of T); avg truncates toward zero.
  using U = std::make_unsigned_t<T>;
  auto load_u = [](T v) { return static_cast<U>(v); };
  auto store_u = [](U v) { return static_cast<T>(v); };
  auto id = [](T v) { return v; };
  switch (op) {
    case CommReduceOp::kSum:
      return ReduceChunks<T, U>(
          srcs, nsrcs, n, dst, load_u, [](U a, U b) { return static_cast<U>(a + b); }, store_u);
    case CommReduceOp::kAvg: {
      const T div = static_cast<T>(avg_divisor <= 0 ? 1 : avg_divisor);
      return ReduceChunks<T, U>(
          srcs, nsrcs, n, dst, load_u, [](U a, U b) { return static_cast<U>(a + b); },
          [div](U v) { return static_cast<T>(static_cast<T>(v) / div); });
    }
    case CommReduceOp::kMax:
      return ReduceChunks<T, T>(
          srcs, nsrcs, n, dst, id, [](T a, T b) { return std::max(a, b); }, id);
    case CommReduceOp::kMin:
      return ReduceChunks<T, T>(
          srcs, nsrcs, n, dst, id, [](T a, T b) { return std::min(a, b); }, id);
    case CommReduceOp::kProduct:
      return ReduceChunks<T, U>(
          srcs, nsrcs, n, dst, load_u, [](U a, U b) { return static_cast<U>(a * b); }, store_u);
  }
}

void ReduceBool(CommReduceOp op, const void* const* srcs, int nsrcs, int64_t n, void* dst) {
  // Bytes, so that a value other than 0 / 1 still reads as true.
  auto load = [](uint8_t v) { return static_cast<uint8_t>(v != 0); };
  auto id = [](uint8_t v) { return v; };
  if (op == CommReduceOp::kMin || op == CommReduceOp::kProduct) {
    ReduceChunks<uint8_t, uint8_t>(
        srcs, nsrcs, n, dst, load, [](uint8_t a, uint8_t b) { return static_cast<uint8_t>(a & b); }, id);
  } else {
    ReduceChunks<uint8_t, uint8_t>(
        srcs, nsrcs, n, dst, load, [](uint8_t a, uint8_t b) { return static_cast<uint8_t>(a | b); }, id);
  }
}

}  // namespace

void Reduce(DType dtype, CommReduceOp op, const void* const* srcs, int nsrcs, int64_t n, void* dst, int avg_divisor) {
  if (n <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return ReduceFloat<float>(op, srcs, nsrcs, n, dst, avg_divisor);
    case DType::kBFloat16:
      return ReduceFloat<BFloat16>(op, srcs, nsrcs, n, dst, avg_divisor);
    case DType::kFloat16:
      return ReduceFloat<Float16>(op, srcs, nsrcs, n, dst, avg_divisor);
    case DType::kInt32:
      return ReduceInt<int32_t>(op, srcs, nsrcs, n, dst, avg_divisor);
    case DType::kInt64:
      return ReduceInt<int64_t>(op, srcs, nsrcs, n, dst, avg_divisor);
    case DType::kBool:
      return ReduceBool(op, srcs, nsrcs, n, dst);
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return;
  }
}

}  // namespace dtensor::internal
