#!/usr/bin/env bash
# parallel_throughput.sh: gpt_train's tokens/s under each parallelism — one rank, DDP, FSDP,
# TP (with sequence parallel), FSDP x TP — as thread ranks of one process and as UCX processes
# under dtrun, as one table (median over the steps after the first three; the same model and
# global batch everywhere).
#
#   bash benchmarks/nn/parallel_throughput.sh [BUILD_DIR] [-- TRAINER FLAGS...]
set -euo pipefail
build=${1:-build}
shift $(( $# > 0 ? 1 : 0 ))
[[ "${1:-}" == "--" ]] && shift
extra=("$@")
trainer="$build/examples/gpt/gpt_train"
dtrun="$build/collectives/dtrun/dtrun"
[[ -x "$trainer" && -x "$dtrun" ]] || { echo "parallel_throughput.sh: build $trainer and $dtrun first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
head -c 200000 "$(dirname "$0")/../../README.md" > "$work/corpus.txt"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
flags=(--text "$work/corpus.txt" --n-layer 4 --n-head 4 --n-embd 256 --seq 64 --batch 8 --steps 12 --sample-tokens 0
       --device cpu "${extra[@]}")

row() {  # row NAME RANKS FLAGS...
  local name=$1 n=$2; shift 2
  local cells=()
  for how in threads ucx; do
    if [[ $how == threads ]]; then
      "$trainer" "${flags[@]}" --ranks "$n" --metrics "$work/m.jsonl" "$@" > "$work/log" 2>&1 || { cat "$work/log" >&2; exit 1; }
    else
      "$dtrun" --nproc-per-node "$n" "$trainer" "${flags[@]}" --metrics "$work/m.jsonl" "$@" > "$work/log" 2>&1 ||
        { cat "$work/log" >&2; exit 1; }
    fi
    cells+=("$(python3 -c '
import json, statistics, sys
steps = [json.loads(l) for l in open(sys.argv[1])][3:]
print(round(statistics.median(s["tokens_per_s"] for s in steps)))' "$work/m.jsonl")")
  done
  printf "| %-22s | %5s | %14s | %14s |\n" "$name" "$n" "${cells[0]}" "${cells[1]}"
}

echo "| configuration          | ranks | threads tok/s  | ucx tok/s      |"
echo "|------------------------|-------|----------------|----------------|"
row "single rank" 1
row "DDP" 2 --dp-shard 1 --dp-replicate 2
row "FSDP" 2
row "TP + SP" 2 --tp 2
row "TP" 2 --tp 2 --sequence-parallel false
row "FSDP x TP (2x2)" 4 --tp 2
