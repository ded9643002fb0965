// A rank program for dtrun's tests. Modes (the rank comes from the environment dtrun sets):
//   env                      prints "env RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT"
//   print                    a line to stdout, a line to stderr, then a partial line, exit 0
//   fail R CODE DIR [ignore-term]
//                            writes its pid to DIR/R.pid; rank R exits with CODE (a negative CODE
//                            raises signal -CODE) after 200 ms, the others sleep up to 60 s
//                            (ignoring SIGTERM with ignore-term)
//   sleep DIR                writes its pid to DIR/R.pid, then sleeps up to 60 s
//   store                    store rendezvous: Add("counter", 1), Get the final count, print it
//   auth                     the same, after printing "auth RANK SECRET_CHARS AUTHENTICATED HAS_STORE_FD";
//                            rank 1 also tries the store with a wrong secret and with none and
//                            prints "intruders WRONG_SECRET_CODE NO_SECRET_CODE" (absl code names)
//   cpus                     prints "cpus LOCAL_RANK c0,c1,..." (the CPUs it may run on)
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/collectives/store/cpus.h"
#include "dtensor/collectives/store/rendezvous.h"

namespace {

void Out(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = write(fd, s.data() + done, s.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "<unset>" : v;
}

void WritePid(const std::string& dir, int rank) {
  const std::string path = absl::StrCat(dir, "/", rank, ".pid");
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fprintf(f, "%d\n", static_cast<int>(getpid()));
    std::fclose(f);
  }
}

void SleepLong() {
  for (int i = 0; i < 600; ++i) usleep(100 * 1000);
}

int Store(bool auth) {
  auto info = dtensor::LaunchInfoFromEnv();
  if (!info.ok()) {
    Out(2, absl::StrCat(info.status().ToString(), "\n"));
    return 3;
  }
  auto store = dtensor::ConnectStore(*info, absl::Seconds(30));
  if (!store.ok()) {
    Out(2, absl::StrCat(store.status().ToString(), "\n"));
    return 4;
  }
  dtensor::StoreClient& s = **store;
  if (auth) {
    const char* secret = std::getenv(dtensor::kStoreSecretEnv);
    Out(1, absl::StrCat("auth ", info->rank, " ", secret == nullptr ? 0 : std::strlen(secret), " ",
                        s.authenticated() ? 1 : 0, " ", std::getenv("DTENSOR_STORE_FD") != nullptr ? 1 : 0, "\n"));
  }
  if (auth && info->rank == 1) {
    auto wrong =
        dtensor::StoreClient::Connect(info->master_addr, info->master_port, absl::Seconds(10), std::string(64, '0'));
    auto none = dtensor::StoreClient::Connect(info->master_addr, info->master_port, absl::Seconds(10));
    const absl::Status none_status = none.ok() ? (*none)->Set("intruder", "x") : none.status();
    Out(1, absl::StrCat("intruders ", absl::StatusCodeToString(wrong.status().code()), " ",
                        absl::StatusCodeToString(none_status.code()), "\n"));
  }
  auto n = s.Add("counter", 1);
  if (!n.ok()) return 5;
  if (*n == info->world_size && !s.Set("done", "yes").ok()) return 6;
  auto done = s.Get("done");
  auto count = s.Get("counter");
  if (!done.ok() || !count.ok()) return 7;
  Out(1, absl::StrCat("counter ", *count, "\n"));
  // Rank 0 hosts the store: it waits until everyone has read before exiting.
  if (!s.Set(absl::StrCat("ack/", info->rank), "1").ok()) return 8;
  if (info->rank == 0) {
    std::vector<std::string> acks;
    for (int r = 0; r < info->world_size; ++r) acks.push_back(absl::StrCat("ack/", r));
    if (!s.Wait(acks).ok()) return 9;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int rank = std::atoi(Env("RANK").c_str());
  if (mode == "env") {
    Out(1, absl::StrCat("env ", Env("RANK"), " ", Env("WORLD_SIZE"), " ", Env("LOCAL_RANK"), " ",
                        Env("LOCAL_WORLD_SIZE"), " ", Env("MASTER_ADDR"), " ", Env("MASTER_PORT"), "\n"));
    return 0;
  }
  if (mode == "print") {
    Out(1, absl::StrCat("hello from ", rank, "\n"));
    Out(2, absl::StrCat("warning from ", rank, "\n"));
    Out(1, absl::StrCat("partial from ", rank));
    return 0;
  }
  if (mode == "lines" && argc == 3) {  // N numbered lines on stdout
    const int n = std::atoi(argv[2]);
    for (int i = 0; i < n; ++i) Out(1, absl::StrCat("line ", rank, " ", i, "\n"));
    return 0;
  }
  if (mode == "fail" && (argc == 5 || argc == 6)) {
    if (argc == 6 && std::string(argv[5]) == "ignore-term") std::signal(SIGTERM, SIG_IGN);
    WritePid(argv[4], rank);
    if (rank == std::atoi(argv[2])) {
      usleep(200 * 1000);
      const int code = std::atoi(argv[3]);
      if (code < 0) raise(-code);
      return code;
    }
    SleepLong();
    return 0;
  }
  if (mode == "sleep" && argc == 3) {
    WritePid(argv[2], rank);
    SleepLong();
    return 0;
  }
  if (mode == "store" || mode == "auth") return Store(mode == "auth");
  if (mode == "cpus") {
    Out(1, absl::StrCat("cpus ", Env("LOCAL_RANK"), " ", absl::StrJoin(dtensor::AllowedCpus(), ","), "\n"));
    return 0;
  }
  Out(2, "dtrun_test_child: bad arguments\n");
  return 64;
}
