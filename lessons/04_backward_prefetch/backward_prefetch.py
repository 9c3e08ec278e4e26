"""Lesson 04: backward prefetch (and forward prefetch).

Before a unit computes, FSDP must all-gather its parameters. If the gather starts only when the unit
is needed, the GPU waits for the network. *Prefetching* issues the next unit's all-gather early, so
it runs on the network while the current unit computes. In backward the question is *when* the next
gather is issued:

    FSDP1 backward_prefetch=BACKWARD_PRE   before the current unit's gradient computation
    FSDP1 backward_prefetch=BACKWARD_POST  after it, before its reduce-scatter (less memory, less overlap)
    FSDP1 backward_prefetch=None           only when the next unit is reached (no overlap)
    FSDP1 forward_prefetch=True            also prefetch in forward, from the previous forward's order
    FSDP2 implicit (default)               always BACKWARD_PRE-like, forward prefetch one unit ahead
    FSDP2 explicit, depth N                set_modules_to_forward/backward_prefetch, N units ahead

This script trains the same model on the same data with each setting and records step time, peak
memory and losses. Prefetching changes timing, never numerics: the losses must match. On GPU it also
writes a torch.profiler Chrome trace per variant and reports exposed communication (collective
kernel time with no compute kernel running beside it); on CPU gloo runs collectives synchronously,
so there is no overlap to see (--trace still records a small CPU trace).

Run: fsdp-course run 04 [--quick]   or   torchrun --nproc-per-node 2 backward_prefetch.py --device cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from torch.distributed.fsdp import BackwardPrefetch

from utilities.course.lesson import Lesson, lesson_parser, positive_int
from utilities.measure import fmt_bytes, unsharded_parameter_bytes
from utilities.prefetch import prefetch_plan, profile_steps, set_explicit_prefetch
from utilities.wrapping import shard_model

VARIANTS = {
    # name: (api, FSDP1 options or FSDP2 prefetch mode)
    "fsdp1-no-prefetch": ("fsdp1", dict(backward_prefetch=None)),
    "fsdp1-backward-post": ("fsdp1", dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST)),
    "fsdp1-backward-pre": ("fsdp1", dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE)),
    "fsdp1-pre+forward": ("fsdp1", dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                                        forward_prefetch=True)),
    "fsdp2-implicit": ("fsdp2", "implicit"),
    "fsdp2-explicit": ("fsdp2", "explicit"),
}


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--prefetch-depth", type=positive_int, default=2,
                   help="FSDP2 explicit prefetch: how many blocks ahead to all-gather (default 2)")
    p.add_argument("--trace", action="store_true",
                   help="also record a torch.profiler Chrome trace per variant on CPU (always on GPU)")
    args = p.parse(argv)
    return args


def train_variant(L, name: str, args) -> None:
    """Shard the model the way ``name`` says, train it, and record step time, memory and trace."""
    api, option = VARIANTS[name]
    block = L.spec.block_class()
    fsdp1_options = option if api == "fsdp1" else {}
    model = L.materialize(shard_model(L.build_model(), api=api, block_class=block,
                                      device=L.device, **fsdp1_options))
    extra = {"api": api}
    if api == "fsdp2":
        blocks = [m for m in model.modules() if isinstance(m, block)]  # forward order
        if option == "explicit":
            set_explicit_prefetch(blocks, args.prefetch_depth)
        extra["prefetch_depth"] = args.prefetch_depth if option == "explicit" else None
        extra["prefetch_plan"] = prefetch_plan(blocks)
    else:
        prefetch = fsdp1_options["backward_prefetch"]
        extra["backward_prefetch"] = prefetch.name if prefetch else None
        extra["forward_prefetch"] = fsdp1_options.get("forward_prefetch", False)

    optimizer = L.optimizer(model)
    stats = L.train(model, name, optimizer=optimizer)
    extra["peak_unsharded_parameter_bytes"] = unsharded_parameter_bytes(stats.peak_memory_bytes)
    if L.device.type == "cuda" or args.trace:
        trace = profile_steps(model, optimizer, L.data(seed_offset=1), L.device,
                              L.out / "traces" / f"{name}.rank{L.dist.rank}.json")
        extra["trace"] = trace["trace"]
        extra["exposed_comm_s_per_step"] = trace["exposed_comm_s_per_step"]
        extra["comm_s_per_step"] = trace["comm_s_per_step"]
    L.results.add(name, stats, **extra)
    L.print(f"    peak {fmt_bytes(stats.peak_memory_bytes.get('total'))}, unsharded "
            f"params at peak {fmt_bytes(extra['peak_unsharded_parameter_bytes'])}")


def main(args) -> None:
    with Lesson("04", args,
                settings=dict(prefetch_depth=args.prefetch_depth),
                needs_ranks="prefetching (overlap of all-gathers with compute)") as L:
        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                train_variant(L, name, args)

        L.results.note("Prefetching changes when all-gathers are issued, never what is computed: "
                       "every variant's losses match.")
        if L.device.type != "cuda":
            L.results.note("CPU run: gloo runs each collective synchronously on the calling thread, "
                           "so nothing overlaps and step times here cannot show prefetching. The "
                           "overlap and the exposed communication time are measured only on GPUs "
                           "(NCCL kernels on their own stream), with a profiler trace per variant.")


if __name__ == "__main__":
    main(parse_args())
