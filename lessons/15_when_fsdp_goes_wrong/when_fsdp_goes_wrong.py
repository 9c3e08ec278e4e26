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
import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
import torch.distributed as dist
import torch.nn.functional as F
from failure_pairs import PAIRS, run_pairs
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.doctor import same_build_findings
from utilities.errors import bounded, positive_float, positive_int
from utilities.parallelize import apply_fsdp
from utilities.results import variant
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


# -- the lesson run: its model, a small causal LM whose pieces each failure needs, and main -----
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
        run_pairs(lesson, args, SimpleNamespace(**globals()))  # each pair: the mistake, then the fix


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = lesson_parser(__doc__)
    p.add_variants(PAIRS)
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
