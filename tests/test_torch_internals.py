"""The private torch attributes the course reads are all read in utilities/torch_internals.py,
and a torch without one gets a one-line UsageError naming it, not an AttributeError."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from utilities import torch_internals as TI
from utilities.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = re.compile(r"_get_fsdp_state|_states_to_\w+_prefetch|_unpadded_unsharded_size|"
                     r"testing\._internal|\._handle\b|_is_flat_param")


def test_private_torch_reads_live_in_one_module():
    offenders = []
    for path in [*ROOT.glob("utilities/**/*.py"), *ROOT.glob("lessons/*/*.py"),
                 *ROOT.glob("benchmarks/*.py")]:
        if path.name == "torch_internals.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if PRIVATE.search(code) and not code.lstrip().startswith(('"', "'")):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_they_work_on_this_torch(world1):
    blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for b in blocks:
        fully_shard(b)
    fully_shard(blocks)
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])
    forward, backward = TI.fsdp2_prefetch_states(blocks[0])
    assert [id(s) for s in forward] == [id(TI.fsdp2_state(blocks[1]))] and backward == []
    assert TI.fake_store() is not None


def test_a_torch_without_them_gets_one_line(monkeypatch):
    class Bare(nn.Module):
        def _get_fsdp_state(self):
            return object()  # a state without the prefetch lists, as a future torch may have

    with pytest.raises(UsageError, match=r"torch .* is not allowed for reading FSDP2's prefetch "
                                         r"lists: .*_states_to_forward_prefetch.*allowed: torch 2\.6"):
        TI.fsdp2_prefetch_states(Bare())
    unit = nn.Linear(2, 2)
    unit._handle = type("Handle", (), {"flat_param": torch.zeros(3)})()
    with pytest.raises(UsageError, match="_unpadded_unsharded_size"):
        TI.fsdp1_unit_numel(unit)
    import builtins

    real_import = builtins.__import__

    def no_fake_pg(name, *a, **k):
        if name.startswith("torch.testing._internal.distributed.fake_pg"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_fake_pg)
    with pytest.raises(UsageError, match="fsdp-course plan"):
        TI.fake_store()


@pytest.mark.parametrize("fsdp2", [True, False], ids=["FSDPMemTracker", "MemTracker"])
def test_global_peak_only_gives_the_stock_trackers_peak(world1, fsdp2):
    """The trimmed tracker (no per-module walk after each operator) records the same peak snapshot,
    category by category, as the stock one, on FSDP2 and on a plain model."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    def peak(trim: bool) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
                                for _ in range(3)))
        if fsdp2:
            for block in model:
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())
        if fsdp2:
            tracker = FSDPMemTracker(model, opt)
        else:
            tracker = MemTracker()
            tracker.track_external(model, opt)
        if trim:
            assert TI.global_peak_only(tracker)._update_peak_stats.__func__ is TI._update_global_peak
        with tracker:  # one step: the plain MemTracker follows one iteration
            model(torch.randn(16, 32)).sum().backward()
            opt.step()
        return {str(k): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}

    stock, trimmed = peak(False), peak(True)
    assert trimmed == stock and stock["Total"] > 0


def test_global_peak_only_leaves_an_unknown_tracker_alone():
    class Other:
        def _update_peak_stats(self, state):
            pass

    other = Other()
    assert TI.global_peak_only(other) is other and "_update_peak_stats" not in vars(other)


PRIVATE_IMPORT = re.compile(r"^\s*(?:from\s+(torch[\w.]*\._\w[\w.]*)\s+import"
                            r"|import\s+(torch[\w.]*\._\w[\w.]*))", re.M)


def test_every_private_module_the_course_imports_is_named_and_imports_here():
    """Each private torch module the course imports is in torch_internals.PRIVATE_MODULES (one
    place says what each is for), and each imports on this torch."""
    import importlib

    used = {}
    for path in [*ROOT.glob("utilities/**/*.py"), *ROOT.glob("lessons/*/*.py"),
                 *ROOT.glob("benchmarks/*.py")]:
        for m in PRIVATE_IMPORT.finditer(path.read_text()):
            used.setdefault(m.group(1) or m.group(2), str(path.relative_to(ROOT)))
    unnamed = {module: where for module, where in used.items() if module not in TI.PRIVATE_MODULES}
    assert not unnamed, unnamed
    for module in TI.PRIVATE_MODULES:
        importlib.import_module(module)
