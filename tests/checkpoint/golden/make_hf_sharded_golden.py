#!/usr/bin/env python3
"""Writes tests/checkpoint/golden/tiny_llama_hf_sharded/, the golden directory of
tests/checkpoint/hf_layout_test.cc (HfLayoutTest.ShardedDirectoryFromTransformers...).

An implementation independent of libfsdp: Hugging Face `transformers.LlamaForCausalLM`
`save_pretrained` with max_shard_size="4KB", which writes the model's state_dict as
model-0000K-of-0000N.safetensors, model.safetensors.index.json and config.json. The model is
the one of tests/nn/golden/make_llama_golden.py (the same config, seed and values: the script
checks that its state_dict equals tiny_llama_hf_model.safetensors bit for bit), so the test
can compare the import with that file and the loss with tiny_llama_hf.safetensors' out.loss.

Only for producing the fixture: CI and the tests never run Python. To regenerate:

    python3 -m venv /tmp/venv-hf
    /tmp/venv-hf/bin/pip install torch transformers safetensors
    /tmp/venv-hf/bin/python tests/checkpoint/golden/make_hf_sharded_golden.py

The committed directory was produced with the versions written to its VERSIONS file.
"""
import os
import shutil

import safetensors.torch
import torch
import transformers

V, T, L, H, KV, C, F = 32, 8, 2, 4, 2, 16, 24

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
config = transformers.LlamaConfig(
    vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L,
    num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=T,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, hidden_act="silu")
torch.manual_seed(1234)
model = transformers.LlamaForCausalLM(config).float()
with torch.no_grad():  # as make_llama_golden.py
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        else:
            p.copy_(0.3 * torch.randn_like(p))

reference = safetensors.torch.load_file(
    os.path.join(root, "nn", "golden", "tiny_llama_hf_model.safetensors"))
state = model.state_dict()
assert sorted(reference) == sorted(state), "not the model of make_llama_golden.py"
for name, t in state.items():
    assert torch.equal(reference[name], t), f"{name} differs from tiny_llama_hf_model"

out = os.path.join(here, "tiny_llama_hf_sharded")
shutil.rmtree(out, ignore_errors=True)
model.save_pretrained(out, max_shard_size="4KB", safe_serialization=True)
with open(os.path.join(out, "VERSIONS"), "w") as f:
    f.write(f"torch {torch.__version__}\ntransformers {transformers.__version__}\n"
            f"safetensors {safetensors.__version__}\n")
for name in sorted(os.listdir(out)):
    print(name, os.path.getsize(os.path.join(out, name)))
