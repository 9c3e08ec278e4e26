"""bf16 parameters with gradient accumulation, measured: the steps planner_check holds the plan to.

A real FSDP2 training step on 2 CPU ranks (gloo) of a course model stored in bf16 (no fp32
master: ``--param-dtype bf16``, FSDP2's param dtype bf16), ``--grad-accum`` micro-batches per
optimizer step, with the gradients reduce-scattered after every micro-batch (``every``) or only
after the last (``last``: ``set_requires_gradient_sync(False)`` before it), and the reduction in
bf16 or in fp32 (FSDP2's ``reduce_dtype``; fp32 is torchtitan's default). The peak of the second
step (AdamW's state in place) is measured as lesson 10's CPU rows are, by the lessons'
``MemoryProbe`` (FSDPMemTracker), the trackers' peak reset between micro-batches as the planner's
is. planner_check.py plans each configuration (``plan(..., options=...)``) against it.

What it found: with ``last`` and an fp32 reduction FSDP2 upcasts each unit's unsharded bf16
gradients to fp32 after the first micro-batch and accumulates them there
(``FSDPParam.unsharded_accumulated_grad``) until the last one's reduce-scatter: twice the bf16
gradients a bf16 reduction holds. A planner that could only say "bf16" (a bf16 reduction) planned
those steps 12% under; ``--reduce-dtype fp32`` plans them to the byte.

    python benchmarks/planner_check_accum.py      # about a minute on 2 cores
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import base_parser, metadata, output_path, pick_device, save  # noqa: E402

NAME = "planner_check_accum"
MODEL, BATCH, SEQ, GRAD_ACCUM, WORLD = "llama-tiny", 4, 64, 4, 2
# (accum_sync, reduce_dtype): each with the parameters stored in bf16
CONFIGS = (("every", "bf16"), ("last", "bf16"), ("every", "fp32"), ("last", "fp32"))


def options_of(accum_sync: str, reduce_dtype: str) -> dict:
    """The plan's options for one configuration (``PlanOptions`` fields)."""
    return {"param_dtype": "bf16", "grad_accum": GRAD_ACCUM, "accum_sync": accum_sync,
            "reduce_dtype": reduce_dtype}


def config_name(accum_sync: str, reduce_dtype: str) -> str:
    return f"bf16-params-accum{GRAD_ACCUM}-sync-{accum_sync}-reduce-{reduce_dtype}"


def measured_peak(model_name: str, batch: int, seq: int, options: dict) -> dict:
    """One rank's tracked peak of the second of two accumulated steps of ``model_name``."""
    from torch.distributed.device_mesh import init_device_mesh

    from utilities.measure.fake_step import fake_batch
    from utilities.measure.memory import MemoryProbe
    from utilities.measure.plan_options import (
        accumulate,
        apply_to_model,
        as_options,
        policy_name,
        shard_kwargs,
    )
    from utilities.models import get_model_spec
    from utilities.parallelize import parallelize_model
    from utilities.precision import fsdp2_policy

    o = as_options(options)
    spec = get_model_spec(model_name)
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    block = spec.block_class()
    apply_to_model(model, [m for m in model.modules() if isinstance(m, block)], o)
    parallelize_model(model, block_class=block, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                      mp_policy=fsdp2_policy(policy_name("bf16", o)), **shard_kwargs(o, "full_shard"))
    data = fake_batch(spec, batch, seq, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for tracked in (False, True):
        with (MemoryProbe(model, optimizer, torch.device("cpu")) if tracked
              else contextlib.nullcontext()) as probe:
            optimizer.zero_grad(set_to_none=True)
            accumulate(model, data, o, o.grad_accum, probe.next_iteration if tracked else None)
            optimizer.step()
    return probe.peak


def _rank(rank: int, port: int, out: list, configs: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        peaks = [measured_peak(MODEL, BATCH, SEQ, options_of(*c)) for c in configs]
        if rank == 0:
            out.extend(peaks)
    finally:
        dist.destroy_process_group()


def measure(configs: tuple = CONFIGS) -> list[dict]:
    """Rank 0's peak for each configuration, measured on ``WORLD`` gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.list()
        mp.spawn(_rank, args=(port, out, configs), nprocs=WORLD, join=True)
        return list(out)


def parse_args(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--configs", type=int, default=None,
                   help=f"measure only the first N of the {len(CONFIGS)} configurations (default all; "
                        "2 with --tiny)")
    args = p.parse_args(argv)
    if args.tiny and args.configs is None:
        args.configs = 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device("cpu")
    data = metadata(NAME, device, args)
    configs = CONFIGS[: args.configs] if args.configs else CONFIGS
    t0 = time.perf_counter()
    peaks = measure(configs)
    data.update(model={"name": MODEL}, world_size=WORLD, batch_size=BATCH, seq_len=SEQ,
                precision="bf16", ac="none", seconds=round(time.perf_counter() - t0, 1),
                method="MemoryProbe (FSDPMemTracker), the second step, reset between micro-batches")
    data["runs"] = [{"config": config_name(*c), "options": options_of(*c), "status": "ok",
                     "peak_bytes": peak["total"], "peak_detail": peak} for c, peak in zip(configs, peaks)]
    for r in data["runs"]:
        print(f"{r['config']}: {r['peak_bytes'] / 2**20:,.2f} MiB", flush=True)
    save(data, output_path(NAME, device, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
