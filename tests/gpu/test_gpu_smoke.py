"""GPU smoke tests: run on an H100 / H200 (`pytest -m gpu tests/gpu -s`); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from utilities import Memory_Maximizer, bf16_ready

pytestmark = pytest.mark.gpu


def test_memory_maximizer_reads_real_values():
    x = []
    with Memory_Maximizer() as mm:
        for _ in range(3):
            x.append(torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda"))
            mm.update()
    r = mm.summary()
    print(Memory_Maximizer.format(r))
    assert r["gpu"] and r["total_gb"] > 10 and r["max_reserved_gb"] >= 0.75
    assert len(r["reserved_gb"]) == 3 and r["reserved_gb"] == sorted(r["reserved_gb"])
    assert r["reserved_gb"][-1] - r["reserved_gb"][0] >= 0.5  # two more 256 MiB blocks
    assert r["cuda_malloc_retries"] == 0 and r["ooms"] == 0  # 768 MiB on a 80 GB GPU: no pressure


def test_bf16_ready_matches_the_compute_capability():
    report = bf16_ready()
    print(report)
    assert bool(report) == (torch.cuda.get_device_capability() >= (8, 0)), report.reasons


def test_lesson_02_checkpointing_frees_activation_memory_on_gpu(tmp_path):
    from conftest import run_lesson, variant

    r = run_lesson("02", tmp_path, "--variants", "fsdp2-none,fsdp2-all,fsdp1-none,fsdp1-all",
                   "--steps", "4", "--search", "off", nproc=1, device="cuda", quick=False)
    for api in ("fsdp2", "fsdp1"):
        none, every = variant(r, f"{api}-none"), variant(r, f"{api}-all")
        print(api, none["peak_memory_bytes"]["total"], every["peak_memory_bytes"]["total"])
        assert every["peak_memory_bytes"]["total"] < none["peak_memory_bytes"]["total"]
        assert every["losses"] == pytest.approx(none["losses"], rel=1e-2)


def test_lesson_03_full_state_dict_round_trip_on_gpu(tmp_path):
    r = run_lesson_quick_on_gpu("03", tmp_path)
    for v in r["variants"]:
        assert v["outputs_identical"] and v["next_step_identical"], v["name"]
        assert v["hf_identical"], v["name"]


def test_lesson_08_distributed_checkpoint_on_gpu(tmp_path):
    from conftest import variant

    r = run_lesson_quick_on_gpu("08", tmp_path)
    assert variant(r, "fsdp2-dcp")["reload_outputs_equal"] is True
    assert variant(r, "resume-check")["max_abs_loss_diff"] <= 1e-5


def run_lesson_quick_on_gpu(number: str, out):
    """The lesson's CPU-sized configuration on one GPU: the same claims, through NCCL and CUDA."""
    from conftest import run_lesson

    return run_lesson(number, out, nproc=1, device="cuda", quick=True)


def test_lesson_01_runs_on_one_gpu(tmp_path):
    from conftest import run_lesson

    r = run_lesson("01", tmp_path, "--variants", "fsdp2-one-unit,fsdp2-per-block,fsdp1-per-block",
                   "--steps", "6", nproc=1, device="cuda", quick=False)
    print(r["model"], [(v["name"], v["step_time_s"], v["peak_memory_bytes"]["total"]) for v in r["variants"]])
    assert r["device"] == "cuda" and r["variants"][0]["mfu"] is not None
