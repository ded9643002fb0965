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
# A small GPT-2 (4 layers, 4 heads, C=128) with GPT-2's tokenizer on the fortunes corpus, FSDP
# over 2 CPU ranks (threads of one process): TorchTitan-style lines with validation loss on a
# held-out tail, metrics as JSONL, a loss plot, then a sample of decoded text.
metrics="$build_dir/gpt_train_metrics.jsonl"
"$build_dir/examples/gpt/gpt_train" --fortunes "$build_dir/fortunes.txt" --tokenizer gpt2 --ranks 2 \
  --steps "${STEPS:-400}" --batch 8 --seq 64 --lr 6e-3 --beta2 0.95 --lr-schedule cosine --warmup 10 --min-lr 6e-4 \
  --val-every 50 --log-every 50 --sample-tokens 80 --metrics "$metrics"
bash scripts/plot_metrics.sh "$metrics" -o "$build_dir/loss.png" --title "gpt_train: fortunes, GPT-2 tokens, FSDP x 2"
