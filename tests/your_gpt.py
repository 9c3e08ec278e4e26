"""A model and a sharding function the course never saw, written as a user's training script has
them: what ``fsdp-course plan --model tests/your_gpt.py:build --parallelize tests/your_gpt.py:shard``
plans and ``tests/your_code_run.py`` runs for real (``tests/test_plan_your_code.py``)."""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=256, d=64, layers=4, heads=4, block=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels=None):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build():
    return GPT()


def shard(model, *, mesh):
    """One unit per block, then the root: the user's own loop."""
    from torch.distributed.fsdp import fully_shard

    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class Tagger(nn.Module):
    """A forward that is not Hugging Face's: ``forward(x)`` returns logits."""

    def __init__(self, vocab=256, d=32):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.out(self.emb(x))


def build_tagger():
    return Tagger()


def tagger_batch(batch, seq):
    """The inputs and the loss of a Tagger step: what --batch-fn returns."""
    x = torch.randint(0, 256, (batch, seq))
    return (x,), lambda logits: F.cross_entropy(logits.flatten(0, 1), x.flatten())


def build_raises():
    raise ValueError("no such size")


def build_not_a_module():
    return 42
