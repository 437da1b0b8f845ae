#!/usr/bin/env bash
# Installs the Debian 12 packages libfsdp builds, tests and fuzzes with. Idempotent: quick and
# silent when everything is present.
#
# The list comes from the CMake configs the build reads, not from a machine that happened to
# have things installed:
#   - dnnl-config.cmake (libdnnl-dev) calls find_package(OpenCL REQUIRED) and links
#     OpenCL::OpenCL, but libdnnl-dev only *recommends* ocl-icd-opencl-dev (libOpenCL.so and,
#     through opencl-c-headers, CL/cl.h);
#   - clang's -fsanitize=fuzzer runtime (the CI fuzz stage) is in libclang-rt-dev, which clang
#     only recommends;
#   - absl, GTest and benchmark configs need Threads (libc), Eigen3 none, MPI the mpicxx wrapper
#     from libopenmpi-dev, OpenMP libgomp from g++;
#   - the check of the Kubernetes manifests (tests/deploy) installs its pinned validator from
#     PyPI into a virtual environment: python3-venv;
#   - the Python package on the C API (python/libfsdp, tests/python) needs numpy and nothing
#     else: python3-numpy; pkg-config builds the C API's consumer in the install test.
# We install with --no-install-recommends, so every recommended package we need is named here.
set -euo pipefail
pkgs=(cmake g++ make git clang libclang-rt-dev libdnnl-dev ocl-icd-opencl-dev libeigen3-dev
      libopenmpi-dev openmpi-bin libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
      python3-venv python3-numpy pkg-config)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#pkgs[@]} packages present"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_deps: done"
