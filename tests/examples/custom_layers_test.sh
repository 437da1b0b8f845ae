#!/usr/bin/env bash
# examples/custom_layers as a user runs it: the default run (2 ranks, FULL_SHARD) exits 0,
# its loss falls and it prints the memory report; the same run on 1 rank, and with the other
# strategies, gives the same losses within 1e-5; a bad flag is exit code 2.
# Usage: custom_layers_test.sh CUSTOM_LAYERS
set -uo pipefail
program=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failed=0
check() {  # check OK DESCRIPTION
  if [ "$1" = 1 ]; then echo "  ok      $2"; else echo "  FAILED  $2"; failed=1; fi
}
run() {  # run NAME ARGS...: the output into $dir/NAME, the exit code into $dir/NAME.rc
  local name=$1
  shift
  echo "command: $program $*"
  timeout -k 5 240 "$program" "$@" >"$dir/$name" 2>&1
  echo $? >"$dir/$name.rc"
}
losses() { awk '$1 == "step" { print $2, $4 }' "$dir/$1"; }

run default --log_every 1
check "$([ "$(cat "$dir/default.rc")" = 0 ] && echo 1)" "default run: exit code $(cat "$dir/default.rc"), expected 0"
check "$(grep -q "on 2 ranks (FULL_SHARD)" "$dir/default" && echo 1)" "default run: 2 ranks, FULL_SHARD"
check "$(grep -q "^memory per rank: " "$dir/default" && echo 1)" "default run: prints the memory report"
first=$(losses default | head -n 1 | cut -d' ' -f2)
last=$(losses default | tail -n 1 | cut -d' ' -f2)
check "$(awk -v a="${first:-0}" -v b="${last:-1}" 'BEGIN { print (a > 0 && b < a / 4) ? 1 : 0 }')" \
      "default run: the loss falls to under a quarter ($first -> $last)"

# Parity: the same losses, step by step, on 1 rank and with each strategy on 2 or 4 ranks.
for variant in "ranks1 --ranks 1" "grad_op --strategy SHARD_GRAD_OP" "no_shard --strategy NO_SHARD" \
               "hybrid --ranks 4 --strategy HYBRID_SHARD --hybrid_shard 2"; do
  name=${variant%% *}
  read -r -a args <<<"${variant#* }"
  run "$name" --log_every 1 "${args[@]}"
  check "$([ "$(cat "$dir/$name.rc")" = 0 ] && echo 1)" "$name: exit code $(cat "$dir/$name.rc"), expected 0"
  worst=$(paste -d' ' <(losses default) <(losses "$name") |
          awk 'BEGIN { w = 0; n = 0 }
               { n++; if ($1 != $3) { w = 1e9 } d = $2 - $4; if (d < 0) d = -d; if (d > w) w = d }
               END { print (n == 0 ? 1e9 : w) }')
  check "$(awk -v w="$worst" 'BEGIN { print (w <= 1e-5) ? 1 : 0 }')" \
        "$name: losses equal the default run's within 1e-5 (largest difference $worst)"
done

run bad_batch --batch 63
check "$([ "$(cat "$dir/bad_batch.rc")" = 2 ] && echo 1)" "--batch 63: exit code $(cat "$dir/bad_batch.rc"), expected 2"
check "$(grep -q -- "--batch=63: must be a positive multiple of --ranks=2" "$dir/bad_batch" && echo 1)" \
      "--batch 63: says what is wrong"

if [ $failed != 0 ]; then
  for f in "$dir"/*; do
    case "$f" in *.rc) continue ;; esac
    echo "---- $(basename "$f") (last 30 lines) ----"
    tail -n 30 "$f"
  done
  exit 1
fi
echo "---- default run (last 4 lines) ----"
tail -n 4 "$dir/default"
