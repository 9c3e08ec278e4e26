"""Run the benchmarks in order (end_to_end, layer, memory_maximizer, planner_check), then
regenerate benchmarks/README.md's table (report.py).

Each benchmark runs as its own process (a failure is reported and the next one still runs) and writes
<results-dir>/<name>-<device>.json. planner_check comes last: it reads the others' files.

    python benchmarks/run_all.py             # on a GPU host: the full-size benchmarks
    python benchmarks/run_all.py --tiny      # on CPU: seconds-sized versions (what the tests run)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, RESULTS_DIR, device_slug, pick_device

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("end_to_end", "layer", "memory_maximizer", "planner_check")
WORK_DIR_USERS = ("end_to_end", "memory_maximizer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="pass --tiny to every benchmark (CPU test size)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="passed to every benchmark (default auto: cuda when visible)")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, default=None, metavar="NAME",
                   help=f"run only these, still in the fixed order (choices: {' '.join(BENCHMARKS)})")
    p.add_argument("--results-dir", default=str(RESULTS_DIR),
                   help="where the JSON files go (default benchmarks/results)")
    p.add_argument("--work-dir", default=str(REPO / "runs" / "benchmarks"),
                   help="where the lesson runs go (default runs/benchmarks)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate benchmarks/README.md")
    return p.parse_args(argv)


def benchmark_argv(name: str, args: argparse.Namespace, slug: str) -> list[str]:
    """The flags run_all gives benchmark ``name`` (the tests call its main() with the same)."""
    results = Path(args.results_dir)
    argv = ["--device", args.device, "--out", str(results / f"{name}-{slug}.json")]
    if args.tiny:
        argv.append("--tiny")
    if name in WORK_DIR_USERS:
        argv += ["--work-dir", str(Path(args.work_dir) / name)]
    if name == "planner_check":
        argv += ["--results-dir", str(results)]
    return argv


def main(argv=None) -> int:
    args = parse_args(argv)
    slug = device_slug(pick_device(args.device))
    results = Path(args.results_dir)
    failed = []
    for name in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        cmd = [sys.executable, str(HERE / f"{name}.py"), *benchmark_argv(name, args, slug)]
        print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.call(cmd, cwd=REPO) != 0:
            failed.append(name)
    if not args.no_report:
        subprocess.call([sys.executable, str(HERE / "report.py"), "--results-dir", str(results)], cwd=REPO)
    if failed:
        print(f"failed: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
