// Command lines of the GPT tools (gpt_train, gpt_generate) in Abseil's flag syntax.
//
//   std::vector<std::string> storage;
//   std::vector<char*> args = gpt::AbslStyleArgs(argc, argv, storage);
//   std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
//
// Abseil names flags as C++ identifiers (n_layer); the tools' users write --n-layer, and give
// booleans a separate value (--prefetch false). AbslStyleArgs rewrites argv into Abseil's form:
// dashes in a flag's name become underscores ("--n-layer=4" -> "--n_layer=4"), and a boolean
// flag followed by true|false|yes|no takes it as its value ("--prefetch false" ->
// "--prefetch=false"). Everything else is passed as it is, so Abseil reports unknown flags and
// bad values itself. `storage` owns the rewritten strings the returned pointers point into.
#ifndef DTENSOR_EXAMPLES_GPT_FLAGS_H_
#define DTENSOR_EXAMPLES_GPT_FLAGS_H_

#include <set>
#include <string>
#include <vector>

namespace dtensor::gpt {

std::vector<char*> AbslStyleArgs(int argc, char** argv, std::vector<std::string>& storage);

// The names of the flags in `args` (AbslStyleArgs' output: "--n_layer=4" gives "n_layer"; a
// boolean's "--noprefetch" gives "noprefetch"): what the user set, as opposed to defaults.
std::set<std::string> GivenFlagNames(const std::vector<std::string>& args);

// The OpenMP threads of the calling thread's parallel regions (a rank's kernels and OpenBLAS):
// `n`, unless the environment sets OMP_NUM_THREADS, which then stands (the user's choice, as
// OpenMP reads it at start-up). The tools share the cores among their ranks with it.
void SetRankThreads(int n);

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_FLAGS_H_
