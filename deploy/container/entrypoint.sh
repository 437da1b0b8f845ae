#!/usr/bin/env bash
# Entry point of the libfsdp image (deploy/container/Dockerfile): in the MPI Operator's
# launcher pod (K_MPI_JOB_ROLE=launcher) it first waits until this pod's and every worker's
# host name resolve (the workers' DNS records appear with their pods), as the operator's own
# images do; then it runs the command.
set -euo pipefail

resolve() {
  local host=$1 delay=0.1
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    if getent hosts "$host" >/dev/null; then return 0; fi
    echo "entrypoint: cannot resolve $host yet; retrying in ${delay}s"
    sleep "$delay"
    delay=$(awk -v d="$delay" 'BEGIN { print d * 2 }')
  done
  echo "entrypoint: could not resolve $host; starting anyway"
}

if [ "${K_MPI_JOB_ROLE:-}" = launcher ]; then
  resolve "$(hostname)"
  if [ -r /etc/mpi/hostfile ]; then
    while read -r host _; do
      [ -n "$host" ] && resolve "${host%%:*}"
    done </etc/mpi/hostfile
  fi
fi
exec "$@"
