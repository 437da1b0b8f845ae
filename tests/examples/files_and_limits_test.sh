#!/usr/bin/env bash
# Files and limits, tried as a hostile user would (docs/failures.md, "Files and limits"): one
# class of case per run, each driving train_gpt (and fsdp_bench) as a user does, checking the
# exit code, the message, and that nothing was written over, hung or left behind.
#
# Usage: files_and_limits_test.sh CLASS TRAIN_GPT [FSDP_BENCH]
#   CLASS: outputs | model | entries | sizes | untrusted | lock | leftovers | disk
# Exit 77 (skipped, saying why) when a case needs what this machine lacks (root for a mount).
set -uo pipefail
class=$1 program=$2 bench=${3:-}
dir=$(mktemp -d)
mounted=""
cleanup() {
  [ -n "$mounted" ] && umount "$mounted" 2>/dev/null
  jobs -p | xargs -r kill -9 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
cd "$dir" || exit 1
failed=0
fast=(--batch 4 --seq 32 --eval_every 0 --sample_tokens 0 --warmup 0 --log_every 1000)
check() {  # check OK DESCRIPTION
  if [ "$1" = 1 ]; then echo "  ok      $2"; else echo "  FAILED  $2"; failed=1; fi
}
# run EXPECTED_RC ARGS...: train_gpt with ARGS (a limit of 60 s: nothing may hang), output in
# $dir/out.txt; the elapsed milliseconds in $ms.
run() {
  local want=$1
  shift
  echo "command: train_gpt $*"
  local start=$(date +%s%N)
  timeout -k 5 60 "$program" "$@" >"$dir/out.txt" 2>&1
  local rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  check "$([ $rc = "$want" ] && echo 1)" "exit code $rc, expected $want (${ms} ms)"
  if [ "$rc" != "$want" ]; then echo "---- output ----"; tail -n 20 "$dir/out.txt"; echo "----"; fi
}
contains() { check "$(grep -qF -- "$1" "$dir/out.txt" && echo 1)" "output contains: $1"; }
absent() { check "$(grep -qF -- "$1" "$dir/out.txt" || echo 1)" "output does not contain: $1"; }

case "$class" in
outputs)
  # Exports create a new file or replace a safetensors file; nothing else is touched.
  printf 'The quick brown fox jumps over the lazy dog. %.0s' $(seq 90) >corpus.txt
  sum=$(sha256sum corpus.txt)
  run 2 "${fast[@]}" --steps 2 --data corpus.txt --export_safetensors corpus.txt
  contains "cannot export to corpus.txt: it is the same file as --data=corpus.txt, which this run reads"
  check "$([ "$(sha256sum corpus.txt)" = "$sum" ] && echo 1)" "the corpus is unchanged"
  mkfifo fifo
  run 2 "${fast[@]}" --steps 2 --export_safetensors fifo
  contains "cannot export to fifo: it is a FIFO, not a regular file"
  check "$([ -p fifo ] && echo 1)" "the FIFO is still a FIFO"
  if [ "$(id -u)" = 0 ] && mknod nulldev c 1 3 2>/dev/null; then
    run 2 "${fast[@]}" --steps 2 --export_safetensors nulldev
    contains "cannot export to nulldev: it is a character device, not a regular file"
    check "$([ -c nulldev ] && echo 1)" "the device node is still a device"
  else
    echo "  (not root: the character-device case is left out; /dev/null itself is never tried)"
  fi
  echo "notes, not a model" >notes.txt
  run 2 "${fast[@]}" --steps 2 --export_safetensors notes.txt
  contains "cannot export to notes.txt: it exists and is not a safetensors file"
  check "$(grep -q "notes, not a model" notes.txt && echo 1)" "notes.txt is unchanged"
  run 0 "${fast[@]}" --steps 2 --export_safetensors m.safetensors
  contains "exported m.safetensors"
  run 0 "${fast[@]}" --steps 2 --export_safetensors m.safetensors
  contains "exported m.safetensors"
  ln -s m.safetensors link.safetensors
  run 2 "${fast[@]}" --steps 2 --export_safetensors link.safetensors
  contains "cannot export to link.safetensors: it is a symbolic link to m.safetensors, not a regular file"
  run 2 "${fast[@]}" --steps 2 --init_safetensors m.safetensors --export_safetensors m.safetensors
  contains "it is the same file as --init_safetensors=m.safetensors, which this run reads"
  # A trace (FSDP_TRACE) is written only over nothing, an empty file or an earlier trace.
  echo "notes" >trace.txt
  FSDP_TRACE=trace.txt run 0 "${fast[@]}" --steps 1
  contains "FSDP_TRACE: WriteChromeTrace: cannot write trace.txt: it exists and is not a Chrome trace"
  check "$(grep -qx "notes" trace.txt && echo 1)" "trace.txt is unchanged"
  if [ -n "$bench" ]; then
    echo "command: fsdp_bench --jsonl notes.txt ..."
    timeout -k 5 60 "$bench" --models nano --worlds 1 --steps 1 --warmup 0 --seq 16 \
      --jsonl notes.txt >out.txt 2>&1
    rc=$?
    check "$([ $rc = 2 ] && echo 1)" "fsdp_bench: exit code $rc, expected 2"
    contains "cannot write notes.txt: it exists and is not a JSON-lines file"
    check "$(grep -q "notes, not a model" notes.txt && echo 1)" "notes.txt is unchanged"
    echo "command: fsdp_bench --jsonl r.jsonl --csv r.jsonl ..."
    timeout -k 5 60 "$bench" --models nano --worlds 1 --steps 1 --jsonl r.jsonl --csv r.jsonl \
      >out.txt 2>&1
    rc=$?
    check "$([ $rc = 2 ] && echo 1)" "fsdp_bench: exit code $rc, expected 2"
    contains "--jsonl and --csv name the same file, r.jsonl"
  fi
  ;;
model)
  # A checkpoint or an export records the model; another model with equal shapes is refused.
  run 0 "${fast[@]}" --steps 2 --checkpoint_dir ck --export_safetensors nano.safetensors
  run 1 "${fast[@]}" --steps 4 --checkpoint_dir ck --heads 4
  contains "ck/step-2 holds another model: num_heads: 2 in the checkpoint, 4 in this model"
  contains "--allow_model_change"
  absent "| loss"
  run 0 "${fast[@]}" --steps 4 --checkpoint_dir ck --heads 4 --allow_model_change
  contains "warning: --allow_model_change: num_heads: 2 in the checkpoint, 4 in this model"
  contains "resumed from ck/step-2 (step 2)"
  run 1 "${fast[@]}" --steps 2 --init_safetensors nano.safetensors --heads 4
  contains "nano.safetensors holds another model: num_heads: 2 in the file, 4 in this model"
  # Llama: heads 4 / kv heads 2 and heads 8 / kv heads 4 have the same tensor shapes (C = 64).
  run 0 "${fast[@]}" --steps 2 --model llama-nano --checkpoint_dir lk
  run 1 "${fast[@]}" --steps 4 --model llama-nano --checkpoint_dir lk --heads 8 --kv_heads 4
  contains "num_heads: 4 in the checkpoint, 8 in this model; num_kv_heads: 2 in the checkpoint, 4 in this model"
  # Another family or width: the shapes differ, and the message says why.
  run 1 "${fast[@]}" --steps 4 --checkpoint_dir ck --channels 32 --heads 2
  contains "in the checkpoint but"
  contains "(the configurations differ: "
  contains "channels: 64 in the checkpoint, 32 in this model"
  ;;
entries)
  # Entries in the checkpoint directory that a save of this run cannot replace: refused at
  # start-up, naming them, before any step (and a FIFO never blocks the start).
  run 0 "${fast[@]}" --steps 4 --checkpoint_every 2 --checkpoint_dir ck
  touch ck/step-6
  run 2 "${fast[@]}" --steps 6 --checkpoint_every 2 --checkpoint_dir ck
  contains "this run saves step-6 after step 6, but ck/step-6 exists and is a regular file, not a checkpoint directory"
  absent "| loss"
  rm ck/step-6
  mkdir -p ck/step-6/COMMIT
  run 2 "${fast[@]}" --steps 6 --checkpoint_every 2 --checkpoint_dir ck
  contains "ck/step-6 exists and is not a checkpoint (no valid COMMIT marker, and entries a save never writes: COMMIT is a directory)"
  rm -r ck/step-6
  mkdir ck/step-6
  ln -s COMMIT ck/step-6/COMMIT
  run 2 "${fast[@]}" --steps 6 --checkpoint_every 2 --checkpoint_dir ck
  contains "COMMIT is a symbolic link loop"
  rm -r ck/step-6
  for f in COMMIT metadata.json; do
    mv ck/step-4/$f saved
    mkfifo ck/step-4/$f
    run 2 "${fast[@]}" --steps 6 --checkpoint_every 2 --checkpoint_dir ck
    contains "this run saves step-4 after step 4, but ck/step-4 exists and is not a checkpoint"
    contains "entries a save never writes: $f is a FIFO"
    check "$([ "$ms" -lt 20000 ] && echo 1)" "no hang on the FIFO ($ms ms)"
    rm ck/step-4/$f
    mv saved ck/step-4/$f
  done
  mv ck/step-4/shard-00000-of-00002.bin saved
  mkfifo ck/step-4/shard-00000-of-00002.bin
  run 1 "${fast[@]}" --steps 6 --checkpoint_every 2 --checkpoint_dir ck
  contains "ck/step-4/shard-00000-of-00002.bin: a FIFO, not a regular file"
  check "$([ "$ms" -lt 20000 ] && echo 1)" "no hang on the FIFO ($ms ms)"
  rm ck/step-4/shard-00000-of-00002.bin
  mv saved ck/step-4/shard-00000-of-00002.bin
  run 0 "${fast[@]}" --steps 6 --checkpoint_every 2 --checkpoint_dir ck
  contains "resumed from ck/step-4 (step 4)"
  contains "saved ck/step-6"
  ;;
sizes)
  # A run that cannot fit the host or the device is refused by the memory planner before
  # anything is allocated, quickly, with the figures. Under a memory limit, so that a
  # regression fails here instead of taking the machine.
  # (Sanitizers reserve more address space than such a limit: not under them.)
  # (Sizes no host of today holds: about 0.5 TB of parameters and optimizer state.)
  for args in "--layers 10000 --channels 1024 --heads 8" "--batch 2147483646" \
              "--model llama2-70b"; do
    echo "command: train_gpt --steps 2 $args"
    start=$(date +%s%N)
    ( [ -z "${FSDP_SANITIZED:-}" ] && ulimit -v 4000000
      exec timeout -k 5 60 "$program" --steps 2 --sample_tokens 0 $args ) >out.txt 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    check "$([ $rc = 2 ] && echo 1)" "exit code $rc, expected 2 (${ms} ms)"
    contains "the memory planner puts a rank's peak at"
    contains "GiB of memory; use fewer layers"
    absent "| loss"
  done
  run 2 "${fast[@]}" --steps 2 --layers 100000
  contains "--layers=100000"
  contains "10000"
  run 2 "${fast[@]}" --steps 2 --config mini --device_memory_mib 40
  contains "--device_memory_mib=40: mini FULL_SHARD on 2 rank(s): the memory planner puts a rank's peak at"
  contains "more than the device's 40.0 MiB"
  run 2 "${fast[@]}" --steps 2 --lr 1e308
  contains "--lr=1e+308: allowed: a learning rate > 0 that an f32 holds"
  ;;
untrusted)
  # All steps skipped, or a diverged model: not a success, and nothing saved or exported.
  run 1 "${fast[@]}" --steps 30 --param_dtype f16 --loss_scaling 1e30 --checkpoint_dir ck \
    --checkpoint_every 10 --export_safetensors m.safetensors
  contains "30 of the run's 30 steps were skipped for inf/NaN gradients, more than half"
  contains "not saving step-10: every step since the start was skipped"
  absent "trained 30 steps"
  check "$([ -z "$(ls ck 2>/dev/null)" ] && [ ! -e m.safetensors ] && echo 1)" \
    "no checkpoint and no export written"
  run 1 --lr 1e4 --clip 0 --steps 30 --warmup 0 --sample_tokens 0 --eval_every 0 \
    --nonfinite skip --log_every 30 --export_safetensors d.safetensors --checkpoint_dir dk
  contains "steps were skipped for inf/NaN gradients, more than half"
  absent "trained 30 steps"
  check "$([ ! -e d.safetensors ] && [ ! -e dk/step-30 ] && echo 1)" \
    "the diverged model was neither saved at the end nor exported"
  ;;
lock)
  # Two trainers on one checkpoint directory: the second is refused, naming the first.
  "$program" "${fast[@]}" --steps 100000 --checkpoint_dir ck --checkpoint_every 1000 \
    >first.txt 2>&1 &
  first=$!
  for _ in $(seq 100); do grep -q "| loss" first.txt && break; sleep 0.1; done
  run 2 "${fast[@]}" --steps 4 --checkpoint_dir ck
  contains "ck is in use by another job (pid $first on host"
  contains "it holds the lock on ck/.fsdp-lock"
  absent "| loss"
  kill -9 "$first"
  wait "$first" 2>/dev/null
  # The kernel released the lock of the killed job: the next one runs.
  run 0 "${fast[@]}" --steps 4 --checkpoint_dir ck
  contains "saved ck/step-4"
  ;;
leftovers)
  # What crashed saves and killed exports left is removed when provably dead, saying so.
  run 0 "${fast[@]}" --steps 2 --checkpoint_dir ck
  cp -r ck/step-2 ck/step-2.old-1234-abc
  rm ck/step-2.old-1234-abc/COMMIT
  mkdir ck/step-4.tmp-99-abc
  run 0 "${fast[@]}" --steps 2 --export_safetensors m.safetensors
  cp m.safetensors m.safetensors.tmp-999999     # a killed export: nobody holds it
  cp m.safetensors m.safetensors.tmp-999998     # an export in progress holds it:
  exec 9<m.safetensors.tmp-999998               # (this shell holds the lock, on fd 9)
  flock -x 9
  echo "not ours" >m.safetensors.tmp-999997     # not an export's file
  run 0 "${fast[@]}" --steps 4 --checkpoint_dir ck --export_safetensors m.safetensors
  contains "removed ck/step-2.old-1234-abc: the old copy of step-2, which a finished save replaced"
  contains "removed ck/step-4.tmp-99-abc: the temporary directory of a save that did not finish"
  contains "removed m.safetensors.tmp-999999: the temporary file of an export that was killed"
  absent "m.safetensors.tmp-999998"
  check "$([ ! -e ck/step-2.old-1234-abc ] && [ ! -e m.safetensors.tmp-999999 ] && echo 1)" \
    "the dead ones are gone"
  check "$([ -e m.safetensors.tmp-999998 ] && [ -e m.safetensors.tmp-999997 ] && echo 1)" \
    "the live and the foreign one are kept"
  exec 9<&-
  # No second warning, no second removal: nothing is left to clean.
  run 0 "${fast[@]}" --steps 4 --checkpoint_dir ck
  absent "removed"
  absent "warning: skipping"
  ;;
disk)
  # A file system without room for one checkpoint: refused at start-up; room for fewer than
  # the run's checkpoints: a warning.
  mkdir mnt
  if ! mount -t tmpfs -o size=1m tmpfs mnt 2>/dev/null; then
    echo "skipped: mounting a small tmpfs needs root (CAP_SYS_ADMIN), which this run lacks"
    exit 77
  fi
  mounted=$dir/mnt
  run 2 "${fast[@]}" --steps 4 --checkpoint_dir mnt/ck
  contains "--checkpoint_dir=mnt/ck: the file system has"
  contains "and one checkpoint needs 1.4 MiB: free some space or write elsewhere"
  absent "| loss"
  umount mnt
  mount -t tmpfs -o size=2m tmpfs mnt
  run 1 "${fast[@]}" --steps 4 --checkpoint_every 2 --checkpoint_dir mnt/ck
  contains "warning: --checkpoint_dir=mnt/ck: the file system has 2.0 MiB free, less than the"
  contains "that the 2 checkpoints of this run (1.4 MiB each, every one kept) need"
  contains "saved mnt/ck/step-2"
  ;;
*)
  echo "unknown class $class"
  exit 2
  ;;
esac
exit $failed
