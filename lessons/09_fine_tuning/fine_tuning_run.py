"""Lesson 09's driver: each variant built, frozen and wrapped, measured before and after
fine-tuning, and made a row; the fine-tuning task, its held-out evaluation and the pre-training.

The freezing, the wrapping and the gradient masks are the lesson script's functions
(``fine_tuning.py``, handed in as ``code``); here: what is run and measured around them.
"""

from __future__ import annotations

import argparse
import string
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from utilities.child_tuning import local
from utilities.course.lesson import Lesson
from utilities.data import LETTERS, LetterTask, batches, make_loader
from utilities.distributed import fail_together, reduce_scalar
from utilities.errors import UsageError
from utilities.measure import fmt_bytes
from utilities.torch_zip import safe_torch_load
from utilities.training import train

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



def settings(args: argparse.Namespace) -> dict:
    return dict(reserve_p=args.reserve_p, fisher_batches=args.fisher_batches, shift=args.shift,
                task="upper-case and rotate letters by shift (pre-trained on reversal)",
                pretrained=args.pretrained or "reversal, in this run")


def run_variant(lesson: Lesson, name: str, state: dict[str, torch.Tensor], args: argparse.Namespace,
                code: SimpleNamespace) -> None:
    """Fresh pre-trained weights, frozen and wrapped as the variant says; held-out numbers before
    and after fine-tuning with the variant's gradient mask, and what the frozen part cost."""
    api, prefixes, mode = code.VARIANTS[name]
    block = lesson.spec.block_class()
    model = fresh_model(lesson, state)
    n_trainable, n_frozen = code.freeze(model, prefixes)
    extra = {}
    if api == "fsdp1":
        refused = fresh_model(lesson, state)  # a model of its own: a refused wrap leaves it half-wrapped
        code.freeze(refused, prefixes)
        extra["fsdp1_without_orig_params_error"] = report_refusal(lesson, code.fsdp1_refusal(refused, block,
                                                                                    lesson.device))
        del refused
        model = code.wrap_fsdp1(model, block, lesson.device, use_orig_params=True)
    else:
        model = code.wrap_fsdp2(model, block)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    frozen_before = [local(p).detach().clone() for p in frozen]
    loss_before, acc_before = evaluate(model, lesson, args.shift, args.eval_batches)

    optimizer = torch.optim.AdamW(trainable, lr=lesson.lr, weight_decay=0.0)  # only what trains
    step_fn = None
    if mode == "F":
        generator = torch.Generator().manual_seed(args.seed * 7919 + lesson.dist.rank)  # own entries
        step_fn = code.masked_step(lambda: code.child_tuning_f(trainable, args.reserve_p, generator))
    elif mode == "D":
        t0 = time.perf_counter()
        n = lesson.batch_size * lesson.dist.world_size * args.fisher_batches
        masks, threshold = code.fisher_masks(model, trainable, task_data(lesson, args.shift, 2, n),
                                        args.fisher_batches, args.reserve_p)
        extra.update(fisher_time_s=round(time.perf_counter() - t0, 3), fisher_threshold=threshold,
                     kept_fraction=kept_fraction(masks, lesson.device))
        step_fn = code.masked_step(lambda: code.child_tuning_d(trainable, masks))
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


def pretrained_state(lesson: Lesson, args: argparse.Namespace,
                     wrap_fsdp2: Callable[[nn.Module, type], nn.Module]) -> dict[str, torch.Tensor]:
    """The starting weights of every variant: a short FSDP2 run on the reversal task (saved as
    OUT/pretrained.pt), or the state dict --pretrained names (``wrap_fsdp2``: the lesson's)."""
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
