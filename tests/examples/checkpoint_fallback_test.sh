#!/usr/bin/env bash
# Resuming past a damaged checkpoint: train_gpt saves step-2 and step-4; step-4's COMMIT
# marker is then removed (later: overwritten with garbage) and a crashed save's temporary
# directory is left next to them. The next run must say that it skips step-4 and why, resume
# from step-2 (the newest intact one), say that it removed the temporary directory, save
# step-4 again in place of the damaged one and succeed; the run after it resumes from there.
# Then a shard file of the newest checkpoint (its COMMIT valid) is damaged: the run names the
# file and why, resumes from the one before and saves the step again; with
# --checkpoint_fallback=false the same damage stops the run (exit 1) naming the file.
#
# Usage: checkpoint_fallback_test.sh TRAIN_GPT
set -uo pipefail
program=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
ck=$dir/ck
args=(--batch 4 --seq 32 --eval_every 0 --sample_tokens 0 --log_every 1 --checkpoint_every 2
      --checkpoint_dir "$ck")
failed=0
check() {  # check OK DESCRIPTION
  if [ "$1" = 1 ]; then echo "  ok      $2"; else echo "  FAILED  $2"; failed=1; fi
}
run() {  # run EXPECTED_RC ARGS...: runs train_gpt, output in $dir/out.txt
  local want=$1
  shift
  echo "command: $program ${args[*]} $*"
  timeout -k 5 240 "$program" "${args[@]}" "$@" >"$dir/out.txt" 2>&1
  local rc=$?
  check "$([ $rc = "$want" ] && echo 1)" "exit code $rc, expected $want"
}
contains() {
  check "$(grep -qF -- "$1" "$dir/out.txt" && echo 1)" "output contains: $1"
}
show() { echo "---- output ----"; cat "$dir/out.txt"; echo "----"; }
flip() {  # flip FILE OFFSET: one bit of the byte at OFFSET changed
  local b
  b=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf "$(printf '\\%03o' $((b ^ 16)))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

run 0 --steps 4
check "$([ -f "$ck/step-4/COMMIT" ] && [ -f "$ck/step-2/COMMIT" ] && echo 1)" "step-2 and step-4 saved"

echo "== step-4/COMMIT removed, a crashed save's step-6.tmp-123-abc left behind"
rm "$ck/step-4/COMMIT"
mkdir "$ck/step-6.tmp-123-abc"
run 0 --steps 4
contains "train_gpt: warning: skipping checkpoint $ck/step-4: $ck/step-4/COMMIT: missing"
contains "removed $ck/step-6.tmp-123-abc: the temporary directory of a save that did not finish"
contains "resumed from $ck/step-2 (step 2), the newest intact checkpoint"
contains "saved $ck/step-4 (replacing the damaged checkpoint of that name)"
check "$([ ! -e "$ck/step-6.tmp-123-abc" ] && [ -f "$ck/step-4/COMMIT" ] && echo 1)" \
  "the temporary directory is gone, step-4 is complete again"
[ $failed = 0 ] || show

echo "== step-4/COMMIT overwritten with garbage, then trained on to step 6"
echo "garbage" >"$ck/step-4/COMMIT"
run 0 --steps 6
contains "train_gpt: warning: skipping checkpoint $ck/step-4: $ck/step-4/COMMIT"
contains "resumed from $ck/step-2 (step 2), the newest intact checkpoint"
contains "saved $ck/step-4 (replacing the damaged checkpoint of that name)"
contains "saved $ck/step-6"
[ $failed = 0 ] || show

echo "== nothing damaged: resumes from the newest"
run 0 --steps 6
contains "resumed from $ck/step-6 (step 6)"
contains "nothing to train: the checkpoint is at step 6, --steps is 6"
check "$(grep -q "skipping" "$dir/out.txt" || echo 1)" "no checkpoint skipped"
[ $failed = 0 ] || show

shard=$(ls "$ck"/step-6/shard-* | tail -n 1)
echo "== a byte of $(basename "$shard") of step-6 flipped (its COMMIT still valid)"
flip "$shard" $(( $(stat -c %s "$shard") - 5 ))
run 0 --steps 6
contains "train_gpt: warning: skipping checkpoint $ck/step-6: "
contains "$shard: checksum mismatch"
contains "resumed from $ck/step-4 (step 4), the newest intact checkpoint"
contains "saved $ck/step-6 (replacing the damaged checkpoint of that name)"
[ $failed = 0 ] || show

echo "== the same damage with --checkpoint_fallback=false: an error naming the file"
flip "$shard" $(( $(stat -c %s "$shard") - 5 ))
run 1 --steps 6 --checkpoint_fallback=false
contains "$shard: checksum mismatch"
contains "--checkpoint_fallback=true resumes from the previous intact one"
check "$(grep -q "resumed from" "$dir/out.txt" || echo 1)" "nothing resumed"
[ $failed = 0 ] || show
exit $failed
