#!/usr/bin/env python3
"""The Python package over the C API (python/libfsdp) beyond training: errors (closed, stale and
foreign handles, hooks out of order, failing init callbacks and ranks, settings that differ
between ranks), the ctypes structs against the header's layout, views on host, device and bf16
runtimes, checkpoints and safetensors round trips, the bundled models, and the planner (its
functions and `python3 -m libfsdp.plan`).

    test_api.py

Environment: PYTHONPATH=<source>/python, FSDP_LIBRARY=<build>/src/capi/libfsdp.so.
Exit status: 0 passed, 1 failed, 77 skipped (numpy is missing).
"""

import ctypes
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

try:
    import numpy as np
except ImportError:
    print("skipped: python3-numpy is not installed")
    sys.exit(77)

import libfsdp
from libfsdp import Code, FsdpError, _capi

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def raises(code, needle, fn, *args, **kwargs):
    """Calls fn, which must raise FsdpError with `code` and `needle` in its message."""
    try:
        fn(*args, **kwargs)
    except FsdpError as e:
        check(e.code == code, "expected %s, got %s" % (code.name, e))
        check(needle is None or needle in e.message,
              "expected %r in the message: %s" % (needle, e))
        return e
    raise Failure("expected FsdpError %s%s, but the call succeeded"
                  % (code.name, " (%s)" % needle if needle else ""))


def iota_init(unit, param, begin, end):
    return np.arange(begin, end, dtype=np.float32) * np.float32(0.01) + unit


def small_runtime(world, backend=None, **options):
    """A runtime of two units over `backend` (a new cpu one by default), finalised."""
    backend = backend or libfsdp.Backend("cpu", rank=world.rank)
    rt = libfsdp.Runtime(backend, world, **options)
    rt.register_unit("a", [("a.w", (4, 3)), {"name": "a.b", "shape": (4,),
                                             "weight_decay": False}])
    rt.register_unit("b", [("b.w", (2, 4)), {"name": "b.frozen", "shape": 2,
                                             "requires_grad": False}])
    rt.finalize(iota_init)
    return rt


def micro_batch(rt, grad=1.0):
    """One forward and backward over every unit, adding `grad` to every gradient."""
    for u in range(rt.num_units):
        rt.pre_forward(u)
        rt.post_forward(u)
    for u in reversed(range(rt.num_units)):
        v = rt.pre_backward(u)
        v.grads[...] += np.float32(grad)
        rt.post_backward(u)
    rt.finish_backward()


# ---- the tests --------------------------------------------------------------------------------


def test_version():
    major, minor = libfsdp.api_version()
    check(major == libfsdp.API_VERSION_MAJOR and minor >= libfsdp.API_VERSION_MINOR,
          "api_version %d.%d" % (major, minor))
    check(libfsdp.version_string().startswith("libfsdp "), libfsdp.version_string())
    check("cpu" in libfsdp.backend_names() and "sim" in libfsdp.backend_names(),
          "backend_names: %r" % libfsdp.backend_names())
    if _capi.has("fsdp_backend_device_count"):
        check(libfsdp.device_count("cpu") is None, "device_count('cpu')")
        raises(Code.INVALID_ARGUMENT, "nope", libfsdp.device_count, "nope")
    else:
        raises(Code.UNIMPLEMENTED, "rebuild", libfsdp.device_count, "cpu")


def test_struct_layout():
    """Every ctypes struct against the C compiler's sizeof and offsetof of c_api.h's."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    header = os.path.join(SOURCE_DIR, "include", "fsdp", "c_api.h")
    if cc is None or not os.path.exists(header):
        print("   (no C compiler or no include/fsdp/c_api.h: layout not compared)")
        return
    structs = [v for v in vars(_capi).values()
               if isinstance(v, type) and issubclass(v, ctypes.Structure) and
               v.__name__.startswith("fsdp_")]
    lines, want = [], []
    for s in structs:
        lines.append('printf("%%zu\\n", sizeof(%s));' % s.__name__)
        want.append(("sizeof(%s)" % s.__name__, ctypes.sizeof(s)))
        for name, _ in s._fields_:
            lines.append('printf("%%zu\\n", offsetof(%s, %s));' % (s.__name__, name))
            want.append(("offsetof(%s, %s)" % (s.__name__, name), getattr(s, name).offset))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "layout.c")
        with open(src, "w") as f:
            f.write('#include <stddef.h>\n#include <stdio.h>\n#include "fsdp/c_api.h"\n'
                    "int main(void) {\n%s\nreturn 0;\n}\n" % "\n".join(lines))
        exe = os.path.join(d, "layout")
        subprocess.run([cc, "-std=c99", "-I", os.path.join(SOURCE_DIR, "include"), src, "-o",
                        exe], check=True)
        got = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split()
    for (what, value), c in zip(want, got):
        check(int(c) == value, "%s is %s in C but %d in ctypes" % (what, c, value))
    print("   %d structs, %d sizes and offsets equal to the C compiler's" % (len(structs),
                                                                            len(want)))


def test_every_function_declared():
    """Every function of c_api.h has a ctypes prototype (a new one needs its declaration)."""
    header = os.path.join(SOURCE_DIR, "include", "fsdp", "c_api.h")
    if not os.path.exists(header):
        print("   (no include/fsdp/c_api.h: not compared)")
        return
    with open(header) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    names = set(re.findall(r"\b(fsdp_\w+)\s*\(", text)) - {"fsdp_rank_body", "fsdp_init_fn"}
    missing = sorted(names - set(_capi._PROTOTYPES))
    check(not missing, "c_api.h functions without a prototype: %s" % ", ".join(missing))
    extra = sorted(set(_capi._PROTOTYPES) - names)
    check(not extra, "prototypes of functions c_api.h does not have: %s" % ", ".join(extra))
    print("   %d functions" % len(names))


def test_library_not_found():
    env = dict(os.environ, FSDP_LIBRARY="/nonexistent/libfsdp.so")
    p = subprocess.run([sys.executable, "-c", "import libfsdp; libfsdp.version_string()"],
                       env=env, capture_output=True, text=True)
    check(p.returncode != 0 and "LibraryNotFoundError" in p.stderr and
          "FSDP_LIBRARY" in p.stderr, "a missing library: %s" % p.stderr[-300:])


def test_error_codes():
    e = raises(Code.INVALID_ARGUMENT, "no backend named 'nope'", libfsdp.Backend, "nope")
    check(str(e).startswith("INVALID_ARGUMENT: "), "str(FsdpError): %s" % e)
    raises(Code.INVALID_ARGUMENT, "unknown option", libfsdp.Backend, "cpu", {"bogus": 1})
    try:
        # Enum options are checked by name before the library sees them.
        libfsdp.run_threads(1, lambda w: libfsdp.Runtime(libfsdp.Backend(), w,
                                                         strategy="bogus"))
        raise Failure("strategy='bogus' was accepted")
    except ValueError as e:
        check("FULL_SHARD" in str(e), str(e))


def test_closed_stale_and_foreign_handles():
    b = libfsdp.Backend("cpu")
    check(b.is_host and b.name == "cpu", "the cpu backend")
    stale = b.handle
    b.close()
    b.close()  # twice: harmless
    check(b.closed, "closed")
    raises(Code.INVALID_ARGUMENT, "backend is NULL", lambda: b.is_host)
    out = ctypes.c_int()
    raises(Code.INVALID_ARGUMENT, "not a live fsdp_backend", _capi.lib().fsdp_backend_is_host,
           stale, ctypes.byref(out))
    _capi.lib().fsdp_backend_destroy(stale)  # destroying a destroyed handle: a no-op
    _capi.lib().fsdp_backend_destroy(None)

    def body(world):
        with libfsdp.Backend("cpu") as backend:
            # A handle of another kind.
            n = ctypes.c_int()
            raises(Code.INVALID_ARGUMENT, "not an fsdp_world", _capi.lib().fsdp_world_rank,
                   backend.handle, ctypes.byref(n))
            # A made-up pointer.
            raises(Code.INVALID_ARGUMENT, "not a live", _capi.lib().fsdp_world_rank,
                   ctypes.addressof(n), ctypes.byref(n))
            rt = small_runtime(world, backend)
            # Closing the world closes the runtimes over it first.
        world.close()
        check(rt.closed, "closing the world left its runtime open")
        raises(Code.INVALID_ARGUMENT, "runtime is NULL", rt.pre_forward, 0)
        raises(Code.INVALID_ARGUMENT, "world is NULL", lambda: world.rank)
    libfsdp.run_threads(1, body)


def test_hooks_out_of_order():
    def before_finalize(world):
        rt = libfsdp.Runtime(libfsdp.Backend("cpu"), world)
        rt.register_unit("a", [("a.w", (4,))])
        raises(Code.FAILED_PRECONDITION, "Finalize", rt.pre_forward, 0)
    libfsdp.run_threads(1, before_finalize)

    def unit_out_of_range(world):
        rt = small_runtime(world)
        raises(Code.OUT_OF_RANGE, "unit 5 does not exist", rt.pre_forward, 5)
        raises(Code.OUT_OF_RANGE, "unit 5 does not exist", rt.unit_param, 5, 0)
        raises(Code.INVALID_ARGUMENT, "index 2", rt.unit_param, 0, 2)
        micro_batch(rt)  # still usable
        check(rt.step(0.1).step == 1, "step after refused calls")
    libfsdp.run_threads(1, unit_out_of_range)

    def backward_first(world):
        rt = small_runtime(world)
        raises(Code.FAILED_PRECONDITION, "out of order", rt.pre_backward, 1)
        # A hook out of order fails the runtime for good.
        raises(Code.FAILED_PRECONDITION, "failed earlier", rt.pre_forward, 0)
    libfsdp.run_threads(1, backward_first)

    def post_forward_first(world):
        rt = small_runtime(world)
        raises(Code.FAILED_PRECONDITION, "out of order", rt.post_forward, 0)
    libfsdp.run_threads(1, post_forward_first)

    def skip_backward(world):
        rt = small_runtime(world)
        for u in range(2):
            rt.pre_forward(u)
            rt.post_forward(u)
        raises(Code.FAILED_PRECONDITION, None, rt.step, 0.1)
    libfsdp.run_threads(1, skip_backward)

    # On two ranks the misuse of rank 0 fails rank 1's collectives at once, not at the timeout.
    def two_ranks(world):
        rt = small_runtime(world)
        if world.rank == 0:
            raises(Code.FAILED_PRECONDITION, "out of order", rt.pre_backward, 1)
            return 0.0
        t = time.monotonic()
        try:
            micro_batch(rt)
            rt.step(0.1)
        except FsdpError as e:
            check("rank 0" in e.message, "rank 1's error: %s" % e)
            return time.monotonic() - t
        raise Failure("rank 1 trained on while rank 0 had failed")
    waited = libfsdp.run_threads(2, two_ranks, timeout_seconds=30)[1]
    check(waited < 10, "rank 1 waited %.1f s for a failed peer" % waited)


def test_views():
    def cpu(world):
        rt = small_runtime(world)
        v = rt.pre_forward(0)
        check(v.params.dtype == np.float32 and v.params.size == 16 and v.grads is None,
              "forward view")
        check(np.array_equal(v.param("a.w"), iota_init(0, 0, 0, 12).reshape(4, 3)) and
              np.array_equal(v.param(1), iota_init(0, 1, 0, 4)), "param(): %r" % v.params)
        raises(Code.FAILED_PRECONDITION, "no gradients", v.grad, 0)
        rt.post_forward(0)
        rt.pre_forward(1)
        rt.post_forward(1)
        v = rt.pre_backward(1)
        check(v.grads.dtype == np.float32 and v.grads.size == 10, "backward view")
        v.grad("b.w")[...] += np.float32(3.0)
        check(np.all(v.grads[:8] == 3.0), "grad() writes the library's buffer")
        rt.post_backward(1)
        v = rt.pre_backward(0)
        v.grads[...] += np.float32(0.5)
        rt.post_backward(0)
        rt.finish_backward()
        # Unit 0: 16 x 0.5^2; unit 1: 8 x 3^2 (the frozen b.frozen has no gradient).
        want = np.sqrt(16 * 0.25 + 8 * 9.0)
        stats = rt.step(0.01)
        check(abs(stats.grad_norm - want) < 1e-5 and stats.step == 1 and not stats.skipped,
              "step: %r" % stats)
        frozen = rt.gather_unit(1)[8:]
        check(np.array_equal(frozen, iota_init(1, 1, 0, 2)), "the frozen parameter moved")
        m = rt.memory()
        check(m["param_shard_bytes"] > 0 and m["peak_bytes"] >= m["param_shard_bytes"],
              "memory(): %r" % m)
        check(rt.backend.memory()["in_use"] > 0, "Backend.memory()")
        rt.set_activation_bytes(1 << 20)
        check(rt.memory()["activation_peak_bytes"] >= 1 << 20, "set_activation_bytes")
        rt.reset_peaks()
        check(rt.loss_scale > 0 and rt.steps == 1, "loss_scale, steps")
        # Forward only (evaluation).
        for u in range(2):
            rt.pre_forward(u)
            rt.post_forward(u)
        rt.finish_forward_only()
        check(world.host_layout() == (1, 1), "host_layout: %r" % (world.host_layout(),))
    libfsdp.run_threads(1, cpu)

    def device(world):
        backend = libfsdp.Backend("sim", rank=world.rank)
        check(not backend.is_host, "sim is a host backend")
        rt = small_runtime(world, backend)
        v = rt.pre_forward(0)
        raises(Code.FAILED_PRECONDITION, "copy_params_to_host", lambda: v.params)
        check(np.array_equal(v.copy_params_to_host()[:12], iota_init(0, 0, 0, 12)),
              "copy_params_to_host")
        rt.post_forward(0)
        rt.pre_forward(1)
        rt.post_forward(1)
        for u in (1, 0):
            v = rt.pre_backward(u)
            g = v.copy_grads_to_host()
            check(np.all(g == 0), "fresh gradients")
            v.copy_grads_from_host(g + np.float32(1.0))
            check(np.all(v.copy_grads_to_host() == 1.0), "copy_grads_from_host")
            rt.post_backward(u)
        rt.finish_backward()
        check(abs(rt.step(0.01).grad_norm - np.sqrt(16 + 8)) < 1e-5, "norm on sim")
    libfsdp.run_threads(1, device)

    def bf16(world):
        rt = small_runtime(world, param_dtype="bf16")
        v = rt.pre_forward(0)
        check(v.params.dtype == np.uint16, "a bf16 view is %s" % v.params.dtype)
        as_f32 = (v.params.astype(np.uint32) << 16).view(np.float32)
        want = np.concatenate([iota_init(0, 0, 0, 12), iota_init(0, 1, 0, 4)])
        check(np.allclose(as_f32, want, rtol=2 ** -8, atol=0), "bf16 values: %r" % as_f32)
    libfsdp.run_threads(1, bf16)


def test_init_errors():
    def raising(world):
        rt = libfsdp.Runtime(libfsdp.Backend("cpu", rank=world.rank), world)
        rt.register_unit("a", [("a.w", (8,))])

        def init(unit, param, begin, end):
            if world.rank == 1:
                raise ValueError("no values for rank 1")
            return np.zeros(end - begin, np.float32)
        try:
            rt.finalize(init)
        except FsdpError as e:
            check("rank 1" in e.message and "no values for rank 1" in e.message, str(e))
            if world.rank == 1:
                check(isinstance(e.__cause__, ValueError), "the cause is %r" % e.__cause__)
            return
        raise Failure("finalize succeeded on rank %d" % world.rank)
    libfsdp.run_threads(2, raising)

    def wrong_size(world):
        rt = libfsdp.Runtime(libfsdp.Backend("cpu"), world)
        rt.register_unit("a", [("a.w", (8,))])
        e = raises(Code.UNKNOWN, "returned 3 values, not 8", rt.finalize,
                   lambda u, p, b, e: [1, 2, 3])
        check(isinstance(e.__cause__, ValueError), "cause")
    libfsdp.run_threads(1, wrong_size)

    def zeros(world):
        rt = libfsdp.Runtime(libfsdp.Backend("cpu"), world)
        rt.register_unit("a", [("a.w", (8,)), ("a.b", (2,))])
        rt.finalize(lambda u, p, b, e: None if p == 0 else np.ones(e - b))
        check(np.array_equal(rt.gather_unit(0), [0] * 8 + [1, 1]), "None: zeros")
    libfsdp.run_threads(1, zeros)


def test_collective_errors():
    def settings(world):
        world.check_same_settings({"lr": 0.1, "model": "nano"}, "same")
        e = raises(Code.INVALID_ARGUMENT, "lr", world.check_same_settings,
                   [("model", "nano"), ("lr", 0.1 * (world.rank + 1))], "the settings")
        check("0.1" in e.message and "0.2" in e.message, str(e))
    libfsdp.run_threads(2, settings)

    def agree(world):
        world.agree(None)
        local = FsdpError(Code.NOT_FOUND, "no data here") if world.rank == 1 else None
        e = raises(Code.NOT_FOUND, "rank 1: no data here", world.agree, local)
        # Any exception is UNKNOWN.
        local = KeyError("k") if world.rank == 0 else None
        raises(Code.UNKNOWN, "rank 0: KeyError", world.agree, local)
        return e.message
    libfsdp.run_threads(2, agree)

    # run_threads: the first exception in rank order; a failing rank aborts the world, so its
    # peer's collective fails at once.
    def failing(world):
        if world.rank == 1:
            raise KeyError("rank 1")
        if world.rank == 2:
            raise ValueError("rank 2")
        t = time.monotonic()
        try:
            world.agree()
        except FsdpError as e:
            check("failed" in e.message, str(e))
            check(time.monotonic() - t < 10, "rank 0 waited for its failed peers")
            return
        raise Failure("rank 0's collective succeeded")
    try:
        libfsdp.run_threads(3, failing, timeout_seconds=30)
        raise Failure("run_threads did not raise")
    except KeyError:
        pass

    def abort(world):
        if world.rank == 0:
            world.abort(FsdpError(Code.CANCELLED, "stop"))
        raises(Code.CANCELLED, "stop", world.agree)
    libfsdp.run_threads(2, abort, timeout_seconds=30)
    raises(Code.INVALID_ARGUMENT, "size", libfsdp.run_threads, 0, lambda w: None)


def test_checkpoints():
    tmp = tempfile.mkdtemp(prefix="libfsdp_test_")
    try:
        ckpt = os.path.join(tmp, "ckpt")
        st = os.path.join(tmp, "model.safetensors")

        def train(world):
            rt = small_runtime(world, strategy="HYBRID_SHARD", hybrid_shard_size=1)
            rt.set_requires_all_reduce(False)
            micro_batch(rt, grad=world.rank + 1.0)
            rt.set_requires_all_reduce(True)
            micro_batch(rt)
            rt.step(0.05)
            rt.save_checkpoint(ckpt)
            raises(Code.ALREADY_EXISTS, None, rt.save_checkpoint, ckpt)
            rt.save_checkpoint(ckpt, overwrite=True)
            rt.export_safetensors(st)
            return [rt.gather_unit(0), rt.gather_unit(1)]
        want = libfsdp.run_threads(2, train)[0]

        # Resharded: one rank, another strategy.
        def load(world):
            rt = libfsdp.Runtime(libfsdp.Backend("cpu"), world, strategy="NO_SHARD")
            rt.register_unit("a", [("a.w", (4, 3)), ("a.b", (4,))])
            rt.register_unit("b", [("b.w", (2, 4)), {"name": "b.frozen", "shape": (2,),
                                                     "requires_grad": False}])
            rt.finalize()
            check(rt.load_checkpoint(ckpt) == 1, "the checkpoint's step")
            got = [rt.gather_unit(0), rt.gather_unit(1)]
            rt2 = libfsdp.Runtime(rt.backend, world)
            rt2.register_unit("a", [("a.w", (4, 3)), ("a.b", (4,))])
            rt2.register_unit("b", [("b.w", (2, 4)), ("b.frozen", (2,))])
            rt2.finalize()
            rt2.import_safetensors(st)
            return got, [rt2.gather_unit(0), rt2.gather_unit(1)]
        from_ckpt, from_st = libfsdp.run_threads(1, load)[0]
        for u in range(2):
            check(np.array_equal(from_ckpt[u], want[u]), "checkpoint unit %d" % u)
            check(np.array_equal(from_st[u], want[u]), "safetensors unit %d" % u)
        raises(Code.NOT_FOUND, None, libfsdp.run_threads, 1,
               lambda w: small_runtime(w).load_checkpoint(os.path.join(tmp, "missing")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_model():
    def body(world):
        with libfsdp.Backend("cpu", rank=world.rank) as backend:
            model = libfsdp.Model(backend, world, "nano", batch_size=2, seq_len=16)
            info = model.info()
            check(info["vocab_size"] > 64 and info["num_parameters"] > 0, "info: %r" % info)
            rng = np.random.default_rng(world.rank)
            tokens = rng.integers(0, 64, size=(2, 17))
            losses = []
            for _ in range(3):
                losses.append(model.forward_backward(tokens[:, :-1], tokens[:, 1:]))
                stats = model.step(3e-3)
            check(stats.step == 3 and losses[-1] < losses[0], "losses %r" % losses)
            check(model.forward(tokens[:, :-1], tokens[:, 1:]) < losses[0], "eval loss")
            raises(Code.INVALID_ARGUMENT, "count", model.forward, tokens[:, :4], tokens[:, 1:5])
            check(model.runtime.steps == 3 and model.runtime.memory()["peak_bytes"] > 0,
                  "the model's runtime")
    libfsdp.run_threads(2, body)


def test_planner():
    p = libfsdp.plan("llama2-70b", 32, ranks_per_host=8, param_dtype="bf16",
                     device_memory_bytes="80GiB", checkpoint_every=1)
    check(p["num_parameters"] > 60e9 and p["num_units"] > 80 and p["peak_bytes"] > 0 and
          isinstance(p["fits"], bool), "plan(): %r" % p)
    small = libfsdp.plan("nano", device_memory_bytes=1)
    check(small["fits"] is False, "1 byte of device memory fits")
    text = libfsdp.format_plan("llama2-70b", 32)
    check("peak (all together)" in text and "llama2-70b" in text, text)
    raises(Code.INVALID_ARGUMENT, "unknown model", libfsdp.plan, "no-such-model")
    check(libfsdp.parse_bytes("80GiB") == 80 << 30 and libfsdp.parse_bytes("1.5kb") == 1500,
          "parse_bytes")

    env = dict(os.environ)
    run = [sys.executable, "-m", "libfsdp.plan"]
    r = subprocess.run(run + ["--model", "llama2-70b", "--world", "32"], env=env,
                       capture_output=True, text=True)
    check(r.returncode == 0 and r.stdout.strip() == text.strip(),
          "python3 -m libfsdp.plan: %d %s %s" % (r.returncode, r.stdout, r.stderr))
    r = subprocess.run(run + ["--model", "llama2-70b", "--world", "32", "--ranks_per_host", "8",
                              "--strategy", "HYBRID_SHARD", "--param_dtype", "bf16", "--batch",
                              "1", "--seq", "4096", "--checkpoint_every", "1",
                              "--device_memory", "80GiB", "--offload", "optimizer"],
                       env=env, capture_output=True, text=True)
    check(r.returncode == 0 and "device memory" in r.stdout and "offload" in r.stdout,
          "every flag: %d %s %s" % (r.returncode, r.stdout, r.stderr))
    for bad, needle in ((["--bogus"], "unrecognized"), (["--world", "0"], "--world"),
                        (["--strategy", "X"], "strategy"), (["--device_memory", "8Q"], "80GiB"),
                        (["--offload", "disk"], "offload"), (["--model", "x"], "unknown model")):
        r = subprocess.run(run + bad, env=env, capture_output=True, text=True)
        check(r.returncode == 2 and needle in r.stderr,
              "%s: exit %d, %s" % (" ".join(bad), r.returncode, r.stderr))
    # Importing the CLI module keeps libfsdp.plan(...) callable.
    importlib.import_module("libfsdp.plan")
    check(libfsdp.plan("nano")["num_units"] > 0, "libfsdp.plan after importing libfsdp.plan")


TESTS = [v for k, v in list(globals().items()) if k.startswith("test_") and callable(v)]


def main():
    failed = 0
    for test in TESTS:
        name = test.__name__[len("test_"):]
        try:
            test()
        except Exception as e:
            failed += 1
            print("FAILED %s: %s" % (name, e))
            if not isinstance(e, Failure):
                traceback.print_exc()
            continue
        print("ok %s" % name)
    print("%d of %d passed" % (len(TESTS) - failed, len(TESTS)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
