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
