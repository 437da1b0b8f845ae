#!/usr/bin/env bash
# Runs a GoogleTest binary with a main() from tests/mpi_test_main.h across "hosts" made by
# scripts/hosts/hosts.sh: N hosts of RANKS_PER_HOST ranks. Exits 77 (ctest: skipped) with the
# reason when hosts cannot be made here, e.g. without CAP_NET_ADMIN.
#
# Usage: gtest_on_hosts.sh HOSTS_SH RESULTS_XML N RANKS_PER_HOST [HOSTS_OPTION VALUE]...
#                          BINARY [ARGS...]
# (HOSTS_OPTION: an option of hosts.sh with its value, e.g. --rate 200mbit.)
set -uo pipefail
hosts_sh=$1 xml=$2 n=$3 per=$4
shift 4
opts=()
while [[ "${1:-}" == --* ]]; do opts+=("$1" "$2"); shift 2; done
rm -f "$xml"  # a results file of an earlier run must not count as this run's
echo "command: $hosts_sh ${opts[*]} run $n $per -- $* --gtest_output=xml:$xml"
"$hosts_sh" "${opts[@]}" run "$n" "$per" -- "$@" "--gtest_output=xml:$xml"
rc=$?
[ $rc != 77 ] || echo "skipped: hosts.sh could not make network-namespace hosts (the line above says why)"
exit $rc
