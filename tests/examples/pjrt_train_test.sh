#!/usr/bin/env bash
# train_gpt --backend pjrt trains nano with 2 ranks on the XLA CPU plugin: the loss falls, and
# the losses and the validation loss are those of the CPU backend with the same flags (to the
# 4 digits printed; the programs sum in XLA's order, the CPU kernels in theirs).
# Usage: pjrt_train_test.sh TRAIN_GPT PLUGIN. Exit 77 (skipped) when the plugin is absent.
set -u
bin=$1 plugin=$2
if [ ! -f "$plugin" ]; then
  echo "skipped: no PJRT plugin at $plugin (scripts/fetch_pjrt_plugin.sh <build>/pjrt fetches it)"
  exit 77
fi
export TF_CPP_MIN_LOG_LEVEL=2
args=(--model nano --ranks 2 --steps 20 --warmup 2 --sample_tokens 0)
cpu=$("$bin" "${args[@]}" --backend cpu 2>&1) || { echo "cpu run failed:"; echo "$cpu"; exit 1; }
pjrt=$("$bin" "${args[@]}" --backend pjrt --pjrt_plugin "$plugin" 2>&1) ||
  { echo "pjrt run failed:"; echo "$pjrt"; exit 1; }
echo "$pjrt" | grep -a "pjrt backend" >/dev/null ||
  { echo "the pjrt run did not report the pjrt backend:"; echo "$pjrt"; exit 1; }
summary() { echo "$1" | grep -a "^trained " | sed -E 's/ in [0-9.]+ s//'; }
c=$(summary "$cpu") p=$(summary "$pjrt")
echo "cpu:  $c"
echo "pjrt: $p"
[ -n "$p" ] || { echo "no summary line in the pjrt run:"; echo "$pjrt"; exit 1; }
[ "$c" = "$p" ] || { echo "the pjrt run's losses differ from the cpu run's"; exit 1; }
first=$(echo "$p" | sed -E 's/.*loss ([0-9.]+) -> ([0-9.]+).*/\1/')
last=$(echo "$p" | sed -E 's/.*loss ([0-9.]+) -> ([0-9.]+).*/\2/')
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.1) }' ||
  { echo "the loss did not fall: $first -> $last"; exit 1; }
echo "ok: the loss fell $first -> $last on pjrt, as on the cpu"
