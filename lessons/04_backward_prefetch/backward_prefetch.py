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

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import NOT_MEASURABLE, world_mesh
from utilities.errors import positive_int
from utilities.measure import gathered_parameter_bytes, unsharded_parameter_bytes
from utilities.measure.predictions import add_prediction_arguments, predict_from_arguments
from utilities.models import get_model_spec
from utilities.prefetch import prefetch_plan, profile_steps
from utilities.results import variant
from utilities.training import TrainStats
from utilities.wrapping import fsdp1_meta_init


# -- FSDP2: prefetching is implicit; explicit lists reach further ahead ----------------------------
def shard_blocks(model: nn.Module, block_class: type[nn.Module],
                 mp_policy: MixedPrecisionPolicy | None = None) -> list[nn.Module]:
    """``fully_shard`` every block, then the root; return the blocks in forward order, the order
    prefetch lists speak of. With nothing more, FSDP2 prefetches implicitly: one block ahead in
    forward, and in backward the block that ran before in forward (BACKWARD_PRE-like).
    ``mp_policy``: none in the lesson's runs (fp32); its cluster prediction passes bf16's."""
    blocks = [m for m in model.modules() if isinstance(m, block_class)]  # T5: encoder, then decoder
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return blocks


def prefetch_ahead(blocks: list[nn.Module], depth: int) -> None:
    """Explicit prefetching ``depth`` blocks ahead. When block i starts its forward it issues the
    all-gathers of blocks i+1..i+depth; backward runs the blocks in reverse, so when block i starts
    its backward it issues those of blocks i-1..i-depth, nearest first. Depth 1 is what FSDP2
    already does; each extra level keeps one more block's parameters unsharded at once."""
    for i, block in enumerate(blocks):
        next_in_forward = blocks[i + 1:i + 1 + depth]
        next_in_backward = blocks[max(0, i - depth):i][::-1]
        if next_in_forward:  # the last blocks have nothing ahead: they keep the implicit default
            block.set_modules_to_forward_prefetch(next_in_forward)
        if next_in_backward:
            block.set_modules_to_backward_prefetch(next_in_backward)


def shard_fsdp2(model: nn.Module, block_class: type[nn.Module], depth: int | None,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """An FSDP2 variant: the blocks and the root sharded, then (``depth``) the explicit lists."""
    blocks = shard_blocks(model, block_class, mp_policy)
    if depth:
        prefetch_ahead(blocks, depth)
    return model


# -- FSDP1: prefetching is two constructor options -------------------------------------------------
def wrap_fsdp1(model: nn.Module, block_class: type[nn.Module], device: torch.device,
               backward_prefetch: BackwardPrefetch | None, forward_prefetch: bool) -> FSDP:
    """One unit per block. ``backward_prefetch`` says when the next unit's all-gather is issued in
    backward (BACKWARD_PRE, the default: before this unit's gradients; BACKWARD_POST: after them;
    None: when the next unit is reached); ``forward_prefetch=True`` also issues the next unit's
    all-gather in forward, following the order recorded in the first forward."""
    on_meta = any(p.is_meta for p in model.parameters())
    return FSDP(model, device_id=device,  # this rank's GPU, or the CPU (else FSDP1 wants a GPU)
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                   transformer_layer_cls={block_class}),
                backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                param_init_fn=fsdp1_meta_init(model, device) if on_meta else None)


# -- the comparison ---------------------------------------------------------------------------------
FSDP1_VARIANTS = {
    "fsdp1-no-prefetch": dict(backward_prefetch=None, forward_prefetch=False),
    "fsdp1-backward-post": dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST, forward_prefetch=False),
    "fsdp1-backward-pre": dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False),
    "fsdp1-pre+forward": dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True),
}
FSDP2_VARIANTS = {"fsdp2-implicit": False, "fsdp2-explicit": True}  # explicit: --prefetch-depth
VARIANTS = [*FSDP1_VARIANTS, *FSDP2_VARIANTS]
NOTES = ("Prefetching changes when all-gathers are issued, never what is computed: every variant's "
         "losses match.",)
CPU_NOTE = ("CPU run: gloo runs each collective synchronously on the calling thread, so nothing "
            "overlaps and step times here cannot show prefetching. The overlap and the exposed "
            "communication time are measured only on GPUs (NCCL kernels on their own stream), with "
            "a profiler trace per variant.")


def predicted_knobs(name: str, depth: int, block_class: type[nn.Module]) -> dict:
    """Each variant as the step-time model's schedule knobs (FSDP1's limit_all_gathers is on by
    default, as in the lesson's FSDP1 runs); an FSDP2 variant is traced through ``shard_fsdp2``
    itself, its ``prefetch`` the schedule of the lists that function registers."""
    fsdp1 = {"fsdp1-no-prefetch": "none", "fsdp1-backward-post": "backward_post",
             "fsdp1-backward-pre": "backward_pre", "fsdp1-pre+forward": "backward_pre"}
    if name in fsdp1:
        return dict(backward_prefetch=fsdp1[name], limit_all_gathers=True,
                    forward_prefetch=1 if name == "fsdp1-pre+forward" else None)
    explicit = depth if FSDP2_VARIANTS[name] else None
    return dict(prefetch=explicit or 1, parallelize=functools.partial(
        shard_fsdp2, block_class=block_class, depth=explicit))


def build(lesson: Lesson, depth: int, name: str) -> nn.Module:
    """The model sharded as variant ``name`` says."""
    block = lesson.spec.block_class()
    if name in FSDP1_VARIANTS:
        return wrap_fsdp1(lesson.build_model(), block, lesson.device, **FSDP1_VARIANTS[name])
    return shard_fsdp2(lesson.build_model(), block, depth if FSDP2_VARIANTS[name] else None)


def describe(lesson: Lesson, args: argparse.Namespace, name: str, model: nn.Module,
             stats: TrainStats) -> dict:
    """What the variant set and what it cost: the FSDP1 options, or the prefetch lists FSDP2
    registered (read back from the model); on GPU (or with --trace) a profile of a few more steps."""
    if name in FSDP1_VARIANTS:
        options = FSDP1_VARIANTS[name]
        prefetch = options["backward_prefetch"]
        extra = {"api": "fsdp1", "backward_prefetch": prefetch.name if prefetch else None,
                 "forward_prefetch": options["forward_prefetch"]}
        summary = prefetch.name if prefetch else "none"
        summary += ", forward" if options["forward_prefetch"] else ""
    else:
        explicit = FSDP2_VARIANTS[name]
        blocks = [m for m in model.modules() if isinstance(m, lesson.spec.block_class())]
        extra = {"api": "fsdp2", "prefetch_depth": args.prefetch_depth if explicit else None,
                 "prefetch_plan": prefetch_plan(blocks)}
        summary = f"explicit, depth {args.prefetch_depth}" if explicit else "implicit"
    extra["prefetch"] = summary
    extra["peak_unsharded_parameter_bytes"] = unsharded_parameter_bytes(stats.peak_memory_bytes)
    # what prefetching adds: blocks gathered ahead wait in their all-gather buffers until they run
    extra["peak_gathered_parameter_bytes"] = gathered_parameter_bytes(stats.peak_memory_bytes)
    if lesson.device.type == "cuda" or args.trace:
        trace = profile_steps(model, lesson.optimizer(model), lesson.data(seed_offset=1), lesson.device,
                              lesson.out / "traces" / f"{name}.rank{lesson.dist.rank}.json")
        extra.update(trace=trace["trace"], **communication_columns(lesson, trace))
    return extra


def communication_columns(lesson: Lesson, trace: dict) -> dict:
    """The profile's communication time and the part no compute overlapped, per step. Over gloo on
    a GPU (ranks sharing one) gloo blocks the host in each collective and launches no NCCL kernel:
    the trace shows no communication, which is not zero communication, so no number is given."""
    if lesson.device.type == "cuda" and not lesson.dist.nccl_on_gpu:
        return {"exposed_comm_s_per_step": NOT_MEASURABLE, "comm_s_per_step": NOT_MEASURABLE}
    return {"exposed_comm_s_per_step": trace["exposed_comm_s_per_step"],
            "comm_s_per_step": trace["comm_s_per_step"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--prefetch-depth", type=positive_int, default=2,
                   help="FSDP2 explicit prefetch: how many blocks ahead to all-gather (default 2)")
    add_prediction_arguments(p, LESSONS["04"].run.gpu_model, LESSONS["04"].run.gpu_batch_size)
    p.add_argument("--trace", action="store_true",
                   help="also record a torch.profiler Chrome trace per variant on CPU (always on GPU)")
    return p.parse(argv)


GLOO_GPU_NOTE = (f"exposed communication {NOT_MEASURABLE}: the collectives run over gloo (ranks "
                 "sharing a GPU), which blocks the host in each one and launches no NCCL kernel, so "
                 "nothing overlaps and the profiler sees no communication kernel. Step times and "
                 "prefetching's overlap need one rank per GPU over NCCL.")


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured, and the prediction where one was made."""
    line = "prefetching never changes the losses"
    predicted = results.get("predicted") or {"variants": []}
    if {"fsdp1-no-prefetch", "fsdp1-backward-pre"} <= {v["name"] for v in predicted["variants"]}:
        none, pre = variant(predicted, "fsdp1-no-prefetch"), variant(predicted, "fsdp1-backward-pre")
        line += (f"; PREDICTED on {predicted['gpus']} GPUs: BACKWARD_PRE "
                 f"{pre['step_s'] * 1e3:.0f} ms vs no prefetch {none['step_s'] * 1e3:.0f} ms per step")
    return line


def main(args: argparse.Namespace) -> None:
    predicted = None
    if args.predict_on != "none":
        block = get_model_spec(args.predict_model).block_class()
        predicted = predict_from_arguments(args, {name: predicted_knobs(name, args.prefetch_depth, block)
                                                  for name in args.variants})
    with Lesson("04", args, settings=dict(prefetch_depth=args.prefetch_depth), notes=NOTES,
                cpu_note=CPU_NOTE, needs_ranks="prefetching (overlap of all-gathers with compute)",
                takeaway=takeaway) as lesson:
        if lesson.device.type == "cuda" and not lesson.dist.nccl_on_gpu:
            lesson.results.note(GLOO_GPU_NOTE)
            lesson.print(f"note: {GLOO_GPU_NOTE}")
        lesson.results.columns("prefetch", "exposed_comm_s_per_step", "peak_gathered_parameter_bytes")
        lesson.run_variants(args.variants, functools.partial(build, lesson, args.prefetch_depth),
                            describe=functools.partial(describe, lesson, args))
        lesson.results.predicted(predicted)


if __name__ == "__main__":
    main(parse_args())
