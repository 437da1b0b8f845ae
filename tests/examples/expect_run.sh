#!/usr/bin/env bash
# Runs a program once and checks its exit code and output (stdout and stderr together).
#
# Usage: expect_run.sh PROGRAM EXIT_CODE [CHECK ...] -- [ARG ...]
#   --contains TEXT   the output must contain TEXT (a fixed string)
#   --absent TEXT     the output must not contain TEXT
#   --memory_kb N     run under `ulimit -v N` (a program that reads without limit then fails
#                     quickly instead of taking the machine's memory)
#   --timeout S       kill the program after S seconds (default 240)
#   --env NAME=VALUE  run the program with this environment variable
# Prints the command, each check with ok / FAILED, and the output when a check failed.
set -uo pipefail
program=$1 want_rc=$2
shift 2
contains=() absent=() envs=() memory_kb="" limit=240
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    --contains) contains+=("$2"); shift 2 ;;
    --absent) absent+=("$2"); shift 2 ;;
    --memory_kb) memory_kb=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    *) echo "expect_run.sh: unknown option $1"; exit 2 ;;
  esac
done
[ "${1:-}" = "--" ] && shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "command: ${envs[*]+${envs[*]} }$program $*"
(
  [ -n "$memory_kb" ] && ulimit -v "$memory_kb"
  exec env "${envs[@]+"${envs[@]}"}" timeout -k 5 "$limit" "$program" "$@"
) >"$out" 2>&1
rc=$?
failed=0
check() {  # check OK DESCRIPTION
  if [ "$1" = 1 ]; then echo "  ok      $2"; else echo "  FAILED  $2"; failed=1; fi
}
check "$([ "$rc" = "$want_rc" ] && echo 1)" "exit code $rc, expected $want_rc"
for t in "${contains[@]+"${contains[@]}"}"; do
  check "$(grep -qF -- "$t" "$out" && echo 1)" "output contains: $t"
done
for t in "${absent[@]+"${absent[@]}"}"; do
  check "$(grep -qF -- "$t" "$out" || echo 1)" "output does not contain: $t"
done
if [ $failed != 0 ]; then
  echo "---- output (last 60 lines) ----"
  tail -n 60 "$out"
  exit 1
fi
echo "---- output (last 5 lines) ----"
tail -n 5 "$out"
