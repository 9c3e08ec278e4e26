"""Hostile evidence archives, generated: whatever the archive's members and manifest hold,
``evidence --unpack`` either merges what the catalog names into its folder or refuses in one line,
within a time bound, and writes nothing outside its folder. The default run draws the same 60
examples every time; a longer, random one:
``FSDP_COURSE_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_evidence.py``."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from utilities.course import evidence as E
from utilities.course import evidence_archive as A

LONG_RUN = int(os.environ.get("FSDP_COURSE_FUZZ_EXAMPLES", "0") or 0)
EXAMPLES = LONG_RUN or 60  # the default run draws the same examples every time (it cannot flake)
KNOWN = ("quick-01", "claim-01-wrap", "lesson-14")
NAMES = st.one_of(
    st.sampled_from(["manifest.json", *KNOWN, *(f"{k}.log" for k in KNOWN), "..", ".", "/etc/passwd",
                     "../x", "a/../../b", "", "quick-01/../..", "x" * 300]),
    st.builds(lambda step, leaf: f"{step}/{leaf}", st.sampled_from([*KNOWN, "..", "other"]),
              st.sampled_from(["results.json", "junit.xml", "a/b", "..", "a", "a/b/c/d"])),
    st.text(alphabet="ab./-_\\\x00é", max_size=12),
)
TYPES = st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                         tarfile.FIFOTYPE, tarfile.CHRTYPE])
RECORD = st.fixed_dictionaries({
    "status": st.sampled_from(["ok", "failed", "cut", "great", 3]),
    "seconds": st.one_of(st.floats(allow_nan=True), st.integers(-10, 10**6), st.text(max_size=3)),
    "version": st.one_of(st.text(max_size=4), st.integers()),
    "date": st.one_of(st.sampled_from(["2026-11-01", "2026-12-01", ""]), st.integers(), st.none()),
})
VALID_RECORD = st.fixed_dictionaries({
    "status": st.sampled_from(["ok", "failed", "cut"]), "seconds": st.floats(0, 1e4),
    "version": st.text(max_size=4), "date": st.sampled_from(["2026-11-01", "2026-12-01"])})


@st.composite
def plausible(draw):
    """An archive as --pack writes one (a manifest and its steps' files), then a few hostile
    members added: most examples reach the merge."""
    steps = draw(st.lists(st.sampled_from(KNOWN), unique=True, max_size=3))
    manifest = {"schema": 2, "folder": "ev", "chunks": [], "steps": {k: draw(VALID_RECORD) for k in steps}}
    members = [(f"{k}/results.json", tarfile.REGTYPE, b"{}") for k in steps]
    members += [(f"{k}.log", tarfile.REGTYPE, b"log") for k in steps]
    hostile = draw(st.lists(st.tuples(NAMES, TYPES, st.binary(max_size=64)), max_size=2))
    return members + hostile, manifest


MANIFEST = st.fixed_dictionaries({
    "schema": st.sampled_from([2, 2, 1, "2"]),
    "folder": st.one_of(st.just("ev"), st.just("/etc"), st.just("../.."), st.integers()),
    "chunks": st.one_of(st.lists(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
                                 max_size=2), st.text(max_size=3), st.integers()),
    "steps": st.dictionaries(NAMES, RECORD, max_size=4),
})


def _archive(path: Path, members, manifest) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, data in [("manifest.json", tarfile.REGTYPE, json.dumps(manifest).encode()),
                                 *members]:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = "/etc/passwd"
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in root.rglob("*")}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=not LONG_RUN, database=None)
@given(archive=st.one_of(plausible(), st.tuples(
    st.lists(st.tuples(NAMES, TYPES, st.binary(max_size=64)), max_size=6), MANIFEST)),
       existing=st.sampled_from(["none", "evidence", "link", "users-file"]))
def test_an_archive_is_merged_within_its_folder_or_refused_in_one_line(tmp_path_factory, archive, existing):
    members, manifest = archive
    base = tmp_path_factory.mktemp("fuzz")
    outside = base / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("kept")
    into = base / "ev"
    if existing != "none":
        into.mkdir()
        E.Manifest(folder="ev", steps={"quick-01": E.Record("ok", 1, "v", "2026-11-15")}).write(
            into / "manifest.json")
    if existing == "link":
        (into / "quick-01").symlink_to(outside, target_is_directory=True)
    elif existing == "users-file":
        (into / "lesson-14.log").write_text("the user's")
    archive = base / "e.tar.gz"
    _archive(archive, members, manifest)
    before = _tree(outside)
    began = time.monotonic()
    try:
        folder, taken = A.unpack(archive, into=into, root=base, known=KNOWN)
    except E.UsageError as e:
        assert "\n" not in str(e) and len(str(e)) < 800
        event("refused")
    else:
        event(f"merged {len(taken)} steps")
        assert folder == into and set(taken) <= set(KNOWN)
        names = {p.relative_to(into).as_posix().split("/")[0] for p in into.iterdir()}
        allowed = {"manifest.json", *KNOWN, *(f"{k}.log" for k in KNOWN)}
        assert names <= allowed, names
    assert time.monotonic() - began < 10
    assert _tree(outside) == before
    assert sorted(p.name for p in base.iterdir()) == sorted(["outside", "e.tar.gz"]
                                                           + (["ev"] if into.exists() else []))
    if existing == "users-file":
        assert (into / "lesson-14.log").read_text() == "the user's"
