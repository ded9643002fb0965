#!/usr/bin/env bash
# Seeded fault injection into training, for longer runs than the unit suite's few trials:
# gpt_train under dtrun (UCX, 2-4 processes; DDP, FSDP, TP) gets a SIGKILL, a SIGSTOP, a
# network cut (network namespaces; skipped with the reason where they cannot be made) or a
# kill during a checkpoint save, at a seeded random moment (tests/faults/fault_test.cc).
#
#   scripts/fault_trials.sh [BUILD_DIR] [TRIALS] [SEED]     defaults: build 50 2026
#
# Prints one line per trial and a table per fault kind and parallelism: trials, survivors,
# survivors that exited with an error naming the operation and the peer in time, resumed runs
# with the right losses, leftovers (must be 0). Exit status: the test's (0: every check held).
set -u
build=${1:-build}
trials=${2:-50}
seed=${3:-2026}
bin="$build/tests/faults_test"
[[ -x "$bin" ]] || { echo "fault_trials: $bin is not built (cmake --build $build --target faults_test)" >&2; exit 2; }
DTENSOR_FAULT_TRIALS=$trials DTENSOR_FAULT_SEED=$seed exec "$bin" \
  --gtest_filter='FaultTrials.SurvivorsFailInTimeAndNothingIsLeftBehind'
