"""Lesson 06: sharding strategies.

A data-parallel rank keeps three kinds of training state per parameter: the parameter, its gradient
and the optimizer state (fp32 + AdamW: 4 + 4 + 8 = 16 bytes). The strategies differ in how much of
it each rank holds, and in how many bytes each step sends:

    ddp                  DistributedDataParallel: every rank holds all 16 bytes; all-reduce
    fsdp1-no-shard       FSDP1 NO_SHARD: the same as DDP (deprecated: use DDP)
    fsdp1-full-shard     FSDP1 FULL_SHARD: everything / world size; gathers twice per step
    fsdp1-shard-grad-op  FSDP1 SHARD_GRAD_OP: keeps full parameters from forward to backward
    fsdp1-hybrid-shard   FSDP1 HYBRID_SHARD on a 2-D mesh (replicate x shard); on a 1-rank
                         shard group FSDP1 falls back to NO_SHARD and stops syncing replicas
    fsdp2-reshard-true   fully_shard(reshard_after_forward=True)   (= FULL_SHARD)
    fsdp2-reshard-false  fully_shard(reshard_after_forward=False)  (= SHARD_GRAD_OP)
    fsdp2-reshard-int    fully_shard(reshard_after_forward=d), d a non-trivial divisor of the
                         world size (none exists on 2 ranks: the variant is then skipped)
    fsdp2-hsdp           fully_shard(mesh=2-D DeviceMesh (replicate, shard))

For each it measures the per-rank parameter, gradient and optimizer bytes kept between steps, the
peak by category, and compares them with the formulas in sharding.py (beside this script); it also
computes the bytes each step communicates and, from the measured bytes per parameter, the largest
model each strategy can train on --gpus GPUs of --gpu-mem-gb GB (results.json key "capacity").

Run: fsdp-course run 06 [--quick]   or   torchrun --nproc-per-node 2 sharding_strategies.py --device cpu
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import sharding as S
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.nn.parallel import DistributedDataParallel as DDP

from utilities.course.catalog import LESSONS
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.errors import positive_float, positive_int
from utilities.measure import fmt_bytes, unsharded_parameter_bytes
from utilities.measure.predictions import add_prediction_arguments, parse_cluster, predict_from_arguments
from utilities.models import get_model_spec
from utilities.results import variant
from utilities.training import TrainStats
from utilities.wrapping import fsdp1_meta_init


# -- the code this lesson teaches -----------------------------------------------------------------
def hsdp_mesh(device_type: str, replicate: int, shard: int) -> DeviceMesh:
    """Hybrid sharding's 2-D mesh. Dim 0 replicates: each group along it holds a full copy of the
    (sharded) state, and the groups all-reduce gradients. Dim 1 shards: its ranks split the state
    and all-gather / reduce-scatter among themselves. Put it inside a node, replicate across nodes."""
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def shard_fsdp2(model: nn.Module, block_class: type[nn.Module], mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """FSDP2 names the strategy with two arguments of ``fully_shard``, on each block and the root:

        reshard_after_forward=True    FULL_SHARD: free a block's gathered weights after its forward
        reshard_after_forward=False   SHARD_GRAD_OP: keep them until its backward (one gather less)
        reshard_after_forward=d       keep a 1/d copy: the backward gathers over d ranks only
        mesh=2-D (replicate, shard)   HYBRID_SHARD
        None                          fully_shard's default: True, but the root keeps its weights
                                      (backward starts with it; older torch, 2.6, reshards it too)

    ``mp_policy``: none in the lesson's runs (fp32); its cluster prediction passes bf16's.
    """
    options = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for module in model.modules():
        if isinstance(module, block_class):
            fully_shard(module, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def shard_fsdp1(model: nn.Module, block_class: type[nn.Module], strategy: ShardingStrategy,
                device: torch.device, mesh: DeviceMesh | None = None) -> nn.Module:
    """FSDP1 names the strategy with one enum; HYBRID_SHARD takes the same 2-D mesh (or builds its
    groups itself from ``process_group=(intra_node, inter_node)``)."""
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_class})

    on_meta = any(p.is_meta for p in model.parameters())
    # device_id: this rank's GPU, or the CPU (without it FSDP1 looks for an accelerator)
    return FSDP(model, auto_wrap_policy=policy, sharding_strategy=strategy, device_mesh=mesh,
                device_id=device, param_init_fn=fsdp1_meta_init(model, device) if on_meta else None)


def wrap_ddp(model: nn.Module) -> nn.Module:
    """What NO_SHARD does, done by the module built for it: every rank keeps everything, and the
    gradients are all-reduced in buckets while backward still runs."""
    return DDP(model)


# name: (how it is wrapped, the strategy in sharding.py)
VARIANTS = {
    "ddp": ("ddp", "ddp"),
    "fsdp1-no-shard": ("fsdp1", "no_shard"),
    "fsdp1-full-shard": ("fsdp1", "full_shard"),
    "fsdp1-shard-grad-op": ("fsdp1", "shard_grad_op"),
    "fsdp1-hybrid-shard": ("fsdp1", "hybrid_shard"),
    "fsdp2-reshard-true": ("fsdp2", "full_shard"),
    "fsdp2-reshard-false": ("fsdp2", "shard_grad_op"),
    "fsdp2-reshard-int": ("fsdp2", "reshard_to"),
    "fsdp2-hsdp": ("fsdp2", "hybrid_shard"),
}
FSDP1_STRATEGY = {"no_shard": ShardingStrategy.NO_SHARD, "full_shard": ShardingStrategy.FULL_SHARD,
                  "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
                  "hybrid_shard": ShardingStrategy.HYBRID_SHARD}


def wrap(name: str, model: nn.Module, block_class: type[nn.Module], device: torch.device,
         mesh_2d: DeviceMesh, reshard_to: int | None) -> nn.Module:
    """Variant ``name``: the model wrapped by one of the three functions above."""
    api, strategy = VARIANTS[name]
    if api == "ddp":
        return wrap_ddp(model)
    mesh = mesh_2d if strategy == "hybrid_shard" else None
    if api == "fsdp1":
        return shard_fsdp1(model, block_class, FSDP1_STRATEGY[strategy], device, mesh)
    reshard = {"full_shard": True, "shard_grad_op": False, "reshard_to": reshard_to}.get(strategy)
    # a 1-D mesh of every rank on this run's device, not fully_shard's default (the accelerator's)
    return shard_fsdp2(model, block_class, mesh or world_mesh(), reshard)


def reshard_divisor(world: int) -> int | None:
    """The largest non-trivial divisor of the world size (an int reshard_after_forward), if any."""
    return next((d for d in range(world - 1, 1, -1) if world % d == 0), None)


# -- the lesson run -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    add_prediction_arguments(p, LESSONS["06"].run.gpu_model, LESSONS["06"].run.gpu_batch_size)
    p.add_argument("--replicate", type=positive_int, default=None,
                   help="replicas in the hybrid (HSDP) mesh; it must divide the world size; the "
                        "shard group is world / replicate (default: 2 when the world is even)")
    p.add_argument("--gpus", type=positive_int, default=8,
                   help="GPUs for the capacity chart (default 8, like the classic G5.48xlarge)")
    p.add_argument("--gpu-mem-gb", type=positive_float, default=24.0,
                   help="memory per GPU in GB (1e9 bytes) for the capacity chart (default 24: A10)")
    p.add_argument("--activation-gb", type=float, default=0.0,
                   help="GB per GPU kept free for activations and buffers in the capacity chart "
                        "(default 0: the chart is the bound set by training state alone)")
    args = p.parse(argv)
    if not 0 <= args.activation_gb < args.gpu_mem_gb:
        p.exit(2, f"error: --activation-gb {args.activation_gb} is not allowed; allowed: "
                  f"0 <= value < --gpu-mem-gb ({args.gpu_mem_gb})\n")
    return args


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


def against_theory(lesson: Lesson, name: str, stats: TrainStats, replicate: int,
                   reshard_to: int | None) -> dict:
    """What variant ``name`` kept between steps and at its peak, beside the formulas of sharding.py."""
    api, strategy = VARIANTS[name]
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


def predicted_knobs(name: str, block_class: type[nn.Module], gpus_per_node: int) -> dict:
    """Each variant as the step-time model's strategy (FSDP1 and FSDP2 alike: same collectives);
    an FSDP2 variant is traced through ``shard_fsdp2`` itself, as the variant calls it (its int
    reshard_after_forward: one node's ranks, re-gathered within a node, timed as full_shard)."""
    api, strategy = VARIANTS[name]
    knobs = dict(strategy={"ddp": "no_shard", "reshard_to": "full_shard"}.get(strategy, strategy),
                 limit_all_gathers=api == "fsdp1")
    if api == "fsdp2":
        reshard = {"full_shard": True, "shard_grad_op": False, "reshard_to": gpus_per_node}.get(strategy)
        knobs["parallelize"] = functools.partial(shard_fsdp2, block_class=block_class,
                                                 reshard_after_forward=reshard)
    return knobs


def prediction(args: argparse.Namespace) -> dict | None:
    """The variants predicted on ``--predict-on`` (``predict_from_arguments``)."""
    if args.predict_on == "none":
        return None
    block = get_model_spec(args.predict_model).block_class()
    per_node = parse_cluster(args.predict_on).gpus_per_node
    return predict_from_arguments(args, {n: predicted_knobs(n, block, per_node) for n in args.variants})


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    ddp, full = variant(results, "ddp"), variant(results, "fsdp2-reshard-true")
    d, f = ddp["resident_bytes_per_rank"], full["resident_bytes_per_rank"]
    return (f"state held per rank: DDP {fmt_bytes(d)} -> FULL_SHARD {fmt_bytes(f)} "
            f"({d / f:.1f}x less on {results['world_size']} ranks), for "
            f"{full['sent_per_step_bytes'] / ddp['sent_per_step_bytes']:.1f}x the bytes sent per step")


def main(args: argparse.Namespace) -> None:
    predicted = prediction(args)
    with Lesson("06", args, needs_ranks="bytes per rank falling with the number of ranks",
                notes=NOTES, cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        lesson.results.columns("strategy", "resident_bytes_per_rank", "peak_unsharded_parameter_bytes",
                               "sent_per_step_bytes")
        world, block = lesson.dist.world_size, lesson.spec.block_class()
        replicate = args.replicate or (2 if world % 2 == 0 else 1)
        lesson.check(world % replicate == 0, "--replicate", replicate, f"divisors of the world size {world}")
        mesh_2d, d = hsdp_mesh(lesson.device.type, replicate, world // replicate), reshard_divisor(world)
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
                names, lambda name: wrap(name, lesson.build_model(), block, lesson.device, mesh_2d, d),
                describe=lambda name, model, stats: against_theory(lesson, name, stats, replicate, d))
        capacity(lesson, args, replicate)
        lesson.results.predicted(predicted)
        if replicate == world and "fsdp1-hybrid-shard" in names:
            lesson.results.note(HYBRID_TRAP)


if __name__ == "__main__":
    main(parse_args())
