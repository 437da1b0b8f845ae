#!/usr/bin/env bash
# Ranks of one mpirun job launched differently: each case gives one rank other arguments than
# the others (rank 1 of 2; then a sample of flags, of every part of the trainer, at rank 1 and
# at rank 2, the last, of 3). Every case must end at start-up, before training, with exit code 2
# and a message naming what differs (or the rank's bad flag), quickly, not after a collective's
# deadline.
#
# Usage: mpi_mismatch_test.sh MPIEXEC TRAIN_GPT SMALL_CORPUS OTHER_CORPUS [2|3]
#   (the cases of 2 ranks, the default, or those of 3 ranks)
set -uo pipefail
mpiexec=$1 program=$2 corpus_a=$3 corpus_b=$4 part=${5:-2}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
common=() np=2 odd=1  # set by each part below
failed=0
# run NAME "OTHER RANKS' ARGS" "ODD RANK'S ARGS" EXPECTED_TEXT: np ranks, rank $odd differs.
run() {
  local name=$1 a0=$2 a1=$3 want=$4
  local start=$(date +%s%N)
  FSDP_COMM_TIMEOUT_S=60 timeout -s KILL 120 "$mpiexec" -np "$np" --oversubscribe --bind-to none \
    --allow-run-as-root --mca btl self,vader -x FSDP_COMM_TIMEOUT_S bash -c \
    'if [ "$OMPI_COMM_WORLD_RANK" = "$3" ]; then exec "$0" $2; else exec "$0" $1; fi' \
    "$program" "${common[*]} $a0" "${common[*]} $a1" "$odd" >"$out" 2>&1
  local rc=$? ms=$(( ($(date +%s%N) - start) / 1000000 ))
  local ok=1
  [ "$rc" -eq 2 ] || ok=0
  grep -qF -- "$want" "$out" || ok=0
  grep -q "| loss" "$out" && ok=0
  [ "$ms" -lt 30000 ] || ok=0  # far below the 60 s deadline: no rank waited for it
  if [ $ok = 1 ]; then
    echo "  ok      $name (rank $odd of $np): exit $rc after ${ms} ms, says: $want"
  else
    echo "  FAILED  $name (rank $odd of $np): exit $rc after ${ms} ms" \
         "(want 2, quickly, saying: $want)"
    sed 's/^/    /' "$out" | tail -15
    failed=1
  fi
}
two_ranks() {
  common=(--steps 3 --sample_tokens 0 --eval_every 0 --seq 8 --batch 4)
  np=2 odd=1
  echo "command: $mpiexec -np 2 ... $program ${common[*]} (rank 1 with other arguments)"
  run lr "" "--lr 1e-3" "lr is 0.001 on rank 1 but 0.0003 on rank 0"
  run seed "" "--seed 2" "seed is 2 on rank 1 but 1 on rank 0"
  run batch "" "--batch 8" "batch is 8 on rank 1 but 4 on rank 0"
  run clip "" "--clip 0.5" "clip is 0.5 on rank 1 but 1 on rank 0"
  run data "--data $corpus_a" "--data $corpus_b" "data (tokens, digest) is"
  run bad_flag "" "--steps 0" "rank 1: --steps=0: allowed: 1 or more optimizer steps"
}

# A flag of each part of the trainer (sharding, precision, accumulation, the model at rank 1,
# a middle one; sharding, the optimizer, the schedule, the policy for inf/NaN, evaluation at
# rank 2, the last, and a bad flag there). The message names the first rank that differs from
# rank 0.
three_ranks() {
  common=(--steps 3 --sample_tokens 0 --eval_every 0 --seq 8 --batch 6)
  np=3 odd=1
  echo "command: $mpiexec -np 3 ... $program ${common[*]}" \
       "(rank 1, then rank 2, with other arguments)"
  run strategy "" "--strategy SHARD_GRAD_OP" \
    "strategy is SHARD_GRAD_OP on rank 1 but FULL_SHARD on rank 0"
  run param_dtype "" "--param_dtype bf16" "param_dtype is bf16 on rank 1 but f32 on rank 0"
  run micro_batches "" "--micro_batches 2" "micro_batches is 2 on rank 1 but 1 on rank 0"
  run layers "" "--layers 3" "layers is 3 on rank 1 but 0 on rank 0"
  odd=2
  run strategy "" "--strategy NO_SHARD" "strategy is NO_SHARD on rank 2 but FULL_SHARD on rank 0"
  run weight_decay "" "--weight_decay 0" "weight_decay is 0 on rank 2 but 0.1 on rank 0"
  run warmup "" "--warmup 2" "warmup is 2 on rank 2 but 50 on rank 0"
  run nonfinite "" "--nonfinite skip" "nonfinite is skip on rank 2 but error on rank 0"
  run eval_every "" "--eval_every 2" "eval_every is 2 on rank 2 but 0 on rank 0"
  run bad_flag "" "--warmup -5" "rank 2: --warmup=-5: allowed: 0 (no warmup) or more steps"
}

case "$part" in
  2) two_ranks ;;
  3) three_ranks ;;
  *) echo "mpi_mismatch_test.sh: the last argument is 2 or 3, not '$part'"; exit 2 ;;
esac
exit $failed
