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
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
from sharding_run import CPU_NOTE, NOTES, prediction, run_strategies, takeaway
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
from utilities.measure.predictions import add_prediction_arguments
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
def main(args: argparse.Namespace) -> None:
    predicted = prediction(args, SimpleNamespace(**globals()))  # before any rank starts
    with Lesson("06", args, needs_ranks="bytes per rank falling with the number of ranks",
                notes=NOTES, cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        run_strategies(lesson, args, predicted, SimpleNamespace(**globals()))  # the wrappers above


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


if __name__ == "__main__":
    main(parse_args())
