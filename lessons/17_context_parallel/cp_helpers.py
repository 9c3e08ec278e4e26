"""What lesson 17 measures around its ring (context_parallel.py holds the ring and the wrapping).

* ``TinyLlama``: a small Llama-like decoder (RMSNorm, rotary positions, SwiGLU) whose attention is
  a function the caller chooses: SDPA on the whole sequence, or the ring on this rank's tokens;
  rotary positions come from the caller, so a rank's tokens keep their global positions;
* ``reverse_batches``: the course's reversal task as global batches, inputs and next-token labels
  shifted before the sequence is split, and each rank's slice of them;
* ``attention_inputs`` / ``largest_difference``: q, k, v and an upstream gradient made alike on every
  rank, and the largest difference over every rank;
* ``per_rank``: one number from each rank, as a list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from utilities.data import ReverseTask
from utilities.distributed import reduce_scalar
from utilities.measure.tensor_parallel import FeedForward

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unsplit causal attention: the reference every split one is compared with."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rotary(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, tokens, head dim) at global positions ``pos``."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angle = pos.to(x.device, torch.float32)[:, None] * inv[None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        x = x + self.o(attend(rotary(q, pos), rotary(k, pos), v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """A Llama-like decoder; ``attend`` (a plain attribute, default ``causal_sdpa``) is its attention."""

    def __init__(self, vocab: int, dim: int = 128, layers: int = 4, heads: int = 4, hidden: int = 352):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.attend: Attend = causal_sdpa

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.attend)
        return self.head(self.norm(x))


def token_loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    """The summed next-token loss of a batch's tokens (labels already shifted; -100 ignored)."""
    logits = model(batch["input_ids"], batch["positions"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                           reduction="sum")


def reverse_batches(seq_len: int, rows: int, steps: int, seed: int, device: torch.device
                    ) -> list[dict[str, torch.Tensor]]:
    """``steps`` global batches of ``rows`` sequences of ``seq_len`` tokens: inputs, the labels
    shifted by one (the last token has none), all positions, and the count of labelled tokens."""
    task = ReverseTask(rows * steps, seq_len + 1, mode="causal", seed=seed)
    out = []
    for step in range(steps):
        items = [task[i] for i in range(step * rows, (step + 1) * rows)]
        ids = torch.stack([it["input_ids"] for it in items])
        labels = torch.stack([it["labels"] for it in items])
        out.append({"input_ids": ids[:, :-1].to(device), "labels": labels[:, 1:].to(device),
                    "positions": torch.arange(seq_len, device=device),
                    "labelled": int((labels[:, 1:] != -100).sum())})
    return out


def local_slice(batch: dict, rows: slice, pos: torch.Tensor) -> dict:
    """A rank's part of a global batch: its data-parallel rows, its context-parallel tokens."""
    pos = pos.to(batch["input_ids"].device)
    return {"input_ids": batch["input_ids"][rows][:, pos], "labels": batch["labels"][rows][:, pos],
            "positions": pos, "labelled": batch["labelled"]}


def attention_inputs(batch: int, heads: int, seq_len: int, head_dim: int, seed: int,
                     device: torch.device) -> list[torch.Tensor]:
    """q, k, v and an upstream gradient of the output, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g).to(device) for _ in range(4)]


def reference_attention(q, k, v, dout) -> tuple[torch.Tensor, ...]:
    """Output and gradients of unsplit causal attention on the whole sequence."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = causal_sdpa(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def largest_difference(got: list[torch.Tensor], want: list[torch.Tensor], device: torch.device) -> float:
    """The largest |difference| of pairs of tensors, over every rank."""
    local = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(got, want))
    return reduce_scalar(local, "max", device)


def per_rank(value: float, device: torch.device) -> list[float]:
    """``value`` from every rank, in rank order."""
    if not dist.is_initialized():
        return [value]
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return t.tolist()


def train_unsplit(model: nn.Module, batches: list[dict], lr: float) -> list[float]:
    """The reference: the whole model on whole global batches, here on this rank alone."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = token_loss_sum(model, batch) / batch["labelled"]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def endless(batches: list[dict]) -> Iterator[dict]:
    while True:
        yield from batches
