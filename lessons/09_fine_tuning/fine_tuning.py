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
import string
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from utilities.child_tuning import global_topk_threshold, local
from utilities.course.lesson import Lesson, lesson_parser
from utilities.data import LETTERS, LetterTask, batches, make_loader
from utilities.distributed import fail_together, reduce_scalar, world_mesh
from utilities.errors import UsageError, bounded, positive_int
from utilities.measure import fmt_bytes
from utilities.results import variant
from utilities.torch_zip import safe_torch_load
from utilities.training import train

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


# -- one variant: build, measure before, fine-tune, measure after ---------------------------------
def run_variant(lesson: Lesson, name: str, state: dict[str, torch.Tensor], args: argparse.Namespace) -> None:
    """Fresh pre-trained weights, frozen and wrapped as the variant says; held-out numbers before
    and after fine-tuning with the variant's gradient mask, and what the frozen part cost."""
    api, prefixes, mode = VARIANTS[name]
    block = lesson.spec.block_class()
    model = fresh_model(lesson, state)
    n_trainable, n_frozen = freeze(model, prefixes)
    extra = {}
    if api == "fsdp1":
        refused = fresh_model(lesson, state)  # a model of its own: a refused wrap leaves it half-wrapped
        freeze(refused, prefixes)
        extra["fsdp1_without_orig_params_error"] = report_refusal(lesson, fsdp1_refusal(refused, block,
                                                                                    lesson.device))
        del refused
        model = wrap_fsdp1(model, block, lesson.device, use_orig_params=True)
    else:
        model = wrap_fsdp2(model, block)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    frozen_before = [local(p).detach().clone() for p in frozen]
    loss_before, acc_before = evaluate(model, lesson, args.shift, args.eval_batches)

    optimizer = torch.optim.AdamW(trainable, lr=lesson.lr, weight_decay=0.0)  # only what trains
    step_fn = None
    if mode == "F":
        generator = torch.Generator().manual_seed(args.seed * 7919 + lesson.dist.rank)  # own entries
        step_fn = masked_step(lambda: child_tuning_f(trainable, args.reserve_p, generator))
    elif mode == "D":
        t0 = time.perf_counter()
        n = lesson.batch_size * lesson.dist.world_size * args.fisher_batches
        masks, threshold = fisher_masks(model, trainable, task_data(lesson, args.shift, 2, n),
                                        args.fisher_batches, args.reserve_p)
        extra.update(fisher_time_s=round(time.perf_counter() - t0, 3), fisher_threshold=threshold,
                     kept_fraction=kept_fraction(masks, lesson.device))
        step_fn = masked_step(lambda: child_tuning_d(trainable, masks))
    if mode:
        extra["reserve_p"] = args.reserve_p
    samples = max(lesson.batch_size * lesson.dist.world_size * lesson.steps, 64)
    data = task_data(lesson, args.shift, 1, samples)
    stats = train(model, optimizer, data, lesson.steps, lesson.device, progress=name,
                  flops_per_token=lesson.spec.flops_per_token(lesson.seq_len),
                  **({"step_fn": step_fn} if step_fn else {}))
    loss_after, acc_after = evaluate(model, lesson, args.shift, args.eval_batches)

    unchanged = all(torch.equal(b, local(p).detach()) for b, p in zip(frozen_before, frozen))
    resident = stats.peak_memory_bytes.get("detail", {}).get("resident_after_step", {})
    lesson.results.add(
        name, stats, api=api, frozen="encoder" if prefixes else "-", child_tuning=mode or "-",
        trainable_parameters=n_trainable, frozen_parameters=n_frozen,
        held_out_loss_before=round(loss_before, 4), held_out_loss_after=round(loss_after, 4),
        held_out_accuracy_before=round(acc_before, 4), held_out_accuracy=round(acc_after, 4),
        frozen_bit_identical=bool(reduce_scalar(int(unchanged), "min", lesson.device)),
        frozen_with_optimizer_state=sum(1 for p in frozen if p in optimizer.state),
        gradient_bytes_per_rank=resident.get("gradients"),
        optimizer_bytes_per_rank=resident.get("optimizer"), **extra)
    lesson.print(f"    held-out loss {loss_before:.3f} -> {loss_after:.3f}, token accuracy "
                 f"{acc_before:.1%} -> {acc_after:.1%}; trainable {n_trainable:,}, frozen {n_frozen:,}; "
                 f"grads {fmt_bytes(resident.get('gradients'))}, optimizer "
                 f"{fmt_bytes(resident.get('optimizer'))} per rank")


# -- the lesson -----------------------------------------------------------------------------------
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
        state = pretrained_state(lesson, args)
        for name in args.variants:
            with lesson.variant(name):  # everything the variant made is freed before the next one
                run_variant(lesson, name, state, args)


# -- the pieces around it: flags, data, evaluation, pre-training -----------------------------------
UPPER = string.ascii_uppercase.encode()
HELD_OUT_SEED = 10_007  # the held-out split: examples no training batch ever contains
NOTES = ("held_out_*: a split of the fine-tuning task (upper-case + rotate) that no training batch "
         "contains; accuracy is teacher-forced token accuracy (argmax of the logits).",
         "gradient_bytes_per_rank / optimizer_bytes_per_rank: what each rank keeps between steps "
         "(sharded); frozen weights have neither.")
CPU_NOTE = "CPU run: memory from torch.distributed._tools trackers; step times are only indicative."


class ShiftTask(LetterTask):
    """The fine-tuning task: each of ``seq_len - 1`` random letters, upper-cased and rotated by
    ``shift`` places (abc -> DEF with shift 3).

    Same format as the reversal pre-training task (seq2seq, byte tokens, EOS last), different
    mapping and output alphabet: the model must unlearn "lower-case letters, read backwards".
    """

    def __init__(self, n: int, seq_len: int, shift: int = 3, seed: int = 0):
        super().__init__(n, seq_len, seed)
        self.shift = shift

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        letters = self.letters(i, self.seq_len - 1)
        return self.seq2seq(bytes(LETTERS[j] for j in letters),
                            bytes(UPPER[(j + self.shift) % 26] for j in letters))


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


def settings(args: argparse.Namespace) -> dict:
    return dict(reserve_p=args.reserve_p, fisher_batches=args.fisher_batches, shift=args.shift,
                task="upper-case and rotate letters by shift (pre-trained on reversal)",
                pretrained=args.pretrained or "reversal, in this run")


def task_data(lesson: Lesson, shift: int, seed_offset: int, n: int, shuffle: bool = True):
    ds = ShiftTask(n, lesson.seq_len, shift=shift, seed=lesson.args.seed + seed_offset)
    loader = make_loader(ds, lesson.batch_size, lesson.dist.rank, lesson.dist.world_size,
                         seed=lesson.args.seed, shuffle=shuffle)
    return batches(loader, lesson.device)


@torch.no_grad()
def evaluate(model: nn.Module, lesson: Lesson, shift: int, num_batches: int) -> tuple[float, float]:
    """Held-out loss (nats per token) and token accuracy (teacher-forced argmax), over all ranks."""
    model.eval()
    n = lesson.batch_size * lesson.dist.world_size * num_batches
    data = task_data(lesson, shift, HELD_OUT_SEED, n, shuffle=False)
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct tokens, tokens
    for _ in range(num_batches):
        batch = next(data)
        logits = model(**batch).logits.float()
        labels = batch["labels"]
        keep = labels != -100
        sums[0] += F.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
        sums[1] += (logits.argmax(-1)[keep] == labels[keep]).sum().item()
        sums[2] += keep.sum().item()
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


def kept_fraction(masks: list[torch.Tensor], device: torch.device) -> float:
    """The share of entries a mask keeps, over every rank's shards."""
    kept = reduce_scalar(sum(int(m.sum()) for m in masks), "sum", device)
    return kept / max(reduce_scalar(sum(m.numel() for m in masks), "sum", device), 1)


def report_refusal(lesson: Lesson, error: str | None) -> str | None:
    if error:
        lesson.print(f"  FSDP1 without use_orig_params: {error}")
        lesson.results.note(f"FSDP1 with a frozen encoder and use_orig_params=False fails: {error}")
    else:
        lesson.print("  FSDP1 without use_orig_params: accepted the mixed units here")
    return error


def pretrained_state(lesson: Lesson, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The starting weights of every variant: a short FSDP2 run on the reversal task (saved as
    OUT/pretrained.pt), or the state dict --pretrained names."""
    if args.pretrained:
        if not Path(args.pretrained).is_file():
            raise UsageError(f"--pretrained {args.pretrained!r} is not a file")
        lesson.print(f"  pre-trained weights from {args.pretrained}")
        # weights_only, and a truncated or code-carrying file is one line (the same on every rank)
        state = safe_torch_load(args.pretrained, f"--pretrained {args.pretrained!r}")
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise UsageError(f"--pretrained {args.pretrained!r} is not a state dict of tensors")
        return state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = wrap_fsdp2(lesson.build_model(), lesson.spec.block_class())
    opt = torch.optim.AdamW(model.parameters(), lr=lesson.lr)
    stats = train(model, opt, lesson.data(seed_offset=0), args.pretrain_steps, lesson.device,
                  measure_memory=False, progress="pre-train (reversal)")
    lesson.print(f"  pre-training on reversal: loss {stats.losses[0]:.3f} -> {stats.losses[-1]:.3f} "
                 f"in {args.pretrain_steps} steps")
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().clone() for k, v in sd.items()}
    with fail_together(f"writing {lesson.out / 'pretrained.pt'}"):  # rank 0 failing stops every rank
        if lesson.dist.is_main:
            lesson.out.mkdir(parents=True, exist_ok=True)
            torch.save(state, lesson.out / "pretrained.pt")
    return state


def fresh_model(lesson: Lesson, state: dict[str, torch.Tensor]) -> nn.Module:
    model = lesson.build_model()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to shared
    if missing or unexpected:
        raise UsageError(f"pre-trained state dict does not fit {lesson.spec.name}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return model


if __name__ == "__main__":
    main(parse_args())
