"""What the lessons' GPU claims assert, each claim run two ways from one definition.

A GPU test that CI never runs rots: a renamed variant or flag breaks it silently. So every case here
is run by ``tests/gpu/test_gpu_smoke.py`` on a GPU (the lesson's GPU defaults, ``--device cuda``)
and by ``tests/test_gpu_claims_on_cpu.py`` on the CPU (the same flags parsed by the lesson, the same variant
names, on the lesson's ``--quick`` run with 2 gloo ranks). The claims, their flags and the runs
on ranks sharing a GPU are the lesson catalog's (``utilities.course.catalog``); here is what must
hold: ``check`` on both, ``gpu_check`` what only a GPU shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from utilities.course.catalog import LESSONS, shared_gpu_runs


def variant(results: dict, name: str) -> dict:
    for v in results["variants"]:
        if v["name"] == name:
            return v
    raise KeyError(f"no variant {name!r} in {[v['name'] for v in results['variants']]}")


def total(v: dict) -> int:
    return v["peak_memory_bytes"]["total"]


def every_variant_released(r: dict) -> None:
    """Nothing a finished variant made is still alive, and on a GPU the allocator is back where it
    was before the variant (within 1%): one variant's memory never inflates the next one's peak."""
    releases = r.get("releases") or {}
    assert releases, "the lesson ran no variant through lesson.variant()"
    for name, rel in releases.items():
        assert rel["leaked_objects"] == 0 and rel["leaked_tensors"] == 0, (name, rel)
        if r["device"] == "cuda":
            before, after = rel["allocated_before_bytes"], rel["allocated_after_bytes"]
            assert after <= before * 1.01 + 2**20, (name, before, after)
    assert r.get("live_parameters_at_exit", 0) == 0


@dataclass(frozen=True)
class Case:
    """One GPU claim: the lesson, its flags, and what must hold (``check``: everywhere;
    ``gpu_check``: on a GPU only, at the lesson's GPU size)."""

    id: str
    lesson: str
    flags: tuple[str, ...] = ()
    check: Callable[[dict], None] = every_variant_released
    gpu_check: Callable[[dict], None] | None = None
    gpu_quick: bool = False  # run the quick (tiny) configuration on the GPU as well


# -- 01: per-block wrapping bounds the unsharded parameters (FSDP2 shows it even on one rank) -------
def _wrap(r: dict) -> None:
    every_variant_released(r)
    assert total(variant(r, "fsdp2-per-block")) < total(variant(r, "fsdp2-one-unit"))


# -- 02: checkpointing lowers activation memory, same losses --------------------------------------
def _ac(r: dict) -> None:
    every_variant_released(r)
    for api in ("fsdp2", "fsdp1"):
        none, every = variant(r, f"{api}-none"), variant(r, f"{api}-all")
        assert every["peak_memory_bytes"]["activations"] < none["peak_memory_bytes"]["activations"]
        assert total(every) < total(none)
        assert every["losses"] == pytest.approx(none["losses"], rel=1e-2)


# -- 03: a full checkpoint reloads exactly, and the next step is the same ---------------------------
def _full_state_dict(r: dict) -> None:
    every_variant_released(r)
    for v in r["variants"]:
        assert v["outputs_identical"] and v["next_step_identical"], v["name"]
        assert v["hf_identical"], v["name"]


# -- 04: on one GPU the prefetch settings are one configuration: their peaks must agree -----------
def _prefetch(r: dict) -> None:
    every_variant_released(r)
    losses = [v["losses"] for v in r["variants"]]
    assert all(x == pytest.approx(losses[0], rel=1e-5) for x in losses)


def _prefetch_gpu(r: dict) -> None:
    assert r["world_size"] > 1 or "single_rank" in r, "a one-rank run must say what it cannot show"
    if r["world_size"] == 1:  # FSDP1 falls back to NO_SHARD: every FSDP1 setting is the same run
        peaks = [total(v) for v in r["variants"] if v["name"].startswith("fsdp1")]
        assert max(peaks) <= min(peaks) * 1.02, peaks


# -- 05: the largest batch without cudaMalloc retries beats the one with retries ------------------
def _maximizer(r: dict) -> None:
    every_variant_released(r)
    rec = variant(r, "recommendation")
    trials = [v for v in r["variants"] if v["name"].startswith("batch-")]
    clean = [t["batch"] for t in trials if t["clean"]]
    assert rec["batch"] == max(clean)
    assert any(not t["clean"] and t["batch"] > rec["batch"] for t in trials), "no failing trial"


def _maximizer_gpu(r: dict) -> None:
    trials = [v for v in r["variants"] if v["name"].startswith("batch-")]
    best = variant(r, f"batch-{variant(r, 'recommendation')['batch']}")
    retrying = [t for t in trials if t["retries"] and not t["ooms"] and t["samples_per_s"]]
    assert retrying, "no batch ran with cudaMalloc retries: start the search nearer the limit"
    worst = min(retrying, key=lambda t: t["batch"])
    print(f"clean batch {best['batch']}: {best['samples_per_s']} samples/s; batch {worst['batch']} "
          f"with {worst['retries']} retries: {worst['samples_per_s']} samples/s")
    assert best["samples_per_s"] > worst["samples_per_s"]


# -- 07: bf16 forward weights, and on a GPU nearly 2x the speed of fp32 ----------------------------
def _precision(r: dict) -> None:
    every_variant_released(r)
    assert "bfloat16" in variant(r, "fsdp2-bf16")["forward_param_dtypes"]
    assert "float32" in variant(r, "fsdp2-fp32")["forward_param_dtypes"]


def _precision_gpu(r: dict) -> None:
    fp32, bf16 = variant(r, "fsdp2-fp32"), variant(r, "fsdp2-bf16")
    speedup = fp32["step_time_s"] / bf16["step_time_s"]
    print(f"bf16 speed-up over fp32: {speedup:.2f}x")
    assert speedup >= 1.5


# -- 08: a distributed checkpoint reloads exactly and resumes on the same curve ---------------------
def _dcp(r: dict) -> None:
    assert variant(r, "fsdp2-dcp")["reload_outputs_equal"] is True
    assert variant(r, "resume-check")["max_abs_loss_diff"] <= 1e-5


# -- 16: CPU offload moves the sharded state to the host and copies it each step --------------------
def _offload(r: dict) -> None:
    every_variant_released(r)
    for api in ("fsdp2", "fsdp1"):
        base, off = variant(r, api), variant(r, f"{api}-offload")
        assert base["to_device_copies"] == base["to_host_copies"] == 0, api
        assert off["to_host_bytes"] == off["sharded_bytes"], api  # each gradient shard comes back once
        assert off["optimizer_on"] == off["parameters_on"] == "cpu", api


def _offload_gpu(r: dict) -> None:
    for api in ("fsdp2", "fsdp1"):
        base, off = variant(r, api), variant(r, f"{api}-offload")
        assert base["parameters_on"].startswith("cuda") and off["gradients_on"] == "cpu", api
        assert off["to_device_moved_bytes"] >= off["sharded_bytes"], api  # forward gathers at least
        assert off["to_host_moved_bytes"] == off["sharded_bytes"], api
        assert total(off) < total(base), api  # the sharded state left the GPU
    assert variant(r, "fsdp2-offload")["pinned"] is True


# -- 17: context parallelism computes unsplit attention; torch's own API on a GPU ----------------
CP_TOLERANCE = 1e-5  # fp32, the lesson's ring against SDPA on the whole sequence
TORCH_CP_TOLERANCE = 1e-4  # fp32, torch's ring over CUDA's memory-efficient SDPA kernel


def _context_parallel(r: dict) -> None:
    every_variant_released(r)
    ran = {v["name"]: v for v in r["variants"]}
    for name in ("ring-contiguous", "ring-balanced"):
        assert ran[name]["max_abs_diff"] < CP_TOLERANCE, (name, ran[name]["max_abs_diff"])
    balanced = ran["ring-balanced"]["score_blocks_per_rank"]
    assert len(set(balanced)) == 1 and sum(balanced) == sum(ran["ring-contiguous"]["score_blocks_per_rank"])
    trained = [v for v in r["variants"] if v["name"].startswith("fsdp-cp")]
    assert trained
    for v in trained:
        assert v["losses"] == pytest.approx(v["unsplit_losses"], abs=1e-4), v["name"]
    if len(trained) > 1:
        acts = [v["peak_memory_bytes"]["activations"] for v in trained]
        assert acts == sorted(acts, reverse=True) and acts[-1] < acts[0], acts


def _context_parallel_gpu(r: dict) -> None:
    assert "torch-cp" not in (r.get("skipped") or {}), r.get("skipped")
    torch_cp = variant(r, "torch-cp")
    print(f"torch's context_parallel on {r['world_size']} rank(s): max |diff| {torch_cp['max_abs_diff']:.1e}")
    assert torch_cp["max_abs_diff"] < TORCH_CP_TOLERANCE


# What must hold of each GPU claim of the catalog, by id: (everywhere, on a GPU only).
CHECKS: dict[str, tuple[Callable[[dict], None], Callable[[dict], None] | None]] = {
    "01-wrap": (_wrap, None),
    "02-activation-checkpointing": (_ac, None),
    "03-full-state-dict": (_full_state_dict, None),
    "04-prefetch": (_prefetch, _prefetch_gpu),
    "05-memory-maximizer": (_maximizer, _maximizer_gpu),
    "07-mixed-precision": (_precision, _precision_gpu),
    "08-distributed-checkpoint": (_dcp, None),
    "16-cpu-offload": (_offload, _offload_gpu),
    "17-context-parallel": (_context_parallel, _context_parallel_gpu),
}
CASES = [Case(claim.id, info.number, claim.flags, *CHECKS[claim.id], gpu_quick=claim.gpu_quick)
         for info in LESSONS.values() for claim in info.gpu_claims]

# What tests/gpu/test_shared_gpu.py runs with 2 (or 4) ranks on one GPU, by key: (ranks, lesson
# flags); tests/test_shared_gpu_launch.py checks the same names and flags on the CPU.
SHARED_GPU_RUNS = {key: (run.nproc, list(run.flags)) for key, (_, run) in shared_gpu_runs().items()}


def lesson_of(key: str) -> str:
    return shared_gpu_runs()[key][0].number
