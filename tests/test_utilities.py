"""Unit tests of the shared package: models, tokenizer, data, wrap policies, bf16, Memory_Maximizer."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from utilities import (
    ByteTokenizer,
    Memory_Maximizer,
    ReverseTask,
    TextFileDataset,
    UsageError,
    bf16_ready,
    get_model_spec,
    shard_model,
    verify_bfloat_support,
)
from utilities.results import write_json
from utilities.wrapping import fsdp1_block_policy, fsdp_units, unit_parameter_counts


# -- models ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [
    ("t5-tiny", 1_887_232), ("t5-small", 60_506_624), ("t5-large", 737_668_096),
    ("llama-1b", 1_235_814_400), ("llama-8b", 8_030_261_248),
])
def test_parameter_counts(name, expected):
    # Llama sizes are the published Llama 3.2 1B / Llama 3 8B; t5 the published T5 v1.0 sizes
    assert get_model_spec(name).num_parameters == expected


def test_block_classes_and_bad_name():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.t5.modeling_t5 import T5Block

    assert get_model_spec("t5-tiny").block_class() is T5Block
    assert get_model_spec("llama-tiny").block_class() is LlamaDecoderLayer
    with pytest.raises(UsageError, match=r"'bert' is not allowed; allowed: a course model name \(t5-tiny"):
        get_model_spec("bert")


def test_flops_per_token_formula():
    spec = get_model_spec("llama-8b")
    cfg = spec.config()
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * 2048
    assert spec.flops_per_token(2048) == 6 * spec.num_parameters + attention


# -- data -----------------------------------------------------------------------------------
def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in ["hello", "Grüße, 世界!", ""]:
        ids = tok.encode(text)
        assert ids[-1] == tok.eos_id and max(ids) < tok.vocab_size
        assert tok.decode(ids) == text


def test_reverse_task_is_deterministic_and_reversed():
    tok = ByteTokenizer()
    ds = ReverseTask(8, 16, mode="seq2seq", seed=3)
    a, b = ds[5], ReverseTask(8, 16, mode="seq2seq", seed=3)[5]
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert tok.decode(a["labels"]) == tok.decode(a["input_ids"])[::-1]
    causal = ReverseTask(8, 16, mode="causal")[0]
    prompt, answer = tok.decode(causal["input_ids"]).split("=")
    assert answer == prompt[::-1]
    assert (causal["labels"] == -100).sum() > len(prompt)  # loss only on the answer


def test_text_file_dataset_reads_local_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"text": "abc " * 20}) for _ in range(4)))
    ds = TextFileDataset(path, seq_len=32)
    assert len(ds) == (4 * 81) // 32 and ds[0]["input_ids"].shape == (32,)
    with pytest.raises(UsageError, match="no field 'body'"):
        TextFileDataset(path, 32, text_field="body")
    with pytest.raises(UsageError, match="does not exist"):
        TextFileDataset(tmp_path / "missing.txt", 32)


# -- wrapping -------------------------------------------------------------------------------
def test_fsdp1_block_policy_selects_only_blocks():
    from transformers.models.t5.modeling_t5 import T5Block, T5LayerFF

    policy = fsdp1_block_policy(T5Block)
    block = get_model_spec("t5-tiny").build("meta").encoder.block[0]
    assert policy(block, recurse=False, nonwrapped_numel=0) is True
    assert policy(T5LayerFF(get_model_spec("t5-tiny").config()), recurse=False, nonwrapped_numel=0) is False


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_shard_model_units_and_sharded_bytes(world1, api):
    spec = get_model_spec("t5-tiny")
    torch.manual_seed(0)
    model = shard_model(spec.build(), api=api, block_class=spec.block_class(), policy="block")
    assert len(fsdp_units(model)) == 9
    assert sum(unit_parameter_counts(model)) == spec.num_parameters


def test_fsdp2_meta_init_then_materialize(world1):
    from utilities.models import init_weights

    spec = get_model_spec("t5-tiny")
    model = shard_model(spec.build("meta"), api="fsdp2", block_class=spec.block_class())
    model.to_empty(device="cpu")
    init_weights(model)
    batch = ReverseTask(2, 16)[0]
    out = model(**{k: v[None] for k, v in batch.items()})
    assert torch.isfinite(out.loss)


def test_fsdp1_meta_init_materializes_each_unit_with_the_models_init(world1):
    """A meta-built model wrapped by FSDP1 with ``fsdp1_meta_init``: no parameter is left on meta,
    each unit got the model's own init (T5's layer norms start at 1, which ``to_empty`` alone does
    not give), and the same seed gives the same weights."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from utilities.wrapping import fsdp1_meta_init

    spec = get_model_spec("t5-tiny")
    weights = []
    for _ in range(2):
        model = spec.build("meta")
        torch.manual_seed(0)
        wrapped = FSDP(model, auto_wrap_policy=fsdp1_block_policy(spec.block_class()),
                       device_id=torch.device("cpu"), use_orig_params=True,
                       param_init_fn=fsdp1_meta_init(model, "cpu"))
        with FSDP.summon_full_params(wrapped):
            params = dict(wrapped.module.named_parameters())
            assert not any(p.is_meta for p in params.values())
            norms = [p for n, p in params.items() if n.endswith("layer_norm.weight")]
            assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
            weights.append({n: p.detach().clone() for n, p in params.items()})
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])


def test_shard_model_bad_options():
    with pytest.raises(UsageError, match="--api 'fsdp3'"):
        shard_model(torch.nn.Linear(2, 2), api="fsdp3")
    with pytest.raises(UsageError, match="no size-based policy"):
        shard_model(torch.nn.Linear(2, 2), api="fsdp2", policy="size")


# -- bf16 and Memory_Maximizer on a machine without a GPU --------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_bf16_ready_says_why_not():
    report = bf16_ready()
    assert not report and verify_bfloat_support() is False
    assert any("no CUDA GPU" in r for r in report.reasons)
    assert str(report).startswith("bf16 not ready:")


@pytest.mark.parametrize("capability, ready", [((7, 0), False), ((7, 5), False), ((8, 0), True),
                                               ((9, 0), True)])
def test_bf16_ready_wants_native_bf16_not_emulation(monkeypatch, capability, ready):
    """A V100 (7.0) or T4 (7.5) emulates bf16, and torch.cuda.is_bf16_supported() says yes by
    default; the checker must say no there, naming the compute capability."""
    import utilities.bf16 as B

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(B, "nccl_version", lambda: (2, 21, 5))
    report = B.bf16_ready()
    assert bool(report) is ready, report.reasons
    assert report.details["compute capability"] == f"{capability[0]}.{capability[1]}"
    if not ready:
        assert report.reasons == [f"GPU Some GPU (compute capability {capability[0]}.{capability[1]}) "
                                  "has no native bf16 (needs 8.0+: Ampere or newer)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_memory_maximizer_without_gpu_is_harmless(capsys):
    with Memory_Maximizer() as mm:
        mm.update()
        mm.update()
    report = mm.summary()
    out = capsys.readouterr().out.strip().splitlines()
    assert report["gpu"] is False and len(out) == 1 and "no CUDA GPU" in out[0]


def test_memory_maximizer_report_survives_stop(fake_allocator):
    """summary() after stop() (or after a with block) is the report of the run that ended, not a
    fresh start: the classic usage reads it after training. A fake allocator stands in for CUDA."""
    import utilities.memory_maximizer as M

    stats = fake_allocator([1, 2, 3], max_reserved_gib=3, retries=5)
    with M.Memory_Maximizer(verbose=False) as mm:
        for _ in range(3):
            mm.update()
        stats["num_alloc_retries"] = 7  # two retries during the run
    report = mm.summary()
    assert report["reserved_gb"] == [1.0, 2.0, 3.0] and report["cuda_malloc_retries"] == 2
    assert report["max_reserved_gb"] == 3.0 and "retries happened" in report["advice"]


def test_bf16_checker_does_not_use_pkg_resources():
    import subprocess
    import sys

    code = "import sys, utilities; utilities.bf16_ready(); print('pkg_resources' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_write_json_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    write_json(target, {"a": 1})

    class Boom:
        pass

    with pytest.raises(TypeError):
        write_json(target, {"a": Boom()})  # fails mid-write
    assert json.loads(target.read_text()) == {"a": 1}  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temp file left


def test_memtracker_follows_fsdp1_with_use_orig_params(world1):
    """FSDP1 with use_orig_params=True (what torch.compile and frozen layers need) is measured by
    the tracker, not estimated: the same peak as use_orig_params=False (on one rank, where FSDP1
    falls back to NO_SHARD, within 1%; on 2 ranks we measured it equal to the byte)."""
    from utilities.measure import MemoryProbe

    peaks = {}
    for orig in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                                          torch.nn.Linear(256, 64)) for _ in range(3)])
        model = shard_model(model, api="fsdp1", block_class=torch.nn.Sequential, device="cpu",
                            use_orig_params=orig)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(128, 64)
        for measure in (False, True):  # the second step, once the optimizer state exists
            with MemoryProbe(model, opt, torch.device("cpu")) if measure else nullcontext() as probe:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        assert probe.peak["detail"]["method"] == "MemTracker"
        peaks[orig] = probe.peak
    # (the two peaks fall at different moments of the step here, so their categories differ)
    assert peaks[True]["total"] == pytest.approx(peaks[False]["total"], rel=0.01)


def test_no_process_group_leaks(world1):
    assert dist.is_initialized() and dist.get_world_size() == 1


def test_the_library_never_imports_the_course():
    """Layers import downward only: ``utilities/*.py`` and ``utilities/measure/`` (the library)
    import nothing from ``utilities/course`` (the CLI and harness), in any spelling (``from
    utilities import course`` too); ``python -m utilities`` is the one entry that starts the
    course's command."""
    import ast

    root = Path(__file__).resolve().parents[1] / "utilities"
    offenders = []
    for path in [*root.glob("*.py"), *(root / "measure").glob("*.py")]:
        if path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(root)}: {n}" for n in names
                          if n == "utilities.course" or n.startswith("utilities.course.")]
    assert offenders == []


def test_ranks_die_with_their_launcher(tmp_path):
    """torchrun starts each rank in its own session: a kill -9 of the launcher left them running
    (and writing checkpoints 28 s later). Two real ranks that arm the guard as setup() does."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    script = tmp_path / "rank.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "from utilities.distributed import die_with_the_launcher\n"
        "die_with_the_launcher()\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "utilities.course.torchrun", "--standalone",
                                 "--nproc-per-node=2", str(script)], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = [int((tmp_path / r).read_text()) for r in ("0", "1") if (tmp_path / r).is_file()
                    and (tmp_path / r).read_text()]
        assert len(pids) == 2, "the ranks did not start"
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in pids if _running(pid)]
        assert not alive, f"ranks {alive} outlived their launcher"
    finally:
        launcher.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def test_memory_maximizer_says_no_gpu_once_per_process(monkeypatch, capsys):
    """Lesson 11 makes a watcher per variant: on a machine without a GPU the notice is printed
    once, not once per watcher."""
    from utilities.memory_maximizer import Memory_Maximizer

    monkeypatch.setattr(Memory_Maximizer, "_said_no_gpu", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    for _ in range(3):
        with Memory_Maximizer() as mm:
            mm.update()
    assert capsys.readouterr().out.count("no CUDA GPU here") == 1


# -- results.json: what a lesson records, through Results' methods ---------------------------------
def _results():
    from utilities.results import Results
    from utilities.training import TrainStats

    r = Results("99", "t", torch.device("cpu"), 2, "t5-tiny", 10, {"every": 2})
    for name in ("base", "fast"):
        r.add(name, TrainStats(losses=[1.0], step_times_s=[0.1], tokens_per_step=64))
    return r


def test_results_record_setting_skipped_and_run_model():
    r = _results()
    assert r.record("capacity", {"largest": 7}) == {"largest": 7}
    r.setting(mlp_dim=512)
    r.skipped("fp8-h64", "no GPU")
    r.skipped("fp8-h128", "no GPU")
    r.run_model("llama-h128", 1234)
    assert r.data["capacity"] == {"largest": 7}
    assert r.data["settings"] == {"every": 2, "mlp_dim": 512}
    assert r.data["skipped"] == {"fp8-h64": "no GPU", "fp8-h128": "no GPU"}
    assert r.data["model"] == {"name": "llama-h128", "parameters": 1234}
    for own in ("variants", "settings", "notes", "model", "skipped"):
        with pytest.raises(ValueError, match=f"{own!r} is written by Results"):
            r.record(own, {})


def test_results_extend_variants_adds_fields_by_name():
    r = _results()
    r.extend_variants({"fast": {"speedup_vs_base": 1.5}})
    assert [v.get("speedup_vs_base") for v in r.data["variants"]] == [None, 1.5]
    assert list(r.data["variants"][1])[-1] == "speedup_vs_base"  # after what add() recorded
    with pytest.raises(ValueError, match="no recorded variant named 'slow'"):
        r.extend_variants({"slow": {"x": 1}})


def test_one_collective_counter_names_every_variant_of_a_collective():
    """``CollectiveCounter`` (lesson 15, ``count_reduce_scatters``) and the fake step's recorder
    tell a collective from any other op the same way, and group a collective's variants by kind."""
    from utilities.measure.transfers import collective_kind, collective_name

    assert collective_name(torch.ops.c10d.allreduce_.default) == "allreduce_"
    assert collective_name(torch.ops._c10d_functional.all_gather_into_tensor.default) == \
        "all_gather_into_tensor"
    assert collective_name(torch.ops.aten.mm.default) is None
    kinds = {n: collective_kind(n) for n in ("_allgather_base_", "all_gather_into_tensor",
                                             "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                                             "allreduce_", "broadcast_")}
    assert kinds == {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
                     "_reduce_scatter_base_": "reduce_scatter",
                     "reduce_scatter_tensor_coalesced_": "reduce_scatter",
                     "allreduce_": "allreduce", "broadcast_": "broadcast"}
