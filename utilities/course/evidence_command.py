"""``fsdp-course evidence``'s command: run a chunk of steps (``utilities.course.evidence``) and pack
the folder, or unpack an archive and re-render the tables (``utilities.course.evidence_archive``)."""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable, Iterable
from pathlib import Path

from utilities.course.evidence import (
    Manifest,
    Step,
    Versions,
    default_folder,
    describe_machine,
    format_plan,
    gpu_steps,
    minutes_value,
    ordered,
    plan_chunk,
    render_benchmarks,
    render_readmes,
    repo_relative,
    run_chunk,
    select,
)
from utilities.course.evidence_archive import pack, unpack
from utilities.errors import UsageError


def main(args: argparse.Namespace, gpu_available: Callable[[], bool] | None = None,
         steps: Iterable[Step] | None = None) -> int:
    if args.unpack:
        folder, taken = unpack(Path(args.unpack), Path(args.into) if args.into else None)
        changed = render_readmes(folder)
        said = render_benchmarks()
        print(f"merged {len(taken)} steps into {repo_relative(folder)}; lesson READMEs re-rendered: "
              f"{', '.join(changed) or 'none'}; {said}")
        return 0
    minutes = minutes_value(args.minutes)
    steps = select(list(steps) if steps is not None else gpu_steps(), args.only)
    if gpu_available is None:
        import torch

        gpu_available = torch.cuda.is_available
    has_gpu = gpu_available()
    machine = describe_machine() if has_gpu else {
        "device": "none", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    folder = Path(args.into) if args.into else default_folder(machine["device"] if has_gpu else None,
                                                             machine["date"])
    manifest = (Manifest.read(folder / "manifest.json") if folder is not None else None) or Manifest(
        folder=repo_relative(folder) if folder is not None else "")
    versions = Versions.of(steps)
    if args.redo:
        if not args.only:
            raise UsageError("--redo is not allowed without --only; allowed: --only STEP ... --redo")
        for step in steps:
            manifest.steps.pop(step.name, None)
    if args.plan:
        print(format_plan(steps, manifest, versions, minutes,
                          repo_relative(folder) if folder is not None else "none yet (no GPU here)"))
        return 0
    if not has_gpu:
        raise UsageError("fsdp-course evidence needs a CUDA GPU and none is visible here; "
                         "`fsdp-course evidence --plan` shows what it would run")
    chunk = plan_chunk(steps, manifest, versions, minutes)
    archive = Path(args.pack) if args.pack else None
    after = (lambda: pack(folder, archive)) if archive else (lambda: None)
    print(f"evidence into {repo_relative(folder)}: {len(chunk)} steps in at most {minutes:g} min on "
          f"{machine['device']}")
    ran = run_chunk(chunk, folder, manifest, versions, minutes, machine, after_step=after)
    if archive:
        size = pack(folder, archive)
        print(f"packed {repo_relative(folder)} into {archive} ({size / 2**20:.2f} MiB)")
    left = [s.name for s, due in ordered(steps, manifest, versions) if due.due]
    print(f"ran {len(ran)} steps; {len(left)} left for later chunks")
    failed = [n for n in ran if manifest.steps[n].status != "ok"]
    return 1 if failed else 0
