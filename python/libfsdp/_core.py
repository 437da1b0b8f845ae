"""Python objects over the C API's handles: worlds, backends and the sharding runtime.

Ownership follows c_api.h: a runtime (or a bundled model) must be destroyed before the backend
and the world it was made over. A Runtime or Model holds references to both (so they cannot be
collected first), and closing a World or a Backend closes the runtimes and models made over it
before destroying the handle.

Thread safety is the C API's: a World, Backend or Runtime belongs to one rank and is used by one
thread at a time.
"""

import atexit
import ctypes
import dataclasses
import os
import sys
import threading
import weakref

import numpy as np

from . import _capi
from ._capi import Code, DType, FsdpError, NonFinite, Offload, Optimizer, Strategy, lib, to_enum


def api_version():
    """The library's C API version as (major, minor)."""
    v = lib().fsdp_api_version()
    return v >> 16, v & 0xFFFF


def version_string():
    """E.g. "libfsdp 0.1.0 (C API 0.1)"."""
    return _capi._decode(lib().fsdp_version_string())


def backend_names():
    """The backends this library has, e.g. ["cpu", "cuda", "pjrt", "sim"]."""
    text = _capi.read_text(lib().fsdp_backend_names)
    return [n.strip() for n in text.split(",") if n.strip()]


def device_count(name, options=None):
    """The devices backend `name` has in this process with these options (a PJRT plugin's
    devices, the GPUs), or None when it has no fixed number (cpu, sim: any number of ranks
    share the host). Raises FsdpError saying why the backend cannot run here."""
    _capi.require("fsdp_backend_device_count")
    array, count, keep = _key_values(options or {})
    out = ctypes.c_int()
    lib().fsdp_backend_device_count(name.encode(), array, count, ctypes.byref(out))
    del keep
    return None if out.value < 0 else out.value


def _key_values(pairs):
    """A C array of fsdp_key_value from a dict or (key, value) pairs; values are str()'d. Returns
    the array and the encoded strings, which must stay alive while C reads them."""
    items = list(pairs.items() if isinstance(pairs, dict) else pairs)
    keep = [(str(k).encode(), str(v).encode()) for k, v in items]
    array = (_capi.fsdp_key_value * max(1, len(keep)))()
    for i, (k, v) in enumerate(keep):
        array[i].key, array[i].value = k, v
    return array, len(keep), keep


def _world_options(timeout_seconds):
    if timeout_seconds is None:
        return None
    o = _capi.fsdp_world_options()
    lib().fsdp_world_options_init(ctypes.byref(o))
    o.timeout_seconds = float(timeout_seconds)
    return ctypes.byref(o)


class _Handle:
    """A C handle destroyed once, by close(), the context manager or the garbage collector."""

    _destroy_name = None  # the C destroy function

    def __init__(self, handle):
        self._handle = handle

    @property
    def handle(self):
        """The raw C handle (an int), or None once closed. Calls on a closed object pass NULL
        to the library, which answers INVALID_ARGUMENT."""
        return self._handle

    @property
    def closed(self):
        return self._handle is None

    def _before_destroy(self):
        pass

    def close(self):
        if self._handle is None:
            return
        self._before_destroy()
        handle, self._handle = self._handle, None
        getattr(lib(), self._destroy_name)(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # During interpreter shutdown the modules this needs may already be gone.
        try:
            self.close()
        except Exception:
            pass


class _HasRuntimes(_Handle):
    def __init__(self, handle):
        super().__init__(handle)
        self._runtimes = weakref.WeakSet()

    def _before_destroy(self):
        # c_api.h: every runtime made over a world or a backend is destroyed first.
        for rt in list(self._runtimes):
            rt.close()


# ---- worlds -----------------------------------------------------------------------------------


class World(_HasRuntimes):
    """One rank's communicator over all ranks of the job. Made by :func:`run_threads` (ranks as
    threads), :meth:`World.mpi` (processes under mpirun) or :func:`run_mpi_threads` (ranks as
    threads of processes under mpirun)."""

    _destroy_name = "fsdp_world_destroy"

    @classmethod
    def mpi(cls, timeout_seconds=None, comm=None):
        """The world of MPI_COMM_WORLD (collective over the processes), or of `comm`: an mpi4py
        communicator, or the address of an MPI_Comm (an int), e.g. one group of a split; its
        processes become the world's ranks. Call :func:`mpi_shutdown` once at the end, after
        closing it."""
        out = ctypes.c_void_p()
        _finish_mpi_at_exit()
        if comm is None:
            lib().fsdp_world_create_mpi(_world_options(timeout_seconds), ctypes.byref(out))
        else:
            if not isinstance(comm, int):
                from mpi4py import MPI  # only when given an mpi4py communicator
                comm = MPI._addressof(comm)
            lib().fsdp_world_create_mpi_comm(ctypes.c_void_p(comm),
                                             _world_options(timeout_seconds), ctypes.byref(out))
        return cls(out.value)

    @property
    def rank(self):
        v = ctypes.c_int()
        lib().fsdp_world_rank(self._handle, ctypes.byref(v))
        return v.value

    @property
    def size(self):
        v = ctypes.c_int()
        lib().fsdp_world_size(self._handle, ctypes.byref(v))
        return v.value

    def host_layout(self):
        """Collective: (num_hosts, ranks_per_host); ranks_per_host is 0 when hosts hold
        different numbers of ranks or ranks that are not consecutive."""
        hosts, per_host = ctypes.c_int(), ctypes.c_int()
        lib().fsdp_world_host_layout(self._handle, ctypes.byref(hosts), ctypes.byref(per_host))
        return hosts.value, per_host.value

    def check_same_settings(self, settings, context=None):
        """Collective: raises FsdpError(INVALID_ARGUMENT) on every rank when ranks passed
        different settings (a dict, or (name, value) pairs, compared in order)."""
        array, count, keep = _key_values(settings)
        ctx = context.encode() if context is not None else None
        lib().fsdp_world_check_same_settings(self._handle, array, count, ctx)
        del keep

    def agree(self, error=None):
        """Collective: returns when every rank passed None; else raises on every rank an
        FsdpError copying the lowest failing rank's error ("rank R: ..."). `error` is None, an
        FsdpError (its code is kept) or any exception (UNKNOWN)."""
        local = _capi.make_error(error) if error is not None else None
        try:
            lib().fsdp_world_agree(self._handle, local)
        finally:
            if local:
                lib().fsdp_error_destroy(local)

    def abort(self, error=None):
        """Fails the world on every rank: their collectives in flight and later ones raise
        `error` (None: ABORTED), instead of waiting for this rank until the timeout."""
        _capi.require("fsdp_world_abort")
        local = _capi.make_error(error) if error is not None else None
        try:
            lib().fsdp_world_abort(self._handle, local)
        finally:
            if local:
                lib().fsdp_error_destroy(local)

    def __repr__(self):
        if self.closed:
            return "<libfsdp.World closed>"
        return "<libfsdp.World rank %d of %d>" % (self.rank, self.size)


def _describe(e):
    return e.message if isinstance(e, FsdpError) else "%s: %s" % (type(e).__name__, e)


def mpi_shutdown():
    """Finalises MPI after the last MPI world is closed (once, at the end of the program)."""
    lib().fsdp_mpi_shutdown()


_exit_hook = {"installed": False, "error": None}


def _finish_mpi_at_exit():
    """Once a process has an MPI world: at exit, fsdp_mpi_finish. After an uncaught exception,
    or when an MPI world failed (a peer died or was stopped), it aborts the job, so that mpirun
    ends every process at once instead of MPI_Finalize waiting for the dead peer; otherwise it
    shuts MPI down."""
    if _exit_hook["installed"]:
        return
    _exit_hook["installed"] = True
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        _exit_hook["error"] = value
        previous(kind, value, tb)

    sys.excepthook = excepthook

    def finish():
        e = _exit_hook["error"]
        error = None
        if e is not None:
            code = e.code if isinstance(e, FsdpError) else Code.UNKNOWN
            error = lib().fsdp_error_create(int(code), _describe(e).encode())
        sys.stdout.flush()
        sys.stderr.flush()
        lib().fsdp_mpi_finish(error, os.path.basename(sys.argv[0] or "python").encode())

    atexit.register(finish)


def run_threads(size, fn, timeout_seconds=None):
    """Runs fn(world) for every rank of a `size`-rank world on Python threads of this process
    and returns the results in rank order. Each world is closed when its fn returns (closing
    the runtimes still open over it). A rank whose fn raises aborts the world, so that its
    peers' collectives fail at once rather than at the timeout (`timeout_seconds`, by default
    the library's: 60 s or $FSDP_COMM_TIMEOUT_S); once every thread has finished, the first
    exception in rank order is re-raised."""
    group = ctypes.c_void_p()
    lib().fsdp_thread_group_create(int(size), _world_options(timeout_seconds),
                                   ctypes.byref(group))
    return _run_group(group, 0, size, fn)


def run_mpi_threads(threads, fn, timeout_seconds=None):
    """Under mpirun: every process plays `threads` ranks as Python threads of one world of
    processes x threads ranks (world rank = process rank * threads + t), for a backend with
    several devices per process (a PJRT client's chips, a host's GPUs). Collective over the
    processes, each passing the same `threads`. Runs fn(world) for each of this process's ranks
    as :func:`run_threads` does and returns their results in rank order. Call
    :func:`mpi_shutdown` once at the end."""
    _capi.require("fsdp_mpi_thread_group_create")
    _finish_mpi_at_exit()
    group = ctypes.c_void_p()
    lib().fsdp_mpi_thread_group_create(int(threads), _world_options(timeout_seconds),
                                       ctypes.byref(group))
    first, count = ctypes.c_int(), ctypes.c_int()
    try:
        lib().fsdp_thread_group_ranks(group, ctypes.byref(first), ctypes.byref(count))
    except BaseException:
        lib().fsdp_thread_group_destroy(group)
        raise
    return _run_group(group, first.value, count.value, fn)


def _run_group(group, first, size, fn):
    """fn(world) for world ranks first .. first + size - 1 of `group`, one Python thread each;
    destroys the group."""
    results = [None] * size
    errors = [None] * size
    try:
        # Every rank's handle is taken up front, so a failure here leaves no thread running.
        worlds = []
        try:
            for r in range(size):
                out = ctypes.c_void_p()
                lib().fsdp_thread_group_take_rank(group, first + r, ctypes.byref(out))
                worlds.append(World(out.value))
        except BaseException:
            for w in worlds:
                w.close()
            raise

        def body(r):
            world = worlds[r]
            try:
                results[r] = fn(world)
            except BaseException as e:  # re-raised on the calling thread
                errors[r] = e
                if _capi.has("fsdp_world_abort"):
                    try:
                        world.abort(FsdpError(e.code if isinstance(e, FsdpError) else Code.UNKNOWN,
                                              "rank %d failed: %s" % (first + r, _describe(e))))
                    except Exception:
                        pass
            finally:
                world.close()

        threads = [threading.Thread(target=body, args=(r,), name="fsdp-rank-%d" % (first + r),
                                    daemon=True) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        lib().fsdp_thread_group_destroy(group)
    for e in errors:
        if e is not None:
            raise e
    return results


# ---- backends ---------------------------------------------------------------------------------

# What numpy sees of a view of each dtype: (ctypes element, numpy dtype). numpy has no bfloat16,
# so bf16 elements are their raw uint16 bits.
_VIEW_TYPES = {
    DType.F32: (ctypes.c_float, np.float32),
    DType.BF16: (ctypes.c_uint16, np.uint16),
    DType.F16: (ctypes.c_uint16, np.float16),
    DType.F64: (ctypes.c_double, np.float64),
    DType.I32: (ctypes.c_int32, np.int32),
    DType.I64: (ctypes.c_int64, np.int64),
    DType.U8: (ctypes.c_uint8, np.uint8),
}


def numpy_dtype(dtype):
    """The numpy dtype of a view's elements (uint16 for bf16)."""
    return np.dtype(_VIEW_TYPES[to_enum(DType, dtype, "dtype")][1])


def _as_array(view, what):
    """A zero-copy numpy array over a view's host memory."""
    dtype = DType(view.dtype)
    if not view.host:
        raise FsdpError(
            Code.FAILED_PRECONDITION,
            "%s: the view has no host pointer because the backend is not a host backend (its "
            "memory is on a device): read it with copy_%s_to_host() (fsdp_view_copy_to_host) "
            "and write gradients back with copy_grads_from_host()" % (what, what))
    ctype, np_dtype = _VIEW_TYPES[dtype]
    if view.count == 0:
        return np.empty(0, np_dtype)
    a = np.ctypeslib.as_array(ctypes.cast(view.host, ctypes.POINTER(ctype)), shape=(view.count,))
    return a.view(np_dtype) if a.dtype != np_dtype else a


class Backend(_HasRuntimes):
    """A backend by name (cpu, sim, pjrt, cuda) for rank `rank` of this process, with its options
    as a dict (docs/backends.md lists each backend's keys)."""

    _destroy_name = "fsdp_backend_destroy"

    def __init__(self, name="cpu", options=None, rank=0):
        array, count, keep = _key_values(options or {})
        out = ctypes.c_void_p()
        lib().fsdp_backend_create(name.encode(), array, count, int(rank), ctypes.byref(out))
        del keep
        super().__init__(out.value)

    @property
    def name(self):
        return _capi.read_text(lib().fsdp_backend_name, self._handle)

    @property
    def is_host(self):
        """Whether views carry host pointers (cpu), so hooks hand out numpy views."""
        v = ctypes.c_int()
        lib().fsdp_backend_is_host(self._handle, ctypes.byref(v))
        return bool(v.value)

    def memory(self):
        """{"in_use": bytes, "peak": bytes} allocated on the backend."""
        in_use, peak = ctypes.c_int64(), ctypes.c_int64()
        lib().fsdp_backend_memory(self._handle, ctypes.byref(in_use), ctypes.byref(peak))
        return {"in_use": in_use.value, "peak": peak.value}

    def synchronize(self):
        lib().fsdp_backend_synchronize(self._handle)

    def native_stream(self, stream=0):
        """The native handle (an int) of stream 0 (compute) or 1 (communication)."""
        out = ctypes.c_void_p()
        lib().fsdp_backend_native_stream(self._handle, int(stream), ctypes.byref(out))
        return out.value

    def copy_to_host(self, view, out=None):
        """A copy of a view (an fsdp_view) in a new numpy array, or in `out`."""
        np_dtype = numpy_dtype(view.dtype)
        if out is None:
            out = np.empty(view.count, np_dtype)
        if out.dtype != np_dtype or out.size != view.count or not out.flags.c_contiguous:
            raise ValueError("out must be a contiguous %s array of %d elements"
                             % (np_dtype, view.count))
        lib().fsdp_view_copy_to_host(self._handle, ctypes.byref(view),
                                     out.ctypes.data_as(ctypes.c_void_p), out.nbytes)
        return out

    def copy_from_host(self, view, array):
        """Copies a numpy array of the view's dtype and element count into the view."""
        a = np.ascontiguousarray(array, dtype=numpy_dtype(view.dtype)).reshape(-1)
        lib().fsdp_view_copy_from_host(self._handle, ctypes.byref(view),
                                       a.ctypes.data_as(ctypes.c_void_p), a.nbytes)

    def wrap_host_memory(self, array):
        """An fsdp_view of a numpy array's memory (host backends only). The array must outlive
        every use of the view."""
        dtypes = {np.dtype(v[1]): k for k, v in _VIEW_TYPES.items() if k != DType.BF16}
        if not array.flags.c_contiguous or array.dtype not in dtypes:
            raise ValueError("wrap_host_memory needs a contiguous array of a dtype the library "
                             "has (float32, float16, float64, int32, int64, uint8)")
        out = _capi.new_struct(_capi.fsdp_view)
        lib().fsdp_backend_wrap_host_memory(self._handle, array.ctypes.data_as(ctypes.c_void_p),
                                            array.size, int(dtypes[array.dtype]),
                                            ctypes.byref(out))
        return out

    def __repr__(self):
        return "<libfsdp.Backend %s>" % ("closed" if self.closed else self.name)


# ---- the runtime ------------------------------------------------------------------------------


@dataclasses.dataclass
class StepStats:
    """fsdp_step_stats."""

    grad_norm: float  # global L2 norm before clipping
    clip_coefficient: float  # what the gradients were multiplied by
    lr: float
    step: int  # optimizer steps taken, this one included
    skipped: bool  # inf/NaN gradients on some rank: no update
    nonfinite: bool
    loss_scale: float  # what the next backward multiplies the loss gradient by


@dataclasses.dataclass
class ParamInfo:
    name: str
    offset: int  # elements into the unit's flat buffer
    numel: int
    shape: tuple


class UnitView:
    """What a hook hands over: the unit's gathered parameters (in param_dtype) and, in backward,
    the f32 gradient buffer of the same layout to accumulate (+=) into.

    On a host backend ``params`` and ``grads`` are numpy arrays over the library's memory (no
    copy): write gradients into ``grads`` in place (``view.grad(0)[...] += dw``). They are valid
    until the next hook on the unit; do not keep them. On a device backend use the copy_*
    methods instead."""

    def __init__(self, runtime, c_view, backward):
        self._runtime = runtime
        self._c = c_view
        self.unit = c_view.unit
        self.numel = c_view.numel
        self.backward = backward
        self._params = None
        self._grads = None

    @property
    def params_view(self):
        """The raw fsdp_view of the parameters."""
        return self._c.params

    @property
    def grads_view(self):
        return self._c.grads

    @property
    def params(self):
        if self._params is None:
            self._params = _as_array(self._c.params, "params")
        return self._params

    @property
    def grads(self):
        """The f32 gradient buffer; None in forward."""
        if not self.backward:
            return None
        if self._grads is None:
            self._grads = _as_array(self._c.grads, "grads")
        return self._grads

    def _slice(self, flat, index):
        p = self._runtime.param_info(self.unit, index)
        return flat[p.offset:p.offset + p.numel].reshape(p.shape)

    def param(self, index):
        """Parameter `index` (or name) of the unit, shaped."""
        return self._slice(self.params, index)

    def grad(self, index):
        """The gradient of parameter `index` (or name), shaped; writes go to the library."""
        if not self.backward:
            raise FsdpError(Code.FAILED_PRECONDITION,
                            "grad(): a forward hook's view has no gradients (pre_backward's has)")
        return self._slice(self.grads, index)

    def copy_params_to_host(self):
        """A copy of the parameters (any backend)."""
        return self._runtime.backend.copy_to_host(self._c.params)

    def copy_grads_to_host(self):
        """A copy of the gradient buffer (any backend; backward only)."""
        return self._runtime.backend.copy_to_host(self._c.grads)

    def copy_grads_from_host(self, array):
        """Writes a whole gradient buffer back (any backend; backward only)."""
        self._runtime.backend.copy_from_host(self._c.grads, array)


def _param_struct(spec, keep):
    """An fsdp_param from (name, shape) or {"name", "shape", "requires_grad", "weight_decay"}."""
    if isinstance(spec, dict):
        unknown = set(spec) - {"name", "shape", "requires_grad", "weight_decay"}
        if unknown:
            raise ValueError("unknown parameter keys %s (allowed: name, shape, requires_grad, "
                             "weight_decay)" % sorted(unknown))
        name, shape = spec["name"], spec["shape"]
        requires_grad = spec.get("requires_grad", True)
        weight_decay = spec.get("weight_decay", None)
    else:
        name, shape = spec
        requires_grad, weight_decay = True, None
    shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    p = _capi.fsdp_param()
    lib().fsdp_param_init(ctypes.byref(p))
    name_bytes = str(name).encode()
    dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    keep.extend([name_bytes, dims])
    p.name = name_bytes
    p.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    p.ndim = len(shape)
    p.requires_grad = 1 if requires_grad else 0
    # None: by rank (tensors of 2+ dimensions decay); True/False: on/off.
    p.weight_decay = -1 if weight_decay is None else (1 if weight_decay else 0)
    return p, str(name), shape


# Runtime's keyword options: fsdp_sharding_options's field -> its enum (None: a number).
_OPTION_ENUMS = {
    "strategy": Strategy, "hybrid_shard_size": None, "forward_prefetch": bool,
    "backward_prefetch": bool, "max_prefetch_units": None, "param_dtype": DType,
    "reduce_dtype": DType, "dynamic_loss_scale": bool, "initial_loss_scale": None,
    "max_grad_norm": None, "optimizer": Optimizer, "adamw_beta1": None, "adamw_beta2": None,
    "adamw_eps": None, "weight_decay": None, "sgd_momentum": None, "nonfinite": NonFinite,
    "offload": Offload, "offload_budget_bytes": None,
}


def _sharding_options(**given):
    """An fsdp_sharding_options from keyword options (None: the library's default)."""
    unknown = set(given) - set(_OPTION_ENUMS)
    if unknown:
        raise TypeError("unknown sharding options %s (allowed: %s)"
                        % (sorted(unknown), ", ".join(_OPTION_ENUMS)))
    o = _capi.fsdp_sharding_options()
    lib().fsdp_sharding_options_init(ctypes.byref(o))
    for field, kind in _OPTION_ENUMS.items():
        value = given.get(field)
        if value is None:
            continue
        if kind is bool:
            value = 1 if value else 0
        elif kind is not None:
            value = int(to_enum(kind, value, field))
        setattr(o, field, value)
    return o


class Runtime(_Handle):
    """The sharding runtime of one rank (collective over `world`).

    Keyword options are fsdp_sharding_options's fields (docs and defaults in c_api.h); an option
    left at None keeps the library's default. Enums take members or names:
    ``strategy="HYBRID_SHARD"``, ``param_dtype="bf16"``, ``optimizer="sgd"``,
    ``offload="optimizer"``. Use one runtime as: register_unit() for each unit, finalize(), then
    the hooks and step() for each training step; close() (or ``with``) at the end."""

    _destroy_name = "fsdp_runtime_destroy"

    def __init__(self, backend, world, *, strategy="FULL_SHARD", hybrid_shard_size=0,
                 max_grad_norm=0.0, forward_prefetch=None, backward_prefetch=None,
                 max_prefetch_units=None, param_dtype=None, reduce_dtype=None,
                 dynamic_loss_scale=None, initial_loss_scale=None, optimizer=None,
                 adamw_beta1=None, adamw_beta2=None, adamw_eps=None, weight_decay=None,
                 sgd_momentum=None, nonfinite=None, offload=None, offload_budget_bytes=None):
        super().__init__(None)
        self._borrowed = False
        arguments = dict(locals())
        o = _sharding_options(**{k: arguments[k] for k in _OPTION_ENUMS})
        out = ctypes.c_void_p()
        lib().fsdp_runtime_create(backend.handle, world.handle, ctypes.byref(o),
                                  ctypes.byref(out))
        self._handle = out.value
        # Kept so that the backend and the world outlive the runtime.
        self.backend = backend
        self.world = world
        backend._runtimes.add(self)
        world._runtimes.add(self)
        self._units = []  # per unit: [(name, shape)] as registered
        self._layout = {}  # unit -> [ParamInfo], read after finalize
        self._init_callback = None

    @classmethod
    def _of_model(cls, handle, model):
        """The runtime of a bundled model: the model's handle, never destroyed here."""
        rt = cls.__new__(cls)
        _Handle.__init__(rt, handle)
        rt._borrowed = True
        rt.backend, rt.world, rt.model = model.backend, model.world, model
        rt._units, rt._layout, rt._init_callback = [], {}, None
        return rt
    # -- units --

    def register_unit(self, name, params):
        """Registers a unit of parameters, given as (name, shape) pairs or dicts with "name",
        "shape" and optionally "requires_grad" (default True) and "weight_decay" (None: by
        rank, True, False). Returns the unit's index."""
        keep = []
        structs, infos = [], []
        for spec in params:
            p, pname, shape = _param_struct(spec, keep)
            structs.append(p)
            infos.append((pname, shape))
        array = (_capi.fsdp_param * max(1, len(structs)))(*structs)
        unit = ctypes.c_int(-1)
        lib().fsdp_runtime_register_unit(self._handle, str(name).encode(), array, len(structs),
                                         ctypes.byref(unit))
        del keep
        self._units.append(infos)
        return unit.value

    def finalize(self, init=None):
        """Collective: allocates the shards and fills them through init(unit, param_index,
        begin, end), which returns end - begin float32 values (elements [begin, end) of that
        parameter, flattened) or None for zeros; init None: all zeros. An exception in init
        stops the fill; every rank then raises the FsdpError the ranks agreed on (chained to
        the exception on the rank where it was raised)."""
        raised = []

        def fill(user, unit, param, begin, end, out):
            try:
                n = end - begin
                values = init(unit, param, begin, end)
                dst = np.ctypeslib.as_array(out, shape=(n,))
                if values is None:
                    dst[:] = 0.0
                else:
                    values = np.asarray(values, dtype=np.float32).reshape(-1)
                    if values.size != n:
                        raise ValueError("init(%d, %d, %d, %d) returned %d values, not %d"
                                         % (unit, param, begin, end, values.size, n))
                    dst[:] = values
                return None
            except BaseException as e:
                raised.append(e)
                return _capi.make_error(e)  # the library takes it over

        # The callback object must stay alive while C may call it: for the whole finalize.
        self._init_callback = _capi.fsdp_init_fn(fill) if init is not None else None
        try:
            # fsdp_init_fn() is a NULL function pointer: zeros.
            callback = self._init_callback or _capi.fsdp_init_fn()
            lib().fsdp_runtime_finalize(self._handle, callback, None)
        except FsdpError as e:
            if raised:
                raise e from raised[0]
            raise
        finally:
            self._init_callback = None

    @property
    def num_units(self):
        v = ctypes.c_int()
        lib().fsdp_runtime_num_units(self._handle, ctypes.byref(v))
        return v.value

    def unit_numel(self, unit):
        v = ctypes.c_int64()
        lib().fsdp_runtime_unit_numel(self._handle, int(unit), ctypes.byref(v))
        return v.value

    def unit_param(self, unit, index):
        """(name, offset, numel) of parameter `index` of `unit`, offset in elements into the
        unit's flat buffer."""
        offset, numel = ctypes.c_int64(), ctypes.c_int64()
        name = _capi.read_text(lib().fsdp_runtime_unit_param, self._handle, int(unit),
                               int(index), ctypes.byref(offset), ctypes.byref(numel))
        return name, offset.value, numel.value

    def param_info(self, unit, index):
        """ParamInfo(name, offset, numel, shape) of parameter `index` (or name) of `unit`."""
        layout = self._layout.get(unit)
        if layout is None:
            if not 0 <= unit < len(self._units):
                raise FsdpError(Code.INVALID_ARGUMENT, "unit %r was not registered through this "
                                "Runtime (%d units)" % (unit, len(self._units)))
            layout = []
            for i, (_, shape) in enumerate(self._units[unit]):
                name, offset, numel = self.unit_param(unit, i)
                layout.append(ParamInfo(name, offset, numel, shape))
            self._layout[unit] = layout
        if isinstance(index, str):
            for p in layout:
                if p.name == index:
                    return p
            raise KeyError("unit %d has no parameter %r (it has %s)"
                           % (unit, index, ", ".join(p.name for p in layout)))
        return layout[index]

    # -- hooks (in fsdp/sharding.h's order; the library checks it) --

    def pre_forward(self, unit):
        v = _capi.new_struct(_capi.fsdp_unit_view)
        lib().fsdp_pre_forward(self._handle, int(unit), ctypes.byref(v))
        return UnitView(self, v, backward=False)

    def post_forward(self, unit):
        lib().fsdp_post_forward(self._handle, int(unit))

    def pre_backward(self, unit):
        v = _capi.new_struct(_capi.fsdp_unit_view)
        lib().fsdp_pre_backward(self._handle, int(unit), ctypes.byref(v))
        return UnitView(self, v, backward=True)

    def post_backward(self, unit):
        lib().fsdp_post_backward(self._handle, int(unit))

    def finish_backward(self):
        lib().fsdp_finish_backward(self._handle)

    def finish_forward_only(self):
        lib().fsdp_finish_forward_only(self._handle)

    def step(self, lr):
        """Clips, updates every local shard with learning rate `lr`, zeroes the gradients."""
        s = _capi.new_struct(_capi.fsdp_step_stats)
        lib().fsdp_step(self._handle, float(lr), ctypes.byref(s))
        return StepStats(grad_norm=s.grad_norm, clip_coefficient=s.clip_coefficient, lr=s.lr,
                         step=s.step, skipped=bool(s.skipped), nonfinite=bool(s.nonfinite),
                         loss_scale=s.loss_scale)

    def set_sync_gradients(self, sync):
        """no_sync: while False, backward passes accumulate whole gradients locally."""
        lib().fsdp_set_sync_gradients(self._handle, 1 if sync else 0)

    def set_requires_all_reduce(self, all_reduce):
        """HYBRID strategies: while False, backward passes reduce inside the shard group only."""
        lib().fsdp_set_requires_all_reduce(self._handle, 1 if all_reduce else 0)

    def set_activation_bytes(self, nbytes):
        lib().fsdp_set_activation_bytes(self._handle, int(nbytes))

    @property
    def loss_scale(self):
        v = ctypes.c_float()
        lib().fsdp_runtime_loss_scale(self._handle, ctypes.byref(v))
        return v.value

    @property
    def steps(self):
        v = ctypes.c_int64()
        lib().fsdp_runtime_steps(self._handle, ctypes.byref(v))
        return v.value

    def gather_unit(self, unit):
        """Collective over the shard group: the unit's whole f32 parameters."""
        out = np.empty(self.unit_numel(unit), np.float32)
        lib().fsdp_runtime_gather_unit(self._handle, int(unit),
                                       out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                       out.size)
        return out

    def memory(self):
        """The memory report (bytes per rank) as a dict of fsdp_memory_report's fields."""
        m = _capi.new_struct(_capi.fsdp_memory_report)
        lib().fsdp_runtime_memory(self._handle, ctypes.byref(m))
        return _capi.struct_to_dict(m)

    def reset_peaks(self):
        lib().fsdp_runtime_reset_peaks(self._handle)

    # -- checkpoints (collective) --

    def save_checkpoint(self, directory, overwrite=False):
        lib().fsdp_checkpoint_save(self._handle, os.fsencode(directory), 1 if overwrite else 0)

    def load_checkpoint(self, directory, load_optimizer_state=True):
        """Loads on any world size or strategy; returns the step reached."""
        step = ctypes.c_int64()
        lib().fsdp_checkpoint_load(self._handle, os.fsencode(directory),
                                   1 if load_optimizer_state else 0, ctypes.byref(step))
        return step.value

    def export_safetensors(self, path, dtype="f32"):
        """Every parameter to one safetensors file (f32, bf16 or f16); rank 0 writes."""
        lib().fsdp_safetensors_export(self._handle, os.fsencode(path),
                                      int(to_enum(DType, dtype, "dtype")))

    def import_safetensors(self, path, ignore_extra_tensors=False):
        lib().fsdp_safetensors_import(self._handle, os.fsencode(path),
                                      1 if ignore_extra_tensors else 0)

    def close(self):
        # Closing twice is harmless; leaves the world and the backend to their owners.
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        if self._borrowed:
            return  # the model destroys it
        lib().fsdp_runtime_destroy(handle)
        for owner in (getattr(self, "backend", None), getattr(self, "world", None)):
            if owner is not None:
                owner._runtimes.discard(self)

    def __repr__(self):
        return "<libfsdp.Runtime %s>" % ("closed" if self.closed else
                                         "%d units" % len(self._units))


# ---- the bundled models -----------------------------------------------------------------------


class Model(_Handle):
    """A bundled model (MODEL_SPEC.md: the GPT-2 and Llama 2 families, by configuration name:
    "nano", "mini", "gpt2", ..., "llama-nano", "llama2-7b") trained with sharding; its forward
    and backward run in the library, through the same hooks. Collective over `world`.

    ``batch_size``, ``seq_len``, ``seed`` and ``checkpoint_every`` are fsdp_model_options's
    (None: the library's defaults); the other keywords are Runtime's sharding options."""

    _destroy_name = "fsdp_model_destroy"

    def __init__(self, backend, world, config="nano", *, batch_size=None, seq_len=None,
                 seed=None, checkpoint_every=None, **sharding):
        super().__init__(None)
        _capi.require("fsdp_model_create")
        sharding_options = _sharding_options(**sharding)
        m = _capi.fsdp_model_options()
        lib().fsdp_model_options_init(ctypes.byref(m))
        config_bytes = config.encode() if config is not None else None
        m.config = config_bytes
        for field, value in (("batch_size", batch_size), ("seq_len", seq_len), ("seed", seed),
                             ("checkpoint_every", checkpoint_every)):
            if value is not None:
                setattr(m, field, int(value))
        out = ctypes.c_void_p()
        lib().fsdp_model_create(backend.handle, world.handle, ctypes.byref(sharding_options),
                                ctypes.byref(m), ctypes.byref(out))
        self._handle = out.value
        self.backend = backend
        self.world = world
        self.batch_size, self.seq_len = m.batch_size, m.seq_len
        backend._runtimes.add(self)
        world._runtimes.add(self)
        rt = ctypes.c_void_p()
        lib().fsdp_model_runtime(self._handle, ctypes.byref(rt))
        self.runtime = Runtime._of_model(rt.value, self)

    def info(self):
        """{"vocab_size", "block_size", "num_parameters"}."""
        vocab, block, n = ctypes.c_int(), ctypes.c_int(), ctypes.c_int64()
        lib().fsdp_model_info(self._handle, ctypes.byref(vocab), ctypes.byref(block),
                              ctypes.byref(n))
        return {"vocab_size": vocab.value, "block_size": block.value, "num_parameters": n.value}

    def _tokens(self, inputs, targets):
        a = np.ascontiguousarray(inputs, dtype=np.int32).reshape(-1)
        b = np.ascontiguousarray(targets, dtype=np.int32).reshape(-1)
        if a.size != b.size:
            raise ValueError("inputs has %d tokens but targets %d" % (a.size, b.size))
        p = ctypes.POINTER(ctypes.c_int32)
        return a, b, a.ctypes.data_as(p), b.ctypes.data_as(p)

    def forward_backward(self, inputs, targets):
        """One micro-batch on this rank (batch_size x seq_len token ids each): forward, loss,
        backward; returns this rank's mean loss. Gradients accumulate until step()."""
        a, b, pa, pb = self._tokens(inputs, targets)
        loss = ctypes.c_float()
        lib().fsdp_model_forward_backward(self._handle, pa, pb, a.size, ctypes.byref(loss))
        return loss.value

    def forward(self, inputs, targets):
        """Forward only (evaluation): this rank's mean loss."""
        a, b, pa, pb = self._tokens(inputs, targets)
        loss = ctypes.c_float()
        lib().fsdp_model_forward(self._handle, pa, pb, a.size, ctypes.byref(loss))
        return loss.value

    def step(self, lr):
        s = _capi.new_struct(_capi.fsdp_step_stats)
        lib().fsdp_model_step(self._handle, float(lr), ctypes.byref(s))
        return StepStats(grad_norm=s.grad_norm, clip_coefficient=s.clip_coefficient, lr=s.lr,
                         step=s.step, skipped=bool(s.skipped), nonfinite=bool(s.nonfinite),
                         loss_scale=s.loss_scale)

    def close(self):
        if self._handle is None:
            return
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.close()  # forgets the model's runtime handle
        handle, self._handle = self._handle, None
        lib().fsdp_model_destroy(handle)
        for owner in (getattr(self, "backend", None), getattr(self, "world", None)):
            if owner is not None:
                owner._runtimes.discard(self)

    def __repr__(self):
        return "<libfsdp.Model %s>" % ("closed" if self.closed else "%d parameters"
                                       % self.info()["num_parameters"])
