"""``python -m utilities.course.torchrun ARGS`` is ``torchrun ARGS``: torch.distributed.run's own
``main``, unchanged, in a process that skips Python's final collections when it ends
(``skip_final_collections``; ~1 s of exit otherwise, after the ranks are done). The command a lesson
run prints is the ``torchrun ...`` line a user types; this is how ``fsdp-course run`` starts it."""

from __future__ import annotations

from torch.distributed.run import main

from utilities.course.lesson import skip_final_collections

if __name__ == "__main__":
    skip_final_collections()
    main()
