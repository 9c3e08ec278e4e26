"""``fsdp-course``: list the lessons, run one (through torchrun), check the environment."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from .catalog import LESSONS, LessonInfo, get_lesson
from .distributed import DEVICES, resolve_device
from .errors import UsageError, bad_value
from .models import MODELS, get_model_spec


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(2, f"error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fsdp-course", description="The FSDP course: lessons, runs and checks.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    ls = sub.add_parser(
        "list", help="every lesson with its number, title and status",
        description="List the course's lessons (number, title, ready / not yet written, folder), "
                    "or with --models the named model configurations (parameters, block class), "
                    "all built from transformers configs with random weights: nothing is "
                    "downloaded.")
    ls.add_argument("--models", action="store_true", help="list the named models instead")

    run = sub.add_parser(
        "run", help="run a lesson through torchrun",
        description="Run lesson NN (or 'all') through torchrun on this machine: every GPU with "
                    "NCCL, else 2 CPU ranks with gloo and a tiny model. Flags after '--' go to the "
                    "lesson script (see `fsdp-course run NN -- --help`).",
        usage="fsdp-course run NN|all [--quick] [--nproc N] [--out DIR] [--device D] "
              "[--model M] [-- lesson flags]")
    run.add_argument("lesson", help="lesson number (01..14) or 'all'")
    run.add_argument("--quick", action="store_true", help="the small CPU-sized configuration")
    run.add_argument("--nproc", type=int, default=None,
                     help="processes (ranks) on this node; default: number of GPUs, or 2 on CPU")
    run.add_argument("--out", default=None, help="output directory (default runs/NN_topic)")
    run.add_argument("--device", default="auto", choices=DEVICES, help="force cpu or cuda")
    run.add_argument("--model", default=None, help="named model (fsdp-course list --models)")

    sub.add_parser(
        "check", help="torch / CUDA / NCCL versions, GPUs, bf16 readiness, lessons",
        description="Report this machine: torch, CUDA and NCCL versions; each GPU's name and "
                    "memory (through NVML where present); whether native bf16 is ready and, if "
                    "not, why; and which lessons can run here (and on what: GPUs or CPU ranks).")

    from .planner import add_plan_arguments

    add_plan_arguments(sub.add_parser(
        "plan", help="predict per-GPU peak memory by category for any model, strategy and size, "
                     "without the hardware",
        description="Predict the peak memory per GPU, by category (parameters, gradients, "
                    "optimizer state, activations), of one training step of a named model on N "
                    "GPUs, on this machine and without them: the model is built under "
                    "FakeTensorMode with a fake process group and the real FSDP2 step runs under "
                    "PyTorch's memory tracker. Says whether it fits (90% of --gpu-memory) and, "
                    "with --max-batch, the largest batch that does (lesson 14)."))

    rec = sub.add_parser(
        "record", help="record a real run of a lesson as an asciinema .cast (the course's demos)",
        usage="fsdp-course record NN|all [--out DIR] [--full] [-- lesson flags]")
    rec.add_argument("lesson", help="lesson number or 'all' (every ready lesson)")
    rec.add_argument("--out", default="videos", help="directory for the .cast files (default videos/)")
    rec.add_argument("--full", action="store_true",
                     help="record the full run instead of --quick (long on CPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lesson_flags: list[str] = []
    if "--" in argv:  # everything after "--" belongs to the lesson script
        cut = argv.index("--")
        argv, lesson_flags = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    args.lesson_args = lesson_flags
    try:
        if args.command == "list":
            return _list(args.models)
        if args.command == "check":
            from .env_report import format_report, report

            print(format_report(report()))
            return 0
        if args.command == "run":
            return _run(args)
        if args.command == "record":
            return _record(args)
        if args.command == "plan":
            from .planner import run_plan

            return run_plan(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _record(args: argparse.Namespace) -> int:
    from .recording import record

    if args.lesson == "all":
        infos = [i for i in LESSONS.values() if i.ready]
    else:
        infos = [get_lesson(args.lesson)]
        if not infos[0].ready:
            raise bad_value("lesson", args.lesson, f"{', '.join(n for n, i in LESSONS.items() if i.ready)}")
    rc = 0
    for info in infos:
        run_args = [] if args.full else ["--quick"]
        if args.lesson_args:
            run_args += ["--", *args.lesson_args]
        cast = Path(args.out) / f"{info.folder}.cast"
        code = record(info, cast, run_args)
        print(f"lesson {info.number}: {'recorded ' + str(cast) if code == 0 else f'failed (exit {code})'}")
        rc = rc or code
    from .videos_index import VIDEOS, write

    if Path(args.out).resolve() == VIDEOS.resolve():  # the course's own demos: refresh the index
        print(f"updated {write()}")
    return rc


def _list(models: bool) -> int:
    if models:
        for name, spec in MODELS.items():
            print(f"{name:12s} {spec.family:6s} {spec.num_parameters / 1e6:10,.1f}M parameters, "
                  f"blocks: {spec.block_class_name}")
        return 0
    for num, info in LESSONS.items():
        status = "ready" if info.ready else "not yet written"
        print(f"{num}  {info.title:55s} {status}")
    return 0


def _run(args: argparse.Namespace) -> int:
    flags = list(args.lesson_args)
    device = resolve_device(args.device)
    if args.model is not None:
        get_model_spec(args.model)
    nproc = _nproc(args.nproc, device)
    if args.lesson == "all":
        return _run_all(args, device, nproc, flags)
    info = get_lesson(args.lesson)
    if not info.ready:
        ready = [n for n, i in LESSONS.items() if i.ready]
        raise bad_value("lesson", args.lesson, f"{', '.join(ready)} (lesson {info.number} is "
                                               "not written yet)")
    out = Path(args.out or Path("runs") / info.folder)
    return launch(info, device, nproc, out, args.quick, args.model, flags)


def _nproc(nproc: int | None, device: str) -> int:
    import torch

    if device == "cuda":
        gpus = torch.cuda.device_count()
        if nproc is None:
            return gpus
        if not 1 <= nproc <= gpus:
            raise bad_value("--nproc", nproc, f"1..{gpus} (GPUs visible here)")
        return nproc
    if nproc is None:
        return 2
    if nproc < 1:
        raise bad_value("--nproc", nproc, "integers >= 1")
    return nproc


def _validate_lesson_flags(info: LessonInfo, argv: list[str]) -> None:
    """Parse the lesson's flags here first, so a bad one fails in one line before torchrun starts."""
    spec = importlib.util.spec_from_file_location(f"lesson_{info.number}", info.script_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "parse_args"):
        module.parse_args(argv)  # exits 2 with one line on a bad value


def lesson_command(info: LessonInfo, device: str, nproc: int, out: Path, quick: bool,
                   model: str | None, flags: list[str]) -> list[str]:
    """The torchrun command line that runs a lesson (also what the notebooks show)."""
    script_args = ["--device", device, "--out", str(out)]
    if quick:
        script_args.append("--quick")
    if model:
        script_args += ["--model", model]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(info.script_path), *script_args, *flags]


def launch(info: LessonInfo, device: str, nproc: int, out: Path, quick: bool,
           model: str | None, flags: list[str]) -> int:
    cmd = lesson_command(info, device, nproc, out, quick, model, flags)
    if "-h" in flags or "--help" in flags:
        return subprocess.call([sys.executable, str(info.script_path), *flags])
    _validate_lesson_flags(info, cmd[cmd.index(str(info.script_path)) + 1:])
    env = dict(os.environ)
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    script = str(info.script_path)
    shown = " ".join([os.path.relpath(script)] + cmd[cmd.index(script) + 1:])
    print(f"$ torchrun --standalone --nproc-per-node={nproc} {shown}", flush=True)
    return subprocess.call(cmd, env=env)


def _run_all(args, device: str, nproc: int, flags: list[str]) -> int:
    from .results import load

    summary = []
    failed = []
    base = Path(args.out or "runs")
    for num, info in LESSONS.items():
        if not info.ready:
            continue
        out = base / info.folder
        rc = launch(info, device, nproc, out, args.quick, args.model, flags)
        if rc != 0:
            failed.append(num)
            summary.append((num, info.title, "FAILED", "", ""))
            continue
        res = load(out)
        best = min((v for v in res["variants"] if v.get("step_time_s")),
                   key=lambda v: v["step_time_s"], default=None)
        summary.append((num, info.title, f"{len(res['variants'])} variants",
                        best["name"] if best else "-",
                        f"{best['step_time_s']:.4f}s" if best else "-"))
    print("\nlesson  title                                                 result       "
          "fastest variant (median step)")
    for num, title, status, best, t in summary:
        print(f"{num:7s} {title[:52]:53s} {status:12s} {best} {t}")
    summary_path = base / "summary.json"
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
