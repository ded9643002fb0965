#!/usr/bin/env bash
# cpu_step_compare.sh: gpt_train's CPU training step beside its two anchors, measured in turns in
# one run on this machine (machines differ, and one machine's speed drifts by more than the
# targets' margins within minutes, so each number is only read against the others of its round):
# GPT-2 124M, B=4, T=64, one CPU process.
#
#   benchmarks/nn/cpu_step_compare.sh BUILD_DIR [--rounds R] [--steps N] [--warmup K] [--vocab V]
#                                     [--out DIR]
#
# It runs, R rounds (default 3) of one run each, in an order that turns by one each round
# (dtensor pytorch floor, then pytorch floor dtensor, ...) so that a slow stretch of the machine
# falls on each contender in turn:
#   dtensor  BUILD/examples/gpt/gpt_train --model gpt2 --vocab V --batch 4 --seq 64 --device cpu
#            (one process, its default threads, on this repository's README as byte tokens; the
#            environment as given, so OMP_WAIT_POLICY=... before the script reaches it too)
#   pytorch  OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 benchmarks/nn/torch_gpt2_step.py (Debian's
#            python3-torch 1.13, torch.set_num_threads(nproc), the same model: see its header;
#            TORCH_PYTHON=... names another interpreter). Where torch does not import it is
#            installed with apt-get when root, else the row is skipped with the command to
#            install it
#   floor    BUILD/benchmarks/sgemm_rate: the FLOPs of the step's matrix multiplies (6 x the
#            parameters in matmuls x tokens, plus attention's Q K^T and P V forward and backward:
#            ~191 GFLOP) over OpenBLAS's sgemm rate on the step's own GEMM shapes, timed here
# dtensor and pytorch for K warmup steps (default 2) and N measured ones (default 3) a round, the
# floor timing each shape itself; it keeps their logs under --out (default: a fresh temporary
# folder) and prints a table per round (each contender's median step, the ratios within the
# round), then one table: per contender the median of all its measured steps (floor: of its
# rounds) and their range, tokens/s, threads, parameters, and dtensor's step time over it as the
# median of the rounds' ratios (their range beside it), with the issue's target and an ok / BELOW
# flag:  dtensor <= 0.5 x PyTorch's step time; dtensor <= 1.15 x the sgemm floor.
# V defaults to 50304, GPT-2's 50257 padded to a multiple of 128 (what gpt_train uses with
# --tokenizer gpt2, and llm.c); all three use the same V. Three rounds take about 3-4 minutes on 2
# cores. Exit status: 1 if a run failed; else 0 (BELOW rows included).
set -u -o pipefail

usage() {
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
  exit 2
}

[[ $# -ge 1 ]] || usage
build=$(cd "$1" 2>/dev/null && pwd) || { echo "cpu_step_compare.sh: no build folder '$1'" >&2; exit 2; }
shift
rounds=3
steps=3
warmup=2
vocab=50304
out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift ;;
    --steps) steps="$2"; shift ;;
    --warmup) warmup="$2"; shift ;;
    --vocab) vocab="$2"; shift ;;
    --out) out="$2"; shift ;;
    *) usage ;;
  esac
  shift
done
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "cpu_step_compare.sh: --rounds wants a positive integer, not '$rounds'" >&2; exit 2; }
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "cpu_step_compare.sh: --steps wants a positive integer, not '$steps'" >&2; exit 2; }
[[ "$warmup" =~ ^[0-9]+$ ]] || { echo "cpu_step_compare.sh: --warmup wants an integer >= 0, not '$warmup'" >&2; exit 2; }
[[ "$vocab" =~ ^[1-9][0-9]*$ ]] || { echo "cpu_step_compare.sh: --vocab wants a positive integer, not '$vocab'" >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
trainer="$build/examples/gpt/gpt_train"
sgemm="$build/benchmarks/sgemm_rate"
torch_step="$here/torch_gpt2_step.py"
python=${TORCH_PYTHON:-/usr/bin/python3}
for f in "$trainer" "$sgemm"; do
  [[ -x "$f" ]] || { echo "cpu_step_compare.sh: $f is not built (cmake --build $build --target gpt_train sgemm_rate)" >&2; exit 2; }
done
if [[ -z "$out" ]]; then
  out=$(mktemp -d /tmp/cpu_step_compare.XXXXXX)
fi
mkdir -p "$out"
echo "cpu_step_compare.sh: logs under $out" >&2

# The model: GPT-2 124M at B=4, T=64.
batch=4 seq=64 n_layer=12 n_head=12 n_embd=768
tokens=$((batch * seq))
failed=0

# median_range FILE: "median min max" of the numbers in FILE, one a line (empty: nothing).
median_range() {
  sort -g "$1" | awk '{ v[NR] = $1 } END { if (NR == 0) exit
    m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.1f %.1f %.1f\n", m, v[1], v[NR] }'
}

# median_range3 FILE: the same with three decimals (ratios).
median_range3() {
  sort -g "$1" | awk '{ v[NR] = $1 } END { if (NR == 0) exit
    m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.3f %.3f %.3f\n", m, v[1], v[NR] }'
}

# fail NAME RC LOG: reports a failed run and the end of its log.
fail() {
  failed=1
  echo "  $1 FAILED (exit $2); its log ($3) ends:" >&2
  tail -5 "$3" | sed 's/^/    /' >&2
}

echo "# cpu_step_compare.sh $(date -u '+%F %T UTC'), $(nproc) cores, $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo), load before: $(cut -d' ' -f1-3 /proc/loadavg)"

# Each contender's run for round R leaves its step times (ms, one a line, warmup dropped) in
# $out/NAME.rR.ms, adds them to $out/NAME.ms, and its round's median to round_ms[NAME,R]; a
# contender that fails is not run again.
declare -A round_ms=()
declare -A broken=()
declare -a round_order=()

# ---- dtensor: gpt_train, the step_ms of its --metrics after the warmup steps ----
dt_params="" dt_threads=""
corpus="$out/corpus.txt"
if [[ -s "$here/../../README.md" ]]; then
  head -c 200000 "$here/../../README.md" >"$corpus"
else  # any text will do: byte tokens, and the step's time does not depend on them
  yes "a few words of synthetic text for the trainer to read as bytes" | head -c 65536 >"$corpus"
fi
run_dtensor() {
  local r=$1 log="$out/dtensor.r$1.log" rc
  "$trainer" --text "$corpus" --model gpt2 --vocab "$vocab" --batch "$batch" --seq "$seq" \
    --steps $((warmup + steps)) --sample-tokens 0 --device cpu --progress false \
    --metrics "$out/dtensor.r$r.jsonl" >"$log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    fail dtensor "$rc" "$log"
    return 1
  fi
  awk -v w="$warmup" 'NR > w && match($0, /"step_ms":[0-9.eE+-]+/) { print substr($0, RSTART + 10, RLENGTH - 10) }' \
    "$out/dtensor.r$r.jsonl" >"$out/dtensor.r$r.ms"
  [[ -s "$out/dtensor.r$r.ms" ]] || { fail "dtensor (no step_ms in $out/dtensor.r$r.jsonl)" 0 "$log"; return 1; }
  dt_params=$(sed -n 's/.*, \([0-9]*\) parameters,.*/\1/p' "$log" | head -1)
  dt_threads=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # gpt_train: one thread per CPU it may use
}

# ---- PyTorch: torch_gpt2_step.py under Debian's python3-torch ----
pt_params="" pt_threads="" pt_version="" pt_note=""
have_torch=0
if "$python" -c 'import torch' >/dev/null 2>&1; then
  have_torch=1
elif [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "  pytorch: torch does not import; installing python3-torch (apt-get install -y --no-install-recommends)" >&2
  installed=1
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-torch >"$out/apt.log" 2>&1; then
    apt-get update >>"$out/apt.log" 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-torch >>"$out/apt.log" 2>&1 ||
      installed=0
  fi
  if "$python" -c 'import torch' >/dev/null 2>&1; then
    have_torch=1
  elif [[ $installed -eq 1 ]]; then
    pt_note="python3-torch is installed, but $python cannot import torch"
  else
    pt_note="python3-torch did not install (see $out/apt.log)"
  fi
else
  pt_note="no torch for $python: install it with 'sudo apt-get install python3-torch'"
fi
[[ $have_torch -eq 1 ]] || { broken[pytorch]=1; echo "  pytorch: skipped: $pt_note" >&2; }
run_pytorch() {
  local r=$1 log="$out/pytorch.r$1.log" rc
  OMP_WAIT_POLICY=PASSIVE "$python" "$torch_step" --batch "$batch" --seq "$seq" --n-layer "$n_layer" \
    --n-head "$n_head" --n-embd "$n_embd" --vocab "$vocab" --steps "$steps" --warmup "$warmup" >"$log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    fail pytorch "$rc" "$log"
    return 1
  fi
  awk '/^step / && !/warmup/ { for (i = 1; i < NF; ++i) if ($i == "time") print $(i + 1) }' "$log" \
    >"$out/pytorch.r$r.ms"
  [[ -s "$out/pytorch.r$r.ms" ]] || { fail "pytorch (no step times)" 0 "$log"; return 1; }
  pt_params=$(awk '/^torch: / { for (i = 1; i < NF; ++i) if ($i == "params") print $(i + 1) }' "$log")
  pt_threads=$(sed -n 's/^torch [^,]*, \([0-9]*\) threads,.*/\1/p' "$log" | head -1)
  pt_version=$(sed -n 's/^torch \([^,]*\),.*/\1/p' "$log" | head -1)
}

# ---- The sgemm floor: the step's GEMM FLOPs at OpenBLAS's rate on the step's shapes ----
fl_gflop="" fl_rate="" blas_core=""
run_floor() {
  local r=$1 log="$out/sgemm_rate.r$1.log" rc fl_ms
  "$sgemm" --batch "$batch" --seq "$seq" --n-layer "$n_layer" --n-head "$n_head" --n-embd "$n_embd" \
    --vocab "$vocab" --trials 3 >"$log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    fail sgemm_rate "$rc" "$log"
    return 1
  fi
  read -r fl_gflop fl_rate fl_ms < <(awk '/^floor: / { print $3, $5, $7 }' "$log")
  [[ -n "$fl_ms" ]] || { fail "sgemm_rate (no floor line)" 0 "$log"; return 1; }
  echo "$fl_ms" >"$out/floor.r$r.ms"
  blas_core=$(sed -n 's/.*OpenBLAS \([^ ]*\) kernels.*/\1/p' "$log" | head -1)
}

# run NAME R: NAME's run for round R.
run() {
  case "$1" in
    dtensor) run_dtensor "$2" ;;
    pytorch) run_pytorch "$2" ;;
    floor) run_floor "$2" ;;
  esac
}

names=(dtensor pytorch floor)
for name in "${names[@]}"; do : >"$out/$name.ms"; done  # --out may hold an earlier run's
for ((r = 1; r <= rounds; ++r)); do
  order=""
  for ((i = 0; i < 3; ++i)); do
    name=${names[$(((r - 1 + i) % 3))]}
    order+="${order:+ }$name"
    [[ -z "${broken[$name]:-}" ]] || continue
    echo "  round $r/$rounds: $name" >&2
    start=$SECONDS
    if run "$name" "$r"; then
      cat "$out/$name.r$r.ms" >>"$out/$name.ms"
      read -r "round_ms[$name,$r]" _ _ < <(median_range "$out/$name.r$r.ms")
    else
      broken[$name]=1
    fi
    echo "    $((SECONDS - start)) s" >&2
  done
  round_order[r]=$order
done

echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "## GPT-2 124M (L=$n_layer H=$n_head C=$n_embd V=$vocab), B=$batch T=$seq, one CPU process; OpenBLAS" \
  "${blas_core:-?} kernels; $rounds rounds, each: $warmup warmup steps and $steps measured ones"
echo
echo "### Each round: the contender's median step (ms), dtensor's over it"
printf "%-5s | %-24s | %9s | %9s | %9s | %10s | %10s\n" round order dtensor pytorch floor "dt/pytorch" "dt/floor"
: >"$out/ratio_pytorch" && : >"$out/ratio_floor"
for ((r = 1; r <= rounds; ++r)); do
  dt=${round_ms[dtensor,$r]:-} pt=${round_ms[pytorch,$r]:-} fl=${round_ms[floor,$r]:-}
  rp="" rf=""
  [[ -n "$dt" && -n "$pt" ]] && rp=$(awk -v a="$dt" -v b="$pt" 'BEGIN { printf "%.3f", a / b }') && echo "$rp" >>"$out/ratio_pytorch"
  [[ -n "$dt" && -n "$fl" ]] && rf=$(awk -v a="$dt" -v b="$fl" 'BEGIN { printf "%.3f", a / b }') && echo "$rf" >>"$out/ratio_floor"
  rp=${rp:+${rp}x} rf=${rf:+${rf}x}
  printf "%-5s | %-24s | %9s | %9s | %9s | %10s | %10s\n" "$r" "${round_order[$r]}" "${dt:--}" "${pt:--}" "${fl:--}" \
    "${rp:--}" "${rf:--}"
done

# The pooled numbers: every measured step (floor: every round's floor), and the rounds' ratios.
dt_ms="" dt_lo="" dt_hi="" pt_ms="" pt_lo="" pt_hi="" fl_ms="" fl_lo="" fl_hi=""
[[ -s "$out/dtensor.ms" ]] && read -r dt_ms dt_lo dt_hi < <(median_range "$out/dtensor.ms")
[[ -s "$out/pytorch.ms" ]] && read -r pt_ms pt_lo pt_hi < <(median_range "$out/pytorch.ms")
[[ -s "$out/floor.ms" ]] && read -r fl_ms fl_lo fl_hi < <(median_range "$out/floor.ms")
rp_med="" rp_lo="" rp_hi="" rf_med="" rf_lo="" rf_hi=""
[[ -s "$out/ratio_pytorch" ]] && read -r rp_med rp_lo rp_hi < <(median_range3 "$out/ratio_pytorch")
[[ -s "$out/ratio_floor" ]] && read -r rf_med rf_lo rf_hi < <(median_range3 "$out/ratio_floor")

echo
echo "### Over the rounds: median of the measured steps; dtensor/it: the median of the rounds' ratios (their range)"
awk -v dt="$dt_ms" -v dt_lo="$dt_lo" -v dt_hi="$dt_hi" -v dt_p="$dt_params" -v dt_t="$dt_threads" \
  -v pt="$pt_ms" -v pt_lo="$pt_lo" -v pt_hi="$pt_hi" -v pt_p="$pt_params" -v pt_t="$pt_threads" -v pt_v="$pt_version" \
  -v pt_note="$pt_note" -v fl="$fl_ms" -v fl_lo="$fl_lo" -v fl_hi="$fl_hi" -v fl_gflop="$fl_gflop" -v fl_rate="$fl_rate" \
  -v rp="$rp_med" -v rp_lo="$rp_lo" -v rp_hi="$rp_hi" -v rf="$rf_med" -v rf_lo="$rf_lo" -v rf_hi="$rf_hi" \
  -v tokens="$tokens" -v wait_policy="${OMP_WAIT_POLICY:-unset}" '
  function cell(v, fmt) { return v == "" ? "-" : sprintf(fmt, v) }
  function range(lo, hi) { return lo == "" ? "-" : sprintf("%.0f-%.0f", lo, hi) }
  # One contender: its step ms, the rounds ratio dtensor / it against `target` (empty: none).
  function row(name, ms, lo, hi, threads, params, ratio, r_lo, r_hi, target, note,   cellr, flag) {
    cellr = "-"; flag = ""
    if (target != "" && ratio != "") {
      cellr = sprintf("%.2fx (%.2f-%.2f)", ratio, r_lo, r_hi)
      flag = sprintf("<= %.2fx: %s", target, (ratio <= target) ? "ok" : "BELOW")
    } else if (target != "") {
      flag = sprintf("<= %.2fx: n/a", target)
    }
    printf "%-26s | %9s | %11s | %8s | %7s | %10s | %17s | %s%s\n", name, cell(ms, "%.1f"), range(lo, hi),
           ms == "" ? "-" : sprintf("%.1f", tokens / (ms / 1000)), threads == "" ? "-" : threads,
           params == "" ? "-" : params, cellr, flag, note == "" ? "" : (flag == "" ? "" : "  ") "(" note ")"
  }
  BEGIN {
    printf "%-26s | %9s | %11s | %8s | %7s | %10s | %17s | %s\n", "contender", "step (ms)", "range (ms)", "tokens/s",
           "threads", "params", "dtensor/it", "target"
    row("dtensor gpt_train", dt, dt_lo, dt_hi, dt_t, dt_p, "", "", "", "", "OMP_WAIT_POLICY " wait_policy)
    row("pytorch " (pt_v == "" ? "" : pt_v " ") "(PASSIVE)", pt, pt_lo, pt_hi, pt_t, pt_p, rp, rp_lo, rp_hi, 0.5, pt_note)
    row("sgemm floor", fl, fl_lo, fl_hi, "", "", rf, rf_lo, rf_hi, 1.15,
        fl == "" ? "" : sprintf("%.1f GFLOP at %.1f GFLOP/s, last round", fl_gflop, fl_rate))
    if (dt_p != "" && pt_p != "" && dt_p != pt_p) printf "# parameters differ: dtensor %s, pytorch %s\n", dt_p, pt_p
  }'

if [[ $failed -ne 0 ]]; then
  echo "cpu_step_compare.sh: a run failed (see above)" >&2
  exit 1
fi
exit 0
