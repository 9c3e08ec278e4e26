"""A real 2-rank CPU run (gloo) of a user's model and sharding function (``tests/your_gpt.py``), one
training step measured by the lessons' MemoryProbe with AdamW's state in place, as ``plan`` traces
it: what tests/test_plan_your_code.py holds ``plan(model=build, parallelize=shard)`` to.

    python tests/your_code_run.py OUT.json BATCH SEQ
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gloo_ranks import on_two_ranks  # noqa: E402 (this script runs from tests/, beside it)


def step_peak(batch: int, seq: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from your_gpt import build, shard

    from utilities.measure.memory import MemoryProbe

    torch.manual_seed(0)
    model = build()
    shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ids = torch.randint(0, 256, (batch, seq))
    with MemoryProbe(model, opt, torch.device("cpu")) as probe:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids.clone()).backward()
        opt.step()
    return {k: int(probe.peak[k]) for k in ("total", "parameters", "gradients", "optimizer",
                                             "activations")}


def main(argv: list[str]) -> None:
    on_two_ranks(argv[0], step_peak, int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
