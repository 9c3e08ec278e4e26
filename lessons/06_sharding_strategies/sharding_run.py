"""Lesson 06's driver: every strategy's variant trained and measured, beside the formulas of
sharding.py, then the capacity chart and the prediction on a cluster.

The meshes and wrappers are the lesson script's functions (``sharding_strategies.py``, handed in as
``code``); here: which variants run, what is measured around them and how it becomes rows.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from types import SimpleNamespace

import sharding as S
from torch import nn

from utilities.course.lesson import Lesson
from utilities.measure import fmt_bytes, unsharded_parameter_bytes
from utilities.measure.predictions import parse_cluster, predict_from_arguments
from utilities.models import get_model_spec
from utilities.results import variant
from utilities.training import TrainStats

CATEGORIES = ("parameters", "gradients", "optimizer")
NOTES = (
    "resident_bytes: parameters, gradients and optimizer state a rank keeps between steps; "
    "theory_resident_bytes: sharding.bytes_per_param (lessons/06_sharding_strategies/sharding.py).",
    "comm_bytes_per_step (sent_per_step_bytes): bytes one rank sends per step by ring collectives, "
    "from theory (sharding.comm_bytes_per_step), not measured.",
)
CPU_NOTE = ("CPU run: memory from torch.distributed._tools trackers; gloo overlaps nothing, so step "
            "times are only indicative.")
HYBRID_TRAP = ("fsdp1-hybrid-shard on a shard group of 1 rank: FSDP1 falls back to NO_SHARD over that "
               "1-rank group and never averages gradients across the replicas, so the ranks drift "
               "apart (its losses differ); FSDP2's 2-D mesh does reduce across replicas.")


def run_strategies(lesson: Lesson, args: argparse.Namespace, predicted: dict, code: SimpleNamespace) -> None:
    """Every variant on this world's meshes, then the capacity chart and the prediction."""
    lesson.results.columns("strategy", "resident_bytes_per_rank", "peak_unsharded_parameter_bytes",
                           "sent_per_step_bytes")
    world, block = lesson.dist.world_size, lesson.spec.block_class()
    replicate = args.replicate or (2 if world % 2 == 0 else 1)
    lesson.check(world % replicate == 0, "--replicate", replicate, f"divisors of the world size {world}")
    mesh_2d = code.hsdp_mesh(lesson.device.type, replicate, world // replicate)
    d = code.reshard_divisor(world)
    lesson.print(f"HSDP mesh: {replicate} replica(s) x {world // replicate} shard(s); int "
                 f"reshard_after_forward: {d or f'none valid on {world} ranks'}")
    names = [v for v in args.variants if d or v != "fsdp2-reshard-int"]
    if len(names) < len(args.variants):
        lesson.results.note("fsdp2-reshard-int skipped: an int reshard_after_forward must be a "
                            f"non-trivial divisor of the shard world size ({world} has none); "
                            "on 8 GPUs per node x N nodes, 8 keeps the backward all-gather "
                            "inside a node.")
        lesson.print(f"  fsdp2-reshard-int: skipped (no non-trivial divisor of {world})")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP1 and NO_SHARD are deprecated
        lesson.run_variants(
            names, lambda name: code.wrap(name, lesson.build_model(), block, lesson.device, mesh_2d, d),
            describe=lambda name, model, stats: against_theory(lesson, code.VARIANTS, name, stats,
                                                               replicate, d))
    capacity(lesson, args, replicate)
    lesson.results.predicted(predicted)
    if replicate == world and "fsdp1-hybrid-shard" in names:
        lesson.results.note(HYBRID_TRAP)


def against_theory(lesson: Lesson, variants: dict, name: str, stats: TrainStats, replicate: int,
                   reshard_to: int | None) -> dict:
    """What variant ``name`` kept between steps and at its peak, beside the formulas of sharding.py."""
    api, strategy = variants[name]
    world, n = lesson.dist.world_size, lesson.spec.num_parameters
    peak = stats.peak_memory_bytes
    resident = peak["detail"]["resident_after_step"]
    theory = S.bytes_per_param(strategy, world, replicate=replicate, reshard_to=reshard_to)
    expected = {k: getattr(theory, k) * n for k in CATEGORIES}
    comm = S.comm_bytes_per_step(strategy, world, n, replicate=replicate, reshard_to=reshard_to)
    lesson.print(f"    kept params/grads/optim {' / '.join(fmt_bytes(resident[k]) for k in CATEGORIES)} "
                 f"(theory {' / '.join(fmt_bytes(expected[k]) for k in CATEGORIES)}); sends "
                 f"{fmt_bytes(sum(comm.values()))} per step")
    return dict(api=api, strategy=strategy, resident_bytes=resident,
                resident_bytes_per_rank=sum(resident[k] for k in CATEGORIES),
                theory_resident_bytes=expected,
                peak_unsharded_parameter_bytes=unsharded_parameter_bytes(peak) or 0,
                all_gather_bytes=peak["detail"].get("all_gather"),
                comm_bytes_per_step=sum(comm.values()), sent_per_step_bytes=sum(comm.values()),
                comm_breakdown=comm, mesh=[replicate, world // replicate] if strategy == "hybrid_shard"
                else [world])


def capacity(lesson: Lesson, args: argparse.Namespace, replicate: int) -> None:
    """The largest model per strategy on --gpus GPUs, from the bytes per parameter measured here."""
    n = lesson.spec.num_parameters
    measured = {v["name"]: S.PerParam(*(v["resident_bytes"][k] / n for k in CATEGORIES),
                                      v["peak_unsharded_parameter_bytes"] / n)
                for v in lesson.results.data["variants"]}
    cap = lesson.results.record("capacity", S.capacity(measured, lesson.dist.world_size, replicate,
                                                       args.gpus, args.gpu_mem_gb * 1e9,
                                                       args.activation_gb * 1e9))
    lesson.print(f"\nlargest model on {args.gpus} GPUs x {args.gpu_mem_gb:g} GB "
                 f"({args.activation_gb:g} GB kept for activations), from measured bytes/param:")
    for row in cap["at_gpus"]:
        lesson.print(f"  {row['strategy']:14s} {row['bytes_per_param']:6.2f} B/param -> "
                     f"{row['largest_model'] / 1e9:6.2f} B parameters")


def predicted_knobs(code: SimpleNamespace, name: str, block_class: type[nn.Module],
                    gpus_per_node: int) -> dict:
    """Each variant as the step-time model's strategy (FSDP1 and FSDP2 alike: same collectives);
    an FSDP2 variant is traced through ``shard_fsdp2`` itself, as the variant calls it (its int
    reshard_after_forward: one node's ranks, re-gathered within a node, timed as full_shard)."""
    api, strategy = code.VARIANTS[name]
    knobs = dict(strategy={"ddp": "no_shard", "reshard_to": "full_shard"}.get(strategy, strategy),
                 limit_all_gathers=api == "fsdp1")
    if api == "fsdp2":
        reshard = {"full_shard": True, "shard_grad_op": False, "reshard_to": gpus_per_node}.get(strategy)
        knobs["parallelize"] = functools.partial(code.shard_fsdp2, block_class=block_class,
                                                 reshard_after_forward=reshard)
    return knobs


def prediction(args: argparse.Namespace, code: SimpleNamespace) -> dict | None:
    """The variants predicted on ``--predict-on`` (``predict_from_arguments``)."""
    if args.predict_on == "none":
        return None
    block = get_model_spec(args.predict_model).block_class()
    per_node = parse_cluster(args.predict_on).gpus_per_node
    return predict_from_arguments(args, {n: predicted_knobs(code, n, block, per_node) for n in args.variants})


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    ddp, full = variant(results, "ddp"), variant(results, "fsdp2-reshard-true")
    d, f = ddp["resident_bytes_per_rank"], full["resident_bytes_per_rank"]
    return (f"state held per rank: DDP {fmt_bytes(d)} -> FULL_SHARD {fmt_bytes(f)} "
            f"({d / f:.1f}x less on {results['world_size']} ranks), for "
            f"{full['sent_per_step_bytes'] / ddp['sent_per_step_bytes']:.1f}x the bytes sent per step")
