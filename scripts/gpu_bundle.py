#!/usr/bin/env python3
"""Packs the GPU check into one file, and runs it on a machine that cannot build the project.

A GPU machine lent for a short check may have CUDA but not the Debian packages the build
needs (Abseil, oneDNN, GoogleTest), and nothing to fetch them from. So the `gpu` tests and
train_gpt are built here, on a machine that has them, and carried there:

  scripts/gpu_bundle.py pack BUILD_DIR OUT.tar.xz   # here: binaries of the `gpu` entries,
                                                    # train_gpt, their libraries, the entries
  scripts/gpu_bundle.py run BUNDLE.tar.xz [WORKDIR] # there: every `gpu` entry as CTest would
                                                    # run it, then exits 1 if one failed
On a short lease, GPU_BUNDLE_TIMEOUT (seconds) caps each entry's CTest timeout, and
GPU_BUNDLE_LOGS names a folder that gets each entry's whole output (ENTRY.log).

BUILD_DIR must be a CUDA build (its CUDA architectures must include the GPU's: the default
80-real;90 covers A100, H100 and H200). The entries come from `ctest -L gpu --show-only=json-v1`,
so the bundle runs what CTest registers, nothing written twice. Libraries of the CUDA toolkit
(cudart, cuBLASLt) and NCCL are not packed: they are large and the GPU machine has its own
(found under /usr/local/cuda, the CUDA_HOME / LD_LIBRARY_PATH given, or the nvidia-* Python
packages). The C library and the dynamic loader are not packed either; everything else the
binaries load (libstdc++, libgomp, oneDNN, Abseil, Open MPI's) is.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

SYSTEM = re.compile(r"^(libc|libm|libdl|libpthread|librt|ld-linux.*|libcuda|libnvidia.*|"
                    r"libcudart|libcublas|libcublasLt|libnccl)\.so")


def ctest_entries(build):
    out = subprocess.run(["ctest", "--test-dir", build, "-L", "gpu", "--show-only=json-v1"],
                         check=True, capture_output=True, text=True).stdout
    entries = []
    for t in json.loads(out)["tests"]:
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        entries.append({"name": t["name"], "command": t["command"],
                        "env": props.get("ENVIRONMENT", []),
                        "timeout": props.get("TIMEOUT", 600)})
    return entries


def libraries(binary):
    libs = []
    for line in subprocess.run(["ldd", binary], check=True, capture_output=True,
                               text=True).stdout.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m and os.path.isfile(m.group(2)) and not SYSTEM.match(m.group(1)):
            libs.append((m.group(1), m.group(2)))
    return libs


def pack(build, out):
    build = os.path.abspath(build)
    entries = ctest_entries(build)
    if not entries:
        sys.exit(f"gpu_bundle: no `gpu` entries in {build}: is it a build with CUDA?")
    binaries = {}
    for e in entries:
        for arg in e["command"]:
            if arg.startswith(build) and os.path.isfile(arg) and os.access(arg, os.X_OK):
                binaries[arg] = os.path.basename(arg)
    binaries[os.path.join(build, "examples", "train_gpt")] = "train_gpt"
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "gpu_bundle")
        os.makedirs(os.path.join(root, "bin"))
        os.makedirs(os.path.join(root, "lib"))
        libs = {}
        for src, name in binaries.items():
            if not os.path.isfile(src):
                sys.exit(f"gpu_bundle: {src} is not built (cmake --build {build})")
            subprocess.run(["strip", "-o", os.path.join(root, "bin", name), src], check=True)
            for soname, path in libraries(src):
                libs[soname] = path
        for soname, path in libs.items():
            shutil.copy(path, os.path.join(root, "lib", soname))
        for e in entries:  # paths relative to the bundle
            e["command"] = ["{bin}/" + binaries[a] if a in binaries else
                            a.replace(os.path.join(build, "test-results"), "{results}")
                            for a in e["command"]]
        with open(os.path.join(root, "entries.json"), "w") as f:
            json.dump(entries, f, indent=1)
        with tarfile.open(out, "w:xz") as tar:
            tar.add(root, arcname="gpu_bundle")
    size = os.path.getsize(out) / 2**20
    print(f"gpu_bundle: {out}: {len(entries)} gpu entries, {len(binaries)} binaries, "
          f"{len(libs)} libraries, {size:.1f} MiB")


def cuda_library_dirs():
    dirs = []
    for var in ("LD_LIBRARY_PATH",):
        dirs += [d for d in os.environ.get(var, "").split(":") if d]
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    dirs += [os.path.join(home, "lib64"), os.path.join(home, "lib")]
    try:  # the nvidia-* wheels (PyTorch's CUDA libraries)
        import importlib.util
        spec = importlib.util.find_spec("nvidia")
        for base in (spec.submodule_search_locations or []) if spec else []:
            for sub in sorted(os.listdir(base)):
                if os.path.isdir(os.path.join(base, sub, "lib")):
                    dirs.append(os.path.join(base, sub, "lib"))
    except Exception:  # noqa: BLE001 - no wheels is fine
        pass
    return [d for d in dirs if os.path.isdir(d)]


def run(bundle, workdir):
    os.makedirs(workdir, exist_ok=True)
    with tarfile.open(bundle) as tar:
        tar.extractall(workdir)
    root = os.path.join(workdir, "gpu_bundle")
    results = os.path.join(workdir, "test-results")
    os.makedirs(results, exist_ok=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join([os.path.join(root, "lib")] + cuda_library_dirs())
    with open(os.path.join(root, "entries.json")) as f:
        entries = json.load(f)
    cap = int(os.environ.get("GPU_BUNDLE_TIMEOUT", "0") or 0)
    logs = os.environ.get("GPU_BUNDLE_LOGS", "")
    if logs:
        os.makedirs(logs, exist_ok=True)
    failed = []
    for e in entries:
        timeout = min(e["timeout"], cap) if cap > 0 else e["timeout"]
        cmd = [a.replace("{bin}", os.path.join(root, "bin")).replace("{results}", results)
               for a in e["command"]]
        run_env = dict(env)
        run_env.update(kv.split("=", 1) for kv in e["env"])
        start = time.time()
        try:
            p = subprocess.run(cmd, env=run_env, cwd=workdir, timeout=timeout,
                               capture_output=True, text=True)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as t:
            partial = t.stdout.decode(errors="replace") if isinstance(t.stdout, bytes) else t.stdout
            rc, out = -1, f"timed out after {timeout} s\n{partial or ''}"
        if logs:
            with open(os.path.join(logs, e["name"] + ".log"), "w") as f:
                f.write(out)
        verdict = "Passed" if rc == 0 else "Skipped" if rc == 77 else "FAILED"
        print(f"{e['name']:32s} {verdict} ({rc}) {time.time() - start:.1f} s", flush=True)
        if rc not in (0, 77):
            failed.append(e["name"])
            print("\n".join(out.splitlines()[-60:]), flush=True)
        elif rc == 77:
            print("  " + out.strip().splitlines()[-1] if out.strip() else "", flush=True)
    print(f"gpu_bundle: {len(entries) - len(failed)} of {len(entries)} gpu entries passed or "
          f"skipped; failed: {failed or 'none'}")
    return 1 if failed else 0


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "pack":
        pack(sys.argv[2], sys.argv[3])
        return 0
    if len(sys.argv) in (3, 4) and sys.argv[1] == "run":
        return run(sys.argv[2], sys.argv[3] if len(sys.argv) == 4 else "gpu_bundle_run")
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
