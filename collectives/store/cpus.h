// Where the local ranks of a run may execute: this process's CPUs, a split of a host's CPUs
// among its ranks (dtrun binds each rank to its share, as Open MPI binds to cores), and whether
// ranks have a CPU each or must take turns (the ucx backend spins only in the first case).
//
//   std::vector<int> mine = AllowedCpus();                        // e.g. {0, 1}
//   auto shares = SplitCpus(mine, CoreKeys(mine), 2);             // {{0}, {1}}
//   bool own = RanksHaveOwnCpus({{0}, {0, 1}});                   // true: rank 1 takes CPU 1
//   bool shared = RanksHaveOwnCpus({{0}, {0}, {0, 1}});           // false: three ranks, two CPUs
#ifndef DTENSOR_COLLECTIVES_STORE_CPUS_H_
#define DTENSOR_COLLECTIVES_STORE_CPUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dtensor {

// The CPUs this thread may run on (sched_getaffinity), ascending; empty if it cannot be read.
std::vector<int> AllowedCpus();

// One key per CPU of `cpus` naming its physical core, ordered by package: (package << 32) |
// the core's first hardware thread (sysfs core_cpus_list, else thread_siblings_list), so that
// hyperthreads of one core share a key. Unknown topology: package 0, a core of its own.
std::vector<int64_t> CoreKeys(absl::Span<const int> cpus);

// Splits `cpus` (with their CoreKeys) among `ranks` local ranks: disjoint, non-empty shares of
// whole cores, rank i getting cores [i*C/ranks, (i+1)*C/ranks) of the C cores in key order
// (package by package). With fewer cores than ranks but at least as many CPUs, the CPUs are
// split the same way instead (in CPU order). Empty when there are fewer CPUs than ranks (they
// have to share: no binding helps), or when keys and cpus differ in length, or ranks < 1.
// Not topology-aware beyond that: NUMA nodes within a package and hybrid (P/E) cores are not
// balanced.
std::vector<std::vector<int>> SplitCpus(absl::Span<const int> cpus, absl::Span<const int64_t> keys, int ranks);

// For more local ranks than `cpus`: one CPU each, rank i taking CPU floor(i * N / ranks) of the
// N CPUs in SplitCpus order (consecutive ranks share a CPU, every CPU gets ranks/N rounded
// down or up). Ranks bound so take turns on their CPU; unbound, the scheduler moves them and
// some runs are slower throughout (4 ranks on 2 CPUs, 4 KiB all_reduce: 4.3-5.4 us bound in
// every run, unbound 4.3 us in some runs and 6.9-7.3 in others). Empty when there are at
// least as many CPUs as ranks (SplitCpus then), or for bad input.
std::vector<std::vector<int>> StackCpus(absl::Span<const int> cpus, absl::Span<const int64_t> keys, int ranks);

// True when every rank can run on a CPU that no other rank needs: rank i may use cpus[i], and
// a matching of ranks to distinct CPUs exists (so none of them must wait for another to give a
// CPU up). An empty entry (affinity unknown) makes it false.
bool RanksHaveOwnCpus(absl::Span<const std::vector<int>> cpus);

// "0-3,8,10-11" (ascending input; "none" when empty), as the kernel prints CPU lists.
std::string FormatCpuList(absl::Span<const int> cpus);
// The inverse: the CPUs of such a list, ascending; empty for malformed text.
std::vector<int> ParseCpuList(absl::string_view text);

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_STORE_CPUS_H_
