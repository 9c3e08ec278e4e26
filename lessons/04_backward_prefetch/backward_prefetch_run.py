"""Lesson 04's driver: each prefetch variant trained, what it set read back, profiled on a GPU (or
with --trace), and the prediction on a cluster.

The sharding, the prefetch lists and FSDP1's options are the lesson script's (``backward_prefetch.py``,
handed in as ``code``); here: what is measured around them and how it becomes rows.
"""

from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

from torch import nn

from utilities.course.lesson import Lesson
from utilities.distributed import NOT_MEASURABLE
from utilities.measure import gathered_parameter_bytes, unsharded_parameter_bytes
from utilities.measure.predictions import predict_from_arguments
from utilities.models import get_model_spec
from utilities.prefetch import prefetch_plan, profile_steps
from utilities.results import variant
from utilities.training import TrainStats

GLOO_GPU_NOTE = (f"exposed communication {NOT_MEASURABLE}: the collectives run over gloo (ranks "
                 "sharing a GPU), which blocks the host in each one and launches no NCCL kernel, so "
                 "nothing overlaps and the profiler sees no communication kernel. Step times and "
                 "prefetching's overlap need one rank per GPU over NCCL.")


def run_prefetch_variants(lesson: Lesson, args: argparse.Namespace, predicted: dict | None,
                          code: SimpleNamespace) -> None:
    """Each variant, its prefetch read back and (GPU, --trace) profiled; then the prediction."""
    if lesson.device.type == "cuda" and not lesson.dist.nccl_on_gpu:
        lesson.results.note(GLOO_GPU_NOTE)
        lesson.print(f"note: {GLOO_GPU_NOTE}")
    lesson.results.columns("prefetch", "exposed_comm_s_per_step", "peak_gathered_parameter_bytes")
    lesson.run_variants(args.variants, functools.partial(code.build, lesson, args.prefetch_depth),
                        describe=functools.partial(describe, lesson, code, args))
    lesson.results.predicted(predicted)


def describe(lesson: Lesson, code: SimpleNamespace, args: argparse.Namespace, name: str, model: nn.Module,
             stats: TrainStats) -> dict:
    """What the variant set and what it cost: the FSDP1 options, or the prefetch lists FSDP2
    registered (read back from the model); on GPU (or with --trace) a profile of a few more steps."""
    if name in code.FSDP1_VARIANTS:
        options = code.FSDP1_VARIANTS[name]
        prefetch = options["backward_prefetch"]
        extra = {"api": "fsdp1", "backward_prefetch": prefetch.name if prefetch else None,
                 "forward_prefetch": options["forward_prefetch"]}
        summary = prefetch.name if prefetch else "none"
        summary += ", forward" if options["forward_prefetch"] else ""
    else:
        explicit = code.FSDP2_VARIANTS[name]
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


def predicted_knobs(code: SimpleNamespace, name: str, depth: int, block_class: type[nn.Module]) -> dict:
    """Each variant as the step-time model's schedule knobs (FSDP1's limit_all_gathers is on by
    default, as in the lesson's FSDP1 runs); an FSDP2 variant is traced through ``shard_fsdp2``
    itself, its ``prefetch`` the schedule of the lists that function registers."""
    fsdp1 = {"fsdp1-no-prefetch": "none", "fsdp1-backward-post": "backward_post",
             "fsdp1-backward-pre": "backward_pre", "fsdp1-pre+forward": "backward_pre"}
    if name in fsdp1:
        return dict(backward_prefetch=fsdp1[name], limit_all_gathers=True,
                    forward_prefetch=1 if name == "fsdp1-pre+forward" else None)
    explicit = depth if code.FSDP2_VARIANTS[name] else None
    return dict(prefetch=explicit or 1, parallelize=functools.partial(
        code.shard_fsdp2, block_class=block_class, depth=explicit))


def prediction(args: argparse.Namespace, code: SimpleNamespace) -> dict | None:
    """The variants predicted on ``--predict-on`` (``predict_from_arguments``)."""
    predicted = None
    if args.predict_on != "none":
        block = get_model_spec(args.predict_model).block_class()
        predicted = predict_from_arguments(args, {
            name: predicted_knobs(code, name, args.prefetch_depth, block) for name in args.variants})
    return predicted


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured, and the prediction where one was made."""
    line = "prefetching never changes the losses"
    predicted = results.get("predicted") or {"variants": []}
    if {"fsdp1-no-prefetch", "fsdp1-backward-pre"} <= {v["name"] for v in predicted["variants"]}:
        none, pre = variant(predicted, "fsdp1-no-prefetch"), variant(predicted, "fsdp1-backward-pre")
        line += (f"; PREDICTED on {predicted['gpus']} GPUs: BACKWARD_PRE "
                 f"{pre['step_s'] * 1e3:.0f} ms vs no prefetch {none['step_s'] * 1e3:.0f} ms per step")
    return line
