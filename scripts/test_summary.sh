#!/usr/bin/env bash
# Counts test cases after a ctest run: GoogleTest's own totals where a test binary wrote its
# results (BUILD/test-results/<ctest name>.xml, see tests/CMakeLists.txt), one case for every
# other ctest entry (install_consumer, the mutation stage; an entry that skipped itself with
# its SKIP_RETURN_CODE is one skipped case). Prints each skipped case with its reason, then
# one closing line "LABEL: N passed, N failed, N skipped".
# Exits 1 if a case failed or no case ran at all.
#
# Usage: scripts/test_summary.sh BUILD_DIR LABEL CTEST_JUNIT_XML...   (one file per ctest run)
set -euo pipefail
build=$1
label=$2
shift 2
results="$build/test-results"
for junit in "$@"; do
  [ -f "$junit" ] || { echo "$label: no ctest results in $junit: ran no test"; exit 1; }
done

attr() {  # attr NAME LINE: the value of NAME="..." in LINE
  sed -n "s/.*[[:space:]]$1=\"\([^\"]*\)\".*/\1/p" <<<"$2"
}

passed=0 failed=0 skipped=0
while IFS= read -r line; do
  name=$(attr name "$line")
  status=$(attr status "$line")
  xml="$results/$name.xml"
  if [ -f "$xml" ]; then
    root=$(grep -m1 "<testsuites " "$xml")
    tests=$(attr tests "$root") fails=$(attr failures "$root") disabled=$(attr disabled "$root")
    errors=$(attr errors "$root")
    skips=$(grep -c 'result="skipped"' "$xml" || true)
    fails=$((fails + errors))
    if [ "$status" != run ] && [ "$fails" -eq 0 ]; then fails=1; fi  # e.g. another rank failed
    passed=$((passed + tests - disabled - skips - fails))
    failed=$((failed + fails))
    skipped=$((skipped + skips))
    # Skipped cases with the reason they printed, one line per reason.
    awk -v test="$name" '
      /<testcase / && /result="skipped"/ {
        match($0, / name="[^"]*"/); c = substr($0, RSTART + 7, RLENGTH - 8)
        match($0, / classname="[^"]*"/); c = substr($0, RSTART + 12, RLENGTH - 13) "." c
      }
      /<skipped message="/ {
        match($0, /message="[^"]*"/); m = substr($0, RSTART + 9, RLENGTH - 10)
        sub(/^[^&]*&#x0A;/, "", m); gsub(/&#x0A;/, " ", m)
        gsub(/&apos;/, "\047", m); gsub(/&quot;/, "\"", m); gsub(/&lt;/, "<", m); gsub(/&gt;/, ">", m); gsub(/&amp;/, "\\&", m)
        if (!(m in n)) { first[m] = c; order[++k] = m }
        n[m]++
      }
      END {
        for (i = 1; i <= k; i++) {
          m = order[i]
          printf "  %s: skipped %d case%s (%s%s): %s\n", test, n[m], (n[m] > 1 ? "s" : ""),
                 first[m], (n[m] > 1 ? ", ..." : ""), m
        }
      }' "$xml"
  elif [ "$status" = run ]; then
    passed=$((passed + 1))
  elif [ "$status" = disabled ]; then
    :
  elif [ "$status" = notrun ] && grep -A1 -F "<testcase name=\"$name\" " "$@" |
                                 grep -q '<skipped message="SKIP_'; then
    # A ctest entry that skipped itself (SKIP_RETURN_CODE): the reason is the line of its
    # output that starts with "skipped:".
    skipped=$((skipped + 1))
    reason=$(awk -v test="$name" '
      index($0, "<testcase name=\"" test "\" ") { inside = 1 }
      inside && /<\/testcase>/ { inside = 0 }
      inside && /skipped: / { sub(/^.*skipped: /, ""); print; exit }' "$@")
    echo "  $name: skipped: ${reason:-no reason printed}"
  else
    failed=$((failed + 1))
  fi
done < <(cat "$@" | grep "<testcase ")

echo "$label: $passed passed, $failed failed, $skipped skipped"
if [ $((passed + failed)) -eq 0 ]; then
  echo "$label: ran no test"
  exit 1
fi
[ "$failed" -eq 0 ]
