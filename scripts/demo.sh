#!/usr/bin/env bash
# Installs what is needed, builds the GPT trainer and runs it on 2 CPU ranks (the main demo).
# This is the README's first command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

build_dir="${BUILD_DIR:-build}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j "$(nproc)" --target gpt_train
# Idle OpenMP threads sleep instead of spinning: on a shared or small machine spinning threads
# steal the cores the other rank needs (libgomp reads this when the program starts).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
# A small GPT-2 (4 layers, 4 heads, C=128, byte vocabulary) on the fortunes corpus, FSDP over 2
# CPU ranks (threads of one process): prints falling loss, then a sample.
"$build_dir/examples/gpt/gpt_train" --fortunes "$build_dir/fortunes.txt" --ranks 2 \
  --steps "${STEPS:-2500}" --batch 8 --seq 64 --lr 2e-3 --lr-schedule cosine --warmup 50 --min-lr 2e-4 \
  --log-every 100 --sample-tokens 300 --metrics "$build_dir/gpt_train_metrics.jsonl"
