#!/usr/bin/env bash
# Installs what is needed, builds libfsdp (Release) and trains the GPT example on the
# embedded corpus. Extra arguments go to examples/train_gpt (try --help).
#
# The example is README's run: the nano config widened to L=4, C=128, H=4, learning rate
# 3e-3, 1000 steps (loss 5.58 -> ~1.26). train_gpt's own defaults follow MODEL_SPEC.md (the
# nano config as it is, lr 3e-4), so the example's settings are passed here, first: any flag
# given to this script comes after them and wins. A --config given to this script means that
# config as it is, so the example's model and learning rate are then left out.
set -euo pipefail
cd "$(dirname "$0")/.."
example_model=(--config nano --layers 4 --channels 128 --heads 4 --lr 3e-3)
example_run=(--steps 1000 --schedule cosine --warmup 50)
for arg in "$@"; do
  case "$arg" in
    --config | --config=* | -config | -config=*) example_model=() ;;
  esac
done
scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_BENCH=OFF
cmake --build build -j"$(nproc)" --target train_gpt
exec build/examples/train_gpt "${example_model[@]}" "${example_run[@]}" "$@"
