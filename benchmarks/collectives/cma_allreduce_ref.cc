// cma_allreduce_ref: the single-copy algorithm of the ucx backend's 2-rank all_reduce, with no
// library around it. Two processes (fork) each hold an input and an output of the full size;
// per 256 KiB chunk of its half, a process reads the peer's piece into an in-cache scratch
// (process_vm_readv), reduces it with its own into its output, and writes the result into the
// peer's output (process_vm_writev); a spin on shared-memory epochs starts and ends each call.
// Each byte of the result crosses between the processes once and nothing is staged, so beside
// coll_bench's ucx all_reduce with DTENSOR_UCX_ZERO_COPY=0 (collectives/ucx: CmaReduce up to 2
// MiB blocks) it shows what the library adds to the bare algorithm. With zero copy (the default)
// the library moves the same bytes with memcpy and beats this kernel-copy bound.
// Also prints memcpy and process_vm_readv rates of one half for scale. Medians of --iters calls.
//   cma_allreduce_ref [--sizes BYTES,...] [--iters N] [--chunk BYTES]
#include <sched.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One page shared by the two processes (MAP_SHARED before fork).
struct Shared {
  std::atomic<int64_t> epoch[2][8];  // [rank][0]; padded apart
  std::atomic<uint64_t> in[2], out[2];
  std::atomic<int> pid[2];
  std::atomic<int> failed;
};

// False when the peer failed or did not arrive within 10 s.
bool Sync(Shared* s, int r, int64_t* e) {
  ++*e;
  s->epoch[r][0].store(*e, std::memory_order_release);
  const auto start = Clock::now();
  for (int64_t spins = 0; s->epoch[1 - r][0].load(std::memory_order_acquire) < *e; ++spins) {
    if (s->failed.load(std::memory_order_relaxed) != 0) return false;
    if (spins % 4096 == 0 && Seconds(start) > 10) {
      s->failed.store(1);
      return false;
    }
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return true;
}

bool Move(pid_t peer, void* local, uint64_t remote, size_t n, bool write) {
  iovec l{local, n}, r{reinterpret_cast<void*>(remote), n};
  const ssize_t got = write ? process_vm_writev(peer, &l, 1, &r, 1, 0) : process_vm_readv(peer, &l, 1, &r, 1, 0);
  return got == static_cast<ssize_t>(n);
}

// Runs in both processes; returns false (and marks the run failed) on any error.
bool Run(Shared* s, int r, size_t bytes, size_t chunk, int iters, bool print) {
  const size_t n = bytes / sizeof(float), half = n / 2;
  std::vector<float> in(n), out(n), scratch(chunk / sizeof(float));
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<float>((i % 1000) * (r + 1));
  s->in[r] = reinterpret_cast<uint64_t>(in.data());
  s->out[r] = reinterpret_cast<uint64_t>(out.data());
  s->pid[r] = getpid();
  int64_t e = s->epoch[r][0].load();
  if (!Sync(s, r, &e)) return false;
  const pid_t peer = s->pid[1 - r];
  const size_t off = static_cast<size_t>(r) * half * sizeof(float), len = half * sizeof(float);
  std::vector<double> t_memcpy, t_read, t_all;
  for (int it = 0; it < iters; ++it) {
    if (!Sync(s, r, &e)) return false;
    auto start = Clock::now();
    std::memcpy(reinterpret_cast<char*>(out.data()) + off, reinterpret_cast<char*>(in.data()) + off, len);
    t_memcpy.push_back(Seconds(start));
    if (!Sync(s, r, &e)) return false;
    start = Clock::now();
    if (!Move(peer, reinterpret_cast<char*>(out.data()) + off, s->in[1 - r] + off, len, false)) return false;
    t_read.push_back(Seconds(start));
    if (!Sync(s, r, &e)) return false;
    start = Clock::now();
    for (size_t at = 0; at < len; at += chunk) {
      const size_t m = std::min(chunk, len - at);
      if (!Move(peer, scratch.data(), s->in[1 - r] + off + at, m, false)) return false;
      float* o = reinterpret_cast<float*>(reinterpret_cast<char*>(out.data()) + off + at);
      const float* x = reinterpret_cast<const float*>(reinterpret_cast<const char*>(in.data()) + off + at);
      const float* y = scratch.data();
      const size_t k = m / sizeof(float);
      if (r == 0) {
        for (size_t i = 0; i < k; ++i) o[i] = x[i] + y[i];  // rank order, as the library does
      } else {
        for (size_t i = 0; i < k; ++i) o[i] = y[i] + x[i];
      }
      if (!Move(peer, o, s->out[1 - r] + off + at, m, true)) return false;
    }
    if (!Sync(s, r, &e)) return false;
    t_all.push_back(Seconds(start));
  }
  // The result must be the sum of both inputs everywhere (the peer wrote the other half).
  for (size_t i = 0; i < 2 * half; ++i) {
    const float want = static_cast<float>(i % 1000) * 3.0f;
    if (out[i] != want) {
      std::fprintf(stderr, "cma_allreduce_ref: rank %d: element %zu is %g, want %g\n", r, i, out[i], want);
      return false;
    }
  }
  if (print) {
    const double half_bytes = static_cast<double>(len);
    const double t = Median(t_all);  // busbw of a 2-rank all_reduce: 2 (n - 1) / n * bytes / t
    std::printf("%10zu %12.1f %12.2f %12.2f %12.2f\n", bytes, t * 1e6, half_bytes / Median(t_memcpy) / 1e9,
                half_bytes / Median(t_read) / 1e9, static_cast<double>(bytes) / t / 1e9);
  }
  return Sync(s, r, &e);  // the peer is done with this process's buffers
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> sizes = {size_t{1} << 20, size_t{4} << 20, size_t{16} << 20, size_t{64} << 20};
  int iters = 0;
  size_t chunk = size_t{256} << 10;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--sizes" && i + 1 < argc) {
      sizes.clear();
      for (const char* p = argv[++i]; *p != '\0';) {
        char* end = nullptr;
        const long long v = std::strtoll(p, &end, 10);
        if (end == p || v < 64) {
          std::fprintf(stderr, "cma_allreduce_ref: --sizes wants byte counts >= 64\n");
          return 2;
        }
        sizes.push_back(static_cast<size_t>(v) / 64 * 64);
        p = *end == ',' ? end + 1 : end;
      }
    } else if (flag == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (flag == "--chunk" && i + 1 < argc) {
      chunk = std::max<size_t>(4096, static_cast<size_t>(std::atoll(argv[++i])) / 64 * 64);
    } else {
      std::fprintf(stderr, "usage: cma_allreduce_ref [--sizes BYTES,...] [--iters N] [--chunk BYTES]\n");
      return 2;
    }
  }
  void* page = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) {
    std::perror("cma_allreduce_ref: mmap");
    return 1;
  }
  auto* s = new (page) Shared();
  std::fflush(stdout);
  const pid_t child = fork();
  if (child < 0) {
    std::perror("cma_allreduce_ref: fork");
    return 1;
  }
  const int r = child == 0 ? 1 : 0;
  if (r == 0) {
    std::printf("cma_allreduce_ref: 2-process all_reduce (float sum) by single copy, no library: per chunk\n");
    std::printf("read the peer's piece, reduce, write the result into the peer (see the file's comment).\n");
    std::printf("Medians; memcpy and readv: one half (bytes / 2) within a process and from the peer.\n");
    std::printf("%10s %12s %12s %12s %12s\n", "bytes", "time us", "memcpy GB/s", "readv GB/s", "busbw GB/s");
  }
  bool ok = true;
  for (size_t bytes : sizes) {
    const int n_iters = iters > 0 ? iters : static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / bytes, 8, 400));
    if (!Run(s, r, bytes, chunk, n_iters, r == 0)) {
      ok = false;
      s->failed.store(1);
      break;
    }
    std::fflush(stdout);
  }
  if (r == 1) std::_Exit(ok ? 0 : 1);
  int status = 0;
  waitpid(child, &status, 0);
  const bool child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!ok || !child_ok) std::fprintf(stderr, "cma_allreduce_ref: failed (process_vm_readv refused? see above)\n");
  return ok && child_ok ? 0 : 1;
}
