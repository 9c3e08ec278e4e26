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
    """torchrun on ``argv``, then exit: 0; or 2 when every failed rank exited 2, the course's
    one-line error that rank 0 has printed already (``utilities.distributed.exit_on_error``: a
    failed save, a damaged checkpoint); or 1 after printing which ranks failed and how."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    skip_final_collections()
    # torchrun logs each failed rank as it sees it; a rank that exits 2 has said why in one line
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: "(exitcode: 2)" not in record.getMessage())
    try:
        main(argv)
    except ChildFailedError as e:
        if {failure.exitcode for failure in e.failures.values()} == {2}:
            raise SystemExit(2) from None
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    raise SystemExit(0)


if __name__ == "__main__":
    run(sys.argv[1:])
