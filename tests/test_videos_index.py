"""videos_index.md: a row per classic lesson, and every link points to a file or a well-formed URL."""

from __future__ import annotations

import json
import re
from urllib.parse import urlparse

from conftest import REPO

from utilities.course.catalog import LESSONS

INDEX = (REPO / "videos_index.md").read_text()
ROWS = {m.group(1): m.group(0) for m in re.finditer(r"^\| (\d\d) \|.*$", INDEX, re.M)}


def test_every_lesson_has_a_row():
    for number in [f"{i:02d}" for i in range(1, 12)]:
        assert number in ROWS, f"lesson {number} has no row"
    for number, info in LESSONS.items():
        if info.ready:
            assert info.notebook.name in ROWS.get(number, ""), f"lesson {number}'s row lacks its notebook"


def test_links_resolve():
    links = re.findall(r"\]\(([^)]+)\)", INDEX)
    assert links
    for link in links:
        if link.startswith("http"):
            url = urlparse(link)
            assert url.scheme == "https" and url.netloc and url.path not in ("", "/"), link
        else:
            assert (REPO / link).exists(), f"{link} does not exist"


def test_index_is_up_to_date():
    from utilities.course.videos_index import render

    assert INDEX == render(), "videos_index.md is stale: run `python -m utilities.course.videos_index`"


def test_recordings_are_asciinema_v2_of_real_runs():
    casts = sorted((REPO / "videos").glob("*.cast"))
    assert casts
    for cast in casts:
        header, *events = map(json.loads, cast.read_text().splitlines())
        assert header["version"] == 2 and header["command"].startswith("fsdp-course run")
        times = [e[0] for e in events]
        assert times == sorted(times) and all(e[1] == "o" for e in events)
        text = "".join(e[2] for e in events)
        assert "results written to" in text and text.rstrip().endswith("[exit 0]"), cast.name


def test_record_command_writes_a_cast(tmp_path):
    from conftest import cli

    proc = cli("record", "01", "--out", str(tmp_path), "--", "--variants", "fsdp2-per-block",
               "--steps", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, *events = map(json.loads, (tmp_path / "01_auto_wrap.cast").read_text().splitlines())
    assert "fsdp2-per-block" in "".join(e[2] for e in events)


# An absolute path that names a user's home or an installation: a home folder (Linux, macOS,
# Windows, its backslashes as JSON writes them), or any folder through a virtual environment or
# an installed package's folder. A
# run's own output folder (``/tmp/...`` in lesson 03's results: where its checkpoints went)
# names neither, so it may stay.
MACHINE_PATH = re.compile(r"(?<![\w.~])(/root/|/home/\w|/Users/\w|[A-Za-z]:\\\\Users\\\\"
                          r"|/[^\s\"']*?/\.?venv/|/[^\s\"']*?/(site|dist)-packages/)")


def test_no_committed_cast_or_results_file_names_a_machines_home_or_installation():
    files = [*(REPO / "videos").glob("*.cast"), *(REPO / "lessons").glob("*/*.json"),
             *(REPO / "benchmarks" / "results").rglob("*.json")]
    assert len(files) > 30
    for path in files:
        found = MACHINE_PATH.search(path.read_text())
        assert found is None, f"{path.relative_to(REPO)}: {found.group(0)!r}"
    assert MACHINE_PATH.search('"/work/main/.venv/lib/python3.11/site-packages/torch/x.py:478"')
    assert MACHINE_PATH.search('"C:\\\\Users\\\\ann\\\\fsdp"') and MACHINE_PATH.search("at /home/ann/fsdp")
    assert not MACHINE_PATH.search("results written to runs/01_auto_wrap/results.json")


def test_recordings_make_paths_relative():
    """What a recorded line names on this machine (an installed package, the repository, the
    standard library, the home folder) is written relative, a venv inside the repository too."""
    import warnings

    import torch

    from utilities.course.catalog import REPO_ROOT
    from utilities.course.recording import relative_paths

    line = f"{torch.__file__}:478: UserWarning; {warnings.__file__}; {REPO_ROOT}/lessons/x.py"
    assert relative_paths(line) == "site-packages/torch/__init__.py:478: UserWarning; " \
        f"python{'.'.join(map(str, __import__('sys').version_info[:2]))}/warnings.py; lessons/x.py"
    roots = [("/work/main/.venv/lib/python3.11/site-packages/", "site-packages/"), ("/work/main/", "")]
    assert relative_paths("/work/main/.venv/lib/python3.11/site-packages/torch/a.py and "
                          "/work/main/lessons/b.py", roots) == "site-packages/torch/a.py and lessons/b.py"
    assert MACHINE_PATH.search(relative_paths(f"{__import__('pathlib').Path.home()}/x/.venv/bin")) is None
