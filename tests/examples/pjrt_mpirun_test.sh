#!/usr/bin/env bash
# train_gpt --backend pjrt under `mpirun -np 2 --ranks_per_process 2`: 2 processes, each a
# client of 2 XLA CPU devices, 4 ranks (CreateMpiThreadsWorld). FULL_SHARD (the world spans the
# processes: the host-staged bridge) and HYBRID_SHARD 2 x 2 (the shard group inside a process:
# the plugin; the replicate group across: the bridge), on nano and llama-nano, must match the
# single-rank CPU reference: the printed losses to their 4 digits, and every exported parameter
# within 1e-4 (the PJRT tolerance of the parity suites). Then a checkpoint saved by the pjrt
# processes resumes on 4 cpu ranks as threads, and one of cpu threads on the pjrt processes:
# the resumed steps' losses match the reference's.
# Usage: pjrt_mpirun_test.sh MPIEXEC TRAIN_GPT PLUGIN. Exit 77 (skipped) without the plugin.
set -u
mpiexec=$1 bin=$2 plugin=$3
if [ ! -f "$plugin" ]; then
  echo "skipped: no PJRT plugin at $plugin (scripts/fetch_pjrt_plugin.sh <build>/pjrt fetches it)"
  exit 77
fi
python=/usr/bin/python3
if ! "$python" -c "import numpy" 2>/dev/null; then python=python3; fi
export TF_CPP_MIN_LOG_LEVEL=2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mpi=("$mpiexec" -np 2 --oversubscribe --bind-to none --allow-run-as-root --mca btl self,vader
     -x TF_CPP_MIN_LOG_LEVEL)
common=(--steps 12 --warmup 2 --sample_tokens 0 --eval_every 0 --log_every 1)
summary() { grep -a "^trained " "$1" | sed -E 's/ in [0-9.]+ s//'; }
losses() { grep -aE "^step +[0-9]+/" "$1" | grep -a "| loss" | sed -E 's/ \| +[0-9]+ tok\/s.*//'; }
compare() {  # two safetensors files: every tensor within 1e-4
  "$python" - "$1" "$2" <<'PY'
import json, struct, sys
import numpy as np
def load(p):
    b = open(p, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__": continue
        s, e = v["data_offsets"]
        assert v["dtype"] == "F32", (k, v["dtype"])
        out[k] = np.frombuffer(b[8 + n + s:8 + n + e], dtype=np.float32)
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
assert a.keys() == b.keys(), (sorted(a), sorted(b))
worst = max(float(np.max(np.abs(a[k] - b[k]) / np.maximum(1.0, np.abs(b[k])))) for k in a)
print(f"  {len(a)} tensors, largest difference {worst:.2e}")
sys.exit(0 if worst <= 1e-4 else 1)
PY
}
failed=0
for model in nano llama-nano; do
  "$bin" --backend cpu --ranks 1 --batch 16 --model "$model" "${common[@]}" \
    --export_safetensors "$dir/ref.safetensors" >"$dir/ref.txt" 2>&1 ||
    { echo "the cpu reference failed:"; cat "$dir/ref.txt"; exit 1; }
  for strategy in FULL_SHARD HYBRID_SHARD; do
    extra=()
    [ $strategy = HYBRID_SHARD ] && extra=(--hybrid_shard 2)
    cmd=("${mpi[@]}" "$bin" --backend pjrt --pjrt_plugin "$plugin" --ranks_per_process 2
         --model "$model" --strategy $strategy "${extra[@]}" "${common[@]}"
         --export_safetensors "$dir/pjrt.safetensors")
    echo "$model $strategy: ${cmd[*]}"
    if ! "${cmd[@]}" >"$dir/pjrt.txt" 2>&1; then
      echo "  FAILED: the run failed"; tail -20 "$dir/pjrt.txt"; failed=1; continue
    fi
    grep -a "on 4 ranks (mpi_threads)" "$dir/pjrt.txt" >/dev/null ||
      { echo "  FAILED: not 4 ranks over mpi_threads"; head -3 "$dir/pjrt.txt"; failed=1; }
    want_paths="data planes: world/shard0 bridge"
    [ $strategy = HYBRID_SHARD ] && want_paths="data planes: world/shard0 plugin, world/replicate0 bridge"
    grep -a "$want_paths" "$dir/pjrt.txt" >/dev/null ||
      { echo "  FAILED: expected '$want_paths' in the banner"; head -3 "$dir/pjrt.txt"; failed=1; }
    if [ "$(losses "$dir/pjrt.txt")" != "$(losses "$dir/ref.txt")" ]; then
      echo "  FAILED: losses differ from the single-rank cpu reference"
      diff <(losses "$dir/ref.txt") <(losses "$dir/pjrt.txt"); failed=1
    else
      echo "  losses equal the reference's: $(summary "$dir/pjrt.txt")"
    fi
    compare "$dir/pjrt.safetensors" "$dir/ref.safetensors" ||
      { echo "  FAILED: the final parameters differ from the reference's by more than 1e-4"; failed=1; }
  done
done
# A checkpoint of the pjrt processes (HYBRID 2 x 2, after 6 steps) resumes on 4 cpu ranks as
# threads for 6 more; the reference does the same on one cpu rank.
ckpt=(--model nano "${common[@]}" --checkpoint_every 6)
hybrid=(--strategy HYBRID_SHARD --hybrid_shard 2)
"${mpi[@]}" "$bin" --backend pjrt --pjrt_plugin "$plugin" --ranks_per_process 2 "${ckpt[@]}" \
  "${hybrid[@]}" --checkpoint_dir "$dir/ckpt" --steps 6 >"$dir/first.txt" 2>&1 ||
  { echo "FAILED: the first half on pjrt"; tail "$dir/first.txt"; exit 1; }
"$bin" --backend cpu --ranks 4 "${ckpt[@]}" "${hybrid[@]}" --checkpoint_dir "$dir/ckpt" \
  >"$dir/second.txt" 2>&1 || { echo "FAILED: the resumed half"; tail "$dir/second.txt"; exit 1; }
"$bin" --backend cpu --ranks 1 --batch 16 "${ckpt[@]}" --checkpoint_dir "$dir/ref" --steps 6 \
  >"$dir/ref1.txt" 2>&1 && "$bin" --backend cpu --ranks 1 --batch 16 "${ckpt[@]}" \
  --checkpoint_dir "$dir/ref" >"$dir/ref2.txt" 2>&1 ||
  { echo "FAILED: the reference"; tail "$dir/ref1.txt" "$dir/ref2.txt"; exit 1; }
grep -a "resumed" "$dir/second.txt" | head -1
got=$(losses "$dir/second.txt") want=$(losses "$dir/ref2.txt")
if [ -n "$got" ] && [ "$got" = "$want" ]; then
  echo "a checkpoint of the pjrt processes resumed on cpu threads: steps 7-12 as the reference's"
else
  echo "FAILED: the resumed run's losses differ"; diff <(echo "$want") <(echo "$got"); failed=1
fi
# And back: a checkpoint of 4 cpu ranks as threads (after 6 steps) resumes on the pjrt processes.
"$bin" --backend cpu --ranks 4 "${ckpt[@]}" "${hybrid[@]}" --checkpoint_dir "$dir/back" \
  --steps 6 >"$dir/first.txt" 2>&1 || { echo "FAILED: the first half on cpu"; tail "$dir/first.txt"; exit 1; }
"${mpi[@]}" "$bin" --backend pjrt --pjrt_plugin "$plugin" --ranks_per_process 2 "${ckpt[@]}" \
  "${hybrid[@]}" --checkpoint_dir "$dir/back" >"$dir/second.txt" 2>&1 ||
  { echo "FAILED: the resumed half on pjrt"; tail "$dir/second.txt"; exit 1; }
got=$(losses "$dir/second.txt")
if [ -n "$got" ] && [ "$got" = "$want" ]; then
  echo "a checkpoint of cpu threads resumed on the pjrt processes: steps 7-12 as the reference's"
else
  echo "FAILED: the run resumed on pjrt differs"; diff <(echo "$want") <(echo "$got"); failed=1
fi
exit $failed
