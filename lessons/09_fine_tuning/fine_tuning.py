"""Lesson 09: fine-tuning under FSDP: freezing layers and child-tuning.

"FSDP cannot freeze layers" was true of early FSDP1 and is not true today:

    FSDP2 (fully_shard)   requires_grad=False per parameter, anywhere: frozen parameters get no
                          gradient, no reduce-scatter and (if you leave them out of the optimizer)
                          no optimizer state.
    FSDP1                 a unit's parameters are flattened into one FlatParameter, which cannot be
                          half frozen: mixing frozen and trainable parameters in one unit needs
                          use_orig_params=True (without it, wrapping fails; this script shows the
                          error).

Child-tuning (Xu et al., 2021) updates only a child network, by masking the gradients:
ChildTuning-F draws a Bernoulli(reserve_p) mask every step and scales kept gradients by
1/reserve_p; ChildTuning-D keeps, for the whole run, the reserve_p fraction of weights with the
largest Fisher information (squared gradients accumulated over a few task batches), with one
threshold for the whole sharded model (utilities/child_tuning.py).

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

import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utilities.child_tuning import ChildTuning, local
from utilities.course.lesson import Lesson, bounded, lesson_parser, positive_int
from utilities.data import LETTERS, LetterTask, batches, make_loader
from utilities.distributed import reduce_scalar
from utilities.errors import UsageError
from utilities.measure import fmt_bytes
from utilities.training import train
from utilities.wrapping import shard_model

VARIANTS = {
    # name: (api, what is frozen, child-tuning mode)
    "full": ("fsdp2", None, None),
    "frozen-encoder": ("fsdp2", "encoder", None),
    "frozen-fsdp1": ("fsdp1", "encoder", None),
    "child-tuning-f": ("fsdp2", None, "F"),
    "child-tuning-d": ("fsdp2", None, "D"),
}
UPPER = string.ascii_uppercase.encode()
HELD_OUT_SEED = 10_007  # the held-out split: examples no training batch ever contains


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


def parse_args(argv=None):
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
    return p.parse(argv)


# -- pieces ---------------------------------------------------------------------------------------
def task_data(L: Lesson, shift: int, seed_offset: int, n: int, shuffle: bool = True):
    ds = ShiftTask(n, L.seq_len, shift=shift, seed=L.args.seed + seed_offset)
    loader = make_loader(ds, L.batch_size, L.dist.rank, L.dist.world_size, seed=L.args.seed,
                         shuffle=shuffle)
    return batches(loader, L.device)


@torch.no_grad()
def evaluate(model, L: Lesson, shift: int, num_batches: int) -> tuple[float, float]:
    """Held-out loss (nats per token) and token accuracy (teacher-forced argmax), over all ranks."""
    model.eval()
    n = L.batch_size * L.dist.world_size * num_batches
    data = task_data(L, shift, HELD_OUT_SEED, n, shuffle=False)
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


def pretrain(L: Lesson, steps: int) -> dict[str, torch.Tensor]:
    """A short FSDP2 run on the reversal task; returns the full state dict on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = shard_model(L.build_model(), api="fsdp2", block_class=L.spec.block_class(),
                        device=L.device)
    opt = torch.optim.AdamW(model.parameters(), lr=L.lr)
    stats = train(model, opt, L.data(seed_offset=0), steps, L.device, measure_memory=False,
                  progress="pre-train (reversal)")
    L.print(f"  pre-training on reversal: loss {stats.losses[0]:.3f} -> {stats.losses[-1]:.3f} "
            f"in {steps} steps")
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def load_pretrained(path: str) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise UsageError(f"--pretrained {path!r} is not a file")
    return torch.load(path, map_location="cpu", weights_only=True)


def fresh_model(L: Lesson, state: dict[str, torch.Tensor]):
    model = L.build_model()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to shared
    if missing or unexpected:
        raise UsageError(f"pre-trained state dict does not fit {L.spec.name}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return model


def freeze(model, what: str | None) -> None:
    if what == "encoder":  # the lower half of the network: every encoder block and its final norm
        for p in model.encoder.block.parameters():
            p.requires_grad_(False)
        for p in model.encoder.final_layer_norm.parameters():
            p.requires_grad_(False)


def fsdp1_without_orig_params_error(L: Lesson, state) -> str | None:
    """What FSDP1 says when a unit mixes frozen and trainable parameters without use_orig_params."""
    model = fresh_model(L, state)
    freeze(model, "encoder")
    try:
        shard_model(model, api="fsdp1", block_class=L.spec.block_class(), device=L.device)
    except (ValueError, RuntimeError) as e:
        return str(e).strip().splitlines()[0]
    return None


def _all_true(flag: bool, device) -> bool:
    return bool(reduce_scalar(int(flag), "min", device))


# -- the lesson -----------------------------------------------------------------------------------
def main(args) -> None:
    if args.quick and args.seq_len is None:
        args.seq_len = 16  # 15 letters: the quick run stays short on two CPU cores
    eval_batches = args.eval_batches or (2 if args.quick else 4)
    args.fisher_batches = args.fisher_batches or (2 if args.quick else 4)
    with Lesson("09", args,
                settings=dict(reserve_p=args.reserve_p, fisher_batches=args.fisher_batches,
                              shift=args.shift, task="upper-case and rotate letters by shift "
                                                         "(pre-trained on reversal)")) as L:
        if not L.spec.is_seq2seq:
            raise UsageError(f"--model {L.spec.name!r} is not allowed; allowed: a t5 model "
                             "(the lesson freezes the encoder)")
        block = L.spec.block_class()
        if args.pretrained:
            state = load_pretrained(args.pretrained)
            L.print(f"  pre-trained weights from {args.pretrained}")
        else:
            steps = args.pretrain_steps or (12 if args.quick else 60)
            state = pretrain(L, steps)
            if L.dist.is_main:
                L.out.mkdir(parents=True, exist_ok=True)
                torch.save(state, L.out / "pretrained.pt")
        L.results.data["settings"]["pretrained"] = args.pretrained or "reversal, in this run"

        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                api, frozen_part, mode = VARIANTS[name]
                model = fresh_model(L, state)
                freeze(model, frozen_part)
                n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
                n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
                step_fn, extra = None, {}
                if api == "fsdp1":
                    error = fsdp1_without_orig_params_error(L, state)
                    extra["fsdp1_without_orig_params_error"] = error
                    if error:
                        L.print(f"  FSDP1 without use_orig_params: {error}")
                        L.results.note(f"FSDP1 with a frozen encoder and use_orig_params=False fails: "
                                       f"{error}")
                    else:
                        L.print("  FSDP1 without use_orig_params: accepted the mixed units here")
                    model = shard_model(model, api="fsdp1", block_class=block, device=L.device,
                                        use_orig_params=True)
                else:
                    model = shard_model(model, api="fsdp2", block_class=block, device=L.device)
                trainable = [p for p in model.parameters() if p.requires_grad]
                frozen = [p for p in model.parameters() if not p.requires_grad]
                frozen_before = [local(p).detach().clone() for p in frozen]
                loss_before, acc_before = evaluate(model, L, args.shift, eval_batches)

                optimizer = torch.optim.AdamW(trainable, lr=L.lr, weight_decay=0.0)
                data = task_data(L, args.shift, 1, max(L.batch_size * L.dist.world_size * L.steps, 64))
                if mode is not None:
                    ct = ChildTuning(trainable, mode=mode, reserve_p=args.reserve_p, seed=args.seed)
                    if mode == "D":
                        t0 = time.perf_counter()
                        fisher_data = task_data(L, args.shift, 2, L.batch_size * L.dist.world_size
                                                * args.fisher_batches)
                        ct.compute_fisher_mask(model, fisher_data, args.fisher_batches)
                        extra.update(fisher_time_s=round(time.perf_counter() - t0, 3),
                                     fisher_threshold=ct.threshold, kept_fraction=ct.kept_fraction)
                    step_fn = ct.step_fn()
                    extra["reserve_p"] = args.reserve_p
                    del ct
                kwargs = {"step_fn": step_fn} if step_fn else {}
                stats = train(model, optimizer, data, L.steps, L.device, progress=name,
                              flops_per_token=L.spec.flops_per_token(L.seq_len), **kwargs)
                loss_after, acc_after = evaluate(model, L, args.shift, eval_batches)

                unchanged = all(torch.equal(b, local(p).detach()) for b, p in zip(frozen_before, frozen))
                frozen_in_optimizer = sum(1 for p in frozen if p in optimizer.state)
                resident = stats.peak_memory_bytes.get("detail", {}).get("resident_after_step", {})
                L.results.add(
                    name, stats, api=api, frozen=frozen_part or "-", child_tuning=mode or "-",
                    trainable_parameters=n_trainable, frozen_parameters=n_frozen,
                    held_out_loss_before=round(loss_before, 4), held_out_loss_after=round(loss_after, 4),
                    held_out_accuracy_before=round(acc_before, 4), held_out_accuracy=round(acc_after, 4),
                    frozen_bit_identical=_all_true(unchanged, L.device),
                    frozen_with_optimizer_state=frozen_in_optimizer,
                    gradient_bytes_per_rank=resident.get("gradients"),
                    optimizer_bytes_per_rank=resident.get("optimizer"), **extra)
                L.print(f"    held-out loss {loss_before:.3f} -> {loss_after:.3f}, token accuracy "
                        f"{acc_before:.1%} -> {acc_after:.1%}; trainable {n_trainable:,}, frozen "
                        f"{n_frozen:,}; grads {fmt_bytes(resident.get('gradients'))}, optimizer "
                        f"{fmt_bytes(resident.get('optimizer'))} per rank")
                # everything that refers to this variant's parameters, so L.variant can free them
                del model, optimizer, trainable, frozen, frozen_before, data, step_fn, kwargs

        L.results.note("held_out_*: a split of the fine-tuning task (upper-case + rotate) that no "
                       "training batch contains; accuracy is teacher-forced token accuracy "
                       "(argmax of the logits).")
        L.results.note("gradient_bytes_per_rank / optimizer_bytes_per_rank: what each rank keeps "
                       "between steps (sharded); frozen weights have neither.")
        if L.device.type == "cpu":
            L.results.note("CPU run: memory from torch.distributed._tools trackers; step times are "
                           "only indicative.")


if __name__ == "__main__":
    main(parse_args())
