"""What a lesson notebook needs around the lesson's own code: its paths, a one-process world for
trying the FSDP calls in a cell, and the multi-rank run with flags the learner changes.

    nb = notebook("01")                      # repo and lesson folder importable, output folder
    from auto_wrap import wrap_fsdp2          # the lesson's own functions: one source of truth
    show(wrap_fsdp2)                         # their code, in the notebook
    with world1():                           # a gloo world of 1 in this kernel: try them
        ...
    results = nb.run("--variants", "fsdp2-per-block")   # 2 CPU ranks (or the GPUs), results.json

A notebook's runs go to ``runs/notebooks/NN_topic`` (or ``$FSDP_COURSE_RUNS/NN_topic``), never
over a full run's ``runs/NN_topic/results.json``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utilities.course.catalog import REPO_ROOT, LessonInfo, get_lesson

_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class LessonNotebook:
    info: LessonInfo
    out: Path
    quick: bool

    def run(self, *flags: str, nproc: int | None = None, quick: bool | None = None,
            tail: int = 40) -> dict[str, Any]:
        """Run the lesson on several ranks with the lesson ``flags``, as ``fsdp-course run NN``
        does (the same checks, the same torchrun command), show the end of its output, and return
        its results.json. The flags are parsed here first by the lesson's own parser, the module
        this notebook imported: a bad one fails at once, in one line. Raises if the run fails."""
        from utilities.course.cli import decide_launch, prepare_launch
        from utilities.devices import resolve_device
        from utilities.results import load

        if "-h" in flags or "--help" in flags:  # as the command does: the help, and no run
            from utilities.course.launch import parse_flags_here

            print(parse_flags_here(self._lesson_module().parse_args, list(flags))[1])
            return {}
        quick = self.quick if quick is None else quick
        device = resolve_device("auto")
        nproc = decide_launch(self.info, device, nproc).nproc
        launch = prepare_launch(self.info, device, nproc, self.out, quick, None, list(flags),
                                check_flags=self._check_flags)
        env = {k: v for k, v in launch.env.items() if k not in _RENDEZVOUS}  # world1() may set them
        proc = subprocess.run(launch.cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        print("\n".join([*launch.header, *proc.stdout.splitlines()[-tail:]]))  # the command first
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise RuntimeError(f"lesson {self.info.number} failed with exit code {proc.returncode}")
        return load(self.out)

    def _lesson_module(self):
        """The lesson script as this notebook imported it (its folder is on ``sys.path``)."""
        return importlib.import_module(self.info.script_path.stem)

    def _check_flags(self, argv: list[str]) -> None:
        """The lesson script's ``parse_args`` on ``argv``, in this kernel (what the launcher runs
        in a child process); a bad flag raises ``UsageError`` with the parser's one line."""
        from utilities.course.launch import parse_flags_here
        from utilities.errors import UsageError

        code, _, err = parse_flags_here(self._lesson_module().parse_args, argv)
        if code:
            raise UsageError(err.strip().removeprefix("error: "))


_EXIT_HOOKED = False  # skip_final_collections registered in this kernel


def notebook(number: str) -> LessonNotebook:
    """Make the repo and the lesson's folder importable and pick the output folder; quick (2 CPU
    ranks, tiny model) unless a GPU is visible."""
    import torch

    from utilities.course.gc_at_exit import skip_final_collections

    global _EXIT_HOOKED
    if "ipykernel" in sys.modules and not _EXIT_HOOKED:
        atexit.register(skip_final_collections)  # the kernel's shutdown: ~2.5 s -> ~0.4 s
        _EXIT_HOOKED = True
    info = get_lesson(number)
    for path in (str(REPO_ROOT), str(info.path)):
        if path not in sys.path:
            sys.path.insert(0, path)
    base = Path(os.environ.get("FSDP_COURSE_RUNS", REPO_ROOT / "runs" / "notebooks"))
    nb = LessonNotebook(info, base / info.folder, quick=not torch.cuda.is_available())
    print(f"lesson {number}: code in {info.path}, runs written to {nb.out}, quick: {nb.quick}")
    return nb


def show(*functions: Callable[..., Any]) -> None:
    """Print the source of the lesson's functions, so the notebook shows the code it runs."""
    for fn in functions:
        print(inspect.getsource(fn))


@contextlib.contextmanager
def world1(device: str = "cpu") -> Iterator[Any]:
    """A process group of one rank in this kernel, so a cell can call ``fully_shard``, ``FSDP`` or
    ``dcp.save`` as a training script would (nothing is sharded or communicated at world size 1)."""
    from utilities.distributed import quiet_torch_internal_warnings, setup, teardown

    saved = {k: os.environ.get(k) for k in _RENDEZVOUS}
    try:
        quiet_torch_internal_warnings()  # the same narrow filters as a lesson run
        yield setup(device)
    finally:
        teardown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
