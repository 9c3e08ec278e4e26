"""A GPU run's memory checks, OOM handling, meshes and process-group backends, exercised on a CPU:
each test runs the course's own code with CUDA's counters, OOMs or accelerator detection replaced by
fakes, and fails on the behaviour a GPU run would have shown."""

from __future__ import annotations

import gc

import pytest
import torch
from fakes import FakeCuda, MiB, lesson_shell
from gpu_cases import every_variant_released

from utilities.course import release


def _variant(cuda: FakeCuda) -> dict:
    scope = release.VariantScope(torch.device("cuda", 0)).start()
    cuda.tensors += 500 * MiB  # the model, its optimizer and activations
    cuda.matmul()
    cuda.tensors -= 500 * MiB  # all freed at the end
    return scope.release()


@pytest.mark.parametrize("clears", ["all", "this-thread", "none"])
def test_cublas_workspaces_are_not_a_leak(monkeypatch, clears):
    """The first variant of a process makes cuBLAS's workspaces; the release check must not count
    them as the variant's memory (it did: before 0, after 64 MiB), whatever torch's clear frees."""
    cuda = FakeCuda(monkeypatch, clears)
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


def test_an_oom_trial_is_reported_as_an_oom_not_a_leak():
    """The trial raises CUDA's out-of-memory error in the middle of a step, its model, optimizer
    and activations alive in the step's frame: the search records an OOM and the release finds
    nothing alive (it found the model, its parameters and the AdamW state, held by the frames)."""
    from utilities.measure.batch_search import Trial, find_max_batch

    lesson = lesson_shell(torch.device("cpu"))

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
        lesson.track(model, optimizer)
        step(model, optimizer, batch)
        return Trial(batch)

    def trial(batch):
        with lesson.variant(f"batch-{batch}"):
            return try_batch(batch)

    result = find_max_batch(trial, start=1, limit=8, bisect=False)
    assert [t.verdict for t in result.trials] == ["clean", "clean", "OOM"]
    assert result.best == 2
    released = lesson.results.data["releases"]
    assert released["batch-4"] == {"leaked_objects": 0, "leaked_tensors": 0,
                                   "ended_by": "out of memory"}
    assert released["batch-1"] == {"leaked_objects": 0, "leaked_tensors": 0}


def test_other_errors_keep_their_frames():
    lesson = lesson_shell(torch.device("cpu"))
    with pytest.raises(ValueError) as info:
        with lesson.variant("broken"):
            model = torch.nn.Linear(4, 4)
            lesson.track(model)
            raise ValueError("a bug")
    assert "model" in info.tb.tb_frame.f_locals
    assert lesson.results.data["releases"]["broken"]["leaked_objects"] == 1
    del info


# -- an OOM on one rank of two ends the trial on both, without a hang -------------------------------
ONE_RANK_OOM = r"""
import json, sys, torch
from utilities.distributed import setup, teardown
from utilities.measure.batch_search import Trial, all_ranks_agree, find_max_batch
from utilities.training import train

info = setup("cpu", timeout_s=30)

def data(batch):
    while True:
        yield {"input_ids": torch.zeros(batch, 8, dtype=torch.long), "x": torch.randn(batch, 8)}

def try_batch(batch):
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, b):  # rank 1 alone runs out of memory at batch 4 and above, in its 2nd step
        loss = model(b["x"]).pow(2).mean()
        loss.backward()
        if batch >= 4 and info.rank == 1 and step.n == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        step.n += 1
        return loss

    step.n = 0
    stats = train(model, optimizer, data(batch), 3, torch.device("cpu"), measure_memory=False,
                  step_fn=step)
    return Trial(batch, throughput=1.0, peak_bytes=batch)

result = find_max_batch(try_batch, start=1, limit=16, agree=all_ranks_agree)
print(json.dumps({"best": result.best, "verdicts": [(t.batch, t.verdict, t.error)
                                                    for t in result.trials]}))
teardown()
"""


def test_an_oom_on_one_rank_is_an_oom_on_both(tmp_path):
    """Rank 1 runs out of memory after its step's collectives; rank 0 finishes the step and makes
    the step's loss all-reduce. Every rank must make that collective, then the same agreement:
    before, rank 1 went straight to the agreement and the two ranks waited in different
    collectives (on GPUs: NCCL and gloo, a hang until the process group's timeout)."""
    from conftest import run_ranks

    outs = run_ranks(ONE_RANK_OOM, timeout=90)
    assert outs[0]["best"] == outs[1]["best"] == 3
    assert [v[:2] for v in outs[0]["verdicts"]] == [v[:2] for v in outs[1]["verdicts"]]
    assert dict((b, v) for b, v, _ in outs[0]["verdicts"])[4] == "OOM"
    assert "another rank" in dict((b, e) for b, _, e in outs[0]["verdicts"])[4]
    assert "Tried to allocate" in dict((b, e) for b, _, e in outs[1]["verdicts"])[4]


# -- --device cpu on a machine with a GPU: every fully_shard gets a CPU mesh ----------------------
def _fully_shard_calls_without_mesh() -> list[str]:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted([*root.glob("lessons/*/*.py"), *root.glob("utilities/**/*.py"),
                        *root.glob("benchmarks/*.py")]):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fully_shard":
                if not any(k.arg in ("mesh", None) for k in node.keywords):  # None: **options
                    found.append(f"{rel}:{node.lineno}")
    return found


def test_every_fully_shard_call_names_its_mesh():
    assert _fully_shard_calls_without_mesh() == []


@pytest.fixture
def accelerator_present(monkeypatch):
    """This machine looks like a GPU machine to fully_shard: its default mesh would be CUDA."""
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda *a, **k: torch.device("cuda"))
    if hasattr(torch, "accelerator"):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "current_accelerator",
                            lambda *a, **k: torch.device("cuda"))


def _meshes(model: torch.nn.Module) -> set[str]:
    return {p.device_mesh.device_type for p in model.parameters()}


def test_lessons_shard_on_the_cpu_mesh_when_a_gpu_is_visible(world1, accelerator_present):
    from conftest import lesson_module
    from torch.distributed.fsdp import fully_shard

    from utilities.models import get_model_spec
    from utilities.wrapping import shard_model

    t5 = get_model_spec("t5-tiny")
    block = t5.block_class()
    try:  # the fake is seen: without a mesh, fully_shard goes to CUDA (fails in a CPU build)
        assert _meshes(fully_shard(torch.nn.Linear(2, 2))) == {"cuda"}
    except (AttributeError, RuntimeError) as e:
        assert "cuda" in str(e).lower() or "setdevice" in str(e).lower(), e
    built = {
        "01": lambda: lesson_module("01").wrap_fsdp2(t5.build("cpu"), lambda m: isinstance(m, block)),
        "02": lambda: lesson_module("02").fsdp2_checkpointed(t5.build("cpu"), block, 2),
        "04": lambda: lesson_module("04").shard_blocks(m := t5.build("cpu"), block) and m,
        "06": lambda: lesson_module("06").wrap("fsdp2-reshard-true", t5.build("cpu"), block,
                                               torch.device("cpu"), None, None),
        "07": lambda: lesson_module("07").shard_fsdp2(t5.build("cpu"), block,
                                                      lesson_module("07").MixedPrecisionPolicy()),
        "09": lambda: lesson_module("09").wrap_fsdp2(t5.build("cpu"), block),
        "11": lambda: lesson_module("11").wrap_fsdp2(t5.build("cpu"), block),
        "14": lambda: lesson_module("14").shard(t5.build("cpu"), block, "full_shard", "fp32", "none"),
        "shard_model": lambda: shard_model(t5.build("cpu"), block_class=block),
    }
    for name, build in built.items():
        assert _meshes(build()) == {"cpu"}, name


# -- lesson 07: the dtype probe never runs in a timed step -----------------------------------------
def test_lesson_07_times_steps_without_the_dtype_probe(world1, monkeypatch):
    """The probe syncs the host three times per reduce-scatter (on an H100 it turned bf16's 1.9x
    into 0.96x): every step the lesson times must run with no probe installed, and the dtypes are
    still observed, on the untimed steps."""
    import torch.distributed as dist
    from conftest import lesson_module

    from utilities.course.lesson import Lesson

    script = lesson_module("07")
    import mixed_precision_run as run  # the lesson's driver, beside its script

    plain = dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") else None
    probed: list[bool] = []
    step = run.default_step

    def spying_step(model, batch):
        hooks = any(m._forward_pre_hooks for m in model.modules() if isinstance(m, torch.nn.Linear))
        wrapped = plain is not None and dist.reduce_scatter_single is not plain
        probed.append(hooks or wrapped)
        return step(model, batch)

    monkeypatch.setattr(run, "default_step", spying_step)
    args = script.parse_args(["--device", "cpu", "--quick", "--steps", "3", "--policies", "bf16",
                              "--batch-size", "1", "--seq-len", "16"])
    lesson = Lesson("07", args)
    lesson._setup()
    with lesson.variant("bf16"):
        run.train_policy(lesson, script, "fsdp2", "bf16")
    v = lesson.results.data["variants"][0]
    assert probed == [True, True, False]  # the warm-up and memory steps; one timed
    assert len(v["step_times_s"]) == 1
    assert v["forward_param_dtypes"] == ["bfloat16"]  # (one rank reduce-scatters nothing)


# -- ranks sharing a GPU over gloo: overlap and the rate limiter are not measurable ---------------
def _gpu_lesson(backend: str):
    from types import SimpleNamespace

    from utilities.distributed import DistInfo

    dev = torch.device("cuda", 0)
    return SimpleNamespace(device=dev, dist=DistInfo(0, 0, 2, dev, backend, ranks_per_gpu=2))


def test_gloo_on_a_gpu_reports_no_overlap_number():
    """The profile of a gloo run on a GPU holds kernels but no NCCL one: exposed communication is
    unknown, not 0.0; lesson 04 says so, and lesson 11 gives no rate-limiter number either."""
    from types import SimpleNamespace

    from conftest import lesson_module

    from utilities.devices import NOT_MEASURABLE, SHARED_GPU_BACKEND
    from utilities.prefetch import exposed_communication

    def kernel(name, start, end):
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end))

    gloo_trace = SimpleNamespace(events=lambda: [kernel("Memcpy DtoH (Device -> Pageable)", 0, 50),
                                                 kernel("ampere_sgemm_128x64", 60, 90)])
    assert exposed_communication(gloo_trace) is None
    shared, nccl = _gpu_lesson(SHARED_GPU_BACKEND), _gpu_lesson("cpu:gloo,cuda:nccl")
    trace = {"exposed_comm_s_per_step": 0.0, "comm_s_per_step": 0.0}
    lesson_module("04")  # its folder on sys.path
    import backward_prefetch_run as l04  # the lesson's driver, beside its script

    assert l04.communication_columns(shared, trace) == {
        "exposed_comm_s_per_step": NOT_MEASURABLE, "comm_s_per_step": NOT_MEASURABLE}
    assert l04.communication_columns(nccl, trace) == trace
    report = {"gpu": True, "max_reserved_gb": 20.5, "cuda_malloc_retries": 0}
    lesson_module("11")  # its folder on sys.path, for its driver
    import rate_limiter_run as l11

    assert l11.allocator_columns(shared, report) == {
        "max_reserved_gb": NOT_MEASURABLE, "cuda_malloc_retries": NOT_MEASURABLE}
    assert l11.allocator_columns(nccl, report) == {"max_reserved_gb": 20.5, "cuda_malloc_retries": 0}
    assert l11.allocator_columns(shared, {"gpu": False}) == {}


# -- --backend nccl, torch without gloo's AVG, and planning before set-up ---------------------------
def test_forced_nccl_keeps_a_cpu_backend_beside_it():
    """An NCCL-only group fails lesson 08's dcp.async_save and lesson 09's CPU all-reduce."""
    from utilities.devices import resolve_backend

    assert resolve_backend("cuda", "nccl") == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize("version, refused", [("2.6.0+cu124", True), ("2.7.1", True),
                                              ("2.8.0", False), ("2.13.0+cpu", False)])
def test_fsdp2_over_gloo_needs_gloos_avg(world1, monkeypatch, version, refused):
    """FSDP2 reduce-scatters with AVG; gloo has it from torch 2.8: before, 2+ ranks over gloo are
    refused in one line when the lesson asks for its mesh, not by a crash in the first backward."""
    import torch.distributed as dist

    from utilities import distributed as D
    from utilities.torch_internals import UnsupportedTorch

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(D, "init_device_mesh", lambda device_type, shape: ("mesh", device_type))
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    D._MESHES.clear()
    if refused:
        with pytest.raises(UnsupportedTorch) as e:
            D.world_mesh()
        assert "\n" not in str(e.value) and "gloo has it from torch 2.8" in str(e.value)
    else:
        assert D.world_mesh() == ("mesh", "cpu")
    D._MESHES.clear()


def test_pin_cuda_device_wraps_ranks_round_the_gpus(monkeypatch):
    """Rank 1 of 2 on a one-GPU machine goes to GPU 0, with CUDA initialized first (a DeviceMesh
    on an uninitialized CUDA would set GPU LOCAL_RANK = 1: "invalid device ordinal")."""
    from utilities.distributed import pin_cuda_device

    calls = []
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(i))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pin_cuda_device() == torch.device("cuda", 0) and calls == ["init", 0]


def test_lesson_14_pins_the_gpu_before_planning(monkeypatch):
    from conftest import lesson_module

    lesson = lesson_module("14")
    order = []
    monkeypatch.setattr(lesson, "pin_cuda_device", lambda: order.append("pin"))

    def plans(args, predict):
        order.append("plan")
        raise KeyboardInterrupt  # stop before the lesson joins a process group

    monkeypatch.setattr(lesson, "my_plans", plans)
    args = lesson.parse_args(["--device", "cpu", "--quick"])
    args.device = "cuda"
    with pytest.raises(KeyboardInterrupt):
        lesson.main(args)
    assert order == ["pin", "plan"]


# -- lesson 13: the FP8 claim one GPU can honestly make -------------------------------------------
def test_fp8_claim_is_the_same_in_the_gpu_test_and_the_readme():
    """A whole one-GPU step at hidden 4096 is claimed to pay (by FP8_STEP_GAIN_AT_4096), not the
    +25% published for 8 GPUs with float8 all-gathers; README and GPU test say the same number."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("fp8_smoke", root / "tests/gpu/test_fp8_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    gain = smoke.FP8_STEP_GAIN_AT_4096
    assert 1.0 < gain < 1.25
    readme = (root / "lessons/13_fp8_compile/README.md").read_text()
    assert f"fp8-compiled ≥ {gain:.2f}× the tokens/s of compiled bf16" in " ".join(readme.split())
    assert "≥ 1.25×" not in readme


# -- MemoryProbe's GPU total: the allocator's own peak ---------------------------------------------
def test_memory_probe_takes_the_gpu_total_from_the_allocator(monkeypatch):
    """On a GPU the probe resets the allocator's peak on entry and reports max_memory_allocated as
    the total, with the activations the rest (census path, as for a compiled model on a GPU)."""
    from utilities.measure import MemoryProbe

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 10 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 12 * MiB)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    with MemoryProbe(model, optimizer, torch.device("cuda", 0), use_tracker=False) as probe:
        assert calls == ["reset"]
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    peak = probe.peak
    known = peak["parameters"] + peak["gradients"] + peak["optimizer"]
    assert known > 0 and peak["total"] == 10 * MiB and peak["activations"] == 10 * MiB - known
    assert peak["detail"]["total_from"] == "torch.cuda.max_memory_allocated"
    assert peak["detail"]["max_reserved"] == 12 * MiB


def test_lesson_03_turns_on_deterministic_kernels_on_a_gpu_only(monkeypatch):
    """The GPU branch of lesson 03's deterministic_kernels: deterministic algorithms on, cuDNN's
    autotuner off, cuBLAS's fixed workspace set before any handle exists; a CPU run changes none."""
    import os

    from conftest import lesson_module

    lesson_module("03")  # its folder on sys.path, its driver imported: the workspace set
    from full_state_dict_run import deterministic_kernels

    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    try:
        assert deterministic_kernels(torch.device("cpu")) is False
        assert torch.are_deterministic_algorithms_enabled() == was[0]
        assert deterministic_kernels(torch.device("cuda", 0)) is True
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
