"""Two real CPU ranks (gloo) for the scripts that hold a fake step to a real one
(``tp_plan_run.py``, ``cp_plan_run.py``, ``your_code_run.py``): each rank runs the script's
``measure(*args)``, and rank 0 writes what it returns to a JSON file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port


def _rank(rank: int, world: int, port: int, out: str, measure: Callable[..., dict], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        result = measure(*args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def on_two_ranks(out: str, measure: Callable[..., dict], *args) -> None:
    """``measure(*args)`` on two gloo ranks (``measure``: a module-level function of the script,
    which each spawned rank imports); rank 0's result in ``out``."""
    mp.spawn(_rank, args=(2, free_port(), out, measure, args), nprocs=2, join=True)
