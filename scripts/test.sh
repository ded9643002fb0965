#!/usr/bin/env bash
# Installs what is needed, builds everything (CUDA code included when the toolkit is present)
# and runs the whole test suite. This is the README's test command and what CI runs:
#   1. g++, every component (CUDA when found): build, clang-format and include checks, every test;
#   2. clang 14, CPU-only, AddressSanitizer + UndefinedBehaviorSanitizer: the whole unit suite,
#      then every libFuzzer target for a bounded time (scripts/fuzz_smoke.sh);
#   3. clang 14, CPU-only, ThreadSanitizer: the threads backend, DTensor / redistribution,
#      autograd and the trainer on thread ranks.
#   bash scripts/test.sh              # build in ./build (./build-asan, ./build-tsan), run all
#   BUILD_DIR=/tmp/b bash scripts/test.sh
#   DTENSOR_SKIP_GCC=1 bash scripts/test.sh     # skip 1 (e.g. to rerun the sanitizer builds)
#   DTENSOR_SKIP_CLANG=1 bash scripts/test.sh   # skip 2 and 3
#   DTENSOR_SKIP_TSAN=1 bash scripts/test.sh    # skip 3
#   DTENSOR_SANITIZERS=0 bash scripts/test.sh   # 2 and 3 become one plain clang 14 CPU-only build
#   FUZZ_SECONDS=60 bash scripts/test.sh        # seconds per fuzz target (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

build_dir="${BUILD_DIR:-build}"
jobs="${JOBS:-$(nproc)}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
# Paths below the checkout are hashed relative to it, so a fresh clone elsewhere (CI) reuses
# what an earlier build of the same sources compiled.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"

if [ "${DTENSOR_SKIP_GCC:-0}" != "1" ]; then
  echo "[test] configure ($build_dir)"
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
  echo "[test] build"
  cmake --build "$build_dir" -j "$jobs"

  # Formatting is part of the contract (.clang-format); checked on every source file.
  echo "[test] clang-format check"
  git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format --dry-run -Werror

  # The include form (README): library headers are "dtensor/<folder>/...". The libraries build
  # only that way; tests, examples and benchmarks also see the source root, so check them here.
  echo "[test] include form"
  if git grep -nE '#include [<"](mesh|placements|collectives|autograd|nn)/' -- '*.h' '*.cc' '*.cu' '*.cuh' '*.md'; then
    echo "the includes above must start with dtensor/ (README: embedding)" >&2
    exit 1
  fi

  echo "[test] ctest"
  ctest --test-dir "$build_dir" -j "$jobs" --output-on-failure --timeout 900
fi

# The second supported compiler and the CPU-only configuration: clang 14 with DTENSOR_CUDA=OFF
# must build warning-free (-Werror) and pass the CPU unit suite. By default that build carries
# AddressSanitizer + UBSan (and the libFuzzer targets, smoke-run after the suite), and a
# ThreadSanitizer build follows; DTENSOR_SANITIZERS=0 makes it a plain build instead. The
# sanitized builds compile at -O1, as the sanitizers' documentation suggests (less compile time
# than -O3: the ASan tree took 14 min here against 16; their checks cost more run time than the
# optimizations save). Suppressions: scripts/sanitizers/ (each says why).
sanitized_flags=(-DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" -DCMAKE_CXX_COMPILER=clang++
  -DDTENSOR_CUDA=OFF)
if [ "${DTENSOR_SKIP_CLANG:-0}" != "1" ] && [ "${DTENSOR_SANITIZERS:-1}" = "0" ]; then
  echo "[test] clang 14, CPU-only build"
  cmake -S . -B "${build_dir}-clang" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER=clang++ -DDTENSOR_CUDA=OFF
  cmake --build "${build_dir}-clang" -j "$jobs"
  ctest --test-dir "${build_dir}-clang" -j "$jobs" --output-on-failure --timeout 900 -L unit
fi
if [ "${DTENSOR_SKIP_CLANG:-0}" != "1" ] && [ "${DTENSOR_SANITIZERS:-1}" != "0" ]; then
  san="$PWD/scripts/sanitizers"
  echo "[test] clang 14, CPU-only, ASan + UBSan build"
  # DTENSOR_FUZZ builds the libFuzzer targets in this same build (scripts/fuzz_smoke.sh runs them).
  cmake -S . -B "${build_dir}-asan" -G Ninja "${sanitized_flags[@]}" \
    -DDTENSOR_SANITIZE=address,undefined -DDTENSOR_FUZZ=ON
  cmake --build "${build_dir}-asan" -j "$jobs"
  # Child processes (dtrun ranks, gpt_train, forks) inherit these and fail the same way.
  # allocator_may_return_null: an impossible allocation must fail as the library expects
  # (ResourceExhausted), not stop the process (SharedCpuBlockTest.AnImpossibleSizeStaysPrivate).
  # DTENSOR_TEST_TIME_SCALE: "waited for a timeout" limits x4; DTENSOR_TEST_SWEEP_STRIDE: the
  # exhaustive redistribution / plan sweeps run every 4th case (the g++ build ran them all).
  echo "[test] ctest (ASan + UBSan, unit)"
  ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:allocator_may_return_null=1" \
    LSAN_OPTIONS="suppressions=$san/lsan.supp:print_suppressions=0" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$san/ubsan.supp" \
    DTENSOR_TEST_TIME_SCALE=4 DTENSOR_TEST_SWEEP_STRIDE=4 ctest --test-dir "${build_dir}-asan" -j "$jobs" --output-on-failure --timeout 900 -L unit
  echo "[test] fuzz smoke (${FUZZ_SECONDS:-30} s per target)"
  FUZZ_JOBS="$jobs" bash scripts/fuzz_smoke.sh "${build_dir}-asan" "${FUZZ_SECONDS:-30}"

  if [ "${DTENSOR_SKIP_TSAN:-0}" != "1" ]; then
    # ThreadSanitizer on the code whose memory several threads share: the threads backend, the
    # DTensor / redistribution suite, autograd and the trainer on thread ranks (UCX and NCCL
    # processes share nothing between threads that these do not already cover; they stay out).
    # The OpenMP runtimes (LLVM's libomp with clang, libgomp under OpenBLAS) are not
    # instrumented, so TSan cannot see their barriers: OMP_THREAD_LIMIT=1 runs every OpenMP
    # region (ours and OpenBLAS's) on the thread that enters it (and OMP_NUM_THREADS=1 tells
    # OpenBLAS so: split for two threads, its GEMM's parts wait for each other, a hang under a
    # limit of one; the tools leave an OMP_NUM_THREADS they find alone), and ignore_noninstrumented_modules
    # keeps the accesses made inside those libraries (libomp's memsets of its own thread-team
    # blocks, reported as races when several rank threads start regions) out of the reports;
    # the rank threads, the communicators' own threads and everything they share stay checked.
    echo "[test] clang 14, CPU-only, TSan build"
    cmake -S . -B "${build_dir}-tsan" -G Ninja "${sanitized_flags[@]}" \
      -DDTENSOR_SANITIZE=thread -DDTENSOR_BUILD_BENCHMARKS=OFF
    cmake --build "${build_dir}-tsan" -j "$jobs" --target collectives_test core_test autograd_test gpt_test
    threads='ThreadsTest|All/ThreadsSweepTest|CutOffs/ThreadsCutOffTest|CommThreadTest'
    dtensor='DTensor[A-Za-z]*|Meshes/(RedistributeSuite|MeshLayouts)|Plan[A-Za-z]*|Random/PlanRandomTest|Small/PlanSweepTest|Redistribute[A-Za-z]*'
    autograd='ActivationCheckpoint|Engine|EveryStrategy[A-Za-z]*|OpDefs/EveryStrategy|OpsStrategy|Grad'
    trainer='GptTrainTest\.DataParallelLossesEqualSingleRank|GptFsdpTest\.(FsdpOnTwoThreeAndFourThreadRanksEqualsOneRank|NoReshardHsdpAndDdpEqualOneRank|TensorParallelRunsEqualOneRank)'
    echo "[test] ctest (TSan: threads backend, DTensor / redistribution, autograd, thread-rank trainer)"
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$san/tsan.supp" \
      OMP_THREAD_LIMIT=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 DTENSOR_TEST_TIME_SCALE=10 DTENSOR_TEST_SWEEP_STRIDE=8 \
      ctest --test-dir "${build_dir}-tsan" -j "$jobs" --output-on-failure --timeout 900 -L unit \
      -R "^(${threads}|${dtensor}|${autograd})\.|^(${trainer})\$"
  fi
fi
