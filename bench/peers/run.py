#!/usr/bin/env python3
"""libfsdp's train_gpt next to PyTorch FSDP2 on the same model, data, shapes and ranks.

Sets up PyTorch from the Python package index in a virtual environment under the build
directory (BUILD/peers/venv; optional, never a dependency of the library or of CI), then runs
train_gpt and bench/peers/fsdp2_gpt.py interleaved, `--reps` rounds of every (implementation,
dtype), and prints the median step time and tokens/s of each with the ratios. Only the
standard library is used here, so any python3 runs it.

    python3 bench/peers/run.py --build build            # mini, B=8, T=256, 2 ranks x 1 thread

Step times: train_gpt's progress lines (--log_every 1) give the cumulative tokens/s after
each step, hence each step's end time; fsdp2_gpt.py times each step itself. Both take the
median over the steps after the warm-up, and the table shows the median over the rounds.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def setup_venv(build, torch_version):
    venv = os.path.join(build, "peers", "venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"peers: creating {venv} (PyTorch {torch_version} from the package index)",
              flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    probe = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.startswith(torch_version):
        subprocess.run([python, "-m", "pip", "install", "-q", f"torch=={torch_version}",
                        "numpy"], check=True)
    return python


def run_train_gpt(args, dtype):
    exe = os.path.join(args.build, "examples", "train_gpt")
    total = args.warmup + args.steps
    cmd = [exe, "--config", args.config, "--batch", str(args.batch), "--seq", str(args.seq),
           "--ranks", str(args.ranks), "--threads", str(args.threads), "--param_dtype", dtype,
           "--steps", str(total), "--log_every", "1", "--eval_every", "0",
           "--sample_tokens", "0", "--warmup", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"peers: {' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    tokens = args.batch * args.seq
    ends = {}  # step -> seconds since the start, from the cumulative tokens/s
    loss = float("nan")
    for line in out.stdout.splitlines():
        m = re.match(r"step\s+(\d+)/\d+ \| loss ([\d.]+) .*\|\s+(\d+) tok/s", line)
        if m:
            step, loss, rate = int(m.group(1)), float(m.group(2)), float(m.group(3))
            ends[step] = step * tokens / rate
    steps = [ends[s] - ends[s - 1] for s in range(args.warmup + 1, total + 1)
             if s in ends and s - 1 in ends]
    if len(steps) < args.steps:
        sys.exit(f"peers: expected {args.steps} timed steps from train_gpt, got {len(steps)}")
    step_s = statistics.median(steps)
    return {"impl": "libfsdp", "dtype": dtype, "step_ms": step_s * 1e3,
            "tok_s": tokens / step_s, "loss": loss}


def run_fsdp2(args, python, dtype):
    cmd = [python, os.path.join(HERE, "fsdp2_gpt.py"), "--config", args.config,
           "--batch", str(args.batch), "--seq", str(args.seq), "--ranks", str(args.ranks),
           "--threads", str(args.threads), "--dtype", dtype, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--corpus", os.path.join(ROOT, "data", "corpus.txt")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"peers: {' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"impl": "pytorch-fsdp2", "dtype": dtype, "step_ms": r["step_ms"],
            "tok_s": r["tok_s"], "loss": r["loss"], "torch": r["torch"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="the CMake build directory (train_gpt, and the venv under peers/)")
    ap.add_argument("--config", default="mini", choices=["nano", "mini", "gpt2"])
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    ap.add_argument("--reps", type=int, default=3, help="rounds of every run, interleaved")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--torch", default="2.15.0", help="the PyTorch version to install")
    ap.add_argument("--json", help="also write every run as a JSON line to this file")
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    dtypes = args.dtypes.split(",")
    python = setup_venv(args.build, args.torch)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.*)", lscpu)
    flags = re.search(r"Flags:\s*(.*)", lscpu)
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
           if flags and f in flags.group(1).split()]
    print(f"peers: {model.group(1) if model else 'cpu'}, {os.cpu_count()} cpus, "
          f"{' '.join(isa) or 'no avx512'}; {args.config}, B={args.batch} global, T={args.seq}, "
          f"{args.ranks} ranks x {args.threads} thread(s); median of {args.steps} steps after "
          f"{args.warmup}, median of {args.reps} interleaved rounds", flush=True)
    results = {}
    log = open(args.json, "w") if args.json else None
    for rep in range(args.reps):
        for dtype in dtypes:
            for impl in ("libfsdp", "pytorch-fsdp2"):
                t0 = time.time()
                r = run_train_gpt(args, dtype) if impl == "libfsdp" else run_fsdp2(args, python,
                                                                                   dtype)
                r["round"] = rep
                results.setdefault((impl, dtype), []).append(r)
                print(f"  round {rep + 1}/{args.reps}: {impl:14s} {dtype:5s} "
                      f"{r['step_ms']:8.1f} ms/step  ({time.time() - t0:.0f} s)", flush=True)
                if log:
                    log.write(json.dumps(r) + "\n")
    med = {k: statistics.median(x["step_ms"] for x in v) for k, v in results.items()}
    tokens = args.batch * args.seq
    print(f"\n| run ({args.config}, B={args.batch} global, T={args.seq}, {args.ranks} ranks x "
          f"{args.threads} thread) | step | tokens/s |")
    print("|---|---|---|")
    names = {"libfsdp": "libfsdp FULL_SHARD (`train_gpt`)",
             "pytorch-fsdp2": f"PyTorch {results.get(('pytorch-fsdp2', dtypes[0]), [{}])[0].get('torch', '')} FSDP2 (`fully_shard` per block, gloo)"}
    for dtype in dtypes:
        for impl in ("libfsdp", "pytorch-fsdp2"):
            ms = med[(impl, dtype)]
            print(f"| {names[impl]}, {dtype} | {ms:.0f} ms | {tokens / ms * 1e3:,.0f} |")
    print()
    for dtype in dtypes:
        print(f"libfsdp / FSDP2 tokens/s, {dtype}: "
              f"{med[('pytorch-fsdp2', dtype)] / med[('libfsdp', dtype)]:.2f}x")
    for impl in ("libfsdp", "pytorch-fsdp2"):
        if "f32" in dtypes and "bf16" in dtypes:
            print(f"{impl} bf16 / f32 step speed-up: "
                  f"{med[(impl, 'f32')] / med[(impl, 'bf16')]:.2f}x")


if __name__ == "__main__":
    main()
