"""Lesson 01: transformer auto-wrap.

FSDP shards every parameter across ranks, and before a module runs it all-gathers the full
parameters of its *unit*. If the whole model is one unit, every rank holds every full weight during
forward and backward: sharding saved nothing at the peak. Wrapping each transformer block as its own
unit means only the block being computed (and the one being prefetched) is ever unsharded.

This script trains the same model, on the same data, wrapped five ways, and measures for each: the
number of FSDP units, the largest unit, the peak of unsharded parameters, the peak memory by
category and the step time.

    fsdp2-one-unit     wrap_fsdp2(model)                               fully_shard(model) only
    fsdp2-per-block    wrap_fsdp2(model, is_block)                     fully_shard(block)..., root
    fsdp1-one-unit     wrap_fsdp1(model, None)                         FullyShardedDataParallel(model)
    fsdp1-per-block    wrap_fsdp1(model, block_policy(Block))          transformer_auto_wrap_policy
    fsdp1-size-based   wrap_fsdp1(model, size_policy(--min-params))    size_based_auto_wrap_policy
    fsdp2-yours        wrap_fsdp2(model, your is_unit)                 with --unit-classes A,B

Run: fsdp-course run 01 [--quick]   or   torchrun --nproc-per-node 2 auto_wrap.py --device cpu
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from auto_wrap_run import run_wrappings, takeaway

from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.errors import positive_int
from utilities.models import get_model_spec
from utilities.wrapping import fsdp1_meta_init


# -- FSDP2: you pick the units, one fully_shard call per unit --------------------------------------
def wrap_fsdp2(model: nn.Module, is_unit: Callable[[nn.Module], bool] | None = None) -> nn.Module:
    """Each ``fully_shard`` call makes one unit: the parameters it gathers at once. The modules
    ``is_unit`` picks get theirs, inner ones first (a unit takes the parameters no unit inside it
    has taken); the root's call takes what is left (embeddings, final norms, the head).
    ``is_unit=None``: one unit for the whole model."""
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    if is_unit is not None:
        for module in reversed(list(model.modules())):  # reversed: inner modules before outer ones
            if module is not model and is_unit(module):
                fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# -- FSDP1: one wrapper call; an auto-wrap policy picks the units ---------------------------------
def block_policy(block_class: type[nn.Module]) -> Callable[..., bool]:
    """Every instance of the transformer block class becomes a unit: what you want."""
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_class})


def size_policy(min_params: int) -> Callable[..., bool]:
    """Any subtree holding ``min_params`` parameters not yet in a unit becomes one: the naive
    alternative, which knows nothing of blocks and cuts across them."""
    return functools.partial(size_based_auto_wrap_policy, min_num_params=min_params)


def wrap_fsdp1(model: nn.Module, policy: Callable[..., bool] | None, device: torch.device) -> FSDP:
    """``policy=None``: one unit for the whole model. ``device_id`` is this rank's GPU, or the CPU
    (without it FSDP1 looks for an accelerator). A model built on the meta device (too big for one
    host) gets memory and its weights unit by unit, just before FSDP1 shards that unit."""
    on_meta = any(p.is_meta for p in model.parameters())
    return FSDP(model, auto_wrap_policy=policy, device_id=device,  # meta: to_empty + the model's init
                param_init_fn=fsdp1_meta_init(model, device) if on_meta else None)


# -- the comparison: the calls above, side by side, with the model's block class ------------------
def variants(block_class: type[nn.Module], min_params: int, device: torch.device,
             unit_classes: list[str] | None = None) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """Each variant's wrapping: the calls above, with the model's block class; with
    ``unit_classes`` also yours: one unit per module of those classes (the notebook's policy)."""
    def is_block(module: nn.Module) -> bool:
        return isinstance(module, block_class)

    def is_yours(module: nn.Module) -> bool:
        return type(module).__name__ in (unit_classes or ())

    fsdp1 = functools.partial(wrap_fsdp1, device=device)
    yours = {"fsdp2-yours": functools.partial(wrap_fsdp2, is_unit=is_yours)} if unit_classes else {}
    return {
        "fsdp2-one-unit": wrap_fsdp2,
        "fsdp2-per-block": functools.partial(wrap_fsdp2, is_unit=is_block),
        "fsdp1-one-unit": functools.partial(fsdp1, policy=None),
        "fsdp1-per-block": functools.partial(fsdp1, policy=block_policy(block_class)),
        "fsdp1-size-based": functools.partial(fsdp1, policy=size_policy(min_params)),
        **yours,
    }


# -- the lesson run -------------------------------------------------------------------------------
VARIANTS = tuple(variants(nn.Module, 1, torch.device("cpu")))  # the names, for --variants
NOTES = ("peak_unsharded_parameter_bytes: all-gathered parameters alive at the memory peak; one "
         "unit means the whole model is gathered at once.",)
CPU_NOTE = ("CPU run: memory from torch.distributed._tools trackers; step times on CPU include no "
            "communication overlap and are only indicative.")


def main(args: argparse.Namespace) -> None:
    with Lesson("01", args, needs_ranks="how wrapping bounds the unsharded parameters at the peak",
                notes=NOTES, cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        run_wrappings(lesson, args, SimpleNamespace(**globals()))  # the wrappings above, measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--min-params", type=positive_int, default=None,
                   help="size-based policy threshold in parameters (default: half a block)")
    p.add_argument("--unit-classes", default=None, type=lambda text: [c.strip() for c in text.split(",")
                                                                     if c.strip()],
                   help="your own FSDP2 policy: one unit per module of these classes (comma-"
                        "separated names, e.g. T5Block,T5LayerFF), run as variant fsdp2-yours")
    args = p.parse(argv)
    if args.unit_classes:  # the lesson's models of one family share their class names
        spec = get_model_spec(args.model or LESSONS["01"].run.cpu_model)
        present = {type(m).__name__ for m in spec.build("meta").modules()}
        unknown = [name for name in args.unit_classes if name not in present]
        if unknown:
            p.exit(2, f"error: --unit-classes {unknown[0]!r} is not allowed; allowed: module classes "
                      f"of {spec.name}: {', '.join(sorted(present))}\n")
    return args


if __name__ == "__main__":
    main(parse_args())
