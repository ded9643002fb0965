#!/usr/bin/env bash
# cpu_step_compare.sh's logic with stand-ins for its three programs (a fake build folder whose
# gpt_train and sgemm_rate, and a TORCH_PYTHON, print given step times per round; ~1 s):
# the rounds take turns in the order documented, each round's ratios are its own medians'
# ratios, the verdict is the median of the rounds' ratios (not the ratio of pooled medians: the
# numbers are chosen so that the two disagree), a program that fails runs no more rounds and
# makes the exit status 1, and bad flags are refused.
#   cpu_step_compare_test.sh CPU_STEP_COMPARE_SH
set -u
script=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "cpu_step_compare_test: $*"
  printf -- '--- stdout\n%s\n--- stderr\n' "${log:-}"
  cat "$tmp/err" 2>/dev/null
  exit 1
}

# The stand-ins. Each appends its name to $tmp/order and takes its step time for round k (its
# k-th run) from its list: dtensor 100 300 200, pytorch 180 500 400, floor 90 250 180. Rounds'
# ratios: dtensor/pytorch 0.556 0.600 0.500 (median 0.556: BELOW 0.5, though the pooled medians
# give 200 / 400 = 0.5), dtensor/floor 1.111 1.200 1.111 (median 1.111: ok for 1.15).
build="$tmp/build"
mkdir -p "$build/examples/gpt" "$build/benchmarks"
cat >"$tmp/stub_lib.sh" <<EOF
# nth NAME LIST...: appends NAME to the order, prints the LIST's entry for NAME's run count.
nth() {
  local name=\$1 k
  shift
  k=\$(grep -cx "\$name" "$tmp/order" 2>/dev/null)
  echo "\$name" >>"$tmp/order"
  local all=("\$@")
  echo "\${all[\$k]}"
}
EOF
cat >"$build/examples/gpt/gpt_train" <<EOF
#!/usr/bin/env bash
. "$tmp/stub_lib.sh"
ms=\$(nth dtensor 100 300 200)
metrics="" steps=0
while [[ \$# -gt 0 ]]; do
  case "\$1" in --metrics) metrics=\$2; shift ;; --steps) steps=\$2; shift ;; esac
  shift
done
echo "gpt_train: gpt2, 124475904 parameters, stand-in"
for ((i = 0; i < steps; ++i)); do echo "{\"step\":\$i,\"step_ms\":\$ms}" >>"\$metrics"; done
EOF
cat >"$build/benchmarks/sgemm_rate" <<EOF
#!/usr/bin/env bash
. "$tmp/stub_lib.sh"
ms=\$(nth floor 90 250 180)
[[ -z "\${STUB_FLOOR_FAILS:-}" ]] || { echo "sgemm_rate: stand-in failure"; exit 3; }
echo "# sgemm_rate: stand-in, float32, OpenBLAS Stub kernels, 2 threads"
echo "floor: step_gflop 191.60 rate_gflops 100.0 floor_ms \$ms"
EOF
cat >"$tmp/python" <<EOF
#!/usr/bin/env bash
[[ "\$1" == -c ]] && exit 0  # import torch
. "$tmp/stub_lib.sh"
ms=\$(nth pytorch 180 500 400)
steps=0 warmup=0
while [[ \$# -gt 0 ]]; do
  case "\$1" in --steps) steps=\$2; shift ;; --warmup) warmup=\$2; shift ;; esac
  shift
done
echo "torch 9.9-stub, 2 threads, OMP_WAIT_POLICY=PASSIVE, 124475904 parameters"
for ((i = 0; i < warmup; ++i)); do echo "step \$i  loss 1.0  time 999 ms (warmup)"; done
for ((i = 0; i < steps; ++i)); do echo "step \$((warmup + i))  loss 1.0  time \$ms ms"; done
echo "torch: median_ms \$ms tokens_per_s 1 params 124475904"
EOF
chmod +x "$build/examples/gpt/gpt_train" "$build/benchmarks/sgemm_rate" "$tmp/python"

# Three rounds.
log=$(TORCH_PYTHON="$tmp/python" bash "$script" "$build" --rounds 3 --steps 2 --warmup 1 --out "$tmp/o1" 2>"$tmp/err")
rc=$?
[[ $rc -eq 0 ]] || fail "exited $rc"
order=$(tr '\n' ' ' <"$tmp/order")
[[ "$order" == "dtensor pytorch floor pytorch floor dtensor floor dtensor pytorch " ]] ||
  fail "ran in the order '$order'"
# round | order | dtensor | pytorch | floor | dt/pytorch | dt/floor
row() { grep -E "^$1 +\|" <<<"$log" | tr -s ' ' | sed 's/ | /|/g'; }
[[ "$(row 1)" == "1|dtensor pytorch floor|100.0|180.0|90.0|0.556x|1.111x" ]] || fail "round 1 row: '$(row 1)'"
[[ "$(row 2)" == "2|pytorch floor dtensor|300.0|500.0|250.0|0.600x|1.200x" ]] || fail "round 2 row: '$(row 2)'"
[[ "$(row 3)" == "3|floor dtensor pytorch|200.0|400.0|180.0|0.500x|1.111x" ]] || fail "round 3 row: '$(row 3)'"
grep -qE '^pytorch 9.9-stub \(PASSIVE\) +\| +400.0 \| +180-500 \|.*\| +0.56x \(0.50-0.60\) \| <= 0.50x: BELOW' <<<"$log" ||
  fail "no pytorch row with the median of the rounds' ratios, 0.56x (0.50-0.60), BELOW"
grep -qE '^sgemm floor +\| +180.0 \| +90-250 \|.*\| +1.11x \(1.11-1.20\) \| <= 1.15x: ok' <<<"$log" ||
  fail "no floor row with 1.11x (1.11-1.20), ok"
grep -qE '^dtensor gpt_train +\| +200.0 \| +100-300 \|.* 124475904 ' <<<"$log" || fail "no dtensor row of 200.0 (100-300)"
# The warmup steps are not counted: every measured time is the round's.
[[ $(wc -l <"$tmp/o1/dtensor.ms") -eq 6 && $(wc -l <"$tmp/o1/pytorch.ms") -eq 6 ]] ||
  fail "$(wc -l <"$tmp/o1/dtensor.ms") dtensor / $(wc -l <"$tmp/o1/pytorch.ms") pytorch step times, want 6 each"

# The floor fails in round 1: it is not run again, the others run every round, the exit status is 1.
rm -f "$tmp/order"
log=$(STUB_FLOOR_FAILS=1 TORCH_PYTHON="$tmp/python" bash "$script" "$build" --rounds 2 --steps 1 --warmup 0 \
  --out "$tmp/o2" 2>"$tmp/err")
rc=$?
[[ $rc -eq 1 ]] || fail "exited $rc with a failing sgemm_rate, want 1"
order=$(tr '\n' ' ' <"$tmp/order")
[[ "$order" == "dtensor pytorch floor pytorch dtensor " ]] || fail "ran in the order '$order' with a failing floor"
grep -q 'sgemm_rate FAILED (exit 3)' "$tmp/err" || fail "no report of sgemm_rate's failure"
grep -qE '^sgemm floor +\| +- \|.*<= 1.15x: n/a' <<<"$log" || fail "no n/a floor row"

# Bad flags.
for bad in "--rounds 0" "--steps x" "--warmup -1" "--bogus 1"; do
  # shellcheck disable=SC2086  # the flag and its value as two words
  bash "$script" "$build" $bad >/dev/null 2>&1
  rc=$?
  [[ $rc -eq 2 ]] || fail "'$bad' exited $rc, want 2"
done
echo "cpu_step_compare_test: ok"
