#include "dtensor/collectives/store/rendezvous.h"

#include <atomic>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "dtensor/tensor/status.h"

extern char** environ;

namespace dtensor {
namespace {

constexpr char kOp[] = "LaunchInfoFromEnv";

const std::string* Find(const std::map<std::string, std::string>& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

// The integer in variable `name`, nullopt if unset; must lie in [lo, hi].
absl::StatusOr<std::optional<int>> IntVar(const std::map<std::string, std::string>& env, const std::string& name,
                                          int lo, int hi) {
  const std::string* v = Find(env, name);
  if (v == nullptr) return std::optional<int>();
  int x = 0;
  if (!absl::SimpleAtoi(*v, &x)) {
    return InvalidArg(kOp, name, "='", *v, "' is not an integer");
  }
  if (x < lo || x > hi) {
    return InvalidArg(kOp, name, "=", x, " is outside ", lo, "..", hi);
  }
  return std::optional<int>(x);
}

// Slurm's "4(x2),3" tasks-per-node list, expanded to one entry per node.
absl::StatusOr<std::vector<int>> ParseTasksPerNode(const std::string& name, const std::string& value) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= value.size()) {
    size_t comma = value.find(',', pos);
    if (comma == std::string::npos) comma = value.size();
    const std::string item = value.substr(pos, comma - pos);
    int count = 0, repeat = 1;
    const size_t paren = item.find("(x");
    const std::string head = item.substr(0, paren);
    bool ok = absl::SimpleAtoi(head, &count) && count > 0;
    if (ok && paren != std::string::npos) {
      ok = item.back() == ')' && absl::SimpleAtoi(item.substr(paren + 2, item.size() - paren - 3), &repeat) &&
           repeat > 0 && repeat <= 1000000;
    }
    if (!ok || out.size() + repeat > 1000000) {
      return InvalidArg(kOp, name, "='", value, "' is not a tasks-per-node list like '4(x2),3'");
    }
    out.insert(out.end(), repeat, count);
    pos = comma + 1;
  }
  return out;
}

// First host of a Slurm node list: "gpu[03-05,9],cpu1" -> "gpu03", "rack[1-2]-node[5-6]-ib"
// -> "rack1-node5-ib" (each bracket gives its first value; the text between and after stays).
std::string FirstHost(const std::string& list) {
  std::string host;
  for (size_t pos = 0; pos < list.size();) {
    const char ch = list[pos];
    if (ch == ',') break;  // the end of the first entry
    if (ch != '[') {
      host.push_back(ch);
      ++pos;
      continue;
    }
    const size_t close = list.find(']', pos);
    if (close == std::string::npos) break;
    const size_t end = list.find_first_of("-,]", pos + 1);
    host += list.substr(pos + 1, end - pos - 1);
    pos = close + 1;
  }
  return host;
}

}  // namespace

absl::StatusOr<LaunchInfo> LaunchInfoFromEnv(const std::map<std::string, std::string>& env) {
  constexpr int kMaxWorld = 1 << 24;
  struct Names {
    const char* scheme;
    const char* rank;
    const char* world;
    const char* local_rank;
    const char* local_world;
  };
  static const Names kSchemes[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"ompi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  LaunchInfo info;
  const Names* names = nullptr;
  for (const Names& n : kSchemes) {
    if (Find(env, n.rank) != nullptr) {
      names = &n;
      break;
    }
  }
  if (names == nullptr) {
    // torchrun's world size without its rank: a launcher that forgot RANK would leave every
    // process training alone. (SLURM_NTASKS without SLURM_PROCID is an allocation's shell,
    // where one process alone is normal.)
    if (const std::string* world = Find(env, "WORLD_SIZE"); world != nullptr && *world != "1") {
      return InvalidArg(kOp, "WORLD_SIZE=", *world, " is set but RANK is not");
    }
  }
  if (names != nullptr) {
    info.scheme = names->scheme;
    DT_ASSIGN_OR_RETURN(std::optional<int> rank, IntVar(env, names->rank, 0, kMaxWorld - 1));
    DT_ASSIGN_OR_RETURN(std::optional<int> world, IntVar(env, names->world, 1, kMaxWorld));
    if (!world) return InvalidArg(kOp, names->rank, " is set but ", names->world, " is not");
    if (*rank >= *world) {
      return InvalidArg(kOp, names->rank, "=", *rank, " is not below ", names->world, "=", *world);
    }
    info.rank = *rank;
    info.world_size = *world;
    DT_ASSIGN_OR_RETURN(std::optional<int> local_rank, IntVar(env, names->local_rank, 0, kMaxWorld - 1));
    DT_ASSIGN_OR_RETURN(std::optional<int> local_world, IntVar(env, names->local_world, 1, kMaxWorld));
    std::string local_world_name = names->local_world;
    if (!local_world && info.scheme == "slurm") {
      for (const char* var : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
        const std::string* v = Find(env, var);
        if (v == nullptr) continue;
        DT_ASSIGN_OR_RETURN(std::vector<int> per_node, ParseTasksPerNode(var, *v));
        DT_ASSIGN_OR_RETURN(std::optional<int> node, IntVar(env, "SLURM_NODEID", 0, kMaxWorld - 1));
        const size_t index = node.value_or(0);
        if (index >= per_node.size()) {
          return InvalidArg(kOp, "SLURM_NODEID=", index, " is beyond the ", per_node.size(), " nodes of ", var, "='",
                            *v, "'");
        }
        local_world = per_node[index];
        local_world_name = var;
        break;
      }
    }
    info.local_rank = local_rank.value_or(info.rank);
    info.local_world_size = local_world.value_or(info.world_size);
    if (info.local_rank >= info.local_world_size) {
      return InvalidArg(kOp, names->local_rank, "=", info.local_rank, " is not below ", local_world_name, "=",
                        info.local_world_size);
    }
    if (info.local_world_size > info.world_size) {
      return InvalidArg(kOp, local_world_name, "=", info.local_world_size, " exceeds ", names->world, "=",
                        info.world_size);
    }
  }

  if (const std::string* addr = Find(env, "MASTER_ADDR")) {
    if (addr->empty()) return InvalidArg(kOp, "MASTER_ADDR is set but empty");
    info.master_addr = *addr;
  } else if (info.scheme == "slurm") {
    for (const char* var : {"SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"}) {
      const std::string* v = Find(env, var);
      if (v == nullptr || v->empty()) continue;
      info.master_addr = FirstHost(*v);
      break;
    }
  }
  DT_ASSIGN_OR_RETURN(std::optional<int> port, IntVar(env, "MASTER_PORT", 0, 65535));
  if (port) {
    if (*port == 0 && info.world_size > 1) {
      return InvalidArg(kOp, "MASTER_PORT=0 (any free port) works only for a world of one; WORLD_SIZE is ",
                        info.world_size);
    }
    info.master_port = *port;
  } else {
    info.master_port = info.world_size > 1 ? kDefaultMasterPort : 0;
  }
  if (const std::string* secret = Find(env, kStoreSecretEnv); secret != nullptr && !secret->empty()) {
    if (static_cast<int64_t>(secret->size()) < kStoreMinSecretBytes) {
      return InvalidArg(kOp, kStoreSecretEnv, " has ", secret->size(), " characters; a store secret needs at least ",
                        kStoreMinSecretBytes);
    }
    info.store_secret = *secret;
  }
  DT_ASSIGN_OR_RETURN(std::optional<int> store_fd, IntVar(env, "DTENSOR_STORE_FD", 0, 1 << 30));
  info.store_fd = store_fd.value_or(-1);
  return info;
}

absl::StatusOr<LaunchInfo> LaunchInfoFromEnv() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return LaunchInfoFromEnv(env);
}

absl::StatusOr<std::unique_ptr<StoreClient>> ConnectStore(const LaunchInfo& info, absl::Duration timeout) {
  if (info.rank != 0) {
    if (info.master_port <= 0) {
      return InvalidArg("ConnectStore", "rank ", info.rank, " needs a master port (got ", info.master_port, ")");
    }
    return StoreClient::Connect(info.master_addr, info.master_port, timeout, info.store_secret);
  }
  std::unique_ptr<StoreServer> server;
  // The inherited socket is a process resource handed over once: the first ConnectStore takes
  // it (its server closes it); a later one binds the port itself.
  static std::atomic<bool> inherited_socket_taken{false};
  if (info.store_fd >= 0 && ListeningPort(info.store_fd) == info.master_port &&
      !inherited_socket_taken.exchange(true)) {
    DT_ASSIGN_OR_RETURN(
        server, StoreServer::StartOnSocket(info.store_fd, info.master_addr, absl::Seconds(30), info.store_secret));
  } else {
    DT_ASSIGN_OR_RETURN(server,
                        StoreServer::Start(info.master_addr, info.master_port, absl::Seconds(30), info.store_secret));
  }
  if (info.store_secret.empty()) {
    std::fprintf(stderr,
                 "[rendezvous] the store at %s:%d is unauthenticated (%s is unset): any process that can connect "
                 "to it may join this job\n",
                 info.master_addr.c_str(), server->port(), kStoreSecretEnv);
  }
  DT_ASSIGN_OR_RETURN(std::unique_ptr<StoreClient> client,
                      StoreClient::Connect(info.master_addr, server->port(), timeout, info.store_secret));
  client->AdoptServer(std::move(server));
  return client;
}

}  // namespace dtensor
