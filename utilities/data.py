"""Data that needs no download: a byte-level tokenizer and synthetic tasks a model can learn.

The task is string reversal: the input is random lowercase letters, the target is the same letters
reversed. A model that learns the task drives its loss well below the ln(26) ~ 3.26 nats of
guessing letters, so a falling loss in a lesson means the model is learning, not just memorizing
token frequencies. ``seq2seq`` gives encoder-decoder batches (T5), ``causal`` gives the same task as
one sequence "input=target" for decoder-only models (Llama).
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from utilities.errors import UsageError

LETTERS = string.ascii_lowercase.encode()
SEP = ord("=")


class ByteTokenizer:
    """UTF-8 bytes shifted past four special ids. Round-trips any text; vocabulary of 260."""

    pad_id, eos_id, bos_id, unk_id = 0, 1, 2, 3
    offset = 4
    vocab_size = 256 + offset

    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return ids + [self.eos_id] if add_eos else ids

    def decode(self, ids) -> str:
        data = bytes(int(i) - self.offset for i in ids if int(i) >= self.offset)
        return data.decode("utf-8", errors="replace")


class LetterTask(Dataset):
    """Base of the synthetic tasks on random lowercase letters: ``n`` examples of ``seq_len``
    tokens, example ``i`` a function of ``(seed, i)`` only, so every rank, every run and every
    resume sees the same data in the same order. Subclasses define ``__getitem__``."""

    def __init__(self, n: int, seq_len: int, seed: int = 0):
        if seq_len < 4:
            raise UsageError(f"seq_len {seq_len} is too short; allowed: 4 or more")
        self.n, self.seq_len, self.seed = n, seq_len, seed
        self.tok = ByteTokenizer()

    def __len__(self) -> int:
        return self.n

    def letters(self, i: int, k: int) -> list[int]:
        """Example ``i``'s ``k`` random letters, as alphabet positions 0..25."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, 26, (k,), generator=g).tolist()

    def seq2seq(self, source: bytes, target: bytes) -> dict[str, torch.Tensor]:
        """An encoder-decoder example: both texts as byte tokens, each ending with EOS."""
        t = self.tok
        src = torch.tensor([b + t.offset for b in source] + [t.eos_id])
        tgt = torch.tensor([b + t.offset for b in target] + [t.eos_id])
        return {"input_ids": src, "attention_mask": torch.ones_like(src), "labels": tgt}


class ReverseTask(LetterTask):
    """Reverse ``seq_len - 1`` random letters (``mode="seq2seq"``), or, for decoder-only models
    (``mode="causal"``), read ``letters SEP reversed EOS`` with the loss on the answer only."""

    def __init__(self, n: int, seq_len: int, mode: str = "seq2seq", seed: int = 0):
        if mode not in ("seq2seq", "causal"):
            raise UsageError(f"data mode {mode!r} is not allowed; allowed: seq2seq, causal")
        super().__init__(n, seq_len, seed)
        self.mode = mode

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        t = self.tok
        if self.mode == "seq2seq":
            source = bytes(LETTERS[j] for j in self.letters(i, self.seq_len - 1))
            return self.seq2seq(source, source[::-1])
        half = (self.seq_len - 2) // 2
        src = [LETTERS[j] + t.offset for j in self.letters(i, half)]
        ids = src + [SEP + t.offset] + src[::-1] + [t.eos_id]
        ids += [t.pad_id] * (self.seq_len - len(ids))
        ids = torch.tensor(ids)
        labels = ids.clone()
        labels[: half + 1] = -100  # loss on the answer only: the prompt is random by construction
        labels[ids == t.pad_id] = -100
        return {"input_ids": ids, "attention_mask": (ids != t.pad_id).long(), "labels": labels}


class TextFileDataset(Dataset):
    """Causal-LM blocks from a local text source the user already has (no download).

    ``path`` may be a ``.txt`` file, a ``.jsonl`` file with a ``text`` field, or a directory saved
    by ``datasets.Dataset.save_to_disk`` (needs the optional ``datasets`` package).
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, text_field: str = "text"):
        self.seq_len = seq_len
        self.tok = ByteTokenizer()
        ids: list[int] = []
        for text in _read_texts(Path(path), text_field):
            ids.extend(self.tok.encode(text))
        n = len(ids) // seq_len
        if n == 0:
            raise UsageError(f"data {str(path)!r} holds fewer than seq_len={seq_len} tokens")
        self.blocks = torch.tensor(ids[: n * seq_len]).view(n, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _read_texts(path: Path, field: str):
    if not path.exists():
        raise UsageError(f"data path {str(path)!r} does not exist")
    if path.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError as e:
            raise UsageError(f"data directory {str(path)!r} needs the 'datasets' package") from e
        ds = load_from_disk(str(path))
        if field not in ds.column_names:
            raise UsageError(f"data {str(path)!r} has no column {field!r}; it has {ds.column_names}")
        yield from ds[field]
    elif path.suffix == ".jsonl":
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if field not in row:
                        raise UsageError(f"{path}:{n} has no field {field!r}")
                    yield row[field]
    else:
        yield path.read_text()


def make_loader(dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int = 0,
                shuffle: bool = True) -> DataLoader:
    """A loader whose ``DistributedSampler`` gives each rank its own slice of every global batch."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


def batches(loader: DataLoader, device: torch.device):
    """Endless iterator over device batches, advancing the sampler's epoch each pass."""
    epoch = 0
    while True:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        epoch += 1
