"""``python -m utilities.course.torchrun ARGS`` is ``torchrun ARGS``: torch.distributed.run's own
``main``, unchanged, in a process that skips Python's final collections when it ends
(``skip_final_collections``; ~1 s of exit otherwise, after the ranks are done), and that answers a
failed rank with torchrun's table alone, not our frames above it. The command a lesson run prints is
the ``torchrun ...`` line a user types; this is how ``fsdp-course run`` starts it."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import NoReturn

from utilities.course.gc_at_exit import skip_final_collections


def run(argv: list[str]) -> NoReturn:
    """torchrun on ``argv``, then exit: 0; or 2 when the first rank to fail exited 2 (the course's
    one-line error, which rank 0 has printed: ``utilities.distributed.exit_on_error``, a failed
    save, a damaged checkpoint) and the others exited 2 too or were stopped by torchrun; 1 after one
    line naming a rank killed by a signal (``kill -9``, the OOM killer; the others, whose
    collectives failed with it, end silently: ``utilities.distributed.quiet_when_a_rank_is_lost``);
    or 1 after printing which ranks failed and how. Interrupted (Ctrl-C, ``kill``): torchrun stops
    every rank, then one line says so, and the exit code is 128 + the signal (130 for Ctrl-C)."""
    import logging
    import signal

    from utilities.imports import collect_from_here, paused_collection

    with paused_collection():  # torch's imports (utilities.imports says why)
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main

        from utilities.distributed import LAUNCHER_NAMES_A_LOST_RANK, LAUNCHER_PRINTS_THE_ERROR

        collect_from_here()  # frozen: this process ends with its ranks (skip_final_collections)
    skip_final_collections()
    os.environ[LAUNCHER_NAMES_A_LOST_RANK] = "1"  # the ranks inherit it
    errors = tempfile.TemporaryDirectory(prefix="fsdp-course-errors-")
    os.environ[LAUNCHER_PRINTS_THE_ERROR] = errors.name
    # torchrun logs each failed rank, and the signal it sends the rest, as it sees them: held back
    # until the outcome is known, and printed unless it is the one line already printed
    held = _HeldBack("failed (exitcode:", "closing signal", "death signal")
    loggers = [logging.getLogger(f"torch.distributed.elastic.{name}")
               for name in ("multiprocessing.api", "agent.server.api")]
    for logger in loggers:
        logger.addFilter(held)
    usage_exit = False
    try:
        main(argv)
    except (SignalException, KeyboardInterrupt) as e:
        usage_exit = True  # what torchrun logged while stopping the ranks is not news
        number = getattr(e, "sigval", signal.SIGINT)
        print(f"error: interrupted by {signal.Signals(number).name}: every rank was stopped",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + int(number)) from None
    except ChildFailedError as e:
        killed = {rank: f for rank, f in e.failures.items()
                  if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}  # SIGTERM: torchrun's own
        if killed:
            usage_exit = True  # the one line below says what the held-back records would
            rank = min(killed, key=lambda r: (killed[r].timestamp, r))
            number = -killed[rank].exitcode
            name = signal.Signals(number).name if number in signal.valid_signals() else number
            print(f"error: rank {rank} (pid {killed[rank].pid}) was killed by {name}; torchrun "
                  "stopped the other ranks", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        failures = list(e.failures.values())
        first = min(failures, key=lambda f: f.timestamp)
        stopped = {2, -signal.SIGTERM, -signal.SIGKILL}
        usage_exit = first.exitcode == 2 and all(f.exitcode in stopped for f in failures)
        if usage_exit:
            line = _first_error_line(errors.name)
            if line:
                print(f"error: {line}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        held.release(loggers)
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if not usage_exit:
            held.release(loggers)
        errors.cleanup()
    raise SystemExit(0)


def _first_error_line(folder: str) -> str:
    """The one line the ranks that ended on an error left (``exit_on_error``), lowest rank first."""
    from pathlib import Path

    for path in sorted(Path(folder).glob("rank*.txt"), key=lambda p: int(p.stem[4:] or 0)):
        return path.read_text(errors="replace")[:2000]
    return ""


class _HeldBack:
    """A logging filter that keeps the records whose message contains one of ``texts``."""

    def __init__(self, *texts: str):
        self.texts, self.records = texts, []

    def filter(self, record) -> bool:
        if any(text in record.getMessage() for text in self.texts):
            self.records.append(record)
            return False
        return True

    def release(self, loggers) -> None:
        """Log what was kept, once, each record through its own logger."""
        import logging

        for logger in loggers:
            logger.removeFilter(self)
        records, self.records = self.records, []
        for record in records:
            logging.getLogger(record.name).handle(record)


if __name__ == "__main__":
    run(sys.argv[1:])
