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
#   DT_STAGES="fsdp trainer2" bash /tmp/gpu/run.sh "$PWD"    # only those stages (names below)
#
# run.sh finds cuBLAS and NCCL (libcublasLt.so.13, libnccl.so.2) under /usr/local, /opt and
# /usr/lib, links the paths the binaries were built with (golden tensors, the trainer, dtrun) to
# the checkout, and runs every test that does something on a GPU (all of gpt_test: its CPU runs
# must also hold where a GPU is visible), then the trainer on cuda:0, then NCCL across processes:
# the MultiRank tests as 2 and 4 processes, the redistribution slice of dtensor_ucx_child
# (every layout pair on 1-d and 2-d meshes, checked against the global tensor and the plan's
# predicted collectives) on 2 and 4 processes, coll_bench's nccl-tests tables (1 and 2 ranks, every
# element checked) and the trainer on 2 ranks beside the same run over UCX on the CPU; then FSDP
# over NCCL: the trainer's losses on 1 GPU against 2 and 4 processes (FSDP, HSDP) and with a
# bfloat16 policy; TP (stage tp) and checkpoints of CUDA tensors resumed under the same and
# another parallelism (stage ckpt); generation on the GPU against the CPU (stage generate); and compute-sanitizer's memcheck over a 2-process FSDP run. With fewer
# GPUs than ranks the processes share cuda:0, each naming itself a host (NCCL_HOSTID) since NCCL
# refuses two ranks of one host on one GPU; they then talk over sockets on loopback.
# Last, stage speed: benchmarks/nn/gpu_step_bench.sh (issue 31) from the bundle's bin/, GPT-2 124M
# steps at B=16 T=1024 in bf16 and fp32 (tokens/s, MFU, peak memory against the 460K tokens/s
# target), the bf16-vs-fp32 loss checks and a per-kernel table of a bf16 step through
# lib/libdtensor_kernel_profile.so (CUPTI; the bundle carries lib/libcupti.so.13 too); about 3
# minutes on an H100, its logs in LOGDIR/speed. Alone: DT_STAGES=speed bash /tmp/gpu/run.sh "$PWD"
# A short lend (15 minutes of device time, start-up included) fits the new kernels' tests and the
# speed stage, in one call of the device tool (timeout_s 560; the tarball built in the checkout,
# which carries it as an untracked file; Python unpacks it where the machine has no xz; each
# stage bounded so that a hang cannot take the call; the logs come back as $OUT/gpu_logs.tgz):
#   { mkdir -p /tmp/gpu && tar xJf gpu.tar.xz -C /tmp/gpu ||
#     python3 -c 'import sys,tarfile;tarfile.open(sys.argv[1]).extractall(sys.argv[2])' gpu.tar.xz /tmp/gpu; } &&
#   DT_STAGES=kernels DT_STEP_TIMEOUT=170 bash /tmp/gpu/run.sh "$PWD" /tmp/gpu_logs;
#   DT_STAGES=speed DT_STEP_TIMEOUT=300 bash /tmp/gpu/run.sh "$PWD" /tmp/gpu_logs
# or, unbounded: DT_STAGES="kernels speed" bash /tmp/gpu/run.sh "$PWD" (the kernels
# stage checks the tensor-core attention, cuDNN's fused attention, cuBLASLt epilogues and
# multi-tensor AdamW against the CPU; if an attention fails there, DTENSOR_CUDA_ATTENTION=flash
# runs dtensor's own flash kernels instead of cuDNN's, =simple the old float32 ones).
# Stage racecheck runs compute-sanitizer's racecheck over the flash-attention test (up to 5
# minutes): add it to a lend with time left. run.sh exports DTENSOR_REQUIRE_GPU=1, so a GPU test
# that finds no usable device (a driver older than this CUDA) fails instead of skipping.
set -euo pipefail

[[ $# -eq 2 ]] || { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
build=$(cd "$1" && pwd)
out=$(realpath -m "$2")
src=$(cd "$(dirname "$0")/.." && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"

bins=(tests/kernels_test tests/tensor_test tests/ops_test tests/collectives_test tests/core_test tests/autograd_test
      tests/nn_test tests/gpt_test examples/gpt/gpt_train examples/gpt/gpt_generate examples/gpt/gpt_export
      collectives/dtrun/dtrun benchmarks/coll_bench
      tests/dtensor_ucx_child)
for b in "${bins[@]}"; do
  [[ -x "$build/$b" ]] || { echo "gpu_bundle.sh: $build/$b is not built" >&2; exit 1; }
  strip -o "$stage/bin/$(basename "$b")" "$build/$b"
done
# The step benchmark and the kernel profiler it loads into gpt_train (CUDA's injection hook), with
# CUPTI from this toolkit: a GPU machine's driver does not bring it.
cp "$src/benchmarks/nn/gpu_step_bench.sh" "$stage/bin/"
profiler="$build/benchmarks/libdtensor_kernel_profile.so"
[[ -f "$profiler" ]] || { echo "gpu_bundle.sh: $profiler is not built (it needs the CUDA Toolkit's CUPTI)" >&2; exit 1; }
strip --strip-unneeded -o "$stage/lib/libdtensor_kernel_profile.so" "$profiler"
# Shared libraries outside glibc/libstdc++ and the CUDA libraries the GPU machine provides.
deps=$(for b in "$stage"/bin/* "$stage/lib/libdtensor_kernel_profile.so"; do [[ "$b" == *.sh ]] || ldd "$b"; done)
if grep -q 'not found' <<<"$deps"; then
  echo "gpu_bundle.sh: libraries the binaries need are not found here:" >&2
  grep 'not found' <<<"$deps" | sort -u >&2
  exit 1
fi
awk '/=>/ {print $3}' <<<"$deps" | sort -u |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|libutil|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so|libcublas|libnccl|libcuda\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
[[ -f "$stage/lib/libcupti.so.13" ]] || { echo "gpu_bundle.sh: libcupti.so.13 (the profiler's) was not found by ldd" >&2; exit 1; }
if [[ -d /usr/lib/x86_64-linux-gnu/ucx ]]; then  # UCX's transport modules, found beside libucs
  mkdir -p "$stage/lib/ucx"
  cp -L /usr/lib/x86_64-linux-gnu/ucx/*.so.0 "$stage/lib/ucx/" 2>/dev/null || true
fi

# Which commit the binaries are of (run.sh prints it beside the checkout's).
git -C "$src" describe --always --dirty >"$stage/COMMIT" 2>/dev/null || echo unknown >"$stage/COMMIT"

cat > "$stage/run.sh" <<EOF
#!/usr/bin/env bash
# Runs the bundle's GPU checks against the checkout \$1 (logs in \$2, default /tmp/gpu_logs; where
# \$OUT names a folder, as on the device tool's machine, they are also packed into
# \$OUT/gpu_logs.tgz at the end, whatever happened).
set -u
here=\$(cd "\$(dirname "\$0")" && pwd)
repo=\$(cd "\${1:?usage: run.sh CHECKOUT [LOGDIR]}" && pwd)
logs=\${2:-/tmp/gpu_logs}
mkdir -p "\$logs"
pack_logs() {
  [[ -n "\${OUT:-}" && -d "\${OUT:-}" ]] || return 0
  tar czf "\$OUT/gpu_logs.tgz" --exclude=corpus.txt --exclude='ckpt_*' -C "\$(dirname "\$logs")" "\$(basename "\$logs")" &&
    echo "logs: \$OUT/gpu_logs.tgz"
}
trap pack_logs EXIT
echo "bundle of \$(cat "\$here/COMMIT"); checkout at \$(git -C "\$repo" describe --always --dirty 2>/dev/null || echo '?')"
find_dir() { dirname "\$(find /usr/local /opt /usr/lib -name "\$1" 2>/dev/null | head -1)"; }
export LD_LIBRARY_PATH="\$here/lib:\$(find_dir 'libcublasLt.so.13*'):\$(find_dir 'libnccl.so.2*')\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
# cuDNN (optional: attention runs dtensor's own kernels without it; CudnnAttentionMatchesCpu then
# skips, saying so).
cudnn_dir=\$(find_dir 'libcudnn.so.9*')
[[ "\$cudnn_dir" == . ]] && echo "no libcudnn.so.9 found: attention runs dtensor's own kernels" ||
  export LD_LIBRARY_PATH="\$LD_LIBRARY_PATH:\$cudnn_dir"
# NVRTC, with which cuDNN compiles some of its attention kernels at run time.
nvrtc_dir=\$(find_dir 'libnvrtc.so.13*')
[[ "\$nvrtc_dir" == . ]] && echo "no libnvrtc.so.13 found: cuDNN may decline attention" ||
  export LD_LIBRARY_PATH="\$LD_LIBRARY_PATH:\$nvrtc_dir"
echo "LD_LIBRARY_PATH=\$LD_LIBRARY_PATH"
# The paths compiled into the tests: golden tensors and the trainer.
mkdir -p "$src/tests" "$build/examples/gpt" "$build/collectives/dtrun" "$build/tests"
[[ -e "$src/tests/golden" ]] || ln -s "\$repo/tests/golden" "$src/tests/golden"
for t in gpt_train gpt_generate gpt_export; do
  [[ -e "$build/examples/gpt/\$t" ]] || ln -s "\$here/bin/\$t" "$build/examples/gpt/\$t"
done
[[ -e "$build/collectives/dtrun/dtrun" ]] || ln -s "\$here/bin/dtrun" "$build/collectives/dtrun/dtrun"
[[ -e "$build/tests/dtensor_ucx_child" ]] || ln -s "\$here/bin/dtensor_ucx_child" "$build/tests/dtensor_ucx_child"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
rc=0
export DTENSOR_REQUIRE_GPU=1  # a GPU test that finds no usable device fails instead of skipping
want() { [[ -z "\${DT_STAGES:-}" || " \$DT_STAGES " == *" \$1 "* ]]; }
t() {
  local name=\$1; shift
  want "\$name" || return 0
  timeout -k 15 "\${DT_STEP_TIMEOUT:-600}" "\$@" > "\$logs/\$name.log" 2>&1; local r=\$?
  [[ \$r -eq 0 ]] || rc=1
  echo "\$name: exit \$r, \$(grep -E '^(\[rank [0-9]+\] )?\[  PASSED  \]' "\$logs/\$name.log" | head -1)"
  grep -E '^(\[rank [0-9]+\] )?\[  (SKIPPED |FAILED  )\]' "\$logs/\$name.log" | grep -v ' listed below' |
    sed 's/ ([0-9]* ms)\$//' | awk '!seen[\$0]++' | head -30
  [[ \$r -eq 0 ]] || { echo "--- \$name.log: its failures, then its end"; grep -E -A4 ': Failure\$' "\$logs/\$name.log" | head -60
    tail -n 15 "\$logs/\$name.log"; }
}
t kernels "\$here/bin/kernels_test"
t tensor "\$here/bin/tensor_test"
t ops "\$here/bin/ops_test"
t nccl "\$here/bin/collectives_test" --gtest_filter='NcclTest.*:*Blocks*:-UcxZeroCopyTest.*:DtrunTest.*'
t core_nccl "\$here/bin/core_test" --gtest_filter='*Nccl*'
t nn "\$here/bin/nn_test"
t autograd "\$here/bin/autograd_test" --gtest_filter='Grad.*'
t gpt "\$here/bin/gpt_test"
t trainer "\$here/bin/dtrun" --nproc-per-node 1 "\$here/bin/gpt_train" --text "\$repo/README.md" --device cuda \\
  --steps 30 --log-every 10 --sample-tokens 0
want trainer && tail -3 "\$logs/trainer.log"
# NCCL across processes (see the top of gpu_bundle.sh); "share" runs its command as such a rank.
gpus=\$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
share() { bash -c 'export NCCL_HOSTID=dtensor-rank-\$RANK NCCL_SOCKET_IFNAME=lo; exec "\$@"' share "\$@"; }
export -f share
procs() {  # procs N PROGRAM ARGS: N ranks under dtrun, sharing cuda:0 where GPUs are fewer
  local n=\$1; shift
  local run=(timeout -k 15 "\${DT_STEP_TIMEOUT:-600}" "\$here/bin/dtrun" --nproc-per-node "\$n")
  if [[ \$gpus -ge \$n ]]; then "\${run[@]}" "\$@"
  else CUDA_VISIBLE_DEVICES=\${CUDA_VISIBLE_DEVICES:-0} "\${run[@]}" bash -c 'share "\$@"' procs "\$@"; fi
}
t nccl_procs2 "\$here/bin/dtrun" --nproc-per-node 2 "\$here/bin/collectives_test" --gtest_filter='NcclTest.MultiRank*'
t nccl_procs4 "\$here/bin/dtrun" --nproc-per-node 4 "\$here/bin/collectives_test" --gtest_filter='NcclTest.MultiRank*'
want redistribute && for n in 2 4; do
  timeout -k 15 "\${DT_STEP_TIMEOUT:-600}" "\$here/bin/dtrun" --nproc-per-node "\$n" "\$here/bin/dtensor_ucx_child" --backend nccl \
    > "\$logs/redistribute_nccl\$n.log" 2>&1 || rc=1
  echo "redistributions over nccl, \$n ranks: \$(grep -h 'cases on' "\$logs/redistribute_nccl\$n.log" | head -1)"
  grep -h 'FAIL' "\$logs/redistribute_nccl\$n.log" | head -10
done
want coll && for n in 1 2; do
  procs "\$n" "\$here/bin/coll_bench" --backend nccl --quick > "\$logs/coll_nccl\$n.log" 2>&1 || rc=1
  echo "coll_bench nccl, \$n rank(s): \$(grep -h 'Out of bounds' "\$logs/coll_nccl\$n.log")"
done
want trainer2 && for b in ucx nccl; do
  dev=\$([[ \$b == ucx ]] && echo cpu || echo cuda)
  procs 2 "\$here/bin/gpt_train" --text "\$repo/README.md" --device "\$dev" --steps 20 --log-every 5 --sample-tokens 0 \
    > "\$logs/trainer2_\$b.log" 2>&1 || rc=1
  echo "trainer, 2 ranks, \$b:"; grep -E 'step: +[0-9]+' "\$logs/trainer2_\$b.log" | grep '^\[rank 0\]' | tail -4
done
# FSDP over NCCL: 20 steps of the trainer's losses on 1 GPU against 2 processes (FSDP) and 4
# (HSDP 2x2) sharing it (1e-4: GPU reductions run in another order), and with a bfloat16
# policy on 1 and 2 processes (1e-3 of each other, 2e-2 of float32).
fsdp_run() {  # fsdp_run TAG NPROC FLAGS...
  local tag=\$1 n=\$2; shift 2
  procs "\$n" "\$here/bin/gpt_train" --text "\$repo/README.md" --device cuda --steps 20 --log-every 5 --sample-tokens 0 \
    --n-layer 2 --n-head 2 --n-embd 64 --seq 32 --batch 8 --eps 1e-5 --metrics "\$logs/fsdp_\$tag.jsonl" "\$@" \
    > "\$logs/fsdp_\$tag.log" 2>&1 || { rc=1; echo "fsdp \$tag: FAILED"; tail -5 "\$logs/fsdp_\$tag.log"; }
}
compare() {  # compare A B RTOL
  python3 - "\$logs/fsdp_\$1.jsonl" "\$logs/fsdp_\$2.jsonl" "\$3" <<'PY' || rc=1
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
tol = float(sys.argv[3])
worst = max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=1.0)
ok = len(a) == len(b) == 20 and worst <= tol
print(f"fsdp {sys.argv[1].split('fsdp_')[1][:-6]} vs {sys.argv[2].split('fsdp_')[1][:-6]}: {len(a)} steps, worst relative "
      f"difference {worst:.2e} (<= {tol}): {'ok' if ok else 'FAIL'}; losses {a[0]:.5f} -> {a[-1]:.5f}")
sys.exit(0 if ok else 1)
PY
}
if want fsdp; then
  fsdp_run one 1
  fsdp_run two 2
  fsdp_run two_noreshard 2 --reshard-after-forward false
  fsdp_run hsdp 4 --dp-replicate 2
  fsdp_run two_accum 2 --grad-accum 2
  fsdp_run bf16_one 1 --param-dtype bf16
  fsdp_run bf16_two 2 --param-dtype bf16
  compare two one 1e-4; compare two_noreshard one 1e-4; compare hsdp one 1e-4; compare two_accum one 1e-4
  compare bf16_two bf16_one 1e-3; compare bf16_two one 2e-2
  grep -h 'gpt_train:' "\$logs"/fsdp_two.log | head -1
fi
# Tensor parallelism over NCCL (processes sharing the GPU): TP 2 with and without sequence
# parallel, from the plan file, FSDP x TP on 4, against 1 GPU (1e-4).
if want tp; then
  [[ -f "\$logs/fsdp_one.jsonl" ]] || fsdp_run one 1
  fsdp_run tp2 2 --tp 2
  fsdp_run tp2_nosp 2 --tp 2 --sequence-parallel false
  fsdp_run tp2_plan 2 --plan "\$repo/examples/gpt/plans/gpt_tp.json"
  fsdp_run fsdp_tp 4 --tp 2
  compare tp2 one 1e-4; compare tp2_nosp one 1e-4; compare tp2_plan one 1e-4; compare fsdp_tp one 1e-4
  grep -h 'gpt_train:' "\$logs"/fsdp_fsdp_tp.log | head -1
fi
# Generation on the GPU (KV cache, greedy and seeded top-k) prints the ids the CPU prints, on
# the golden Hugging Face model.
if want generate; then
  hf="\$repo/tests/golden/hf_gpt2_tiny/model.safetensors"
  for d in cpu cuda; do
    "\$here/bin/gpt_generate" --hf "\$hf" --prompt-ids "3 14 15 92 65" --max-new-tokens 40 --temperature 0 \
      --device \$d > "\$logs/generate_greedy_\$d.log" 2>&1
    "\$here/bin/gpt_generate" --hf "\$hf" --prompt-ids "3 14 15 92 65" --max-new-tokens 40 --top-k 5 --seed 3 \
      --device \$d > "\$logs/generate_topk_\$d.log" 2>&1
  done
  for m in greedy topk; do
    if diff <(grep '^ids:' "\$logs/generate_\${m}_cpu.log") <(grep '^ids:' "\$logs/generate_\${m}_cuda.log") >/dev/null; then
      echo "generate \$m: cuda ids == cpu ids (\$(grep -o '[0-9.]* tokens/s' "\$logs/generate_\${m}_cuda.log"))"
    else
      echo "generate \$m: DIFFER"; tail -n 3 "\$logs/generate_\${m}_cpu.log" "\$logs/generate_\${m}_cuda.log"; rc=1
    fi
  done
fi
# Checkpoints of CUDA tensors: 2 processes stopped at step 10 and resumed (sync and async
# saves) against the uninterrupted run, and a TP 2 checkpoint resumed on 1 GPU (1e-4).
if want ckpt; then
  [[ -f "\$logs/fsdp_one.jsonl" ]] || fsdp_run one 1
  [[ -f "\$logs/fsdp_two.jsonl" ]] || fsdp_run two 2
  rm -rf "\$logs"/ckpt_*
  fsdp_run ckpt_a 2 --steps 10 --ckpt-every 10 --ckpt-dir "\$logs/ckpt_sync"
  fsdp_run ckpt_b 2 --resume --ckpt-dir "\$logs/ckpt_sync"
  fsdp_run ckpt_c 2 --steps 10 --ckpt-every 5 --ckpt-async true --ckpt-dir "\$logs/ckpt_async"
  fsdp_run ckpt_d 2 --resume --ckpt-dir "\$logs/ckpt_async"
  fsdp_run ckpt_e 2 --tp 2 --steps 10 --ckpt-every 10 --ckpt-dir "\$logs/ckpt_tp"
  fsdp_run ckpt_f 1 --resume --ckpt-dir "\$logs/ckpt_tp"
  python3 - "\$logs" <<'PY' || rc=1
import json, sys
logs = sys.argv[1]
def losses(tag):
    return {j["step"]: j["loss"] for j in map(json.loads, open(f"{logs}/fsdp_{tag}.jsonl"))}
ok = True
for resumed, ref, tol in (("ckpt_b", "two", 1e-6), ("ckpt_d", "two", 1e-6), ("ckpt_f", "one", 1e-4)):
    got, want = losses(resumed), losses(ref)
    worst = max((abs(got[s] - want[s]) / abs(want[s]) for s in got), default=1.0)
    good = sorted(got) == list(range(10, 20)) and worst <= tol
    ok &= good
    print(f"checkpoint resume {resumed} vs {ref}: steps {min(got, default=-1)}-{max(got, default=-1)}, worst relative "
          f"difference {worst:.2e} (<= {tol}): {'ok' if good else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
fi
if want sanitizer; then
  if command -v compute-sanitizer > /dev/null; then
    # (--report-api-errors no: NCCL's init probes kernels of other architectures and handles
    # the errors itself; memcheck's memory errors are what this looks for.)
    procs 2 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 7 "\$here/bin/gpt_train" \
      --text "\$repo/README.md" --device cuda --steps 3 --sample-tokens 4 --n-layer 2 --n-head 2 --n-embd 64 --seq 32 --batch 8 --param-dtype bf16 \
      > "\$logs/sanitizer.log" 2>&1; s=\$?
    [[ \$s -eq 0 ]] || rc=1
    echo "compute-sanitizer memcheck, FSDP bf16 on 2 processes: exit \$s, \$(grep -h 'ERROR SUMMARY' "\$logs/sanitizer.log" | sort | uniq -c | tr '\n' ' ')"
    procs 2 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 7 "\$here/bin/gpt_train" \\
      --text "\$repo/README.md" --device cuda --steps 3 --sample-tokens 4 --n-layer 2 --n-head 2 --n-embd 64 --seq 32 \\
      --batch 8 --tp 2 > "\$logs/sanitizer_tp.log" 2>&1; s=\$?
    [[ \$s -eq 0 ]] || rc=1
    echo "compute-sanitizer memcheck, TP 2 on 2 processes: exit \$s, \$(grep -h 'ERROR SUMMARY' "\$logs/sanitizer_tp.log" | sort | uniq -c | tr '\n' ' ')"
  else
    echo "compute-sanitizer: not installed"
  fi
fi
# The tensor-core attention's shared-memory barriers, which no CPU run can check (racecheck is
# slow: the flash-attention test alone, under its own limit).
if want racecheck && command -v compute-sanitizer > /dev/null; then
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 7 "\$here/bin/kernels_test" \
    --gtest_filter='CudaKernelsTest.FlashAttention*' > "\$logs/racecheck.log" 2>&1; s=\$?
  [[ \$s -eq 0 ]] || rc=1
  echo "compute-sanitizer racecheck, flash attention: exit \$s, \$(grep -h 'RACECHECK SUMMARY\|ERROR SUMMARY' "\$logs/racecheck.log" | head -2 | tr '\n' ' ')"
fi
# Last (nothing else on the GPU while it measures): the step benchmark, its table printed whole.
if want speed; then
  # No limit around the script (a hung run's processes would outlive it on the GPU): its runs
  # are cut to DT_BENCH_DEADLINE seconds from its start (DT_STEP_TIMEOUT by default).
  deadline=\${DT_BENCH_DEADLINE:-\${DT_STEP_TIMEOUT:-600}}
  [[ \$deadline =~ ^[0-9]+\$ ]] || deadline=600  # timeout's forms (10m, 1.5h) are not seconds
  DT_BENCH_DEADLINE=\$deadline bash "\$here/bin/gpu_step_bench.sh" "\$here/bin" \\
    --repo "\$repo" --out "\$logs/speed" > "\$logs/speed.log" 2> "\$logs/speed_progress.log"; s=\$?
  [[ \$s -eq 0 ]] || rc=1
  echo "speed: exit \$s (0: runs and checks passed; 1: one failed or was cut at the deadline; 2: bad arguments; 4: no GPU)"
  cat "\$logs/speed.log"
  [[ \$s -eq 0 ]] || tail -n 20 "\$logs/speed_progress.log"
fi
exit \$rc
EOF
chmod +x "$stage/run.sh"
tar -C "$stage" -cJf "$out" bin lib run.sh COMMIT
echo "gpu_bundle.sh: $out ($(du -h "$out" | cut -f1))"
