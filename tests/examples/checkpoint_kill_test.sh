#!/usr/bin/env bash
# Kill points of a save, synchronous and in the background (--checkpoint_async): train_gpt
# (nano, 2 ranks as threads, a checkpoint every 2 steps, 6 steps) is killed with SIGKILL inside
# the save of step-4 at each point (FSDP_CHECKPOINT_KILL_AT=POINT:step-4: after the shard
# files are written, after metadata.json, after COMMIT, before the rename). No step-4 may then
# be visible; the next run must resume from step-2, the last intact checkpoint, and end with
# the losses of a run that was never killed. Then a snapshot over --checkpoint_async_max_mib:
# each save is left out, saying so, training goes on, and the refused last save fails the run.
#
# Usage: checkpoint_kill_test.sh TRAIN_GPT
set -uo pipefail
program=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
ck=$dir/ck
args=(--batch 4 --seq 32 --eval_every 0 --sample_tokens 0 --log_every 1 --checkpoint_every 2
      --steps 6)
failed=0
check() {  # check OK DESCRIPTION
  if [ "$1" = 1 ]; then echo "  ok      $2"; else echo "  FAILED  $2"; failed=1; fi
}
run() {  # run OUT EXPECTED_RC ARGS...
  local out=$1 want=$2
  shift 2
  echo "command: $program ${args[*]} $*"
  timeout -k 5 240 "$program" "${args[@]}" "$@" >"$out" 2>&1
  local rc=$?
  check "$([ $rc = "$want" ] && echo 1)" "exit code $rc, expected $want"
}
losses() { sed -n 's/^step *\([56]\)\/6 | loss \([0-9.]*\) .*/\1 \2/p' "$1"; }

run "$dir/ref.txt" 0 --checkpoint_dir "$dir/ref"
want=$(losses "$dir/ref.txt")
check "$([ -n "$want" ] && echo 1)" "the uninterrupted run's losses of steps 5 and 6: $(echo $want)"
for mode in sync async; do
  extra=()
  [ $mode = async ] && extra=(--checkpoint_async)
  for point in shard_written metadata_written commit_written; do
    echo "== $mode save, killed at $point of step-4"
    rm -rf "$ck"
    FSDP_CHECKPOINT_KILL_AT=$point:step-4 run "$dir/killed.txt" 137 --checkpoint_dir "$ck" \
      "${extra[@]}"
    check "$([ -f "$ck/step-2/COMMIT" ] && [ ! -e "$ck/step-4" ] && echo 1)" \
      "step-2 intact, no step-4"
    run "$dir/resumed.txt" 0 --checkpoint_dir "$ck" "${extra[@]}"
    check "$(grep -qF "resumed from $ck/step-2 (step 2)" "$dir/resumed.txt" && echo 1)" \
      "resumed from step-2"
    got=$(losses "$dir/resumed.txt")
    check "$([ "$got" = "$want" ] && echo 1)" "the losses of steps 5 and 6: $(echo $got)"
    check "$([ -f "$ck/step-6/COMMIT" ] && [ -f "$ck/step-4/COMMIT" ] && echo 1)" \
      "step-4 and step-6 saved"
    if [ $failed != 0 ]; then
      for f in killed resumed; do echo "---- $f ----"; cat "$dir/$f.txt"; done
      exit 1
    fi
  done
done

echo "== --checkpoint_async with a snapshot bound below the snapshot: each save left out, said"
rm -rf "$ck"
run "$dir/bound.txt" 1 --checkpoint_dir "$ck" --checkpoint_async --layers 4 \
  --checkpoint_async_max_mib 1
check "$(grep -qF "not saving $ck/step-2: the snapshot of rank 0's shards takes" "$dir/bound.txt" && grep -qF "more than --checkpoint_async_max_mib (1048576 bytes); nothing was copied or written; training goes on" "$dir/bound.txt" && echo 1)" \
  "the refused save of step-2 said"
check "$(grep -q "^step *6/6 | loss" "$dir/bound.txt" && echo 1)" "training went on to step 6"
check "$(grep -qF "the run's last save was not taken: rank 0: not saving $ck/step-6" "$dir/bound.txt" && [ ! -e "$ck/step-2" ] && echo 1)" \
  "the run's last save refused fails the run; nothing saved"
run "$dir/bound.txt" 2 --checkpoint_dir "$ck" --checkpoint_async_max_mib 1
check "$(grep -qF -- "--checkpoint_async_max_mib=1: needs --checkpoint_async" "$dir/bound.txt" && echo 1)" \
  "--checkpoint_async_max_mib without --checkpoint_async: bad usage"
[ $failed = 0 ] || cat "$dir/bound.txt"
exit $failed
