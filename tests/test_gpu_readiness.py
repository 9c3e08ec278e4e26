"""The GPU paths that a CPU can exercise with the device-specific call faked (issue 29): each test
runs the course's own code with CUDA's counters, OOMs or accelerator detection replaced by fakes,
and fails on the behaviour a GPU run would have shown."""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_cases import every_variant_released

from utilities.course import release

MiB = 2**20
WORKSPACE = 32 * MiB  # what cuBLAS allocates per (handle, stream) on sm90


class FakeCuda:
    """A caching allocator's ``memory_allocated`` as a counter, and cuBLAS's workspaces: made by
    the first matmul of each thread, never freed by ``empty_cache``, only by torch's clear call."""

    def __init__(self, monkeypatch, has_clear: bool = True):
        self.tensors = 0
        self.workspaces = 0
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        if has_clear:
            monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", self.clear, raising=False)
        else:
            monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
        monkeypatch.setattr(release, "_make_cublas_workspaces", lambda device: self.matmul())

    @property
    def allocated(self) -> int:
        return self.tensors + self.workspaces

    def clear(self) -> None:
        self.workspaces = 0

    def matmul(self) -> None:
        self.workspaces = 2 * WORKSPACE  # the forward thread's handle and the autograd thread's


def _variant(cuda: FakeCuda) -> dict:
    scope = release.VariantScope(torch.device("cuda", 0)).start()
    cuda.tensors += 500 * MiB  # the model, its optimizer and activations
    cuda.matmul()
    cuda.tensors -= 500 * MiB  # all freed at the end
    return scope.release()


@pytest.mark.parametrize("has_clear", [True, False], ids=["cleared", "made-before-baseline"])
def test_cublas_workspaces_are_not_a_leak(monkeypatch, has_clear):
    """The first variant of a process makes cuBLAS's workspaces; the release check must not count
    them as the variant's memory (it did: before 0, after 64 MiB)."""
    cuda = FakeCuda(monkeypatch, has_clear)
    reports = {"first": _variant(cuda), "second": _variant(cuda)}
    every_variant_released({"releases": reports, "device": "cuda"})
    assert reports["first"]["allocated_after_bytes"] == reports["first"]["allocated_before_bytes"]


def test_a_real_leak_still_fails_the_check(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    scope = release.VariantScope(torch.device("cuda", 0)).start()
    cuda.tensors += 8 * MiB
    cuda.matmul()
    with pytest.raises(AssertionError):
        every_variant_released({"releases": {"leaky": scope.release()}, "device": "cuda"})
    gc.collect()
