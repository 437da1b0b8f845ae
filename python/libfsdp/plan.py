"""python3 -m libfsdp.plan: the memory planner's table for one configuration, e.g.

    python3 -m libfsdp.plan --model llama2-70b --world 32 --ranks_per_host 8 \\
        --strategy HYBRID_SHARD --param_dtype bf16 --seq 4096 --checkpoint_every 1 \\
        --device_memory 80GiB

Exit codes: 0 planned (whether or not it fits; the table says), 2 bad usage (a message on
stderr saying what to fix), 1 another error of the library.
"""

import argparse
import sys
import types

from ._capi import Code, FsdpError, LibraryNotFoundError, Offload, Strategy
from ._planner import format_plan, parse_bytes

_FLOAT_DTYPES = ("f32", "bf16", "f16")


def _choice(names, what):
    """An argparse type accepting `names` case-insensitively."""
    lowered = {n.lower(): n for n in names}

    def parse(text):
        try:
            return lowered[text.strip().lower()]
        except KeyError:
            raise argparse.ArgumentTypeError(
                "%s %r: allowed %s" % (what, text, ", ".join(names))) from None
    return parse


def _bytes(text):
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text):
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError("%r: give an integer >= 1" % text)
    return v


def _non_negative(text):
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError("%r: give an integer >= 0" % text)
    return v


def _checkpoint(text):
    """fsdp_plan's --checkpoint: off, all (every block) or k (blocks 0, k, 2k, ...)."""
    t = text.strip().lower()
    if t == "off":
        return 0
    if t == "all":
        return 1
    try:
        v = int(t)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError("%r: allowed off, all or a block interval >= 1" % text)
    return v


def _flag(parser, name, **kwargs):
    # Underscored like fsdp_plan's flags; the dashed spelling is accepted too.
    names = ["--" + name] + (["--" + name.replace("_", "-")] if "_" in name else [])
    parser.add_argument(*names, dest=name, **kwargs)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python3 -m libfsdp.plan", allow_abbrev=False,
        description="How much device memory one rank of a sharded training run needs, by "
                    "category (libfsdp's planner, the fsdp_plan tool's table).")
    _flag(p, "model", default="nano",
          help="nano, mini, gpt2, gpt2-medium, gpt2-xl, llama-nano, llama-mini, llama2-7b, "
               "llama2-13b or llama2-70b (default nano)")
    _flag(p, "world", type=_positive, default=1, help="data-parallel ranks in all (default 1)")
    _flag(p, "ranks_per_host", type=_non_negative, default=0,
          help="ranks per host; must divide --world (0: all on one host)")
    _flag(p, "strategy", type=_choice([s.name for s in Strategy], "strategy"),
          default="FULL_SHARD", help=", ".join(s.name for s in Strategy))
    _flag(p, "hybrid_shard_size", type=_non_negative, default=0,
          help="HYBRID strategies: ranks per shard group (0: --ranks_per_host)")
    _flag(p, "param_dtype", type=_choice(_FLOAT_DTYPES, "dtype"), default="f32",
          help="f32, bf16 or f16: the dtype parameters are gathered in")
    _flag(p, "reduce_dtype", type=_choice(_FLOAT_DTYPES, "dtype"), default="f32",
          help="f32, bf16 or f16: the dtype gradients are reduced in")
    ckpt = p.add_mutually_exclusive_group()
    _flag(ckpt, "checkpoint_every", type=_non_negative, default=None,
          help="activation checkpointing every k blocks (0: off; 1: every block)")
    _flag(ckpt, "checkpoint", type=_checkpoint, default=None,
          help="as fsdp_plan's: off, all or k (same as --checkpoint_every)")
    _flag(p, "batch", type=_positive, default=1, help="micro-batch size: sequences per rank")
    _flag(p, "seq", type=_non_negative, default=0,
          help="sequence length (0: the model's block size)")
    _flag(p, "micro_batches", type=_positive, default=1, help="micro-batches per step")
    _flag(p, "device_memory", type=_bytes, default=0,
          help="device memory per rank, e.g. 80GiB, 80GB, 40960MiB (0: unknown, no fit check)")
    _flag(p, "offload", type=_choice([o.name.lower() for o in Offload], "offload"),
          default="none", help="none, optimizer or all")
    _flag(p, "offload_budget", type=_bytes, default=None,
          help="--offload optimizer|all: host memory per rank the offload may take, e.g. 20GiB "
               "(default: every unit)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.offload_budget is not None and args.offload == "none":
        parser.error("--offload_budget needs --offload optimizer or all")
    checkpoint_every = args.checkpoint_every if args.checkpoint_every is not None else (
        args.checkpoint if args.checkpoint is not None else 0)
    try:
        text = format_plan(
            args.model, args.world, ranks_per_host=args.ranks_per_host,
            strategy=args.strategy, hybrid_shard_size=args.hybrid_shard_size,
            param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype,
            checkpoint_every=checkpoint_every, batch_size=args.batch, seq_len=args.seq,
            micro_batches=args.micro_batches, device_memory_bytes=args.device_memory,
            offload=args.offload, offload_budget_bytes=args.offload_budget)
    except FsdpError as e:
        if e.code == Code.INVALID_ARGUMENT:
            parser.error(e.message)  # a request the planner refuses: bad usage, exit 2
        print("%s: %s" % (parser.prog, e), file=sys.stderr)
        return 1
    except LibraryNotFoundError as e:
        print("%s: %s" % (parser.prog, e), file=sys.stderr)
        return 1
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


class _PlanModule(types.ModuleType):
    """Importing this submodule sets the package's attribute `plan` to the module, hiding the
    function libfsdp.plan(...); calling the module calls that function, so both keep working."""

    def __call__(self, *args, **kwargs):
        from ._planner import plan
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _PlanModule

if __name__ == "__main__":
    sys.exit(main())
