"""Runs README.md's Python example (the block after "<!-- file: example.py -->") as it stands
there and checks that its loss fell. Exit 77 (skipped) without numpy.

    run_readme_example.py README.md
"""
import re
import subprocess
import sys


def main():
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("skipped: python3-numpy is not installed")
        return 77
    text = open(sys.argv[1], encoding="utf-8").read()
    m = re.search(r"<!-- file: example\.py -->\s*```python\n(.*?)\n```", text, re.S)
    if m is None:
        print("README.md has no block marked <!-- file: example.py -->")
        return 1
    run = subprocess.run([sys.executable, "-c", m.group(1)], capture_output=True, text=True)
    sys.stdout.write(run.stdout + run.stderr)
    if run.returncode != 0:
        print("README.md's Python example failed (exit %d)" % run.returncode)
        return 1
    loss = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", run.stdout)
    if loss is None or not float(loss.group(2)) < float(loss.group(1)):
        print("README.md's Python example printed no falling 'loss A -> B'")
        return 1
    print("README.md's Python example ran; loss %s -> %s" % loss.groups())
    return 0


if __name__ == "__main__":
    sys.exit(main())
