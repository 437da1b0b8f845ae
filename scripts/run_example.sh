#!/usr/bin/env bash
# Installs what is needed, builds libfsdp (Release) and trains the GPT example on the
# embedded corpus. Extra arguments go to examples/train_gpt (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_BENCH=OFF
cmake --build build -j"$(nproc)" --target train_gpt
exec build/examples/train_gpt "$@"
