#!/usr/bin/env bash
# compare.sh: dtensor's collectives (threads and ucx backends) beside Open MPI, measured in one
# run with the same program logic (coll_bench / mpi_coll_bench share coll_bench_common.h).
#
#   benchmarks/collectives/compare.sh BUILD_DIR [--quick] [--ranks "2 4"] [--out DIR] [--strict]
#                                     [-- FLAGS for both benchmarks, e.g. --ops all_reduce]
#
# For each rank count N it runs
#   threads  BUILD/benchmarks/coll_bench --backend threads --ranks N
#   ucx      BUILD/collectives/dtrun/dtrun --nproc-per-node N BUILD/benchmarks/coll_bench --backend ucx
#   ompi     mpirun --allow-run-as-root --oversubscribe -np N --mca pml ucx --mca pml_ucx_tls any
#                   --mca pml_ucx_devices any BUILD/benchmarks/mpi_coll_bench
# keeps their nccl-tests tables under --out (default: a fresh temporary folder), and prints one
# merged table per (collective, N): busbw of each (GB/s), ucx/ompi, the per-call times of
# ucx and ompi, and the target with an ok / BELOW flag:
#   ucx busbw >= ompi busbw at every size; >= 2x ompi for all_reduce and reduce_scatter at
#   >= 4 MiB; the 4 KiB all_reduce under 1.5 us.
# Exit status: 1 if a run failed or reported wrong elements (or, with --strict, if a row is
# BELOW target); else 0.
set -u -o pipefail

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

[[ $# -ge 1 ]] || usage
build=$(cd "$1" 2>/dev/null && pwd) || { echo "compare.sh: no build folder '$1'" >&2; exit 2; }
shift
quick=()
ranks="2 4"
out=""
strict=0
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) quick=(--quick) ;;
    --ranks) ranks="$2"; shift ;;
    --out) out="$2"; shift ;;
    --strict) strict=1 ;;
    --) shift; extra=("$@"); break ;;
    *) usage ;;
  esac
  shift
done

bench="$build/benchmarks/coll_bench"
mpi_bench="$build/benchmarks/mpi_coll_bench"
dtrun="$build/collectives/dtrun/dtrun"
for f in "$bench" "$dtrun"; do
  [[ -x "$f" ]] || { echo "compare.sh: $f is not built (cmake --build $build --target coll_bench dtrun)" >&2; exit 2; }
done
have_mpi=1
if [[ ! -x "$mpi_bench" ]]; then
  echo "compare.sh: $mpi_bench is not built (no MPI found at configure time?): ompi columns stay empty" >&2
  have_mpi=0
elif ! command -v mpirun >/dev/null; then
  echo "compare.sh: mpirun not found: ompi columns stay empty" >&2
  have_mpi=0
fi
if [[ -z "$out" ]]; then
  out=$(mktemp -d /tmp/coll_compare.XXXXXX)
fi
mkdir -p "$out"

failed=0
# run NAME N COMMAND...: the table (dtrun's "[rank 0] " prefix removed) goes to $out/NAME.N.txt.
run() {
  local name=$1 n=$2
  shift 2
  local file="$out/$name.$n.txt"
  local start=$SECONDS
  "$@" >"$file.raw" 2>"$out/$name.$n.err"
  local rc=$?
  sed -n 's/^\[rank 0\] //; /^[ #]/p' "$file.raw" >"$file"
  rm -f "$file.raw"
  echo "  $name, $n ranks: exit $rc, $((SECONDS - start)) s" >&2
  if [[ $rc -ne 0 ]]; then
    failed=1
    echo "  $name, $n ranks FAILED; its stderr ($out/$name.$n.err) ends:" >&2
    tail -5 "$out/$name.$n.err" | sed 's/^/    /' >&2
  fi
}

echo "compare.sh: tables under $out" >&2
echo "# compare.sh $(date -u '+%F %T UTC'), $(nproc) cores, load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for n in $ranks; do
  run threads "$n" "$bench" --backend threads --ranks "$n" "${quick[@]}" "${extra[@]}"
  run ucx "$n" "$dtrun" --nproc-per-node "$n" "$bench" --backend ucx "${quick[@]}" "${extra[@]}"
  if [[ $have_mpi -eq 1 ]]; then
    run ompi "$n" mpirun --allow-run-as-root --oversubscribe -np "$n" --mca pml ucx --mca pml_ucx_tls any \
      --mca pml_ucx_devices any "$mpi_bench" "${quick[@]}" "${extra[@]}"
  fi
done

echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
below=0
for n in $ranks; do
  files=()
  for name in threads ucx ompi; do
    [[ -f "$out/$name.$n.txt" ]] && files+=("$out/$name.$n.txt") || files+=(/dev/null)
  done
  awk -v n="$n" -v f_threads="${files[0]}" -v f_ucx="${files[1]}" -v f_ompi="${files[2]}" '
    function load(file, tag,   line, f, op) {
      op = ""
      while ((getline line < file) > 0) {
        if (line ~ /^# collective /) { split(line, f, " "); op = f[3]; if (!(op in seen)) { seen[op] = 1; ops[++nops] = op } continue }
        if (line !~ /^ *[0-9]+ +[0-9]+ +float/ || op == "") continue
        split(line, f, " ")  # size count type redop root time algbw busbw #wrong
        key = op SUBSEP f[1]
        if (!(key in has_size)) { has_size[key] = 1; sizes[op, ++nsizes[op]] = f[1] }
        bus[tag, key] = f[8]; us[tag, key] = f[6]; wrong[tag, key] = f[9]
      }
      close(file)
    }
    function cell(tag, key, arr) { return ((tag, key) in arr) ? arr[tag, key] : "-" }
    BEGIN {
      load(f_threads, "threads"); load(f_ucx, "ucx"); load(f_ompi, "ompi")
      for (i = 1; i <= nops; ++i) {
        op = ops[i]
        printf "\n## %s, %d ranks: busbw in GB/s (nccl-tests), time per call in us\n", op, n
        printf "%10s | %9s | %9s | %9s | %8s | %9s | %9s | %s\n", "size (B)", "threads", "ucx", "ompi", "ucx/ompi",
               "ucx us", "ompi us", "target"
        for (j = 1; j <= nsizes[op]; ++j) {
          size = sizes[op, j]; key = op SUBSEP size
          need = ((op == "all_reduce" || op == "reduce_scatter") && size >= 4194304) ? 2 : 1
          target = need == 2 ? "ucx >= 2x ompi" : "ucx >= ompi"
          ratio = "-"; flag = "n/a"
          if (("ucx", key) in bus && ("ompi", key) in bus) {
            u = bus["ucx", key] + 0; o = bus["ompi", key] + 0
            ratio = o > 0 ? sprintf("%.2fx", u / o) : "inf"
            flag = (u >= need * o) ? "ok" : "BELOW"
          }
          if (op == "all_reduce" && size == 4096) {
            target = target ", < 1.5 us"
            if (("ucx", key) in us) {
              t_ok = (us["ucx", key] + 0 < 1.5)
              if (flag == "n/a") flag = t_ok ? "ok" : "BELOW"; else if (!t_ok) flag = "BELOW"
            }
          }
          bad = ""
          for (t = 1; t <= 3; ++t) {
            tag = t == 1 ? "threads" : t == 2 ? "ucx" : "ompi"
            if ((tag, key) in wrong && wrong[tag, key] != "0") bad = bad " " tag "-WRONG"
          }
          if (flag == "BELOW") ++below
          printf "%10s | %9s | %9s | %9s | %8s | %9s | %9s | %s: %s%s\n", size, cell("threads", key, bus),
                 cell("ucx", key, bus), cell("ompi", key, bus), ratio, cell("ucx", key, us), cell("ompi", key, us),
                 target, flag, bad
        }
      }
      exit below > 0 ? 3 : 0
    }'
  [[ $? -eq 3 ]] && below=1
done

if [[ $failed -ne 0 ]]; then
  echo "compare.sh: a run failed or reported wrong elements (see above)" >&2
  exit 1
fi
if [[ $below -ne 0 ]]; then
  echo >&2
  echo "compare.sh: some rows are BELOW target" >&2
  [[ $strict -eq 1 ]] && exit 1
fi
exit 0
