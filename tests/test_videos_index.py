"""videos_index.md: a row per classic lesson, and every link points to a file or a well-formed URL."""

from __future__ import annotations

import re
from urllib.parse import urlparse

from conftest import REPO

from utilities.catalog import LESSONS

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
