"""Ranks sharing a GPU and the process group's backends, checked on CPU.

The CPU twins of ``tests/gpu/test_shared_gpu.py``: the same launcher decision, backend strings,
lesson flags and variant names, with ``torch.cuda`` mocked, so a rename or a changed default fails
here in CI before anyone runs the GPU tests. Nothing here starts a lesson: ``subprocess.call`` and
``init_process_group`` are caught; the planner really runs (on t5-tiny) where the refusal is
checked.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from gpu_cases import SHARED_GPU_RUNS, lesson_of

from utilities import distributed as D
from utilities.course import cli as C
from utilities.course.catalog import LESSONS, get_lesson, run_defaults
from utilities.errors import UsageError
from utilities.models import get_model_spec

GiB = 2**30

@pytest.fixture
def one_gpu(monkeypatch):
    """A machine with one (pretend) GPU: what the launcher and ``setup`` ask torch about it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    return 1


@pytest.fixture
def launched(monkeypatch):
    """Catch the torchrun command instead of running it."""
    calls: list[dict] = []

    def call(cmd, env=None):
        calls.append({"cmd": cmd, "env": env})
        return 0

    monkeypatch.setattr(C.subprocess, "call", call)
    return calls


# -- the launcher's decision ---------------------------------------------------------------------

@pytest.mark.parametrize("number", list(LESSONS))
def test_one_gpu_default_runs_memory_lessons_on_two_ranks(number):
    info = get_lesson(number)
    plan = C.decide_launch(info, "cuda", None, gpus=1)
    if number in ("01", "06", "11", "14", "15", "17"):
        assert info.memory_lesson and plan.nproc == 2 and plan.ranks_per_gpu == 2
        assert plan.backend == "cpu:gloo,cuda:gloo" and plan.shared
        assert "NCCL refuses two ranks on one device" in plan.first_line()
        assert "step times host-staged: not comparable" in plan.first_line()
    else:
        assert not info.memory_lesson and plan.nproc == 1 and not plan.shared
        assert plan.backend == "cpu:gloo,cuda:nccl" and plan.first_line() is None
    # --nproc overrides either way
    assert C.decide_launch(info, "cuda", 1, gpus=1).nproc == 1
    assert C.decide_launch(info, "cuda", 3, gpus=1).ranks_per_gpu == 3
    # with a GPU per rank nothing is shared: every GPU, NCCL
    many = C.decide_launch(info, "cuda", None, gpus=4)
    assert (many.nproc, many.ranks_per_gpu, many.backend) == (4, 1, "cpu:gloo,cuda:nccl")


def test_more_ranks_than_gpus_share_them_evenly():
    plan = C.decide_launch(get_lesson("04"), "cuda", 4, gpus=2)
    assert (plan.nproc, plan.ranks_per_gpu, plan.backend) == (4, 2, "cpu:gloo,cuda:gloo")
    assert plan.first_line().startswith("4 ranks on 2 GPUs, 2 per GPU, over cpu:gloo,cuda:gloo")
    assert C.decide_launch(get_lesson("04"), "cuda", 3, gpus=2).ranks_per_gpu == 2
    cpu = C.decide_launch(get_lesson("01"), "cpu", None)
    assert (cpu.nproc, cpu.backend, cpu.shared) == (2, "gloo", False)


@pytest.mark.parametrize("number", [n for n, i in LESSONS.items() if i.ready])
def test_every_lesson_has_run_defaults_the_planner_knows(number):
    """The fit check plans each lesson's own GPU model and batch, from the catalog's ``Run``: the
    one source ``Lesson`` (and lesson 10's config) read their defaults from."""
    for quick in (False, True):
        model, batch = run_defaults(get_lesson(number), quick)
        assert get_model_spec(model) and batch >= 1
    assert run_defaults(get_lesson("14"), False) == ("llama-1b", 2)
    assert run_defaults(get_lesson("10"), False) == ("llama-1b", 4)
    assert run_defaults(get_lesson("10"), True) == ("llama-tiny", 8)


# -- the process group's backend -------------------------------------------------------------------

@pytest.fixture
def init_calls(monkeypatch):
    """``setup()`` as under torchrun, with ``init_process_group`` caught."""
    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29999").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return calls


@pytest.mark.parametrize("forced, local_ranks, local_rank, expected, per_gpu", [
    ("auto", None, 0, "cpu:gloo,cuda:nccl", 1),  # a CPU backend beside NCCL: async_save, evaluate
    ("auto", "1", 0, "cpu:gloo,cuda:nccl", 1),
    ("nccl", "1", 0, "cpu:gloo,cuda:nccl", 1),  # forced: NCCL, and gloo for CPU tensors beside it
    ("gloo", "1", 0, "gloo", 1),
    ("auto", "2", 1, "cpu:gloo,cuda:gloo", 2),  # two ranks on the one GPU
    ("gloo", "2", 0, "gloo", 2),
])
def test_setup_asks_for_a_cpu_backend_on_cuda(one_gpu, init_calls, monkeypatch, forced,
                                              local_ranks, local_rank, expected, per_gpu):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("RANK", str(local_rank))
    if local_ranks is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
        monkeypatch.setenv("WORLD_SIZE", local_ranks)
    info = D.setup("cuda", forced)
    (kw,) = init_calls
    assert kw["backend"] == expected == info.backend
    assert info.device == torch.device("cuda", 0) and info.ranks_per_gpu == per_gpu
    # NCCL is bound to its GPU at once; gloo (shared GPU) is not
    assert ("device_id" in kw) == ("nccl" in expected)


def test_setup_on_cpu_asks_for_gloo(init_calls):
    info = D.setup("cpu")
    assert init_calls[0]["backend"] == "gloo" == info.backend and "device_id" not in init_calls[0]
    assert info.ranks_per_gpu == 1 and not info.shares_gpu and info.shared_gpu_note() is None


def test_nccl_on_a_shared_gpu_is_refused_in_one_line(one_gpu, init_calls, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="NCCL refuses two ranks on one device") as e:
        D.setup("cuda", "nccl")
    assert "\n" not in str(e.value) and not init_calls
    with pytest.raises(UsageError, match="not allowed with --device cpu"):
        D.resolve_backend("cpu", "nccl")


def test_device_specific_backend_strings_make_a_working_group(monkeypatch):
    """``cpu:gloo,cuda:gloo`` is accepted by this torch (even a CPU build), and the subgroups of a
    device mesh inherit both backends (lesson 06's HSDP mesh, lesson 12's TP mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    from utilities.distributed import _free_port

    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
    dist.init_process_group(D.SHARED_GPU_BACKEND, store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        assert dist.get_backend_config(mesh.get_group("shard")) == "cpu:gloo,cuda:gloo"
        t = torch.ones(2)
        dist.all_reduce(t)  # a CPU tensor: needs the cpu backend
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


# -- the lesson: first line and results.json ------------------------------------------------------

def test_lesson_on_a_shared_gpu_says_so_first_and_records_it(one_gpu, init_calls, monkeypatch,
                                                             capsys):
    """``Lesson._setup`` with the real ``setup()`` as rank 0 of 2 on one GPU (process group and
    GPU name mocked): the first line it prints, and results.json's settings and notes."""
    from utilities.course.lesson import Lesson, lesson_parser

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    args = lesson_parser(None).parse_args(["--device", "cuda", "--quick"])
    lesson = Lesson("06", args)
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    lesson._setup()
    assert not freezes  # only a rank torchrun started freezes its objects
    out = capsys.readouterr().out
    first = " ".join(out[:out.index("lesson 06")].split())  # the first message, wrapped at 120
    assert first.startswith("2 ranks, 2 per GPU, over cpu:gloo,cuda:gloo")
    assert "step times host-staged: not comparable" in first
    data = lesson.results.data
    assert data["settings"]["backend"] == "cpu:gloo,cuda:gloo"
    assert data["settings"]["ranks_per_gpu"] == 2 and data["world_size"] == 2
    assert any("step times host-staged: not comparable" in n for n in data["notes"])


# -- the launcher, end to end (nothing started) ---------------------------------------------------

@pytest.mark.parametrize("key", list(SHARED_GPU_RUNS))
def test_gpu_test_runs_launch_as_shared_ranks(key, one_gpu, launched, monkeypatch, capsys,
                                              tmp_path):
    """Twin of each GPU test: its command line through the real launcher on a pretend one-GPU
    machine. The lesson's own parser accepts its flags and variant names, the ranks share the GPU,
    and the shared line comes first. (The planner's check is stubbed: its real run is below.)"""
    nproc, flags = SHARED_GPU_RUNS[key]
    planned = []
    monkeypatch.setattr(C, "check_fit", lambda *a, **k: planned.append(a) or "planned: stub")
    rc = C.main(["run", lesson_of(key), "--device", "cuda", "--nproc", str(nproc), "--out",
                 str(tmp_path), "--", *flags])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{nproc} ranks on 1 GPU, {nproc} per GPU, over cpu:gloo,cuda:gloo"), out
    (call,) = launched
    assert f"--nproc-per-node={nproc}" in call["cmd"] and call["cmd"][-len(flags):] == flags
    assert "--device" in call["cmd"] and call["cmd"][call["cmd"].index("--device") + 1] == "cuda"
    assert planned and planned[0][1].ranks_per_gpu == nproc


def test_one_gpu_default_and_the_planner_on_a_fitting_run(one_gpu, launched, monkeypatch, capsys,
                                                          tmp_path):
    """`fsdp-course run 01 --device cuda --quick` on one GPU: 2 ranks by default, planned for
    real (t5-tiny) against the GPU's free memory before anything starts."""
    monkeypatch.setattr(C, "gpu_free_bytes", lambda: [80 * GiB])
    rc = C.main(["run", "01", "--device", "cuda", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out.replace("\n  ", " ").splitlines()  # folded lines rejoined
    assert rc == 0
    assert out[0].startswith("2 ranks on 1 GPU, 2 per GPU")
    assert out[1].startswith("planned: 2 ranks of t5-tiny (batch 4") and "80.00 GiB free" in out[1]
    assert "--nproc-per-node=2" in launched[0]["cmd"]


def test_ranks_that_would_not_fit_are_refused_before_launch(one_gpu, launched, monkeypatch, capsys,
                                                            tmp_path):
    monkeypatch.setattr(C, "gpu_free_bytes", lambda: [2**20])  # 1 MiB free
    rc = C.main(["run", "06", "--device", "cuda", "--quick", "--nproc", "4", "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not launched
    assert err.startswith("error: --nproc 4 is not allowed: 4 ranks of t5-tiny") and "\n" not in err
    assert "by the planner" in err and "1.00 MiB free" in err


def test_forced_nccl_on_a_shared_gpu_is_refused_before_launch(one_gpu, launched, capsys, tmp_path):
    rc = C.main(["run", "01", "--device", "cuda", "--quick", "--out", str(tmp_path), "--",
                 "--backend", "nccl"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not launched and "NCCL refuses two ranks" in err and "\n" not in err


# -- memory: the same tracker path on GPU --------------------------------------------------------

def test_memory_probe_uses_the_tracker_on_gpu_too_except_when_compiled():
    """The probe's choice, made before it touches the device: the tracker on CPU and GPU alike
    (so 'unsharded params at peak' is measured on GPU), a census for a compiled model on GPU."""
    from utilities.measure import MemoryProbe

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert MemoryProbe(model, None, torch.device("cuda")).use_tracker
    assert MemoryProbe(model, None, torch.device("cpu")).use_tracker
    model[0].compile()  # lazy: nothing is compiled until called
    probe = MemoryProbe(model, None, torch.device("cuda"))
    assert not probe.use_tracker and "torch.compile" in probe.why_census
    assert MemoryProbe(model, None, torch.device("cpu")).use_tracker


def test_memory_probe_lets_the_steps_own_error_through():
    """A step that fails under the tracker (a batch search's out-of-memory on GPU) raises its own
    error, which the search recognizes, and never the tracker's."""
    from utilities.measure import MemoryProbe

    model = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="out of memory"):
        with MemoryProbe(model, None, torch.device("cpu")):
            model(torch.ones(2, 4)).sum().backward()
            raise RuntimeError("CUDA out of memory (pretend)")


def test_check_says_how_each_lesson_runs_on_one_gpu(monkeypatch):
    from utilities.course import env_report

    monkeypatch.setattr(env_report, "visible_gpus", lambda: [{"index": 0, "name": "NVIDIA H100 80GB HBM3",
                                                      "memory_bytes": 80 * GiB,
                                                      "capability": "9.0", "source": "torch"}])
    lessons = env_report.report()["lessons"]
    assert lessons["06"].startswith("runs here as 2 ranks sharing the GPU over gloo")
    assert lessons["04"].startswith("runs here on 1 GPU(s) with NCCL (gloo for CPU-side")
