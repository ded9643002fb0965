// Checkpoint throughput: GPT-2 124M's parameters (or a smaller GPT with --small), sharded
// Shard(0) over 1 and 2 thread ranks, saved and loaded with dtensor/checkpoint beside a plain
// sequential write (write + fsync) and read of the same bytes per rank, and the time an
// asynchronous save blocks training (AsyncCheckpointSave::Start) beside a synchronous one.
// Medians of --reps runs, alternating the contenders; loads read from the page cache.
//
//   build/benchmarks/ckpt_bench                       # GPT-2 124M, 1 and 2 ranks
//   build/benchmarks/ckpt_bench --small --reps 1      # a quick run
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/collectives/threads/threads_communicator.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/ops/ops.h"
#include "dtensor/tensor/status.h"

namespace dtensor {
namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Times {
  std::vector<double> save, load, plain_write, plain_read, async_blocked;
  int64_t bytes_per_rank = 0;
};

// This rank's plain sequential write (one file, fsync) and read of `bytes`.
absl::Status PlainWriteRead(const std::string& path, const std::vector<char>& bytes, double* write_s, double* read_s) {
  double t0 = Now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return absl::InternalError("open " + path);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, std::min<size_t>(bytes.size() - done, 1 << 26));
    if (w <= 0) return absl::InternalError("write " + path);
    done += static_cast<size_t>(w);
  }
  ::fsync(fd);
  ::close(fd);
  *write_s = Now() - t0;
  std::vector<char> back(bytes.size());
  t0 = Now();
  fd = ::open(path.c_str(), O_RDONLY);
  done = 0;
  while (done < back.size()) {
    const ssize_t r =
        ::pread(fd, back.data() + done, std::min<size_t>(back.size() - done, 1 << 26), static_cast<off_t>(done));
    if (r <= 0) break;
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  *read_s = Now() - t0;
  return absl::OkStatus();
}

absl::Status RunRank(Communicator& comm, const nn::GPTConfig& cfg, const std::string& dir, int reps, Times* out) {
  DT_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(comm, {comm.size()}));
  DT_ASSIGN_OR_RETURN(std::unique_ptr<nn::GPT> model, nn::GPT::Create(cfg));
  CheckpointState state, target;
  int64_t bytes = 0;
  for (auto& [name, v] : model->NamedParameters()) {
    const Tensor& full = v->value().local();
    DT_ASSIGN_OR_RETURN(DTensor d, DTensor::Distribute(full, mesh, Layout({Shard(0)}), {.src_rank = std::nullopt}));
    DT_ASSIGN_OR_RETURN(Tensor z, Zeros(d.ToLocal().shape(), d.dtype()));
    state.push_back({name, d});
    target.push_back({name, DTensor::WrapTrusted(z, mesh, d.layout(), Shape(d.shape().begin(), d.shape().end()))});
    bytes += static_cast<int64_t>(d.ToLocal().nbytes());
  }
  model.reset();
  std::vector<char> plain(static_cast<size_t>(bytes), 1);
  out->bytes_per_rank = bytes;
  for (int r = 0; r < reps; ++r) {
    const std::string name = absl::StrCat("rep", r);
    DT_RETURN_IF_ERROR(comm.Barrier());
    double t0 = Now();
    DT_RETURN_IF_ERROR(SaveCheckpoint(comm, dir, name, state));
    const double save = Now() - t0;
    DT_RETURN_IF_ERROR(comm.Barrier());
    t0 = Now();
    DT_RETURN_IF_ERROR(LoadCheckpoint(dir + "/" + name, target));
    DT_RETURN_IF_ERROR(comm.Barrier());
    const double load = Now() - t0;
    double w = 0, rd = 0;
    DT_RETURN_IF_ERROR(PlainWriteRead(absl::StrCat(dir, "/plain-", comm.rank()), plain, &w, &rd));
    DT_RETURN_IF_ERROR(comm.Barrier());
    t0 = Now();
    DT_ASSIGN_OR_RETURN(auto async, AsyncCheckpointSave::Start(comm, dir, name + "-async", state));
    const double blocked = Now() - t0;
    DT_RETURN_IF_ERROR(async->Finish());
    DT_RETURN_IF_ERROR(comm.Barrier());
    if (comm.rank() == 0) {
      out->save.push_back(save);
      out->load.push_back(load);
      out->plain_write.push_back(w);
      out->plain_read.push_back(rd);
      out->async_blocked.push_back(blocked);
      std::error_code ec;
      std::filesystem::remove_all(dir + "/" + name, ec);
      std::filesystem::remove_all(dir + "/" + name + "-async", ec);
    }
    DT_RETURN_IF_ERROR(comm.Barrier());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dtensor

int main(int argc, char** argv) {
  using namespace dtensor;
  nn::GPTConfig cfg;  // GPT-2 124M
  int reps = 3;
  std::string dir = "/tmp/ckpt_bench";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--small") {
      cfg = {.vocab_size = 256, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 64};
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: ckpt_bench [--small] [--reps 3] [--dir /tmp/ckpt_bench]\n");
      return 2;
    }
  }
  std::filesystem::create_directories(dir);
  std::printf(
      "| ranks | bytes/rank | save GB/s | plain write GB/s | save/plain | load GB/s | plain read GB/s | "
      "sync save ms | async blocks ms |\n|---|---|---|---|---|---|---|---|---|\n");
  for (int ranks : {1, 2}) {
    auto comms = MakeThreadGroup(ranks);
    if (!comms.ok()) {
      std::fprintf(stderr, "%s\n", comms.status().ToString().c_str());
      return 1;
    }
    Times t;
    std::vector<absl::Status> status(static_cast<size_t>(ranks));
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back(
          [&, r] { status[static_cast<size_t>(r)] = RunRank(*(*comms)[static_cast<size_t>(r)], cfg, dir, reps, &t); });
    }
    for (auto& th : threads) th.join();
    for (const absl::Status& s : status) {
      if (!s.ok()) {
        std::fprintf(stderr, "ckpt_bench: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    const double total = static_cast<double>(t.bytes_per_rank) * ranks / 1e9;  // all ranks' bytes
    const double save = Median(t.save), write = Median(t.plain_write);
    std::printf("| %d | %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f |\n", ranks,
                static_cast<long long>(t.bytes_per_rank), total / save, total / write, write / save,
                total / Median(t.load), total / Median(t.plain_read), save * 1e3, Median(t.async_blocked) * 1e3);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
