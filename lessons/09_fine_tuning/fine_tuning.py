"""Lesson 09: fine-tuning under FSDP: freezing layers and child-tuning.

"FSDP cannot freeze layers" was true of early FSDP1 and is not true today:

    FSDP2 (fully_shard)   requires_grad=False per parameter, anywhere: frozen parameters get no
                          gradient, no reduce-scatter and (if you leave them out of the optimizer)
                          no optimizer state.
    FSDP1                 a unit's parameters are flattened into one FlatParameter, which cannot be
                          half frozen: mixing frozen and trainable parameters in one unit needs
                          use_orig_params=True (without it, wrapping fails; this script shows the
                          error).

Child-tuning (Xu et al., 2021) updates only a child network, by masking the gradients between
backward and optimizer.step: ChildTuning-F draws a Bernoulli(reserve_p) mask every step and scales
kept gradients by 1/reserve_p; ChildTuning-D keeps, for the whole run, the reserve_p fraction of
weights with the largest Fisher information (squared gradients accumulated over a few task
batches), with one threshold for the whole sharded model. The masks are the functions below;
utilities.child_tuning.ChildTuning packages the same method for your own code.

The script first "pre-trains" t5 on the reversal task (or loads --pretrained), then fine-tunes it
on a different task, writing every letter in upper case, rotated by --shift places
(abc -> DEF), five ways:

    full              every weight trained (FSDP2)
    frozen-encoder    encoder blocks frozen, decoder and embeddings trained (FSDP2)
    frozen-fsdp1      the same freezing with FSDP1 and use_orig_params=True
    child-tuning-f    ChildTuning-F over every weight (FSDP2)
    child-tuning-d    ChildTuning-D over every weight (FSDP2)

and reports held-out loss and token accuracy before / after, trainable and frozen parameters,
gradient and optimizer-state memory, and step time. AdamW runs with weight_decay=0 for every
variant, so a weight with zero gradient and zero momentum never moves.

Run: fsdp-course run 09 [--quick]   or   torchrun --nproc-per-node 2 fine_tuning.py --device cpu
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
from fine_tuning_run import CPU_NOTE, NOTES, pretrained_state, run_variant, settings
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from utilities.child_tuning import global_topk_threshold, local
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import reduce_scalar, world_mesh
from utilities.errors import bounded, positive_int
from utilities.measure import fmt_bytes
from utilities.results import variant

ENCODER = ("encoder.block.", "encoder.final_layer_norm.")  # the lower half of a t5
VARIANTS = {
    # name: (api, parameter-name prefixes to freeze, child-tuning mode)
    "full": ("fsdp2", (), None),
    "frozen-encoder": ("fsdp2", ENCODER, None),
    "frozen-fsdp1": ("fsdp1", ENCODER, None),
    "child-tuning-f": ("fsdp2", (), "F"),
    "child-tuning-d": ("fsdp2", (), "D"),
}


# -- freezing: requires_grad_(False) before wrapping ----------------------------------------------
def freeze(model: nn.Module, prefixes: Iterable[str]) -> tuple[int, int]:
    """Freeze every parameter whose name starts with one of ``prefixes``; return the (trainable,
    frozen) parameter counts. Do it before wrapping: FSDP1 reads requires_grad when it flattens
    each unit (FSDP2 would also take it afterwards, per parameter)."""
    prefixes = tuple(prefixes)
    for name, p in model.named_parameters():
        if prefixes and name.startswith(prefixes):
            p.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable


def wrap_fsdp2(model: nn.Module, block_class: type[nn.Module]) -> nn.Module:
    """FSDP2 keeps every parameter a DTensor of its own, so a unit may mix frozen and trainable
    parameters: frozen ones get no gradient and are not reduce-scattered."""
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    for module in model.modules():
        if isinstance(module, block_class):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit: embeddings, final norms and whatever no block holds
    return model


def wrap_fsdp1(model: nn.Module, block_class: type[nn.Module], device: torch.device,
               use_orig_params: bool = True) -> nn.Module:
    """FSDP1 flattens each unit into one FlatParameter with one requires_grad: a unit that mixes
    frozen and trainable parameters needs use_orig_params=True (here the root holds the frozen
    encoder's final norm and the trainable shared embedding)."""
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_class})
    # device_id: the GPU of this rank, or the CPU (without it FSDP1 looks for an accelerator)
    return FSDP(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, device_id=device)


def fsdp1_refusal(model: nn.Module, block_class: type[nn.Module], device: torch.device) -> str | None:
    """What FSDP1 says when a unit mixes frozen and trainable parameters without use_orig_params
    (None if it accepted them)."""
    try:
        wrap_fsdp1(model, block_class, device, use_orig_params=False)
    except (ValueError, RuntimeError) as e:
        return str(e).strip().splitlines()[0]
    return None


# -- child-tuning: a mask on the gradients, between backward and optimizer.step --------------------
@torch.no_grad()
def child_tuning_f(params: list[nn.Parameter], reserve_p: float, generator: torch.Generator) -> None:
    """ChildTuning-F: keep each gradient entry with probability reserve_p, a fresh draw every
    step, and scale the kept ones by 1/reserve_p so the expected gradient is unchanged. Under
    FSDP2 a gradient is a DTensor: each rank masks its own shard, with its own generator."""
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            keep = torch.rand(g.shape, generator=generator).to(g.device) < reserve_p
            g.mul_(keep.to(g.dtype)).div_(reserve_p)


def fisher_masks(model: nn.Module, params: list[nn.Parameter], data: Iterator[dict],
                 num_batches: int, reserve_p: float) -> tuple[list[torch.Tensor], float]:
    """ChildTuning-D's mask, fixed before training: squared gradients summed over a few task
    batches (the diagonal of the empirical Fisher), then the reserve_p fraction of entries with the
    largest values, one threshold for the whole model. No rank holds every gradient;
    global_topk_threshold finds the exact k-th largest over all ranks' shards by bisection, one
    scalar all-reduce a step, without gathering anything."""
    fisher = [torch.zeros_like(local(p)) for p in params]
    for _ in range(num_batches):
        model.zero_grad(set_to_none=True)
        model(**next(data)).loss.backward()
        with torch.no_grad():
            for f, p in zip(fisher, params):
                if p.grad is not None:
                    f.add_(local(p.grad).float().pow(2))
    model.zero_grad(set_to_none=True)
    total = reduce_scalar(sum(f.numel() for f in fisher), "sum")
    threshold = global_topk_threshold(fisher, max(1, int(round(reserve_p * total))))
    return [f >= threshold for f in fisher], threshold


@torch.no_grad()
def child_tuning_d(params: list[nn.Parameter], masks: list[torch.Tensor]) -> None:
    """ChildTuning-D: the same fixed mask every step, on this rank's shard of each gradient."""
    for p, mask in zip(params, masks):
        if p.grad is not None:
            local(p.grad).mul_(mask.to(p.grad.dtype))


def masked_step(mask: Callable[[], None]) -> Callable[[nn.Module, dict], torch.Tensor]:
    """One training step's forward and backward, then the mask: the optimizer.step that follows
    sees only the kept gradient entries."""
    def step(model: nn.Module, batch: dict) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        mask()
        return loss
    return step


# -- the lesson run --------------------------------------------------------------------------------
def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    full, frozen = variant(results, "full"), variant(results, "frozen-encoder")
    return (f"freezing the encoder: {fmt_bytes(full['optimizer_bytes_per_rank'])} -> "
            f"{fmt_bytes(frozen['optimizer_bytes_per_rank'])} of optimizer state per rank, held-out "
            f"loss {frozen['held_out_loss_after']:.3f} vs {full['held_out_loss_after']:.3f} trained fully")


def main(args: argparse.Namespace) -> None:
    with Lesson("09", args, settings=settings(args), notes=NOTES, cpu_note=CPU_NOTE,
                takeaway=takeaway) as lesson:
        lesson.results.columns("trainable_parameters", "frozen_parameters", "gradient_bytes_per_rank",
                               "optimizer_bytes_per_rank", "held_out_loss_after", "frozen_bit_identical")
        lesson.check(lesson.spec.is_seq2seq, "--model", lesson.spec.name,
                     "a t5 model (the lesson freezes the encoder)")
        state = pretrained_state(lesson, args, wrap_fsdp2)
        code = SimpleNamespace(**globals())  # the functions above, for the driver
        for name in args.variants:
            with lesson.variant(name):  # everything the variant made is freed before the next one
                run_variant(lesson, name, state, args, code)


reserve_p = bounded(float, 0, 1, low_open=True)
shift_value = bounded(int, 1, 25)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--reserve-p", type=reserve_p, default=0.3,
                   help="child-tuning: fraction of gradient entries kept, in (0, 1] (default 0.3; "
                        "the paper and the classic lesson use 0.3-0.35)")
    p.add_argument("--fisher-batches", type=positive_int, default=None,
                   help="ChildTuning-D: task batches whose squared gradients give the Fisher mask "
                        "(default 2 quick, 4)")
    p.add_argument("--shift", type=shift_value, default=3,
                   help="fine-tuning task: rotate each letter by this many places (1..25)")
    p.add_argument("--pretrain-steps", type=positive_int, default=None,
                   help="steps of reversal pre-training before fine-tuning (default 12 quick, 60)")
    p.add_argument("--pretrained", default=None,
                   help="load this pre-trained state dict (torch.save of a full model state dict, "
                        "e.g. OUT/pretrained.pt from an earlier run) instead of pre-training")
    p.add_argument("--eval-batches", type=positive_int, default=None,
                   help="held-out batches per rank for loss and token accuracy (default 2 quick, 4)")
    args = p.parse(argv)
    if args.quick and args.seq_len is None:
        args.seq_len = 16  # 15 letters: the quick run stays short on two CPU cores
    args.eval_batches = args.eval_batches or (2 if args.quick else 4)
    args.fisher_batches = args.fisher_batches or (2 if args.quick else 4)
    args.pretrain_steps = args.pretrain_steps or (12 if args.quick else 60)
    return args



if __name__ == "__main__":
    main(parse_args())
