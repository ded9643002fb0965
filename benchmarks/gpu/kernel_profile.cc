// libdtensor_kernel_profile.so: a per-kernel GPU time table of any CUDA program, without Nsight
// Systems. The CUDA driver loads it into the program through its injection hook and calls
// InitializeInjection, which turns on CUPTI's activity records for every kernel (concurrent
// kernel mode), memcpy and memset; at the program's exit it flushes them and prints the GPU
// time summed per kernel name (demangled, without parameter lists), sorted by total time
// (KernelTable::Format, benchmarks/gpu/kernel_table.h).
//
//   export CUDA_INJECTION64_PATH=$PWD/build/benchmarks/libdtensor_kernel_profile.so DTENSOR_PROFILE_STEPS=4
//   build/collectives/dtrun/dtrun --nproc-per-node 1 build/examples/gpt/gpt_train --device cuda --steps 4 ...
//
// Environment (all optional):
//   DTENSOR_PROFILE_OUT=FILE      the table goes to FILE (default: stderr); "%p" becomes the pid
//   DTENSOR_PROFILE_STEPS=N       ms/step column = total / N (default 1)
//   DTENSOR_PROFILE_TOP=K         rows before "(more)" (default 25; 0: all)
//   DTENSOR_PROFILE_TSV=FILE      also write the raw sums (name, calls, ns; "%p" as above)
//   DTENSOR_PROFILE_BASELINE=FILE subtract a TSV written by a shorter run of the same command
//   DTENSOR_PROFILE_TITLE=TEXT    the table's heading
// Warm-up: every activity from the first CUDA call to exit counts. To see the steady state, run
// the program twice, K and K + N steps, the first with DTENSOR_PROFILE_TSV=warm.tsv, the second
// with DTENSOR_PROFILE_BASELINE=warm.tsv DTENSOR_PROFILE_STEPS=N: its table is then steps K+1 to
// K+N alone (benchmarks/nn/gpu_step_bench.sh does this). A process that ends in _exit, a
// signal or abort prints nothing; each process the driver starts in prints its own table.
// CUPTI (libcupti.so.13) must be loadable: it is linked from the CUDA Toolkit; scripts/
// gpu_bundle.sh ships it. Kernels overlapping on several streams each count their full time.
#include <cupti.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>

#include "benchmarks/gpu/kernel_table.h"

namespace dtensor::bench {
namespace {

constexpr size_t kBufferBytes = 8 << 20;  // CUPTI's activity buffers, 8-byte aligned
constexpr size_t kAlign = 8;

// What the buffers delivered so far. Leaked on purpose: CUPTI's thread may deliver a buffer
// while static destructors run.
struct Profile {
  std::mutex mu;
  KernelTable table;
  std::unordered_map<const char*, std::string> names;  // CUPTI keeps one name string per kernel
  size_t dropped = 0;
  bool enabled = false;
};

Profile& State() {
  static Profile* profile = new Profile;
  return *profile;
}

const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// `path` with "%p" replaced by this process's id.
std::string WithPid(std::string path) {
  for (size_t at = path.find("%p"); at != std::string::npos; at = path.find("%p", at)) {
    path.replace(at, 2, std::to_string(getpid()));
  }
  return path;
}

void Warn(const char* what, CUptiResult r) {
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "kernel_profile: %s failed: %s\n", what, text != nullptr ? text : "unknown CUPTI error");
}

const char* CopyKindName(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "[memcpy HtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "[memcpy DtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "[memcpy DtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "[memcpy HtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "[memcpy PtoP]";
    default:
      return "[memcpy other]";
  }
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kAlign, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI BufferCompleted(CUcontext context, uint32_t stream_id, uint8_t* buffer, size_t /*size*/,
                              size_t valid_size) {
  Profile& p = State();
  {
    std::lock_guard<std::mutex> lock(p.mu);
    CUpti_Activity* record = nullptr;
    while (valid_size > 0 && cuptiActivityGetNextRecord(buffer, valid_size, &record) == CUPTI_SUCCESS) {
      switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
          auto it = p.names.find(k->name);
          if (it == p.names.end()) it = p.names.emplace(k->name, ShortKernelName(k->name)).first;
          p.table.Add(it->second, 1, static_cast<int64_t>(k->end - k->start));
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
          p.table.Add(CopyKindName(m->copyKind), 1, static_cast<int64_t>(m->end - m->start));
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
          p.table.Add("[memset]", 1, static_cast<int64_t>(m->end - m->start));
          break;
        }
        default:
          break;
      }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(context, stream_id, &dropped) == CUPTI_SUCCESS) p.dropped += dropped;
  }
  std::free(buffer);
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  if (!out.flush()) std::fprintf(stderr, "kernel_profile: cannot write %s\n", path.c_str());
}

void Report() {
  Profile& p = State();
  if (!p.enabled) return;
  if (CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED); r != CUPTI_SUCCESS) {
    Warn("cuptiActivityFlushAll", r);
  }
  std::lock_guard<std::mutex> lock(p.mu);
  if (const char* tsv = Env("DTENSOR_PROFILE_TSV")) WriteFile(WithPid(tsv), p.table.ToTsv());
  KernelTable table = p.table;
  std::string title = Env("DTENSOR_PROFILE_TITLE") != nullptr ? Env("DTENSOR_PROFILE_TITLE") : "";
  if (const char* base = Env("DTENSOR_PROFILE_BASELINE")) {
    std::ifstream in(base);
    std::stringstream text;
    text << in.rdbuf();
    std::string error;
    std::optional<KernelTable> warm = KernelTable::FromTsv(text.str(), &error);
    if (!in) {
      std::fprintf(stderr, "kernel_profile: cannot read DTENSOR_PROFILE_BASELINE %s; the table is the whole run\n",
                   base);
    } else if (!warm) {
      std::fprintf(stderr, "kernel_profile: DTENSOR_PROFILE_BASELINE %s: %s; the table is the whole run\n", base,
                   error.c_str());
    } else {
      table.Subtract(*warm);
      title += std::string(title.empty() ? "" : ", ") + "less " + base;
    }
  }
  KernelTable::FormatOptions options{.steps = 1, .top = 25, .name_width = 80, .title = title};
  if (const char* s = Env("DTENSOR_PROFILE_STEPS")) options.steps = std::atoll(s);
  if (const char* s = Env("DTENSOR_PROFILE_TOP")) options.top = std::atoi(s);
  std::string text = table.Format(options);
  if (p.dropped > 0) text += "kernel_profile: CUPTI dropped " + std::to_string(p.dropped) + " records\n";
  if (const char* out = Env("DTENSOR_PROFILE_OUT")) {
    WriteFile(WithPid(out), text);
  } else {
    std::fputs(text.c_str(), stderr);
  }
}

}  // namespace
}  // namespace dtensor::bench

// Called by the CUDA driver (cuInit) when CUDA_INJECTION64_PATH names this library; returns
// nonzero on success.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  using namespace dtensor::bench;
  Profile& p = State();
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.enabled) return 1;
  }
  if (CUptiResult r = cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted); r != CUPTI_SUCCESS) {
    Warn("cuptiActivityRegisterCallbacks", r);
    return 0;
  }
  for (CUpti_ActivityKind kind :
       {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET}) {
    if (CUptiResult r = cuptiActivityEnable(kind); r != CUPTI_SUCCESS) {
      Warn("cuptiActivityEnable", r);
      return 0;
    }
  }
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.enabled = true;
  }
  std::atexit(Report);
  return 1;
}
