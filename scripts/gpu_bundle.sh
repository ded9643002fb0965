#!/usr/bin/env bash
# gpu_bundle.sh: packs the GPU-relevant test binaries and the trainer of a build folder, with the
# shared libraries they need that a bare GPU machine may lack (Abseil, UCX, OpenBLAS, ...; not
# cuBLAS, NCCL or the driver, which that machine must have), into one tarball, plus a script
# that runs them there. For checking the CUDA and NCCL paths on a GPU machine that has no
# Debian build dependencies (binaries built on Debian 12 run on newer glibc).
#
#   bash scripts/gpu_bundle.sh BUILD_DIR OUT.tar.xz
#   # on the GPU machine, in a checkout of the same commit (the tests read tests/golden):
#   mkdir -p /tmp/gpu && tar xJf OUT.tar.xz -C /tmp/gpu && bash /tmp/gpu/run.sh "$PWD" [LOGDIR]
#
# run.sh finds cuBLAS and NCCL (libcublasLt.so.13, libnccl.so.2) under /usr/local, /opt and
# /usr/lib, links the paths the binaries were built with (golden tensors, the trainer, dtrun) to
# the checkout, and runs every test that does something on a GPU (all of gpt_test: its CPU runs
# must also hold where a GPU is visible), then the trainer on cuda:0.
set -euo pipefail

[[ $# -eq 2 ]] || { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
build=$(cd "$1" && pwd)
out=$(realpath -m "$2")
src=$(cd "$(dirname "$0")/.." && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"

bins=(tests/kernels_test tests/tensor_test tests/ops_test tests/collectives_test tests/autograd_test
      tests/nn_test tests/gpt_test examples/gpt/gpt_train collectives/dtrun/dtrun)
for b in "${bins[@]}"; do
  [[ -x "$build/$b" ]] || { echo "gpu_bundle.sh: $build/$b is not built" >&2; exit 1; }
  strip -o "$stage/bin/$(basename "$b")" "$build/$b"
done
# Shared libraries outside glibc/libstdc++ and the CUDA libraries the GPU machine provides.
for b in "$stage"/bin/*; do ldd "$b"; done | awk '/=>/ {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so|libcublas|libnccl|libcuda\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
if [[ -d /usr/lib/x86_64-linux-gnu/ucx ]]; then  # UCX's transport modules, found beside libucs
  mkdir -p "$stage/lib/ucx"
  cp -L /usr/lib/x86_64-linux-gnu/ucx/*.so.0 "$stage/lib/ucx/" 2>/dev/null || true
fi

cat > "$stage/run.sh" <<EOF
#!/usr/bin/env bash
# Runs the bundle's GPU checks against the checkout \$1 (logs in \$2, default /tmp/gpu_logs).
set -u
here=\$(cd "\$(dirname "\$0")" && pwd)
repo=\$(cd "\${1:?usage: run.sh CHECKOUT [LOGDIR]}" && pwd)
logs=\${2:-/tmp/gpu_logs}
mkdir -p "\$logs"
find_dir() { dirname "\$(find /usr/local /opt /usr/lib -name "\$1" 2>/dev/null | head -1)"; }
export LD_LIBRARY_PATH="\$here/lib:\$(find_dir 'libcublasLt.so.13*'):\$(find_dir 'libnccl.so.2*')\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
# The paths compiled into the tests: golden tensors and the trainer.
mkdir -p "$src/tests" "$build/examples/gpt" "$build/collectives/dtrun"
[[ -e "$src/tests/golden" ]] || ln -s "\$repo/tests/golden" "$src/tests/golden"
[[ -e "$build/examples/gpt/gpt_train" ]] || ln -s "\$here/bin/gpt_train" "$build/examples/gpt/gpt_train"
[[ -e "$build/collectives/dtrun/dtrun" ]] || ln -s "\$here/bin/dtrun" "$build/collectives/dtrun/dtrun"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
rc=0
t() {
  local name=\$1; shift
  timeout 600 "\$@" > "\$logs/\$name.log" 2>&1; local r=\$?
  [[ \$r -eq 0 ]] || rc=1
  echo "\$name: exit \$r, \$(grep -E '^\[  PASSED  \]' "\$logs/\$name.log" | head -1)"
  grep -E '^\[  FAILED  \]' "\$logs/\$name.log" | head -20
}
t kernels "\$here/bin/kernels_test"
t tensor "\$here/bin/tensor_test"
t ops "\$here/bin/ops_test"
t nccl "\$here/bin/collectives_test" --gtest_filter='NcclTest.*:*Blocks*:-UcxZeroCopyTest.*'
t nn "\$here/bin/nn_test"
t autograd "\$here/bin/autograd_test" --gtest_filter='Grad.*'
t gpt "\$here/bin/gpt_test"
t trainer "\$here/bin/dtrun" --nproc-per-node 1 "\$here/bin/gpt_train" --text "\$repo/README.md" --device cuda \\
  --steps 30 --log-every 10 --sample-tokens 0
tail -3 "\$logs/trainer.log"
exit \$rc
EOF
chmod +x "$stage/run.sh"
tar -C "$stage" -cJf "$out" bin lib run.sh
echo "gpu_bundle.sh: $out ($(du -h "$out" | cut -f1))"
