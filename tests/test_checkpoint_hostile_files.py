"""Hostile checkpoint files and folders, each attack reproduced: reading and writing refuse it.

A refused file leaves the process as it was; any file is read or refused in time proportional to
its size; the lock cannot be redirected or bypassed; two saves never share a temporary; a fresh run
never prunes its own newest checkpoint; a zip bomb is refused before it inflates; hostile trainer
values are one line; a data file swapped for a link or a FIFO after the check is refused; an HF
export is published with one rename. Everything runs in this process on a one-rank gloo world
with a two-layer model, but for the one lesson 03 launch that shows its folder lock.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import shutil
import signal
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO
from fakes import lesson10_module, train_step
from hostile_files import build_zip, local_record, memo_dag, torch_file_with_pickle, torch_save_records

import utilities.dcp as D
import utilities.dcp_metadata as DM
import utilities.owned_paths as O
import utilities.safe_files as S
import utilities.torch_zip as Z
from utilities.errors import UsageError
from utilities.state_dict import FORMAT, read_full


def _one_line(e: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, msg
    return msg


@pytest.fixture
def no_hang():
    """A test that would hang on a FIFO fails after 30 s instead."""
    def stuck(*_):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# -- a refused .metadata changes nothing in the process ----------------------------------
def _build_on(module: str, name: str, state: bytes) -> bytes:
    """A pickle that pushes the global ``module.name`` and BUILDs it with ``state`` (opcodes)."""
    return b"\x80\x04c" + f"{module}\n{name}\n".encode() + state + b"b."


def test_a_refused_metadata_cannot_poison_torchs_layout_cache(tiny, tmp_path):
    """BUILD on ``torch.serialization._get_layout`` set its cache to a wrong table: every later
    good checkpoint of the process was refused. Refused now, and the cache is untouched."""
    model, opt = tiny
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=1)
    D.save_checkpoint(tmp_path / "evil", model, opt, step=1)
    layout_fn = torch.serialization._get_layout
    cache_before = dict(getattr(layout_fn, "cache", {}))
    cache_object = getattr(layout_fn, "cache", None)
    state = b"N}\x8c\x05cache}\x8c\rtorch.stridedctorch\nfloat32\nss\x86"  # (None, {cache: {...}})
    for payload in (_build_on("torch.serialization", "_get_layout", state),
                    _build_on("torch.serialization", "_get_layout",
                              b"}\x8c\x05cache}\x8c\rtorch.stridedctorch\nfloat32\nss")):
        (tmp_path / "evil" / ".metadata").write_bytes(payload)
        with pytest.raises(UsageError) as e:
            D.check_checkpoint(tmp_path / "evil")
        _one_line(e, "asks to change the running process", "_layout", "nothing was changed")
        assert getattr(layout_fn, "cache", None) is cache_object
        assert dict(getattr(layout_fn, "cache", {})) == cache_before
    assert D.load_checkpoint(ckpt, model, opt).step == 1  # a good checkpoint still loads


def test_a_refused_metadata_cannot_redefine_path_division(tiny, tmp_path):
    """BUILD with slot state on ``pathlib.PosixPath`` set ``PosixPath.__truediv__``: every
    ``a / b`` of the process changed meaning. End to end: a planted ``step_9999999`` made lesson 10
    --resume start from 0, then every save failed. Now it is passed over, nothing changes."""
    model, opt = tiny
    train = lesson10_module()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpts = tmp_path / "checkpoints"
    train.save_training_checkpoint(ckpts, model, opt, sched, step=10, batches=10, keep_last=2)
    divide = pathlib.PosixPath.__truediv__
    planted = ckpts / "step_9999999"
    shutil.copytree(ckpts / "step_000010", planted)
    for cls in ("PosixPath", "PurePosixPath"):
        (planted / ".metadata").write_bytes(_build_on(
            "pathlib", cls, b"N}\x8c\x0b__truediv__ctorch\nfloat32\ns\x86"))  # (None, {...})
        with pytest.raises(UsageError) as e:
            D.check_checkpoint(planted)
        _one_line(e, "asks to change the running process", "PosixPath")
        assert pathlib.PosixPath.__truediv__ is divide and "__truediv__" not in vars(pathlib.PosixPath)
        assert str(Path("a") / "b") == "a/b"
        assert train.latest_checkpoint(ckpts).name == "step_000010"
    assert train.load_training_checkpoint(train.latest_checkpoint(ckpts), model, opt, sched)[0] == 10
    train.save_training_checkpoint(ckpts, model, opt, sched, step=20, batches=20, keep_last=2)
    assert (ckpts / "step_000020" / ".metadata").is_file()


def test_the_metadata_unpickler_gives_state_only_to_dcp_objects_it_built(tiny, tmp_path):
    """NEWOBJ of anything but DCP's metadata classes, a container op on a non-container, and a
    dataclass state with a name that is not a field are refused too; a real checkpoint's metadata
    still reads to the same object as pickle.loads gives."""
    model, opt = tiny
    ckpt = tmp_path / "ckpt"
    D.save_checkpoint(ckpt, model, opt, step=1)
    good = (ckpt / ".metadata").read_bytes()
    assert DM.read_metadata(ckpt) == pickle.loads(good)
    md = "torch.distributed.checkpoint.metadata"
    for payload, says in [
        (b"\x80\x04ctorch\nfloat32\n)\x81.", "to create an object"),  # NEWOBJ on a dtype
        (b"\x80\x04c" + f"{md}\nStorageMeta\n".encode() + b")\x81}\x8c\t__class__K\x01sb.",
         "not its fields"),
        (b"\x80\x04ctorch\nfloat32\n\x8c\x01aK\x01s.", "SETITEM to a dtype"),
    ]:
        (ckpt / ".metadata").write_bytes(payload)
        with pytest.raises(UsageError) as e:
            D.check_checkpoint(ckpt)
        _one_line(e, says)


# -- keys that all hash alike --------------------------------------------------------------
_P = 2 ** 61 - 1  # every multiple of it hashes to 0


def _long1(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _colliding_dict(n: int) -> bytes:
    """Opcodes of a dict of ``n`` distinct int keys that all hash to 0 (about 13 bytes each)."""
    body = bytearray(b"}")
    for start in range(0, n, 1000):
        body += b"(" + b"".join(_long1(k * _P) + b"N" for k in range(start + 1, min(n, start + 1000) + 1))
        body += b"u"
    return bytes(body)


def test_metadata_with_keys_that_hash_alike_is_refused_in_time_proportional_to_size(tmp_path):
    """A half-MiB .metadata holding 40,000 int keys of one hash took 40-90 s to unpickle (each key
    compared with every earlier one); it is refused after a few keys."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    data = b"\x80\x04" + _colliding_dict(40_000) + b"."
    assert len(data) > 400_000
    (ckpt / ".metadata").write_bytes(data)
    started = time.monotonic()
    with pytest.raises(UsageError) as e:
        D.check_checkpoint(ckpt)
    took = time.monotonic() - started
    _one_line(e, "damaged or hostile", "hash alike")
    assert took < 5, took


@pytest.mark.parametrize("container", ["dict", "set", "frozenset", "OrderedDict"])
def test_a_full_state_dict_with_keys_that_hash_alike_is_refused_before_torch_load(tmp_path,
                                                                                  container):
    """The same through ``weights_only`` torch.load of a .pt (its unpickler is pure Python and
    inserts each key as it comes): the pickle is scanned first and refused."""
    n = 40_000
    keys = b"(" + b"".join(_long1(k * _P) for k in range(1, n + 1))
    inner = {
        "dict": _colliding_dict(n),
        "set": b"cbuiltins\nset\n" + keys + b"l\x85R",  # set([...]), as protocol 2 pickles one
        "frozenset": b"cbuiltins\nfrozenset\n" + keys + b"l\x85R",
        "OrderedDict": b"ccollections\nOrderedDict\n" + b"(" + b"".join(
            _long1(k * _P) + b"N\x86" for k in range(1, n + 1)) + b"l\x85R",
    }[container]
    pkl = b"\x80\x02}(X\x06\x00\x00\x00formatX" + struct.pack("<I", len(FORMAT)) + FORMAT.encode() \
        + b"X\x05\x00\x00\x00model" + inner + b"u."
    path = tmp_path / "evil.pt"
    path.write_bytes(torch_file_with_pickle(pkl))
    started = time.monotonic()
    with pytest.raises(UsageError) as e:
        read_full(path)
    took = time.monotonic() - started
    msg = _one_line(e, "damaged or hostile")
    assert "hash alike" in msg or "from items that" in msg or "dict or a list" in msg, msg
    assert took < 10, took


def test_many_distinct_int_keys_still_load(tmp_path):
    """Not a refusal of big dicts: 50,000 int keys (an optimizer's state by index) load."""
    path = tmp_path / "big.pt"
    state = {i: {"step": i} for i in range(50_000)}
    torch.save({"format": FORMAT, "step": 1, "model": {}, "optimizer": {"state": state}}, path)
    assert len(read_full(path)["optimizer"]["state"]) == 50_000


# -- the lock cannot be redirected, nor bypassed through a link ------------------------
def test_a_planted_lock_link_fifo_or_hard_link_is_refused_and_its_target_untouched(tmp_path, no_hang):
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    lock = tmp_path / ".checkpoints.lock"
    for plant, says in ((lambda: lock.symlink_to(victim), "symbolic link"),
                        (lambda: os.mkfifo(lock), "FIFO"),
                        (lambda: os.link(victim, lock), "hard link")):
        plant()
        with pytest.raises(UsageError) as e:
            S.lock_checkpoints(tmp_path / "checkpoints")
        _one_line(e, says, ".checkpoints.lock")
        assert victim.read_text() == "precious"
        lock.unlink()
    S.lock_checkpoints(tmp_path / "checkpoints").close()  # a regular lock file works


def test_a_symlinked_checkpoint_folder_takes_the_same_lock(tmp_path):
    """Two runs saved into one folder through --ckpt-dir real and --ckpt-dir link."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    first = S.lock_checkpoints(tmp_path / "link")
    with pytest.raises(UsageError) as e:
        S.lock_checkpoints(real)
    _one_line(e, "in use by pid")
    first.close()
    first = S.lock_checkpoints(real)
    with pytest.raises(UsageError):
        S.lock_checkpoints(tmp_path / "link")
    first.close()


# -- lesson 03's temporaries are its own, and a run locks its folder ---------------------------
def test_lesson03_saves_at_once_never_share_a_temporary(world1, tmp_path, monkeypatch):
    """With the fixed name ``.NAME.tmp`` a second save during the first one wrote into the first's
    temporary, and the first then published the other run's state or a torn file."""
    from conftest import lesson_module

    lesson03 = lesson_module("03")
    path = tmp_path / "ck.pt"
    real_save = torch.save
    nested = []

    def save_with_another_save_meanwhile(obj, f, *a, **k):
        if not nested:
            nested.append(1)
            lesson03.save_on_rank0(path, {"w": torch.zeros(4)}, {}, 2)  # the other run
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_with_another_save_meanwhile)
    lesson03.save_on_rank0(path, {"w": torch.ones(4)}, {}, 1)
    monkeypatch.undo()
    ckpt = read_full(path)  # complete: one save or the other, whole
    assert ckpt["step"] == 1 and torch.equal(ckpt["model"]["w"], torch.ones(4))
    assert [f.name for f in tmp_path.iterdir()] == ["ck.pt"]


def test_lesson03_refuses_a_checkpoint_folder_another_run_holds(tmp_path):
    from conftest import cli

    ckpts = tmp_path / "ckpts"
    held = S.lock_checkpoints(ckpts)
    try:
        proc = cli("run", "03", "--device", "cpu", "--nproc", "1", "--quick", "--out", str(tmp_path),
                   "--", "--variants", "fsdp2", "--no-export", "--checkpoint-dir", str(ckpts),
                   timeout=120)
    finally:
        held.close()
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(errors) == 1 and "is in use by pid" in errors[0], errors
    assert list(ckpts.iterdir()) == []


# -- a fresh lesson 10 run in an old folder prunes only its own -----------------------------
def test_a_fresh_lesson10_run_in_an_old_folder_keeps_its_own_newest_checkpoints(tiny, tmp_path):
    """keep_last counted the earlier run's higher steps: each new save of the fresh run was deleted
    as soon as it was written. The fresh run now neither counts nor prunes the earlier run's."""
    model, opt = tiny
    train = lesson10_module()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpts = tmp_path / "checkpoints"
    for step in (100, 110):  # the earlier run
        train.save_training_checkpoint(ckpts, model, opt, sched, step=step, batches=step, keep_last=2)
    cfg = train.parse_args(["--ckpt-dir", str(ckpts)])
    earlier = train.earlier_checkpoints(cfg, None)
    assert earlier == {"step_000100", "step_000110"}
    assert train.earlier_checkpoints(train.parse_args(["--ckpt-dir", str(ckpts), "--resume"]), None) \
        == set()
    for step in (10, 20, 30, 110):
        saved = train.save_training_checkpoint(ckpts, model, opt, sched, step=step, batches=step,
                                               keep_last=2, earlier_run=frozenset(earlier))
        earlier.discard(saved.name)
        assert saved.is_dir()
    # 110 replaced the earlier run's own step 110: it is this run's now, and prunes its 20
    assert sorted(os.listdir(ckpts)) == ["step_000030", "step_000100", "step_000110"]
    assert "earlier_run" in (REPO / "lessons/10_end_to_end/train.py").read_text()


# -- a zip bomb in a .pt ---------------------------------------------------------------------
def test_a_zip_bomb_pt_is_refused_before_it_inflates(tmp_path):
    """torch's reader inflates a compressed record: 8 MB of zeros in a 20 KB file loaded (2 MiB
    inflating to 2.2 GiB in a crafted one). torch.save never compresses: refused."""
    plain = io.BytesIO()
    torch.save({"format": FORMAT, "step": 1, "model": {"w": torch.zeros(2_000_000)}, "optimizer": {}},
               plain)
    bomb = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(plain.getvalue())) as src, \
            zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    path = tmp_path / "bomb.pt"
    path.write_bytes(bomb.getvalue())
    assert path.stat().st_size < 100_000
    assert torch.load(path, weights_only=True)["model"]["w"].numel() == 2_000_000  # the attack
    with pytest.raises(UsageError) as e:
        read_full(path)
    _one_line(e, "damaged or hostile", "8000000 bytes (compressed)", f"file of {path.stat().st_size}")
    entry = io.BytesIO(bomb.getvalue())  # a DCP non-tensor entry is read the same way
    with pytest.raises(UsageError, match="compressed"):
        Z.safe_torch_load(entry, "entry")


# -- hostile trainer values ------------------------------------------------------------------
def test_a_hostile_step_is_one_line(tiny, tmp_path):
    """trainer.step = -10**12 resumed and trained 'forever'."""
    model, opt = tiny
    train = lesson10_module()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    D.save_checkpoint(tmp_path / "ckpt", model, opt, step=-10 ** 12)
    with pytest.raises(UsageError) as e:
        D.load_checkpoint(tmp_path / "ckpt", model, opt)
    _one_line(e, "trainer.step is -1000000000000", "allowed: integers in [0, ")
    ckpts = tmp_path / "checkpoints"
    path = train.save_training_checkpoint(ckpts, model, opt, sched, step=5, batches=-1, keep_last=2)
    with pytest.raises(UsageError) as e:
        train.load_training_checkpoint(path, model, opt, sched)
    _one_line(e, "trainer.batches_consumed is -1")


def test_a_string_where_the_scheduler_keeps_its_rates_is_one_line(tiny, tmp_path):
    """A string ``base_lrs`` loaded, then failed once per rank with a traceback at the next step."""
    model, opt = tiny
    train = lesson10_module()
    ckpts = tmp_path / "checkpoints"
    hostile = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    hostile.base_lrs = "abc"
    path = train.save_training_checkpoint(ckpts, model, opt, hostile, step=5, batches=5, keep_last=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(UsageError) as e:
        train.load_training_checkpoint(path, model, opt, sched)
    _one_line(e, "entry scheduler.base_lrs is 'abc' (a str)", "allowed: a list of 1 item(s)")
    assert sched.base_lrs == [1e-3]  # refused before the scheduler took it
    hostile.base_lrs, hostile.last_epoch = [float("nan")], 5
    path = train.save_training_checkpoint(ckpts, model, opt, hostile, step=6, batches=6, keep_last=2)
    with pytest.raises(UsageError) as e:
        train.load_training_checkpoint(path, model, opt, sched)
    _one_line(e, "scheduler.base_lrs", "each a finite number")
    hostile.base_lrs, hostile.last_epoch = [1e-3], -10 ** 12
    path = train.save_training_checkpoint(ckpts, model, opt, hostile, step=7, batches=7, keep_last=2)
    with pytest.raises(UsageError) as e:
        train.load_training_checkpoint(path, model, opt, sched)
    _one_line(e, "scheduler.last_epoch is -1000000000000")


# -- a data file swapped after the check --------------------------------------------------------
def test_a_shard_swapped_for_a_link_or_a_fifo_after_the_check_is_refused(tiny, tmp_path, no_hang):
    """After the check, the shard became a link to another checkpoint's shard (its weights loaded)
    or a FIFO (the load hung). Shards are opened without following links, as regular files."""
    model, opt = tiny
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    D.save_checkpoint(ckpt, model, opt, step=1)
    train_step(model, opt)
    D.save_checkpoint(other, model, opt, step=2)
    shard = ckpt / "__0_0.distcp"
    kept = tmp_path / "kept.distcp"
    shutil.copyfile(shard, kept)
    for swap, says in ((lambda: shard.symlink_to(other / "__0_0.distcp"), "symbolic link"),
                       (lambda: os.mkfifo(shard), "FIFO")):
        p, metadata = D._checked(ckpt)
        shard.unlink()
        swap()
        with pytest.raises(UsageError) as e:
            D.dcp_load(D.training_state(model, opt), p, metadata)
        _one_line(e, says)
        with pytest.raises(UsageError) as e:  # and the check itself, before any load
            D.check_checkpoint(ckpt)
        _one_line(e, "not a regular file")
        shard.unlink()
        shutil.copyfile(kept, shard)
    (ckpt / ".metadata").unlink()
    os.mkfifo(ckpt / ".metadata")
    with pytest.raises(UsageError) as e:
        DM.read_metadata(ckpt)
    _one_line(e, "FIFO")
    os.mkfifo(tmp_path / "fifo.pt")
    with pytest.raises(UsageError) as e:
        read_full(tmp_path / "fifo.pt")
    _one_line(e, "FIFO")


# -- the HF export is published with one rename --------------------------------------------
class _Killed(BaseException):
    pass


def test_a_kill_at_any_instant_of_an_hf_export_leaves_an_export(tmp_path, monkeypatch):
    """The export replaced the earlier one with two renames (old away, new in): a kill between them
    left no export. Where the filesystem can exchange two names atomically it is one rename."""
    import utilities.state_dict as state_dict
    from utilities.models import get_model_spec
    from utilities.state_dict import export_hf

    a, b = tmp_path / "probe_a", tmp_path / "probe_b"
    a.mkdir()
    b.mkdir()
    if not S._rename_exchange(a, b):
        pytest.skip("this filesystem has no atomic exchange: the README names the window")
    spec = get_model_spec("llama-tiny")
    torch.manual_seed(0)
    model = spec.build(device="cpu").eval()
    hf = tmp_path / "hf"
    export_hf(model.state_dict(), spec.config(), hf)
    (hf / "tokenizer.json").write_text("the user's")  # kept through every kill below
    first = (hf / "model.safetensors").read_bytes()
    real = S._rename_exchange
    for when in ("before", "after"):
        def killed(x, y, when=when):
            if when == "after":
                real(x, y)
            raise _Killed(when)

        monkeypatch.setattr(S, "_rename_exchange", killed)
        calls = []

        def first_only(*args, calls=calls):  # the leftovers' cleanup before staging; a kill then
            calls.append(args)                # cleans up nothing after it
            if len(calls) == 1:
                O.discard_owned(*args)

        monkeypatch.setattr(state_dict, "discard_owned", first_only)
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        with pytest.raises(_Killed):
            export_hf(model.state_dict(), spec.config(), hf)
        monkeypatch.undo()
        assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file(), when
        changed = (hf / "model.safetensors").read_bytes() != first
        assert changed == (when == "after"), when
        first = (hf / "model.safetensors").read_bytes()
        assert (hf / "tokenizer.json").read_text() == "the user's", when
        assert (tmp_path / ".hf.tmp").is_dir(), when  # left by the kill, old export or new
    export_hf(model.state_dict(), spec.config(), hf)  # the next export cleans up
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("probe")) == ["hf"]
    assert (hf / "tokenizer.json").read_text() == "the user's"


# -- bounded work: a pickle shared through its memo, zip records that share bytes ---------------------
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("reader", ["pt", "metadata"])
def test_a_tuple_dag_shared_through_the_memo_is_refused_at_once(tmp_path, reader, where):
    """A 40-deep tuple DAG as a dict key hung loading (hashing it visits 2**40 tuples; the guard's
    own hash() too): the scan counts each re-use of a memoized object again and refuses an object
    of more parts than the file can honestly build, whether a key or a value, in .pt and .metadata."""
    entry = memo_dag(40) + b"K\x01" if where == "key" else b"K\x01" + memo_dag(40)
    pkl = b"\x80\x04}" + entry + b"s."
    assert len(pkl) < 300
    started = time.monotonic()
    with pytest.raises(UsageError) as e:
        if reader == "pt":
            path = tmp_path / "dag.pt"
            path.write_bytes(torch_file_with_pickle(pkl))
            read_full(path)
        else:
            (tmp_path / ".metadata").write_bytes(pkl)
            D.check_checkpoint(tmp_path)
    _one_line(e, "damaged or hostile", "parts", "memo")
    assert time.monotonic() - started < 2


def test_shared_storages_and_tied_tensors_still_load(tmp_path):
    """Not a refusal of sharing: tensors that share a storage, one tensor under two names, and a
    thousand keys naming one memoized string load as saved."""
    base = torch.arange(12.0)
    tied = torch.ones(3)
    model = {"a": base[:6], "b": base[6:], "t1": tied, "t2": tied,
             **{f"k{i}": "same" for i in range(1000)}}
    path = tmp_path / "shared.pt"
    torch.save({"format": FORMAT, "step": 1, "model": model}, path)
    got = read_full(path)["model"]
    assert torch.equal(got["b"], base[6:]) and got["t1"] is got["t2"] and got["k999"] == "same"


def _zip(records: list[tuple[str, bytes]], aliases: dict[str, str]) -> bytes:
    """A zip of stored ``records`` whose central directory also names each ``aliases`` key at the
    record of its value (one record, two names: what no zip writer makes)."""
    index = {name: i for i, (name, _) in enumerate(records)}
    return build_zip(records, [(name, i, 0, 0, 0) for name, i in index.items()]
                     + [(alias, index[target], 0, 0, 0) for alias, target in aliases.items()])


def test_zip_records_that_share_bytes_are_refused(tmp_path):
    """500 central-directory entries naming one 4 MiB record: a 4.1 MiB file was accepted as
    1.95 GiB of tensors. Each entry must point at a record of its own name, and records may not
    overlap (a record hidden inside another's bytes), so the records hold no more than the file."""
    records = torch_save_records({"format": FORMAT, "step": 1, "model": {"w": torch.zeros(1 << 20)}})
    storage = next(name for name, _ in records if name.endswith("/data/0"))
    path = tmp_path / "aliased.pt"
    path.write_bytes(_zip(records, {storage[:-1] + str(i): storage for i in range(1, 500)}))
    assert path.stat().st_size < 5 << 20
    with pytest.raises(UsageError) as e:
        read_full(path)
    _one_line(e, "damaged or hostile", "where another record starts", "refused")
    # the record of tensor "b" hidden inside the bytes of tensor "a" (19 floats: 16 bytes, then
    # b's 60-byte record): torch read both, b from inside a
    saved = torch_save_records({"format": FORMAT, "step": 1, "model": {"a": torch.zeros(19),
                                                                       "b": torch.ones(4)}})
    first, second = (next(n for n, _ in saved if n.endswith(k)) for k in ("/data/0", "/data/1"))
    hidden = local_record(second, dict(saved)[second])
    assert 16 + len(hidden) == 19 * 4
    records = [(n, bytes(16) + hidden if n == first else b) for n, b in saved if n != second]
    entries = [(n, i, 0, 0, 0) for i, (n, _) in enumerate(records)]
    at = next(i for i, (n, _) in enumerate(records) if n == first)
    entries.append((second, at, 30 + len(first) + 16, 16 - len(records[at][1]), 0))
    path.write_bytes(build_zip(records, entries))
    with pytest.raises(UsageError) as e:
        read_full(path)
    _one_line(e, "share bytes")
    path.write_bytes(build_zip(torch_save_records({"format": FORMAT, "step": 1,
                                                   "model": {"w": torch.ones(3)}})))
    assert torch.equal(read_full(path)["model"]["w"], torch.ones(3))  # the builder itself is sound


def test_a_legacy_pt_is_named_with_how_to_resave(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"format": FORMAT, "step": 1, "model": {}}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UsageError) as e:
        read_full(path)
    msg = _one_line(e, "legacy", "torch.save(obj, f)", "_use_new_zipfile_serialization=True")
    assert "truncated" not in msg
    path.write_bytes(b"\x80\x02}q\x00." + b"\0" * 100)  # a plain pickle is still not a torch.save file
    with pytest.raises(UsageError) as e:
        read_full(path)
    _one_line(e, "not a torch.save file")


# -- the lock cannot be redirected by a parent swapped for a link; outputs never block -------------------
def test_a_parent_swapped_for_a_link_after_resolving_cannot_redirect_the_lock(tmp_path, monkeypatch):
    """Between ``realpath`` and the open, a parent folder swapped for a link to another folder had
    the lock created there (327 and 711 of 3,000 tries): the folder is now opened name by name
    without following a link, and the lock file relative to it."""
    parent, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    (parent / "ckpt").mkdir(parents=True)
    (elsewhere / "ckpt").mkdir(parents=True)
    real_realpath = os.path.realpath

    def resolve_then_swap(path, *args, **kwargs):
        resolved = real_realpath(path, *args, **kwargs)
        parent.rename(tmp_path / "runs.moved")
        parent.symlink_to(elsewhere)
        return resolved

    monkeypatch.setattr(os.path, "realpath", resolve_then_swap)
    with pytest.raises(UsageError) as e:
        S.lock_checkpoints(parent / "ckpt")
    monkeypatch.undo()
    _one_line(e, "'runs'", "link")
    assert list(elsewhere.iterdir()) == [elsewhere / "ckpt"]
    parent.unlink()
    (tmp_path / "runs.moved").rename(parent)
    S.lock_checkpoints(parent / "ckpt").close()
    assert (parent / ".ckpt.lock").is_file()


def test_plan_trace_refuses_a_fifo_or_a_device_without_blocking(tmp_path, no_hang):
    from conftest import cli_here

    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    for target, says in ((fifo, "FIFO"), (Path(os.devnull), "device"), (tmp_path, "directory")):
        proc = cli_here("plan", "--model", "llama-tiny", "--trace", str(target))
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
        assert says in proc.stderr and "--trace" in proc.stderr, proc.stderr
    S.atomic_write_text(tmp_path / "ok.json", "{}", "--trace")
    assert (tmp_path / "ok.json").read_text() == "{}" and sorted(os.listdir(tmp_path)) == [
        "ok.json", "trace.json"]


def test_record_out_refuses_a_fifo_or_a_device_without_blocking(tmp_path, no_hang, monkeypatch):
    """``record --out``: its recording and the temporary beside it are opened non-blocking and only
    as regular files; the lesson is not started."""
    import subprocess

    from utilities.course.catalog import get_lesson
    from utilities.course.recording import record

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("the lesson was started"))
    info = get_lesson("01")
    cast = tmp_path / f"{info.folder}.cast"
    os.mkfifo(cast)
    with pytest.raises(UsageError) as e:
        record(info, cast, ["--quick"])
    _one_line(e, "FIFO", "record --out")
    cast.unlink()
    os.mkfifo(tmp_path / f".{cast.name}.tmp")
    with pytest.raises(UsageError) as e:
        record(info, cast, ["--quick"])
    _one_line(e, "FIFO", "record --out")
    (tmp_path / f".{cast.name}.tmp").unlink()
    (tmp_path / f".{cast.name}.tmp").symlink_to(os.devnull)
    with pytest.raises(UsageError) as e:
        record(info, cast, ["--quick"])
    _one_line(e, "symbolic link")
    assert not cast.exists()


# -- export_hf replaces only what the course wrote ----------------------------------------------------
@pytest.fixture(scope="module")
def llama_tiny():
    from utilities.models import get_model_spec

    spec = get_model_spec("llama-tiny")
    torch.manual_seed(0)
    return spec.build(device="cpu").eval().state_dict(), spec.config()


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_export_hf_refuses_a_file_or_a_downloaded_folder_and_deletes_nothing(tmp_path, llama_tiny):
    """A regular file at the export path was deleted; a downloaded HF folder (config.json,
    tokenizer.json, README.md) was replaced whole, the user's files lost."""
    from utilities.state_dict import export_hf

    state, config = llama_tiny
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    with pytest.raises(UsageError) as e:
        export_hf(state, config, file)
    _one_line(e, "is a file, not a folder", "nothing was replaced or deleted")
    assert file.read_text() == "mine"
    downloaded = tmp_path / "llama"
    downloaded.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        (downloaded / name).write_text(name)
    before = _tree(downloaded)
    with pytest.raises(UsageError) as e:
        export_hf(state, config, downloaded)
    _one_line(e, "not an export the course wrote", O.OWNED_MARKER)
    assert _tree(downloaded) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "notes.txt"]


@pytest.mark.parametrize("publish", ["exchange", "two renames"])
def test_export_hf_keeps_the_users_files_beside_an_earlier_export(tmp_path, llama_tiny, monkeypatch,
                                                                   publish):
    """A user's tokenizer.json and README.md beside an export survive the next export, by the
    atomic exchange and by the fallback's two renames; the marker lists only the course's files."""
    from utilities.state_dict import export_hf

    state, config = llama_tiny
    hf = tmp_path / "hf"
    export_hf(state, config, hf)
    ours = json_names(hf)
    assert "model.safetensors" in ours and "config.json" in ours and O.OWNED_MARKER not in ours
    (hf / "tokenizer.json").write_text("{\"tok\": 1}")
    (hf / "README.md").write_text("# my model")
    (hf / "link.txt").symlink_to("README.md")
    if publish == "two renames":
        monkeypatch.setattr(S, "_rename_exchange", lambda a, b: False)
    export_hf(state, config, hf)
    assert (hf / "tokenizer.json").read_text() == "{\"tok\": 1}"
    assert (hf / "README.md").read_text() == "# my model" and os.readlink(hf / "link.txt") == "README.md"
    assert os.stat(hf / "README.md").st_nlink == 1  # the old folder's name for it is gone
    assert json_names(hf) == ours
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(hf) is not None


def json_names(folder: Path) -> list[str]:
    return json.loads((folder / O.OWNED_MARKER).read_text())["files"]


def test_export_hf_refuses_a_users_file_where_it_would_write_and_a_forged_marker(tmp_path,
                                                                                llama_tiny):
    from utilities.state_dict import export_hf

    state, config = llama_tiny
    hf = tmp_path / "hf"
    export_hf(state, config, hf)
    (hf / "generation_config.json").unlink()
    (hf / "generation_config.json").write_text("mine")  # now the user's, and not in the marker
    listed = json.loads((hf / O.OWNED_MARKER).read_text())
    listed["files"].remove("generation_config.json")
    (hf / O.OWNED_MARKER).write_text(json.dumps(listed))
    before = _tree(hf)
    with pytest.raises(UsageError) as e:
        export_hf(state, config, hf)
    _one_line(e, "generation_config.json", "did not write")
    assert _tree(hf) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    precious = tmp_path / "precious"
    precious.write_text("keep")
    for forged in ('{"written_by": "fsdp-course", "files": ["../precious"]}', "[" * 100_000,
                   '{"written_by": "fsdp-course", "files": 1}', "not json"):
        (hf / O.OWNED_MARKER).write_text(forged)
        with pytest.raises(UsageError) as e:
            export_hf(state, config, hf)
        _one_line(e, "marker", "nothing was replaced or deleted")
        assert precious.read_text() == "keep" and (hf / "config.json").is_file()


def _scan_peak(scan) -> tuple[int, float]:
    """The peak of Python memory traced while ``scan()`` runs, and the seconds it took."""
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    try:
        scan()
        return tracemalloc.get_traced_memory()[1], time.perf_counter() - start
    finally:
        tracemalloc.stop()


def test_a_large_legal_pickle_is_scanned_in_memory_far_below_its_size(tmp_path):
    """The pickle scan reads opcode by opcode, a long argument in pieces: 64 MiB of bytes and
    8 MiB of text are scanned holding a few MiB (the whole pickle held once is over 72 MiB),
    from a file and from the data.pkl of a torch.save file; a long text that is not UTF-8 or a
    long argument cut short is still refused."""
    from utilities.pickle_scan import DamagedPickle, scan_pickle

    payload = {"weights": bytes(64 << 20), "notes": "é" * (4 << 20), "step": 3}
    path = tmp_path / "big.pkl"
    path.write_bytes(pickle.dumps(payload, protocol=4))
    size = path.stat().st_size
    assert size > 72 << 20
    with open(path, "rb") as f:
        peak, seconds = _scan_peak(lambda: scan_pickle(f, 64, lambda module, name: True))
    assert peak < 4 << 20 and seconds < 10, (peak, seconds)
    saved = tmp_path / "big.pt"
    torch.save(payload, saved)
    with open(saved, "rb") as f:
        peak, seconds = _scan_peak(lambda: Z.check_torch_zip(f, "big.pt"))
    assert peak < 4 << 20 and seconds < 10, (peak, seconds)
    long_text = pickle.dumps("é" * 5000, protocol=4)
    for damaged in (long_text.replace("é".encode(), b"\xff\xfe", 1), long_text[:-2000]):
        with pytest.raises(DamagedPickle):
            scan_pickle(damaged, 64, lambda module, name: True)


def test_the_ownership_rules_refuse_what_the_course_did_not_write(tiny, tmp_path):
    """One set of rules for every writer (utilities.owned_paths): a folder is the course's to write
    into only when new, empty or marked; an entry is replaced only when listed and still of its
    kind; a name from the input is never a path. The DCP converter and the checkpoint save follow
    them: a user's file, folder or link where they would write is refused and left as it was."""
    from utilities.owned_paths import folder_state, owned_entry, replaceable

    marked, foreign, empty = tmp_path / "marked", tmp_path / "foreign", tmp_path / "empty"
    for folder in (marked, foreign, empty):
        folder.mkdir()
    (marked / "manifest.json").write_text("{}")
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    (tmp_path / "link").symlink_to(marked)
    states = {p.name: folder_state(p, "manifest.json") for p in (marked, foreign, empty, tmp_path / "file",
                                                                  tmp_path / "link", tmp_path / "new")}
    assert states == {"marked": "marked", "foreign": "foreign", "empty": "empty", "file": "file",
                      "link": "link", "new": "missing"}
    assert replaceable(marked / "manifest.json", True, "file") and replaceable(marked / "gone", False, "file")
    assert not replaceable(marked / "manifest.json", False, "file")  # not listed: the user's
    assert not replaceable(tmp_path / "link", True, "folder")  # a link is never the course's
    for name in ("..", "a/b", "", O.OWNED_MARKER):
        with pytest.raises(UsageError):
            owned_entry(tmp_path, name, "--unpack")
    model = {"w": torch.ones(2)}
    torch.save(model, tmp_path / "model.pt")
    def everything() -> dict[str, bytes | str]:
        return {str(p.relative_to(tmp_path)): os.readlink(p) if p.is_symlink() else
                p.read_bytes() if p.is_file() else "folder" for p in sorted(tmp_path.rglob("*"))}

    for target in (tmp_path / "file", tmp_path / "link", foreign):
        before = everything()
        with pytest.raises(UsageError) as e:
            D.from_torch_save(tmp_path / "model.pt", target)
        _one_line(e, "is not a DCP checkpoint", "not replaced")
        assert everything() == before
        with pytest.raises(UsageError) as e:
            D.save_checkpoint(target, *tiny, step=1)
        _one_line(e, "not a DCP checkpoint", "not replaced")
        assert everything() == before
    assert D.from_torch_save(tmp_path / "model.pt", empty) == empty and (empty / ".metadata").is_file()
