"""A real 2-rank CPU run (gloo) of one training step per planner option, measured by the lessons'
MemoryProbe (FSDPMemTracker on real tensors): what tests/test_plan_options.py holds
``plan(..., options=...)`` to. The options are applied by the planner's own functions
(``utilities.measure.plan_options``), the step is real: real storage, real collectives, a real
AdamW whose state exists before the measured step, as in ``plan``.

    python tests/plan_options_run.py OUT.json MODEL BATCH SEQ OPTIONS_JSON_LIST
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import free_port  # noqa: E402 (this script runs from tests/, beside conftest)


def step_peak(model_name: str, batch: int, seq: int, options: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from utilities.measure.memory import MemoryProbe
    from utilities.measure.plan_options import (
        accumulate,
        apply_to_model,
        as_options,
        policy_name,
        shard_kwargs,
        traced_micro_batches,
        trainable_parameters,
    )
    from utilities.models import get_model_spec
    from utilities.precision import fsdp2_policy

    o = as_options(options)
    spec = get_model_spec(model_name)
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    block = spec.block_class()
    blocks = [m for m in model.modules() if isinstance(m, block)]
    apply_to_model(model, blocks, o)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = dict(mesh=mesh, mp_policy=fsdp2_policy(policy_name("bf16", o)), **shard_kwargs(o, "full_shard"))
    for b in blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ids = torch.randint(0, spec.config().vocab_size, (batch, seq))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    with MemoryProbe(model, opt, torch.device("cpu")) as probe:
        opt.zero_grad(set_to_none=True)
        accumulate(model, data, o, traced_micro_batches(o), probe._tracker.reset_mod_stats)
        opt.step()
    peak = probe.peak
    return {k: int(peak[k]) for k in ("total", "parameters", "gradients", "optimizer", "activations")}


def worker(rank: int, world: int, port: int, out: str, model: str, batch: int, seq: int,
           configs: list[dict]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        rows = [dict(options=c, measured=step_peak(model, batch, seq, c)) for c in configs]
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    out, model, batch, seq, configs = argv[0], argv[1], int(argv[2]), int(argv[3]), json.loads(argv[4])
    port = free_port()
    mp.spawn(worker, args=(2, port, out, model, batch, seq, configs), nprocs=2, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
