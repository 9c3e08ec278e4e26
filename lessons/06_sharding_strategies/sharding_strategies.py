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
peak by category, and compares them with the formulas in utilities/sharding.py; it also computes
the bytes each step communicates and, from the measured bytes per parameter, the largest model each
strategy can train on --gpus GPUs of --gpu-mem-gb GB (results.json key "capacity").

Run: fsdp-course run 06 [--quick]   or   torchrun --nproc-per-node 2 sharding_strategies.py --device cpu
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities import distributed as D
from utilities import sharding as S
from utilities.course.lesson import Lesson, lesson_parser, positive_float, positive_int
from utilities.measure import fmt_bytes, unsharded_parameter_bytes
from utilities.wrapping import shard_model

# name: (how it is wrapped, the strategy in utilities.sharding)
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
# Which measured variant stands for each strategy in the capacity chart (today's API first).
CAPACITY_FROM = {"ddp": ["ddp", "fsdp1-no-shard"],
                 "shard_grad_op": ["fsdp2-reshard-false", "fsdp1-shard-grad-op"],
                 "full_shard": ["fsdp2-reshard-true", "fsdp1-full-shard"],
                 "hybrid_shard": ["fsdp2-hsdp", "fsdp1-hybrid-shard"]}


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
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


def reshard_divisor(world: int) -> int | None:
    """The largest non-trivial divisor of the world size (an int reshard_after_forward), if any."""
    return next((d for d in range(world - 1, 1, -1) if world % d == 0), None)


def wrap(L, name: str, mesh_2d, reshard_to: int | None):
    """Build the model and wrap it the way variant ``name`` says."""
    from torch.distributed.fsdp import ShardingStrategy
    from torch.nn.parallel import DistributedDataParallel as DDP

    api, strategy = VARIANTS[name]
    model = L.build_model()
    block = L.spec.block_class()
    if api == "ddp":
        return DDP(model)
    if api == "fsdp1":
        fsdp1 = {"no_shard": ShardingStrategy.NO_SHARD, "full_shard": ShardingStrategy.FULL_SHARD,
                 "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
                 "hybrid_shard": ShardingStrategy.HYBRID_SHARD}[strategy]
        mesh = mesh_2d if strategy == "hybrid_shard" else None
        return shard_model(model, api="fsdp1", block_class=block, device=L.device, mesh=mesh,
                           sharding_strategy=fsdp1)
    if strategy == "hybrid_shard":
        return shard_model(model, api="fsdp2", block_class=block, mesh=mesh_2d)
    reshard = {"full_shard": True, "shard_grad_op": False, "reshard_to": reshard_to}[strategy]
    return shard_model(model, api="fsdp2", block_class=block, reshard_after_forward=reshard)


def main(args) -> None:
    with Lesson("06", args,
                needs_ranks="bytes per rank falling with the number of ranks") as L:
        world = L.dist.world_size
        replicate = args.replicate or (2 if world % 2 == 0 else 1)
        L.check(world % replicate == 0, "--replicate", replicate,
                f"divisors of the world size {world}")
        shard = world // replicate
        d = reshard_divisor(world)
        n = L.spec.num_parameters
        mesh_2d = D.mesh(L.device.type, (replicate, shard), ("replicate", "shard"))
        L.print(f"HSDP mesh: {replicate} replica(s) x {shard} shard(s); int reshard_after_forward: "
                f"{d if d else 'none valid on ' + str(world) + ' ranks'}")
        measured: dict[str, S.PerParam] = {}

        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                api, strategy = VARIANTS[name]
                if strategy == "reshard_to" and d is None:
                    L.results.note(f"{name} skipped: an int reshard_after_forward must be a non-trivial "
                                   f"divisor of the shard world size ({world} has none); on 8 GPUs per "
                                   "node x N nodes, 8 keeps the backward all-gather inside a node.")
                    L.print(f"  {name}: skipped (no non-trivial divisor of {world})")
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # FSDP1 / NO_SHARD deprecations
                    model = wrap(L, name, mesh_2d, d)
                    stats = L.train(model, name)
                peak = stats.peak_memory_bytes
                resident = peak["detail"]["resident_after_step"]
                unsharded = unsharded_parameter_bytes(peak) or 0
                theory = S.bytes_per_param(strategy, world, replicate=replicate, reshard_to=d)
                measured[name] = S.PerParam(resident["parameters"] / n, resident["gradients"] / n,
                                            resident["optimizer"] / n, unsharded / n)
                comm = S.comm_bytes_per_step(strategy, world, n, replicate=replicate, reshard_to=d)
                L.results.add(
                    name, stats, api=api, strategy=strategy,
                    resident_bytes=resident,
                    theory_resident_bytes={"parameters": theory.parameters * n,
                                           "gradients": theory.gradients * n,
                                           "optimizer": theory.optimizer * n},
                    peak_unsharded_parameter_bytes=unsharded,
                    all_gather_bytes=peak["detail"].get("all_gather"),
                    comm_bytes_per_step=sum(comm.values()), comm_breakdown=comm,
                    mesh=[replicate, shard] if strategy == "hybrid_shard" else [world])
                L.print(f"    resident params/grads/optim {fmt_bytes(resident['parameters'])} / "
                        f"{fmt_bytes(resident['gradients'])} / {fmt_bytes(resident['optimizer'])} "
                        f"(theory {fmt_bytes(theory.parameters * n)} / "
                        f"{fmt_bytes(theory.gradients * n)} / {fmt_bytes(theory.optimizer * n)}); "
                        f"sends {fmt_bytes(sum(comm.values()))} per step")
                del model

        L.results.data["capacity"] = capacity(args, measured, world, replicate)
        cap = L.results.data["capacity"]
        L.print(f"\nlargest model on {args.gpus} GPUs x {args.gpu_mem_gb:g} GB "
                f"({args.activation_gb:g} GB kept for activations), from measured bytes/param:")
        for row in cap["at_gpus"]:
            L.print(f"  {row['strategy']:14s} {row['bytes_per_param']:6.2f} B/param -> "
                    f"{row['largest_model'] / 1e9:6.2f} B parameters")
        if shard == 1 and "fsdp1-hybrid-shard" in args.variants:
            L.results.note("fsdp1-hybrid-shard on a shard group of 1 rank: FSDP1 falls back to "
                           "NO_SHARD over that 1-rank group and never averages gradients across "
                           "the replicas, so the ranks drift apart (its losses differ); FSDP2's "
                           "2-D mesh does reduce across replicas.")
        L.results.note("resident_bytes: parameters, gradients and optimizer state a rank keeps "
                       "between steps; theory_resident_bytes: utilities.sharding.bytes_per_param.")
        L.results.note("comm_bytes_per_step: bytes one rank sends per step by ring collectives, "
                       "from theory (utilities.sharding.comm_bytes_per_step), not measured.")
        if L.device.type == "cpu":
            L.results.note("CPU run: memory from torch.distributed._tools trackers; gloo overlaps "
                           "nothing, so step times are only indicative.")


def capacity(args, measured: dict[str, S.PerParam], world: int, replicate: int) -> dict:
    """Largest trainable model per strategy, from measured bytes/param scaled to other GPU counts."""
    gpu_mem = args.gpu_mem_gb * 1e9
    act = args.activation_gb * 1e9
    node = min(args.gpus, 8)  # HSDP: shard inside a node of up to 8 GPUs, replicate across nodes
    gpu_counts = sorted({1, 2, 4, 8, 16, 32, 64, args.gpus})
    curves: dict[str, list[int]] = {}
    at_gpus = []
    for strategy, sources in CAPACITY_FROM.items():
        src = next((s for s in sources if s in measured), None)
        curve = []
        for g in gpu_counts:
            rep = max(1, g // node) if g % node == 0 else 1
            pp = S.bytes_per_param(strategy, g, replicate=rep)
            if src is not None:
                m = measured[src]
                scaled = S.scale_measured(m, world, strategy, g, replicate=rep,
                                          measured_replicate=replicate)
                # the unsharded copy (SHARD_GRAD_OP) from theory: the tiny model's peak also holds
                # the one or two units being gathered, which a large model's does not
                pp = S.PerParam(scaled.parameters, scaled.gradients, scaled.optimizer,
                                pp.unsharded_parameters)
            n_max = S.largest_model(strategy, g, gpu_mem, act, per_param=pp)
            curve.append(n_max)
            if g == args.gpus:
                at_gpus.append({"strategy": strategy, "measured_from": src,
                                "bytes_per_param": pp.total, "largest_model": n_max})
        curves[strategy] = curve
    return {"gpus": args.gpus, "gpu_mem_bytes": gpu_mem, "activation_bytes": act,
            "gpus_per_node_for_hsdp": node, "gpu_counts": gpu_counts, "largest_model": curves,
            "at_gpus": at_gpus,
            "classic_a10_8gpu": {"ddp": 750e6, "shard_grad_op": 2e9, "full_shard": 2.5e9}}


if __name__ == "__main__":
    main(parse_args())
