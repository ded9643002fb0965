#!/usr/bin/env bash
# cpu_step_compare.sh: gpt_train's CPU training step beside its two anchors, measured one after
# the other in one run on this machine (machines differ, so each number is only read against the
# others of the same run): GPT-2 124M, B=4, T=64, one CPU process.
#
#   benchmarks/nn/cpu_step_compare.sh BUILD_DIR [--steps N] [--warmup K] [--vocab V] [--out DIR]
#
# It runs
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
# each for K warmup steps (default 3) and N measured ones (default 5; the floor times each shape
# itself), keeps their logs under --out (default: a fresh temporary folder), and prints one table:
# per contender the median step time after warmup (and the range), tokens/s, threads, parameters,
# and dtensor's step time over it with the issue's target and an ok / BELOW flag:
#   dtensor <= 0.5 x PyTorch's step time; dtensor <= 1.15 x the sgemm floor.
# V defaults to 50304, GPT-2's 50257 padded to a multiple of 128 (what gpt_train uses with
# --tokenizer gpt2, and llm.c); all three use the same V. Runs take about 2-3 minutes on 2 cores.
# Exit status: 1 if a run failed; else 0 (BELOW rows included).
set -u -o pipefail

usage() {
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
  exit 2
}

[[ $# -ge 1 ]] || usage
build=$(cd "$1" 2>/dev/null && pwd) || { echo "cpu_step_compare.sh: no build folder '$1'" >&2; exit 2; }
shift
steps=5
warmup=3
vocab=50304
out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift ;;
    --warmup) warmup="$2"; shift ;;
    --vocab) vocab="$2"; shift ;;
    --out) out="$2"; shift ;;
    *) usage ;;
  esac
  shift
done
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

# fail NAME RC LOG: reports a failed run and the end of its log.
fail() {
  failed=1
  echo "  $1 FAILED (exit $2); its log ($3) ends:" >&2
  tail -5 "$3" | sed 's/^/    /' >&2
}

echo "# cpu_step_compare.sh $(date -u '+%F %T UTC'), $(nproc) cores, $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo), load before: $(cut -d' ' -f1-3 /proc/loadavg)"

# ---- dtensor: gpt_train, the median step_ms of its --metrics after the warmup steps ----
dt_ms="" dt_lo="" dt_hi="" dt_params="" dt_threads=""
corpus="$out/corpus.txt"
if [[ -s "$here/../../README.md" ]]; then
  head -c 200000 "$here/../../README.md" >"$corpus"
else  # any text will do: byte tokens, and the step's time does not depend on them
  yes "a few words of synthetic text for the trainer to read as bytes" | head -c 65536 >"$corpus"
fi
echo "  dtensor: gpt_train, $warmup + $steps steps" >&2
start=$SECONDS
"$trainer" --text "$corpus" --model gpt2 --vocab "$vocab" --batch "$batch" --seq "$seq" --steps $((warmup + steps)) \
  --sample-tokens 0 --device cpu --progress false --metrics "$out/dtensor.jsonl" >"$out/dtensor.log" 2>&1
rc=$?
if [[ $rc -ne 0 ]]; then
  fail dtensor "$rc" "$out/dtensor.log"
else
  awk -v w="$warmup" 'NR > w && match($0, /"step_ms":[0-9.eE+-]+/) { print substr($0, RSTART + 10, RLENGTH - 10) }' \
    "$out/dtensor.jsonl" >"$out/dtensor.ms"
  read -r dt_ms dt_lo dt_hi < <(median_range "$out/dtensor.ms")
  dt_params=$(sed -n 's/.*, \([0-9]*\) parameters,.*/\1/p' "$out/dtensor.log" | head -1)
  dt_threads=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # gpt_train: one thread per CPU it may use
  [[ -n "$dt_ms" ]] || fail "dtensor (no step_ms in $out/dtensor.jsonl)" 0 "$out/dtensor.log"
fi
echo "    $((SECONDS - start)) s" >&2

# ---- PyTorch: torch_gpt2_step.py under Debian's python3-torch ----
pt_ms="" pt_lo="" pt_hi="" pt_params="" pt_threads="" pt_version="" pt_note=""
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
if [[ $have_torch -eq 1 ]]; then
  echo "  pytorch: torch_gpt2_step.py, $warmup + $steps steps" >&2
  start=$SECONDS
  OMP_WAIT_POLICY=PASSIVE "$python" "$torch_step" --batch "$batch" --seq "$seq" --n-layer "$n_layer" \
    --n-head "$n_head" --n-embd "$n_embd" --vocab "$vocab" --steps "$steps" --warmup "$warmup" \
    >"$out/pytorch.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    fail pytorch "$rc" "$out/pytorch.log"
  else
    awk '/^step / && !/warmup/ { for (i = 1; i < NF; ++i) if ($i == "time") print $(i + 1) }' "$out/pytorch.log" \
      >"$out/pytorch.ms"
    read -r pt_ms pt_lo pt_hi < <(median_range "$out/pytorch.ms")
    pt_params=$(awk '/^torch: / { for (i = 1; i < NF; ++i) if ($i == "params") print $(i + 1) }' "$out/pytorch.log")
    pt_threads=$(sed -n 's/^torch [^,]*, \([0-9]*\) threads,.*/\1/p' "$out/pytorch.log" | head -1)
    pt_version=$(sed -n 's/^torch \([^,]*\),.*/\1/p' "$out/pytorch.log" | head -1)
    [[ -n "$pt_ms" ]] || fail "pytorch (no step times)" 0 "$out/pytorch.log"
  fi
  echo "    $((SECONDS - start)) s" >&2
else
  echo "  pytorch: skipped: $pt_note" >&2
fi

# ---- The sgemm floor: the step's GEMM FLOPs at OpenBLAS's rate on the step's shapes ----
fl_ms="" fl_gflop="" fl_rate=""
echo "  floor: sgemm_rate" >&2
start=$SECONDS
"$sgemm" --batch "$batch" --seq "$seq" --n-layer "$n_layer" --n-head "$n_head" --n-embd "$n_embd" --vocab "$vocab" \
  --trials 3 >"$out/sgemm_rate.log" 2>&1
rc=$?
if [[ $rc -ne 0 ]]; then
  fail sgemm_rate "$rc" "$out/sgemm_rate.log"
else
  read -r fl_gflop fl_rate fl_ms < <(awk '/^floor: / { print $3, $5, $7 }' "$out/sgemm_rate.log")
  [[ -n "$fl_ms" ]] || fail "sgemm_rate (no floor line)" 0 "$out/sgemm_rate.log"
fi
echo "    $((SECONDS - start)) s" >&2
blas_core=$(sed -n 's/.*OpenBLAS \([^ ]*\) kernels.*/\1/p' "$out/sgemm_rate.log" | head -1)

echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "## GPT-2 124M (L=$n_layer H=$n_head C=$n_embd V=$vocab), B=$batch T=$seq, one CPU process: median step time after" \
  "$warmup warmup steps, of $steps; OpenBLAS ${blas_core:-?} kernels"
awk -v dt="$dt_ms" -v dt_lo="$dt_lo" -v dt_hi="$dt_hi" -v dt_p="$dt_params" -v dt_t="$dt_threads" \
  -v pt="$pt_ms" -v pt_lo="$pt_lo" -v pt_hi="$pt_hi" -v pt_p="$pt_params" -v pt_t="$pt_threads" -v pt_v="$pt_version" \
  -v pt_note="$pt_note" -v fl="$fl_ms" -v fl_gflop="$fl_gflop" -v fl_rate="$fl_rate" -v tokens="$tokens" \
  -v wait_policy="${OMP_WAIT_POLICY:-unset}" '
  function cell(v, fmt) { return v == "" ? "-" : sprintf(fmt, v) }
  function range(lo, hi) { return lo == "" ? "-" : sprintf("%.0f-%.0f", lo, hi) }
  # One contender: its step ms, the ratio dtensor / it against `target` (empty: none).
  function row(name, ms, lo, hi, threads, params, target, note,   ratio, flag) {
    ratio = "-"; flag = ""
    if (target != "" && ms != "" && dt != "" && ms + 0 > 0) {
      ratio = sprintf("%.2fx", dt / ms)
      flag = sprintf("<= %.2fx: %s", target, (dt / ms <= target) ? "ok" : "BELOW")
    } else if (target != "") {
      flag = sprintf("<= %.2fx: n/a", target)
    }
    printf "%-26s | %9s | %11s | %8s | %7s | %10s | %10s | %s%s\n", name, cell(ms, "%.1f"), range(lo, hi),
           ms == "" ? "-" : sprintf("%.1f", tokens / (ms / 1000)), threads == "" ? "-" : threads,
           params == "" ? "-" : params, ratio, flag, note == "" ? "" : (flag == "" ? "" : "  ") "(" note ")"
  }
  BEGIN {
    printf "%-26s | %9s | %11s | %8s | %7s | %10s | %10s | %s\n", "contender", "step (ms)", "range (ms)", "tokens/s",
           "threads", "params", "dtensor/it", "target"
    row("dtensor gpt_train", dt, dt_lo, dt_hi, dt_t, dt_p, "", "OMP_WAIT_POLICY " wait_policy)
    row("pytorch " (pt_v == "" ? "" : pt_v " ") "(PASSIVE)", pt, pt_lo, pt_hi, pt_t, pt_p, 0.5, pt_note)
    row("sgemm floor", fl, "", "", "", "", 1.15,
        fl == "" ? "" : sprintf("%.1f GFLOP at %.1f GFLOP/s", fl_gflop, fl_rate))
    if (dt_p != "" && pt_p != "" && dt_p != pt_p) printf "# parameters differ: dtensor %s, pytorch %s\n", dt_p, pt_p
  }'

if [[ $failed -ne 0 ]]; then
  echo "cpu_step_compare.sh: a run failed (see above)" >&2
  exit 1
fi
exit 0
