#!/usr/bin/env bash
# Draws the training and validation loss of one or several gpt_train runs (their --metrics
# JSONL files) into one PNG with gnuplot (Debian's gnuplot-nox; scripts/setup.sh installs it).
#
#   scripts/plot_metrics.sh run_a.jsonl [run_b.jsonl ...] -o loss.png [--title TEXT]
#
# Each file gives a line of training loss per step ("loss") and, where the run validated,
# points of validation loss ("val_loss"), named after the file.
set -euo pipefail

out="" title="gpt_train loss" files=()
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="${2:?-o needs a file}"; shift 2 ;;
    --title) title="${2:?--title needs text}"; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) echo "plot_metrics: unknown option $1" >&2; exit 2 ;;
    *) files+=("$1"); shift ;;
  esac
done
[ -n "$out" ] || { echo "plot_metrics: give -o OUT.png" >&2; exit 2; }
[ "${#files[@]}" -gt 0 ] || { echo "plot_metrics: give at least one metrics file" >&2; exit 2; }
command -v gnuplot >/dev/null || { echo "plot_metrics: gnuplot is missing (apt-get install gnuplot-nox)" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# One JSON object per line (nlohmann's compact dump): pull "step" with "loss" or "val_loss".
# extract KEY FILE: "step value" per line holding KEY.
extract() {
  awk -v key="\"$1\":" '{
    s = index($0, "\"step\":"); k = index($0, key)
    if (s == 0 || k == 0) next
    step = substr($0, s + 7); sub(/[^-0-9.eE+].*/, "", step)
    val = substr($0, k + length(key)); sub(/[^-0-9.eE+].*/, "", val)
    print step, val
  }' "$2"
}
plots=()
i=0
for f in "${files[@]}"; do
  [ -r "$f" ] || { echo "plot_metrics: cannot read $f" >&2; exit 1; }
  name="$(basename "$f" .jsonl)"
  extract loss "$f" >"$tmp/train$i.dat"
  [ -s "$tmp/train$i.dat" ] || { echo "plot_metrics: $f has no \"loss\" lines" >&2; exit 1; }
  extract val_loss "$f" >"$tmp/val$i.dat"
  plots+=("'$tmp/train$i.dat' using 1:2 with lines linewidth 2 title '$name train'")
  if [ -s "$tmp/val$i.dat" ]; then
    plots+=("'$tmp/val$i.dat' using 1:2 with linespoints pointtype 7 title '$name val'")
  fi
  i=$((i + 1))
done

joined="$(IFS=,; echo "${plots[*]}")"
gnuplot <<GP
set terminal pngcairo size 1000,600 noenhanced
set output '$out.tmp'
set title '$title'
set xlabel 'step'
set ylabel 'loss (cross-entropy, nats)'
set grid
set key top right
plot $joined
GP
mv "$out.tmp" "$out"
echo "plot_metrics: wrote $out"
