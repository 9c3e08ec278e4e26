"""``fsdp-course``: list the lessons, run one (through torchrun), check the environment.

``run`` decides how many ranks to start and where before it starts any (``decide_launch``): on
CPU 2 gloo ranks; on CUDA one rank per GPU, except that a machine with one GPU runs a per-rank
memory lesson as 2 ranks sharing it (``LessonInfo.one_gpu_nproc``), and ``--nproc`` above the GPU
count makes the ranks share the GPUs (over gloo: NCCL refuses two ranks on one device). Ranks
that share a GPU are first planned (``check_fit``: the memory planner, with the GPU's free memory)
and refused in one line if they would not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from utilities.course.catalog import LESSONS, LessonInfo, get_lesson, run_defaults
from utilities.course.launch import LAUNCH_ENV
from utilities.devices import (
    BACKENDS,
    DEVICES,
    ranks_per_gpu,
    resolve_backend,
    resolve_device,
    shared_gpu_sentence,
)
from utilities.errors import OneLineParser, UsageError, bad_value
from utilities.models import MODELS, get_model_spec
from utilities.text import HelpFormatter


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="fsdp-course", description="The FSDP course: lessons, runs and checks.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

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
                     help="processes (ranks) on this node; default: number of GPUs (on one GPU: "
                          "2 sharing it for the per-rank memory lessons 01, 06, 11, 14), or 2 on "
                          "CPU; more than the GPUs: ranks share them over gloo")
    run.add_argument("--out", default=None, help="output directory (default runs/NN_topic)")
    run.add_argument("--device", default="auto", choices=DEVICES, help="force cpu or cuda")
    run.add_argument("--model", default=None, help="named model (fsdp-course list --models)")

    sub.add_parser(
        "check", help="torch / CUDA / NCCL versions, GPUs, bf16 readiness, lessons",
        description="Report this machine: torch, CUDA and NCCL versions; each GPU's name and "
                    "memory (through NVML where present); whether native bf16 is ready and, if "
                    "not, why; and which lessons can run here (and on what: GPUs or CPU ranks).")

    # The planner parses its own flags (its module loads torch, which no other command here needs).
    sub.add_parser("plan", add_help=False, help="predict per-GPU peak memory by category for any "
                   "model, strategy and size, without the hardware (fsdp-course plan --help)")

    from utilities.course import evidence

    evidence.add_arguments(sub.add_parser(
        "evidence", help="on a GPU machine: the course's GPU measurements in chunks of --minutes "
                         "(--plan: what is done and next; --pack / --unpack: one archive back)",
        description=evidence.__doc__.split("\n\n")[0]))

    _add_doctor(sub)

    rec = sub.add_parser(
        "record", help="record a real run of a lesson as an asciinema .cast (the course's demos)",
        usage="fsdp-course record NN|all [--out DIR] [--full] [-- lesson flags]")
    rec.add_argument("lesson", help="lesson number or 'all' (every ready lesson)")
    rec.add_argument("--out", default="videos", help="directory for the .cast files (default videos/)")
    rec.add_argument("--full", action="store_true",
                     help="record the full run instead of --quick (long on CPU)")
    return p


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    """The ``doctor`` command's parser."""
    doc = sub.add_parser(
        "doctor", help="build a course model, shard it the course's way and list what is wrong "
                       "with it (utilities.doctor: run it on your own model after sharding)",
        description="Build --model as the lessons do, on tensors without storage (FSDP2: meta; "
                    "FSDP1: fake; nothing materialised, so any size runs in seconds; one process: "
                    "a one-rank gloo group in this process), shard it with --api and --policy "
                    "through utilities.wrapping.shard_model, build its AdamW and run "
                    "utilities.doctor.diagnose on it: one line per problem (what is wrong, why "
                    "it matters, the fix), or 'no problems found' (exit 0; 1 with findings), then "
                    "what needs a run with real values. In your own script, after sharding and "
                    "building the optimizer:\n\n"
                    "    from utilities.doctor import diagnose\n"
                    "    for finding in diagnose(model, optimizer):\n"
                    "        print(finding)",
        formatter_class=HelpFormatter)
    doc.add_argument("--model", default="t5-tiny",
                     help="a course model (see `fsdp-course list --models`) or a Hugging Face "
                          "config.json or a folder holding one (built and sharded on meta tensors, "
                          "FSDP1 on fake ones: nothing is materialised, any size runs in "
                          "seconds); default t5-tiny")
    doc.add_argument("--api", default="fsdp2",
                     help="fsdp2 (fully_shard) or fsdp1 (FullyShardedDataParallel); default fsdp2")
    doc.add_argument("--policy", default="block",
                     help="the units: block (one per transformer block, the course's way), whole "
                          "(one for the whole model: lesson 01's mistake) or size (FSDP1's "
                          "size-based policy); default block")


def main(argv: list[str] | None = None) -> int:
    """The ``fsdp-course`` command; output cut short by its reader (``| head``) ends it quietly."""
    try:
        return _main(argv)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's own flush at exit fails too
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if sys.stdout.isatty() and "COLUMNS" not in os.environ:  # the ranks print to this terminal
        import shutil

        os.environ["COLUMNS"] = str(shutil.get_terminal_size().columns)
    lesson_flags: list[str] = []
    if "--" in argv:  # everything after "--" belongs to the lesson script
        cut = argv.index("--")
        argv, lesson_flags = argv[:cut], argv[cut + 1:]
    if argv[:1] == ["plan"]:
        from utilities.imports import paused_collection

        with paused_collection():  # torch's and transformers' imports (utilities.imports says why)
            from utilities.measure.plan_cli import main as plan_main

            return plan_main(argv[1:])
    args = _parser().parse_args(argv)
    args.lesson_args = lesson_flags
    try:
        if args.command == "list":
            return _list(args.models)
        if args.command == "check":
            from utilities.course.env_report import format_report, report
            from utilities.text import wrap_lines

            print(wrap_lines(format_report(report())))
            return 0
        if args.command == "run":
            return _run(args)
        if args.command == "record":
            return _record(args)
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "evidence":
            from utilities.course.evidence_command import main as evidence_main

            return evidence_main(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _record(args: argparse.Namespace) -> int:
    from utilities.course.recording import record

    check_output_dir(Path(args.out))
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
    from utilities.course.videos_index import VIDEOS, write

    if Path(args.out).resolve() == VIDEOS.resolve():  # the course's own demos: refresh the index
        print(f"updated {write()}")
    return rc


def _doctor(args: argparse.Namespace) -> int:
    """``fsdp-course doctor``: the course's model, sharded the course's way on tensors without
    storage (FSDP2: meta; FSDP1, which cannot shard meta tensors: fake ones), diagnosed."""
    from utilities.wrapping import APIS, POLICIES, shard_model

    spec = get_model_spec(args.model)
    if args.api not in APIS:
        raise bad_value("--api", args.api, APIS)
    if args.policy not in POLICIES:
        raise bad_value("--policy", args.policy, POLICIES)
    import warnings

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from utilities.distributed import teardown
    from utilities.doctor import diagnose, findings_text
    from utilities.text import wrap_lines

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    storage = "meta" if args.api == "fsdp2" else "fake"
    try:
        warnings.filterwarnings("ignore", message=".*switching to use `NO_SHARD`")  # one rank
        fake = FakeTensorMode(allow_non_fake_inputs=True) if storage == "fake" else contextlib.nullcontext()
        with fake:
            try:
                model = shard_model(spec.build(storage if storage == "meta" else "cpu"), api=args.api,
                                    block_class=spec.block_class(), policy=args.policy)
            except (ValueError, RuntimeError, TypeError, IndexError) as e:
                message = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UsageError(f"--model {args.model}: this config cannot be built and sharded: "
                                 f"{message[:200]}") from None
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, spec.config().vocab_size, (2, min(64, spec.default_seq_len)))
        findings = diagnose(model, optimizer, batch={"input_ids": ids}, values=False)
    finally:
        if own_group:
            teardown()
    print(wrap_lines(f"doctor: {spec.name}, {args.api}, policy {args.policy}, 1 process "
                     f"(gloo), {spec.num_parameters:,} parameters on {storage} tensors (none "
                     "materialised)", 80))
    print(findings_text(findings))
    print(wrap_lines("needs a run, not checked here: non-finite or uninitialised values, ranks that "
                     "built different models (in your script: diagnose(model, optimizer, "
                     "every_rank=True) on every rank; same_build_findings(model) before sharding)",
                     80, indent="    "))
    return 1 if findings else 0


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
    check_nproc(args.nproc)
    if args.lesson == "all":
        return _run_all(args, device, args.nproc, flags)
    info = get_lesson(args.lesson)
    if not info.ready:
        ready = [n for n, i in LESSONS.items() if i.ready]
        raise bad_value("lesson", args.lesson, f"{', '.join(ready)} (lesson {info.number} is "
                                               "not written yet)")
    out = Path(args.out or Path("runs") / info.folder)
    nproc = decide_launch(info, device, args.nproc).nproc
    return launch(info, device, nproc, out, args.quick, args.model, flags)


@dataclass(frozen=True)
class LaunchPlan:
    """How a lesson will be started: where, how many ranks, how many share each GPU, and the
    backend its ``setup()`` will ask for (the same decision, from the same numbers)."""

    device: str
    nproc: int
    gpus: int  # visible GPUs; 0 on CPU
    ranks_per_gpu: int  # 1 unless ranks share a GPU
    backend: str

    @property
    def shared(self) -> bool:
        return self.ranks_per_gpu > 1

    def first_line(self) -> str | None:
        """What a run prints first when its ranks share GPUs (None otherwise)."""
        if not self.shared:
            return None
        return shared_gpu_sentence(self.nproc, self.ranks_per_gpu, self.backend, self.gpus)


# ranks one machine may start: each is a process holding torch (a few hundred MiB of host memory)
MAX_NPROC = 128


def check_nproc(nproc: int | None) -> None:
    """Refuse a ``--nproc`` no machine starts (one line), before torchrun tries to."""
    if nproc is not None and not 1 <= nproc <= MAX_NPROC:
        raise bad_value("--nproc", nproc, f"integers in [1, {MAX_NPROC}] (ranks on this machine)")


def decide_launch(info: LessonInfo | None, device: str, nproc: int | None = None,
                  gpus: int | None = None, backend: str = "auto") -> LaunchPlan:
    """Ranks, ranks per GPU and backend for a lesson on ``device`` (``cpu`` or ``cuda``).

    No GPU is touched: the count comes from ``torch.cuda.device_count()`` (or ``gpus``)."""
    check_nproc(nproc)
    if device != "cuda":
        n = nproc or 2
        return LaunchPlan(device, n, 0, 1, resolve_backend(device, backend))
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if nproc is None:
        nproc = info.one_gpu_nproc if (gpus == 1 and info is not None) else gpus
    per_gpu = ranks_per_gpu(nproc, gpus)
    return LaunchPlan(device, nproc, gpus, per_gpu, resolve_backend(device, backend, per_gpu > 1))


def gpu_free_bytes() -> list[int]:
    """Free memory of each visible GPU (``torch.cuda.mem_get_info``), read in a child process:
    asking here would give this launcher a CUDA context (several hundred MiB of the GPU) for as
    long as the lesson runs."""
    code = ("import json, torch; print(json.dumps([torch.cuda.mem_get_info(i)[0] "
            "for i in range(torch.cuda.device_count())]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise UsageError(f"could not read the GPUs' free memory: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lesson_settings(flags: list[str]) -> argparse.Namespace:
    """The lesson flags the launcher needs to plan, as typed: the lesson's parser is the one to
    refuse a bad value, in its one line (a backend is read before it runs; sizes only after)."""
    p = argparse.ArgumentParser(add_help=False)
    for flag, default in (("--model", None), ("--batch-size", None), ("--seq-len", None),
                          ("--backend", "auto")):
        p.add_argument(flag, default=default)
    return p.parse_known_args(flags)[0]


def check_fit(info: LessonInfo, plan: LaunchPlan, quick: bool, model: str | None,
              flags: list[str], free_bytes: list[int] | None = None) -> str:
    """Refuse, in one line, ranks sharing a GPU that would not fit in its free memory.

    Each rank is planned by ``utilities.measure.planner.plan`` as one of ``nproc`` ranks with the
    lesson's model, batch and sequence (fp32, ``full_shard`` per block, no checkpointing: the
    lightest of a lesson's usual variants, so a refusal is never wrong by the plan; a heavier
    variant, e.g. lesson 06's no_shard, may still run out). Its budget is the least free GPU
    memory divided by the ranks per GPU, of which the planner counts 90% usable (the rest: each
    process's CUDA context, the allocator's fragmentation). The fake tensors live on CPU, so the
    launcher never touches the GPU. Returns the line to print when it fits.
    """
    from utilities.measure import fmt_bytes
    from utilities.measure.planner import plan as plan_memory

    lesson = _lesson_settings(flags)
    default_model, default_batch = run_defaults(info, quick)
    name = lesson.model or model or default_model
    batch = int(lesson.batch_size or default_batch)
    free = min(free_bytes if free_bytes is not None else gpu_free_bytes())
    share = max(1, free // plan.ranks_per_gpu)
    p = plan_memory(name, plan.nproc, share, strategy="full_shard", precision="fp32", ac="none",
                    batch=batch, seq=int(lesson.seq_len) if lesson.seq_len else None, device_type="cpu")
    need = p.peak_bytes["total"]
    what = (f"{plan.nproc} ranks of {name} (batch {batch} x seq {p.seq}, fp32, full_shard), "
            f"{plan.ranks_per_gpu} per GPU,")
    if not p.fits:
        raise UsageError(
            f"--nproc {plan.nproc} is not allowed: {what} need {fmt_bytes(need)} each by the "
            f"planner, but a GPU has {fmt_bytes(free)} free ({fmt_bytes(p.budget_bytes)} usable "
            "per rank); allowed: fewer ranks, a smaller --batch-size or --model")
    return (f"planned: {what} need {fmt_bytes(need)} each; {fmt_bytes(free)} free per GPU, "
            f"{fmt_bytes(p.budget_bytes)} usable per rank")


def check_output_dir(out: Path) -> None:
    """Refuse an output folder that cannot be written, before a long run fills it (one line)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise UsageError(f"--out {str(out)!r} is not allowed: it cannot be written "
                         f"({type(e).__name__}: {e.strerror or e}); allowed: a folder you can "
                         "write to") from None


def _launcher(info: LessonInfo) -> list[str]:
    """The command that checks a lesson's flags with its own ``parse_args`` (``launch.main``)."""
    return [sys.executable, "-m", "utilities.course.launch", str(info.script_path)]


def _validate_lesson_flags(info: LessonInfo, argv: list[str]) -> None:
    """Let the lesson script parse its flags first, so a bad one fails in one line before torchrun
    starts (``launch.main`` without a launch request: it stops once they parse)."""
    env = {k: v for k, v in os.environ.items() if k != LAUNCH_ENV}
    done = subprocess.run([*_launcher(info), *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr.strip().splitlines()[-1] + "\n" if done.stderr.strip() else "")
        raise SystemExit(done.returncode)


def lesson_command(info: LessonInfo, device: str, nproc: int, out: Path, quick: bool,
                   model: str | None, flags: list[str]) -> list[str]:
    """The torchrun command line that runs a lesson (also what the notebooks show)."""
    script_args = ["--device", device, "--out", str(out)]
    if quick:
        script_args.append("--quick")
    if model:
        script_args += ["--model", model]
    return [sys.executable, "-m", "utilities.course.torchrun", *_torchrun_args(nproc),
            str(info.script_path), *script_args, *flags]


def _torchrun_args(nproc: int) -> list[str]:
    return ["--standalone", f"--nproc-per-node={nproc}"]


@dataclass(frozen=True)
class Launch:
    """A lesson run ready to start: the command, its environment, and the lines the launcher
    prints before it (the shared-GPU sentence and plan, then the torchrun command as typed)."""

    cmd: list[str]
    env: dict[str, str]
    header: list[str]


def prepare_launch(info: LessonInfo, device: str, nproc: int, out: Path, quick: bool,
                   model: str | None, flags: list[str],
                   check_flags: Callable[[list[str]], None] | None = None,
                   check_then_launch: bool = False) -> Launch:
    """Every check that can fail in one line, before anything starts: the output folder, the
    lesson's flags (``check_flags``, by default the script's ``parse_args`` in a child process,
    which stops once they parse) and, for ranks sharing a GPU, whether they fit.

    ``check_then_launch``: the flags are checked by the process that starts the ranks. The command
    is then ``launch.main`` on the script: it parses the flags (a bad one: one line, exit 2, no
    rank started), prints the header and becomes torchrun: one process importing torch instead of
    two. Ranks sharing a GPU keep the separate check, which must come before their fit is
    planned."""
    from utilities.text import shell_lines, wrap_lines

    cmd = lesson_command(info, device, nproc, out, quick, model, flags)
    script = str(info.script_path)
    lesson_argv = cmd[cmd.index(script) + 1:]
    check_output_dir(out)
    backend = _lesson_settings(flags).backend
    plan = decide_launch(info, device, nproc, backend=backend if backend in BACKENDS else "auto")
    deferred = bool(flags) and check_then_launch and not plan.shared
    if flags and not deferred:  # the flags the launcher adds itself (--device, ...) are checked
        (check_flags or partial(_validate_lesson_flags, info))(lesson_argv)
    header = []
    if plan.shared:
        fit = check_fit(info, plan, quick, model, flags)
        header += [wrap_lines(plan.first_line()), wrap_lines(fit)]
    env = dict(os.environ)
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    shown = [os.path.relpath(script), *lesson_argv]
    header.append(shell_lines(["torchrun", *_torchrun_args(nproc), *shown]))
    if deferred:
        env[LAUNCH_ENV] = json.dumps({"torchrun": _torchrun_args(nproc), "header": header})
        return Launch([*_launcher(info), *lesson_argv], env, [])
    return Launch(cmd, env, header)


def launch(info: LessonInfo, device: str, nproc: int, out: Path, quick: bool,
           model: str | None, flags: list[str]) -> int:
    """Start the lesson through torchrun (after ``prepare_launch``'s checks); its exit code."""
    if "-h" in flags or "--help" in flags:  # the script prints its help and ends
        return subprocess.call([sys.executable, str(info.script_path), *flags])
    run = prepare_launch(info, device, nproc, out, quick, model, flags, check_then_launch=True)
    for line in run.header:
        print(line, flush=True)
    with ctrl_c_left_to_the_launcher():
        return subprocess.call(run.cmd, env=run.env)


@contextlib.contextmanager
def ctrl_c_left_to_the_launcher():
    """While the launcher runs, Ctrl-C does nothing here. The launcher is in our process group, so
    it gets the signal too: torchrun stops the ranks and it says so in one line (exit 130), which
    ``subprocess.call`` then returns. Without this, ``subprocess.call`` would kill the launcher a
    quarter of a second into its shutdown. A handler, not ``SIG_IGN``: ``exec`` resets a handler to
    the default, so the launcher still gets its KeyboardInterrupt."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, lambda number, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _run_all(args, device: str, nproc: int | None, flags: list[str]) -> int:
    from utilities.results import load

    summary = []
    failed = []
    base = Path(args.out or "runs")
    check_output_dir(base)
    for num, info in LESSONS.items():
        if not info.ready:
            continue
        out = base / info.folder
        n = decide_launch(info, device, nproc).nproc
        try:
            rc = launch(info, device, n, out, args.quick, args.model, flags)
        except UsageError as e:  # e.g. ranks that would not fit: this lesson fails, the rest run
            print(f"error: lesson {num}: {e}", file=sys.stderr, flush=True)
            rc = 2
        if rc > 128:  # interrupted (Ctrl-C: 130): the launcher has said so; the rest do not run
            return rc
        if rc != 0:
            failed.append(num)
            summary.append((num, info.title, "FAILED", ""))
            continue
        res = load(out)
        summary.append((num, info.title, f"{len(res['variants'])} variants", res.get("takeaway", "")))
    from utilities.text import wrap_lines

    print("\nlesson  title and measured takeaway")
    for num, title, status, said in summary:
        print(wrap_lines(f"{num:7s} {title}: {said or status}", indent=" " * 8))
    summary_path = base / "summary.json"
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
