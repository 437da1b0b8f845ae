"""libfsdp from Python: sharded data-parallel training (FSDP / ZeRO) through the library's C API
(include/fsdp/c_api.h), with ctypes and numpy only.

The library is found through $FSDP_LIBRARY (a full path) if set, else beside this package, else
by its SONAME (libfsdp.so.0) on the dynamic loader's path. A training step of a model written in
numpy, on each rank::

    import libfsdp

    def train(world):
        with libfsdp.Backend("cpu", rank=world.rank) as backend, \\
             libfsdp.Runtime(backend, world, strategy="FULL_SHARD") as rt:
            rt.register_unit("layer", [("w", (16, 8)), ("b", (16,))])
            rt.finalize(lambda unit, param, begin, end: my_init(unit, param, begin, end))
            v = rt.pre_forward(0)       # v.param(0): the gathered weight, a numpy view
            ...                          # forward with v.param(0), v.param(1)
            rt.post_forward(0)
            v = rt.pre_backward(0)
            v.grad(0)[...] += dw         # accumulate into the library's gradient buffer
            v.grad(1)[...] += db
            rt.post_backward(0)
            rt.finish_backward()
            stats = rt.step(lr=1e-3)

    libfsdp.run_threads(2, train)      # or, under mpirun: train(libfsdp.World.mpi()),
                                       # or libfsdp.run_mpi_threads(2, train)

Every failing call raises :class:`FsdpError` (``.code``, a :class:`Code`; ``.message``).
"""

from ._capi import (
    API_VERSION_MAJOR,
    API_VERSION_MINOR,
    Code,
    DType,
    FsdpError,
    LibraryNotFoundError,
    NonFinite,
    Offload,
    Optimizer,
    Strategy,
    load_library,
)
from ._core import (
    Backend,
    Model,
    ParamInfo,
    Runtime,
    StepStats,
    UnitView,
    World,
    api_version,
    backend_names,
    device_count,
    mpi_shutdown,
    numpy_dtype,
    run_mpi_threads,
    run_threads,
    version_string,
)
from ._planner import format_plan, parse_bytes, plan

__version__ = "0.1.0"

__all__ = [
    "API_VERSION_MAJOR", "API_VERSION_MINOR", "Backend", "Code", "DType", "FsdpError",
    "LibraryNotFoundError", "Model", "NonFinite", "Offload", "Optimizer", "ParamInfo", "Runtime",
    "StepStats", "Strategy", "UnitView", "World", "api_version", "backend_names", "device_count",
    "format_plan", "load_library", "mpi_shutdown", "numpy_dtype", "parse_bytes", "plan",
    "run_mpi_threads", "run_threads", "version_string",
]
