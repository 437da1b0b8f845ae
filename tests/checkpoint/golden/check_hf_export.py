#!/usr/bin/env python3
"""Loads a directory written by libfsdp (ExportSafetensorsDirectory, train_gpt --export_hf_dir)
with transformers' LlamaForCausalLM.from_pretrained, as a user of the export would, and checks:
no tensor missing, unexpected or of another shape; every parameter bitwise the directory's
safetensors data; a forward pass on fixed tokens gives a finite loss (printed).

Outside CI, with the reference packages (see make_hf_sharded_golden.py):

    build/examples/train_gpt --config llama-mini --steps 3 --export_hf_dir /tmp/hf-mini \\
        --export_max_file_mb 10
    /tmp/venv-hf/bin/python tests/checkpoint/golden/check_hf_export.py /tmp/hf-mini
"""
import json
import os
import sys

import safetensors.torch
import torch
import transformers

path = sys.argv[1]
model, info = transformers.LlamaForCausalLM.from_pretrained(
    path, output_loading_info=True, dtype=torch.float32)
problems = {k: v for k, v in info.items() if v}
assert not problems, f"from_pretrained: {problems}"
index_path = os.path.join(path, "model.safetensors.index.json")
if os.path.exists(index_path):
    with open(index_path) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
else:
    files = ["model.safetensors"]
stored = {}
for name in files:
    stored.update(safetensors.torch.load_file(os.path.join(path, name)))
state = model.state_dict()
assert sorted(stored) == sorted(state), "the tensors differ"
for name, t in state.items():
    assert torch.equal(stored[name].to(t.dtype), t), f"{name}: not the file's values"
g = torch.Generator().manual_seed(0)
V, T = model.config.vocab_size, min(64, model.config.max_position_embeddings)
idx = torch.randint(0, V, (2, T), generator=g)
with torch.no_grad():
    logits = model(input_ids=idx).logits
loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1))
assert torch.isfinite(loss), "the forward pass is not finite"
print(f"{path}: {len(files)} file(s), {len(state)} tensors loaded by LlamaForCausalLM "
      f"(transformers {transformers.__version__}), bitwise the files; loss on random tokens "
      f"{loss.item():.4f}")
