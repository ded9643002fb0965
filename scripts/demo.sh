#!/usr/bin/env bash
# Installs what is needed, builds the examples and runs the main demo on CPU.
# This is the README's first command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

build_dir="${BUILD_DIR:-build}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j "$(nproc)" --target char_mlp
"$build_dir/examples/char_mlp" --steps "${STEPS:-3000}"
