// Which OpenBLAS kernel set ("core") this process runs, and a faster one where OpenBLAS fell
// back to a generic set.
//
// OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels from the CPU model when it is
// loaded. A CPU newer than its table (e.g. Emerald Rapids under OpenBLAS 0.3.21) gets the
// SSE3 "Prescott" kernels: sgemm runs 4-5x slower than with the AVX-512 ones the CPU can run.
// The documented override, the OPENBLAS_CORETYPE environment variable, is read only when the
// library is loaded, so a program that wants it must be started with it: ReexecWithFasterBlasCore
// does that for a main().
#ifndef DTENSOR_KERNELS_CPU_BLAS_CORE_H_
#define DTENSOR_KERNELS_CPU_BLAS_CORE_H_

#include <string>

#include "absl/status/status.h"

namespace dtensor {

// The vector units a CPU offers (and its OS enables) that decide OpenBLAS's kernel set.
struct CpuVectorIsa {
  bool avx2_fma = false;  // AVX2 and FMA3 (OpenBLAS's Haswell kernels)
  bool avx512 = false;    // AVX-512 F, CD, BW, DQ and VL (OpenBLAS's SkylakeX kernels)
};

// This CPU's (from cpuid, as the compiler runtime reads it).
CpuVectorIsa HostVectorIsa();

// Whether this OpenBLAS chooses its kernels when it loads (built with DYNAMIC_ARCH, as
// Debian's), and so honours OPENBLAS_CORETYPE.
bool BlasChoosesCoreAtLoad();

// The name OpenBLAS gives the kernel set it runs (openblas_get_corename(), e.g. "SkylakeX",
// "Haswell", "Prescott").
std::string BlasCoreName();

// The OPENBLAS_CORETYPE value that runs faster than `core` on a CPU with `isa`: "SkylakeX" or
// "Haswell" where `core` is a pre-AVX2 set (Prescott, Core2, Nehalem, Sandybridge, ...) that the
// CPU outgrows; "" where `core` is already the right one or is a set this does not know (a
// choice OpenBLAS made on purpose, e.g. Zen, is kept). Case-insensitive. Pure.
std::string FasterBlasCoreType(const std::string& core, CpuVectorIsa isa);

// For main(), before any other work: where OpenBLAS chooses its kernels at load, OPENBLAS_CORETYPE
// is unset, and FasterBlasCoreType names a faster set for this CPU, sets OPENBLAS_CORETYPE to
// it and re-executes this program (the file /proc/self/exe links to, so the process keeps its
// name) with the same arguments and environment, so that OpenBLAS loads with it. The process
// keeps its pid, CPU binding and the file descriptors not marked close-on-exec. Returns OK
// where there was nothing to do, and an error naming the cause where the exec failed (the
// program can go on, slower). Setting OPENBLAS_CORETYPE to any value turns the restart off:
// e.g. OPENBLAS_CORETYPE=Haswell under valgrind, which does not follow an exec by default and
// does not run AVX-512.
absl::Status ReexecWithFasterBlasCore(char** argv);

}  // namespace dtensor

#endif  // DTENSOR_KERNELS_CPU_BLAS_CORE_H_
