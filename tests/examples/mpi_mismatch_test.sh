#!/usr/bin/env bash
# Ranks of one mpirun job launched differently: each case gives rank 1 other arguments than
# rank 0. Every case must end at start-up, before training, with exit code 2 and a message
# naming what differs (or rank 1's bad flag), quickly, not after a collective's deadline.
#
# Usage: mpi_mismatch_test.sh MPIEXEC TRAIN_GPT SMALL_CORPUS OTHER_CORPUS
set -uo pipefail
mpiexec=$1 program=$2 corpus_a=$3 corpus_b=$4
out=$(mktemp)
trap 'rm -f "$out"' EXIT
common=(--steps 3 --sample_tokens 0 --eval_every 0 --seq 8 --batch 4)
failed=0
# run NAME "RANK0 ARGS" "RANK1 ARGS" EXPECTED_TEXT
run() {
  local name=$1 a0=$2 a1=$3 want=$4
  local start=$(date +%s%N)
  FSDP_COMM_TIMEOUT_S=60 timeout -s KILL 120 "$mpiexec" -np 2 --oversubscribe --bind-to none \
    --allow-run-as-root --mca btl self,vader -x FSDP_COMM_TIMEOUT_S bash -c \
    'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then exec "$0" $2; else exec "$0" $1; fi' \
    "$program" "${common[*]} $a0" "${common[*]} $a1" >"$out" 2>&1
  local rc=$? ms=$(( ($(date +%s%N) - start) / 1000000 ))
  local ok=1
  [ "$rc" -eq 2 ] || ok=0
  grep -qF -- "$want" "$out" || ok=0
  grep -q "| loss" "$out" && ok=0
  [ "$ms" -lt 30000 ] || ok=0  # far below the 60 s deadline: no rank waited for it
  if [ $ok = 1 ]; then
    echo "  ok      $name: exit $rc after ${ms} ms, says: $want"
  else
    echo "  FAILED  $name: exit $rc after ${ms} ms (want 2, quickly, saying: $want)"
    sed 's/^/    /' "$out" | tail -15
    failed=1
  fi
}
echo "command: $mpiexec -np 2 ... $program ${common[*]} (rank 1 with other arguments)"
run lr "" "--lr 1e-3" "lr is 0.001 on rank 1 but 0.0003 on rank 0"
run seed "" "--seed 2" "seed is 2 on rank 1 but 1 on rank 0"
run batch "" "--batch 8" "batch is 8 on rank 1 but 4 on rank 0"
run clip "" "--clip 0.5" "clip is 0.5 on rank 1 but 1 on rank 0"
run data "--data $corpus_a" "--data $corpus_b" "data (tokens, digest) is"
run bad_flag "" "--steps 0" "rank 1: --steps=0: allowed: 1 or more optimizer steps"
exit $failed
