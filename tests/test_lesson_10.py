"""Lesson 10's promises: the training program learns, a crashed run resumes to the very same numbers,
and a bad config value is one line and exit 2.

Five torchrun launches in all: the notebook's quick run (30 steps, a checkpoint every 10), the same
run killed from outside (SIGKILL to the CLI, torchrun and every rank) once its first checkpoint is
published, its --resume (resumed once more in this process: nothing to do), a short run that
crashes itself (--crash-after-step), the same training through every other switch at once
(FSDP1, selective checkpointing, gradient accumulation, prefetch, profiler), and two short runs of
gradient accumulation, reducing after the last micro-batch and after every one (the latter the
script copied into an empty folder, started by plain torchrun).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    assert_documented_keys,
    cli,
    flag_error,
    no_rendezvous_env,
    notebook_results,
    notebook_run_dir,
)

QUICK_STEPS, CKPT_EVERY = 30, 10


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("10", tmp_path_factory)  # the notebook runs `fsdp-course run 10 --quick`


def test_results_have_the_documented_keys(results):
    assert_documented_keys(results, "10")
    (v,) = results["variants"]
    assert v["name"] == "fsdp2" and v["start_step"] == 0
    assert len(v["losses"]) == len(v["lrs"]) == QUICK_STEPS
    assert v["step_time_s"] > 0 and v["tokens_per_s"] > 0 and v["mfu"] is None  # no known CPU peak
    assert set(v["peak_memory_bytes"]) >= {"total", "parameters", "gradients", "optimizer", "activations"}


def test_quick_run_learns(results):
    v = results["variants"][0]
    # From ln(384) ~ 5.95 (uniform over the vocabulary) to below 3.6: the model has learned that
    # the answer is lowercase letters (ln 26 ~ 3.26 is guessing among them).
    assert v["losses"][0] > 5.0
    assert v["losses"][-1] < 3.6, v["losses"]
    steps, eval_losses = zip(*v["eval_losses"])
    assert steps == (10, 20, 30) and eval_losses[-1] < 3.6  # held-out data agrees


def test_schedule_warms_up_then_decays(results):
    lrs = results["variants"][0]["lrs"]
    peak = results["settings"]["lr"]
    warmup = results["settings"]["warmup_steps"]
    assert lrs[:warmup + 1] == sorted(lrs[:warmup + 1])  # rising during warm-up
    assert lrs[warmup] == pytest.approx(peak)
    assert lrs[warmup:] == sorted(lrs[warmup:], reverse=True)  # cosine decay after it
    assert lrs[-1] < 0.2 * peak


def _process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc). torchrun starts each rank in a session of its
    own, so killing the launcher's process group would leave the ranks running."""
    tree, i = [pid], 0
    while i < len(tree):
        try:
            children = Path(f"/proc/{tree[i]}/task/{tree[i]}/children").read_text().split()
        except OSError:
            children = []
        tree += [int(c) for c in children]
        i += 1
    return tree


def _kill_after_first_checkpoint(out: Path) -> int:
    """Start the quick run and SIGKILL the whole job (the CLI, torchrun and every rank) as soon as
    a checkpoint has been published, as a preempting scheduler would. Returns the step of the
    first checkpoint seen."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "utilities", "run", "10", "--device", "cpu",
                             "--quick", "--out", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = out / "checkpoints"
    deadline = time.monotonic() + 300
    try:
        while not (ckpts.is_dir() and any(ckpts.glob("step_*"))):
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before any checkpoint"
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.01)
    finally:
        for pid in reversed(_process_tree(proc.pid)):  # the ranks first, then their launchers
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    return int(sorted(ckpts.glob("step_*"))[0].name.removeprefix("step_"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks through /proc")
def test_killed_then_resumed_matches_the_uninterrupted_run(results, tmp_path_factory, monkeypatch,
                                                           capsys):
    """Kill the whole job mid-run, from outside; --resume from the latest complete checkpoint
    gives the very same losses, learning rates and evals as the uninterrupted run from there on."""
    reference = results["variants"][0]
    assert reference["checkpoints"] == [10, 20, 30]
    out = tmp_path_factory.mktemp("run10_killed")
    assert _kill_after_first_checkpoint(out) == CKPT_EVERY
    assert not (out / "results.json").exists()  # killed before the end
    done = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    start = int(done[-1].removeprefix("step_"))  # a save cut short stays a .tmp and is not used
    assert start in (10, 20), done

    resumed = cli("run", "10", "--device", "cpu", "--quick", "--out", str(out), "--", "--resume",
                  timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    v = json.loads((out / "results.json").read_text())["variants"][0]
    assert v["start_step"] == start and v["resumed_from"].endswith(done[-1])
    # Steps start+1..30 again: same weights, optimizer state, schedule and batches -> same numbers.
    assert v["losses"] == pytest.approx(reference["losses"][start:], abs=1e-5)
    assert v["lrs"] == pytest.approx(reference["lrs"][start:], rel=1e-9)
    expected = [e for e in reference["eval_losses"] if e[0] > start]
    assert [e[0] for e in v["eval_losses"]] == [e[0] for e in expected]
    assert [e[1] for e in v["eval_losses"]] == pytest.approx([e[1] for e in expected], abs=1e-5)

    # and resuming a run that is already complete has nothing to do, and says so: the same main()
    # and flags in this process, on one rank (the checkpoint of 2 ranks loads on 1)
    no_rendezvous_env(monkeypatch)
    capsys.readouterr()
    train = _lesson10("train.py")
    train.main(train.parse_args(["--device", "cpu", "--quick", "--out", str(out), "--resume"]))
    assert f"nothing to do: the checkpoint is at step {QUICK_STEPS}" in capsys.readouterr().out


def test_crash_flag_leaves_only_the_checkpoints_before_it(tmp_path):
    """--crash-after-step (every rank hard-exits, deterministic): what a crash leaves on disk."""
    crashed = cli("run", "10", "--device", "cpu", "--quick", "--out", str(tmp_path), "--",
                  "--steps", "12", "--ckpt-every", "5", "--crash-after-step", "11", timeout=300)
    assert crashed.returncode != 0 and not (tmp_path / "results.json").exists()
    assert "Traceback" not in crashed.stderr and "exitcode  : 3" in crashed.stderr  # torchrun's table
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000005",
                                                                           "step_000010"]


# FSDP1 vs FSDP2, checkpointing and 2 x 4 accumulated micro-batches instead of 1 x 8 change the
# order of float sums only; over 30 AdamW steps the curves stay within 5e-3 (measured: ~2e-3).
SAME_CURVE_ATOL = 5e-3


def test_every_switch_trains_the_same_model(results, tmp_path):
    """The README's "same numbers every way": one launch with FSDP1, every other block
    checkpointed, gradient accumulation, explicit prefetch and the profiler on, against the
    notebook's default FSDP2 run; and the profiler's trace is written."""
    reference = results["variants"][0]
    proc = cli("run", "10", "--device", "cpu", "--quick", "--out", str(tmp_path), "--",
               "--api", "fsdp1", "--activation-checkpointing", "--ac-every", "2", "--grad-accum", "2",
               "--batch-size", "4", "--prefetch", "1", "--profile", "--ckpt-every", "0", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    v = r["variants"][0]
    assert v["name"] == "fsdp1" and v["activation_checkpointing"] == "selective (every 2)"
    assert r["settings"]["grad_accum"] == 2 and r["settings"]["batch_size"] == 4
    assert v["losses"] == pytest.approx(reference["losses"], abs=SAME_CURVE_ATOL)
    assert [e[1] for e in v["eval_losses"]] == pytest.approx(
        [e[1] for e in reference["eval_losses"]], abs=SAME_CURVE_ATOL)
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    assert trace["traceEvents"]
    # FSDP1's no_sync() (the default --accum-sync last): one reduce-scatter per unit per step, the
    # whole model's gradients unsharded between the micro-batches
    assert r["settings"]["accum_sync"] == "last" and v["accum_sync"] == "last"
    assert v["reduce_scatters_per_step"] == LLAMA_TINY_UNITS
    assert v["grads_between_unsharded_bytes"] == LLAMA_TINY_GRAD_BYTES
    assert v["grads_between_sharded_bytes"] == 0


# llama-tiny: 4 blocks and the root are FSDP units; 836,736 fp32 parameters, 2 ranks share them
LLAMA_TINY_UNITS, LLAMA_TINY_GRAD_BYTES = 5, 4 * 836_736


def test_without_accumulation_each_unit_reduce_scatters_once_per_step(results):
    v = results["variants"][0]
    assert v["reduce_scatters_per_step"] == LLAMA_TINY_UNITS
    assert v["reduce_scatter_per_step_bytes"] == LLAMA_TINY_GRAD_BYTES
    assert v["accum_sync"] is None and v["grads_between_unsharded_bytes"] is None  # no micro-batches


def test_accum_sync_trades_gradient_memory_for_reduce_scatters(copied_run, tmp_path):
    """Both sides of gradient accumulation's trade, FSDP2, 2 micro-batches per step: `last`
    (set_requires_gradient_sync(False) until the last one) holds the whole model's gradients
    unsharded between micro-batches and reduce-scatters once; `every` (the copied script's run)
    holds only this rank's shards and reduce-scatters after each micro-batch. The losses are the
    same."""
    proc = cli("run", "10", "--device", "cpu", "--quick", "--out", str(tmp_path), "--",
               *ACCUMULATION, "--accum-sync", "last", "--ckpt-every", "0", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads((tmp_path / "results.json").read_text())["variants"][0]
    every = copied_run["variants"][0]
    assert last["grads_between_unsharded_bytes"] == LLAMA_TINY_GRAD_BYTES
    assert last["grads_between_sharded_bytes"] == 0
    assert every["grads_between_unsharded_bytes"] == 0
    assert every["grads_between_sharded_bytes"] == LLAMA_TINY_GRAD_BYTES // 2
    assert last["reduce_scatters_per_step"] == LLAMA_TINY_UNITS
    assert every["reduce_scatters_per_step"] == 2 * LLAMA_TINY_UNITS
    assert every["reduce_scatter_per_step_bytes"] == 2 * last["reduce_scatter_per_step_bytes"]
    assert every["losses"] == pytest.approx(last["losses"], abs=1e-5)


def test_notebook_run_wrote_checkpoints(results, tmp_path_factory):
    ckpts = notebook_run_dir("10", tmp_path_factory) / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["step_000020", "step_000030"]  # --keep-last 2 deleted step 10
    assert (ckpts / "step_000030" / ".metadata").is_file()


@pytest.mark.parametrize("flags, named", [(["--lr", "-1"], "--lr"), (["--api", "fsdp3"], "fsdp3"),
                                          (["--grad-accum", "0"], "--grad-accum"),
                                          (["--accum-sync", "never"], "--accum-sync")])
def test_bad_config_value_is_one_line_exit_2(flags, named):
    assert named in flag_error("10", *flags)


def _lesson10(name: str):
    """One of lesson 10's files as a module (train.py puts its folder on sys.path for the others)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"lesson10_{name}", REPO / "lessons/10_end_to_end" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_field_is_a_flag_with_help():
    import dataclasses

    train = _lesson10("train.py")
    config = _lesson10("train_config.py")
    help_text = config.config_parser().format_help()
    for f in dataclasses.fields(config.Config):
        assert "--" + f.name.replace("_", "-") in help_text
        assert f.metadata["help"]
    cfg = train.parse_args(["--api", "fsdp1", "--grad-accum", "4", "--activation-checkpointing"])
    assert (cfg.api, cfg.grad_accum, cfg.activation_checkpointing) == ("fsdp1", 4, True)


def _parallelized(*flags: str):
    train, config = _lesson10("train.py"), _lesson10("train_config.py")
    cfg = config.finalize(config.parse_args(["--quick", *flags]), on_gpu=False)
    return train.parallelize(train.build_model(cfg, torch.device("cpu")), cfg, torch.device("cpu"))


def test_parallelize_makes_a_unit_per_block_then_the_root(world1):
    """The FSDP2 steps in order: every other block checkpoint-wrapped, each block (its wrapper where
    there is one) a fully_shard unit, and the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    model = _parallelized("--activation-checkpointing", "--ac-every", "2", "--prefetch", "2")
    blocks = list(model.model.layers)
    assert [m for m in model.modules() if isinstance(m, FSDPModule)] == [model, *blocks]
    assert [isinstance(b, CheckpointWrapper) for b in blocks] == [i % 2 == 0 for i in range(len(blocks))]


def test_prefetch_names_the_next_blocks_both_ways(world1):
    """--prefetch 2: what FSDP2 registered, read back from its state, is two blocks ahead in forward
    and the two previous blocks, nearest first, in backward."""
    from utilities.prefetch import prefetch_plan

    blocks = list(_parallelized("--prefetch", "2").model.layers)
    n = len(blocks)
    assert n >= 4
    plan = prefetch_plan(blocks)
    assert [p["forward"] for p in plan] == [list(range(i + 1, min(n, i + 3))) for i in range(n)]
    assert [p["backward"] for p in plan] == [list(range(i - 1, max(-1, i - 3), -1)) for i in range(n)]


def test_fsdp1_parallelize_checkpoints_inside_its_units(world1):
    """FSDP1's order: a unit per block first, then each block checkpoint-wrapped inside its unit."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _parallelized("--api", "fsdp1", "--activation-checkpointing")
    root, *units = [m for m in model.modules() if isinstance(m, FSDP)]
    assert root is model and len(units) == len(model.module.model.layers)
    assert all(isinstance(next(u.children()), CheckpointWrapper) for u in units)  # FSDP(wrapper(block))


LESSON10_FILES = ("train.py", "train_config.py", "train_metrics.py")


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports (``from a.b import c`` counts as a.b and a.b.c), by its ast."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_the_files_to_copy_import_nothing_from_the_course():
    """train.py and the two files beside it use torch, transformers and the library only: copied
    into another project they need ``utilities`` installed, not the course."""
    for name in LESSON10_FILES:
        course = sorted(n for n in _imported_modules(REPO / "lessons/10_end_to_end" / name)
                        if n == "utilities.course" or n.startswith("utilities.course."))
        assert course == [], (name, course)


def test_the_training_defaults_are_the_ones_the_launcher_plans_with():
    """train_config states its hardware defaults itself; the catalog's lesson 10 ``Run`` (which
    ``fsdp-course run`` plans ranks sharing a GPU with) must say the same."""
    from utilities.course.catalog import LESSONS

    config, run = _lesson10("train_config.py"), LESSONS["10"].run
    for on_gpu in (True, False):
        cfg = config.finalize(config.Config(), on_gpu=on_gpu)
        assert (cfg.model, cfg.batch_size) == (run.model(on_gpu, False), run.batch(on_gpu, False))


# 4 steps of 2 micro-batches of 4: the copied script's run and the accumulation test's `last` side
ACCUMULATION = ("--batch-size", "4", "--grad-accum", "2", "--steps", "4")


@pytest.fixture(scope="module")
def copied_run(tmp_path_factory) -> dict:
    """train.py (with train_config.py and train_metrics.py) copied alone into an empty folder and
    started there by plain torchrun, only the library importable (PYTHONPATH, as if installed),
    every import each rank makes traced (PYTHONPROFILEIMPORTTIME); accumulating gradients with a
    reduce-scatter after each micro-batch (``--accum-sync every``). Its results.json, with the
    ranks' stderr under ``"stderr"`` and the folder under ``"folder"``."""
    import shutil

    folder = tmp_path_factory.mktemp("copied")
    for name in LESSON10_FILES:
        shutil.copy(REPO / "lessons/10_end_to_end" / name, folder / name)
    out = folder / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_COURSE")}
    env.update(PYTHONPATH=str(REPO), PYTHONPROFILEIMPORTTIME="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "train.py", "--device", "cpu", "--quick",
                           *ACCUMULATION, "--accum-sync", "every", "--ckpt-every", "2",
                           "--out", str(out)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads((out / "results.json").read_text()), "stderr": proc.stderr, "folder": out}


def test_copied_into_an_empty_folder_it_trains_with_plain_torchrun(copied_run):
    """The README's promise: train.py is the file to copy into your own project. Copied alone
    into an empty folder and started by plain torchrun there, it trains, saves its checkpoints and
    writes results.json; no rank imports anything from ``utilities.course``."""
    imported = [line.rsplit("|", 1)[-1].strip() for line in copied_run["stderr"].splitlines()
                if line.startswith("import time:")]
    assert "utilities.dcp" in imported and "train_metrics" in imported  # the trace is on
    assert [m for m in imported if m.startswith("utilities.course")] == []
    (v,) = copied_run["variants"]
    assert len(v["losses"]) == 4 and v["losses"][-1] < v["losses"][0]
    out = copied_run["folder"]
    assert v["checkpoints"] == [2, 4] and (out / "checkpoints" / "step_000004").is_dir()
    assert copied_run["takeaway"].startswith("fsdp2: train loss")


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    10 --quick` with its default flags; this quick run reproduces what it claims (precision,
    checkpointing, memory at the peak, losses)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("10", results)
