#!/usr/bin/env bash
# Checks deploy/slurm/train_gpt.sbatch: bash -n, shellcheck (when installed), and a run as
# Slurm would start it on one node with 2 tasks (SLURM_* set as sbatch sets them, a stub srun
# first on PATH): mpirun must read the allocation, train the nano GPT for a few steps on 2
# ranks and exit 0, with one log folder per rank. A layout of unequal tasks per node must be
# refused before anything runs.
#
# Usage: slurm_test.sh SOURCE_DIR TRAIN_GPT [MPIRUN]   (MPIRUN's folder goes first on PATH)
# shellcheck disable=SC2016,SC2034  # check() evaluates its condition (and reads rc) later
set -euo pipefail
src=$1 train_gpt=$2
mpi_dir=$(dirname "$(command -v "${3:-mpirun}" || echo /nonexistent/mpirun)")
[ -x "$mpi_dir/mpirun" ] || { echo "skipped: mpirun is not installed"; exit 77; }
script=$src/deploy/slurm/train_gpt.sbatch
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
check() { if eval "$2"; then echo "  ok      $1"; else echo "  FAILED  $1"; failed=1; fi; }

bash -n "$script" && echo "  ok      bash -n"
if command -v shellcheck >/dev/null; then
  shellcheck -s bash "$script" && echo "  ok      shellcheck ($(shellcheck --version | sed -n 's/^version: //p'))"
else
  echo "  note    shellcheck is not installed: not run"
fi

slurm_env=(PATH="$src/tests/deploy/stub:$mpi_dir:$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  SLURM_JOB_ID=4711 SLURM_JOBID=4711 SLURM_JOB_NAME=train_gpt SLURM_SUBMIT_DIR="$work"
  SLURM_JOB_NUM_NODES=1 SLURM_NNODES=1 SLURM_NTASKS=2 SLURM_NPROCS=2 SLURM_NTASKS_PER_NODE=2
  SLURM_TASKS_PER_NODE=2 SLURM_CPUS_PER_TASK=1 SLURM_JOB_NODELIST="$(hostname)"
  SLURM_NODELIST="$(hostname)" SLURM_JOB_CPUS_PER_NODE=2
  TRAIN_GPT="$train_gpt" MODEL=nano STEPS=5 MPIRUN_ARGS="--oversubscribe"
  TRAIN_ARGS="--batch 4 --seq 32 --log_every 1 --eval_every 0 --sample_tokens 0 --warmup 0")
echo "-- sbatch script on 1 node x 2 tasks"
rc=0
(cd "$work" && env "${slurm_env[@]}" bash "$script") >"$work/out.txt" 2>&1 || rc=$?
cat "$work/out.txt"
check "exit code 0" '[ "$rc" -eq 0 ]'
check "2 ranks under mpirun, HYBRID_SHARD with a shard group of 2 (the tasks per node)" \
  'grep -q "HYBRID_SHARD on 2 ranks (mpi)" "$work/out.txt" && grep -q -- "--hybrid_shard 2" "$work/out.txt"'
check "it trained: trained 5 steps in ...: loss A -> B" \
  'grep -qE "^trained 5 steps in [0-9.]+ s: loss [0-9.]+ -> [0-9.]+" "$work/out.txt"'
check "a log folder per rank" \
  '[ -s "$work/train_gpt-4711.ranks/1/rank.0/stdout" ] && [ -d "$work/train_gpt-4711.ranks/1/rank.1" ]'
check "FSDP_COMM_TIMEOUT_S set for the ranks" 'grep -q "FSDP_COMM_TIMEOUT_S=120" "$work/out.txt"'

echo "-- 3 tasks on 2 nodes: refused"
rc=0
env "${slurm_env[@]}" SLURM_JOB_NUM_NODES=2 SLURM_NTASKS=3 SLURM_NTASKS_PER_NODE=2 \
  bash "$script" >"$work/bad.txt" 2>&1 || rc=$?
cat "$work/bad.txt"
check "exit code 2, nothing run" '[ "$rc" -eq 2 ] && ! grep -q "^train_gpt:" "$work/bad.txt"'
exit $failed
