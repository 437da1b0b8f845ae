#!/usr/bin/env python3
"""Writes tiny_gpt_f32.safetensors, the golden file of tests/checkpoint/safetensors_golden_test.cc.

An implementation independent of libfsdp: the tensor names and shapes come from
MODEL_SPEC.md (the GPT's "Parameters" list), the values from the formula below,
and the file is written by the reference `safetensors` library (safetensors.numpy.save_file).
The test exports the same model from libfsdp and compares the two files tensor by tensor
(names, dtypes, shapes, bitwise data, metadata), then imports this file into libfsdp.

Only for producing the fixture: CI and the tests never run Python. To regenerate:

    python3 -m venv /tmp/venv-golden
    /tmp/venv-golden/bin/pip install safetensors numpy
    /tmp/venv-golden/bin/python tests/checkpoint/golden/make_golden.py

The committed file was produced with Python 3.11.7, safetensors 0.8.0, numpy 2.4.6.
(The reference library orders the "__metadata__" entries by a hash map, so a rerun may order
them differently; the tensors and their data layout are deterministic.)

The model: a GPT with V=16, T=8, L=2, H=2, C=8 (the config "tiny-golden" of the test).
The tensors, numbered t = 0, 1, ... in MODEL_SPEC.md order: transformer.wte.weight,
transformer.wpe.weight, then for each block i the 12 tensors ln_1.weight ... mlp.c_proj.bias,
then transformer.ln_f.weight, transformer.ln_f.bias (lm_head.weight is tied to wte and not
stored). Element i of tensor t (row-major flat index) is

    value(t, i) = (-1)^(t + i) * ((t + 1) * 1024 + i) * 2^-(6 + i % 5)

an integer below 2^15 times a power of two: exact in float32, distinct for every (t, i).
"""
import os
import sys

import numpy as np
import safetensors
from safetensors.numpy import save_file

V, T, L, H, C = 16, 8, 2, 2, 8

METADATA = {
    "format": "pt",
    "producer": "libfsdp golden test",
    "config": "V=16 T=8 L=2 H=2 C=8",
    "formula": "(-1)^(t+i) * ((t+1)*1024 + i) * 2^-(6 + i%5)",
}


def model_spec_tensors():
    """(name, shape) in MODEL_SPEC.md order."""
    out = [("transformer.wte.weight", (V, C)), ("transformer.wpe.weight", (T, C))]
    for i in range(L):
        p = f"transformer.h.{i}."
        out += [
            (p + "ln_1.weight", (C,)),
            (p + "ln_1.bias", (C,)),
            (p + "attn.c_attn.weight", (3 * C, C)),
            (p + "attn.c_attn.bias", (3 * C,)),
            (p + "attn.c_proj.weight", (C, C)),
            (p + "attn.c_proj.bias", (C,)),
            (p + "ln_2.weight", (C,)),
            (p + "ln_2.bias", (C,)),
            (p + "mlp.c_fc.weight", (4 * C, C)),
            (p + "mlp.c_fc.bias", (4 * C,)),
            (p + "mlp.c_proj.weight", (C, 4 * C)),
            (p + "mlp.c_proj.bias", (C,)),
        ]
    out += [("transformer.ln_f.weight", (C,)), ("transformer.ln_f.bias", (C,))]
    return out


def values(t, shape):
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64)
    magnitude = ((t + 1) * 1024 + i).astype(np.float64) * np.exp2(-(6 + i % 5).astype(np.float64))
    sign = np.where((t + i) % 2 == 1, -1.0, 1.0)
    v64 = sign * magnitude
    v32 = v64.astype(np.float32)
    assert np.array_equal(v32.astype(np.float64), v64), "not exact in float32"
    return v32.reshape(shape)


def main():
    tensors = {}
    for t, (name, shape) in enumerate(model_spec_tensors()):
        tensors[name] = values(t, shape)
    assert len(tensors) == 4 + 12 * L
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_gpt_f32.safetensors")
    save_file(tensors, out, metadata=METADATA)
    print(f"wrote {out} ({os.path.getsize(out)} bytes) with python {sys.version.split()[0]}, "
          f"safetensors {safetensors.__version__}, numpy {np.__version__}")


if __name__ == "__main__":
    main()
