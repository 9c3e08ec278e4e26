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


# -- an out-of-memory trial is an OOM, not a leak ---------------------------------------------------
def _lesson_shell(device: torch.device):
    """A ``Lesson`` with only what ``variant`` and ``_track`` use (no process group, no model)."""
    import argparse

    from utilities.course.lesson import Lesson
    from utilities.course.results import Results

    L = object.__new__(Lesson)
    L.args = argparse.Namespace(log_all_ranks=False)
    L.device = device
    L._scope = None
    L.results = Results("05", "t", device, 1, "m", 0, {})
    return L


def test_an_oom_trial_is_reported_as_an_oom_not_a_leak():
    """The trial raises CUDA's out-of-memory error in the middle of a step, its model, optimizer
    and activations alive in the step's frame: the search records an OOM and the release finds
    nothing alive (it found the model, its parameters and the AdamW state, held by the frames)."""
    from utilities.measure.batch_search import Trial, find_max_batch

    L = _lesson_shell(torch.device("cpu"))

    def step(model, optimizer, batch):
        activations = model(torch.randn(batch, 256))
        activations.sum().backward()
        optimizer.step()
        if batch > 2:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch} GiB")
        return activations.detach().sum().item()

    def try_batch(batch):  # as lesson 05's: the model lives in this frame, not the with's
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        optimizer = torch.optim.AdamW(model.parameters())
        L._track(model, optimizer)
        step(model, optimizer, batch)
        return Trial(batch)

    def trial(batch):
        with L.variant(f"batch-{batch}"):
            return try_batch(batch)

    result = find_max_batch(trial, start=1, limit=8, bisect=False)
    assert [t.verdict for t in result.trials] == ["clean", "clean", "OOM"]
    assert result.best == 2
    released = L.results.data["releases"]
    assert released["batch-4"] == {"leaked_objects": 0, "leaked_tensors": 0,
                                   "ended_by": "out of memory"}
    assert released["batch-1"] == {"leaked_objects": 0, "leaked_tensors": 0}


def test_other_errors_keep_their_frames():
    L = _lesson_shell(torch.device("cpu"))
    with pytest.raises(ValueError) as info:
        with L.variant("broken"):
            model = torch.nn.Linear(4, 4)
            L._track(model)
            raise ValueError("a bug")
    assert "model" in info.tb.tb_frame.f_locals
    assert L.results.data["releases"]["broken"]["leaked_objects"] == 1
    del info
