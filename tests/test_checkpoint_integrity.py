"""No checkpoint the course loads can run code, and a kill at any instant of a
save never costs the previous checkpoint.

Everything here runs in this process on a one-rank gloo world (``world1``) with a two-layer model:
no torchrun launch, well under a second per save.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import REPO
from fakes import lesson10_module, train_step
from torch import nn

import utilities.dcp as D
import utilities.dcp_metadata as DM
import utilities.safe_files as S
from utilities.errors import UsageError
from utilities.state_dict import FORMAT, read_full


class _Touch:
    """Unpickling this calls ``os.system("touch MARKER")``: the test sees whether code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))




def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- item 2: nothing runs code -------------------------------------------------------------------
def test_crafted_metadata_is_refused_before_dcp_reads_it(tiny, tmp_path):
    model, opt = tiny
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=1)
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    for call in (D.check_checkpoint, D.checkpoint_files,
                 lambda p: D.load_checkpoint(p, model, opt),
                 lambda p: D.to_torch_save(p, tmp_path / "one.pt")):
        with pytest.raises(UsageError) as e:
            call(ckpt)
        msg = str(e.value)
        assert "\n" not in msg and "asks to run code" in msg and "system" in msg, msg
        assert "nothing was loaded" in msg
    assert not marker.exists()


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as ``getattr(cls, "NAME")``, as Python 3.11.2 does (3.11.7: by value)."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _repickle_enums_by_name(ckpt: Path) -> None:
    import io

    metadata = DM.read_metadata(ckpt)
    buf = io.BytesIO()
    _EnumsByName(buf).dump(metadata)
    (ckpt / ".metadata").write_bytes(buf.getvalue())


def test_metadata_with_enums_pickled_by_name_loads_and_other_getattrs_are_refused(tiny, tmp_path):
    """A checkpoint written under Python 3.11.2 (DCP's memory-format enum pickled through
    ``builtins.getattr``) loads; ``getattr`` on anything but a DCP enum's member is refused."""
    model, opt = tiny
    before = _weights(model)
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=2)
    _repickle_enums_by_name(ckpt)
    assert b"getattr" in (ckpt / ".metadata").read_bytes()
    train_step(model, opt)
    assert D.load_checkpoint(ckpt, model, opt).step == 2 and _same(_weights(model), before)

    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(
        b"\x80\x04cbuiltins\ngetattr\ncposix\nsystem\nX\x04\x00\x00\x00namer.")  # getattr(posix.system, ...)
    with pytest.raises(UsageError, match="asks to run code.*posix.system"):
        D.check_checkpoint(ckpt)
    from torch.distributed.checkpoint.metadata import Metadata

    class _Rogue:
        def __reduce__(self):
            return getattr, (Metadata, "__init__")

    (ckpt / ".metadata").write_bytes(pickle.dumps(_Rogue()))
    with pytest.raises(UsageError, match=r"asks to run code.*getattr\(Metadata, '__init__'\)"):
        D.check_checkpoint(ckpt)
    assert not marker.exists()


def test_sharded_tensor_metadata_with_enums_pickled_by_name_loads(tmp_path):
    """The same for what an FSDP1 local state dict holds: ShardedTensor metadata, whose
    ``TensorProperties`` pickles DCP's memory-format enum, saved by ``torch.save`` the way Python
    3.11.2 pickles enums. Loaded with the local state dict's allowlist (``load_fsdp1_local``)."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    from utilities.torch_zip import safe_torch_load

    props = TensorProperties.create_from_tensor(torch.zeros(2, 3))
    path = tmp_path / "rank0_of_2.pt"
    pickler = types.ModuleType("enums_by_name")
    pickler.Pickler, pickler.dump = _EnumsByName, pickle.dump
    torch.save({"props": props}, path, pickle_module=pickler)
    assert b"getattr" in path.read_bytes() and b"MEM_FORMAT_ENCODING" in path.read_bytes()
    assert safe_torch_load(path, "local", allow=D._sharded_tensor_globals())["props"] == props


def test_crafted_non_tensor_entry_is_refused(tiny, tmp_path):
    """DCP stores non-tensor values as torch.save bytes and reads them back with
    ``weights_only=False``; a checkpoint holding one that runs code must be refused, not loaded."""
    import torch.distributed.checkpoint as dcp

    model, opt = tiny
    marker = tmp_path / "ran"
    state = D.training_state(model, opt, 1, 1)
    state["evil"] = _Touch(marker)
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    with pytest.raises(UsageError, match=r"entry evil asks to run code.*posix.system"):
        D.check_checkpoint(tmp_path / "ckpt")
    target = D.training_state(model, opt)
    target["evil"] = None
    with pytest.raises(UsageError, match="entry evil asks to run code"):  # the planner alone
        D.dcp_load(target, tmp_path / "ckpt")
    with pytest.raises(UsageError, match="asks to run code"):
        D.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert not marker.exists()


def test_torch_save_files_are_read_weights_only(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "x": _Touch(marker)}, evil)
    with pytest.raises(UsageError, match="asks to run code.*posix.system"):
        D.from_torch_save(evil, tmp_path / "dcp")
    with pytest.raises(UsageError, match="asks to run code.*posix.system"):
        D.load_fsdp1_local(nn.Linear(2, 2), evil)
    assert not marker.exists() and not (tmp_path / "dcp").exists()


def test_a_good_checkpoint_still_round_trips(tiny, tmp_path):
    model, opt = tiny
    before = _weights(model)
    D.save_checkpoint(tmp_path / "ckpt", model, opt, step=3, batches_consumed=5)
    train_step(model, opt)
    resumed = D.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert (resumed.step, resumed.batches_consumed) == (3, 5) and _same(_weights(model), before)
    one = D.to_torch_save(tmp_path / "ckpt", tmp_path / "one.pt")
    back = D.from_torch_save(one, tmp_path / "back")
    assert D.checkpoint_files(back) == ["__0_0.distcp"]


# -- item 4: lesson 03's loader says what a malicious pickle is ------------------------------------
def test_malicious_full_checkpoint_is_named_not_called_truncated(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "step": 1, "model": {}, "payload": _Touch(marker)}, path)
    with pytest.raises(UsageError) as e:
        read_full(path)
    msg = str(e.value)
    assert "\n" not in msg and "asks to run code" in msg and "posix.system" in msg
    assert "nothing was loaded" in msg
    assert "truncated" not in msg and "In PyTorch 2.6" not in msg
    assert not marker.exists()


# -- item 3: a kill between any two filesystem operations of an overwrite ----------------------------
class _Killed(BaseException):
    """What a SIGKILL looks like from inside: nothing after it runs."""


def _fs_ops(monkeypatch, kill_at: int | None, how: str = "before") -> list[str]:
    """Route the os.replace / shutil.rmtree / mkdir / dcp.save of utilities.dcp and
    utilities.safe_files through a counter that raises ``_Killed`` at op number ``kill_at``:
    before the op, or (``how="half"``) after doing
    half of it (half a directory deleted; a DCP save's data written but not its ``.metadata``).
    Lesson 10 saves through ``utilities.dcp.dcp_save``, so its ``dcp.save`` counts too."""
    ops: list[str] = []

    def op(name, real, *args, **kwargs):
        index = len(ops)
        ops.append(name)
        if index == kill_at:
            if how == "half":
                _half(name, real, *args, **kwargs)
            raise _Killed(f"{name} #{index}")
        return real(*args, **kwargs)

    fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    fake_os.replace = lambda *a, **k: op("replace", os.replace, *a, **k)
    fake_shutil = types.SimpleNamespace(rmtree=lambda *a, **k: op("rmtree", shutil.rmtree, *a, **k))
    real_save = D.dcp.save
    fake_dcp = types.SimpleNamespace(**vars(D.dcp))
    fake_dcp.save = lambda *a, **k: op("dcp.save", real_save, *a, **k)
    real_mkdir = Path.mkdir
    monkeypatch.setattr(D, "os", fake_os)
    monkeypatch.setattr(S, "os", fake_os)  # the swap and the removal live in utilities.safe_files
    monkeypatch.setattr(S, "shutil", fake_shutil)
    monkeypatch.setattr(D, "dcp", fake_dcp)

    def mkdir(self, *a, **k):  # only our own mkdir is an operation of ours, not DCP's
        if sys._getframe(1).f_globals.get("__name__") in (D.__name__, S.__name__):
            return op("mkdir", real_mkdir, self, *a, **k)
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    return ops


def _half(name, real, *args, **kwargs) -> None:
    if name == "rmtree":
        target = Path(args[0])
        files = sorted(target.iterdir()) if target.is_dir() else []
        for f in files[: len(files) // 2]:
            f.unlink()
    elif name == "dcp.save":
        real(*args, **kwargs)
        (Path(kwargs["checkpoint_id"]) / ".metadata").unlink()  # DCP writes it last




def _overwrite_ops(tiny, tmp_path, monkeypatch) -> list[str]:
    model, opt = tiny
    D.save_checkpoint(tmp_path / "count", model, opt, step=1)
    ops = _fs_ops(monkeypatch, None)
    D.save_checkpoint(tmp_path / "count", model, opt, step=2)
    monkeypatch.undo()
    return ops


def test_the_overwrite_has_the_operations_we_kill_at(tiny, tmp_path, monkeypatch):
    ops = _overwrite_ops(tiny, tmp_path, monkeypatch)
    assert ops.count("replace") == 2 and "dcp.save" in ops and ops[-1] == "rmtree", ops


@pytest.mark.parametrize("how", ["before", "half"])
def test_kill_between_any_two_operations_keeps_a_checkpoint(tiny, tmp_path, monkeypatch, how):
    """Save A, then overwrite it with B and kill the process at the k-th filesystem operation, for
    every k. Afterwards the name always loads, and deterministically: B once B's data was all
    written (only the renames were cut short), A before that. A further save cleans up."""
    model, opt = tiny
    ops = _overwrite_ops(tiny, tmp_path, monkeypatch)
    saved_at = ops.index("dcp.save")
    for k in range(len(ops)):
        path = tmp_path / f"k{k}" / "ckpt"
        D.save_checkpoint(path, model, opt, step=1)
        a = _weights(model)
        train_step(model, opt)
        b = _weights(model)
        _fs_ops(monkeypatch, k, how)
        with pytest.raises(_Killed):
            D.save_checkpoint(path, model, opt, step=2)
        monkeypatch.undo()
        train_step(model, opt)  # so a load that does nothing cannot pass
        expect_b = k > saved_at  # a kill during dcp.save ("half": data without .metadata) keeps A
        resumed = D.load_checkpoint(path, model, opt)
        assert resumed.step == (2 if expect_b else 1), (k, ops[k], how, os.listdir(path.parent))
        assert _same(_weights(model), b if expect_b else a), (k, ops[k], how)
        # the next save recovers: only the name itself is left
        D.save_checkpoint(path, model, opt, step=3)
        assert sorted(os.listdir(path.parent)) == ["ckpt"], (k, ops[k], how)
        assert D.load_checkpoint(path, model, opt).step == 3


def test_lesson10_resumes_from_a_save_killed_mid_publish(tiny, tmp_path, monkeypatch):
    """Lesson 10's save uses the same swap; its latest_checkpoint and load find the finished save
    even where the kill left it as .step_N.tmp (before: --resume silently restarted at step 0)."""
    model, opt = tiny
    train = lesson10_module()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpts = tmp_path / "checkpoints"
    train.save_training_checkpoint(ckpts, model, opt, sched, step=10, batches=10, keep_last=2)
    train_step(model, opt)
    b = _weights(model)
    ops = _fs_ops(monkeypatch, None)
    train.save_training_checkpoint(ckpts, model, opt, sched, step=20, batches=20, keep_last=2)
    monkeypatch.undo()
    shutil.rmtree(ckpts / "step_000020")
    for k in range(ops.index("dcp.save") + 1, len(ops)):  # every kill after the data is written
        _fs_ops(monkeypatch, k)
        with pytest.raises(_Killed):
            train.save_training_checkpoint(ckpts, model, opt, sched, step=20, batches=20, keep_last=2)
        monkeypatch.undo()
        latest = train.latest_checkpoint(ckpts)
        assert latest is not None and latest.name in ("step_000020", ".step_000020.tmp"), k
        train_step(model, opt)
        assert train.load_training_checkpoint(latest, model, opt, sched) == (20, 20)
        assert _same(_weights(model), b)
        shutil.rmtree(latest)
        train_step(model, opt)
        b = _weights(model)
    # an unfinished save (no .metadata) is never picked: step 10 is
    _fs_ops(monkeypatch, ops.index("dcp.save"), "half")
    with pytest.raises(_Killed):
        train.save_training_checkpoint(ckpts, model, opt, sched, step=30, batches=30, keep_last=2)
    monkeypatch.undo()
    assert train.latest_checkpoint(ckpts).name == "step_000010"
    train.save_training_checkpoint(ckpts, model, opt, sched, step=40, batches=40, keep_last=2)
    assert sorted(os.listdir(ckpts)) == ["step_000010", "step_000040"]


def test_unfinished_tmp_alone_is_still_reported_as_unfinished(tmp_path):
    (tmp_path / ".ckpt.tmp").mkdir()
    (tmp_path / ".ckpt.tmp" / "__0_0.distcp").write_bytes(b"half")
    with pytest.raises(UsageError, match="never completed"):
        D.check_checkpoint(tmp_path / "ckpt")


# -- a .metadata swapped after it was checked is never read again -----------------------------------
def test_metadata_swapped_after_any_read_never_runs_code(tiny, tmp_path, monkeypatch):
    """Whoever can write the folder replaces ``.metadata`` by a payload right after the n-th time it
    is opened, for every n: the load either succeeds on the checked object or is refused in one
    line; the payload never runs (PyTorch's own reader would unpickle it with ``pickle.load``)."""
    import builtins
    import io
    import time

    model, opt = tiny
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=4)
    good = (ckpt / ".metadata").read_bytes()
    marker = tmp_path / "ran"
    payload = tmp_path / "payload"
    payload.write_bytes(pickle.dumps(_Touch(marker)))
    real_open = builtins.open
    started = time.monotonic()
    for call in (lambda: D.load_checkpoint(ckpt, model, opt),
                 lambda: D.to_torch_save(ckpt, tmp_path / "one.pt")):
        for swap_after in range(1, 12):
            (ckpt / ".metadata").write_bytes(good)
            opened = []

            def spying_open(file, *args, opened=opened, swap_after=swap_after, **kwargs):
                f = real_open(file, *args, **kwargs)
                if str(file).endswith(".metadata") and Path(file).parent == ckpt:
                    opened.append(file)
                    if len(opened) == swap_after:  # the open file keeps the old contents
                        shutil.copyfile(payload, tmp_path / "swap")
                        os.replace(tmp_path / "swap", ckpt / ".metadata")
                return f

            monkeypatch.setattr(builtins, "open", spying_open)
            monkeypatch.setattr(io, "open", spying_open)  # pathlib.Path.open goes through io.open
            try:
                call()
            except UsageError as e:
                assert "\n" not in str(e) and "asks to run code" in str(e), e
            finally:
                monkeypatch.setattr(builtins, "open", real_open)
                monkeypatch.setattr(io, "open", real_open)
            assert not marker.exists(), f"the payload ran after swap at open {swap_after}"
            if len(opened) < swap_after:
                break  # every interleaving of this call was tried
    assert time.monotonic() - started < 60


# -- crafted metadata of DCP's own classes: one line, damaged or hostile, nothing loaded ----------
def _rewrite_metadata(ckpt: Path, change) -> None:
    metadata = DM.read_metadata(ckpt)
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _first_storage(metadata, fqn: str = "trainer.step"):
    return next(k for k in metadata.storage_data if k.fqn == fqn)


def _set_storage(fqn: str, **fields):
    import dataclasses

    def change(metadata):
        key = _first_storage(metadata, fqn)
        metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], **fields)
    return change


def _storage_of_wrong_type(metadata):
    metadata.storage_data[_first_storage(metadata)] = ("__0_0.distcp", 0, 10)


def _huge_tensor(metadata):
    metadata.state_dict_metadata["model.1.bias"].size = torch.Size([2 ** 40])


def _deep_path(metadata):
    deep = "__0_0.distcp"
    for _ in range(40):
        deep = (deep,)
    _set_storage("trainer.step", relative_path=deep)(metadata)


@pytest.mark.parametrize("change,says", [
    (_storage_of_wrong_type, "storage of trainer.step is malformed"),
    (_set_storage("trainer.step", offset=-1), "storage of trainer.step is malformed"),
    (_set_storage("trainer.step", length=2 ** 62), "shorter than .metadata says"),
    (_set_storage("optim.param_groups.0.lr", length=2 ** 62), "shorter than .metadata says"),
    (_set_storage("trainer.step", relative_path="/etc/hostname"), "outside the checkpoint folder"),
    (_set_storage("trainer.step", relative_path="../outside/__0_0.distcp"), "outside the checkpoint"),
    (_set_storage("trainer.step", relative_path=""), "outside the checkpoint folder"),
    (_deep_path, "storage of trainer.step is malformed"),
    (_huge_tensor, "larger than its data files"),
], ids=["wrong-type", "offset-1", "length-2^62", "bytes-length-2^62", "absolute", "dotdot", "empty",
        "deep-path", "huge-size"])
def test_crafted_metadata_of_allowed_classes_is_one_line(tiny, tmp_path, change, says):
    model, opt = tiny
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=4)
    shutil.copytree(ckpt, tmp_path / "outside")  # a real shard that a '..' path would reach
    _rewrite_metadata(ckpt, change)
    for call in (D.check_checkpoint, lambda p: D.load_checkpoint(p, model, opt),
                 lambda p: D.to_torch_save(p, tmp_path / "one.pt"),
                 lambda p: D.dcp_load(D.training_state(model, opt), p)):
        with pytest.raises(UsageError) as e:
            call(ckpt)
        msg = str(e.value)
        assert "\n" not in msg and "damaged or hostile" in msg and says in msg, msg
        assert "nothing was loaded" in msg and "run code" not in msg
    assert not (tmp_path / "one.pt").exists()


def test_truncated_shard_and_random_metadata_are_damaged(tiny, tmp_path):
    model, opt = tiny
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=4)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(UsageError, match="damaged or hostile.*truncated.*nothing was loaded"):
        D.load_checkpoint(ckpt, model, opt)
    rng = __import__("random").Random(0)
    for _ in range(50):
        (ckpt / ".metadata").write_bytes(bytes(rng.randrange(256) for _ in range(400)))
        with pytest.raises(UsageError) as e:
            D.check_checkpoint(ckpt)
        assert "\n" not in str(e.value) and "damaged" in str(e.value), e.value
        assert "run code" not in str(e.value)


def test_shard_cut_short_after_the_check_is_one_line(tiny, tmp_path):
    """The data files change between the check and DCP's read: still one line, no traceback."""
    model, opt = tiny
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=4)
    p, metadata = D._checked(ckpt)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    with pytest.raises(UsageError, match="is damaged: reading its data failed") as e:
        D.dcp_load(D.training_state(model, opt), p, metadata)
    assert "\n" not in str(e.value)


def test_a_300000_deep_metadata_pickle_ends_in_one_line_not_a_crash(tmp_path):
    """Hashing a deeply nested dict key recurses in C: plain pickle.load dies of SIGSEGV on this."""
    import subprocess

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"\x80\x04}K\x01" + b"\x85" * 300_000 + b"K\x02s.")
    code = ("import sys\nimport utilities.dcp as D\nfrom utilities.errors import UsageError\n"
            "try:\n    D.check_checkpoint(sys.argv[1])\n"
            "except UsageError as e:\n    print(f'error: {e}', file=sys.stderr)\n    sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1 and "damaged or hostile" in proc.stderr
    assert "levels deep" in proc.stderr


def test_lesson10_orders_checkpoints_by_step_across_the_padding_width(tiny, tmp_path):
    """``step_{step:06d}`` grows a digit at step 1,000,000; sorted as text it came first, so each
    new save was pruned at once and --resume picked step 999,999."""
    model, opt = tiny
    train = lesson10_module()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpts = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        train.save_training_checkpoint(ckpts, model, opt, sched, step=step, batches=step, keep_last=2)
    assert sorted(os.listdir(ckpts)) == ["step_1000000", "step_1000001"]
    assert train.latest_checkpoint(ckpts).name == "step_1000001"
    assert train.load_training_checkpoint(train.latest_checkpoint(ckpts), model, opt, sched)[0] == 1_000_001
    (ckpts / "step_1000000").rename(ckpts / ".step_1000000.tmp")  # a save killed mid-publish
    shutil.rmtree(ckpts / "step_1000001")
    (ckpts / "step_999999").mkdir()  # an incomplete older one never wins either
    assert train.latest_checkpoint(ckpts).name == ".step_1000000.tmp"
    assert [p.name for p in D.recover_checkpoints(ckpts)] == ["step_999999", "step_1000000"]


def test_publish_syncs_the_new_folder_before_renaming_it(tiny, tmp_path, monkeypatch):
    """DCP renames ``.metadata`` into place inside ``.NAME.tmp`` without syncing that folder; the
    publish syncs it before the renames and the parent after them."""
    model, opt = tiny
    events = []
    real_replace = os.replace
    monkeypatch.setattr(S, "fsync_dir", lambda d: events.append(("fsync", Path(d).name)))
    monkeypatch.setattr(S.os, "replace", lambda a, b: (events.append(("replace", Path(a).name)),
                                                       real_replace(a, b)))
    D.save_checkpoint(tmp_path / "ckpt", model, opt, step=1)
    assert events == [("fsync", ".ckpt.tmp"), ("replace", ".ckpt.tmp"), ("fsync", tmp_path.name)]


def test_planted_tmp_file_and_old_symlink_neither_crash_nor_get_followed(tiny, tmp_path):
    """A file where ``.NAME.tmp`` goes crashed the save (mkdir), a symlink where ``.NAME.old`` goes
    crashed it too (rmtree refuses links), and a linked ``.old`` was taken for a checkpoint."""
    model, opt = tiny
    elsewhere = tmp_path / "elsewhere"
    D.save_checkpoint(elsewhere, model, opt, step=9)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / ".ckpt.tmp").write_text("planted")
    (ckpts / ".ckpt.old").symlink_to(elsewhere)
    assert D.resolve_checkpoint(ckpts / "ckpt") is None  # the link is never followed
    D.save_checkpoint(ckpts / "ckpt", model, opt, step=1)
    D.save_checkpoint(ckpts / "ckpt", model, opt, step=2)  # an overwrite, through .old
    assert sorted(os.listdir(ckpts)) == ["ckpt"] and not (ckpts / "ckpt").is_symlink()
    assert D.load_checkpoint(ckpts / "ckpt", model, opt).step == 2
    assert D.load_checkpoint(elsewhere, model, opt).step == 9  # what the link pointed at is intact


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tiny, tmp_path,
                                                                                monkeypatch):
    """ENOSPC inside dcp.save was 160 lines and 6 tracebacks, and left a partial ``.tmp``."""
    import errno

    from torch.distributed.checkpoint import filesystem

    model, opt = tiny
    train = lesson10_module()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpts = tmp_path / "checkpoints"
    train.save_training_checkpoint(ckpts, model, opt, sched, step=10, batches=10, keep_last=2)
    real_open = filesystem.FileSystem.create_stream

    def full(self, path, mode):
        if "w" in mode and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(self, path, mode)

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full)
    for save in (lambda: train.save_training_checkpoint(ckpts, model, opt, sched, step=20, batches=20,
                                               keep_last=2),
                 lambda: D.save_checkpoint(ckpts / "step_000020", model, opt, step=20)):
        with pytest.raises(UsageError) as e:
            save()
        msg = str(e.value)
        assert "\n" not in msg and "No space left on device" in msg, msg
        assert "step_000020" in msg and "previous checkpoint" in msg
        assert sorted(os.listdir(ckpts)) == ["step_000010"]  # no partial .tmp is left
    monkeypatch.undo()
    assert train.load_training_checkpoint(train.latest_checkpoint(ckpts), model, opt, sched) == (10, 10)


def test_from_torch_save_replaces_an_earlier_conversion_whole(tiny, tmp_path):
    model, opt = tiny
    D.save_checkpoint(tmp_path / "ckpt", model, opt, step=3)
    one = D.to_torch_save(tmp_path / "ckpt", tmp_path / "one.pt")
    back = tmp_path / "back"
    D.from_torch_save(one, back)
    (back / "__7_0.distcp").write_bytes(b"left by an earlier conversion")
    D.from_torch_save(one, back)
    assert sorted(os.listdir(back)) == [".metadata", "__0_0.distcp"]
    assert not (tmp_path / ".back.tmp").exists() and not (tmp_path / ".back.old").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(UsageError, match="not a DCP checkpoint"):
        D.from_torch_save(one, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_checkpoint_folder_takes_one_run_at_a_time(tmp_path):
    """Two `run 10` on one --out: one's recovery deleted the other's .tmp. The second is refused in
    one line naming the holder; the lock goes with the process that held it."""
    first = S.lock_checkpoints(tmp_path / "checkpoints")
    with pytest.raises(UsageError) as e:
        S.lock_checkpoints(tmp_path / "checkpoints")
    msg = str(e.value)
    assert "\n" not in msg and "in use by pid" in msg and str(os.getpid()) in msg, msg
    assert os.listdir(tmp_path / "checkpoints") == []  # nothing inside the folder itself
    first.close()  # as the process ending does
    S.lock_checkpoints(tmp_path / "checkpoints").close()
    assert "lock_checkpoints(cfg.ckpt_dir)" in (REPO / "lessons/10_end_to_end/train.py").read_text()


def test_a_size_whose_element_count_overflows_int64_is_refused(tiny, tmp_path):
    model, opt = tiny
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=4)

    def change(metadata):
        entry = metadata.state_dict_metadata["model.0.weight"]
        entry.size = torch.Size([2 ** 62, 2 ** 62])  # numel wraps around in int64
    _rewrite_metadata(ckpt, change)
    with pytest.raises(UsageError, match="larger than its data files"):
        D.to_torch_save(ckpt, tmp_path / "one.pt")
