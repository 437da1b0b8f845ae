"""The memory planner (fsdp_plan_memory, fsdp_plan_format): how much device memory one rank of a
sharded training run needs, by category, before anything is allocated."""

import ctypes
import math
import re

from . import _capi
from ._capi import DType, Offload, Strategy, lib, to_enum

# Suffixes of fsdp::ParseByteSize (src/plan/plan.cc), longest first.
_BYTE_UNITS = [
    ("kib", 1024.0), ("mib", 1024.0 ** 2), ("gib", 1024.0 ** 3), ("tib", 1024.0 ** 4),
    ("kb", 1e3), ("mb", 1e6), ("gb", 1e9), ("tb", 1e12),
    ("k", 1024.0), ("m", 1024.0 ** 2), ("g", 1024.0 ** 3), ("t", 1024.0 ** 4),
    ("b", 1.0),
]


def parse_bytes(text):
    """A memory size: an int (bytes) or text such as "80GiB", "80GB", "81920MiB", "1e9"."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError("a memory size is >= 0, got %d" % text)
        return text
    s = str(text).strip().lower()
    factor = 1.0
    for suffix, f in _BYTE_UNITS:
        if s.endswith(suffix):
            s, factor = s[:-len(suffix)].strip(), f
            break
    try:
        if not re.fullmatch(r"[0-9.eE+-]+", s):
            raise ValueError
        v = float(s)
    except ValueError:
        v = -1.0
    if not math.isfinite(v) or v < 0 or v * factor >= 9.2e18:
        raise ValueError("%r is not a memory size; write e.g. 80GiB, 80GB, 81920MiB or a number "
                         "of bytes" % (text,))
    return int(round(v * factor))


def _request(model, world_size, ranks_per_host, strategy, hybrid_shard_size, param_dtype,
             reduce_dtype, checkpoint_every, batch_size, seq_len, micro_batches,
             device_memory_bytes, offload, offload_budget_bytes):
    r = _capi.fsdp_plan_request()
    lib().fsdp_plan_request_init(ctypes.byref(r))
    model_bytes = model.encode() if model is not None else None
    r.model = model_bytes
    r.world_size = int(world_size)
    r.ranks_per_host = int(ranks_per_host)
    r.strategy = int(to_enum(Strategy, strategy, "strategy"))
    r.hybrid_shard_size = int(hybrid_shard_size)
    r.param_dtype = int(to_enum(DType, param_dtype, "param_dtype"))
    r.reduce_dtype = int(to_enum(DType, reduce_dtype, "reduce_dtype"))
    r.checkpoint_every = int(checkpoint_every)
    r.batch_size = int(batch_size)
    r.seq_len = int(seq_len)
    r.micro_batches = int(micro_batches)
    r.device_memory_bytes = parse_bytes(device_memory_bytes)
    r.offload = int(to_enum(Offload, offload, "offload"))
    r.offload_budget_bytes = (-1 if offload_budget_bytes is None or offload_budget_bytes == -1
                              else parse_bytes(offload_budget_bytes))
    # The struct holds a pointer into model_bytes: both go back together.
    return r, model_bytes


def plan(model="nano", world_size=1, *, ranks_per_host=0, strategy="FULL_SHARD",
         hybrid_shard_size=0, param_dtype="f32", reduce_dtype="f32", checkpoint_every=0,
         batch_size=1, seq_len=0, micro_batches=1, device_memory_bytes=0, offload="none",
         offload_budget_bytes=None):
    """fsdp_plan_memory for a bundled model ("nano" ... "llama2-70b"): a dict of
    fsdp_memory_plan's fields (bytes per rank; "fits" a bool). The arguments are
    fsdp_plan_request's fields with its defaults; sizes take ints or text ("80GiB")."""
    r, keep = _request(model, world_size, ranks_per_host, strategy, hybrid_shard_size,
                       param_dtype, reduce_dtype, checkpoint_every, batch_size, seq_len,
                       micro_batches, device_memory_bytes, offload, offload_budget_bytes)
    out = _capi.new_struct(_capi.fsdp_memory_plan)
    lib().fsdp_plan_memory(ctypes.byref(r), ctypes.byref(out))
    del keep
    d = _capi.struct_to_dict(out)
    d["fits"] = bool(d["fits"])
    return d


def format_plan(model="nano", world_size=1, *, ranks_per_host=0, strategy="FULL_SHARD",
                hybrid_shard_size=0, param_dtype="f32", reduce_dtype="f32", checkpoint_every=0,
                batch_size=1, seq_len=0, micro_batches=1, device_memory_bytes=0, offload="none",
                offload_budget_bytes=None):
    """The plan as the fsdp_plan tool prints it (fsdp_plan_format): a table with a note."""
    r, keep = _request(model, world_size, ranks_per_host, strategy, hybrid_shard_size,
                       param_dtype, reduce_dtype, checkpoint_every, batch_size, seq_len,
                       micro_batches, device_memory_bytes, offload, offload_budget_bytes)
    text = _capi.read_text(lib().fsdp_plan_format, ctypes.byref(r))
    del keep
    return text
