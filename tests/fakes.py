"""Stand-ins the CPU tests share: a CUDA allocator's counters and cuBLAS's workspaces faked, a
``Lesson`` with only what its variant bookkeeping needs, lesson 10's script loaded as a module,
and one training step of a small model."""

from __future__ import annotations

import importlib.util

import torch
from conftest import REPO

from utilities.course import release

MiB = 2**20
WORKSPACE = 32 * MiB  # what cuBLAS allocates per (handle, stream) on sm90


class FakeCuda:
    """A caching allocator's ``memory_allocated`` as a counter, and cuBLAS's workspaces: made by
    the first matmul of each thread, never freed by ``empty_cache``, only by torch's clear call
    (``clears``: all of them, only this thread's, or no such call in this torch)."""

    def __init__(self, monkeypatch, clears: str = "all"):
        self.tensors = 0
        self.workspaces: set[str] = set()
        self.clears = clears
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        if clears == "none":
            monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
        else:
            monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", self.clear, raising=False)
        monkeypatch.setattr(release, "_make_cublas_workspaces", lambda device: self.matmul())

    @property
    def allocated(self) -> int:
        return self.tensors + WORKSPACE * len(self.workspaces)

    def clear(self) -> None:
        self.workspaces -= {"forward", "autograd"} if self.clears == "all" else {"forward"}

    def matmul(self) -> None:
        self.workspaces |= {"forward", "autograd"}  # this thread's handle and the autograd one's


def lesson_shell(device: torch.device):
    """A ``Lesson`` with only what ``variant`` and ``_track`` use (no process group, no model)."""
    import argparse

    from utilities.course.lesson import Lesson
    from utilities.results import Results

    lesson = object.__new__(Lesson)
    lesson.args = argparse.Namespace(log_all_ranks=False)
    lesson.device = device
    lesson._scope = None
    lesson.results = Results("05", "t", device, 1, "m", 0, {})
    return lesson


def lesson10_module():
    spec = importlib.util.spec_from_file_location("lesson10_train_trust",
                                                  REPO / "lessons/10_end_to_end/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_step(model, opt) -> None:
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
