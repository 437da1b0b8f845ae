#!/usr/bin/env bash
# train_gpt with HYBRID_SHARD and --hybrid_shard 0 (a shard group per host) on 2 hosts x 2 ranks
# (scripts/hosts/hosts.sh):
#   blocks:      ranks placed host by host (mpirun's --map-by slot): the start line shows the
#                mesh 2 x 2 and the job trains;
#   round_robin: ranks placed across the hosts in turn (--rank-by node: host 1 holds ranks 0
#                and 2): no host is a block of consecutive ranks, so the job must fail
#                with the error that shows the layout and says what to do, and exit non-zero.
#   secondary:   FULL_SHARD across the 4 ranks with --secondary_shard 2 (the ranks of a host):
#                the start line names the secondary shard and the job trains;
#   secondary_round_robin: the same placed across the hosts in turn: each pair of consecutive
#                ranks spans the two hosts, so the job must fail naming the option and the hosts.
# Exits 77 (ctest: skipped) with the reason when hosts cannot be made here.
#
# Usage: host_layout_test.sh HOSTS_SH TRAIN_GPT MODE
set -uo pipefail
hosts_sh=$1 program=$2 mode=$3
log=$(mktemp)
trap 'rm -f "$log"' EXIT
extra=()
case "$mode" in
  round_robin|secondary_round_robin) extra=(--mpirun-arg --rank-by --mpirun-arg node) ;;
esac
train=("$program" --strategy HYBRID_SHARD --hybrid_shard 0 --steps 5 --warmup 1 --batch 8 --seq 32
       --eval_every 0 --sample_tokens 0)
case "$mode" in
  secondary|secondary_round_robin)
    train=("$program" --strategy FULL_SHARD --secondary_shard 2 --steps 5 --warmup 1 --batch 8
           --seq 32 --eval_every 0 --sample_tokens 0) ;;
esac
timeout 120 bash "$hosts_sh" "${extra[@]}" run 2 2 -- "${train[@]}" >"$log" 2>&1
rc=$?
[ "$rc" -eq 77 ] && { grep -m1 "skipped" "$log"; exit 77; }
fail() { echo "host_layout_test $mode: $*"; echo "--- output:"; cat "$log"; exit 1; }
case "$mode" in
  blocks)
    [ "$rc" -eq 0 ] || fail "exit code $rc, want 0"
    grep -q "| mesh 2 x 2 (a shard group per host)" "$log" || fail "no 'mesh 2 x 2' on the start line"
    grep -q "^trained 5 steps" "$log" || fail "it did not train"
    ;;
  round_robin)
    [ "$rc" -ne 0 ] || fail "exit code 0, want non-zero"
    grep -q "the ranks of group 'world' run as host 0: ranks \[0, 2\]; host 1: ranks \[1, 3\]. Launch the ranks of a host one after another (mpirun --map-by slot) or set hybrid_shard_size" "$log" ||
      fail "the layout error is missing"
    ;;
  secondary)
    [ "$rc" -eq 0 ] || fail "exit code $rc, want 0"
    grep -q "| secondary shard over 2 ranks of a host (backward gathers inside it)" "$log" ||
      fail "no secondary shard on the start line"
    grep -q "^trained 5 steps" "$log" || fail "it did not train"
    ;;
  secondary_round_robin)
    [ "$rc" -ne 0 ] || fail "exit code 0, want non-zero"
    grep -q "secondary_shard_size is 2: the secondary group of ranks 0..1 (of a shard group of 4) spans hosts 0 and 1" "$log" ||
      fail "the secondary shard's layout error is missing"
    ;;
  *) echo "host_layout_test: unknown mode '$mode'"; exit 2 ;;
esac
echo "host_layout_test $mode: ok (exit code $rc)"
