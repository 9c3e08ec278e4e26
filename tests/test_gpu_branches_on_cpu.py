"""The course's GPU-only branches, run on the CPU.

Each test runs the course's own code for a branch only a GPU takes, with the device-specific call
faked (``torch.cuda``'s answers, a GPU-resident model's ``offload_to_cpu``, a torchao module) or its
CPU counterpart (a process group with the shared-GPU backend string, whose CUDA half a CPU build
never uses), and fails on what the GPU run would have shown. Each docstring names the GPU test or
path it stands in for. Two gloo ranks only where the path is collective (rank 0 only / the other
ranks get nothing; the losses every rank averages).
"""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import json
import sys
import types
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, free_port, lesson_module, no_rendezvous_env, run_ranks
from fakes import FakeCuda, MiB, lesson_shell
from gpu_cases import every_variant_released

from utilities import distributed as D
from utilities.devices import CUDA_BACKEND, NOT_MEASURABLE, SHARED_GPU_BACKEND, resolve_backend

# -- two gloo ranks on the shared-GPU backend string: collectives, lesson 03, async save -----------
TWO_RANKS = r"""
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from utilities import distributed as D
from utilities.dcp import async_save_checkpoint, load_checkpoint
from utilities.errors import UsageError
from utilities.measure.batch_search import Trial, all_ranks_agree
from utilities.models import get_model_spec
from utilities.training import train
from utilities.wrapping import shard_model

out_dir = Path(sys.argv[1])
sys.path.insert(0, sys.argv[2])
import full_state_dict as L03

D.quiet_torch_internal_warnings()
# The group two ranks sharing one GPU make (setup() on CUDA with LOCAL_WORLD_SIZE 2 asks for
# exactly this string); setup() then joins it. A CPU build runs every collective on its cpu:gloo half.
dist.init_process_group(D.SHARED_GPU_BACKEND)
info = D.setup("cpu", timeout_s=60)
rank = info.rank
found = {"backend": str(dist.get_backend())}
spec = get_model_spec("t5-tiny")
vocab = spec.config().vocab_size


def build(api, seed):
    torch.manual_seed(seed)
    model = shard_model(spec.build("cpu"), api=api, block_class=spec.block_class(), policy="block")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batches():
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as a sampler gives
    while True:
        ids = torch.randint(0, vocab, (2, 8), generator=g)
        yield {"input_ids": ids, "labels": ids.clone()}


# 1. the course's collectives over the shared-GPU group
model, opt = build("fsdp2", 0)
found["mesh"] = D.world_mesh().device_type
found["losses"] = train(model, opt, batches(), 2, torch.device("cpu"), measure_memory=False).losses
found["sum"] = D.reduce_scalar(rank + 1, "sum")
found["max"] = D.reduce_scalar(rank + 1, "max")
trial = all_ranks_agree(Trial(4, peak_bytes=10 * (rank + 1),
                              error="CUDA out of memory" if rank == 1 else None))
found["trial"] = [trial.peak_bytes, trial.error]
try:
    with D.fail_together("saving x"):
        if rank == 0:
            raise OSError(28, "No space left on device", "x")
except UsageError as e:
    found["fail_together"] = str(e)

# 2. async save: the state is copied to host memory before it returns; training goes on
pending = async_save_checkpoint(out_dir / "async", model, opt, step=2, batches_consumed=4)
saved = {n: p.to_local().clone() for n, p in model.named_parameters()}
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)  # the next optimizer step, while the files are written
pending.wait()
fresh, fresh_opt = build("fsdp2", 1)
resumed = load_checkpoint(out_dir / "async", fresh, fresh_opt)
found["resumed"] = [resumed.step, resumed.batches_consumed]
found["async_holds_the_state_at_save"] = all(torch.equal(p.to_local(), saved[n])
                                             for n, p in fresh.named_parameters())
found["async_not_the_update"] = not any(torch.equal(p.to_local(), saved[n] + 1.0)
                                        for n, p in fresh.named_parameters())
del model, opt, fresh, fresh_opt

# 3. lesson 03 as on a GPU: offload_to_cpu is True for a CUDA-resident model
asked = []
real_offload = L03.offload_to_cpu
L03.offload_to_cpu = lambda m: asked.append(real_offload(m)) or True
torch.manual_seed(0)
reference = {k: v.clone() for k, v in spec.build("cpu").state_dict().items()}
model, opt = build("fsdp2", 0)
train(model, opt, batches(), 1, torch.device("cpu"), measure_memory=False)  # AdamW state exists
whole = {n: p.full_tensor() for n, p in model.named_parameters()}
msd, osd = L03.gather_full_state(model, opt)
compared = [k for k in msd if k in whole]
found["fsdp2_gathered"] = len(msd)
found["fsdp2_equal"] = len(compared) > 50 and all(torch.equal(msd[k], whole[k]) for k in compared)
found["fsdp2_on_cpu"] = all(v.device.type == "cpu" for v in msd.values())
found["fsdp2_optim_states"] = len(osd.get("state", {}))
L03.save_on_rank0(out_dir / "full.pt", msd, osd, 3)
fresh, fresh_opt = build("fsdp2", 1)
found["fsdp2_loaded_step"] = L03.load_full_checkpoint(out_dir / "full.pt", fresh, fresh_opt)
pairs = list(zip(model.parameters(), fresh.parameters()))
found["fsdp2_reloaded_equal"] = all(
    torch.equal(a.to_local(), b.to_local())
    and torch.equal(opt.state[a]["exp_avg"].to_local(), fresh_opt.state[b]["exp_avg"].to_local())
    for a, b in pairs)
found["asked_offload"] = asked
del model, opt, fresh, fresh_opt

# FSDP1's classic path: the configs a GPU run passes, run without the offload (on a CPU build FSDP1
# hands back views of freed gather buffers when asked to offload: the lesson's CPU_NOTE)
configs = []
real_type = FSDP.state_dict_type


def spying(module, kind, model_cfg, optim_cfg):
    configs.append([model_cfg.offload_to_cpu, model_cfg.rank0_only,
                    optim_cfg.offload_to_cpu, optim_cfg.rank0_only])
    return real_type(module, kind, FullStateDictConfig(rank0_only=model_cfg.rank0_only),
                     FullOptimStateDictConfig(rank0_only=optim_cfg.rank0_only))


FSDP.state_dict_type = staticmethod(spying)
model, opt = build("fsdp1", 0)
msd1, osd1 = L03.gather_full_state_fsdp1_classic(model, opt)
found["fsdp1_configs"] = configs
found["fsdp1_gathered"] = len(msd1)
found["fsdp1_equal"] = all(torch.equal(v, reference[k]) for k, v in msd1.items())
found["fsdp1_optim"] = len(osd1)
del model, opt
print(json.dumps(found))
D.teardown()
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("two_ranks")
    return run_ranks(TWO_RANKS, str(out), str(REPO / "lessons" / "03_full_state_dict"))


def test_course_collectives_over_the_shared_gpu_backend(two_ranks):
    """Twin of tests/gpu/test_shared_gpu.py's process group (``cpu:gloo,cuda:gloo``, ranks sharing
    a GPU): FSDP2 trains on it (its all-gathers and AVG reduce-scatters, the step's loss all-reduce
    every rank makes), and the course's own collectives give every rank the same answer."""
    r0, r1 = two_ranks
    assert r0["backend"] == r1["backend"] == SHARED_GPU_BACKEND
    assert r0["mesh"] == "cpu"  # the run's device, not the group's CUDA half
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 2  # averaged over both ranks
    assert (r0["sum"], r0["max"]) == (r1["sum"], r1["max"]) == (3.0, 2.0)
    assert r0["trial"] == [20, "out of memory on another rank"]
    assert r1["trial"] == [20, "CUDA out of memory"]
    assert r0["fail_together"] == r1["fail_together"]
    assert "No space left on device (x)" in r0["fail_together"]


def test_async_save_stages_the_state_before_training_goes_on(two_ranks):
    """Twin of lesson 08's ``async_save`` on a GPU (``utilities.dcp.async_save_checkpoint``): DCP
    copies every rank's shards to host memory before it returns (on a GPU: device to host), so an
    optimizer step taken while the files are written does not reach the checkpoint."""
    for r in two_ranks:
        assert r["resumed"] == [2, 4]
        assert r["async_holds_the_state_at_save"] and r["async_not_the_update"]


def test_lesson_03_full_state_dict_with_cpu_offload_as_on_a_gpu(two_ranks):
    """Twin of lesson 03 on a GPU (tests/gpu_cases.py's 03-full-state-dict): ``gather_full_state`` with
    ``cpu_offload=True`` gives rank 0 every tensor whole, on the CPU, and the other ranks nothing;
    ``save_on_rank0`` writes it and ``load_full_checkpoint`` (``broadcast_from_rank0``, offloaded) puts back
    the same shards on every rank."""
    r0, r1 = two_ranks
    assert r0["asked_offload"] and not any(r0["asked_offload"])  # the real answer here: no CUDA
    assert r0["fsdp2_gathered"] > 50 and r0["fsdp2_equal"] and r0["fsdp2_on_cpu"]
    assert r0["fsdp2_optim_states"] > 50  # AdamW's moments, whole, for every parameter
    assert (r1["fsdp2_gathered"], r1["fsdp2_optim_states"]) == (0, 0)  # only rank 0 holds a copy
    assert r0["fsdp2_loaded_step"] == r1["fsdp2_loaded_step"] == 3
    assert r0["fsdp2_reloaded_equal"] and r1["fsdp2_reloaded_equal"]


def test_lesson_03_fsdp1_classic_asks_for_offload_and_rank0_only_on_a_gpu(two_ranks):
    """Twin of lesson 03's ``fsdp1-classic`` on a GPU: ``FULL_STATE_DICT`` with
    ``offload_to_cpu=True, rank0_only=True`` for the model and the optimizer; rank 0 gets the whole
    model, the other ranks ``({}, {})``."""
    r0, r1 = two_ranks
    assert r0["fsdp1_configs"] == r1["fsdp1_configs"] == [[True, True, True, True]]
    assert r0["fsdp1_gathered"] > 50 and r0["fsdp1_equal"]
    assert (r1["fsdp1_gathered"], r1["fsdp1_optim"]) == (0, 0)


# -- the shared-GPU decision: which mesh, which check ----------------------------------------------
@pytest.mark.parametrize("run_device, backend, mesh_type, needs_gloo_avg", [
    ("cuda", SHARED_GPU_BACKEND, "cuda", True),  # ranks sharing a GPU: gloo reduce-scatters
    ("cuda", CUDA_BACKEND, "cuda", False),  # NCCL has AVG on every torch
    ("cuda", "gloo", "cuda", True),  # --backend gloo on GPUs
    ("cpu", "gloo", "cpu", True),
    (None, CUDA_BACKEND, "cuda", False),  # a group the course did not make: NCCL means CUDA
    (None, SHARED_GPU_BACKEND, "cpu", True),
])
def test_world_mesh_on_a_gpu_run(monkeypatch, run_device, backend, mesh_type, needs_gloo_avg):
    """Twin of ``world_mesh()`` in a rank on a GPU (every lesson's ``fully_shard(mesh=...)``):
    the mesh is on the run's device, and FSDP2 over gloo with 2 ranks (a shared GPU included) is
    checked for gloo's AVG."""
    checked = []
    monkeypatch.setattr(D, "init_device_mesh", lambda device_type, shape: (device_type, shape))
    monkeypatch.setattr(D, "require_gloo_avg", lambda what: checked.append(what))
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(D, "_RUN_DEVICE", {} if run_device is None else
                        {"device": torch.device(run_device, 0) if run_device == "cuda" else
                         torch.device("cpu")})
    monkeypatch.setattr(D, "_MESHES", {})
    assert D.world_mesh() == (mesh_type, (2,))
    assert bool(checked) == needs_gloo_avg


def test_dist_info_on_a_gpu_says_what_its_collectives_can_show():
    """``DistInfo`` of a rank on a GPU: over ``cpu:gloo,cuda:gloo`` it shares the GPU and its
    collectives are no NCCL kernels (lessons 04 and 11 record ``NOT_MEASURABLE``), over NCCL they
    are."""
    cuda = torch.device("cuda", 0)
    shared = D.DistInfo(1, 1, 2, cuda, SHARED_GPU_BACKEND, ranks_per_gpu=2)
    assert shared.shares_gpu and not shared.nccl_on_gpu
    assert shared.shared_gpu_note().startswith("2 ranks, 2 per GPU, over cpu:gloo,cuda:gloo")
    nccl = D.DistInfo(0, 0, 8, cuda, CUDA_BACKEND)
    assert nccl.nccl_on_gpu and not nccl.shares_gpu and nccl.shared_gpu_note() is None
    assert not D.DistInfo(0, 0, 2, cuda, "gloo").nccl_on_gpu
    assert not D.DistInfo(0, 0, 2, torch.device("cpu"), "gloo", ranks_per_gpu=2).shares_gpu


# -- async save needs the CPU backend every CUDA group of the course has ---------------------------
def _group(backend: str) -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def test_every_cuda_backend_the_course_asks_for_lets_async_save_stage(tmp_path):
    """Twin of ``dcp.async_save`` on a GPU group (lesson 08): DCP refuses a group without a CPU
    backend (it stages through host memory); every string ``resolve_backend`` gives for CUDA has
    one. A CPU build has no NCCL: ``cuda:nccl`` is made ``cuda:gloo`` here, the CPU half is what
    DCP checks."""
    from utilities.dcp import async_save_checkpoint

    strings = {resolve_backend("cuda", b, shared) for b in ("auto", "nccl", "gloo")
               for shared in (False, True) if not (b == "nccl" and shared)}
    assert strings == {CUDA_BACKEND, SHARED_GPU_BACKEND, "gloo"}
    model = torch.nn.Linear(4, 4)
    for i, backend in enumerate(sorted(strings)):
        _group(backend.replace("cuda:nccl", "cuda:gloo"))
        try:
            async_save_checkpoint(tmp_path / f"ok{i}", model).wait()
        finally:
            dist.destroy_process_group()
        assert (tmp_path / f"ok{i}" / ".metadata").is_file(), backend
    _group("cuda:gloo")  # what an NCCL-only group looks like to DCP: no CPU backend
    try:
        with pytest.raises(AssertionError, match="CPU backend"):
            async_save_checkpoint(tmp_path / "refused", model)
    finally:
        dist.destroy_process_group()


# -- a real profiler trace fed to exposed_communication ---------------------------------------------
@pytest.mark.filterwarnings("ignore:CUDA is not available, disabling CUDA profiling")
def test_profile_steps_gpu_branch_on_a_real_trace(world1, monkeypatch, tmp_path):
    """Twin of lesson 04's profile on a GPU (``profile_steps`` with ``device=cuda``): a real
    ``torch.profiler`` trace of FSDP2 steps with gloo collectives goes to ``exposed_communication``,
    which finds no NCCL kernel and says unknown (None), not 0.0; lesson 04 records that as
    ``NOT_MEASURABLE`` for ranks sharing a GPU. The same real events, relabelled as CUDA kernels,
    are read by their time ranges (the fields a GPU trace has)."""
    from torch.distributed.fsdp import fully_shard

    from utilities import prefetch

    seen = []
    real_exposed = prefetch.exposed_communication
    monkeypatch.setattr(prefetch, "sync", lambda device: None)  # torch.cuda.synchronize
    monkeypatch.setattr(prefetch, "exposed_communication",
                        lambda prof: seen.append(prof) or real_exposed(prof))
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    for layer in model:
        fully_shard(layer, mesh=D.world_mesh())
    fully_shard(model, mesh=D.world_mesh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(m, batch):
        loss = m(batch["x"]).pow(2).mean()
        loss.backward()
        dist.all_reduce(loss.detach().clone())  # the step's loss, as training logs it
        return loss

    data = iter(lambda: {"x": torch.randn(4, 32)}, None)
    trace = prefetch.profile_steps(model, optimizer, data, torch.device("cuda", 0),
                                   tmp_path / "trace.json", steps=2, step_fn=step)
    assert len(seen) == 1  # the GPU branch ran, on the real profile
    assert trace["exposed_comm_s_per_step"] is None and trace["comm_s_per_step"] is None
    events = json.loads(Path(trace["trace"]).read_text())["traceEvents"]
    assert any("all_reduce" in str(e.get("name", "")) for e in events)
    cuda_kind = torch.autograd.DeviceType.CUDA

    def as_kernel(ev, name):
        k = copy.copy(ev)
        k.device_type, k.name = cuda_kind, name
        return k

    real = list(seen[0].events())
    collectives = [e for e in real if "all_reduce" in e.name or "allreduce" in e.name]
    matmuls = [e for e in real if e.name in ("aten::addmm", "aten::mm")]
    assert collectives and matmuls
    relabelled = [as_kernel(e, "ncclDevKernel_AllReduce_Sum_f32") for e in collectives]
    relabelled += [as_kernel(e, "sm90_xmma_gemm") for e in matmuls]
    found = real_exposed(types.SimpleNamespace(events=lambda: relabelled))
    start = min(e.time_range.start for e in real)
    end = max(e.time_range.end for e in real)
    assert 0 < found["exposed_s"] <= found["comm_s"] <= (end - start) / 1e6
    shared = types.SimpleNamespace(device=torch.device("cuda", 0),
                                   dist=D.DistInfo(0, 0, 2, torch.device("cuda", 0),
                                                   SHARED_GPU_BACKEND, ranks_per_gpu=2))
    lesson_module("04")  # its folder on sys.path
    from backward_prefetch_run import communication_columns

    assert communication_columns(shared, trace) == {
        "exposed_comm_s_per_step": NOT_MEASURABLE, "comm_s_per_step": NOT_MEASURABLE}


# -- the planner for a GPU on a machine without one --------------------------------------------------
def test_planner_for_cuda_without_a_gpu_runs_the_cpu_simulation_and_says_so(monkeypatch):
    """Twin of the planner on a GPU (``plan(..., device_type="cuda")``, lesson 14 and
    ``fsdp-course run``'s fit check): with a GPU the fake tensors claim CUDA and AdamW takes its
    foreach path; without one they live on the CPU, the plan says so in a note, and its bytes are
    the CPU plan's plus the cuBLAS workspaces a GPU step allocates."""
    from utilities.measure import fake_step
    from utilities.measure import planner as P

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fake_step.fake_device("cuda") == (torch.device("cuda"), [])
    assert (fake_step.adamw_foreach(torch.device("cuda"))
            and not fake_step.adamw_foreach(torch.device("cpu")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, notes = fake_step.fake_device("cuda")
    assert device == torch.device("cpu") and "no GPU here" in notes[0]
    as_gpu = P.plan("llama-tiny", 2, 10**12, "full_shard", "bf16", "none", 1, 32, "cuda")
    on_cpu = P.plan("llama-tiny", 2, 10**12, "full_shard", "bf16", "none", 1, 32, "cpu")
    assert as_gpu.device_type == "cpu" and any("no GPU here" in n for n in as_gpu.notes)
    assert not any("no GPU here" in n for n in on_cpu.notes)
    # the same step, plus what a GPU run allocates outside the trackers: two Hopper-sized cuBLAS
    # workspaces (the H200 quick runs' measured peaks were the tracker's plus exactly 64 MiB)
    workspaces = 2 * 32 * 2**20
    assert as_gpu.detail["cublas_workspaces"] == workspaces and "cublas_workspaces" not in on_cpu.detail
    for c in on_cpu.peak_bytes:
        extra = workspaces if c in ("total", "temporaries") else 0
        assert as_gpu.peak_bytes[c] == on_cpu.peak_bytes[c] + extra, c
    assert any("cuBLAS workspaces: 2 x 32.00 MiB" in n for n in as_gpu.notes)


# -- a variant on a GPU that runs out of memory ------------------------------------------------------
@pytest.mark.parametrize("error, freed", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (ValueError("a bug"), False),
])
def test_a_gpu_variant_ended_by_an_oom_gives_its_memory_back(monkeypatch, error, freed):
    """Twin of ``Lesson.variant`` on a GPU (lesson 05's batch search, every_variant_released in
    tests/gpu_cases.py): the OOM's frames, which hold the model, are cleared before the allocator
    is read, so ``memory_allocated`` is back where it was; any other error keeps its frames (for
    debugging) and the reading shows the memory still held."""
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    lesson = lesson_shell(torch.device("cuda", 0))

    def free(nbytes):
        cuda.tensors -= nbytes

    def trial():
        model = torch.nn.Linear(64, 64)
        lesson.track(model)
        cuda.tensors += 300 * MiB  # the model, its optimizer state, the activations
        weakref.finalize(model, free, 300 * MiB)
        cuda.matmul()
        raise error

    with pytest.raises(type(error)) as info:
        with lesson.variant("batch-64"):
            trial()
    report = lesson.results.data["releases"]["batch-64"]
    released = {"releases": {"batch-64": report}, "device": "cuda"}
    if freed:
        assert report["ended_by"] == "out of memory"
        assert report["allocated_after_bytes"] == report["allocated_before_bytes"]
        every_variant_released(released)
    else:
        assert "ended_by" not in report
        assert report["allocated_after_bytes"] == report["allocated_before_bytes"] + 300 * MiB
        with pytest.raises(AssertionError):
            every_variant_released(released)
    del info


# -- FP8: torchao faked ------------------------------------------------------------------------------
@dataclass
class FakeFloat8LinearConfig:
    """torchao.float8.Float8LinearConfig's two entry points the course uses."""

    enable_fsdp_float8_all_gather: bool = False
    recipe: str = "tensorwise"

    @classmethod
    def from_recipe_name(cls, name: str) -> FakeFloat8LinearConfig:
        if name in FakeTorchao.missing_recipes:
            raise ValueError(f"recipe {name} is not in this torchao\n(a second line)")
        return cls(recipe=name)


class FakeTorchao:
    """``torchao`` and ``torchao.float8`` in ``sys.modules``: conversion records what it was asked
    (the names the filter chose, the config) and swaps nothing; the scale precomputation counts."""

    missing_recipes: tuple[str, ...] = ()

    def __init__(self, monkeypatch, float8: bool = True):
        self.converted: list[tuple[list[str], FakeFloat8LinearConfig]] = []
        self.precomputed = 0
        pkg = types.ModuleType("torchao")
        pkg.__spec__ = importlib.machinery.ModuleSpec("torchao", None, is_package=True)
        pkg.__path__ = []
        monkeypatch.setitem(sys.modules, "torchao", pkg)
        if not float8:  # an installed torchao whose float8 does not import
            monkeypatch.setitem(sys.modules, "torchao.float8", None)
            return
        f8 = types.ModuleType("torchao.float8")
        f8.Float8LinearConfig = FakeFloat8LinearConfig
        f8.convert_to_float8_training = self.convert
        f8.precompute_float8_dynamic_scale_for_fsdp = self.precompute
        pkg.float8 = f8
        monkeypatch.setitem(sys.modules, "torchao.float8", f8)

    def convert(self, model, *, config, module_filter_fn):
        names = [n for n, m in model.named_modules() if module_filter_fn(m, n)]
        self.converted.append((names, config))
        return model

    def precompute(self, model) -> None:
        self.precomputed += 1


@pytest.fixture
def gpu_of_capability(monkeypatch):
    """A visible GPU of the given compute capability, for ``fp8_available``."""
    def install(capability: tuple[int, int], name: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)

    return install


def test_fp8_available_on_gpus(monkeypatch, gpu_of_capability):
    """Twin of tests/gpu/test_fp8_smoke.py's ``fp8_available("cuda")`` (the lesson's and the layer
    benchmark's decision): an A100 is refused by its capability, an H100 by a missing or broken
    torchao, and accepted with one; each reason one line."""
    from utilities.fp8 import fp8_available

    monkeypatch.setitem(sys.modules, "torchao", None)  # find_spec: not installed
    gpu_of_capability((8, 0), "NVIDIA A100-SXM4-80GB")
    ok, why = fp8_available("cuda")
    assert not ok and "NVIDIA A100-SXM4-80GB has compute capability 8.0; FP8 needs >= 8.9" in why
    gpu_of_capability((9, 0), "NVIDIA H100 80GB HBM3")
    ok, why = fp8_available(torch.device("cuda", 0))
    assert not ok and why == "torchao is not installed (pip install torchao)"
    FakeTorchao(monkeypatch, float8=False)
    ok, why = fp8_available("cuda")
    assert not ok and why.startswith("torchao.float8 cannot be imported: ") and "\n" not in why
    FakeTorchao(monkeypatch)
    assert fp8_available("cuda") == (True, "torchao float8 on a GPU with compute capability >= 8.9")
    assert not fp8_available("cpu")[0]  # the run's device decides, not the machine's GPU


def test_float8_config_and_convert_choose_the_recipe_and_the_all_gather(monkeypatch):
    """Twin of ``utilities.fp8.convert_for_fp8`` on a GPU (lesson 13, benchmarks/layer.py):
    tensorwise gathers in float8 unless told not to, rowwise recipes come from torchao by name and
    refuse the float8 all-gather; only the filtered Linears are handed to torchao."""
    from utilities.fp8 import convert_for_fp8, float8_config

    fake = FakeTorchao(monkeypatch)
    assert float8_config().enable_fsdp_float8_all_gather is True
    assert float8_config("tensorwise", False).enable_fsdp_float8_all_gather is False
    assert float8_config("rowwise") == FakeFloat8LinearConfig(recipe="rowwise")
    assert float8_config("rowwise_with_gw_hp").recipe == "rowwise_with_gw_hp"
    with pytest.raises(ValueError, match="needs the tensorwise recipe"):
        float8_config("rowwise", True)
    with pytest.raises(ValueError, match="'blockwise' is not allowed; allowed: tensorwise"):
        float8_config("blockwise")
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(64, 128))
    model.add_module("odd", torch.nn.Linear(64, 24))
    model.add_module("lm_head", torch.nn.Linear(128, 64))
    assert convert_for_fp8(model, recipe="rowwise") == ["up"]
    assert fake.converted == [(["up"], FakeFloat8LinearConfig(recipe="rowwise"))]


def test_lesson_13_fp8_compiled_runs_where_fp8_is_available(monkeypatch, tmp_path):
    """Twin of tests/gpu/test_fp8_smoke.py's fp8-compiled run: with ``fp8_available`` saying yes
    (faked) and torchao faked, lesson 13 runs the fp8-compiled variant (convert with the float8
    all-gather, then shard, then compile; the scales precomputed after every optimizer step),
    records no skip, and takes its speed-up and FP8 crossover from the rows."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # what the lesson sets on import
    lesson = lesson_module("13")
    import fp8_compile_run  # the lesson's driver, beside it: it asks whether FP8 can run

    fake = FakeTorchao(monkeypatch)
    monkeypatch.setattr(fp8_compile_run, "fp8_available", lambda device: (True, "faked"))
    no_rendezvous_env(monkeypatch)
    out = tmp_path / "run13"
    args = lesson.parse_args(["--device", "cpu", "--hidden", "64", "--layers", "1", "--steps", "3",
                              "--seq-len", "16", "--batch-size", "2", "--variants",
                              "compiled,fp8-compiled", "--compile-backend", "aot_eager",
                              "--out", str(out)])
    lesson.main(args)
    r = json.loads((out / "results.json").read_text())
    assert [v["name"] for v in r["variants"]] == ["compiled-h64", "fp8-compiled-h64"]
    assert "skipped" not in r and not any("skipped" in n for n in r["notes"])
    fp8 = next(v for v in r["variants"] if v["variant"] == "fp8-compiled")
    ((names, config),) = fake.converted
    assert fp8["fp8_linears"] == len(names) == 7  # q, k, v, o, gate, up, down of the one block
    assert config.enable_fsdp_float8_all_gather is True
    assert fp8["compiled_blocks"] == 1 and fp8["speedup_vs_compiled"] > 0
    assert fake.precomputed == 3  # after each of the 3 optimizer steps
    assert r["fp8_crossover"]["ratios"] and "skipped" not in r["fp8_crossover"]["why"]


# -- benchmarks/layer.py: its GPU configurations ----------------------------------------------------
def _layer_benchmark():
    spec = importlib.util.spec_from_file_location("bench_layer_twin", REPO / "benchmarks/layer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_benchmark_gpu_defaults(monkeypatch):
    """Twin of ``benchmarks/layer.py`` on a GPU (run_all.py's GPU pass): TransformerEngine's shape
    in bf16, every configuration (``fp8`` the old name of fp8-tensorwise, eager first), inductor."""
    bench = _layer_benchmark()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = bench.parse_args([])
    assert (args.hidden, args.ffn, args.heads, args.seq_len) == (4096, 16384, 32, 2048)
    assert args.batch_sizes == [4, 8] and args.dtype == "bf16" and args.compile_backend == "inductor"
    assert args.variants == list(bench.CONFIGS) and (args.warmup, args.iters) == (5, 20)
    picked = bench.parse_args(["--variants", "fp8", "compile-linear", "fp8-tensorwise"])
    assert picked.variants == ["eager", "fp8-tensorwise", "compile-linear"]
    assert bench.parse_args(["--tiny"]).dtype == "fp32"


def test_layer_benchmark_builds_each_gpu_configuration(monkeypatch):
    """Twin of ``build`` for the FP8 and compile-linear rows: the recipe goes to torchao without
    the float8 all-gather (no FSDP in a layer), compile-linear compiles each Linear and nothing
    else, fp8-tensorwise-eager compiles nothing."""
    bench = _layer_benchmark()
    fake = FakeTorchao(monkeypatch)
    args = bench.parse_args(["--tiny", "--device", "cpu"])
    cpu = torch.device("cpu")

    def compiled(m):
        return getattr(m, "_compiled_call_impl", None) is not None

    layer = bench.build(args, cpu, "fp8-rowwise")
    assert isinstance(layer, torch._dynamo.eval_frame.OptimizedModule)
    layer = bench.build(args, cpu, "fp8-tensorwise-linear")
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 6 and all(compiled(m) for m in linears)
    assert not any(compiled(m) for m in layer.modules() if not isinstance(m, torch.nn.Linear))
    eager = bench.build(args, cpu, "fp8-tensorwise-eager")
    assert not any(compiled(m) for m in eager.modules())
    assert [c for _, c in fake.converted] == [
        FakeFloat8LinearConfig(recipe="rowwise"),
        FakeFloat8LinearConfig(enable_fsdp_float8_all_gather=False),
        FakeFloat8LinearConfig(enable_fsdp_float8_all_gather=False)]
    assert all(names == ["q", "k", "v", "o", "up", "down"] for names, _ in fake.converted)


def test_layer_benchmark_fp8_rows_where_fp8_is_available(monkeypatch, tmp_path, gpu_of_capability):
    """Twin of the layer benchmark's FP8 rows on an H100: where ``fp8_available`` says yes, each
    FP8 configuration is timed and gets ``speedup_vs_compile``; one this torchao lacks is recorded
    under ``skipped`` in one line and the others still run. On an A100 all FP8 rows are skipped
    with the capability as the reason."""
    import utilities.fp8 as F

    bench = _layer_benchmark()
    gpu_of_capability((8, 0), "NVIDIA A100-SXM4-80GB")
    a100 = F.fp8_available("cuda")
    monkeypatch.undo()  # the runs below stay on the CPU
    FakeTorchao(monkeypatch)
    monkeypatch.setattr(FakeTorchao, "missing_recipes", ("rowwise",))
    monkeypatch.setattr(F, "fp8_available", lambda device: (True, "faked"))
    out = tmp_path / "layer.json"
    variants = ["eager", "compile", "fp8-tensorwise-eager", "fp8-rowwise"]
    assert bench.main(["--tiny", "--device", "cpu", "--iters", "10", "--warmup", "1", "--out",
                       str(out), "--variants", *variants]) == 0
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["rows"]] == ["eager", "compile", "fp8-tensorwise-eager"]
    fp8 = data["rows"][2]
    assert fp8["fp8_recipe"] == "tensorwise" and fp8["compiled"] is None
    assert fp8["speedup_vs_compile"] == pytest.approx(data["rows"][1]["median_ms"] / fp8["median_ms"])
    assert data["skipped"] == [{"variant": "fp8-rowwise",
                                "reason": "ValueError: recipe rowwise is not in this torchao"}]
    monkeypatch.setattr(F, "fp8_available", lambda device: a100)
    assert bench.main(["--tiny", "--device", "cpu", "--iters", "10", "--warmup", "1", "--out",
                       str(out), "--variants", "eager", "fp8-tensorwise"]) == 0
    data = json.loads(out.read_text())
    assert data["skipped"] == [{"variant": "fp8-tensorwise", "reason": a100[1]}]
    assert "compute capability 8.0" in a100[1] and not a100[0]
