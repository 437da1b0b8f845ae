#!/usr/bin/env bash
# Validates the Kubernetes manifests of deploy/k8s/ (validate_manifests.py) and checks that
# every wrong-on-purpose manifest of tests/deploy/bad/ is rejected. The validator comes from
# PyPI, pinned with hashes (requirements.txt), in a virtual environment made once in VENV and
# reused while requirements.txt stays the same. Exits 77 (a skip, saying why) when python3 with
# venv is missing or the package index cannot be reached; a hash mismatch is a failure.
#
# Usage: k8s_manifests_test.sh SOURCE_DIR VENV
set -euo pipefail
src=$1 venv=$2
here=$src/tests/deploy
req=$here/requirements.txt

skip() { echo "skipped: $*"; exit 77; }

command -v python3 >/dev/null || skip "python3 is not installed (the validator is a Python package)"
python3 -c 'import venv, ensurepip' 2>/dev/null ||
  skip "python3 has no venv/ensurepip module (Debian: apt-get install python3-venv)"

# requirements.txt has wheels for these only (PyYAML and rpds-py are compiled).
platform=$(python3 -c 'import platform, sys; print("%d.%d %s" % (sys.version_info[:2] + (platform.machine(),)))')
case "$platform" in
  "3.11 "* | "3.12 "* | "3.13 "*) ;;
  *) skip "the pinned wheels are for CPython 3.11 to 3.13 on x86_64 or aarch64 Linux, not Python $platform" ;;
esac
case "$platform" in
  *" x86_64" | *" aarch64") ;;
  *) skip "the pinned wheels are for CPython 3.11 to 3.13 on x86_64 or aarch64 Linux, not Python $platform" ;;
esac

stamp=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.requirements-sha256" 2>/dev/null)" != "$stamp" ]; then
  index=${PIP_INDEX_URL:-https://pypi.org/simple}
  probe='
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/kubernetes-validate/", timeout=15).read(1)
except Exception as e:
    sys.exit(str(e))'
  why=$(python3 -c "$probe" "$index" 2>&1) ||
    skip "cannot reach the package index $index to install the validator ($why)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
       --require-hashes --only-binary :all: -r "$req"; then
    rm -rf "$venv"
    echo "FAILED: pip could not install the pinned validator (see above): a changed or missing wheel"
    exit 1
  fi
  echo "$stamp" >"$venv/.requirements-sha256"
  echo "made $venv"
fi
"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
  awk '$1 == "kubernetes-validate" || $1 == "jsonschema" { printf "%s %s\n", $1, $2 }'

failed=0
echo "-- deploy/k8s: every manifest must be valid"
"$venv/bin/python" -B "$here/validate_manifests.py" --project "$src"/deploy/k8s/*.yaml || failed=1
echo "-- tests/deploy/bad: every manifest must be rejected"
"$venv/bin/python" -B "$here/validate_manifests.py" --project --expect-invalid "$here"/bad/*.yaml ||
  failed=1
good=("$src"/deploy/k8s/*.yaml) bad=("$here"/bad/*.yaml)
[ $failed = 0 ] && echo "ok: ${#good[@]} manifests valid, ${#bad[@]} wrong ones rejected"
exit $failed
