#!/usr/bin/env bash
# fsdp_memory.sh: per-rank memory of gpt_train under each parallelism — one rank, DDP, FSDP
# with and without resharding after forward, HSDP, TP, FSDP x TP — as a table, from the trainer's
# --metrics (rank 0's; every configuration runs as UCX processes under dtrun, so the
# allocator's counters are that rank's own).
#
#   bash benchmarks/nn/fsdp_memory.sh [BUILD_DIR] [-- TRAINER FLAGS...]
#
# Columns (MiB, after the last step's optimizer update, before its gradients are dropped):
# parameters, gradients and AdamW state this rank holds (sums of its local tensors), their sum
# against the single rank's divided by the FSDP degree, and the allocator's bytes in use then and its peak
# during the step (activations, gathered parameters and buffers included). The default model
# has 8 blocks of C = 256 (6.3M parameters in blocks, 0.08M in embeddings), so blocks dominate.
set -euo pipefail
build=${1:-build}
shift $(( $# > 0 ? 1 : 0 ))
[[ "${1:-}" == "--" ]] && shift
extra=("$@")
trainer="$build/examples/gpt/gpt_train"
dtrun="$build/collectives/dtrun/dtrun"
[[ -x "$trainer" && -x "$dtrun" ]] || { echo "fsdp_memory.sh: build $trainer and $dtrun first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
head -c 200000 "$(dirname "$0")/../../README.md" > "$work/corpus.txt"
flags=(--text "$work/corpus.txt" --n-layer 8 --n-head 4 --n-embd 256 --seq 64 --batch 8 --steps 3 --sample-tokens 0
       --device cpu "${extra[@]}")

row() {  # row NAME NPROC SHARDS FLAGS...
  local name=$1 n=$2 shards=$3; shift 3
  "$dtrun" --nproc-per-node "$n" "$trainer" "${flags[@]}" --metrics "$work/m.jsonl" "$@" > "$work/log" 2>&1 ||
    { cat "$work/log" >&2; exit 1; }
  python3 - "$name" "$n" "$shards" "$work/m.jsonl" "$work/single" <<'PY'
import json, os, sys
name, n, shards, path, single_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
m = json.loads(open(path).read().strip().splitlines()[-1])
mib = lambda b: b / 2**20
state = m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]
if n == 1 and name == "single rank":
    open(single_path, "w").write(str(state))
single = int(open(single_path).read())
print(f"| {name:<22} | {n:>5} | {mib(m['param_bytes']):>7.2f} | {mib(m['grad_bytes']):>7.2f} | {mib(m['optim_bytes']):>7.2f} "
      f"| {mib(state):>7.2f} | {mib(single / shards):>15.2f} | {mib(m['bytes_in_use']):>7.2f} | {mib(m['peak_bytes']):>7.2f} |")
PY
}

echo "| configuration          | ranks |  params |   grads |   AdamW | p+g+opt | single / shards |  in use |    peak |"
echo "|------------------------|-------|---------|---------|---------|---------|-----------------|---------|---------|"
row "single rank" 1 1
for n in 2 4; do
  row "DDP" "$n" 1 --dp-shard 1 --dp-replicate "$n"
  row "FSDP, reshard" "$n" "$n"
  row "FSDP, no reshard" "$n" "$n" --reshard-after-forward false
done
row "HSDP 2x2" 4 2 --dp-replicate 2
row "TP 2 (+SP)" 2 2 --tp 2
row "FSDP x TP 2x2" 4 4 --tp 2
