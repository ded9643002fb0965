#!/usr/bin/env bash
# compare.sh end to end on its quickest settings: 2 ranks, all_reduce and broadcast at 4 KiB and
# 128 KiB, one short trial per size, two rounds. Checks that each program's per-round tables
# hold exactly the collectives asked for, that the merged tables have every row with a verdict
# (and Open MPI's columns where mpirun is installed), and that a bad flag is refused.
#   compare_test.sh COMPARE_SH BUILD_DIR
set -u
script=$1
build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log=$(bash "$script" "$build" --ranks 2 --rounds 2 --out "$tmp/t" -- --ops all_reduce,broadcast \
  --max-bytes 131072 --step 32 --trials 1 --trial-ms 2 --warmup 1 2>"$tmp/err")
rc=$?
fail() {
  echo "compare_test: $*"
  printf -- '--- stdout\n%s\n--- stderr\n' "$log"
  cat "$tmp/err"
  exit 1
}
[[ $rc -eq 0 ]] || fail "compare.sh exited $rc"
have_mpi=0
command -v mpirun >/dev/null && [[ -x "$build/benchmarks/mpi_coll_bench" ]] && have_mpi=1
programs="threads ucx"
[[ $have_mpi -eq 1 ]] && programs="threads ucx ompi"
for p in $programs; do
  for k in 1 2; do
    f="$tmp/t/$p.2.$k.txt"
    got=$(grep '^# collective ' "$f" 2>/dev/null | awk '{print $3}' | tr '\n' ' ')
    [[ "$got" == "all_reduce broadcast " ]] || fail "$f holds collectives '$got', want 'all_reduce broadcast '"
  done
done
for op in all_reduce broadcast; do
  grep -q "^## $op, 2 ranks: .* medians of 2 rounds" <<<"$log" || fail "no merged $op table"
done
grep -q '^## all_gather' <<<"$log" && fail "all_gather ran although --ops left it out"
rows=$(grep -cE '^ +(4096|131072) \|.*: (ok|BELOW|n/a)' <<<"$log")
[[ $rows -eq 4 ]] || fail "$rows rows with a verdict, want 4"
if [[ $have_mpi -eq 1 ]]; then
  # size | threads | ucx | ompi | ucx/ompi: numbers in the ompi and ratio columns
  bad=$(grep -E '^ +(4096|131072) \|' <<<"$log" | awk -F'|' '$4 + 0 <= 0 || $5 !~ /[0-9]x/' | wc -l)
  [[ $bad -eq 0 ]] || fail "$bad rows without Open MPI's busbw and the ratio"
fi
bash "$script" "$build" --rounds x >/dev/null 2>&1
rc=$?
[[ $rc -eq 2 ]] || fail "--rounds x: exit $rc, want 2"
echo "compare_test: ok ($programs)"
