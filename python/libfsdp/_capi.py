"""The raw C API of libfsdp (include/fsdp/c_api.h) through ctypes.

Everything here mirrors the header one to one: the enums as IntEnums, the structs as
ctypes.Structures with the same fields in the same order, and the prototypes of every exported
function. The library is loaded on first use (``lib()``), so that importing the package does not
need it.

Every function returning ``fsdp_error*`` has an errcheck that turns a non-NULL error into
:class:`FsdpError` (destroying the C error after reading it); those functions therefore return
None to Python on success.
"""

import ctypes
import ctypes.util
import enum
import os
import threading

# The header version these bindings were written against (c_api.h's FSDP_C_API_VERSION_*).
API_VERSION_MAJOR = 0
API_VERSION_MINOR = 2
SONAME = "libfsdp.so.%d" % API_VERSION_MAJOR


# ---- enums ------------------------------------------------------------------------------------


class Code(enum.IntEnum):
    """fsdp_code: absl::StatusCode's (gRPC's) codes."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class DType(enum.IntEnum):
    F32 = 0
    BF16 = 1
    F16 = 2
    F64 = 3
    I32 = 4
    I64 = 5
    U8 = 6


class Strategy(enum.IntEnum):
    FULL_SHARD = 0
    SHARD_GRAD_OP = 1
    NO_SHARD = 2
    HYBRID_SHARD = 3
    HYBRID_SHARD_GRAD_OP = 4


class Optimizer(enum.IntEnum):
    ADAMW = 0
    SGD = 1


class NonFinite(enum.IntEnum):
    ERROR = 0
    SKIP = 1


class Offload(enum.IntEnum):
    NONE = 0
    OPTIMIZER = 1
    ALL = 2


def to_enum(cls, value, what):
    """An enum member from a member, an int or a case-insensitive name ("full_shard", "bf16")."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls[value.strip().upper()]
        except KeyError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            return cls(value)
        except ValueError:
            pass
    allowed = ", ".join(m.name for m in cls)
    raise ValueError("%s is %r; allowed: %s" % (what, value, allowed))


# ---- errors -----------------------------------------------------------------------------------


class FsdpError(Exception):
    """An error returned by the library: ``code`` (a :class:`Code`) and ``message``."""

    def __init__(self, code, message):
        try:
            code = Code(code)
        except ValueError:
            code = int(code)
        self.code = code
        self.message = message
        super().__init__(code, message)

    @property
    def code_name(self):
        return self.code.name if isinstance(self.code, Code) else "CODE_%d" % self.code

    def __str__(self):
        return "%s: %s" % (self.code_name, self.message)


FsdpError.__module__ = "libfsdp"  # as users name it


class LibraryNotFoundError(OSError):
    """libfsdp.so could not be loaded, or is of an incompatible major version."""


LibraryNotFoundError.__module__ = "libfsdp"


# ---- structs ----------------------------------------------------------------------------------

_size_t = ctypes.c_size_t
_int = ctypes.c_int
_enum = ctypes.c_int  # C enums are int-sized on every ABI the library supports
_i64 = ctypes.c_int64
_u64 = ctypes.c_uint64
_f32 = ctypes.c_float
_f64 = ctypes.c_double
_ptr = ctypes.c_void_p
_str = ctypes.c_char_p


class fsdp_world_options(ctypes.Structure):
    _fields_ = [("struct_size", _size_t), ("timeout_seconds", _f64)]


class fsdp_key_value(ctypes.Structure):
    _fields_ = [("key", _str), ("value", _str)]


class fsdp_view(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("host", _ptr),
        ("address", _ptr),
        ("storage", _ptr),
        ("allocation_bytes", _u64),
        ("offset", _i64),
        ("count", _i64),
        ("dtype", _enum),
    ]


class fsdp_sharding_options(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("strategy", _enum),
        ("hybrid_shard_size", _int),
        ("forward_prefetch", _int),
        ("backward_prefetch", _int),
        ("max_prefetch_units", _int),
        ("param_dtype", _enum),
        ("reduce_dtype", _enum),
        ("dynamic_loss_scale", _int),
        ("initial_loss_scale", _f32),
        ("max_grad_norm", _f32),
        ("optimizer", _enum),
        ("adamw_beta1", _f32),
        ("adamw_beta2", _f32),
        ("adamw_eps", _f32),
        ("weight_decay", _f32),
        ("sgd_momentum", _f32),
        ("nonfinite", _enum),
        ("offload", _enum),
        ("offload_budget_bytes", _i64),
    ]


class fsdp_param(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("name", _str),
        ("shape", ctypes.POINTER(_i64)),
        ("ndim", _int),
        ("requires_grad", _int),
        ("weight_decay", _int),
    ]


class fsdp_unit_view(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("unit", _int),
        ("numel", _i64),
        ("params", fsdp_view),
        ("grads", fsdp_view),
    ]


class fsdp_step_stats(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("grad_norm", _f64),
        ("clip_coefficient", _f32),
        ("lr", _f32),
        ("step", _i64),
        ("skipped", _int),
        ("nonfinite", _int),
        ("loss_scale", _f32),
    ]


class fsdp_memory_report(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("param_shard_bytes", _i64),
        ("grad_shard_bytes", _i64),
        ("optimizer_bytes", _i64),
        ("gathered_param_bytes", _i64),
        ("gathered_param_peak_bytes", _i64),
        ("grad_buffer_bytes", _i64),
        ("grad_buffer_peak_bytes", _i64),
        ("activation_peak_bytes", _i64),
        ("secondary_param_bytes", _i64),
        ("secondary_param_peak_bytes", _i64),
        ("peak_bytes", _i64),
        ("host_offload_bytes", _i64),
        ("offloaded_units", _int),
    ]


class fsdp_model_options(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("config", _str),
        ("batch_size", _int),
        ("seq_len", _int),
        ("seed", _u64),
        ("checkpoint_every", _int),
    ]


class fsdp_plan_request(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("model", _str),
        ("world_size", _int),
        ("ranks_per_host", _int),
        ("strategy", _enum),
        ("hybrid_shard_size", _int),
        ("param_dtype", _enum),
        ("reduce_dtype", _enum),
        ("checkpoint_every", _int),
        ("batch_size", _int),
        ("seq_len", _int),
        ("micro_batches", _int),
        ("device_memory_bytes", _i64),
        ("offload", _enum),
        ("offload_budget_bytes", _i64),
    ]


class fsdp_memory_plan(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size_t),
        ("param_shard_bytes", _i64),
        ("grad_shard_bytes", _i64),
        ("optimizer_bytes", _i64),
        ("gathered_param_peak_bytes", _i64),
        ("grad_buffer_peak_bytes", _i64),
        ("activation_peak_bytes", _i64),
        ("secondary_param_peak_bytes", _i64),
        ("peak_bytes", _i64),
        ("host_offload_bytes", _i64),
        ("num_parameters", _i64),
        ("num_units", _int),
        ("fits", _int),
    ]


def new_struct(cls):
    """A zeroed struct with struct_size set (the library reads and writes up to it)."""
    s = cls()
    s.struct_size = ctypes.sizeof(cls)
    return s


def struct_to_dict(s):
    return {name: getattr(s, name) for name, _ in s._fields_ if name != "struct_size"}


# ---- callbacks --------------------------------------------------------------------------------

# fsdp_error* (*)(fsdp_world*, void*). Declared for completeness: the Python wrappers do not use
# fsdp_run_threads (they start their own threads on fsdp_thread_group).
fsdp_rank_body = ctypes.CFUNCTYPE(_ptr, _ptr, _ptr)
# fsdp_error* (*)(void* user, int unit, int param, int64_t begin, int64_t end, float* out)
fsdp_init_fn = ctypes.CFUNCTYPE(_ptr, _ptr, _int, _int, _i64, _i64, ctypes.POINTER(_f32))


# ---- prototypes -------------------------------------------------------------------------------

_P = ctypes.POINTER
_err = "error"  # marks a function returning fsdp_error* (checked, raises FsdpError)

# name: (restype, [argtypes]). Handles are void pointers; out-parameters are pointers.
_PROTOTYPES = {
    # version
    "fsdp_api_version": (ctypes.c_uint32, []),
    "fsdp_version_string": (_str, []),
    # errors
    "fsdp_error_code": (_enum, [_ptr]),
    "fsdp_error_message": (_str, [_ptr]),
    "fsdp_error_create": (_ptr, [_enum, _str]),
    "fsdp_error_destroy": (None, [_ptr]),
    # worlds
    "fsdp_world_options_init": (None, [_P(fsdp_world_options)]),
    "fsdp_run_threads": (_err, [_int, _P(fsdp_world_options), fsdp_rank_body, _ptr]),
    "fsdp_thread_group_create": (_err, [_int, _P(fsdp_world_options), _P(_ptr)]),
    "fsdp_thread_group_take_rank": (_err, [_ptr, _int, _P(_ptr)]),
    "fsdp_thread_group_destroy": (None, [_ptr]),
    "fsdp_thread_group_ranks": (_err, [_ptr, _P(_int), _P(_int)]),
    "fsdp_run_mpi_threads": (_err, [_int, _P(fsdp_world_options), fsdp_rank_body, _ptr]),
    "fsdp_mpi_thread_group_create": (_err, [_int, _P(fsdp_world_options), _P(_ptr)]),
    "fsdp_world_create_mpi": (_err, [_P(fsdp_world_options), _P(_ptr)]),
    "fsdp_world_create_mpi_comm": (_err, [ctypes.c_void_p, _P(fsdp_world_options), _P(_ptr)]),
    "fsdp_mpi_shutdown": (None, []),
    "fsdp_mpi_finish": (ctypes.c_int, [_ptr, ctypes.c_char_p]),
    "fsdp_world_destroy": (None, [_ptr]),
    "fsdp_world_rank": (_err, [_ptr, _P(_int)]),
    "fsdp_world_size": (_err, [_ptr, _P(_int)]),
    "fsdp_world_abort": (_err, [_ptr, _ptr]),
    "fsdp_world_host_layout": (_err, [_ptr, _P(_int), _P(_int)]),
    "fsdp_world_check_same_settings": (_err, [_ptr, _P(fsdp_key_value), _size_t, _str]),
    "fsdp_world_agree": (_err, [_ptr, _ptr]),
    # backends
    "fsdp_backend_names": (_err, [ctypes.c_char_p, _size_t, _P(_size_t)]),
    "fsdp_backend_create": (_err, [_str, _P(fsdp_key_value), _size_t, _int, _P(_ptr)]),
    "fsdp_backend_device_count": (_err, [_str, _P(fsdp_key_value), _size_t, _P(_int)]),
    "fsdp_backend_destroy": (None, [_ptr]),
    "fsdp_backend_name": (_err, [_ptr, ctypes.c_char_p, _size_t, _P(_size_t)]),
    "fsdp_backend_is_host": (_err, [_ptr, _P(_int)]),
    "fsdp_backend_memory": (_err, [_ptr, _P(_i64), _P(_i64)]),
    "fsdp_backend_synchronize": (_err, [_ptr]),
    "fsdp_view_copy_to_host": (_err, [_ptr, _P(fsdp_view), _ptr, _i64]),
    "fsdp_view_copy_from_host": (_err, [_ptr, _P(fsdp_view), _ptr, _i64]),
    "fsdp_backend_wrap_host_memory": (_err, [_ptr, _ptr, _i64, _enum, _P(fsdp_view)]),
    "fsdp_backend_wrap_native_memory": (_err, [_ptr, _ptr, _i64, _enum, _P(fsdp_view)]),
    "fsdp_backend_native_stream": (_err, [_ptr, _int, _P(_ptr)]),
    # the runtime
    "fsdp_sharding_options_init": (None, [_P(fsdp_sharding_options)]),
    "fsdp_runtime_create": (_err, [_ptr, _ptr, _P(fsdp_sharding_options), _P(_ptr)]),
    "fsdp_runtime_destroy": (None, [_ptr]),
    "fsdp_param_init": (None, [_P(fsdp_param)]),
    "fsdp_runtime_register_unit": (_err, [_ptr, _str, _P(fsdp_param), _size_t, _P(_int)]),
    "fsdp_runtime_finalize": (_err, [_ptr, fsdp_init_fn, _ptr]),
    "fsdp_runtime_num_units": (_err, [_ptr, _P(_int)]),
    "fsdp_runtime_unit_param": (
        _err,
        [_ptr, _int, _int, _P(_i64), _P(_i64), ctypes.c_char_p, _size_t, _P(_size_t)],
    ),
    "fsdp_runtime_unit_numel": (_err, [_ptr, _int, _P(_i64)]),
    "fsdp_pre_forward": (_err, [_ptr, _int, _P(fsdp_unit_view)]),
    "fsdp_post_forward": (_err, [_ptr, _int]),
    "fsdp_pre_backward": (_err, [_ptr, _int, _P(fsdp_unit_view)]),
    "fsdp_post_backward": (_err, [_ptr, _int]),
    "fsdp_finish_backward": (_err, [_ptr]),
    "fsdp_finish_forward_only": (_err, [_ptr]),
    "fsdp_step": (_err, [_ptr, _f32, _P(fsdp_step_stats)]),
    "fsdp_set_sync_gradients": (_err, [_ptr, _int]),
    "fsdp_set_requires_all_reduce": (_err, [_ptr, _int]),
    "fsdp_set_activation_bytes": (_err, [_ptr, _i64]),
    "fsdp_runtime_loss_scale": (_err, [_ptr, _P(_f32)]),
    "fsdp_runtime_steps": (_err, [_ptr, _P(_i64)]),
    "fsdp_runtime_gather_unit": (_err, [_ptr, _int, _P(_f32), _i64]),
    "fsdp_runtime_memory": (_err, [_ptr, _P(fsdp_memory_report)]),
    "fsdp_runtime_reset_peaks": (_err, [_ptr]),
    # checkpoints
    "fsdp_checkpoint_save": (_err, [_ptr, _str, _int]),
    "fsdp_checkpoint_load": (_err, [_ptr, _str, _int, _P(_i64)]),
    "fsdp_safetensors_export": (_err, [_ptr, _str, _enum]),
    "fsdp_safetensors_import": (_err, [_ptr, _str, _int]),
    # the bundled models
    "fsdp_model_options_init": (None, [_P(fsdp_model_options)]),
    "fsdp_model_create": (
        _err,
        [_ptr, _ptr, _P(fsdp_sharding_options), _P(fsdp_model_options), _P(_ptr)],
    ),
    "fsdp_model_destroy": (None, [_ptr]),
    "fsdp_model_info": (_err, [_ptr, _P(_int), _P(_int), _P(_i64)]),
    "fsdp_model_forward_backward": (_err, [_ptr, _P(ctypes.c_int32), _P(ctypes.c_int32), _i64,
                                           _P(_f32)]),
    "fsdp_model_forward": (_err, [_ptr, _P(ctypes.c_int32), _P(ctypes.c_int32), _i64, _P(_f32)]),
    "fsdp_model_step": (_err, [_ptr, _f32, _P(fsdp_step_stats)]),
    "fsdp_model_runtime": (_err, [_ptr, _P(_ptr)]),
    # the planner
    "fsdp_plan_request_init": (None, [_P(fsdp_plan_request)]),
    "fsdp_plan_memory": (_err, [_P(fsdp_plan_request), _P(fsdp_memory_plan)]),
    "fsdp_plan_format": (_err, [_P(fsdp_plan_request), ctypes.c_char_p, _size_t, _P(_size_t)]),
}


# Functions added to the header after the first 0.1 libraries were built, without a new minor
# version: a library without them still loads, and using them raises UNIMPLEMENTED.
_LATER = {
    "fsdp_world_abort", "fsdp_backend_device_count", "fsdp_model_options_init",
    "fsdp_model_create", "fsdp_model_destroy", "fsdp_model_info", "fsdp_model_forward_backward",
    "fsdp_model_forward", "fsdp_model_step", "fsdp_model_runtime",
    # C API 0.2
    "fsdp_thread_group_ranks", "fsdp_run_mpi_threads", "fsdp_mpi_thread_group_create",
}
_missing = set()


def has(name):
    """Whether the loaded library exports `name`."""
    lib()
    return name not in _missing


def require(name):
    if not has(name):
        raise FsdpError(Code.UNIMPLEMENTED, "%s: this libfsdp (%s) was built before the "
                        "function was added; rebuild it" % (name, _lib._name))


def _decode(b):
    return b.decode("utf-8", "replace") if b is not None else ""


def _symbol(dll, name):
    try:
        return getattr(dll, name)
    except AttributeError:
        raise LibraryNotFoundError(
            "%s does not export %s: it is older than the C API %d.%d these bindings need, or "
            "not libfsdp" % (dll._name, name, API_VERSION_MAJOR, API_VERSION_MINOR)) from None


def _declare(dll):
    # Reading and destroying an error: declared first, the checker needs them.
    code_fn = _symbol(dll, "fsdp_error_code")
    code_fn.restype, code_fn.argtypes = _enum, [_ptr]
    message_fn = _symbol(dll, "fsdp_error_message")
    message_fn.restype, message_fn.argtypes = _str, [_ptr]
    destroy_fn = _symbol(dll, "fsdp_error_destroy")
    destroy_fn.restype, destroy_fn.argtypes = None, [_ptr]

    def errcheck(result, func, args):
        # With restype c_void_p, ctypes hands over NULL as None and a pointer as an int.
        if result:
            code = code_fn(result)
            message = _decode(message_fn(result))
            destroy_fn(result)
            raise FsdpError(code, message)
        return None

    for name, (restype, argtypes) in _PROTOTYPES.items():
        if name in _LATER and not hasattr(dll, name):
            _missing.add(name)
            continue
        fn = _symbol(dll, name)
        fn.argtypes = argtypes
        if restype is _err:
            fn.restype = _ptr
            fn.errcheck = errcheck
        else:
            fn.restype = restype


# ---- loading ----------------------------------------------------------------------------------

_lock = threading.Lock()
_lib = None


def _candidates():
    """Where to look for the library, in order: $FSDP_LIBRARY, beside the package, the SONAME
    through the dynamic loader's search (LD_LIBRARY_PATH, the ld.so cache), find_library."""
    path = os.environ.get("FSDP_LIBRARY")
    if path:
        # An explicit choice: nothing else is tried.
        return [path]
    here = os.path.dirname(os.path.abspath(__file__))
    out = [os.path.join(here, SONAME), os.path.join(here, "libfsdp.so")]
    out = [p for p in out if os.path.exists(p)]
    out.append(SONAME)
    # find_library runs ldconfig (or the compiler): only when the rest failed.
    out.append(lambda: ctypes.util.find_library("fsdp"))
    return out


def load_library(path=None):
    """Loads libfsdp (``path``, else the search of :func:`_candidates`) and checks that its C API
    major version is the one these bindings speak. Returns the ctypes.CDLL. Called on first use;
    a later call returns the library already loaded."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        dll = None
        for candidate in [path] if path else _candidates():
            if callable(candidate):
                candidate = candidate()
                if candidate is None:
                    continue
            try:
                # CDLL, not PyDLL: the GIL is released during every call, so a rank blocked in a
                # collective lets the other ranks' Python threads run.
                dll = ctypes.CDLL(candidate)
                break
            except OSError as e:
                tried.append("%s (%s)" % (candidate, e))
        if dll is None:
            raise LibraryNotFoundError(
                "cannot load libfsdp: tried " + "; ".join(tried) + ". Set FSDP_LIBRARY to the "
                "full path of libfsdp.so (e.g. build/src/capi/libfsdp.so), or put its directory "
                "on LD_LIBRARY_PATH"
            )
        version_fn = _symbol(dll, "fsdp_api_version")
        version_fn.restype, version_fn.argtypes = ctypes.c_uint32, []
        version = version_fn()
        major, minor = version >> 16, version & 0xFFFF
        if major != API_VERSION_MAJOR:
            raise LibraryNotFoundError(
                "%s has C API version %d.%d, but these bindings need major version %d (the "
                "SONAME is %s): use a libfsdp of the same major version, or bindings made for "
                "version %d" % (dll._name, major, minor, API_VERSION_MAJOR, SONAME, major)
            )
        _declare(dll)
        _lib = dll
        return _lib


def lib():
    """The loaded library (loading it on first use)."""
    return _lib if _lib is not None else load_library()


def read_text(fn, *args):
    """Calls a function with a text out-parameter (..., char* buffer, size_t capacity,
    size_t* length) twice: once for the length, once with room for it."""
    length = _size_t(0)
    fn(*args, None, 0, ctypes.byref(length))
    while True:
        buf = ctypes.create_string_buffer(length.value + 1)
        need = length.value
        fn(*args, buf, len(buf), ctypes.byref(length))
        if length.value <= need:
            return _decode(buf.value)


def make_error(exc):
    """A C fsdp_error (the caller owns it) carrying a Python exception: its code when it is an
    FsdpError, FSDP_CODE_UNKNOWN otherwise."""
    if isinstance(exc, FsdpError):
        code, message = int(exc.code), exc.message
    else:
        code, message = int(Code.UNKNOWN), "%s: %s" % (type(exc).__name__, exc)
    return lib().fsdp_error_create(code, message.encode("utf-8", "replace"))
