#!/usr/bin/env bash
# gpu_step_bench.sh's logic on the CPU (--cpu-smoke: a tiny model, one thread rank): its runs,
# the out-of-memory fallback (simulated at B=16, rerun at B=8), the table with the MFU formula
# checked against the trainer's, the bf16-vs-fp32 checks; DT_BENCH_DEADLINE; bad arguments exit 2;
# and, where no GPU is visible, the GPU run stops at once with "no GPU visible" and exit 4.
#   gpu_step_bench_test.sh GPU_STEP_BENCH_SH BUILD_DIR
set -u
script=$1
build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "gpu_step_bench_test: $*"
  printf -- '--- stdout\n%s\n--- stderr\n' "$log"
  cat "$tmp/err"
  exit 1
}

log=$(OMP_NUM_THREADS=1 DT_BENCH_SIMULATE_OOM=16 bash "$script" "$build" --cpu-smoke --batch 16 --out "$tmp/run" \
  2>"$tmp/err")
rc=$?
[[ $rc -eq 0 ]] || fail "exit $rc, want 0"
for dtype in bf16 fp32; do
  grep -qE "^$dtype B=8 T=32 \(B=16: OOM\) +\| +[0-9.]+ \| +[0-9.]+- *[0-9.]+ +\| +[0-9]+ \| +[0-9.]+% \|" <<<"$log" ||
    fail "no $dtype row at the fallback B=8 with its numbers"
  [[ -s "$tmp/run/speed_${dtype}_b16.log" ]] || fail "the simulated out-of-memory log of $dtype was not kept"
  [[ $(wc -l <"$tmp/run/speed_$dtype.jsonl") -eq 6 ]] || fail "speed_$dtype.jsonl does not hold 6 steps"
  [[ $(wc -l <"$tmp/run/curve_$dtype.jsonl") -eq 12 ]] || fail "curve_$dtype.jsonl does not hold 12 steps"
done
grep -q '^MFU = tokens/s x flops per token / peak; .*(the trainer agrees)$' <<<"$log" ||
  fail "the MFU formula line does not agree with the trainer's flops per token"
grep -q '^bf16 B=8 .*>= 460K tokens/s: \(ok\|BELOW\)' <<<"$log" || fail "no target flag on the bf16 row"
checks=$(grep -c '^check .*: ok' <<<"$log")
[[ $checks -eq 3 ]] || fail "$checks checks ok, want 3 (speed first step, curve first step, curve)"
grep -q '^kernel profile: not run (--cpu-smoke)$' <<<"$log" || fail "no word on the kernel profile"

# DT_BENCH_DEADLINE: runs that would start with under 20 s left are not started and fail, and no
# metrics of an earlier run in the same folder pass for theirs.
mkdir -p "$tmp/late"
echo '{"step": 0, "loss": 1.0}' >"$tmp/late/speed_bf16.jsonl"
log=$(OMP_NUM_THREADS=1 DT_BENCH_DEADLINE=1 bash "$script" "$build" --cpu-smoke --out "$tmp/late" 2>"$tmp/err")
rc=$?
[[ $rc -eq 1 ]] || fail "DT_BENCH_DEADLINE=1: exit $rc, want 1"
[[ ! -e "$tmp/late/speed_bf16.jsonl" ]] || fail "DT_BENCH_DEADLINE=1: an earlier run's metrics were left in place"
grep -q 'speed_bf16: B=4 T=32, 6 steps: exit 124' "$tmp/err" || fail "DT_BENCH_DEADLINE=1: speed_bf16 was not cut"
grep -q 'not run: .* left before DT_BENCH_DEADLINE=1' "$tmp/late/speed_bf16.log" || fail "DT_BENCH_DEADLINE=1: no reason"

DT_BENCH_DEADLINE=10m bash "$script" "$build" --cpu-smoke >/dev/null 2>&1
rc=$?
[[ $rc -eq 2 ]] || fail "DT_BENCH_DEADLINE=10m: exit $rc, want 2"

bash "$script" "$build" --cpu-smoke --steps 2 >/dev/null 2>&1
rc=$?
[[ $rc -eq 2 ]] || fail "--steps 2: exit $rc, want 2"
bash "$script" "$tmp/nowhere" >/dev/null 2>&1
rc=$?
[[ $rc -eq 2 ]] || fail "a missing folder: exit $rc, want 2"
no_gpu=skipped
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU' && ! compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  log=$(timeout 60 bash "$script" "$build" --out "$tmp/gpu" 2>"$tmp/err")
  rc=$?
  [[ $rc -eq 4 ]] || fail "no GPU: exit $rc, want 4"
  grep -q 'no GPU visible' <<<"$log" || fail "no GPU: no 'no GPU visible' message"
  [[ ! -e "$tmp/gpu/speed_bf16.log" ]] || fail "no GPU: a run started anyway"
  no_gpu=ok
fi
echo "gpu_step_bench_test: ok (no-GPU exit: $no_gpu)"
