#!/usr/bin/env python3
"""Writes the golden files of the Llama tests:
- tiny_llama_hf.safetensors (tests/nn/llama_test.cc, LlamaHuggingFaceTest), and
- tiny_llama_hf_model.safetensors (tests/checkpoint/safetensors_test.cc): the model's
  state_dict alone, as `save_pretrained` stores a model, for the import into libfsdp.

An implementation independent of libfsdp: Hugging Face `transformers.LlamaForCausalLM` in
float32 (eager attention) with grouped-query attention, run forward and backward on fixed
tokens. The file holds the model's parameters under their Hugging Face names, the tokens, the
logits, the mean cross-entropy and every parameter's gradient:

    <name>            a parameter, as in model.state_dict()
    grad.<name>       d loss / d parameter
    tokens.idx        int32 [B, T] inputs      tokens.tgt   int32 [B, T] targets
    out.logits        float32 [B, T, V]        out.loss     float32 [1]

The loss is the mean cross-entropy of the logits against tokens.tgt over all B*T positions
(MODEL_SPEC.md), computed from the logits here, not by the model's own label shifting.

Only for producing the fixture: CI and the tests never run Python. To regenerate:

    python3 -m venv /tmp/venv-hf
    /tmp/venv-hf/bin/pip install torch transformers safetensors
    /tmp/venv-hf/bin/python tests/nn/golden/make_llama_golden.py

The committed file was produced with the versions printed in its metadata.
"""
import os

import safetensors.torch
import torch
import transformers

V, T, L, H, KV, C, F, B = 32, 8, 2, 4, 2, 16, 24, 2

config = transformers.LlamaConfig(
    vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L,
    num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=T,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, hidden_act="silu")
config._attn_implementation = "eager"
torch.manual_seed(1234)
model = transformers.LlamaForCausalLM(config).float()
with torch.no_grad():  # values well away from the init: norm weights near 1, weights ~0.3
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        else:
            p.copy_(0.3 * torch.randn_like(p))
g = torch.Generator().manual_seed(99)
idx = torch.randint(0, V, (B, T), generator=g)
tgt = torch.randint(0, V, (B, T), generator=g)
logits = model(input_ids=idx).logits
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))
loss.backward()

out = {}
for name, p in model.named_parameters():
    out[name] = p.detach().contiguous()
    out["grad." + name] = p.grad.detach().contiguous()
out["tokens.idx"] = idx.to(torch.int32)
out["tokens.tgt"] = tgt.to(torch.int32)
out["out.logits"] = logits.detach().contiguous()
out["out.loss"] = loss.detach().reshape(1)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_llama_hf.safetensors")
safetensors.torch.save_file(out, path, metadata={
    "torch": torch.__version__, "transformers": transformers.__version__,
    "config": f"V={V} T={T} L={L} H={H} Hkv={KV} C={C} F={F} B={B}"})
model_path = os.path.join(os.path.dirname(path), "tiny_llama_hf_model.safetensors")
safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                            model_path, metadata={"format": "pt"})
print(f"wrote {model_path}")
print(f"wrote {path}: loss {loss.item():.6f}, {len(out)} tensors")
