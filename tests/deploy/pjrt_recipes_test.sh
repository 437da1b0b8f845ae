#!/usr/bin/env bash
# Checks the PJRT launch recipes for accelerators (docs/deploy.md, "PJRT on TPU pods and
# Trainium clusters"): deploy/slurm/train_gpt_trainium.sbatch and deploy/tpu/train_gpt_tpu_pod.sh.
# Neither Trainium nor TPU hardware is here, so the checks are:
#   - bash -n and shellcheck (when installed);
#   - the launch each composes for its hardware (DRY_RUN=1: 2 Trainium nodes of 32 NeuronCores,
#     a v5litepod-16 of 4 VMs x 4 chips whose workers come from a stand-in metadata server):
#     one process per node, --ranks_per_process and --hybrid_shard = the node's devices, the
#     plugin's environment passed on with -x; and the layouts they refuse (exit code 2);
#   - with the XLA CPU plugin standing in for the accelerator's (when given): each script run as
#     it runs on one node, with 2 devices, training the nano GPT for 3 steps.
#
# Usage: pjrt_recipes_test.sh SOURCE_DIR [TRAIN_GPT MPIRUN PLUGIN]   (an empty argument: not run)
# shellcheck disable=SC2016,SC2034,SC2317  # check() evaluates its condition (reading rc and
# calling has and trained) later
set -euo pipefail
src=$1 train_gpt=${2:-} mpirun=${3:-} plugin=${4:-}
trn=$src/deploy/slurm/train_gpt_trainium.sbatch
tpu=$src/deploy/tpu/train_gpt_tpu_pod.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
check() { if eval "$2"; then echo "  ok      $1"; else echo "  FAILED  $1"; failed=1; fi; }
has() { grep -qF -- "$1" "$2"; }

for script in "$trn" "$tpu"; do
  check "bash -n $(basename "$script")" 'bash -n "$script"'
  if command -v shellcheck >/dev/null; then
    check "shellcheck $(basename "$script")" 'shellcheck -s bash "$script"'
  else
    echo "  note    shellcheck is not installed: not run"
  fi
done

# A file where the plugin would be: the dry runs check that it exists, not what it is.
touch "$work/libneuronpjrt.so" "$work/libtpu.so"
slurm_env=(PATH="$src/tests/deploy/stub:$PATH" SLURM_JOB_ID=4711 SLURM_JOB_NAME=train_gpt_trainium
  SLURM_SUBMIT_DIR="$work" SLURM_JOB_NODELIST="trn-[1-2]")

echo "-- train_gpt_trainium.sbatch, DRY_RUN=1 on 2 nodes x 1 task"
rc=0
env "${slurm_env[@]}" SLURM_JOB_NUM_NODES=2 SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=1 DRY_RUN=1 \
  PJRT_PLUGIN="$work/libneuronpjrt.so" TRAIN_GPT=/opt/libfsdp/train_gpt \
  bash "$trn" >"$work/trn.txt" 2>&1 || rc=$?
cat "$work/trn.txt"
out=$work/trn.txt
check "exit code 0, nothing run" '[ "$rc" -eq 0 ] && has "DRY_RUN=1: nothing run" "$out"'
check "one process per node: mpirun -np 2 --map-by ppr:1:node" \
  'has "mpirun -np 2 --map-by ppr:1:node " "$out"'
check "32 ranks per process, a shard group per node, on the Neuron plugin" \
  'has "/opt/libfsdp/train_gpt --backend pjrt --pjrt_plugin $work/libneuronpjrt.so --ranks_per_process 32 " "$out" && has "--strategy HYBRID_SHARD --hybrid_shard 32" "$out"'
check "each node a PJRT world of its own: all 32 cores, one process of 32 devices, index 0, a local root" \
  'has "NEURON_RT_VISIBLE_CORES=0-31 NEURON_PJRT_PROCESSES_NUM_DEVICES=32 NEURON_PJRT_PROCESS_INDEX=0 NEURON_RT_ROOT_COMM_ID=localhost:62182" "$out"'
check "the Neuron variables and FSDP_COMM_TIMEOUT_S passed on with -x" \
  'has "-x FSDP_COMM_TIMEOUT_S -x NEURON_RT_VISIBLE_CORES -x NEURON_PJRT_PROCESSES_NUM_DEVICES -x NEURON_PJRT_PROCESS_INDEX -x NEURON_RT_ROOT_COMM_ID -x PATH" "$out"'

echo "-- train_gpt_trainium.sbatch: refused layouts"
rc=0
env "${slurm_env[@]}" SLURM_JOB_NUM_NODES=2 SLURM_NTASKS=4 SLURM_NTASKS_PER_NODE=2 \
  PJRT_PLUGIN="$work/libneuronpjrt.so" bash "$trn" >"$work/bad1.txt" 2>&1 || rc=$?
cat "$work/bad1.txt"
check "2 tasks per node: exit code 2, nothing run" \
  '[ "$rc" -eq 2 ] && has "give sbatch --ntasks-per-node=1" "$work/bad1.txt" && ! has "mpirun -np" "$work/bad1.txt"'
rc=0
env "${slurm_env[@]}" SLURM_JOB_NUM_NODES=2 SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=1 PJRT_PLUGIN= \
  PYTHON=false bash "$trn" >"$work/bad2.txt" 2>&1 || rc=$?
cat "$work/bad2.txt"
check "no plugin (no libneuronxla): exit code 2, nothing run" \
  '[ "$rc" -eq 2 ] && has "no Neuron PJRT plugin" "$work/bad2.txt" && ! has "mpirun -np" "$work/bad2.txt"'

echo "-- train_gpt_tpu_pod.sh, DRY_RUN=1 on a v5litepod-16 (workers from a stand-in metadata server)"
mkdir -p "$work/metadata/instance/attributes"
printf 't1v-w-0:a0:10.0.0.2,t1v-w-1:a1:10.0.0.3,t1v-w-2:a2:10.0.0.4,t1v-w-3:a3:10.0.0.5' \
  >"$work/metadata/instance/attributes/worker-network-endpoints"
rc=0
env -u WORKERS METADATA_URL="file://$work/metadata" DRY_RUN=1 PJRT_PLUGIN="$work/libtpu.so" \
  TRAIN_GPT=/opt/libfsdp/train_gpt bash "$tpu" >"$work/tpu.txt" 2>&1 || rc=$?
cat "$work/tpu.txt"
out=$work/tpu.txt
check "exit code 0, nothing run" '[ "$rc" -eq 0 ] && has "DRY_RUN=1: nothing run" "$out"'
check "the 4 workers of the metadata, worker 0 first, one slot each" \
  'has "hostfile: 10.0.0.2 slots=1,10.0.0.3 slots=1,10.0.0.4 slots=1,10.0.0.5 slots=1" "$out"'
check "one process per worker: mpirun -np 4 ... --map-by ppr:1:node" \
  'grep -qE "mpirun -np 4 --hostfile [^ ]+ --map-by ppr:1:node " "$out"'
check "4 ranks per process, a shard group per VM, on libtpu" \
  'has "/opt/libfsdp/train_gpt --backend pjrt --pjrt_plugin $work/libtpu.so --ranks_per_process 4 " "$out" && has "--strategy HYBRID_SHARD --hybrid_shard 4" "$out"'
check "libtpu told each VM is a one-host v5litepod-4 of 2x2 chips, not asking the metadata server" \
  'has "TPU_SKIP_MDS_QUERY=true TPU_ACCELERATOR_TYPE=v5litepod-4 TPU_TOPOLOGY=2x2 TPU_TOPOLOGY_WRAP=false,false,false TPU_TOPOLOGY_ALT=false TPU_HOST_BOUNDS=1,1,1 TPU_CHIPS_PER_HOST_BOUNDS=2,2,1 TPU_WORKER_ID=0 TPU_WORKER_HOSTNAMES=localhost" "$out"'
check "the TPU variables and FSDP_COMM_TIMEOUT_S passed on with -x" \
  'has "-x FSDP_COMM_TIMEOUT_S -x TPU_SKIP_MDS_QUERY -x TPU_ACCELERATOR_TYPE -x TPU_TOPOLOGY -x TPU_TOPOLOGY_WRAP -x TPU_TOPOLOGY_ALT -x TPU_HOST_BOUNDS -x TPU_CHIPS_PER_HOST_BOUNDS -x TPU_WORKER_ID -x TPU_WORKER_HOSTNAMES " "$out"'
echo "-- train_gpt_tpu_pod.sh: refused"
rc=0
env -u WORKERS METADATA_URL="file://$work/nothing" PJRT_PLUGIN="$work/libtpu.so" \
  bash "$tpu" >"$work/bad3.txt" 2>&1 || rc=$?
cat "$work/bad3.txt"
check "no WORKERS and no metadata server: exit code 2, nothing run" \
  '[ "$rc" -eq 2 ] && has "no WORKERS given" "$work/bad3.txt" && ! has "mpirun -np" "$work/bad3.txt"'

# The scripts as they run on one node, with the XLA CPU plugin's 2 devices standing in.
why=
[ -n "$train_gpt" ] && [ -x "$train_gpt" ] || why="train_gpt is not built here"
[ -n "$why" ] || { [ -n "$mpirun" ] && [ -x "$(command -v "$mpirun" || true)" ]; } ||
  why="mpirun is not installed"
[ -n "$why" ] || { [ -n "$plugin" ] && [ -f "$plugin" ]; } ||
  why="no XLA CPU plugin (the PJRT backend is not built, or scripts/fetch_pjrt_plugin.sh has not fetched it)"
if [ -n "$why" ]; then
  echo "  note    the runs on the XLA CPU plugin are left out: $why"
  exit $failed
fi
mpi_dir=$(dirname "$(command -v "$mpirun")")
run_env=(PATH="$src/tests/deploy/stub:$mpi_dir:$PATH" OMPI_ALLOW_RUN_AS_ROOT=1
  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=2 TRAIN_GPT="$train_gpt"
  PJRT_PLUGIN="$plugin" MODEL=nano STEPS=3 MPIRUN_ARGS="--oversubscribe"
  TRAIN_ARGS="--batch 4 --seq 32 --log_every 1 --eval_every 0 --sample_tokens 0 --warmup 0")
trained() {  # FILE: 2 ranks of one process, HYBRID_SHARD over the plugin, 3 steps trained
  grep -q "HYBRID_SHARD on 2 ranks" "$1" && grep -q "pjrt backend" "$1" &&
    grep -qE "(^|>:)trained 3 steps in [0-9.]+ s: loss [0-9.]+ -> [0-9.]+" "$1"
}
echo "-- train_gpt_trainium.sbatch on 1 node x 1 task, RANKS_PER_PROCESS=2, the XLA CPU plugin"
rc=0
(cd "$work" && env "${slurm_env[@]}" "${run_env[@]}" SLURM_JOB_NODELIST="$(hostname)" \
   SLURM_JOB_NUM_NODES=1 SLURM_NTASKS=1 SLURM_NTASKS_PER_NODE=1 RANKS_PER_PROCESS=2 \
   bash "$trn") >"$work/trn_run.txt" 2>&1 || rc=$?
cat "$work/trn_run.txt"
check "exit code 0; it trained 3 steps on 2 ranks of one process, HYBRID_SHARD on the plugin" \
  '[ "$rc" -eq 0 ] && trained "$work/trn_run.txt"'
check "a log folder for the process" '[ -s "$work/train_gpt-4711.ranks/1/rank.0/stdout" ]'
echo "-- train_gpt_tpu_pod.sh on WORKERS=localhost, CHIPS_PER_HOST=2, the XLA CPU plugin"
rc=0
env "${run_env[@]}" WORKERS=localhost CHIPS_PER_HOST=2 bash "$tpu" >"$work/tpu_run.txt" 2>&1 ||
  rc=$?
cat "$work/tpu_run.txt"
check "exit code 0; it trained 3 steps on 2 ranks of one process, HYBRID_SHARD on the plugin" \
  '[ "$rc" -eq 0 ] && trained "$work/tpu_run.txt"'
exit $failed
