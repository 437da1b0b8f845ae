#!/usr/bin/env bash
# Trains train_gpt with the PJRT backend on a Cloud TPU pod slice through libtpu (libtpu.so,
# from the libtpu pip package), one process per TPU VM: run it on worker 0, where it starts
# Open MPI's mpirun with a hostfile of the slice's workers. Each process plays CHIPS_PER_HOST
# ranks as threads, one per chip of its VM (v5litepod-16: 4 VMs x 4 chips, 16 ranks; rank =
# worker x CHIPS_PER_HOST + thread). With HYBRID_SHARD a shard group is one VM
# (--hybrid_shard CHIPS_PER_HOST): its all-gathers and reduce-scatters run as libtpu's
# collectives over the VM's chips, and only the replicate group's all-reduce crosses VMs,
# through the host-staged bridge (device -> host, Open MPI over the VMs' network, host ->
# device; docs/pjrt.md).
#
# NOT RUN ON A TPU: written from the sources docs/deploy.md cites ("PJRT on TPU pods and
# Trainium clusters"); none of it has run on TPU hardware.
#
# Each process's libtpu client is a slice of its own VM's chips: libtpu is told the VM is a
# one-host slice (below) instead of reading the pod slice's topology from the metadata server,
# where it would wait for the other workers to join one client spanning the slice. libfsdp
# connects the VMs itself; the slice's links between VMs are not used.
#
#   gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=0 \
#     --command='cd libfsdp && deploy/tpu/train_gpt_tpu_pod.sh'
#
# Every worker needs Open MPI, libtpu and train_gpt at the same path, and worker 0 must reach
# the others by ssh without a password (docs/deploy.md gives the gcloud commands).
# Settings, from the environment:
#   WORKERS            the workers' addresses, comma separated, worker 0 first (default: read
#                      from the metadata server, instance/attributes/worker-network-endpoints)
#   TRAIN_GPT          the trainer (default: train_gpt on PATH, else build/examples/train_gpt
#                      under the current folder; the same path on every worker)
#   PJRT_PLUGIN        libtpu (default: the libtpu.so of the libtpu package that $PYTHON
#                      imports, libtpu.get_library_path())
#   PYTHON             the Python with the libtpu package (default python3)
#   CHIPS_PER_HOST     chips of one VM = ranks per process, one per PJRT device (default 4;
#                      a chip is one device from TPU v4 on, two on v2 and v3)
#   HOST_ACCELERATOR_TYPE, HOST_TOPOLOGY, HOST_CHIP_BOUNDS   one VM as a slice (default
#                      v5litepod-4, 2x2, 2,2,1: a v5e VM of 4 chips)
#   MODEL              --model (default llama-mini)       STEPS  --steps (default 1000)
#   STRATEGY           --strategy (default HYBRID_SHARD; --hybrid_shard is set to
#                      CHIPS_PER_HOST for HYBRID_SHARD and HYBRID_SHARD_GRAD_OP)
#   TRAIN_ARGS         more train_gpt flags, split at spaces (e.g. "--batch 64")
#   MPIRUN_ARGS        more mpirun options, split at spaces
#   FSDP_COMM_TIMEOUT_S  the deadline of every collective in seconds (default here 600: the
#                      first step compiles every program)
#   METADATA_URL       the metadata server (default http://metadata.google.internal/computeMetadata/v1)
#   DRY_RUN=1          print the hostfile, the environment and the mpirun command, run nothing
set -euo pipefail
me=train_gpt_tpu_pod.sh

CHIPS_PER_HOST=${CHIPS_PER_HOST:-4}
case "$CHIPS_PER_HOST" in
  '' | *[!0-9]* | 0*)
    echo "$me: CHIPS_PER_HOST=$CHIPS_PER_HOST: give the chips of one TPU VM (1 or more)" >&2
    exit 2 ;;
esac

# The workers, worker 0 first. The metadata server lists them as hostname:uid:ip,...
# (PyTorch/XLA reads the same attribute: pytorch/xla, torch_xla/_internal/tpu.py).
METADATA_URL=${METADATA_URL:-http://metadata.google.internal/computeMetadata/v1}
if [ -z "${WORKERS:-}" ]; then
  endpoints=$(curl -sf --connect-timeout 5 --max-time 10 -H 'Metadata-Flavor: Google' \
              "$METADATA_URL/instance/attributes/worker-network-endpoints") || endpoints=
  if [ -z "$endpoints" ]; then
    echo "$me: no WORKERS given and no worker-network-endpoints from the metadata server" \
         "($METADATA_URL): run it on worker 0 of a TPU VM slice, or set WORKERS=ip0,ip1,..." >&2
    exit 2
  fi
  WORKERS=$(tr ',' '\n' <<<"$endpoints" | awk -F: 'NF >= 3 { print $3 }' | paste -sd, -)
fi
IFS=, read -r -a workers <<<"$WORKERS"
if [ "${#workers[@]}" -eq 0 ]; then
  echo "$me: WORKERS='$WORKERS' names no worker" >&2
  exit 2
fi

PYTHON=${PYTHON:-python3}
if [ -z "${PJRT_PLUGIN:-}" ]; then
  PJRT_PLUGIN=$("$PYTHON" -c 'import libtpu; print(libtpu.get_library_path())' 2>/dev/null) ||
    PJRT_PLUGIN=
fi
if [ -z "$PJRT_PLUGIN" ] || [ ! -f "$PJRT_PLUGIN" ]; then
  echo "$me: no libtpu (PJRT_PLUGIN='$PJRT_PLUGIN'): pip install libtpu on every worker, or" \
       "set PJRT_PLUGIN to its libtpu.so (the same path on every worker)" >&2
  exit 2
fi
if [ -z "${TRAIN_GPT:-}" ]; then
  TRAIN_GPT=$(command -v train_gpt || echo "$PWD/build/examples/train_gpt")
fi
MODEL=${MODEL:-llama-mini}
STEPS=${STEPS:-1000}
STRATEGY=${STRATEGY:-HYBRID_SHARD}
export FSDP_COMM_TIMEOUT_S=${FSDP_COMM_TIMEOUT_S:-600}

# libtpu's topology: this VM alone, as GKE's TPU device plugin describes a one-host v5e slice
# of 2x2 chips to libtpu (ai-on-gke/tpu-device-plugin, pkg/tpu/util/util_test.go, the case
# "v5 lite podslice 2x2 topology, 4 chips per node"). TPU_SKIP_MDS_QUERY: take the topology
# from these variables, not from the metadata server; the bounds are in chips (x,y,z).
# Several processes on one VM would also set TPU_PROCESS_BOUNDS, TPU_CHIPS_PER_PROCESS_BOUNDS
# and TPU_VISIBLE_CHIPS per process; here one process owns every chip of its VM.
export TPU_SKIP_MDS_QUERY=true
export TPU_ACCELERATOR_TYPE=${HOST_ACCELERATOR_TYPE:-v5litepod-4}
export TPU_TOPOLOGY=${HOST_TOPOLOGY:-2x2}
export TPU_TOPOLOGY_WRAP=false,false,false
export TPU_TOPOLOGY_ALT=false
export TPU_HOST_BOUNDS=1,1,1
export TPU_CHIPS_PER_HOST_BOUNDS=${HOST_CHIP_BOUNDS:-2,2,1}
export TPU_WORKER_ID=0
export TPU_WORKER_HOSTNAMES=localhost
tpu_env=(TPU_SKIP_MDS_QUERY TPU_ACCELERATOR_TYPE TPU_TOPOLOGY TPU_TOPOLOGY_WRAP TPU_TOPOLOGY_ALT
         TPU_HOST_BOUNDS TPU_CHIPS_PER_HOST_BOUNDS TPU_WORKER_ID TPU_WORKER_HOSTNAMES)

train_args=(--backend pjrt --pjrt_plugin "$PJRT_PLUGIN" --ranks_per_process "$CHIPS_PER_HOST"
            --model "$MODEL" --steps "$STEPS" --strategy "$STRATEGY")
case "$STRATEGY" in
  HYBRID_SHARD | HYBRID_SHARD_GRAD_OP) train_args+=(--hybrid_shard "$CHIPS_PER_HOST") ;;
esac
# shellcheck disable=SC2206  # split at spaces on purpose
train_args+=(${TRAIN_ARGS:-})
# shellcheck disable=SC2206
mpirun_args=(${MPIRUN_ARGS:-})

hostfile=$(mktemp "${TMPDIR:-/tmp}/train_gpt_tpu_hosts.XXXXXX")
trap 'rm -f "$hostfile"' EXIT
for w in "${workers[@]}"; do echo "$w slots=1"; done >"$hostfile"
x_args=(-x FSDP_COMM_TIMEOUT_S)
for v in "${tpu_env[@]}"; do x_args+=(-x "$v"); done
# One process per worker, process w on worker w (the hostfile's order, ppr:1:node); mpirun
# starts the other workers' daemons by ssh, accepting a worker's host key the first time.
cmd=(mpirun -np "${#workers[@]}" --hostfile "$hostfile" --map-by ppr:1:node --bind-to none
     --tag-output --mca plm_rsh_args "-o StrictHostKeyChecking=accept-new -o BatchMode=yes"
     "${x_args[@]}" "${mpirun_args[@]}" "$TRAIN_GPT" "${train_args[@]}")
echo "$me: ${#workers[@]} workers x 1 process x $CHIPS_PER_HOST ranks ($WORKERS)," \
     "FSDP_COMM_TIMEOUT_S=$FSDP_COMM_TIMEOUT_S"
echo "$me: hostfile: $(paste -sd, "$hostfile")"
settings=()
for v in "${tpu_env[@]}"; do settings+=("$v=${!v}"); done
echo "$me: ${settings[*]}"
echo "$me: ${cmd[*]}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "$me: DRY_RUN=1: nothing run"
  exit 0
fi
rc=0
"${cmd[@]}" || rc=$?
echo "$me: mpirun exited with $rc"
exit "$rc"
