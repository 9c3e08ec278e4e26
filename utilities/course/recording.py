"""Terminal recordings of real lesson runs, as asciinema v2 ``.cast`` files.

``fsdp-course record NN`` runs ``fsdp-course run NN`` for real and records what it printed, with
the real timing, so the course's demos never drift from what the code does. Paths are recorded
relative (``relative_paths``): a cast shows no machine's folders or user name. Play one with
``asciinema play videos/01_auto_wrap.cast`` or embed it with asciinema-player.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from utilities.course.catalog import REPO_ROOT, LessonInfo
from utilities.safe_files import check_output_file, open_output


def machine_roots() -> list[tuple[str, str]]:
    """This machine's absolute folders a recorded line may name, each with what it becomes:
    installed packages' folders ``site-packages/``, the repository's root nothing (paths relative
    to it, as the lessons run from it), the standard library ``python3.X/``, the home folder ``~/``.
    Longest first, so a virtual environment inside the repository reads ``site-packages/...``."""
    packages = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                *site.getsitepackages(), site.getusersitepackages()}
    roots = {f"{p}/": "site-packages/" for p in packages if p}
    roots[f"{sysconfig.get_paths()['stdlib']}/"] = f"python{sys.version_info[0]}.{sys.version_info[1]}/"
    roots[f"{REPO_ROOT}/"] = ""
    roots[f"{Path.home()}/"] = "~/"
    return sorted(roots.items(), key=lambda item: -len(item[0]))


def relative_paths(line: str, roots: list[tuple[str, str]] | None = None) -> str:
    """``line`` with each of this machine's absolute folders (``machine_roots``) made relative."""
    for root, relative in roots if roots is not None else machine_roots():
        line = line.replace(root, relative)
    return line


def record(info: LessonInfo, cast_path: Path, run_args: list[str], width: int = 120,
           height: int = 40) -> int:
    """Run the lesson through the CLI and write its output as an asciinema v2 recording."""
    roots = machine_roots()
    shown = relative_paths("fsdp-course run " + " ".join([info.number, *run_args]), roots)
    cmd = [sys.executable, "-m", "utilities", "run", info.number, *run_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS=str(width))
    cast_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cast_path.with_name(f".{cast_path.name}.tmp")
    start = time.monotonic()
    header = {"version": 2, "width": width, "height": height, "timestamp": int(time.time()),
              "title": f"lesson {info.number}: {info.title}", "command": shown,
              "env": {"SHELL": "/bin/bash", "TERM": "xterm-256color"}}
    check_output_file(cast_path, "record --out: recording")
    with open_output(tmp, "record --out: recording") as f:
        f.write(json.dumps(header) + "\n")
        f.write(json.dumps([0.0, "o", f"$ {shown}\r\n"]) + "\n")
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            f.write(json.dumps([round(time.monotonic() - start, 3), "o",
                                relative_paths(line.rstrip("\n"), roots) + "\r\n"]) + "\n")
        rc = proc.wait()
        f.write(json.dumps([round(time.monotonic() - start, 3), "o", f"[exit {rc}]\r\n"]) + "\n")
    if rc == 0:
        os.replace(tmp, cast_path)
    else:
        tmp.unlink(missing_ok=True)
    return rc
