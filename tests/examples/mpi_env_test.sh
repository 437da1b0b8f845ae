#!/usr/bin/env bash
# Environment variables train_gpt reads under mpirun, given bad values: exit code 2, the
# message printed once (by rank 0, not by every rank), nothing trained, quickly.
#
# Usage: mpi_env_test.sh MPIEXEC TRAIN_GPT
set -uo pipefail
mpiexec=$1 program=$2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
failed=0
for case in "FSDP_MPI_SHM=2|FSDP_MPI_SHM='2' is not valid: give 0" \
            "FSDP_COMM_TIMEOUT_S=5s|FSDP_COMM_TIMEOUT_S='5s' is not a valid timeout"; do
  assignment=${case%%|*} want=${case#*|}
  echo "command: $assignment mpirun -np 2 train_gpt --steps 1"
  env "$assignment" timeout -s KILL 120 "$mpiexec" -np 2 --oversubscribe --bind-to none \
    --allow-run-as-root --mca btl self,vader -x "${assignment%%=*}" "$program" --steps 1 \
    --sample_tokens 0 >"$out" 2>&1
  rc=$?
  n=$(grep -cF -- "$want" "$out")
  if [ "$rc" = 2 ] && [ "$n" = 1 ] && ! grep -q "| loss" "$out" && ! grep -q "rank -1" "$out"; then
    echo "  ok      exit 2, said once: $want"
  else
    echo "  FAILED  exit $rc, said $n times (want exit 2, once): $want"
    cat "$out"
    failed=1
  fi
done
exit $failed
