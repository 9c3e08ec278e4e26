"""``python -m utilities.course.torchrun ARGS`` is ``torchrun ARGS``: torch.distributed.run's own
``main``, unchanged, in a process that skips Python's final collections when it ends
(``skip_final_collections``; ~1 s of exit otherwise, after the ranks are done), and that answers a
failed rank with torchrun's table alone, not our frames above it. The command a lesson run prints is
the ``torchrun ...`` line a user types; this is how ``fsdp-course run`` starts it."""

from __future__ import annotations

import sys
from typing import NoReturn

from utilities.course.lesson import skip_final_collections


def run(argv: list[str]) -> NoReturn:
    """torchrun on ``argv``, then exit: 0, or 1 after printing which ranks failed and how."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    skip_final_collections()
    try:
        main(argv)
    except ChildFailedError as e:
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    raise SystemExit(0)


if __name__ == "__main__":
    run(sys.argv[1:])
