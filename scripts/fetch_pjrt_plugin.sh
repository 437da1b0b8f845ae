#!/bin/sh
# Fetches the XLA CPU PJRT plugin and the PJRT C API header it was built with, from the pinned
# wheel xla-cpu-pjrt==0.0.1 on PyPI (pip download, no install; sha256 checked), for the PJRT
# backend (backends/pjrt/, docs/pjrt.md).
#   usage: scripts/fetch_pjrt_plugin.sh DEST      e.g. scripts/fetch_pjrt_plugin.sh build/pjrt
# Writes DEST/include/pjrt_c_api.h (PJRT C API 0.81) and DEST/xla_cpu_pjrt.so (259 MB); keeps
# the wheel (63 MB) in DEST/cache so a second run needs no network. A build finds them when
# DEST is its FSDP_PJRT_DIR (default: <build dir>/pjrt).
set -eu
if [ $# -ne 1 ]; then
  echo "usage: $0 DEST   (e.g. $0 build/pjrt; then configure with -DFSDP_PJRT_DIR=DEST if DEST is not <build dir>/pjrt)" >&2
  exit 2
fi
DEST=$1
VER=0.0.1
WHEEL=xla_cpu_pjrt-$VER-py3-none-manylinux_2_27_x86_64.whl
WHEEL_SHA256=55837b6b7b47daa717f2d9a5a03563ea0ceaa338d06a81a1e2d3f060d960decc
HEADER_SHA256=c85bb95cb1743c2a353a555b3ab35f065e5f17007c7f182ad68d23754950235c
mkdir -p "$DEST/include" "$DEST/cache"
if [ ! -f "$DEST/cache/$WHEEL" ]; then
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_27_x86_64 -d "$DEST/cache" "xla-cpu-pjrt==$VER"
fi
if ! echo "$WHEEL_SHA256  $DEST/cache/$WHEEL" | sha256sum -c --quiet -; then
  echo "$0: $DEST/cache/$WHEEL does not have the pinned sha256; delete it and run again" >&2
  exit 1
fi
python3 - "$DEST/cache/$WHEEL" "$DEST" <<'PY'
import os, shutil, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for src, dst in [("xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so", "xla_cpu_pjrt.so"),
                     ("xla_plugins/xla_cpu_pjrt/include/pjrt_c_api.h", "include/pjrt_c_api.h")]:
        tmp = os.path.join(dest, dst + ".tmp")
        with z.open(src) as f, open(tmp, "wb") as o:
            shutil.copyfileobj(f, o)
        os.replace(tmp, os.path.join(dest, dst))
PY
if ! echo "$HEADER_SHA256  $DEST/include/pjrt_c_api.h" | sha256sum -c --quiet -; then
  echo "$0: $DEST/include/pjrt_c_api.h does not have the pinned sha256" >&2
  exit 1
fi
echo "PJRT plugin: $DEST/xla_cpu_pjrt.so  header: $DEST/include/pjrt_c_api.h"
