#!/usr/bin/env bash
# Checks deploy/container/Dockerfile without building the image (a build installs packages and
# compiles the library: minutes, and it needs a Docker daemon): the image must be built the
# way the repository builds itself, i.e. on Debian 12 with scripts/install_deps.sh and
# scripts/run_example.sh's cmake configure and build commands, and must install train_gpt and
# the ssh the MPI Operator's launcher uses. hadolint lints it when installed.
#
# Usage: dockerfile_check.sh SOURCE_DIR
# shellcheck disable=SC2016  # check() evaluates its condition later, on purpose
set -euo pipefail
src=$1
dockerfile=$src/deploy/container/Dockerfile
failed=0
check() { if eval "$2"; then echo "  ok      $1"; else echo "  FAILED  $1"; failed=1; fi; }
# The Dockerfile's instructions with continuation lines joined and spaces squeezed.
joined=$(sed -e 's/[[:space:]]*\\$/ /' "$dockerfile" | tr -s ' ' | tr -d '\n')
# shellcheck disable=SC2317  # called from check()
has() { grep -qF -- "$1" <<<"$joined"; }

configure=$(grep -E '^cmake -S \. -B build ' "$src/scripts/run_example.sh" | tr -s ' ')
build=$(grep -E '^cmake --build build ' "$src/scripts/run_example.sh" | tr -s ' ')
check "scripts/run_example.sh has a cmake configure and build line" '[ -n "$configure" ] && [ -n "$build" ]'
check "FROM debian:12" 'grep -qE "^FROM debian:12( |$)" "$dockerfile"'
check "runs scripts/install_deps.sh" 'has "RUN scripts/install_deps.sh"'
check "configures as run_example.sh: $configure" 'has "$configure"'
check "builds as run_example.sh: $build" 'has "$build"'
check "installs train_gpt to /usr/local/bin" 'has "build/examples/train_gpt /usr/local/bin/train_gpt"'
check "installs openssh-server and openssh-client" 'has "openssh-server" && has "openssh-client"'
check "sshd for mpiuser on port 2222 (the manifests' sshAuthMountPath and sshd -f)" \
  'has "useradd -m -u 1000 mpiuser" && has "/home/mpiuser/.sshd_config" && has "SSH_PORT=2222"'
for m in "$src"/deploy/k8s/*.yaml; do
  check "$(basename "$m"): sshAuthMountPath /home/mpiuser/.ssh, runAsUser 1000" \
    'grep -q "sshAuthMountPath: /home/mpiuser/.ssh" "$m" && grep -q "runAsUser: 1000" "$m"'
done
check "the entrypoint it copies exists" '[ -x "$src/deploy/container/entrypoint.sh" ]'
if command -v hadolint >/dev/null; then
  hadolint "$dockerfile" && echo "  ok      hadolint" || failed=1
else
  echo "  note    hadolint is not installed: not run"
fi
if command -v shellcheck >/dev/null; then
  shellcheck "$src/deploy/container/entrypoint.sh" && echo "  ok      shellcheck entrypoint.sh" || failed=1
fi
echo "  note    the image is not built here (minutes of packages and compiling; docs/deploy.md)"
exit $failed
