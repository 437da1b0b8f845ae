#!/usr/bin/env bash
# Runs mpi_abort_test under mpirun in one mode and checks how the job ends:
#   ok:   exit 0, both ranks finished;
#   stop: rank 1 stops itself (SIGSTOP); rank 0 reports the deadline error naming the missing
#         rank and aborts: the job exits non-zero within the 3 s deadline + 10 s;
#   exit: rank 1 exits without MPI_Finalize; the job exits non-zero as quickly.
# Usage: mpi_abort_check.sh MPIEXEC BINARY MODE
set -u
mpiexec=$1 bin=$2 mode=$3
out=$(mktemp)
start=$(date +%s%N)
timeout -s KILL 60 "$mpiexec" -np 2 --oversubscribe --allow-run-as-root --mca btl self,vader \
  "$bin" "$mode" >"$out" 2>&1
rc=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
# Never leave a stopped rank behind, whatever happened.
pkill -CONT -f "^$bin " 2>/dev/null; pkill -KILL -f "^$bin " 2>/dev/null
echo "--- mpirun output (exit code $rc, ${elapsed_ms} ms) ---"
cat "$out"
echo "---"
fail() { echo "mpi_abort_check $mode: FAILED: $*"; rm -f "$out"; exit 1; }
case "$mode" in
  ok)
    [ "$rc" -eq 0 ] || fail "exit code $rc, expected 0"
    [ "$(grep -c 'both collectives done' "$out")" -eq 2 ] || fail "not both ranks finished"
    ;;
  stop|exit)
    [ "$rc" -ne 0 ] || fail "the job exited 0 after a failed collective"
    [ "$rc" -ne 137 ] || fail "the job hung until the test's 60 s limit killed it"
    [ "$elapsed_ms" -lt 13000 ] || fail "took ${elapsed_ms} ms, more than the deadline (3 s) + 10 s"
    if [ "$mode" = stop ]; then
      grep -q "mpi_abort_test: \[rank 0\] DEADLINE_EXCEEDED" "$out" ||
        fail "rank 0 did not print its deadline error"
      grep -q "ranks \[1\] did not arrive" "$out" || fail "the error does not name rank 1"
    fi
    ;;
  *) fail "unknown mode" ;;
esac
echo "mpi_abort_check $mode: passed (exit code $rc after ${elapsed_ms} ms)"
rm -f "$out"
