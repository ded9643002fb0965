#!/usr/bin/env bash
# Runs every libFuzzer target of a build for a bounded time, each on a copy of its seed corpus.
#
#   scripts/fuzz_smoke.sh <build_dir> [seconds_per_target]     (default 30)
#
# The build must be configured with -DDTENSOR_FUZZ=ON (clang; tests/fuzz/CMakeLists.txt writes
# <build_dir>/fuzz_targets.txt); without it this prints why and exits 0. Prints per target the
# executions, coverage (libFuzzer's cov: and ft: at the end) and the crashes found; a crash
# (also a leak, a timeout of one input, an out-of-memory or a sanitizer report) leaves its input
# in <build_dir>/fuzz_findings/<target>/ and makes the script exit 1. To keep one as a
# regression: fix it, then copy it to tests/fuzz/regressions/<target>/ (fuzz_replay.<target>).
# Environment: FUZZ_RSS_LIMIT_MB (2048), FUZZ_TIMEOUT_S (per input, 10), FUZZ_TARGETS (names to
# run, space-separated; default all), FUZZ_JOBS (targets run at once, default 1; each is one
# process on one core, so up to the number of cores keeps every target its full time).
set -u
build=${1:?usage: fuzz_smoke.sh <build_dir> [seconds_per_target]}
seconds=${2:-30}
list="$build/fuzz_targets.txt"
if [[ ! -f "$list" ]]; then
  echo "fuzz_smoke: no fuzz targets in $build (configure with clang and -DDTENSOR_FUZZ=ON): skipped"
  exit 0
fi
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
work=$(mktemp -d "${TMPDIR:-/tmp}/fuzz_smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
findings="$build/fuzz_findings"
failed=0
jobs=${FUZZ_JOBS:-1}
# Runs one target; writes its table row to $work/$name/row (and, on failure, the end of its log
# to $work/$name/report).
run_target() {
  local name=$1 prog=$2 corpus=$3
  mkdir -p "$work/$name/corpus" "$work/$name/artifacts"
  if [[ ! -x "$prog" ]]; then
    printf '%-22s %12s %8s %8s %8s  %s\n' "$name" - - - - "not built ($prog)" >"$work/$name/row"
    return
  fi
  cp -r "$corpus"/. "$work/$name/corpus/" 2>/dev/null
  local log="$work/$name/log"
  (cd "$work/$name" && exec "$prog" corpus -max_total_time="$seconds" -rss_limit_mb="${FUZZ_RSS_LIMIT_MB:-2048}" \
    -timeout="${FUZZ_TIMEOUT_S:-10}" -print_final_stats=1 -artifact_prefix="$work/$name/artifacts/" >"$log" 2>&1) &
  local pid=$!
  wait "$pid"
  local rc=$?
  # libFuzzer ends with _exit, so the OpenMP runtime (LLVM's libomp with clang) leaves its
  # registration file behind: remove it (the pid was this target's).
  rm -f /dev/shm/__KMP_REGISTERED_LIB_"${pid}"_*
  local execs covline cov ft crashes status
  execs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -1)
  [[ -z "$execs" ]] && execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
  covline=$(grep -E '^#[0-9]+.*cov: [0-9]+' "$log" | tail -1)
  cov=$(sed -n 's/.*cov: \([0-9]*\).*/\1/p' <<<"$covline")
  ft=$(sed -n 's/.*ft: \([0-9]*\).*/\1/p' <<<"$covline")
  crashes=$(find "$work/$name/artifacts" -type f | wc -l)
  status=ok
  if [[ $rc -ne 0 || $crashes -gt 0 ]]; then
    status="FAILED (exit $rc)"
    mkdir -p "$findings/$name"
    cp "$work/$name/artifacts"/* "$findings/$name/" 2>/dev/null
    cp "$log" "$findings/$name/log.txt"
    {
      echo "---- $name: the end of its log (whole log and inputs in $findings/$name) ----"
      grep -v '^#[0-9]' "$log" | tail -40 | cut -c1-300
      echo "----"
    } >"$work/$name/report"
  fi
  printf '%-22s %12s %8s %8s %8s  %s\n' "$name" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$crashes" "$status" \
    >"$work/$name/row"
}

names=()
while read -r name prog corpus; do
  [[ -z "$name" ]] && continue
  if [[ -n "${FUZZ_TARGETS:-}" && " $FUZZ_TARGETS " != *" $name "* ]]; then continue; fi
  while [[ $(jobs -rp | wc -l) -ge $jobs ]]; do wait -n; done
  names+=("$name")
  run_target "$name" "$prog" "$corpus" &
done <"$list"
wait
printf '%-22s %12s %8s %8s %8s  %s\n' target executions cov ft crashes status
for name in "${names[@]}"; do
  cat "$work/$name/row" 2>/dev/null || printf '%-22s  %s\n' "$name" "FAILED (no result)"
  grep -q ' ok$' "$work/$name/row" 2>/dev/null || failed=1
done
for name in "${names[@]}"; do
  [[ -f "$work/$name/report" ]] && cat "$work/$name/report"
done
exit $failed
