"""What a process that ends soon does with Python's garbage collector: the launcher, torchrun's
process, each rank and a notebook kernel skip the final collections that would walk every object
torch and transformers made. Below ``launch`` and ``torchrun``, which both use it."""

from __future__ import annotations

import gc
import os


def skip_final_collections() -> None:
    """For a process that will end soon: freeze what lives now. At exit Python's final garbage
    collections walk every object torch and transformers made: 1.5-2.5 s per process on a 2-core
    machine (measured), paid by every launcher, rank and notebook kernel. Frozen objects are
    skipped, and a process that is ending needs none of them collected."""
    gc.freeze()


def freeze_what_lives_until_exit() -> None:
    """In a rank that torchrun started, move every object alive now (torch, transformers, the
    process group: ~350K objects) out of the garbage collector's sight. Each variant's release
    collects and scans what the collector sees (``utilities.course.release.VariantScope``): ~0.45
    s per variant and rank over all of them, a few ms over what the variant made; and the rank's
    exit skips them too (see ``skip_final_collections``). Collected first, so no garbage is kept.
    A notebook kernel or a test process (no ``TORCHELASTIC_RUN_ID``) is left as it is."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        gc.collect()
        gc.freeze()


def end_rank_now() -> None:
    """In a rank torchrun started, once its lesson has written and printed everything and left
    the process group: end the process here, output flushed, without the interpreter's
    shutdown. That shutdown destroys what is left of the process group's C++ threads, and a rank
    that exits that way can still die of SIGABRT ("terminate called without an active
    exception") after a complete run, which torchrun reports as a failed lesson. A notebook
    kernel or a test process (no ``TORCHELASTIC_RUN_ID``) returns as usual."""
    import sys

    if os.environ.get("TORCHELASTIC_RUN_ID"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
