#!/usr/bin/env bash
# A host fails while train_gpt trains across 2 hosts of 2 ranks (scripts/hosts/hosts.sh),
# with FSDP_COMM_TIMEOUT_S=5. After step 3, host 2 (ranks 2 and 3):
#   freeze: stops answering: every process on it (its ranks and its orted) gets SIGSTOP.
#           Ranks 0 and 1 must each report the deadline error naming ranks 2 and 3 and exit
#           within the deadline + 10 s. mpirun cannot end what it cannot reach, so the host is
#           then fenced (SIGKILL, as a cluster manager would) and the job must end non-zero
#           within 10 s;
#   cut:    its link goes down (the processes keep running): the same checks; the fence
#           kills its processes and brings the link back;
#   kill:   every process on it dies (SIGKILL): Open MPI sees its daemon and peers vanish and
#           the job must end non-zero within 10 s (before any deadline).
# Exits 77 (ctest: skipped) with the reason when hosts cannot be made here.
#
# Usage: host_failure_test.sh HOSTS_SH TRAIN_GPT MODE
set -uo pipefail
hosts_sh=$1 program=$2 mode=$3
dir=$(mktemp -d)
job=""
cleanup() {
  # hosts.sh removes the hosts and whatever still runs on them when it ends.
  [ -z "$job" ] || { kill -TERM "$job" 2>/dev/null; wait "$job" 2>/dev/null; }
  rm -rf "$dir"
}
trap cleanup EXIT
log=$dir/out.txt
: >"$log"
export FSDP_COMM_TIMEOUT_S=5
train=("$program" --steps 1000000 --log_every 1 --eval_every 0 --sample_tokens 0 --batch 4
       --seq 32)
echo "command: FSDP_COMM_TIMEOUT_S=5 $hosts_sh run 2 2 -- ${train[*]}"
# Each rank writes the name of the hosts, so that this script finds their namespaces.
"$hosts_sh" run 2 2 -- sh -c 'echo "$FSDP_HOSTS_NAME" >"$0/name"; exec "$@"' "$dir" \
  "${train[@]}" >"$log" 2>&1 &
job=$!
for _ in $(seq 240); do
  grep -q "^step     3/" "$log" && break
  kill -0 $job 2>/dev/null || break
  sleep 0.25
done
if ! kill -0 $job 2>/dev/null; then
  wait $job
  rc=$?
  if [ $rc = 77 ]; then
    grep "skipped:" "$log"; job=""; exit 77
  fi
fi
if ! grep -q "^step     3/" "$log" || [ ! -s "$dir/name" ]; then
  echo "FAILED: the job did not start training"; cat "$log"; exit 1
fi
name=$(head -1 "$dir/name")
host2=${name}h2
host1=${name}h1
ranks_on() {  # the train_gpt processes in a host's namespace
  local p
  for p in $(ip netns pids "$1" 2>/dev/null); do
    [ "$(cat /proc/"$p"/comm 2>/dev/null)" = "$(basename "$program" | cut -c1-15)" ] && echo "$p"
  done
}
case "$mode" in
  freeze) for p in $(ip netns pids "$host2"); do kill -STOP "$p"; done ;;
  cut) ip link set "${name}v2" down ;;
  kill) for p in $(ip netns pids "$host2"); do kill -KILL "$p"; done ;;
  *) echo "unknown mode '$mode'"; exit 2 ;;
esac
failed_at=$(date +%s%N)
ms_since() { echo $(( ($(date +%s%N) - failed_at) / 1000000 )); }
echo "$mode: host 2 ($host2: ranks 2, 3) after step 3"
failed=0
check() { if eval "$2"; then echo "  ok      $1"; else echo "  FAILED  $1"; failed=1; fi; }

if [ "$mode" != kill ]; then
  # The survivors: both report the deadline error, and both processes end.
  for _ in $(seq 60); do
    [ -z "$(ranks_on "$host1")" ] && break
    sleep 0.25
  done
  survivors_ms=$(ms_since)
  echo "ranks 0 and 1 ended ${survivors_ms} ms after the failure"
  check "ranks 0 and 1 ended within the deadline (5 s) + 10 s" '[ -z "$(ranks_on "$host1")" ]'
  check "rank 0 printed the deadline error" 'grep -q "train_gpt: \[rank 0\] DEADLINE_EXCEEDED" "$log"'
  check "rank 1 printed the deadline error" 'grep -q "train_gpt: \[rank 1\] DEADLINE_EXCEEDED" "$log"'
  # Failed before host 2 posted the collective, its ranks "did not arrive"; in the middle of
  # the transfer, "every rank arrived, but the transfer did not complete".
  check "it says what host 2's ranks did not do" \
    'grep -qE "ranks \[2, 3\] did not arrive|did not complete" "$log"'
  # Fence the failed host: mpirun waits for its daemon, which cannot answer. Once its
  # processes are gone, a link that comes back answers mpirun's retries with a reset.
  for p in $(ip netns pids "$host2"); do kill -KILL "$p" 2>/dev/null; done
  [ "$mode" != cut ] || ip link set "${name}v2" up
  fenced_at=$(date +%s%N)
fi
for _ in $(seq 40); do kill -0 $job 2>/dev/null || break; sleep 0.25; done
if kill -0 $job 2>/dev/null; then
  echo "  FAILED  the job still runs 10 s after host 2 was $([ "$mode" = kill ] && echo killed || echo fenced)"
  tail -5 "$log"; exit 1
fi
wait $job
rc=$?
job=""
end_ms=$(ms_since)
if [ "$mode" = kill ]; then
  echo "the job exited with $rc, ${end_ms} ms after host 2 was killed"
  check "within 10 s" '[ "$end_ms" -lt 10000 ]'
else
  echo "the job exited with $rc, $(( ($(date +%s%N) - fenced_at) / 1000000 )) ms after host 2 was fenced (${end_ms} ms after the failure)"
fi
check "non-zero exit code" '[ "$rc" -ne 0 ]'
[ $failed = 0 ] || { echo "---- output ----"; grep -v "^step" "$log" | tail -40; }
exit $failed
