"""Planner speed: how long `fsdp-course plan` makes an engineer wait, timed from a shell the way
they run it (a fresh `python -m utilities plan ...` process each time, imports included, memory
and step time both): a llama-8b plan (8 GPUs, bf16, op-level selective AC, batch 2 x 8192), the
largest batch that fits (`--max-batch`) and a sweep of 6 GPU counts x 3 strategies (`--sweep`).
Wall-clock seconds of each command, beside the goal, the machine's cores and its load average
when the command started (other work on the machine slows it). `--tiny`: llama-tiny, for the tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import base_parser, cpu_name, metadata, output_path, pick_device, save

NAME = "planner_speed"
REPO = Path(__file__).resolve().parents[1]
README = REPO / "benchmarks" / "README.md"
README_BLOCK = re.compile(r"(<!-- planner-speed:start -->\n)(.*?)(<!-- planner-speed:end -->)", re.S)
GOALS_S = {"plan": 6.0, "max_batch": 10.0, "sweep": 10.0}  # what a user should wait, at most
EXTRA = {"plan": [], "max_batch": ["--max-batch"], "sweep": ["--sweep"]}


def command(what: str, model: str, seq: int) -> list[str]:
    """The `fsdp-course plan` command line for one measurement (as `python -m utilities`)."""
    return ["plan", "--model", model, "--gpus", "8", "--batch", "2", "--seq", str(seq), "--ac",
            "selective", "--gpu-memory", "80GiB", *EXTRA[what]]


def timed(args: list[str]) -> dict:
    """One command in a fresh process: its wall seconds and the 1-minute load average before."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "utilities", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    seconds = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"`fsdp-course {' '.join(args)}` failed: {done.stderr.strip()[-400:]}")
    return {"s": round(seconds, 2), "load_before": None if load is None else round(load, 2)}


def render(data: dict) -> str:
    """The README's lines about the planner's speed, from the result file (never typed by hand)."""
    m = data["machine"]
    rows = "".join(
        f"| `{' '.join(['fsdp-course', *command(what, data['model'], data['config']['seq'])])}` | "
        f"{r['s']} | {GOALS_S[what]:g} | {r['load_before']} |\n" for what, r in data["runs"].items())
    return (f"_Rendered from `results/planner_speed-cpu.json`: `python benchmarks/planner_speed.py` on "
            f"{m['cpu']} ({m['cores']} cores; {data['date'][:10]}, torch {data['torch']}); each "
            f"command a fresh process, imports included, memory and step time._\n\n"
            f"| command | seconds | goal | load before |\n|---|---|---|---|\n" + rows)


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
    args = parse_args(argv)
    device = pick_device(args.device)
    model = args.model or ("llama-tiny" if args.tiny else "llama-8b")
    seq = 64 if args.tiny else 8192
    data = metadata(NAME, device, args)
    data.update(model=model, config=dict(strategy="full_shard", precision="bf16", ac="selective",
                                         seq=seq, gpus=8, batch=2, gpu_memory="80GiB"),
                machine={"cpu": cpu_name(), "cores": os.cpu_count()}, goals_s=GOALS_S)
    if not args.tiny:  # files into the OS cache first (--tiny only checks that the commands run)
        timed(["plan", "--model", "llama-tiny", "--seq", "64", "--no-time"])
    data["runs"] = {what: timed(command(what, model, seq)) for what in GOALS_S}
    for what, r in data["runs"].items():
        print(f"{what}: {r['s']} s (goal {GOALS_S[what]:g} s; load average {r['load_before']} "
              f"on {data['machine']['cores']} cores)")
    path = save(data, output_path(NAME, device, args.out))
    if not args.tiny and not args.out and write_readme(data):
        print(f"{README.relative_to(REPO)}: planner speed re-rendered ({path.name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
