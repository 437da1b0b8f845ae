#!/usr/bin/env bash
# A hung peer under mpirun: train_gpt runs on 2 processes with FSDP_COMM_TIMEOUT_S=5; once it
# trains, one rank is stopped with SIGSTOP. The other rank must report the deadline error and
# the whole job must exit non-zero within the deadline plus a few seconds (it used to call
# MPI_Finalize, which waited for the stopped peer forever).
#
# Usage: mpi_stopped_rank_test.sh MPIEXEC TRAIN_GPT [FLAGS...] (more flags for train_gpt: the
# pjrt backend with 2 ranks per process, for one).
set -uo pipefail
mpiexec=$1 program=$2
shift 2
extra=("$@")
dir=$(mktemp -d)
cleanup() {
  pkill -CONT -f "^$program " 2>/dev/null; pkill -KILL -f "^$program " 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
log=$dir/out.txt
export FSDP_COMM_TIMEOUT_S=5
cmd=("$mpiexec" -np 2 --oversubscribe --bind-to none --allow-run-as-root --mca btl self,vader
     -x FSDP_COMM_TIMEOUT_S "$program" --steps 1000000 --log_every 1 --eval_every 0
     --sample_tokens 0 --batch 4 --seq 32 "${extra[@]}")
echo "command: FSDP_COMM_TIMEOUT_S=5 ${cmd[*]}"
"${cmd[@]}" >"$log" 2>&1 &
job=$!
waited=0
while [ $waited -lt 120 ] && ! grep -q "^step     3/" "$log" && kill -0 $job 2>/dev/null; do
  sleep 0.5
  waited=$((waited + 1))
done
victim=$(pgrep -f "^$program " | sort -n | tail -1)
if [ -z "$victim" ] || ! grep -q "^step     3/" "$log"; then
  echo "FAILED: the job did not start training"; cat "$log"; exit 1
fi
kill -STOP "$victim"
stopped=$(date +%s%N)
echo "stopped pid $victim after step 3"
# Wait for the job, at most 60 s.
for _ in $(seq 120); do kill -0 $job 2>/dev/null || break; sleep 0.5; done
if kill -0 $job 2>/dev/null; then
  echo "FAILED: the job still runs 60 s after a rank was stopped (deadline 5 s)"
  tail -5 "$log"; kill -KILL $job; exit 1
fi
wait $job
rc=$?
ms=$(( ($(date +%s%N) - stopped) / 1000000 ))
echo "job exited with $rc, ${ms} ms after the stop"
failed=0
check() { if eval "$2"; then echo "  ok      $1"; else echo "  FAILED  $1"; failed=1; fi; }
check "non-zero exit code" '[ "$rc" -ne 0 ]'
check "within the deadline (5 s) + 10 s" '[ "$ms" -lt 15000 ]'
check "a rank printed the deadline error" 'grep -q "train_gpt: \[rank [01]\] DEADLINE_EXCEEDED" "$log"'
# Stopped before it posted the collective, the peer "did not arrive"; stopped in the middle
# of the transfer, "every rank arrived, but the transfer did not complete".
check "it says what the peer did not do" 'grep -qE "did not arrive|did not complete" "$log"'
[ $failed = 0 ] || { echo "---- output ----"; tail -30 "$log"; }
exit $failed
