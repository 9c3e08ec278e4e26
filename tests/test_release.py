"""A finished variant is freed completely: ``VariantScope`` and the two loops that used to keep
every variant alive (FSDP1's flat parameter <-> module views, and the autograd hooks of PyTorch's
memory trackers). One process here; FSDP1's loop forms only with 2+ ranks (at world size 1 it runs
NO_SHARD), so the 2-rank lesson runs check it: ``conftest.run_lesson`` fails any lesson run whose
variants leave anything alive, and ``tests/test_gpu_claims_on_cpu.py`` runs FSDP1 variants of lessons 01,
02, 04 and 07 that way."""

from __future__ import annotations

import pytest
import torch

from utilities.course.release import VariantScope
from utilities.models import get_model_spec
from utilities.training import train
from utilities.wrapping import shard_model


def _data():
    g = torch.Generator().manual_seed(0)
    while True:
        ids = torch.randint(0, 100, (2, 16), generator=g)
        yield {"input_ids": ids, "labels": ids}


def _train_variant(scope: VariantScope, api: str, measure_memory: bool) -> None:
    spec = get_model_spec("t5-tiny")
    model = shard_model(spec.build(device="cpu"), api=api, block_class=spec.block_class())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, optimizer, _data(), 3, torch.device("cpu"), measure_memory=measure_memory)
    scope.track(model, optimizer)


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_a_finished_variant_leaves_nothing_alive(world1, api):
    """Trained with the memory tracker on (as every CPU lesson step that measures memory is):
    weak references to the model, its parameters, gradients and AdamW state all die."""
    scope = VariantScope(torch.device("cpu")).start()
    _train_variant(scope, api, measure_memory=True)
    assert scope.release() == {"leaked_objects": 0, "leaked_tensors": 0}


def test_memory_tracker_hooks_are_removed(world1, monkeypatch):
    """Without removing the trackers' multi-grad hooks, the measured step's graph keeps the model."""
    import utilities.measure.memory as M

    class NoRemoval(M.TrackerHooks):
        def __exit__(self, *exc):
            self.handles.clear()
            super().__exit__(*exc)

    monkeypatch.setattr(M, "TrackerHooks", NoRemoval)
    scope = VariantScope(torch.device("cpu")).start()
    _train_variant(scope, "fsdp2", measure_memory=True)
    assert scope.release()["leaked_tensors"] > 0
