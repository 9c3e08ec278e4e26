"""Lesson 09: frozen weights stay put and cost no gradient or optimizer memory; child-tuning's masked
gradient entries never reach the update; every fine-tuning variant improves held-out loss."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from conftest import REPO, flag_error, notebook_results, variant
from torch import nn

from utilities.child_tuning import ChildTuning, global_topk_threshold, local

sys.path.insert(0, str(REPO / "lessons" / "09_fine_tuning"))  # the lesson's own functions
from fine_tuning import child_tuning_d, child_tuning_f, fisher_masks, freeze  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("09", tmp_path_factory)  # the notebook runs `fsdp-course run 09 --quick`


# -- the notebook's quick run ----------------------------------------------------------------------
VARIANTS = ("full", "frozen-encoder", "frozen-fsdp1", "child-tuning-f", "child-tuning-d")


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_improves_held_out_loss(results, name):
    v = variant(results, name)
    assert v["held_out_loss_after"] < v["held_out_loss_before"] - 0.05, v
    assert 0.0 <= v["held_out_accuracy"] <= 1.0


@pytest.mark.parametrize("name", ["frozen-encoder", "frozen-fsdp1"])
def test_frozen_weights_are_bit_identical_and_cost_nothing(results, name):
    frozen, full = variant(results, name), variant(results, "full")
    assert frozen["frozen_parameters"] > 0
    assert frozen["frozen_parameters"] + frozen["trainable_parameters"] == results["model"]["parameters"]
    assert frozen["frozen_bit_identical"] is True
    assert frozen["frozen_with_optimizer_state"] == 0
    # No gradient and no AdamW moments for the frozen share: both shrink by (about) its fraction.
    share = frozen["trainable_parameters"] / full["trainable_parameters"]
    for key in ("gradient_bytes_per_rank", "optimizer_bytes_per_rank"):
        assert frozen[key] == pytest.approx(share * full[key], rel=0.02), key


def test_fsdp1_needs_use_orig_params(results):
    """Wrapping a unit that mixes frozen and trainable parameters fails without use_orig_params;
    with it, the frozen-fsdp1 variant trains."""
    error = variant(results, "frozen-fsdp1")["fsdp1_without_orig_params_error"]
    assert error and "requires_grad" in error, error
    assert any(error in n for n in results["notes"])


def test_fsdp1_and_fsdp2_freeze_to_the_same_model(results):
    """Same weights, same frozen part, same data: the two APIs end at the same held-out loss and
    accuracy (they differ only in float summation order; the README shows them equal to 3 decimals)."""
    two, one = variant(results, "frozen-encoder"), variant(results, "frozen-fsdp1")
    assert two["trainable_parameters"] == one["trainable_parameters"]
    assert one["held_out_loss_after"] == pytest.approx(two["held_out_loss_after"], abs=1e-3)
    assert one["held_out_accuracy"] == pytest.approx(two["held_out_accuracy"], abs=1e-3)
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-3)


def test_child_tuning_d_keeps_reserve_p(results):
    v = variant(results, "child-tuning-d")
    assert v["kept_fraction"] == pytest.approx(results["settings"]["reserve_p"], abs=0.01)


# -- child-tuning masks, in process ---------------------------------------------------------------
def _toy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _backward(model: nn.Module, batch: dict) -> torch.Tensor:
    loss = model(batch["x"]).pow(2).mean()
    loss.backward()
    return loss


def _batches():
    g = torch.Generator().manual_seed(1)
    while True:
        yield {"x": torch.randn(8, 16, generator=g)}


def test_child_tuning_f_zeroes_and_rescales_on_a_plain_module():
    model = _toy()
    ct = ChildTuning(model.parameters(), mode="F", reserve_p=0.3, seed=0)
    _backward(model, next(_batches()))
    before = [p.grad.clone() for p in model.parameters()]
    ct.apply()
    kept = total = 0
    for g0, p in zip(before, model.parameters()):
        nz = p.grad != 0
        assert torch.allclose(p.grad[nz], g0[nz] / 0.3)  # kept entries scaled by 1/reserve_p
        kept += int(nz.sum())
        total += p.numel()
    assert 0.2 < kept / total < 0.4


def test_child_tuning_f_never_lets_sgd_touch_the_dropped_entries():
    """ChildTuning-F draws a fresh mask every step; whatever it drops that step gets no update."""
    model = _toy()
    ct = ChildTuning(model.parameters(), mode="F", reserve_p=0.3, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # plain SGD: no momentum carries old grads
    data = _batches()
    for _ in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        _backward(model, next(data))
        ct.apply()
        dropped = [p.grad == 0 for p in model.parameters()]
        opt.step()
        moved = 0
        for d, b, p in zip(dropped, before, model.parameters()):
            assert torch.equal(p.detach()[d], b[d])
            moved += int((p.detach()[~d] != b[~d]).sum())
        kept = sum(int((~d).sum()) for d in dropped)
        assert moved == kept > 0  # every kept entry moved, and only those


def test_child_tuning_d_masked_weights_do_not_move_under_fsdp2(world1):
    from torch.distributed.fsdp import fully_shard

    model = _toy()
    fully_shard(model[0])
    fully_shard(model)
    data = _batches()
    ct = ChildTuning(model.parameters(), mode="D", reserve_p=0.25)
    ct.compute_fisher_mask(model, data, num_batches=3, step_fn=_backward)
    assert ct.kept_fraction == pytest.approx(0.25, abs=0.01)
    before = [local(p).detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ct.step_fn(_backward)
    for _ in range(3):
        opt.zero_grad()
        step(model, next(data))
        for m, p in zip(ct.masks, model.parameters()):
            assert bool((local(p.grad)[~m] == 0).all())  # the optimizer sees zero grad there
        opt.step()
    moved = 0
    for m, b, p in zip(ct.masks, before, model.parameters()):
        now = local(p).detach()
        assert torch.equal(now[~m], b[~m])  # masked entries: bit-identical
        moved += int((now[m] != b[m]).sum())
    assert moved > 0


# -- the lesson's own masks are ChildTuning's ------------------------------------------------------
class _WithLoss(nn.Module):
    """The toy model with a Hugging Face style output (``.loss``), as the lesson's masks expect."""

    def __init__(self):
        super().__init__()
        self.net = _toy()

    def forward(self, x: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(loss=self.net(x).pow(2).mean())


def test_lesson_child_tuning_f_is_childtuning_f():
    """The script's ChildTuning-F (its own function) masks exactly as the public class does, given
    the same per-rank seed: the lesson shows the method it ships."""
    ours, theirs = _toy(), _toy()
    batch = next(_batches())
    _backward(ours, batch)
    _backward(theirs, batch)
    ChildTuning(theirs.parameters(), mode="F", reserve_p=0.3, seed=0).apply()
    child_tuning_f(list(ours.parameters()), 0.3, torch.Generator().manual_seed(0))  # seed 0, rank 0
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_lesson_fisher_mask_is_childtuning_d_under_fsdp2(world1):
    from torch.distributed.fsdp import fully_shard

    model = _WithLoss()
    fully_shard(model.net[0])
    fully_shard(model)
    params = list(model.parameters())
    ct = ChildTuning(params, mode="D", reserve_p=0.25)
    ct.compute_fisher_mask(model, ({"x": b["x"]} for b in _batches()), num_batches=3)
    masks, threshold = fisher_masks(model, params, ({"x": b["x"]} for b in _batches()), 3, 0.25)
    assert threshold == ct.threshold
    assert all(torch.equal(m, c) for m, c in zip(masks, ct.masks))
    model(next(_batches())["x"]).loss.backward()
    child_tuning_d(params, masks)
    for m, p in zip(masks, params):
        assert bool((local(p.grad)[~m] == 0).all())  # what the optimizer will see: zero there
    assert sum(int((local(p.grad)[m] != 0).sum()) for m, p in zip(masks, params)) > 0


def test_freeze_counts_and_flags_by_name():
    model = _toy()
    trainable, frozen = freeze(model, ["0."])  # the first Linear: 16 x 32 + 32
    assert (trainable, frozen) == (32 * 4 + 4, 16 * 32 + 32)
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]


def test_global_threshold_is_the_exact_kth_largest():
    torch.manual_seed(0)
    values = [torch.rand(37).pow(4), torch.rand(5, 11)]
    flat = torch.cat([v.flatten() for v in values])
    for k in (1, 10, 50, flat.numel()):
        assert global_topk_threshold(values, k) == flat.topk(k).values[-1].item()


# -- flags ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--reserve-p", "1.5"], ["--variants", "lora"]])
def test_bad_flag_is_one_line_exit_2(flags):
    assert flags[1] in flag_error("09", *flags)


def test_pretrained_that_is_truncated_hostile_or_not_weights_is_one_line(tmp_path):
    """--pretrained was read with a bare torch.load: a truncated or code-carrying file ended the
    run in 54-58 lines on every rank."""
    import argparse
    import os

    import fine_tuning

    from utilities.errors import UsageError

    class Quiet:
        @staticmethod
        def print(*args, **kwargs):
            pass

    class Touch:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(2)}, good)
    state = fine_tuning.pretrained_state(Quiet, argparse.Namespace(pretrained=str(good)), None)
    assert state["w"].shape == (2,)
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:200])
    torch.save({"w": Touch()}, tmp_path / "hostile.pt")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    for name, says in (("cut.pt", "not readable"), ("hostile.pt", "asks to run code"),
                       ("list.pt", "not a state dict")):
        with pytest.raises(UsageError, match=says) as e:
            fine_tuning.pretrained_state(Quiet, argparse.Namespace(pretrained=str(tmp_path / name)), None)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "ran").exists()


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    09 --device cpu`; this quick run reproduces what it claims (trainable and frozen parameters,
    gradient and optimizer bytes, frozen weights unchanged)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("09", results)
