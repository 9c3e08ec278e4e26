"""Property-based fuzzing (``hypothesis``) of the readers of checkpoint files the course did not
write: ``torch.save`` files (``torch_zip.safe_torch_load``: the zip check, the pickle scan, the
weights-only load), DCP ``.metadata`` (``dcp.check_checkpoint``) and the marker of an export folder
(``owned_paths.owned_names``); and the writers of a path the user names (``plan --trace``, ``record
--out``: ``safe_files.atomic_write_text``, ``open_output``) over whatever is planted there.

Each property: the reader gives a correct result or refuses in one ``UsageError`` line, within
``SECONDS`` of CPU time per example (ten times that of wall time: it never waits), ``MEMORY`` bytes
of address space more than the process had, and writes nothing (the folder an example reads from
holds afterwards exactly what the example put there).
The generators make what the course's readers were broken with and more: opcode streams that play
with the memo (``DUP``, ``BINPUT``/``BINGET``, ``MEMOIZE``) and nest deeply, zips whose central
directory names one record twice, points into another or declares the wrong sizes, and DCP
metadata cut, flipped or re-pickled with hostile field values (or its data file flipped).

The default run is small and fixed (``derandomize``: the same 50 examples a property every run,
and the known attacks as ``@example``; the whole file in seconds). A longer, random one on request::

    FSDP_COURSE_FUZZ_EXAMPLES=2000 pytest -n 0 tests/test_fuzz_readers.py

No example database is written (``database=None``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import resource
import sys
import time
from pathlib import Path

import pytest
import torch
from hostile_files import build_zip, memo_dag, memo_op, torch_file_with_pickle, torch_save_records
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import utilities.dcp as D
import utilities.dcp_metadata as DM
import utilities.owned_paths as O
import utilities.safe_files as S
import utilities.torch_zip as Z
from utilities.errors import UsageError

LONG_RUN = int(os.environ.get("FSDP_COURSE_FUZZ_EXAMPLES", "0") or 0)
SECONDS = 2.0  # CPU per example: every reader is linear in its input, and inputs here are small
MEMORY = 1 << 30  # address space an example may add (a 4 MiB zip once read as 2 GiB of tensors)

FUZZ = settings(max_examples=LONG_RUN or 50, deadline=None, database=None,
                derandomize=not LONG_RUN, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@contextlib.contextmanager
def memory_bound(extra: int = MEMORY):
    """Address space limited to what the process has now plus ``extra`` (Linux): a reader that
    allocates past it fails with MemoryError instead of taking the machine's memory."""
    if not sys.platform.startswith("linux"):
        yield
        return
    pages = int(Path("/proc/self/statm").read_text().split()[0])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def read_within_bounds(read, folder: Path):
    """``read()`` under the time and memory bounds: its result, or None where it refused in one
    ``UsageError`` line; ``folder`` holds the same names afterwards."""
    before = sorted(os.listdir(folder))
    started, cpu = time.monotonic(), time.process_time()
    result = None
    try:
        with memory_bound():
            result = read()
    except UsageError as e:
        assert "\n" not in str(e) and str(e), repr(str(e))
    # CPU time: what the reader costs, whatever else shares the machine; wall time: it never waits
    took, waited = time.process_time() - cpu, time.monotonic() - started
    assert took < SECONDS and waited < 10 * SECONDS, f"took {took:.2f} s of CPU, {waited:.2f} s"
    assert sorted(os.listdir(folder)) == before, "the reader wrote into the folder it read"
    return result


# -- hostile pickles: opcode streams -------------------------------------------------------------------
_PUSH = [b")", b"]", b"}", b"\x8f", b"N", b"\x88", b"(", b"K\x07", b"J\xff\xff\xff\x7f",
         b"\x8c\x01k", b"X\x03\x00\x00\x00key", b"G\x7f\xf0\x00\x00\x00\x00\x00\x00"]
_COMBINE = [b"\x85", b"\x86", b"\x87", b"t", b"l", b"d", b"\x91", b"a", b"e", b"s", b"u", b"\x90",
            b"R", b"b", b"\x81", b"0", b"1", b"2"]
_GLOBALS = [b"cbuiltins\nset\n", b"cbuiltins\nfrozenset\n", b"ccollections\nOrderedDict\n",
            b"ctorch._utils\n_rebuild_tensor_v2\n", b"ctorch\nSize\n", b"cposix\nsystem\n",
            b"cbuiltins\ngetattr\n", b"\x8c\x08builtins\x8c\x03set\x93"]




_op = st.one_of(st.sampled_from(_PUSH), st.sampled_from(_COMBINE), st.sampled_from(_GLOBALS),
                st.builds(memo_op, st.sampled_from(["put", "get", "memoize", "long_get"]),
                          st.integers(0, 7)))




@st.composite
def memo_dags(draw) -> bytes:
    """A memo DAG of up to 64 levels (a few hundred bytes) placed as a dict key, a dict value or
    a set member."""
    body = memo_dag(draw(st.integers(0, 64)), draw(st.sampled_from([2, 3])))
    where = draw(st.sampled_from(["key", "value", "set", "frozenset"]))
    if where == "key":
        return b"\x80\x04}" + body + b"K\x01s."
    if where == "value":
        return b"\x80\x04}K\x01" + body + b"s."
    if where == "set":
        return b"\x80\x04\x8f(" + body + b"\x90."
    return b"\x80\x04(" + body + b"\x91."


@st.composite
def deep_nesting(draw) -> bytes:
    depth = draw(st.sampled_from([1, 10, 63, 65, 1000, 20_000]))
    kind = draw(st.sampled_from(["lists", "tuples", "dicts"]))
    if kind == "lists":
        return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    if kind == "tuples":
        return b"\x80\x02" + b"(" * depth + b"t" * depth + b"."
    return b"\x80\x02" + b"}K\x00" * depth + b"s" * (depth - 1) + b"K\x00s."


pickles = st.one_of(
    st.lists(_op, max_size=60).map(lambda ops: b"\x80\x04" + b"".join(ops) + b"."),
    memo_dags(),
    deep_nesting(),
    st.binary(max_size=200),
)

# plain data as a checkpoint holds it, with objects shared between places (pickle memoizes them)
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                  st.text(max_size=8), st.builds(lambda n: torch.arange(float(n)), st.integers(0, 5)))
_plain = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4),
    st.tuples(inner, inner), inner.map(lambda x: [x, x, (x, x)])), max_leaves=20)




def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


# what broke the readers before, in every run whatever the generators draw
_KNOWN = [b"\x80\x04}" + memo_dag(40) + b"K\x01s.",  # a 40-deep memo DAG as a key: 2**40 to hash
          b"\x80\x02" + b"]" * 20_000 + b"a" * 19_999 + b"."]  # 20,000 nested lists


@FUZZ
@given(data=pickles)
@example(data=_KNOWN[0])
@example(data=_KNOWN[1])
def test_hostile_pickles_in_a_pt_are_read_or_refused_in_one_line(data, tmp_path):
    read_within_bounds(lambda: Z.safe_torch_load(io.BytesIO(torch_file_with_pickle(data)), "fuzzed.pt"),
                       tmp_path)


@FUZZ
@given(data=pickles)
@example(data=_KNOWN[0])
@example(data=_KNOWN[1])
def test_hostile_pickles_as_dcp_metadata_are_read_or_refused_in_one_line(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("metadata")
    (folder / ".metadata").write_bytes(data)
    read_within_bounds(lambda: D.check_checkpoint(folder), folder)


@FUZZ
@given(obj=_plain)
def test_what_torch_save_writes_loads_back_as_it_was(obj, tmp_path):
    """The other half of each property: a file torch.save wrote, with shared objects, is read back
    whole (the work bound counts shared objects but never refuses honest sharing)."""
    buf = io.BytesIO()
    torch.save({"obj": obj}, buf)
    got = read_within_bounds(lambda: Z.safe_torch_load(io.BytesIO(buf.getvalue()), "saved.pt"),
                             tmp_path)
    assert got is not None and _same(obj, got["obj"])


# -- hostile zips: records named twice, overlapping, of the wrong size --------------------------------






_BASE = torch_save_records({"format": "fuzz", "w": torch.arange(64.0), "b": torch.ones(8)})


@st.composite
def hostile_zips(draw) -> bytes:
    n = len(_BASE)
    entries = []
    for i, (name, _) in enumerate(_BASE):
        if draw(st.booleans()) or draw(st.integers(0, 3)) == 0:
            entries.append((name, i, 0, 0, 0))  # as written
        else:
            entries.append((draw(st.sampled_from([name, _BASE[0][0], name + "x"])),
                            draw(st.integers(0, n - 1)), draw(st.sampled_from([0, 0, 1, -1, 30, 64])),
                            draw(st.sampled_from([0, 0, 1, -1, 1 << 20, 1 << 31])),
                            draw(st.sampled_from([0, 0, 8]))))
    extra = draw(st.lists(st.tuples(st.sampled_from([f"archive/data/{k}" for k in range(4)]),
                                    st.integers(0, n - 1)), max_size=6))
    entries += [(name, index, 0, 0, 0) for name, index in extra]  # more names for one record
    data = bytearray(build_zip(_BASE, draw(st.permutations(entries))))
    flips = draw(st.integers(0, 3))
    for _ in range(flips):
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    cut = draw(st.sampled_from([None, None, None, 0, 22, len(data) // 2, len(data) - 1]))
    return bytes(data[:cut] if cut is not None else data), not flips and cut is None


@FUZZ
@given(zip_and_intact=hostile_zips())
def test_hostile_zips_are_read_or_refused_in_one_line(zip_and_intact, tmp_path):
    """Refused in one line, or read as written: where no byte was flipped (a flipped byte of a
    tensor's data changes its value: torch checks no CRC), no record is read twice, out of place or
    under another record's name."""
    data, intact = zip_and_intact
    got = read_within_bounds(lambda: Z.safe_torch_load(io.BytesIO(data), "fuzzed.pt"), tmp_path)
    if got is not None and intact:
        assert isinstance(got, dict) and set(got) <= {"format", "w", "b"}
        if "w" in got:
            assert torch.equal(got["w"], torch.arange(64.0)), got["w"]
        if "b" in got:
            assert torch.equal(got["b"], torch.ones(8)), got["b"]


def test_the_zip_builder_writes_what_torch_reads():
    assert torch.equal(Z.safe_torch_load(io.BytesIO(build_zip(_BASE)), "built.pt")["w"],
                       torch.arange(64.0))


# -- hostile DCP metadata: the real one cut, flipped, or re-pickled with hostile fields ----------------
@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save({"model": {"w": torch.arange(16.0).reshape(4, 4), "b": torch.ones(4)},
              "trainer": {"step": 3, "note": "fuzz"}}, checkpoint_id=str(folder))
    return folder


_hostile_values = st.one_of(st.integers(-2**70, 2**70), st.sampled_from(
    [0, -1, 2**62, "", "../x", "/etc/hostname", "__0_0.distcp", None, (), ("a",), 1.5,
     torch.Size([2**40]), torch.Size([-1]), [1, 2]]))


def _refield(metadata, draw) -> None:
    """Set one field of one entry of ``metadata`` to a hostile value."""
    import dataclasses

    storage = draw(st.sampled_from(sorted(metadata.storage_data, key=str)))
    info = metadata.storage_data[storage]
    if dataclasses.is_dataclass(info) and draw(st.booleans()):
        field = draw(st.sampled_from(["relative_path", "offset", "length"]))
        metadata.storage_data[storage] = dataclasses.replace(info, **{field: draw(_hostile_values)})
        return
    entry = metadata.state_dict_metadata[draw(st.sampled_from(sorted(metadata.state_dict_metadata)))]
    chunks = getattr(entry, "chunks", None)
    if chunks and draw(st.booleans()):
        field = draw(st.sampled_from(["offsets", "sizes"]))
        setattr(chunks[0], field, draw(_hostile_values))
    elif hasattr(entry, "size"):
        entry.size = draw(_hostile_values)
    else:
        metadata.storage_data[storage] = draw(_hostile_values)


@FUZZ
@given(data=st.data())
def test_hostile_dcp_metadata_is_read_or_refused_in_one_line(data, dcp_checkpoint, tmp_path_factory):
    import shutil

    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    shutil.copytree(dcp_checkpoint, folder)
    raw = bytearray((folder / ".metadata").read_bytes())
    how = data.draw(st.sampled_from(["field", "field", "flip", "cut", "shard"]))
    if how == "shard":  # the data file: its torch.save entries are read too
        shard = next(folder.glob("*.distcp"))
        body = bytearray(shard.read_bytes())
        for _ in range(data.draw(st.integers(1, 8))):
            body[data.draw(st.integers(0, len(body) - 1))] ^= data.draw(st.integers(1, 255))
        shard.write_bytes(bytes(body))
    elif how == "field":
        metadata = DM.read_metadata(folder)
        for _ in range(data.draw(st.integers(1, 3))):
            _refield(metadata, data.draw)
        raw = bytearray(pickle.dumps(metadata, protocol=data.draw(st.sampled_from([2, 4, 5]))))
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    else:
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    (folder / ".metadata").write_bytes(bytes(raw))
    read_within_bounds(lambda: D.check_checkpoint(folder), folder)


def test_the_unchanged_dcp_checkpoint_is_read(dcp_checkpoint):
    assert D.check_checkpoint(dcp_checkpoint) == dcp_checkpoint


# -- the marker of an export folder ---------------------------------------------------------------------
_names = st.one_of(st.text(max_size=12), st.sampled_from(["..", ".", "a/b", "/etc", O.OWNED_MARKER,
                                                          "config.json", "x\0y"]))
_markers = st.one_of(
    st.binary(max_size=300),
    st.fixed_dictionaries({"written_by": st.sampled_from(["fsdp-course", "other"]),
                           "files": st.one_of(st.lists(_names, max_size=5), st.just("all"),
                                              st.integers(), st.none())}).map(
        lambda d: __import__("json").dumps(d).encode()),
    st.integers(1, 50_000).map(lambda n: b"[" * n),
)


@FUZZ
@given(marker=_markers)
def test_hostile_export_markers_are_read_or_refused_in_one_line(marker, tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    (folder / "config.json").write_text("{}")
    (folder / O.OWNED_MARKER).write_bytes(marker)
    names = read_within_bounds(lambda: O.owned_names(folder, "fuzzed export"), folder)
    if names is not None:
        assert all(n and "/" not in n and n not in (".", "..") for n in names), names


# -- output paths the user names: written whole, or refused in one line, never blocking -----------------
@contextlib.contextmanager
def alarm_after(seconds: int):
    """A call that blocks (an open of a FIFO) fails after ``seconds`` instead of hanging the suite."""
    import signal

    def stuck(*_):
        raise TimeoutError("blocked")

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


_PLANTS = ["nothing", "file", "fifo", "folder", "link to a file", "link to a fifo", "link to a device",
           "dangling link"]


def _plant(path: Path, what: str) -> None:
    beside = path.parent / "beside"
    if what == "file":
        path.write_text("old")
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "folder":
        path.mkdir()
    elif what == "link to a file":
        beside.write_text("kept")
        path.symlink_to(beside)
    elif what == "link to a fifo":
        os.mkfifo(beside)
        path.symlink_to(beside)
    elif what == "link to a device":
        path.symlink_to(os.devnull)
    elif what == "dangling link":
        path.symlink_to(path.parent / "nowhere")


@FUZZ
@given(plant=st.sampled_from(_PLANTS), writer=st.sampled_from(["atomic_write_text", "open_output"]))
def test_output_paths_are_written_or_refused_without_blocking(plant, writer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("out")
    path = folder / "trace.json"
    _plant(path, plant)
    beside = (folder / "beside").read_text() if (folder / "beside").is_file() else None
    started = time.monotonic()
    try:
        with alarm_after(5):
            if writer == "atomic_write_text":
                S.atomic_write_text(path, "new", "--trace")
            else:
                with S.open_output(path, "--trace") as f:
                    f.write("new")
        written = True
    except UsageError as e:
        assert "\n" not in str(e) and "--trace" in str(e), str(e)
        written = False
    assert time.monotonic() - started < 5
    if written:
        assert not path.is_symlink() and path.read_text() == "new"
    assert set(os.listdir(folder)) <= {"trace.json", "beside"}, os.listdir(folder)  # no temporary left
    if beside is not None:
        assert (folder / "beside").read_text() == beside  # a link's target is never written
