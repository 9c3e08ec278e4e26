"""Planner speed: how long `fsdp-course plan` takes on this machine for the three things engineers
ask of it. A llama-8b plan (8 GPUs, bf16, op-level selective AC, batch 2 x 8192), the largest batch
that fits (`--max-batch`: traced steps counted), and a sweep of 6 GPU counts x 3 strategies
(`--sweep`: traced steps counted; the others re-sharded by arithmetic, checked against a trace of
the largest count). Wall-clock seconds, one process, caches warm after the first plan (the first
plan's time, imports included, is reported apart). `--tiny`: llama-tiny, for the tests.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import base_parser, metadata, output_path, pick_device, save

NAME = "planner_speed"
REPO = Path(__file__).resolve().parents[1]
README = REPO / "benchmarks" / "README.md"
README_BLOCK = re.compile(r"(<!-- planner-speed:start -->\n)(.*?)(<!-- planner-speed:end -->)", re.S)


def render(data: dict) -> str:
    """The README's lines about the planner's speed, from the result file (never typed by hand)."""
    c = data["config"]
    return (f"_Rendered from `results/planner_speed-cpu.json`: `python benchmarks/planner_speed.py` on "
            f"{data['device_name']} ({data['date'][:10]}, torch {data['torch']}), {data['model']}, "
            f"{c['strategy']}, {c['precision']}, AC {c['ac']}, batch {c['batch']} x {c['seq']}._\n\n"
            f"| what | seconds | traced steps |\n|---|---|---|\n"
            f"| one plan (memory) | {data['plan_s']} (first in the process {data['first_plan_s']}) | 1 |\n"
            f"| `--max-batch` (answer: batch {data['max_batch']['largest_batch']}) | "
            f"{data['max_batch']['s']} | {data['max_batch']['traced_steps']} |\n"
            f"| `--sweep`, {data['sweep']['configurations']} configurations | {data['sweep']['s']} | "
            f"{data['sweep']['traced_steps']} |\n")


def write_readme(data: dict) -> bool:
    text = README.read_text()
    new = README_BLOCK.sub(lambda m: m.group(1) + render(data) + m.group(3), text)
    if new != text:
        README.write_text(new)
    return new != text


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
    config = dict(config, device_type=device.type)

    traced = []
    real_plan = planner.plan

    def counted(*a, **k):
        traced.append(1)
        return real_plan(*a, **k)

    planner.plan = counted
    try:
        t = time.perf_counter()
        real_plan(model, 8, memory, batch=2, **config)
        data["first_plan_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        real_plan(model, 8, memory, batch=2, **config)
        data["plan_s"] = round(time.perf_counter() - t, 2)

        traced.clear()
        t = time.perf_counter()
        best, _ = planner.largest_batch(model, 8, memory, **config)
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
    path = save(data, output_path(NAME, device, args.out))
    if not args.tiny and not args.out and write_readme(data):
        print(f"{README.relative_to(REPO)}: planner speed re-rendered ({path.name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
