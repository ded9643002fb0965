#!/usr/bin/env bash
# Installs every Debian package dtensor needs to build, test and run its demos.
# Idempotent: packages already present are skipped; safe to run again.
# CUDA is not a Debian package here: the CUDA Toolkit (with cuBLAS and NCCL) is used when
# found under /usr/local/cuda, and the library builds CPU-only otherwise.
set -euo pipefail

packages=(
  build-essential g++ clang cmake ninja-build ccache pkg-config git
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-openmp-dev libomp-dev
  libucx-dev ucx-utils nlohmann-json3-dev zlib1g-dev
  openmpi-bin libopenmpi-dev
  clang-format iproute2
  fortunes fortunes-min gnuplot-nox
)

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
