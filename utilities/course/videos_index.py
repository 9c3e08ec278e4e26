"""videos_index.md, generated: one row per lesson from the catalog, the original walkthroughs
(videos/original_videos.tsv), each notebook's chapters (its "## " headings) and the course's own
recorded demo (videos/NN_topic.cast, made by ``fsdp-course record``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from utilities.course.catalog import LESSONS, REPO_ROOT

VIDEOS = REPO_ROOT / "videos"
HEADER = """# Videos index

One row per lesson: the original walkthrough of the topic from the classic FSDP series (Loom, and
the public YouTube copy where known), this course's own demo (a terminal recording of
`fsdp-course run NN --quick` made by `fsdp-course record NN`: play it with
`asciinema play videos/NN_topic.cast`), the lesson's notebook and its chapters, and the command an
instructor runs live. The classic videos teach FSDP1 with 2022-era code; each lesson's README says
what has changed since. Regenerate this file with `fsdp-course record all` (or
`python -m utilities.course.videos_index` to rebuild the table alone).

| # | lesson | original walkthrough | course demo | notebook | chapters | live demo |
|---|---|---|---|---|---|---|
"""


def originals() -> dict[str, dict[str, str]]:
    path = VIDEOS / "original_videos.tsv"
    with path.open() as f:
        return {row["lesson"]: row for row in csv.DictReader(f, delimiter="\t")}


def chapters(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    heads = []
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        for line in "".join(cell["source"]).splitlines():
            if line.startswith("## "):
                heads.append(line[3:].strip().replace("|", "/"))
    return heads


def render() -> str:
    orig = originals()
    rows = []
    for num, info in LESSONS.items():
        o = orig.get(num, {})
        links = []
        if o.get("video"):
            links.append(f"[Loom]({o['video']})")
        if o.get("youtube"):
            links.append(f"[YouTube]({o['youtube']})")
        if o.get("paper"):
            links.append(f"[paper]({o['paper']})")
        cast = VIDEOS / f"{info.folder}.cast"
        demo = f"[{cast.name}](videos/{cast.name})" if cast.is_file() else "not recorded yet"
        if info.notebook.is_file():
            nb = f"[{info.notebook.name}](lessons/{info.folder}/{info.notebook.name})"
            chap = "; ".join(chapters(info.notebook)) or "-"
        else:
            nb, chap = "not yet written", "-"
        rows.append(f"| {num} | {info.title} | {', '.join(links) or 'none (new in this course)'} | "
                    f"{demo} | {nb} | {chap} | `fsdp-course run {num}` |")
    return HEADER + "\n".join(rows) + "\n"


def write() -> Path:
    path = REPO_ROOT / "videos_index.md"
    path.write_text(render())
    return path


if __name__ == "__main__":
    print(write())
