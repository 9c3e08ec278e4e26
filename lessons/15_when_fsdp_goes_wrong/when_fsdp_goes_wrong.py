"""Lesson 15: when FSDP goes wrong: the failures people meet, reproduced, measured and fixed.

Each variant is one failure in two halves, run on the same ranks: the mistake (the code a user
writes, and the symptom measured as the user would meet it: a loss that does not move, an error,
bytes, a norm, seconds of waiting) and the fix (the right code, the symptom measured gone).

    optimizer-before-shard   AdamW(model.parameters()) before fully_shard: the loss never moves
    bf16-weights             model.to(bfloat16) instead of a MixedPrecisionPolicy: updates lost
    grad-accumulation        set_requires_gradient_sync(False): unsharded gradients between steps
    tied-weights             embedding and head in different units: the tie is broken
    meta-init-buffers        meta device + to_empty: rotary inv_freq is garbage, not re-initialised
    frozen-fsdp1             frozen and trainable in one FSDP1 unit: an error; FSDP2 handles it
    reshard-after-forward    True or False: peak unsharded parameters against all-gathers per step
    skipped-collective       one rank runs one batch more: a hang, ended by a small timeout
    hand-clipping            a gradient norm by hand on local shards: not the model's norm
    optimizer-state          optimizer.state_dict() saved on rank 0: resumes to other numbers
    non-forward-method       a method other than forward on an FSDP2 model: sharded parameters
    memory-vs-rss            the process's RSS against the trackers' categories
    rank-seeds               each rank seeds its own build: the sharded model is a mix no rank built
    bf16-reduce              param_dtype bf16 without reduce_dtype: gradients summed in bf16

Run: fsdp-course run 15 [--quick]   or   torchrun --nproc-per-node 2 when_fsdp_goes_wrong.py --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import reduce_scalar, world_mesh
from utilities.doctor import diagnose, same_build_findings
from utilities.errors import bounded, positive_float, positive_int
from utilities.measure import fmt_bytes
from utilities.measure.memory import MemoryProbe
from utilities.measure.results import variant
from utilities.parallelize import apply_fsdp
from utilities.torch_internals import fsdp_forward_method_registrar


# -- 1. the optimizer must see the sharded parameters ----------------------------------------------
def optimizer_before_sharding(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The mistake: fully_shard replaces every parameter with a new (DTensor) one; an optimizer built
    before it holds the old tensors, which never get a gradient again."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    shard(model)
    return optimizer


def optimizer_after_sharding(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The fix: shard first, then build the optimizer over model.parameters()."""
    shard(model)
    return torch.optim.AdamW(model.parameters(), lr=lr)


def shard(model: nn.Module, **options) -> nn.Module:
    """One unit per block, then the root (embedding, final norm and head): lesson 01's wrapping."""
    return apply_fsdp(model, mesh=world_mesh(), units=model.blocks, **options)


# -- 2. bf16: a mixed-precision policy, not model.to(bfloat16) -----------------------------------
def bf16_weights(model: nn.Module) -> nn.Module:
    """The mistake: the weights themselves in bf16, so AdamW's update is added to a bf16 number
    (8 significant bits): an update smaller than half a unit in the last place is rounded away."""
    return shard(model.to(torch.bfloat16))


def bf16_policy(model: nn.Module) -> nn.Module:
    """The fix: fp32 sharded weights (the optimizer's), computed in bf16 after each all-gather,
    gradients reduced in fp32."""
    return shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32))


def bf16_policy_without_reduce_dtype(model: nn.Module) -> nn.Module:
    """The half-policy: ``param_dtype`` alone. ``reduce_dtype`` unset means "reduce in
    param_dtype": every gradient's reduce-scatter sums the ranks' bf16 gradients in bf16, each
    addition rounded to 8 significant bits. The fix is ``bf16_policy`` above."""
    return shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))


# -- 3. gradient accumulation: the memory / communication trade ------------------------------------
def accumulate_without_sync(model: nn.Module, micro_batches: list[torch.Tensor],
                            between: Callable[[], None] = lambda: None) -> None:
    """FSDP2: no reduce-scatter until the last micro-batch; each rank keeps the *unsharded*
    gradients in between (FSDP1's ``with model.no_sync():`` does the same). ``between`` runs
    after each micro-batch (logging; here the memory probe)."""
    for i, ids in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        (model.loss(ids) / len(micro_batches)).backward()
        between()


def accumulate_with_sync(model: nn.Module, micro_batches: list[torch.Tensor],
                         between: Callable[[], None] = lambda: None) -> None:
    """The other side: reduce-scatter every micro-batch; only sharded gradients stay, and each
    micro-batch pays a reduce-scatter per unit."""
    model.set_requires_gradient_sync(True)
    for ids in micro_batches:
        (model.loss(ids) / len(micro_batches)).backward()
        between()


# -- 4. tied weights: both ends of the tie in one unit --------------------------------------------
def shard_tie_split(model: nn.Module) -> nn.Module:
    """The mistake: the embedding and the head (one shared weight) each made a unit. fully_shard
    on the embedding replaces its weight; the head still holds the original tensor, and its own
    fully_shard makes a second, separate copy."""
    mesh = world_mesh()
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    return shard(model)


def shard_tie_together(model: nn.Module) -> nn.Module:
    """The fix: leave both ends to one unit (here the root; ``fully_shard([embed, head])`` from
    torch 2.7 groups them in a unit of their own)."""
    return shard(model)


# -- 5. meta-device init: re-create the buffers no checkpoint carries --------------------------------
def materialize_weights_only(model: nn.Module, state: dict[str, torch.Tensor], device) -> nn.Module:
    """The mistake: to_empty gives every parameter *and buffer* uninitialised memory; loading the
    checkpoint fills the parameters and persistent buffers only. Rotary ``inv_freq`` is
    non-persistent: it stays whatever the memory held."""
    model.to_empty(device=device)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return model


def materialize_and_reinit_buffers(model: nn.Module, state: dict[str, torch.Tensor], device) -> nn.Module:
    """The fix: after to_empty, recompute every non-persistent buffer from a fresh module of the
    same class (torchtitan's models do it in ``init_weights(buffer_device=...)``)."""
    materialize_weights_only(model, state, device)
    with torch.no_grad():
        for module in model.modules():
            persistent = set(module.state_dict(keep_vars=True))
            transient = [n for n, _ in module.named_buffers(recurse=False) if n not in persistent]
            if transient:
                fresh = rebuild(module)
                for name in transient:
                    getattr(module, name).copy_(getattr(fresh, name))
    return model


def rebuild(module: nn.Module) -> nn.Module:
    """A fresh CPU instance of ``module``'s class (Hugging Face rotary modules take the config)."""
    config = getattr(module, "config", None)
    return type(module)(config=config) if config is not None else type(module)()


# -- 6. frozen and trainable parameters in one unit -------------------------------------------------
def fsdp1_mixed_unit(model: nn.Module, device: torch.device, use_orig_params: bool) -> nn.Module:
    """FSDP1 flattens a unit into one FlatParameter with one requires_grad: frozen and trainable
    parameters in one unit need use_orig_params=True (else an error at wrapping)."""
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device,
                use_orig_params=use_orig_params)


# -- 7. reshard_after_forward -----------------------------------------------------------------------
def shard_reshard(model: nn.Module, reshard: bool) -> nn.Module:
    """True (the default): free each block's gathered weights after its forward, gather them again
    for backward. False: keep them from forward to backward (fewer all-gathers, more memory)."""
    return shard(model, reshard_after_forward=reshard)


# -- 8. every rank must make the same collectives ---------------------------------------------------
def uneven_epoch(model: nn.Module, my_batches: list[torch.Tensor], group) -> None:
    """The mistake: each rank loops over its own batches, then sums the epoch's loss. With one
    batch more on rank 0, rank 0's forward waits for an all-gather rank 1 never makes."""
    total = torch.zeros(1)
    for ids in my_batches:
        loss = model.loss(ids)
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total, group=group)


def even_epoch(model: nn.Module, my_batches: list[torch.Tensor], group) -> None:
    """The fix: every rank runs the same number of steps (the fewest any rank has; or pad, or a
    DistributedSampler with drop_last)."""
    steps = torch.tensor([len(my_batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MIN, group=group)
    uneven_epoch(model, my_batches[: int(steps)], group)


def timeout_group(seconds: float, detail: bool):
    """A process group whose collectives give up after ``seconds``; ``detail``: the same group as
    TORCH_DISTRIBUTED_DEBUG=DETAIL makes it, checking every collective's fingerprint across ranks
    before running it."""
    dist.set_debug_level(dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    try:
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)


# -- 9. gradient clipping: the norm of the whole model --------------------------------------------
@torch.no_grad()
def clip_by_hand(params: list[nn.Parameter], max_norm: float) -> float:
    """The mistake: the norm of the gradients this rank holds (its shards), so each rank finds
    another, smaller norm and scales its shards by another factor."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)


def clip_dtensors(params: list[nn.Parameter], max_norm: float) -> float:
    """The fix: clip_grad_norm_ on the DTensor gradients reduces the squares over the ranks
    (FSDP1: ``model.clip_grad_norm_``, its own method)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


# -- 10. optimizer state: the sharded model's API ---------------------------------------------------
def save_plain(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The mistake: rank 0 saves ``optimizer.state_dict()``: keys by position, values rank 0's
    shards only."""
    if dist.get_rank() == 0:
        torch.save(optimizer.state_dict(), path)
    dist.barrier()


def load_plain(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    optimizer.load_state_dict(torch.load(path, weights_only=True))


def save_optimizer_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The fix: ``get_optimizer_state_dict`` gathers every shard into full tensors keyed by
    parameter name (a collective: every rank calls it), rank 0 writes them."""
    state = get_optimizer_state_dict(model, optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()


def load_optimizer_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """``set_optimizer_state_dict`` takes each rank's shard of every full tensor."""
    set_optimizer_state_dict(model, optimizer, torch.load(path, weights_only=True),
                             options=StateDictOptions(full_state_dict=True))


# -- 11. methods other than forward -------------------------------------------------------------------
def register_generate(model: nn.Module) -> nn.Module:
    """The fix: FSDP2 gathers a unit's parameters in hooks around ``forward``; a method the model
    calls instead (``generate``) gets the same hooks once registered."""
    fsdp_forward_method_registrar()(model, "generate")
    return model


# -- 13. every rank builds the same model ------------------------------------------------------------
def build_seeded_per_rank(seed: int, **kw) -> TinyLM:
    """The mistake: each rank seeds with its rank (for its own data order) before building the
    model. Every rank builds other weights; fully_shard keeps each rank's shard of its own build,
    so the model trained is a mix that no rank built, and nothing fails."""
    torch.manual_seed(seed + dist.get_rank())
    return TinyLM(**kw)


def build_seeded_alike(seed: int, **kw) -> TinyLM:
    """The fix: one seed for the model on every rank (seed the data per rank afterwards)."""
    torch.manual_seed(seed)
    return TinyLM(**kw)


def check_same_build(model: nn.Module) -> list[str]:
    """Before sharding, on every rank: ``same_build_findings`` all-gathers a checksum of every
    tensor and names the ones that differ between ranks (nothing: every rank built one model)."""
    return [finding.line for finding in same_build_findings(model)]


# -- the lesson's model: a small causal LM whose pieces each failure needs --------------------------
class Block(nn.Module):
    def __init__(self, d: int, adapter: int = 0):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        # a LoRA-style adapter: trainable while fc1 / fc2 are frozen
        self.down = nn.Linear(d, adapter, bias=False) if adapter else None
        self.up = nn.Linear(adapter, d, bias=False) if adapter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = self.fc2(F.gelu(self.fc1(h)))
        if self.down is not None:
            out = out + self.up(self.down(h))
        return x + out


class TinyLM(nn.Module):
    """Embedding, ``layers`` residual MLP blocks, a final norm and a head (tied or not)."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, tie: bool = False, adapter: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, adapter) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        return lm_loss(self, ids)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy decoding through the modules, not through forward (as Hugging Face's
        encoder-decoder generate calls the encoder directly)."""
        for _ in range(new_tokens):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            nxt = self.head(self.norm(x))[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy through ``model(...)``: through the wrapper's forward, which an
    FSDP1 wrapper needs (its ``.loss`` would reach the inner module's and skip the gathering)."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def counting_batch(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """Sequences that count up (mod vocab) from a random start: a task a tiny model learns in a
    few steps, so a loss that does not move is the failure, not the task."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    return (start + torch.arange(seq)) % vocab


# -- the comparison: each failure, the mistake then the fix --------------------------------------------
def train_losses(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor],
                 steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(batches[step % len(batches)])
        loss.backward()
        optimizer.step()
        losses.append(reduce_scalar(loss.item(), "mean"))
    return losses


@contextlib.contextmanager
def mixed_unit_warnings_off():
    """FSDP1's warning, once per unit and rank, that a unit mixes frozen and trainable parameters
    (its gradient memory is the whole unit's): the pair makes that mix on purpose and measures it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has both parameters with requires_grad=True and False")
        yield


def first_line(e: BaseException) -> str:
    """An exception as the user reads it: its type and the first line of its message, without the
    source path gloo puts in front."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", str(e).strip()).splitlines()[0]
    return f"{type(e).__name__}: {text}"[:300]


def short(text: str | None, n: int = 72) -> str | None:
    """An error as a table cell: its first ``n`` characters (results.json keeps the line)."""
    return text if text is None or len(text) <= n else text[: n - 3] + "..."


def tokens(equal: bool) -> str:
    return "the unsharded model's tokens" if equal else "other tokens"


def said(error: str | None) -> str:
    return "an error" if error else "no error"


def ok(flag: bool) -> bool:
    """The same answer on every rank (the smaller): a pair passes only where every rank saw it."""
    return bool(reduce_scalar(int(bool(flag)), "min"))


class Failures:
    """The variants, each a method returning the fields of its row: ``measure`` (what is compared),
    ``mistake`` and ``fix`` (the two values, from the run), ``symptom_shown`` and ``fix_works``."""

    def __init__(self, lesson: Lesson, args: argparse.Namespace):
        self.lesson, self.args = lesson, args
        self.vocab, self.seq = 64, 17
        self.rank = dist.get_rank()

    def model(self, seed: int = 0, **kw) -> TinyLM:
        torch.manual_seed(self.args.seed + seed)
        model = TinyLM(self.vocab, **kw)
        self.lesson._track(model)
        return model

    def batches(self, n: int, batch: int = 8, same_on_every_rank: bool = False) -> list[torch.Tensor]:
        offset = 0 if same_on_every_rank else 1000 * (self.rank + 1)
        return [counting_batch(batch, self.seq, self.vocab, self.args.seed + offset + i) for i in range(n)]

    # 1
    def optimizer_before_shard(self) -> dict:
        data, steps = self.batches(4), self.args.fail_steps
        result = {}
        for half, build in (("mistake", optimizer_before_sharding), ("fix", optimizer_after_sharding)):
            model = self.model()
            optimizer = build(model, 3e-3)
            losses = train_losses(model, optimizer, data, steps)
            result[f"{half}_loss_drop"] = round(losses[0] - losses[-1], 4)
            result[f"{half}_losses"] = [round(x, 4) for x in losses]
        return dict(result, measure=f"loss drop, {steps} steps",
                    mistake=f"{result['mistake_loss_drop']:.3f}", fix=f"{result['fix_loss_drop']:.3f}",
                    symptom_shown=abs(result["mistake_loss_drop"]) < 0.05,
                    fix_works=result["fix_loss_drop"] > 0.3)

    # 2
    def bf16_weights(self) -> dict:
        data, steps = self.batches(4), self.args.bf16_steps
        result = {}
        for half, build in (("mistake", bf16_weights), ("fix", bf16_policy)):
            model = build(self.model(d=64))
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.args.bf16_lr)
            losses = train_losses(model, optimizer, data, steps - 1)
            before = [p.to_local().detach().clone() for p in model.parameters()]
            losses += train_losses(model, optimizer, data[steps % len(data):], 1)
            same = sum(int((b == p.to_local()).sum()) for b, p in zip(before, model.parameters()))
            total = sum(b.numel() for b in before)
            result[f"{half}_final_loss"] = round(sum(losses[-3:]) / 3, 4)
            share = reduce_scalar(same, "sum") / reduce_scalar(total, "sum")
            result[f"{half}_unchanged_fraction"] = round(share, 4)
            result[f"{half}_param_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        gap = result["mistake_final_loss"] - result["fix_final_loss"]
        return dict(result, loss_gap=round(gap, 4),
                    measure=f"weights the last step left unchanged; loss at step {steps}",
                    mistake=f"{result['mistake_unchanged_fraction']:.0%}; {result['mistake_final_loss']:.3f}",
                    fix=f"{result['fix_unchanged_fraction']:.0%}; {result['fix_final_loss']:.3f}",
                    symptom_shown=result["mistake_unchanged_fraction"] > 0.3
                    and result["mistake_final_loss"] > 1.25 * result["fix_final_loss"],
                    fix_works=result["fix_unchanged_fraction"] < 0.05)

    # 3
    def grad_accumulation(self) -> dict:
        micro = self.batches(self.args.micro_batches, batch=4)
        result, finals = {}, []
        for half, accumulate in (("mistake", accumulate_without_sync), ("fix", accumulate_with_sync)):
            model = shard(self.model(d=64, layers=4))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            with MemoryProbe(model, optimizer, self.lesson.device) as probe, comm_counts() as comms:
                accumulate(model, micro, probe.next_iteration)
            optimizer.step()
            finals.append([p.to_local().detach().clone() for p in model.parameters()])
            detail = probe.peak["detail"]
            result[f"{half}_peak_gradient_bytes"] = probe.peak["gradients"]
            result[f"{half}_resident_gradient_bytes"] = detail["resident_after_step"]["gradients"]
            result[f"{half}_reduce_scatters"] = comms.get("reduce_scatter", 0)
        diff = max(float((a - b).abs().max()) for a, b in zip(*finals))
        full = 4 * sum(p.numel() for p in self.model(d=64, layers=4).parameters())
        return dict(result, micro_batches=len(micro), unsharded_gradient_bytes=full,
                    same_update_max_abs_diff=diff,
                    measure=f"peak grads; reduce-scatters ({len(micro)} micro-batches)",
                    mistake=f"{fmt_bytes(result['mistake_peak_gradient_bytes'])}; "
                            f"{result['mistake_reduce_scatters']}",
                    fix=f"{fmt_bytes(result['fix_peak_gradient_bytes'])}; {result['fix_reduce_scatters']}",
                    symptom_shown=result["mistake_peak_gradient_bytes"] >= 0.9 * full,
                    fix_works=result["fix_peak_gradient_bytes"] < 0.75 * full and diff < 1e-5)

    # 4
    def tied_weights(self) -> dict:
        """Newer torch refuses the split tie at the first forward (an error naming the weight);
        older torch trains two copies that drift apart. Either is the symptom."""
        data, result = self.batches(2), {}
        for half, wrap in (("mistake", shard_tie_split), ("fix", shard_tie_together)):
            model = wrap(self.model(tie=True))
            embed, head = model.embed.weight, model.head.weight
            copies = {id(p) for p in model.parameters() if p.shape == embed.shape}
            result[f"{half}_weight_copies"] = len(copies)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            try:
                train_losses(model, optimizer, data, 3)
                result[f"{half}_error"] = None
                gap = (embed.full_tensor() - head.full_tensor()).abs().max()
                result[f"{half}_tie_max_abs_diff"] = float(gap.detach())
            except ValueError as e:
                result[f"{half}_error"], result[f"{half}_tie_max_abs_diff"] = first_line(e), None
        m = result["mistake_tie_max_abs_diff"]
        return dict(result, measure="copies of the tied weight; training",
                    mistake=f"{result['mistake_weight_copies']}; "
                            + (short(result["mistake_error"]) or f"|embed - head| {m:.2g} after 3 steps"),
                    fix=f"{result['fix_weight_copies']}; |embed - head| {result['fix_tie_max_abs_diff']:.2g}",
                    symptom_shown=result["mistake_weight_copies"] == 2
                    and (result["mistake_error"] is not None or (m or 0) > 0),
                    fix_works=result["fix_weight_copies"] == 1 and result["fix_tie_max_abs_diff"] == 0
                    and embed is head)

    # 5
    def meta_init_buffers(self) -> dict:
        spec = self.lesson.spec
        torch.manual_seed(self.args.seed)
        eager = spec.build("cpu")
        state = {k: v.detach().clone() for k, v in eager.state_dict().items()}
        ids = counting_batch(2, 16, 64, self.args.seed)
        with torch.no_grad():
            reference = eager(input_ids=ids).logits
        result = {}
        halves = (("mistake", materialize_weights_only), ("fix", materialize_and_reinit_buffers))
        for half, materialize in halves:
            model = spec.build("meta")
            self.lesson._track(model)
            block = spec.block_class()
            apply_fsdp(model, mesh=world_mesh(),
                       units=[m for m in model.modules() if isinstance(m, block)])
            materialize(model, state, self.lesson.device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            err = (logits - reference).abs().max()
            result[f"{half}_logits_max_abs_diff"] = float(err) if torch.isfinite(err) else None
            result[f"{half}_finite"] = ok(bool(torch.isfinite(logits).all()))
            buffers = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
            result[f"{half}_inv_freq_matches"] = ok(all(torch.equal(b, eager.get_buffer(n))
                                                       for n, b in model.named_buffers()
                                                       if n.endswith("inv_freq")) and bool(buffers))
        bad = result["mistake_logits_max_abs_diff"]
        return dict(result, measure=f"max |logits - eager {spec.name}'s|",
                    mistake="NaN" if bad is None else f"{bad:.3g}",
                    fix=f"{result['fix_logits_max_abs_diff']:.3g}",
                    symptom_shown=(bad is None or bad > 1e-3) and not result["mistake_inv_freq_matches"],
                    fix_works=result["fix_logits_max_abs_diff"] is not None
                    and result["fix_logits_max_abs_diff"] < 1e-5 and result["fix_inv_freq_matches"])

    # 6
    def frozen_fsdp1(self) -> dict:
        def lora(model: TinyLM) -> TinyLM:
            for name, p in model.named_parameters():
                p.requires_grad_(".down." in name or ".up." in name)
            return model

        try:
            with mixed_unit_warnings_off():
                fsdp1_mixed_unit(lora(self.model(adapter=4)), self.lesson.device, use_orig_params=False)
            error = None
        except (ValueError, RuntimeError) as e:
            error = first_line(e)
        model = shard(lora(self.model(adapter=4)))
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=3e-3)
        losses = train_losses(model, optimizer, self.batches(2), 3)
        model.loss(self.batches(1)[0]).backward()
        grads = {flag: sum(p.grad.to_local().numel() * 4 for p in model.parameters()
                           if p.requires_grad == flag and p.grad is not None) for flag in (True, False)}
        with mixed_unit_warnings_off():
            fsdp1 = fsdp1_mixed_unit(lora(self.model(adapter=4)), self.lesson.device, use_orig_params=True)
        fsdp1_ok = all(p.grad is None for p in fsdp1.parameters() if not p.requires_grad)
        n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        return dict(fsdp1_error=error, fsdp2_loss_drop=round(losses[0] - losses[-1], 4),
                    trainable_gradient_bytes_per_rank=grads[True],
                    frozen_gradient_bytes_per_rank=grads[False],
                    optimizer_states=len(optimizer.state), frozen_parameters_sharded=n_frozen,
                    fsdp1_orig_params_wraps=fsdp1_ok,
                    measure="FSDP1 wrap; FSDP2 grads frozen / trainable",
                    mistake=short(error) or "accepted",
                    fix=f"{fmt_bytes(grads[False])} / {fmt_bytes(grads[True])}",
                    symptom_shown=error is not None and "requires_grad" in error,
                    fix_works=grads[False] == 0 and grads[True] > 0 and losses[-1] < losses[0])

    # 7
    def reshard_after_forward(self) -> dict:
        data, result = self.batches(2), {}
        for half, reshard in (("mistake", False), ("fix", True)):
            model = shard_reshard(self.model(d=64, layers=4), reshard)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            train_losses(model, optimizer, data, 1)
            with MemoryProbe(model, optimizer, self.lesson.device) as probe, comm_counts() as comms:
                train_losses(model, optimizer, data, 1)
            unsharded = probe.peak["detail"].get("unsharded_parameters")
            result[f"{half}_peak_unsharded_parameter_bytes"] = unsharded
            result[f"{half}_all_gathers"] = comms.get("all_gather", 0)
        m, f = result["mistake_peak_unsharded_parameter_bytes"], result["fix_peak_unsharded_parameter_bytes"]
        return dict(result, measure="False vs True: unsharded at peak; all-gathers",
                    mistake=f"{fmt_bytes(m)}; {result['mistake_all_gathers']}",
                    fix=f"{fmt_bytes(f)}; {result['fix_all_gathers']}",
                    symptom_shown=m > f, fix_works=result["fix_all_gathers"] > result["mistake_all_gathers"])

    # 8
    def skipped_collective(self) -> dict:
        seconds = self.args.hang_timeout
        mine = self.batches(3 if self.rank == 0 else 2, batch=2)
        result = {}
        for half, detail, epoch in (("mistake", False, uneven_epoch), ("detail", True, uneven_epoch),
                                    ("fix", False, even_epoch)):
            group = timeout_group(seconds, detail)
            mesh = _mesh_of(group, self.lesson.device)
            model = self.model()
            apply_fsdp(model, mesh=mesh, units=model.blocks)
            t0 = time.perf_counter()
            try:
                epoch(model, mine, group)
                error, names = None, ""
            except RuntimeError as e:
                error, names = first_line(e), _fingerprints(str(e))
            result[f"{half}_names"] = _from_rank0(names)
            result[f"{half}_seconds"] = round(reduce_scalar(time.perf_counter() - t0, "max"), 2)
            result[f"{half}_error_rank0"] = _from_rank0(error)
            del model
            dist.destroy_process_group(group)
        named = result["detail_names"]
        return dict(result, timeout_s=seconds,
                    measure=f"seconds to an error (timeout {seconds:g} s); names",
                    mistake=f"{result['mistake_seconds']:.1f} s, {said(result['mistake_error_rank0'])}; "
                            f"DETAIL: {result['detail_seconds']:.2f} s, {named or 'nothing named'}",
                    fix=f"{result['fix_seconds']:.2f} s, {said(result['fix_error_rank0'])}",
                    symptom_shown=result["mistake_error_rank0"] is not None
                    and result["mistake_seconds"] >= 0.8 * seconds and not result["mistake_names"]
                    and "rank 0" in named and "rank 1" in named,
                    fix_works=result["fix_error_rank0"] is None and result["fix_seconds"] < seconds / 2)

    # 9
    def hand_clipping(self) -> dict:
        ids = self.batches(1, same_on_every_rank=True)[0]
        reference = self.model()
        reference.loss(ids).backward()
        true_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")))
        result = {"reference_norm": round(true_norm, 6)}
        for half, clip in (("mistake", clip_by_hand), ("fix", clip_dtensors)):
            model = shard(self.model())
            model.loss(ids).backward()
            norms = _gather_objects(clip(list(model.parameters()), 1e9))
            result[f"{half}_norms_per_rank"] = [round(n, 6) for n in norms]
            result[f"{half}_max_rel_error"] = round(max(abs(n - true_norm) / true_norm for n in norms), 6)
        fsdp1 = FSDP(self.model(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=self.lesson.device)
        lm_loss(fsdp1, ids).backward()
        plain = _gather_objects(float(torch.nn.utils.clip_grad_norm_(fsdp1.parameters(), 1e9)))
        own = _gather_objects(float(fsdp1.clip_grad_norm_(1e9)))
        result.update(fsdp1_plain_max_rel_error=round(max(abs(n - true_norm) / true_norm for n in plain), 6),
                      fsdp1_method_max_rel_error=round(max(abs(n - true_norm) / true_norm for n in own), 6))
        return dict(result, measure="norm per rank / the unsharded model's",
                    mistake=" ".join(f"{n / true_norm:.3f}" for n in result["mistake_norms_per_rank"]),
                    fix=" ".join(f"{n / true_norm:.3f}" for n in result["fix_norms_per_rank"]),
                    symptom_shown=result["mistake_max_rel_error"] > 0.05,
                    fix_works=result["fix_max_rel_error"] < 1e-4
                    and result["fsdp1_method_max_rel_error"] < 1e-4)

    # 10
    def optimizer_state(self) -> dict:
        data, steps = self.batches(4), 3
        self.lesson.out.mkdir(parents=True, exist_ok=True)
        model = shard(self.model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train_losses(model, optimizer, data, steps)
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # every rank
        weights = {k: v.clone() for k, v in weights.items()}
        files = {}
        for half, save in (("mistake", save_plain), ("fix", save_optimizer_by_name)):
            files[half] = self.lesson.out / f"optimizer_{half}.pt"
            save(model, optimizer, files[half])
        onward = train_losses(model, optimizer, data[steps % len(data):], 2)
        result = {"uninterrupted_losses": [round(x, 6) for x in onward]}
        for half, load in (("mistake", load_plain), ("fix", load_optimizer_by_name)):
            fresh = shard(self.model(seed=1))
            set_model_state_dict(fresh, weights, options=StateDictOptions(full_state_dict=True))
            opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
            try:
                load(fresh, opt, files[half])
                error = None
            except (KeyError, ValueError, RuntimeError, AssertionError) as e:
                error = first_line(e)
            errors = [f"rank {r}: {e}" for r, e in enumerate(_gather_objects(error)) if e]
            result[f"{half}_error"], result[f"{half}_max_abs_loss_diff"] = (errors or [None])[0], None
            if not errors:  # every rank resumes, or none: a rank alone in a step would hang
                resumed = train_losses(fresh, opt, data[steps % len(data):], 2)
                result[f"{half}_max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(resumed, onward))
        for path in files.values():
            dist.barrier()
            if self.rank == 0:
                path.unlink(missing_ok=True)
        m = result["mistake_max_abs_loss_diff"]
        return dict(result, measure="max |resumed - uninterrupted loss|",
                    mistake=short(result["mistake_error"]) or f"{m:.2g}",
                    fix=f"{result['fix_max_abs_loss_diff']:.2g}",
                    symptom_shown=result["mistake_error"] is not None or m > 1e-4,
                    fix_works=result["fix_max_abs_loss_diff"] == 0.0)

    # 11
    def non_forward_method(self) -> dict:
        prompt = self.batches(1, batch=2, same_on_every_rank=True)[0][:, :4]
        reference = self.model().generate(prompt, 6)
        result = {}
        for half, prepare in (("mistake", lambda m: m), ("fix", register_generate)):
            model = prepare(shard(self.model()))
            said = [f.line for f in diagnose(model, methods=["generate"]) if f.check == "unregistered-method"]
            result[f"{half}_doctor"] = said[0] if said else None  # said before the call, from the code
            try:
                out = model.generate(prompt, 6)
                error, equal = None, ok(torch.equal(out, reference))
            except (RuntimeError, TypeError, ValueError, AssertionError) as e:
                error, equal = first_line(e), False
            result[f"{half}_error"], result[f"{half}_equal_to_unsharded"] = error, equal
        return dict(result, measure="generate() on the FSDP2 model",
                    mistake=short(result["mistake_error"]) or tokens(result["mistake_equal_to_unsharded"]),
                    fix=short(result["fix_error"]) or tokens(result["fix_equal_to_unsharded"]),
                    symptom_shown=result["mistake_error"] is not None
                    or not result["mistake_equal_to_unsharded"],
                    fix_works=result["fix_error"] is None and result["fix_equal_to_unsharded"])

    # 14
    def bf16_reduce(self) -> dict:
        ids = self.batches(1)[0]  # each rank its own batch: the ranks' gradients differ
        result, grads = {}, {}
        for half, wrap in (("mistake", bf16_policy_without_reduce_dtype), ("fix", bf16_policy)):
            model = wrap(self.model(d=64))
            with comm_dtypes() as dtypes:
                model.loss(ids).backward()
            grads[half] = torch.cat([p.grad.full_tensor().float().flatten() for p in model.parameters()])
            result[f"{half}_reduce_dtypes"] = sorted(dtypes.get("reduce_scatter", ()))
            said = [f.line for f in diagnose(model) if f.check == "low-precision-reduce"]
            result[f"{half}_doctor"] = said[0] if said else None
        error = float((grads["mistake"] - grads["fix"]).norm() / grads["fix"].norm())
        result["mistake_grad_rel_error"] = round(error, 6)
        m, f = result["mistake_reduce_dtypes"], result["fix_reduce_dtypes"]
        return dict(result, measure="reduce-scatter dtype; gradients vs an fp32 reduction; doctor",
                    mistake=f"{'/'.join(m)}; {error:.2%}; "
                            + ("low-precision-reduce" if result["mistake_doctor"] else "nothing said"),
                    fix=f"{'/'.join(f)}; 0%; "
                        + ("low-precision-reduce" if result["fix_doctor"] else "nothing said"),
                    symptom_shown=m == ["bfloat16"] and error > 1e-4 and result["mistake_doctor"] is not None,
                    fix_works=f == ["float32"] and result["fix_doctor"] is None)

    # 12
    def memory_vs_rss(self) -> dict:
        rss_before = process_rss_bytes()
        model = shard(self.model(d=128, layers=4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = self.batches(2, batch=8)
        train_losses(model, optimizer, data, 1)
        with MemoryProbe(model, optimizer, self.lesson.device) as probe:
            train_losses(model, optimizer, data, 1)
        rss = process_rss_bytes()
        peak = probe.peak
        parts = sum(peak[k] for k in ("parameters", "gradients", "optimizer", "activations"))
        other = sum(v for k, v in peak["detail"].items() if k in ("buffers", "temporaries", "all_gather",
                                                                   "reduce_scatter", "inputs", "other"))
        cached = allocator_model(model, optimizer, data, self.lesson.device)
        return dict(process_rss_bytes=rss, rss_before_model_bytes=rss_before,
                    tracker_peak_bytes=peak["total"], tracker_categories_bytes=parts + other,
                    rss_to_tracker_ratio=round(rss / peak["total"], 1),
                    allocator_allocated_bytes=cached["allocated"],
                    allocator_reserved_bytes=cached["reserved"],
                    reserved_to_allocated_ratio=round(cached["reserved"] / cached["allocated"], 2),
                    measure="RSS vs tracker peak; categories vs peak; reserved (allocator model)",
                    mistake=f"{fmt_bytes(rss)} vs {fmt_bytes(peak['total'])}",
                    fix=f"{fmt_bytes(parts + other)} of {fmt_bytes(peak['total'])}, "
                        f"reserved {fmt_bytes(cached['reserved'])}",
                    symptom_shown=rss > 10 * peak["total"],
                    fix_works=abs(parts + other - peak["total"]) <= 0.01 * peak["total"]
                    and peak["total"] <= cached["allocated"] <= cached["reserved"])


    # 13
    def rank_seeds(self) -> dict:
        result = {}
        for half, build in (("mistake", build_seeded_per_rank), ("fix", build_seeded_alike)):
            model = build(self.args.seed, vocab=self.vocab)
            self.lesson._track(model)
            said = check_same_build(model)
            builds = _gather_objects({n: p.detach().cpu().clone() for n, p in model.named_parameters()})
            shard(model)
            as_built, farthest = 0, 0.0
            for name, p in model.named_parameters():
                gathered = p.full_tensor().detach().cpu()
                gaps = [float((gathered - build[name]).abs().max()) for build in builds]
                as_built += min(gaps) == 0.0
                farthest = max(farthest, min(gaps))
            result[f"{half}_tensors_as_a_rank_built"] = as_built
            result[f"{half}_max_abs_diff_from_nearest_build"] = farthest
            result[f"{half}_doctor"] = said[0] if said else None
        tensors = len(list(model.parameters()))
        m, f = result["mistake_tensors_as_a_rank_built"], result["fix_tensors_as_a_rank_built"]
        return dict(result, tensors=tensors,
                    measure="tensors as some rank built them, max |gathered - nearest build|; check",
                    mistake=f"{m} of {tensors}, {result['mistake_max_abs_diff_from_nearest_build']:.2g}; "
                            + ("rank-divergent-build" if result["mistake_doctor"] else "nothing said"),
                    fix=f"{f} of {tensors}, {result['fix_max_abs_diff_from_nearest_build']:.2g}; "
                        + ("rank-divergent-build" if result["fix_doctor"] else "nothing said"),
                    symptom_shown=m < tensors and result["mistake_max_abs_diff_from_nearest_build"] > 1e-3
                    and result["mistake_doctor"] is not None,
                    fix_works=f == tensors and result["fix_max_abs_diff_from_nearest_build"] == 0.0
                    and result["fix_doctor"] is None)

def allocator_model(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor],
                    device: torch.device) -> dict[str, int]:
    """One more step, its allocations and frees recorded by the memory tracker and replayed through
    the model of CUDA's caching allocator that ``fsdp-course plan`` reports as ``reserved``
    (``utilities.measure.allocator.reserved_peak``): what the step allocates at its peak, rounded
    to the allocator's 512-byte blocks, and what the allocator reserves (its cached segments:
    what ``torch.cuda.memory_reserved``, ``nvidia-smi`` less the CUDA context, torchtitan's memory
    column and an out-of-memory message report)."""
    from utilities.measure.allocator import EventRecorder, reserved_peak
    from utilities.measure.memory import TrackerHooks
    from utilities.torch_internals import fsdp_mem_tracker

    tracker = fsdp_mem_tracker()(model, optimizer)
    recorder = EventRecorder(tracker, device.type)
    with TrackerHooks(), tracker:
        start = len(recorder.events)
        train_losses(model, optimizer, data, 1)
    return reserved_peak(recorder.events[:start], recorder.events[start:])


class _Collectives(TorchDispatchMode):
    """Counts the collectives this rank makes, by kind (all_gather, reduce_scatter, ...), as
    torch's dispatcher sees them, and the dtypes of the tensors each kind moves."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.dtypes: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0].lower().strip("_")
        if getattr(func, "namespace", "") == "c10d" or "c10d" in str(func):
            kind = ("all_gather" if "allgather" in name else "reduce_scatter" if "reduce_scatter" in name
                    else name)
            self.counts[kind] = self.counts.get(kind, 0) + 1
            moved = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                     if isinstance(t, torch.Tensor)]
            self.dtypes.setdefault(kind, set()).update(str(t.dtype).removeprefix("torch.") for t in moved)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def comm_counts():
    """``with comm_counts() as counts:`` the collectives made inside, by kind."""
    mode = _Collectives()
    with mode:
        yield mode.counts


@contextlib.contextmanager
def comm_dtypes():
    """``with comm_dtypes() as dtypes:`` the dtypes each kind of collective moved inside."""
    mode = _Collectives()
    with mode:
        yield mode.dtypes


def process_rss_bytes() -> int:
    """What the operating system says the process holds (``top``'s RES): every page the process
    has touched and not returned, torch's libraries included."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _mesh_of(group, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def _gather_objects(value):
    """Every rank's ``value``, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _from_rank0(text: str | None) -> str | None:
    out = [text]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def _fingerprints(message: str | None) -> str:
    """The ranks and collectives TORCH_DISTRIBUTED_DEBUG=DETAIL names in its mismatch error
    ("rank 0: _ALLGATHER_BASE, rank 1: ALLREDUCE"), read from the message itself."""
    found = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
                       r"OpType=(\w+)", message or "")
    return ", ".join(f"rank {r}: {op}" for r, op in found)


VARIANTS: dict[str, Callable[[Failures], dict]] = {
    "optimizer-before-shard": Failures.optimizer_before_shard,
    "bf16-weights": Failures.bf16_weights,
    "grad-accumulation": Failures.grad_accumulation,
    "tied-weights": Failures.tied_weights,
    "meta-init-buffers": Failures.meta_init_buffers,
    "frozen-fsdp1": Failures.frozen_fsdp1,
    "reshard-after-forward": Failures.reshard_after_forward,
    "skipped-collective": Failures.skipped_collective,
    "hand-clipping": Failures.hand_clipping,
    "optimizer-state": Failures.optimizer_state,
    "non-forward-method": Failures.non_forward_method,
    "memory-vs-rss": Failures.memory_vs_rss,
    "rank-seeds": Failures.rank_seeds,
    "bf16-reduce": Failures.bf16_reduce,
}
NOTES = ("symptom shown / fix works: the mistake's measured symptom is there, and the fix's measure "
         "is where it should be, on every rank (each test of tests/test_lesson_15.py asserts one pair).",
         "mistake / fix: the two values of the measure, from this run.")
CPU_NOTE = ("CPU run: memory from torch.distributed._tools trackers, reserved from plan's model of "
            "CUDA's caching allocator; a GPU measures allocated vs reserved vs nvidia-smi "
            "(memory-vs-rss) and NCCL's own timeouts (skipped-collective).")


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    rows = results["variants"]
    shown = sum(1 for v in rows if v.get("symptom_shown"))
    fixed = sum(1 for v in rows if v.get("fix_works"))
    hang = variant(results, "skipped-collective")
    return (f"{shown} of {len(rows)} mistakes showed their symptom and {fixed} of {len(rows)} fixes removed "
            f"it; a skipped collective waited {hang['mistake_seconds']:.1f} s for its timeout, while "
            f"TORCH_DISTRIBUTED_DEBUG=DETAIL named it in {hang['detail_seconds']:.2f} s "
            f"({hang['detail_names']})")


def main(args: argparse.Namespace) -> None:
    with Lesson("15", args, settings=settings(args), needs_ranks="what sharding breaks", notes=NOTES,
                cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        lesson.results.columns("symptom_shown", "fix_works", "measure", "mistake", "fix")
        failures = Failures(lesson, args)
        for name in args.variants:
            with lesson.variant(name):
                t0 = time.perf_counter()
                fields = VARIANTS[name](failures)
                fields["seconds"] = round(reduce_scalar(time.perf_counter() - t0, "max"), 2)
                lesson.results.add(name, **fields)
                lesson.print(f"  {name}: {fields['measure']}: mistake {fields['mistake']} -> fix "
                             f"{fields['fix']} (symptom shown: {'yes' if fields['symptom_shown'] else 'NO'}, "
                             f"fix works: {'yes' if fields['fix_works'] else 'NO'})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--fail-steps", type=positive_int, default=6,
                   help="optimizer-before-shard: steps trained on each side (default 6)")
    p.add_argument("--bf16-steps", type=positive_int, default=None,
                   help="bf16-weights: steps on each side, enough for the loss gap to show "
                        "(default 120 quick, 240)")
    p.add_argument("--bf16-lr", type=positive_float, default=5e-4,
                   help="bf16-weights: AdamW learning rate; the smaller, the more updates bf16 loses "
                        "(default 5e-4)")
    p.add_argument("--micro-batches", type=positive_int, default=4,
                   help="grad-accumulation: micro-batches per optimizer step (default 4)")
    p.add_argument("--hang-timeout", type=bounded(float, 0.2, 60), default=2.0,
                   help="skipped-collective: seconds before a collective gives up (default 2; "
                        "torch's default is 10 minutes for gloo and NCCL)")
    args = p.parse(argv)
    args.bf16_steps = args.bf16_steps or (120 if args.quick else 240)
    return args


def settings(args: argparse.Namespace) -> dict:
    return dict(fail_steps=args.fail_steps, bf16_steps=args.bf16_steps, bf16_lr=args.bf16_lr,
                micro_batches=args.micro_batches, hang_timeout=args.hang_timeout)


if __name__ == "__main__":
    main(parse_args())
