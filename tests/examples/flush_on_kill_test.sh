#!/usr/bin/env bash
# train_gpt with its output redirected to a file is killed with SIGKILL after its first
# progress line: that line (and the header before it) must already be in the file, i.e.
# every line is flushed as it is printed, not held in a buffer that dies with the process.
#
# Usage: flush_on_kill_test.sh TRAIN_GPT
set -uo pipefail
program=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
log=$dir/stdout.txt
args=(--steps 1000000 --log_every 1000000 --eval_every 0 --sample_tokens 0 --batch 2 --seq 16)
echo "command: $program ${args[*]} > $log (ranks as threads)"
"$program" "${args[@]}" >"$log" 2>"$dir/stderr.txt" &
pid=$!
# Step 1 takes well under a second; the line is printed right after it. Wait until the
# file has it, or at most 60 s (without flushing it never appears: nothing else is printed
# for a million steps), then kill -9.
waited=0
while [ $waited -lt 120 ] && ! grep -q "^step     1/" "$log" && kill -0 $pid 2>/dev/null; do
  sleep 0.5
  waited=$((waited + 1))
done
sleep 1  # and a little longer, as a user would
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
echo "killed with SIGKILL after $((waited / 2 + 1)) s; $(wc -c <"$log") bytes in the file"
failed=0
for want in "train_gpt: GPT nano " "step     1/1000000 | loss"; do
  if grep -qF "$want" "$log"; then
    echo "  ok      the file contains: $want"
  else
    echo "  FAILED  the file contains: $want"
    failed=1
  fi
done
if [ $failed != 0 ]; then
  echo "---- stdout file ----"; cat "$log"
  echo "---- stderr ----"; cat "$dir/stderr.txt"
fi
exit $failed
