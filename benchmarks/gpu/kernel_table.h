// KernelTable: GPU time summed per kernel name (and per kind of memcpy / memset), and the table
// kernel_profile.cc prints at a profiled program's exit. Plain C++ (no CUDA), so its arithmetic
// and printing are tested on any machine (tests/benchmarks/kernel_table_test.cc).
//
//   KernelTable run;
//   run.Add(ShortKernelName("_ZN7dtensor6kernel9LayerNormIfEEvPKfPf"), /*calls=*/1, /*ns=*/5300);
//   run.Add("[memcpy HtoD]", 1, 900);
//   KernelTable warmup = *KernelTable::FromTsv(saved_tsv, &error);   // a shorter run of the same program
//   run.Subtract(warmup);                                            // what the later steps added
//   std::fputs(run.Format({.steps = 4, .top = 25, .title = "steps 3-6"}).c_str(), stdout);
//
// Format prints, sorted by total time: rank, kernel name (cut to `name_width` characters), calls,
// total ms, ms per step (total / steps) and % of the table's GPU time; then one row for the
// kernels left out and the total. "GPU time" is the sum of each activity's end - start: kernels
// that overlap on several streams count twice, so it can exceed the wall time.
// The TSV form (ToTsv / FromTsv) is one line per name: name, calls, nanoseconds, tab-separated.
#ifndef DTENSOR_BENCHMARKS_GPU_KERNEL_TABLE_H_
#define DTENSOR_BENCHMARKS_GPU_KERNEL_TABLE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace dtensor::bench {

struct KernelStat {
  int64_t calls = 0;
  int64_t ns = 0;  // GPU time, nanoseconds
};

class KernelTable {
 public:
  struct FormatOptions {
    int64_t steps = 1;    // ms/step = total / steps (< 1 counts as 1)
    int top = 25;         // rows before "(N more)"; <= 0: all
    int name_width = 80;  // names longer than this end in "..."
    std::string title;    // printed in the heading
  };

  // Adds `calls` activities of `name` that took `ns` nanoseconds in all (tabs and newlines in
  // `name` become spaces, so the TSV form stays one line per name).
  void Add(std::string_view name, int64_t calls, int64_t ns);

  // Takes away a shorter run of the same program (its warm-up): the names it shares lose its
  // calls and time, clamped at zero; names left with no calls and no time are dropped.
  void Subtract(const KernelTable& other);

  int64_t total_ns() const;
  int64_t total_calls() const;
  const std::map<std::string, KernelStat>& stats() const { return stats_; }

  std::string ToTsv() const;
  // nullopt, with the line and what is wrong in *error, where a line is not "name\tcalls\tns".
  static std::optional<KernelTable> FromTsv(std::string_view tsv, std::string* error);

  std::string Format(const FormatOptions& options) const;

 private:
  std::map<std::string, KernelStat> stats_;
};

// A kernel's symbol as a short readable name: demangled (where it is a C++ symbol), without the
// leading "void ", the parameter list and "(anonymous namespace)::". cuBLAS's and other
// extern "C" kernel names come back as they are.
std::string ShortKernelName(const char* symbol);

}  // namespace dtensor::bench

#endif  // DTENSOR_BENCHMARKS_GPU_KERNEL_TABLE_H_
