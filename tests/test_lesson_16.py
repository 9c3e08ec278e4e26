"""Lesson 16's point: CPU offload keeps the sharded state on the host and pays for it in copies,
each step: every parameter shard to the device before its gathers, every gradient shard back."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_documented_keys,
    assert_help_lists,
    assert_prediction_is_the_readmes,
    assert_readme_table_is_reproduced,
    assert_same_losses,
    flag_error,
    notebook_results,
    variant,
)

T5_TINY_PARAMETERS = 89  # parameter tensors: one FSDP2 copy each way per gather
T5_TINY_ROOT_PARAMETERS = 3  # the shared embedding and two final norms, kept gathered for backward
T5_TINY_UNITS = 9  # 8 blocks + the root: FSDP1's flat parameters


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("16", tmp_path_factory)  # the notebook runs `fsdp-course run 16 --quick`


def test_results_have_the_documented_keys(results):
    assert_documented_keys(results, "16")
    assert [v["name"] for v in results["variants"]] == ["fsdp2", "fsdp2-offload", "fsdp1", "fsdp1-offload"]
    for v in results["variants"]:
        assert v["step_time_s"] > 0 and v["sharded_bytes"] == 4 * 1_887_232 // 2


def test_on_a_cpu_every_state_lives_on_the_cpu_unpinned(results):
    for v in results["variants"]:
        assert (v["parameters_on"], v["gradients_on"], v["optimizer_on"]) == ("cpu",) * 3, v["name"]
        assert v["pinned"] is False
    assert results["settings"]["pin_memory"] is False


def test_without_offload_a_step_copies_nothing(results):
    for name in ("fsdp2", "fsdp1"):
        v = variant(results, name)
        assert v["to_device_copies"] == v["to_host_copies"] == v["to_device_bytes"] == 0, name


def test_fsdp2_offload_copies_each_shard_in_for_every_gather_and_each_gradient_out_once(results):
    v = variant(results, "fsdp2-offload")
    shards = v["sharded_bytes"]
    assert v["to_device_copies"] == 2 * T5_TINY_PARAMETERS - T5_TINY_ROOT_PARAMETERS
    assert shards < v["to_device_bytes"] < 2 * shards  # forward and backward, less the root's
    assert v["to_host_copies"] == T5_TINY_PARAMETERS and v["to_host_bytes"] == shards
    assert v["to_device_moved_bytes"] == v["to_host_moved_bytes"] == 0  # one memory: .to is a no-op


def test_fsdp1_offload_copies_per_unit_and_keeps_a_host_gradient_buffer(results):
    v = variant(results, "fsdp1-offload")
    assert v["to_host_copies"] == T5_TINY_UNITS and v["to_host_bytes"] == v["sharded_bytes"]
    assert v["to_host_moved_bytes"] == v["sharded_bytes"]  # copy_ into the buffer moves bytes
    assert v["to_device_copies"] == 0  # already on the compute device: FSDP1 checks first
    assert v["peak_memory_bytes"]["gradients"] == v["sharded_bytes"]
    assert variant(results, "fsdp1")["peak_memory_bytes"]["gradients"] == 0


def test_offload_never_changes_the_numbers(results):
    """Offload moves where the state lives and where AdamW runs, not what is computed: each
    offloaded run's losses equal its API's run without offload (bit for bit on this machine), and
    the two APIs agree to the order of a sum."""
    for api in ("fsdp2", "fsdp1"):
        off, base = variant(results, f"{api}-offload")["losses"], variant(results, api)["losses"]
        assert off == pytest.approx(base, abs=1e-6), api
    assert_same_losses(results, "fsdp2", atol=1e-4)


def test_count_copies_books_a_copy_by_what_it_moves():
    """The counter on a plain module, without FSDP: a ``.to`` of a parameter is a copy to the
    device, a ``copy_`` into a gradient a copy to the host, anything else neither."""
    from utilities.measure.transfers import count_copies

    layer = torch.nn.Linear(8, 8)
    layer.weight.grad = torch.zeros(8, 8)
    with count_copies(layer) as c:
        layer.weight.to("cpu")
        layer.weight.grad.copy_(torch.ones(8, 8))
        torch.zeros(4).to("cpu")
        torch.zeros(4).copy_(torch.ones(4))
    assert (c.to_device_copies, c.to_device_bytes, c.to_device_moved_bytes) == (1, 256, 0)
    assert (c.to_host_copies, c.to_host_bytes, c.to_host_moved_bytes) == (1, 256, 256)
    assert torch.Tensor.to.__name__ == "to"  # the methods are back


def test_pinning_on_a_cpu_is_one_line_exit_2():
    line = flag_error("16", "--pin-memory", "true")
    assert "--pin-memory" in line and "GPU" in line


def test_bad_variant_is_one_line_exit_2():
    line = flag_error("16", "--variants", "fsdp3-offload")
    assert "fsdp3-offload" in line and "fsdp2-offload" in line


def test_lesson_help_explains_every_flag():
    assert_help_lists("16", ("--variants", "--pin-memory", "--predict-on", "--device", "--quick"))


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's table is rendered from results_cpu.json; the quick run reproduces its
    placement, copies and bytes exactly and its memory within readme_claims' tolerances."""
    assert_readme_table_is_reproduced("16", results)


def test_readme_prediction_is_the_runs(results):
    assert_prediction_is_the_readmes("16", results, "predicted_2x8xh100.json")
