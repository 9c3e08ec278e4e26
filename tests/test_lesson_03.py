"""Lesson 03: a full checkpoint round-trips exactly, exports to transformers, and bad files are one
clear line."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO, flag_error, notebook_results, notebook_run_dir, variant

from utilities.errors import UsageError
from utilities.safe_files import atomic_torch_save
from utilities.state_dict import FORMAT, check_model_keys, read_full

sys.path.insert(0, str(REPO / "lessons" / "03_full_state_dict"))  # the lesson's own functions


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("03", tmp_path_factory)  # the notebook runs `fsdp-course run 03 --quick`


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1", "fsdp1-classic"])
def test_load_gives_identical_outputs_and_next_step(results, name):
    v = variant(results, name)
    assert v["loaded_step"] == results["settings"]["steps"]
    assert v["diff_before_load"] > 0  # the fresh model really started elsewhere
    assert v["outputs_identical"] and v["outputs_max_abs_diff"] == 0.0
    assert v["next_loss_a"] == v["next_loss_b"]
    assert v["next_step_identical"] and v["after_step_max_abs_diff"] == 0.0
    assert v["checkpoint_bytes"] > 3 * 4 * results["model"]["parameters"]  # weights + 2 Adam moments


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1", "fsdp1-classic"])
def test_hf_export_loads_with_identical_outputs(results, name):
    from transformers import AutoModelForSeq2SeqLM

    v = variant(results, name)
    assert v["hf_identical"] and v["hf_max_abs_diff"] == 0.0
    model = AutoModelForSeq2SeqLM.from_pretrained(v["hf_dir"])
    assert model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()  # ties restored
    x = torch.randint(3, 259, (1, 8))
    assert torch.isfinite(model(input_ids=x, labels=x).loss)


def test_hf_export_of_a_causal_model(tmp_path):
    """export_hf picks the causal-LM class for a Llama config (the seq2seq one for T5)."""
    from transformers import AutoModelForCausalLM

    from utilities.models import get_model_spec
    from utilities.state_dict import export_hf

    spec = get_model_spec("llama-tiny")
    torch.manual_seed(0)
    model = spec.build(device="cpu").eval()
    export_hf(model.state_dict(), spec.config(), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is type(model)
    x = torch.randint(3, 259, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)


class _RunsCode:
    def __reduce__(self):
        return (print, ("this pickle ran code",))


def test_pickle_with_code_is_refused_not_run(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "step": 1, "model": {}, "payload": _RunsCode()}, path)
    with pytest.raises(UsageError, match="asks to run code.*builtins.print.*nothing was loaded") as e:
        read_full(path)
    assert "\n" not in str(e.value) and "this pickle ran code" not in capsys.readouterr().out
    assert "truncated" not in str(e.value)  # not damaged: refused


@pytest.mark.parametrize("writer", ["lesson", "utilities"])
def test_crash_mid_save_keeps_the_old_checkpoint(world1, tmp_path, monkeypatch, writer):
    """The lesson's save_on_rank0 and utilities' atomic_torch_save (behind save_full) alike."""
    from full_state_dict import save_on_rank0

    save = (lambda path, sd: save_on_rank0(path, sd, {}, 1)) if writer == "lesson" else _checkpoint
    path = tmp_path / "ck.pt"
    save(path, {"w": torch.ones(4)})
    before = path.read_bytes()

    def crash(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as a kill in the middle of torch.save would

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save(path, {"w": torch.zeros(4)})
    monkeypatch.undo()
    assert path.read_bytes() == before and [f.name for f in tmp_path.iterdir()] == ["ck.pt"]
    assert torch.equal(read_full(path)["model"]["w"], torch.ones(4))


def _checkpoint(path, model_sd):
    atomic_torch_save({"format": FORMAT, "step": 1, "model": model_sd, "optimizer": {}}, path)
    return path


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_saved_on_2_ranks_loads_on_1(world1, tmp_path_factory, api):
    """The notebook run's fsdp2 checkpoint (2 ranks) loads into a 1-rank model, FSDP2 or FSDP1,
    with the lesson's load_full_checkpoint: every weight bit-identical to the file's."""
    from full_state_dict import gather_full_state, load_full_checkpoint

    from utilities.models import get_model_spec
    from utilities.wrapping import shard_model

    path = notebook_run_dir("03", tmp_path_factory) / "checkpoints" / "fsdp2.pt"
    ckpt = read_full(path)
    saved = ckpt["model"]
    spec = get_model_spec("t5-tiny")
    torch.manual_seed(1)
    model = shard_model(spec.build("cpu"), api=api, block_class=spec.block_class())
    assert load_full_checkpoint(path, model, torch.optim.AdamW(model.parameters())) == ckpt["step"]
    loaded, _ = gather_full_state(model)
    assert set(loaded) == set(saved)
    for key, tensor in loaded.items():
        assert torch.equal(tensor, saved[key]), key


def test_public_save_full_and_load_full_read_the_lessons_files(world1, tmp_path):
    """utilities.save_full / load_full (what users import) and the lesson's own functions write
    and read the same file format, both ways, bit for bit."""
    from full_state_dict import gather_full_state, load_full_checkpoint, save_full_checkpoint
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import utilities

    def model_and_optimizer(seed):
        torch.manual_seed(seed)
        model = fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = model_and_optimizer(0)
    want, want_optim = gather_full_state(model, optimizer)
    for save, load in ((save_full_checkpoint, utilities.load_full),
                       (utilities.save_full, load_full_checkpoint)):
        save(tmp_path / "ck.pt", model, optimizer, 7)
        fresh, fresh_optimizer = model_and_optimizer(1)
        assert load(tmp_path / "ck.pt", fresh, fresh_optimizer) == 7
        got, got_optim = gather_full_state(fresh, fresh_optimizer)
        assert all(torch.equal(got[k], want[k]) for k in want)
        for index, state in want_optim["state"].items():
            assert all(torch.equal(got_optim["state"][index][k], v) for k, v in state.items())


def test_truncated_file_is_one_line(tmp_path):
    path = _checkpoint(tmp_path / "ck.pt", {"w": torch.randn(64, 64)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError) as e:
        read_full(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "truncated" in msg


def test_not_a_checkpoint_is_one_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(UsageError, match="not readable"):
        read_full(path)
    other = tmp_path / "other.pt"
    torch.save({"w": torch.zeros(2)}, other)
    with pytest.raises(UsageError, match="not a full state dict checkpoint"):
        read_full(other)


def test_checkpoint_of_another_model_is_one_line(tmp_path):
    path = _checkpoint(tmp_path / "other_model.pt",
                       {"a.weight": torch.zeros(2, 3), "extra.bias": torch.zeros(3)})
    ckpt = read_full(path)
    expected = {"a.weight": (4, 3), "b.weight": (3,)}
    with pytest.raises(UsageError) as e:
        check_model_keys(path, ckpt["model"], expected)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    assert "missing keys (b.weight)" in msg and "unexpected keys (extra.bias)" in msg
    assert "wrong shapes (a.weight" in msg
    check_model_keys(path, {"a.weight": torch.zeros(4, 3), "b.weight": torch.zeros(3)}, expected)


def test_bad_flag_value_exits_2_with_one_line():
    assert "fsdp3" in flag_error("03", "--variants", "fsdp3")


def test_rank0_failing_to_save_stops_every_rank_in_one_line(tmp_path):
    """Only rank 0 writes; when it cannot (here a folder where the checkpoint's name goes, as a
    full disk would), rank 1 used to wait for its answer for ever. Two real ranks: the run must end
    within seconds, with rank 0's error as the one line and exit 2."""
    import time

    from conftest import cli

    ckpts = tmp_path / "ckpts"
    (ckpts / "fsdp2.pt").mkdir(parents=True)  # os.replace cannot put a file there
    started = time.monotonic()
    proc = cli("run", "03", "--device", "cpu", "--nproc", "2", "--quick", "--out", str(tmp_path),
               "--", "--variants", "fsdp2", "--no-export", "--checkpoint-dir", str(ckpts),
               timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert took < 90, took
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: saving {ckpts / 'fsdp2.pt'}"), errors
    assert "Traceback" not in proc.stdout + proc.stderr


def test_hf_export_replaces_an_earlier_one_whole_and_survives_a_crash(tmp_path, monkeypatch):
    """export_hf wrote into the folder: files of an earlier export stayed beside the new ones, and
    a crash mid-write left a mix. It now writes beside it and renames it into place; of the earlier
    export it deletes what its marker lists (a file the course wrote in an older format)."""
    import utilities.owned_paths as O
    from utilities.models import get_model_spec
    from utilities.state_dict import export_hf

    spec = get_model_spec("llama-tiny")
    torch.manual_seed(0)
    model = spec.build(device="cpu").eval()
    hf = tmp_path / "hf"
    export_hf(model.state_dict(), spec.config(), hf)
    (hf / "pytorch_model.bin").write_bytes(b"an earlier export in the older format")
    O.mark_owned(hf, [*O.owned_names(hf, "hf"), "pytorch_model.bin"])
    before = sorted(p.name for p in hf.iterdir())
    import transformers

    def crash(self, *args, **kwargs):
        raise KeyboardInterrupt  # as a kill mid-write

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        export_hf(model.state_dict(), spec.config(), hf)
    monkeypatch.undo()
    assert sorted(p.name for p in hf.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    export_hf(model.state_dict(), spec.config(), hf)
    assert "pytorch_model.bin" not in {p.name for p in hf.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an export")
    with pytest.raises(UsageError, match="not an export"):
        export_hf(model.state_dict(), spec.config(), mine)
    assert (mine / "notes.txt").read_text() == "not an export"


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    03 --quick`; this quick run reproduces what it claims (checkpoint and export bytes, exact
    reloads, the next step's loss, memory, losses)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("03", results)
