#!/usr/bin/env python3
"""Trains the two-layer perceptron of tests/capi/mlp.h through libfsdp's Python package (the C
API through ctypes), with the model written in numpy, and compares every rank's losses and
gradient norms and the final parameters with the C++ API's run of the same configuration (the
reference files that tests/capi/c_api_reference writes; layout in tests/capi/mlp_run.h).

    test_mlp.py REF_DIR           every configuration of mlp_run.h, ranks as Python threads (cpu
                                  backend), and FULL_SHARD on 2 ranks on the sim backend, whose
                                  views have no host pointer (read and written through copies)
    test_mlp.py REF_DIR --mpi     under mpirun -np 2: the 2-rank configurations, one rank per
                                  process

numpy's float32 matrix products sum in another order than mlp.c's loops, so the comparison is
not bitwise: losses and gradient norms must agree within RTOL (relative), parameters within RTOL
plus PARAM_ATOL (absolute): AdamW's update is normalised, so a parameter near zero carries the
absolute rounding error of the update (a few 1e-8), not a relative one. As a check that the model
really trains, the loss over every batch the run saw must be lower with the final parameters than
with the initial ones.

Environment: PYTHONPATH=<source>/python, FSDP_LIBRARY=<build>/src/capi/libfsdp.so.
Exit status: 0 passed, 1 failed, 2 bad usage, 77 skipped (numpy is missing).
"""

import os
import sys

try:
    import numpy as np
except ImportError:
    print("skipped: python3-numpy is not installed")
    sys.exit(77)

import libfsdp

# mlp.h
MLP_IN, MLP_HIDDEN, MLP_OUT = 8, 16, 4
MLP_BATCH, MLP_STEPS, MLP_MICRO_BATCHES = 4, 4, 2
MLP_LR = np.float32(0.05)
MAX_GRAD_NORM = 0.07  # as c_api_train_test.c: clips steps 0 and 3
# mlp_run.h
MLP_LOSSES = MLP_STEPS * MLP_MICRO_BATCHES
MLP_UNIT0 = MLP_HIDDEN * MLP_IN + MLP_HIDDEN
MLP_UNIT1 = MLP_OUT * MLP_HIDDEN + MLP_OUT
# (name, strategy, hybrid_shard_size, world): mlp_run.h's kMlpConfigs.
CONFIGS = [
    ("full_shard_2", "FULL_SHARD", 0, 2),
    ("full_shard_4", "FULL_SHARD", 0, 4),
    ("hybrid_shard_2x2", "HYBRID_SHARD", 2, 4),
    ("hybrid_shard_2x1", "HYBRID_SHARD", 1, 2),
    ("no_shard_2", "NO_SHARD", 0, 2),
]

RTOL = 1e-5
PARAM_ATOL = 1e-6

UNITS = [
    ("layer1", [("w1", (MLP_HIDDEN, MLP_IN)), ("b1", (MLP_HIDDEN,))]),
    ("layer2", [("w2", (MLP_OUT, MLP_HIDDEN)), ("b2", (MLP_OUT,))]),
]


# ---- mlp.c in numpy ---------------------------------------------------------------------------


def hash_unit(a, b, c, d):
    """mlp.c's hash_unit, elementwise over arrays: a value in [-0.5, 0.5) from a 32-bit integer
    hash (uint32 arithmetic wrapping as in C)."""
    vs = [np.asarray(v, dtype=np.uint32) for v in (a, b, c, d)]
    h = np.full(np.broadcast(*vs).shape, 2166136261, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for v in vs:
            h ^= v
            h *= np.uint32(16777619)
            h ^= h >> np.uint32(15)
            h *= np.uint32(2246822519)
            h ^= h >> np.uint32(13)
    return (h >> np.uint32(8)).astype(np.float32) / np.float32(16777216.0) - np.float32(0.5)


def mlp_init(unit, param, i):
    return np.float32(0.6) * hash_unit(1 + unit, 7 + param, i, 99)


def mlp_batch(rank, step, micro_batch):
    key = rank * 1000 + step * 10 + micro_batch
    x = np.float32(2.0) * hash_unit(key, 1, np.arange(MLP_BATCH * MLP_IN), 5)
    t = hash_unit(key, 2, np.arange(MLP_BATCH * MLP_OUT), 5)
    return x.reshape(MLP_BATCH, MLP_IN), t.reshape(MLP_BATCH, MLP_OUT)


def forward1(x, w1, b1):
    hpre = x @ w1.T + b1
    return hpre, np.maximum(hpre, np.float32(0))


def forward2(h, t, w2, b2):
    y = h @ w2.T + b2
    d = y - t
    loss = np.sum(np.float32(0.5) * d * d, dtype=np.float32) / np.float32(MLP_BATCH * MLP_OUT)
    return y, np.float32(loss)


def backward2(h, y, t, w2, dw2, db2):
    """Accumulates (+=) dW2 and db2; returns dh."""
    dy = (y - t) / np.float32(MLP_BATCH * MLP_OUT)
    db2 += dy.sum(axis=0)
    dw2 += dy.T @ h
    return dy @ w2


def backward1(x, hpre, dh, dw1, db1):
    g = np.where(hpre > 0, dh, np.float32(0))
    db1 += g.sum(axis=0)
    dw1 += g.T @ x


def mean_loss(params, ranks):
    """The mean loss over every batch of `ranks` ranks' run, with the flat unit buffers."""
    p0, p1 = params
    w1 = p0[:MLP_HIDDEN * MLP_IN].reshape(MLP_HIDDEN, MLP_IN)
    b1 = p0[MLP_HIDDEN * MLP_IN:]
    w2 = p1[:MLP_OUT * MLP_HIDDEN].reshape(MLP_OUT, MLP_HIDDEN)
    b2 = p1[MLP_OUT * MLP_HIDDEN:]
    losses = []
    for r in range(ranks):
        for s in range(MLP_STEPS):
            for m in range(MLP_MICRO_BATCHES):
                x, t = mlp_batch(r, s, m)
                _, h = forward1(x, w1, b1)
                losses.append(forward2(h, t, w2, b2)[1])
    return float(np.mean(losses))


def initial_params():
    out = []
    for u, (_, params) in enumerate(UNITS):
        out.append(np.concatenate([mlp_init(u, p, np.arange(int(np.prod(shape))))
                                   for p, (_, shape) in enumerate(params)]))
    return out


# ---- training through the library ------------------------------------------------------------


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


class HostUnit:
    """A unit's weight and bias and their gradients as numpy arrays (c_api_train_test.c's
    host_unit): on a host backend the hooks' views of the library's memory (UnitView.param and
    .grad), else host copies (fsdp_view_copy_to_host) whose gradients done() writes back."""

    def __init__(self, rt, view, host):
        self.view, self.host = view, host
        if host:
            check(view.params.dtype == np.float32 and view.params.size == view.numel,
                  "the params view")
            self.w, self.b = view.param(0), view.param(1)
            self.dw, self.db = (view.grad(0), view.grad(1)) if view.backward else (None, None)
            return
        self.grads = view.copy_grads_to_host() if view.backward else None
        params = view.copy_params_to_host()
        slices = []
        for flat in (params, self.grads):
            for i in range(2):
                p = rt.param_info(view.unit, i)
                slices.append(None if flat is None else
                              flat[p.offset:p.offset + p.numel].reshape(p.shape))
        self.w, self.b, self.dw, self.db = slices

    def done(self):
        if not self.host and self.view.backward:
            self.view.copy_grads_from_host(self.grads)


def train(world, config, backend_name="cpu"):
    """One rank's run; returns its losses, gradient norms and the final gathered parameters."""
    name, strategy, hybrid_shard_size, world_size = config
    rank = world.rank
    check(world.size == world_size, "%s: the world has %d ranks, not %d"
          % (name, world.size, world_size))
    with libfsdp.Backend(backend_name, rank=rank) as backend, \
            libfsdp.Runtime(backend, world, strategy=strategy,
                            hybrid_shard_size=hybrid_shard_size,
                            max_grad_norm=MAX_GRAD_NORM) as rt:
        host = backend.is_host
        for u, (unit_name, params) in enumerate(UNITS):
            check(rt.register_unit(unit_name, params) == u, "register_unit: wrong unit index")
        rt.finalize(lambda unit, param, begin, end: mlp_init(unit, param, np.arange(begin, end)))
        check(rt.num_units == 2, "num_units")
        for u, (_, params) in enumerate(UNITS):
            offset = 0
            for p, (pname, shape) in enumerate(params):
                numel = int(np.prod(shape))
                check(rt.unit_param(u, p) == (pname, offset, numel),
                      "unit_param(%d, %d) is %r" % (u, p, rt.unit_param(u, p)))
                offset += numel
            check(rt.unit_numel(u) == offset, "unit_numel(%d)" % u)

        def unit(view):
            return HostUnit(rt, view, host)

        losses, norms = [], []
        for step in range(MLP_STEPS):
            for m in range(MLP_MICRO_BATCHES):
                x, t = mlp_batch(rank, step, m)
                rt.set_sync_gradients(m == MLP_MICRO_BATCHES - 1)
                l1 = unit(rt.pre_forward(0))
                hpre, h = forward1(x, l1.w, l1.b)
                rt.post_forward(0)
                l2 = unit(rt.pre_forward(1))
                y, loss = forward2(h, t, l2.w, l2.b)
                rt.post_forward(1)
                l2 = unit(rt.pre_backward(1))
                dh = backward2(h, y, t, l2.w, l2.dw, l2.db)
                l2.done()
                rt.post_backward(1)
                l1 = unit(rt.pre_backward(0))
                backward1(x, hpre, dh, l1.dw, l1.db)
                l1.done()
                rt.post_backward(0)
                rt.finish_backward()
                losses.append(loss)
            stats = rt.step(MLP_LR)
            check(stats.step == step + 1, "step(): step is %d, not %d" % (stats.step, step + 1))
            check(not stats.skipped and not stats.nonfinite, "step() skipped")
            norms.append(np.float32(stats.grad_norm))
        check(rt.steps == MLP_STEPS, "steps")
        memory = rt.memory()
        check(memory["peak_bytes"] > 0 and memory["param_shard_bytes"] > 0,
              "memory(): %r" % memory)
        final = [rt.gather_unit(0), rt.gather_unit(1)]
        check(final[0].shape == (MLP_UNIT0,) and final[1].shape == (MLP_UNIT1,),
              "gather_unit: wrong sizes")
    return np.array(losses, np.float32), np.array(norms, np.float32), final


def read_reference(ref_dir, config):
    name, _, _, world = config
    path = os.path.join(ref_dir, name + ".bin")
    n = world * (MLP_LOSSES + MLP_STEPS) + MLP_UNIT0 + MLP_UNIT1
    try:
        ref = np.fromfile(path, dtype=np.float32)
    except OSError as e:
        raise Failure("cannot read %s (run c_api_reference first): %s" % (path, e))
    check(ref.size == n, "%s has %d floats, not %d" % (path, ref.size, n))
    losses = ref[:world * MLP_LOSSES].reshape(world, MLP_LOSSES)
    norms = ref[world * MLP_LOSSES:world * (MLP_LOSSES + MLP_STEPS)].reshape(world, MLP_STEPS)
    params = ref[world * (MLP_LOSSES + MLP_STEPS):]
    return losses, norms, [params[:MLP_UNIT0], params[MLP_UNIT0:]]


class Diff:
    """The largest differences seen between this run and the C++ API's, by quantity."""

    def __init__(self):
        self.worst = {}  # quantity -> [largest absolute, largest relative]
        self.values = 0
        self.bitwise = 0

    def compare(self, quantity, what, got, want, atol=0.0):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        check(got.shape == want.shape, "%s: shape %s, not %s" % (what, got.shape, want.shape))
        d = np.abs(got.astype(np.float64) - want.astype(np.float64))
        rel = d / np.maximum(np.abs(want.astype(np.float64)), 1e-30)
        worst = self.worst.setdefault(quantity, [0.0, 0.0])
        worst[0] = max(worst[0], float(d.max()))
        worst[1] = max(worst[1], float(rel.max()))
        self.values += got.size
        self.bitwise += int(np.sum(got.view(np.uint32) == want.view(np.uint32)))
        bad = ~np.isclose(got, want, rtol=RTOL, atol=atol)
        if bad.any():
            i = int(np.argmax(bad))
            raise Failure("%s[%d] is %.9g through Python but %.9g through the C++ API "
                          "(rtol %g, atol %g)" % (what, i, got.flat[i], want.flat[i], RTOL, atol))

    def report(self):
        parts = ["%s %.3g abs, %.3g rel" % (q, a, r) for q, (a, r) in self.worst.items()]
        return ("largest differences from the C++ API: %s (%d of %d values bitwise equal)"
                % ("; ".join(parts), self.bitwise, self.values))


def compare_rank(config, rank, result, ref, diff):
    name = config[0]
    losses, norms, final = result
    ref_losses, ref_norms, ref_params = ref
    diff.compare("loss", "%s rank %d loss" % (name, rank), losses, ref_losses[rank])
    diff.compare("grad norm", "%s rank %d grad_norm" % (name, rank), norms, ref_norms[rank])
    for u in range(2):
        diff.compare("parameter", "%s rank %d unit %d parameter" % (name, rank, u), final[u],
                     ref_params[u], atol=PARAM_ATOL)


def check_trains(config, final):
    """The loss over every batch of the run falls from the initial parameters to the final."""
    world = config[3]
    before = mean_loss(initial_params(), world)
    after = mean_loss(final, world)
    check(after < before, "%s: the mean loss over the run's batches went from %.6f to %.6f"
          % (config[0], before, after))
    return before, after


def run_threads_mode(ref_dir):
    diff = Diff()
    runs = [(c, "cpu") for c in CONFIGS] + [(CONFIGS[0], "sim")]
    for config, backend in runs:
        ref = read_reference(ref_dir, config)
        results = libfsdp.run_threads(config[3], lambda w: train(w, config, backend))
        for rank, result in enumerate(results):
            compare_rank(config, rank, result, ref, diff)
        before, after = check_trains(config, results[0][2])
        print("ok %s (threads, %s backend): %d steps; losses, grad norms and parameters match "
              "the C++ API's; mean loss %.6f -> %.6f"
              % (config[0], backend, MLP_STEPS, before, after))
    return diff


def run_mpi_mode(ref_dir):
    diff = Diff()
    world = libfsdp.World.mpi()
    rank, size = world.rank, world.size
    runs = 0
    failed = False
    try:
        for config in CONFIGS:
            if config[3] != size:
                continue
            runs += 1
            error = None
            try:
                ref = read_reference(ref_dir, config)
                result = train(world, config)
                compare_rank(config, rank, result, ref, diff)
                before, after = check_trains(config, result[2])
            except (Failure, libfsdp.FsdpError) as e:
                error = e
            # Every rank learns whether some rank failed.
            try:
                world.agree(error)
            except libfsdp.FsdpError as e:
                failed = True
                print("FAILED %s (mpi, rank %d): %s" % (config[0], rank, e), file=sys.stderr)
                continue
            if rank == 0:
                print("ok %s (processes under mpirun): %d steps; losses, grad norms and "
                      "parameters match the C++ API's; mean loss %.6f -> %.6f"
                      % (config[0], MLP_STEPS, before, after))
    finally:
        world.close()
        libfsdp.mpi_shutdown()
    if runs == 0:
        raise Failure("no configuration has %d ranks (run under mpirun -np 2)" % size)
    if failed:
        raise Failure("some configurations failed")
    return diff if rank == 0 else None


def run_mpi_threads_mode(ref_dir):
    """Under mpirun -np 2: each process plays 2 ranks as threads (run_mpi_threads); the 4-rank
    configurations. A failing rank aborts the world, so every process raises."""
    diff = Diff()
    runs = 0
    first = None
    try:
        for config in CONFIGS:
            if config[3] != 4:
                continue
            runs += 1
            ref = read_reference(ref_dir, config)
            results = libfsdp.run_mpi_threads(
                2, lambda w: (w.rank, w.size, train(w, config, "cpu")))
            for rank, size, result in results:
                check(size == 4, "world size %d, not 4" % size)
                compare_rank(config, rank, result, ref, diff)
            first = results[0][0]
            before, after = check_trains(config, results[0][2][2])
            if first == 0:
                print("ok %s (2 processes under mpirun x 2 ranks as threads): %d steps; losses, "
                      "grad norms and parameters match the C++ API's; mean loss %.6f -> %.6f"
                      % (config[0], MLP_STEPS, before, after))
    finally:
        libfsdp.mpi_shutdown()
    if runs == 0:
        raise Failure("no 4-rank configuration")
    return diff if first == 0 else None


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    flags = [a for a in argv[1:] if a.startswith("--")]
    if len(args) != 1 or any(f not in ("--mpi", "--mpi-threads") for f in flags) or len(flags) > 1:
        print("usage: test_mlp.py REF_DIR [--mpi | --mpi-threads]", file=sys.stderr)
        return 2
    try:
        if flags == ["--mpi"]:
            diff = run_mpi_mode(args[0])
        elif flags == ["--mpi-threads"]:
            diff = run_mpi_threads_mode(args[0])
        else:
            diff = run_threads_mode(args[0])
    except (Failure, libfsdp.FsdpError) as e:
        print("FAILED: %s" % e, file=sys.stderr)
        return 1
    if diff is not None:
        print("tolerance: rtol %g (parameters also atol %g); %s" % (RTOL, PARAM_ATOL,
                                                                      diff.report()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
