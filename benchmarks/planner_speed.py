"""Planner speed: how long `fsdp-course plan` takes on this machine for the three things engineers
ask of it. A llama-8b plan (8 GPUs, bf16, op-level selective AC, batch 2 x 8192), the largest batch
that fits (`--max-batch`: traced steps counted), and a sweep of 6 GPU counts x 3 strategies
(`--sweep`: traced steps counted; the others re-sharded by arithmetic, checked against a trace of
the largest count). Wall-clock seconds, one process, caches warm after the first plan (the first
plan's time, imports included, is reported apart). `--tiny`: llama-tiny, for the tests.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import base_parser, metadata, output_path, pick_device, save

NAME = "planner_speed"


def parse_args(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--model", default=None, help="model to plan (default llama-8b; llama-tiny with --tiny)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import utilities.measure.planner as planner

    args = parse_args(argv)
    device = pick_device(args.device)
    model = args.model or ("llama-tiny" if args.tiny else "llama-8b")
    seq = 64 if args.tiny else 8192
    memory = planner.parse_memory("80GiB")
    config = dict(strategy="full_shard", precision="bf16", ac="selective", seq=seq)
    data = metadata(NAME, device, args)
    data.update(model=model, config=dict(config, gpus=8, batch=2, gpu_memory="80GiB"))

    traced = []
    real_plan = planner.plan

    def counted(*a, **k):
        traced.append(1)
        return real_plan(*a, **k)

    planner.plan = counted
    try:
        t = time.perf_counter()
        real_plan(model, 8, memory, batch=2, device_type=device.type, **config)
        data["first_plan_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        real_plan(model, 8, memory, batch=2, device_type=device.type, **config)
        data["plan_s"] = round(time.perf_counter() - t, 2)

        traced.clear()
        t = time.perf_counter()
        best, _ = planner.largest_batch(model, 8, memory, device_type=device.type, **config)
        data["max_batch"] = {"s": round(time.perf_counter() - t, 2), "traced_steps": len(traced),
                             "largest_batch": best}

        traced.clear()
        t = time.perf_counter()
        plans = planner.sweep(model, gpu_memory_bytes=memory, precision="bf16", ac="selective",
                              batch=2, seq=seq, device_type=device.type)
        data["sweep"] = {"s": round(time.perf_counter() - t, 2), "traced_steps": len(traced),
                         "configurations": len(plans), "methods": sorted({p.method for p in plans})}
    finally:
        planner.plan = real_plan
    print(f"{model}: plan {data['plan_s']} s (first {data['first_plan_s']} s); --max-batch "
          f"{data['max_batch']['s']} s in {data['max_batch']['traced_steps']} traced steps "
          f"(batch {data['max_batch']['largest_batch']}); sweep of {len(plans)} configurations "
          f"{data['sweep']['s']} s in {data['sweep']['traced_steps']} traced steps")
    save(data, output_path(NAME, device, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
