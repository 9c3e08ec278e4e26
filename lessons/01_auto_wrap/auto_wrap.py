"""Lesson 01: transformer auto-wrap.

FSDP shards every parameter across ranks, and before a module runs it all-gathers the full
parameters of its *unit*. If the whole model is one unit, every rank holds every full weight during
forward and backward: sharding saved nothing at the peak. Wrapping each transformer block as its own
unit means only the block being computed (and the one being prefetched) is ever unsharded.

This script trains the same model, on the same data, wrapped five ways, and measures for each: the
number of FSDP units, the largest unit, the peak of unsharded parameters, the peak memory by
category and the step time.

    FSDP2: fully_shard(model)                           one unit
    FSDP2: fully_shard(block) for each block, then root  one unit per block
    FSDP1: FullyShardedDataParallel(model)               one unit
    FSDP1: transformer_auto_wrap_policy(block class)     one unit per block
    FSDP1: size_based_auto_wrap_policy(min params)       the naive alternative

Run: fsdp-course run 01 [--quick]   or   torchrun --nproc-per-node 2 auto_wrap.py --device cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities.course.lesson import Lesson, lesson_parser, positive_int
from utilities.measure import fmt_bytes, unsharded_parameter_bytes
from utilities.wrapping import fsdp_units, shard_model, unit_parameter_counts

VARIANTS = {
    # name: (api, policy)
    "fsdp2-one-unit": ("fsdp2", "whole"),
    "fsdp2-per-block": ("fsdp2", "block"),
    "fsdp1-one-unit": ("fsdp1", "whole"),
    "fsdp1-per-block": ("fsdp1", "block"),
    "fsdp1-size-based": ("fsdp1", "size"),
}


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--min-params", type=positive_int, default=None,
                   help="size-based policy threshold in parameters (default: half a block)")
    return p.parse(argv)


def main(args) -> None:
    with Lesson("01", args,
                needs_ranks="how wrapping bounds the unsharded parameters at the peak") as L:
        block = L.spec.block_class()
        block_params = sum(p.numel() for p in next(m for m in L.spec.build("meta").modules()
                                                   if isinstance(m, block)).parameters())
        min_params = args.min_params or block_params // 2
        L.print(f"block class: {block.__name__} ({block_params:,} parameters per block)")

        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                api, policy = VARIANTS[name]
                model = shard_model(L.build_model(), api=api, block_class=block, policy=policy,
                                    device=L.device, min_num_params=min_params)
                model = L.materialize(model)
                units = unit_parameter_counts(model)
                stats = L.train(model, name)
                unsharded = unsharded_parameter_bytes(stats.peak_memory_bytes)
                L.results.add(name, stats, api=api, policy=policy, fsdp_units=len(fsdp_units(model)),
                              largest_unit_parameters=max(units), peak_unsharded_parameter_bytes=unsharded)
                L.print(f"    {len(units)} units, largest {max(units):,} params, unsharded params at "
                        f"peak {fmt_bytes(unsharded)}")
                del model

        L.results.note("peak_unsharded_parameter_bytes: all-gathered parameters alive at the "
                       "memory peak; one unit means the whole model is gathered at once.")
        if L.device.type == "cpu":
            L.results.note("CPU run: memory from torch.distributed._tools trackers; step times on "
                           "CPU include no communication overlap and are only indicative.")


if __name__ == "__main__":
    main(parse_args())
