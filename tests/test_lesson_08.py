"""Lesson 08: DCP checkpoints reshard (2 ranks -> 1), resume exactly, refuse damaged directories in
one line, and convert to one torch.save file and back without changing a tensor.

The notebook's quick run (2 ranks) is the saved checkpoint; two more torchrun launches: a load on
1 rank, and a load of that rank's re-save on 2 ranks."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli, notebook_results, notebook_run_dir, run_lesson, variant

from utilities.dcp import check_checkpoint, checkpoint_files, from_torch_save, to_torch_save
from utilities.errors import UsageError

sys.path.insert(0, str(REPO / "lessons" / "08_local_state_dict"))  # the lesson's own functions

FLAGS = ("--skip-resume-check",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Lesson 08 on 2 ranks as its notebook runs it: trains, saves with DCP, checks resuming."""
    return notebook_run_dir("08", tmp_path_factory), notebook_results("08", tmp_path_factory)


def _steps(res) -> int:
    return res["settings"]["steps"]


def test_layout_one_file_per_rank_plus_metadata(saved):
    out, res = saved
    files = sorted(p.name for p in (out / "checkpoint").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert checkpoint_files(out / "checkpoint") == ["__0_0.distcp", "__1_0.distcp"]
    assert not (out / ".checkpoint.tmp").exists()  # published by rename
    v = variant(res, "fsdp2-dcp")
    assert v["reload_outputs_equal"] is True
    assert v["save_s"] > 0 and v["load_s"] > 0 and v["async_total_s"] >= v["async_blocked_s"] > 0
    assert variant(res, "fsdp1-local")["world_size_bound"] == 2


def test_resume_equals_uninterrupted(saved):
    out, res = saved
    r = json.loads((out / "resume_check.json").read_text())
    k = _steps(res)
    assert len(r["uninterrupted"]) == 2 * k and r["resumed_at_step"] == k
    # different data after the resume (data position lost) or a lost optimizer state would differ
    assert r["resumed"] == pytest.approx(r["uninterrupted"], abs=1e-5)
    assert variant(res, "resume-check")["max_abs_loss_diff"] <= 1e-5


def test_saved_on_2_loaded_on_1_gives_same_outputs(saved, tmp_path):
    out, saved_res = saved
    k = _steps(saved_res)
    res = run_lesson("08", tmp_path / "run1", *FLAGS, "--load-from", str(out / "checkpoint"),
                     nproc=1)
    v = variant(res, "dcp-load-resharded")
    assert v["world_size"] == 1 and v["step"] == k and v["batches_consumed"] == k
    # the same run's FSDP1 LOCAL_STATE_DICT cannot follow: its flat shards belong to 2 ranks
    assert "Local world size at save time was 2, but at load time was 1" in v["local_state_dict_error"]
    before = torch.load(out / "outputs_saved.pt")
    after = torch.load(tmp_path / "run1" / "outputs_loaded.pt")
    assert before.shape == after.shape
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    # re-saved from one rank: one data file, and still a complete checkpoint
    assert checkpoint_files(tmp_path / "run1" / "checkpoint") == ["__0_0.distcp"]

    # and the reverse: what one rank wrote, two ranks load
    res2 = run_lesson("08", tmp_path / "run2", *FLAGS, "--load-from",
                      str(tmp_path / "run1" / "checkpoint"), nproc=2)
    assert variant(res2, "dcp-load-resharded")["world_size"] == 2
    again = torch.load(tmp_path / "run2" / "outputs_loaded.pt")
    torch.testing.assert_close(again, before, rtol=1e-5, atol=1e-5)


def test_missing_rank_file_is_one_line_usage_error(saved, tmp_path):
    out, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(out / "checkpoint", broken)
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(UsageError, match="missing __1_0.distcp"):
        check_checkpoint(broken)
    proc = cli("run", "08", "--device", "cpu", "--quick", "--out", str(tmp_path / "x"), "--",
               "--load-from", str(broken))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "__1_0.distcp" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    (broken / ".metadata").unlink()
    with pytest.raises(UsageError, match="no .metadata"):
        check_checkpoint(broken)


def test_unfinished_save_is_refused(tmp_path):
    (tmp_path / ".ckpt.tmp").mkdir()
    with pytest.raises(UsageError, match="never completed"):
        check_checkpoint(tmp_path / "ckpt")


def test_a_save_killed_mid_write_keeps_the_previous_checkpoint(world1, tmp_path, monkeypatch):
    """The lesson's save_sharded writes into .NAME.tmp and renames it only once complete: a kill inside
    dcp.save leaves the previous checkpoint loadable, and the next save recovers."""
    import sharded_state_dict as lesson
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = tmp_path / "ckpt"
    lesson.save_sharded(ckpt, model, optimizer, step=1, batches_consumed=1)

    def killed(state, checkpoint_id):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        raise KeyboardInterrupt  # as a kill in the middle of the write would

    monkeypatch.setattr(lesson.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        lesson.save_sharded(ckpt, model, optimizer, step=2, batches_consumed=2)
    monkeypatch.undo()
    assert (tmp_path / ".ckpt.tmp").is_dir() and check_checkpoint(ckpt) == ckpt
    assert lesson.load_sharded(ckpt, model, optimizer) == (1, 1)
    lesson.save_sharded(ckpt, model, optimizer, step=2, batches_consumed=2)
    assert lesson.load_sharded(ckpt, model, optimizer) == (2, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_convert_to_torch_save_and_back_preserves_tensors(saved, tmp_path):
    out, res = saved
    single = to_torch_save(out / "checkpoint", tmp_path / "one.pt")
    data = torch.load(single, weights_only=False)
    reference = torch.load(out / "reference_full_model.pt")
    assert set(data["model"]) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(data["model"][name], tensor), name
    assert int(data["trainer"]["step"]) == _steps(res) and data["optim"]["state"]

    back = from_torch_save(single, tmp_path / "back_dcp")
    check_checkpoint(back)
    again = torch.load(to_torch_save(back, tmp_path / "again.pt"), weights_only=False)
    flat, flat_again = _flatten(data), _flatten(again)
    assert set(flat) == set(flat_again)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(flat_again[key], value), key
        else:
            assert flat_again[key] == value, key


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        items = {}
        for k, v in obj.items():
            items.update(_flatten(v, f"{prefix}{k}."))
        return items
    if isinstance(obj, list):
        items = {}
        for i, v in enumerate(obj):
            items.update(_flatten(v, f"{prefix}{i}."))
        return items
    return {prefix: obj}


def test_a_stray_local_state_dict_name_beside_load_from_is_ignored(tmp_path):
    """``rank0_of_x.pt`` beside a ``--load-from`` folder ended the run in a 50-line ValueError."""
    from state_dict_run import local_on_this_world

    (tmp_path / "fsdp1_local").mkdir()
    (tmp_path / "fsdp1_local" / "rank0_of_x.pt").write_bytes(b"stray")
    (tmp_path / "fsdp1_local" / "rank1_of_0.pt").write_bytes(b"stray")
    assert local_on_this_world(None, tmp_path / "checkpoint") is None


def test_readme_table_is_reproduced_by_the_quick_run(saved):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    08 --quick`; this quick run reproduces what it claims (formats, file counts, exact reload and
    resume)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("08", saved[1])
