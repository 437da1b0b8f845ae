#!/usr/bin/env bash
# Mutation testing: each tests/mutants/NN-name.patch plants one small bug (a sum where a mean
# belongs, an off-by-one range, an order swapped, the ZeRO saving lost, the overlap lost, a
# dtype mixed up, a wait dropped...) in the runtime, the collectives, the optimizer, the
# checkpoint code or the kernels. For each, this script applies the patch to SRC, rebuilds
# only the target the patch names in BUILD (an existing build of SRC with the tests), runs the
# test command the patch names, and reverts the patch. The mutant is killed when that command
# fails. Any surviving mutant, a patch that no longer applies or compiles, or a test command
# that fails without its mutant (checked first) fails the run.
#
# A patch starts with four header lines, then a unified diff (git apply ignores the header):
#   Mutant: what the bug is
#   Kind: scale | range | ordering | memory | overlap | dtype | wait | kernel | checkpoint | comm |
#         agreement | accumulation | runtime | abi
#   Build: the CMake target to rebuild
#   Run: the command to run in BUILD (a test binary and its --gtest_filter)
#
# SRC must be a scratch git checkout with a clean working tree (CI uses its fresh clone):
# patches are applied to it in place.
# Usage: tests/mutants/run.sh SRC BUILD
# With MUTANTS_SUITE_PASSED=1 (CI, right after the whole suite passed on this BUILD) the check
# that each test command passes without its mutant is left out: the suite was that check.
set -uo pipefail
src=$(cd "$1" && pwd) build=$(cd "$2" && pwd)
if [ -n "$(git -C "$src" status --porcelain --untracked-files=no)" ]; then
  echo "mutants: $src has uncommitted changes; run this on a scratch checkout"
  exit 2
fi
patches=("$src"/tests/mutants/*.patch)
field() { sed -n "s/^$1: //p" "$2" | head -1; }
start=$(date +%s)
errors=0

# The test commands must pass on the code as it is, or a "kill" would mean nothing.
declare -A seen
[ "${MUTANTS_SUITE_PASSED:-0}" = 1 ] && patches_checked=() || patches_checked=("${patches[@]}")
for p in "${patches_checked[@]}"; do
  target=$(field Build "$p") run=$(field Run "$p")
  [ -n "${seen[$run]:-}" ] && continue
  seen[$run]=1
  cmake --build "$build" --target "$target" -j"$(nproc)" >/dev/null 2>&1 ||
    { echo "mutants: cannot build $target"; exit 1; }
  if ! (cd "$build" && timeout 600 $run >"$build/mutant.log" 2>&1); then
    echo "mutants: '$run' fails without any mutant; the end of its output:"
    grep -v -e '^\[ *OK *\]' -e '^\[ RUN' "$build/mutant.log" | tail -40 | sed 's/^/    /'
    errors=$((errors + 1))
  fi
done
[ $errors -eq 0 ] || { echo "mutants: ${errors} test command(s) fail on the unmutated code"; exit 1; }
if [ "${MUTANTS_SUITE_PASSED:-0}" = 1 ]; then
  echo "mutants: the whole suite passed on this build just before (MUTANTS_SUITE_PASSED=1)"
else
  echo "mutants: ${#seen[@]} test commands pass on the unmutated code ($(( $(date +%s) - start )) s)"
fi

killed=0 total=0 survivors=()
for p in "${patches[@]}"; do
  name=$(basename "$p" .patch)
  desc=$(field Mutant "$p") kind=$(field Kind "$p") target=$(field Build "$p") run=$(field Run "$p")
  total=$((total + 1))
  t0=$(date +%s)
  if ! git -C "$src" apply "$p" 2>/dev/null; then
    echo "  ERROR     $name: the patch no longer applies; update it to the current code"
    errors=$((errors + 1))
    continue
  fi
  if ! cmake --build "$build" --target "$target" -j"$(nproc)" >"$build/mutant.log" 2>&1; then
    echo "  ERROR     $name: does not compile; update the patch"
    errors=$((errors + 1))
  else
    (cd "$build" && timeout 600 $run >"$build/mutant.log" 2>&1)
    rc=$?
    if [ $rc -ne 0 ]; then
      killed=$((killed + 1))
      echo "  killed    $name [$kind] ($(( $(date +%s) - t0 )) s, exit $rc): $desc"
    else
      survivors+=("$name")
      echo "  SURVIVED  $name [$kind]: $desc (ran: $run)"
    fi
  fi
  git -C "$src" apply -R "$p" || { echo "mutants: cannot revert $name"; exit 1; }
done
echo "mutants: ${killed}/${total} killed in $(( $(date +%s) - start )) s"
# One line in the closing format, a mutant per case: killed passes, a survivor fails.
echo "mutants: ${killed} passed, $(( ${#survivors[@]} + errors )) failed, 0 skipped"
[ ${#survivors[@]} -eq 0 ] && [ $errors -eq 0 ]
