"""How ``fsdp-course run`` starts a lesson script.

A lesson script knows nothing of this module: it parses its flags (``parse_args``) and runs. The
launcher checks those flags before any rank starts by importing the script as a module and calling
its ``parse_args`` (every check, including those a script makes after argparse), then either stops
or, in the same process, becomes torchrun on the script::

    python -m utilities.course.launch SCRIPT ARGS     # parse ARGS as SCRIPT would, then stop
    FSDP_COURSE_LAUNCH='{"torchrun": [...], "header": [...]}' python -m utilities.course.launch SCRIPT ARGS
                                                      # ... then print the header, become torchrun

A bad flag ends it with the script's one line and exit 2, before any rank starts. The check and
torchrun are one process importing torch once (about 2.5 s on a laptop core), not two.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from utilities.course.gc_at_exit import skip_final_collections

# set by the CLI for a launcher that, its flags accepted, becomes torchrun: the torchrun arguments
# and the lines to print first (JSON)
LAUNCH_ENV = "FSDP_COURSE_LAUNCH"

_checking_flags = False  # a launcher (or parse_flags_here) is parsing a script's flags


def checking_flags() -> bool:
    """Whether flags are being parsed for a launcher, not by a rank about to run: a check that
    belongs to the ranks (is a GPU there?) is left to them and to the launcher's own."""
    return _checking_flags


@contextlib.contextmanager
def _parsing_for_the_launcher() -> Iterator[None]:
    global _checking_flags
    before, _checking_flags = _checking_flags, True
    try:
        yield
    finally:
        _checking_flags = before


def load_script(path: str | os.PathLike) -> ModuleType:
    """A lesson script imported as a module (its folder on ``sys.path`` for the helpers beside it),
    not run: its ``if __name__ == "__main__"`` block does not start."""
    path = Path(path).resolve()
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_launched_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_flags_here(parse_args: Callable[[list[str]], Any], argv: list[str]) -> tuple[int, str, str]:
    """Run a lesson's ``parse_args`` on ``argv`` in this process, as the launcher does (the device
    is left to the launcher); returns the exit code (0 when the flags parse), what it printed and
    what it printed as an error."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with (_parsing_for_the_launcher(), contextlib.redirect_stdout(out),
              contextlib.redirect_stderr(err)):
            parse_args(argv)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return code, out.getvalue(), err.getvalue()


def main(argv: list[str]) -> NoReturn:
    """``python -m utilities.course.launch SCRIPT ARGS``: check ARGS with SCRIPT's ``parse_args``
    (a bad one: its one line, exit 2; ``--help``: the help, exit 0); then stop with 0, or, when
    ``LAUNCH_ENV`` is set, print its header lines and run torchrun on ``SCRIPT ARGS`` here. The
    ranks are fresh processes: they run the script itself, without ``LAUNCH_ENV``."""
    script, args = argv[0], argv[1:]
    module = load_script(script)
    skip_final_collections()  # whatever happens next, this process ends soon
    with _parsing_for_the_launcher():
        module.parse_args(args)
    request = os.environ.pop(LAUNCH_ENV, None)
    if request is None:
        raise SystemExit(0)
    plan = json.loads(request)
    for line in plan["header"]:
        print(line, flush=True)
    from utilities.course.torchrun import run

    run([*plan["torchrun"], script, *args])


if __name__ == "__main__":  # through the module lesson.py imports, not this __main__ copy of it
    from utilities.course import launch

    launch.main(sys.argv[1:])
