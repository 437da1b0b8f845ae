#!/usr/bin/env bash
# scripts/gpu_check.sh [BUILD_DIR]: what a machine with an NVIDIA GPU runs to check the CUDA
# backend (docs/cuda.md), in a few minutes on one H100/H200.
# scripts/gpu_check.sh --bundle FILE.tar.xz: the same on a GPU machine that cannot build the
# project (no Abseil / oneDNN / GoogleTest there): the tests and train_gpt come built from
# `scripts/gpu_bundle.py pack BUILD FILE.tar.xz`, made where they build.
#   1. a Release build for sm_90 only (CUDA_ARCH=80 for an A100) of just the targets it needs;
#   2. every test labelled `gpu` (ctest -L gpu): the backend's contract, op conformance against
#      the CPU kernels, strategy parity, prefetch, mixed precision, checkpoints (ranks as
#      threads share the one GPU);
#   3. gpt2 (124M) in bf16, FULL_SHARD, on 1 rank and on 2 ranks as threads sharing the GPU:
#      tokens/s, MFU against PEAK_TFLOPS (989: H100/H200 dense bf16), host synchronisations per
#      step and peak device memory.
# Without a GPU it says so and exits 77 (skipped). Any failure exits 1.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bundle=""
if [ "${1:-}" = "--bundle" ]; then
  bundle=$(realpath "${2:?--bundle needs the file scripts/gpu_bundle.py pack wrote}")
  build=$(pwd)/gpu_bundle_run
else
  build=${1:-$root/build-gpu}
fi
arch=${CUDA_ARCH:-90}
peak=${PEAK_TFLOPS:-989}
steps=${GPT2_STEPS:-30}
batch=${GPT2_BATCH:-16}
seq=${GPT2_SEQ:-1024}
# GPT2_TIMEOUT: seconds each training run may take (600).

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: SKIPPED: no CUDA device (nvidia-smi lists no GPU on this machine)"
  exit 77
fi
nvidia-smi -L
start=$(date +%s)

if [ -n "$bundle" ]; then
  echo "== gpu_check: the gpu entries of $bundle"
  python3 "$root/scripts/gpu_bundle.py" run "$bundle" "$build"
  tests_rc=$?
  train_gpt="$build/gpu_bundle/bin/train_gpt"
  export LD_LIBRARY_PATH="$build/gpu_bundle/lib:${CUDA_HOME:-/usr/local/cuda}/lib64:${LD_LIBRARY_PATH:-}"
else
  echo "== gpu_check: build (Release, sm_${arch}) in $build"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DFSDP_BUILD_BENCH=OFF -DFSDP_WITH_PJRT=OFF >"$build.cmake.log" 2>&1 ||
    { tail -30 "$build.cmake.log"; echo "gpu_check: FAILED: cmake"; exit 1; }
  grep -q "CUDA backend built" "$build.cmake.log" ||
    { grep -i cuda "$build.cmake.log"; echo "gpu_check: FAILED: the CUDA backend was not configured"; exit 1; }
  targets="cuda_device_probe cuda_backend_test op_conformance_test sharding_parity_test c_api_cuda_test
           sharding_runtime_test overlap_precision_test checkpoint_resume_test train_gpt"
  # shellcheck disable=SC2086
  cmake --build "$build" -j"$(nproc)" --target $targets 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: FAILED: build"; exit 1; }
  echo "gpu_check: built in $(( $(date +%s) - start )) s"

  echo "== gpu_check: ctest -L gpu"
  ctest --test-dir "$build" -L gpu --output-on-failure --timeout 300
  tests_rc=$?
  train_gpt="$build/examples/train_gpt"
fi

echo "== gpu_check: gpt2 bf16 FULL_SHARD, B=$batch per rank, T=$seq, $steps steps"
fail=0
for ranks in 1 2; do
  log="$build/gpt2_${ranks}rank.log"
  timeout "${GPT2_TIMEOUT:-600}" "$train_gpt" --backend cuda --model gpt2 --ranks "$ranks" --batch $((batch * ranks)) \
    --seq "$seq" --steps "$steps" --param_dtype bf16 --log_every 5 --eval_every 0 \
    --sample_tokens 0 --warmup 5 >"$log" 2>&1
  rc=$?
  grep -E "^train_gpt:|^step|^trained|^memory|^device memory" "$log"
  if [ $rc -ne 0 ]; then
    tail -5 "$log"
    echo "gpu_check: FAILED: gpt2 on $ranks rank(s) exited $rc"
    fail=1
    continue
  fi
  # tokens/s of the last progress line (cumulative over the run after its first step),
  # parameters from the start line; FLOPs per token 6 P + 12 L C T (MODEL_SPEC.md).
  python3 - "$log" "$peak" "$ranks" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
peak, ranks = float(sys.argv[2]), int(sys.argv[3])
params = float(re.search(r"([0-9.]+)M parameters", text).group(1)) * 1e6
L = int(re.search(r" L=(\d+)", text).group(1)); C = int(re.search(r" C=(\d+)", text).group(1))
T = int(re.search(r"batch \d+ x (\d+)", text).group(1))
steps = re.findall(r"\| *(\d+) host syncs \| *([0-9.]+) tok/s", text)
syncs, tps = int(steps[-1][0]), float(steps[-1][1])
flops = (6 * params + 12 * L * C * T) * tps
print(f"gpu_check: gpt2 {ranks} rank(s) on one GPU: {tps:,.0f} tokens/s, "
      f"{flops / 1e12:.1f} TFLOP/s, MFU {flops / (peak * 1e12):.3f} of {peak:.0f} TFLOP/s, "
      f"{syncs} host syncs in the last step")
PY
done

echo "gpu_check: done in $(( $(date +%s) - start )) s"
if [ $tests_rc -ne 0 ] || [ $fail -ne 0 ]; then
  echo "gpu_check: FAILED (gpu tests rc=$tests_rc, training failures: $fail)"
  exit 1
fi
echo "gpu_check: PASSED"
