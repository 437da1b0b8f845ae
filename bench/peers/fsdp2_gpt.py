"""The GPT of MODEL_SPEC.md trained with PyTorch FSDP2 (`fully_shard` per block, then the
root) on CPU ranks over gloo: the peer that bench/peers/run.sh runs next to train_gpt.

Prints one JSON line on rank 0: the median step time over the measured steps (after the
warm-up), tokens/s from it, and the last loss. Same model, data (the embedded corpus as
bytes), optimizer (AdamW, MODEL_SPEC.md's defaults and decay groups), clipping (1.0) and
shapes as `train_gpt --config NAME --batch B --seq T --ranks N`.

    python fsdp2_gpt.py --config mini --batch 8 --seq 256 --ranks 2 --threads 1 --dtype f32
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

CONFIGS = {  # V, block T, L, H, C (MODEL_SPEC.md)
    "nano": (256, 64, 2, 2, 64),
    "mini": (256, 256, 6, 6, 384),
    "gpt2": (50304, 1024, 12, 12, 768),
}


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(C, 3 * C)
        self.attn.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(C, 4 * C)
        self.mlp.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, block, L, H, C):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(V, C)
        self.transformer.wpe = nn.Embedding(block, C)
        self.transformer.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.transformer.ln_f = nn.LayerNorm(C, eps=1e-5)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or "ln_f" in name:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T))
        for block in self.transformer.h:
            x = block(x)
        logits = F.linear(self.transformer.ln_f(x), self.transformer.wte.weight)  # tied lm_head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def worker(rank, args, port, corpus):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(args.seed)
    model = GPT(*CONFIGS[args.config])
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
        reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    local_batch = args.batch // args.ranks
    times, loss = [], float("nan")
    for step in range(args.warmup + args.steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (local_batch,), generator=gen)
        chunk = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()])
        t0 = time.perf_counter()
        loss_t = model(chunk[:, :-1], chunk[:, 1:])
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss_t.item()  # the step is done on every rank once its loss is on the host
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        step_s = statistics.median(times)
        print(json.dumps({
            "impl": "pytorch-fsdp2", "torch": torch.__version__, "dtype": args.dtype,
            "config": args.config, "ranks": args.ranks, "threads": args.threads,
            "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "step_ms": round(step_s * 1e3, 2),
            "tok_s": round(args.batch * args.seq / step_s, 1), "loss": round(loss, 4)}),
            flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mini", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--corpus", required=True, help="text file the batches are drawn from")
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args()
    if args.batch % args.ranks:
        ap.error("--batch must be a multiple of --ranks")
    with open(args.corpus, "rb") as f:
        corpus = f.read()
    mp.spawn(worker, args=(args, args.port, corpus), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
