"""Process-group set-up that works the same under torchrun and in one plain process.

Lessons never branch on the hardware themselves: ``setup()`` picks NCCL + cuda when GPUs are there
and gloo + cpu otherwise, and both are overridable, so the same script teaches on a laptop and on a
GPU node.

On CUDA the process group always has a CPU backend too (``cpu:gloo,cuda:nccl``): the course runs
CPU-side collectives there (``dcp.async_save`` stages the checkpoint through host memory and needs
one; lesson 09's evaluation all-reduces a CPU tensor), and an NCCL-only group refuses both.

When torchrun starts more ranks on a node than it has GPUs, they share the GPUs (rank i on GPU
``i % GPUs``) over gloo for both devices (``cpu:gloo,cuda:gloo``): NCCL refuses two ranks on one
device. Every rank is its own process with its own caching allocator, so its memory figures are
true per-rank figures; its collectives go through the host, so its step times are not.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from utilities.devices import (  # noqa: F401  (re-exported: the names users and lessons import)
    BACKENDS,
    CUDA_BACKEND,
    DEVICES,
    NOT_MEASURABLE,
    SHARED_GPU_BACKEND,
    SHARED_GPU_NOTE,
    ranks_per_gpu,
    resolve_backend,
    resolve_device,
    shared_gpu_sentence,
)
from utilities.errors import UsageError, bad_value
from utilities.torch_internals import require_gloo_avg


@dataclass(frozen=True)
class DistInfo:
    """Where this process runs: its rank, the world size, its device and the backend (the exact
    string given to ``init_process_group``), and how many ranks of this node share its GPU."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    ranks_per_gpu: int = 1  # > 1 only when ranks share a GPU (see ``ranks_per_gpu``)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def shares_gpu(self) -> bool:
        return self.device.type == "cuda" and self.ranks_per_gpu > 1

    @property
    def nccl_on_gpu(self) -> bool:
        """Whether collectives on this run's CUDA tensors are NCCL kernels on their own stream:
        what communication overlap, exposed communication time and FSDP1's rate limiter need. Over
        gloo (ranks sharing a GPU, or ``--backend gloo``) every collective blocks the host thread
        and copies through host memory: those effects are ``NOT_MEASURABLE`` there."""
        return self.device.type == "cuda" and (self.backend == "nccl" or "cuda:nccl" in self.backend)

    def shared_gpu_note(self) -> str | None:
        """The sentence a run whose ranks share a GPU prints first and records (None otherwise)."""
        if not self.shares_gpu:
            return None
        return shared_gpu_sentence(self.world_size, self.ranks_per_gpu, self.backend)


def setup(device: str = "auto", backend: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the default process group and pin this process to its device.

    Under torchrun the rendezvous variables are already set; in a plain ``python`` process or a
    notebook we make a world of size 1 on a free local port so the same FSDP code runs unchanged.
    On CUDA, when torchrun started more ranks on this node (``LOCAL_WORLD_SIZE``) than there are
    visible GPUs, the ranks share them: every rank takes the same decision from the same numbers,
    so all of them ask for the same backend.
    """
    quiet_on_interrupt()
    die_with_the_launcher()
    dev = resolve_device(device)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    check_launch_environment()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    per_gpu = 1
    if dev == "cuda":
        gpus = torch.cuda.device_count()
        local_ranks = os.environ.get("LOCAL_WORLD_SIZE")
        if local_ranks is None:  # not torchrun: no way to know what the other ranks decide
            if local_rank >= gpus:
                raise UsageError(f"local rank {local_rank} has no GPU: only {gpus} visible; "
                                 "lower --nproc, or launch with torchrun to share the GPUs")
        else:
            per_gpu = ranks_per_gpu(int(local_ranks), gpus)
        torch_device = pin_cuda_device(local_rank, gpus)
    else:
        torch_device = torch.device("cpu")
    be = resolve_backend(dev, backend, shared_gpu=per_gpu > 1)
    _RUN_DEVICE["device"] = torch_device
    if not dist.is_initialized():
        kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if dev == "cuda" and "nccl" in be:
            # Binds NCCL to this GPU at once; gloo has no use for it (and older torch refuses
            # eager connection on it), so a shared GPU goes without.
            kwargs["device_id"] = torch_device
        dist.init_process_group(backend=be, rank=rank, world_size=world_size, **kwargs)
        quiet_when_a_rank_is_lost()
    return DistInfo(rank, local_rank, world_size, torch_device, be, per_gpu)


_RUN_DEVICE: dict[str, torch.device] = {}  # the device ``setup`` chose for this process
_MESHES: dict[tuple[str, int], DeviceMesh] = {}  # by device type and process group


def world_mesh() -> DeviceMesh:
    """The 1-D DeviceMesh of every rank on this run's device: the ``mesh=`` every ``fully_shard``
    of the course is given.

    ``fully_shard`` without a mesh makes the default one, on the machine's accelerator whatever the
    run chose: with ``--device cpu`` on a GPU machine that mesh is CUDA (its set-up pins rank 1 to
    GPU 1, "invalid device ordinal" on a one-GPU machine, and FSDP2 moves the model to the GPUs while
    FSDP1 stays on the CPU). The device is the one ``setup`` chose (a notebook's ``world1``
    included); in a process group made some other way, CUDA where the group has NCCL, else CPU.
    With 2+ ranks over gloo, a torch whose gloo has no AVG reduce is refused in one line
    (``require_gloo_avg``)."""
    device = _RUN_DEVICE.get("device")
    backend = str(dist.get_backend())
    if device is None:
        device = torch.device("cuda" if "nccl" in backend else "cpu")
    nccl = device.type == "cuda" and (backend == "nccl" or "cuda:nccl" in backend)
    if dist.get_world_size() > 1 and not nccl and backend != "fake":  # the planner's does no math
        require_gloo_avg("FSDP2 over gloo with 2+ ranks")
    key = (device.type, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _MESHES[key]


@contextlib.contextmanager
def run_device(device: torch.device):
    """``world_mesh()`` on ``device`` inside (the planner's fake world on its fake device), the
    device ``setup`` chose again after."""
    before = _RUN_DEVICE.get("device")
    _RUN_DEVICE["device"] = torch.device(device)
    try:
        yield
    finally:
        if before is None:
            _RUN_DEVICE.pop("device", None)
        else:
            _RUN_DEVICE["device"] = before


def forget_world_meshes() -> None:
    """Forget the meshes ``world_mesh`` made for the current process group (before it is
    destroyed: a later group may reuse its id)."""
    if dist.is_initialized():
        for key in [k for k in _MESHES if k[1] == id(dist.group.WORLD)]:
            del _MESHES[key]


def pin_cuda_device(local_rank: int | None = None, gpus: int | None = None) -> torch.device:
    """Put this process on GPU ``local_rank % gpus`` (ranks sharing GPUs: rank i on GPU i % N) and
    initialize CUDA there, so that a DeviceMesh made later keeps this device: on a CUDA not yet
    initialized, DeviceMesh sets the device to LOCAL_RANK, which ranks sharing a GPU do not have
    ("invalid device ordinal"). Defaults: LOCAL_RANK, and every visible GPU."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = local_rank % (gpus or torch.cuda.device_count())
    torch.cuda.init()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# FSDP2 warns when a wrapped module returns a view: an in-place op on it would skip the module's
# pre-backward all-gather. A T5Block returns its attention position bias, a slice of the first
# block's bias, which the next blocks only read (``scores += position_bias``, out of place for the
# bias), so the warning is about a hazard T5 never meets; tests/test_warnings.py proves the
# gradients equal an unsharded model's, with and without checkpoint wrappers. Only these module
# names are silenced: a view returned by any other wrapped module (yours) still warns.
T5_POSITION_BIAS_VIEW = r"FSDP2-wrapped module \((FSDP)?(T5Block|CheckpointWrapper)\) returned a view tensor"

# Warnings that torch raises about its own internals, which a learner can do nothing about:
TORCH_INTERNAL_WARNINGS = (
    T5_POSITION_BIAS_VIEW,
    # FSDP1's state-dict code still uses the ShardedTensor and helpers torch itself deprecates.
    "Please use DTensor instead", "`_get_pg_default_device`", "Multiple backends are registered",
    # torch.distributed._tools' module tracker, around FSDP1's hook-less backward wrappers.
    "Module is None",
    # ... and its memory tracker, which reads .grad of every tensor it sees, non-leaves included.
    "The .grad attribute of a Tensor that is not a leaf Tensor",
    # ShardedGradScaler.unscale_ checks FSDP2's DTensor gradients with its own one-element
    # found_inf / inv_scale tensors; DTensor replicates them implicitly (right: every rank holds the
    # same scale) and says so at every step.
    "Found a non-scalar tensor with numel=1",
    # FSDP1 at world size 1 runs NO_SHARD, whose sharded state dict is a full one: the lessons say
    # so before any number (results.json "single_rank"), in the learner's words, not torch's.
    "When using ``NO_SHARD`` for ``ShardingStrategy``",
    # FSDP1's HYBRID_SHARD over shard groups of one rank runs NO_SHARD in each: lesson 06 says so
    # under its table (its HYBRID_TRAP note), with what it costs, in one line instead of torch's
    # two per rank.
    "FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.HYBRID_SHARD",
)


def quiet_torch_internal_warnings() -> None:
    """Hide the warnings torch raises about its own internals (listed above), so lesson output
    shows what the lesson prints. Every other warning still shows."""
    import warnings

    for message in TORCH_INTERNAL_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def teardown() -> None:
    """Leave the process group cleanly: a barrier first, so no rank exits mid-collective; then
    collect garbage, so no tensor or collective handle of a finished model is left for the
    interpreter's own shutdown to destroy after the process group's threads are gone (a rank
    that exits that way dies of SIGABRT: "terminate called without an active exception")."""
    _MESHES.clear()
    _RUN_DEVICE.clear()
    if dist.is_initialized():
        try:
            dist.barrier()
            gc.collect()
        finally:
            dist.destroy_process_group()


def quiet_on_interrupt() -> None:
    """In a rank torchrun started: Ctrl-C ends this process at once, silently, with 130. The
    launcher gets the same signal, stops every rank and prints the one line that says so; without
    this, every rank adds a KeyboardInterrupt traceback from wherever it was (a collective, mostly).
    A save cut short this way is one a kill would leave: the previous checkpoint stays complete.
    Elsewhere (a notebook, a test, one plain process) Ctrl-C is left as it is."""
    import signal
    import threading

    if os.environ.get("TORCHELASTIC_RUN_ID") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda number, frame: os._exit(128 + number))


# Set by the course's launcher (``utilities.course.torchrun``) for the ranks it starts: it names a
# rank that dies in one line, so the others say nothing of the collective that failed with it.
LAUNCHER_NAMES_A_LOST_RANK = "FSDP_COURSE_LAUNCHER_NAMES_A_LOST_RANK"
# Set by the course's torchrun (``utilities.course.torchrun``): a folder it made, where each rank
# that ends on an error leaves the one line for the launcher to print once.
LAUNCHER_PRINTS_THE_ERROR = "FSDP_COURSE_ERROR_FOLDER"
# How a collective fails when another rank's process is gone (gloo's TCP pairs, NCCL)
LOST_RANK_TEXTS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                   "Socket closed", "remote process exited", "NCCL communicator was aborted")


def lost_a_rank(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from or during, is a collective failing
    because another rank's process is gone."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and any(text in str(exc) for text in LOST_RANK_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def quiet_when_a_rank_is_lost() -> None:
    """In a rank torchrun started: when another rank dies (``kill -9``, the OOM killer), the
    collective this one is in fails, and its traceback (with the one of the tear-down's barrier)
    used to fill the terminal. Such an error ends this rank at once with exit 1, in one line, or
    silently under the course's launcher, which names the rank that died. Any other error keeps
    its traceback (torch's ``[rankN]:`` hook, installed by ``init_process_group``, stays)."""
    import sys

    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    torch_hook = sys.excepthook

    def hook(exc_type, exc, tb):
        if not lost_a_rank(exc):
            return torch_hook(exc_type, exc, tb)
        if not os.environ.get(LAUNCHER_NAMES_A_LOST_RANK):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc_type.__name__
            print(f"error: rank {rank()}: another rank is gone, a collective failed ({first[:200]})",
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook


def die_with_the_launcher() -> None:
    """In a rank torchrun started (Linux): be killed when the launcher dies. torchrun starts each
    rank in its own session, so a ``kill -9`` of the launcher (or of its process group) used to
    leave the ranks training and writing checkpoints on their own, racing a restarted ``--resume``.
    The kernel's parent-death signal ends them instead. Armed in ``setup()``: a launcher killed
    while its ranks are still importing torch leaves them to finish that first."""
    import ctypes
    import signal
    import sys

    if not os.environ.get("TORCHELASTIC_RUN_ID") or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died while the signal was being armed
        os._exit(128 + int(signal.SIGKILL))


class fail_together:
    """``with fail_together("saving X"):`` around a step that not every rank does the same way
    (rank 0 writes a file, the others wait for it): every rank enters, and on leaving, the ranks
    compare notes (one small all-gather), so a failure on any rank becomes the same one-line
    ``UsageError`` on every rank. Without it, rank 0 fails alone and the others wait for ever in
    their next collective (a full disk, an unwritable ``--out``).

    ``KeyboardInterrupt`` and other ``BaseException``s pass through untouched: every rank gets the
    signal itself."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> fail_together:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False
        error = None if exc is None else one_line_error(self.what, exc)
        if dist.is_initialized() and dist.get_world_size() > 1:
            errors: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise UsageError(error) from None
        return False


def one_line_error(what: str, exc: BaseException) -> str:
    """``exc`` as one line: a ``UsageError`` as it is, an ``OSError`` by its reason and file,
    anything else by its type and the first 200 characters of its message (and, with several
    ranks, that the others stopped too)."""
    if isinstance(exc, UsageError):
        return str(exc)
    others = "; the other ranks stopped too" if world_size() > 1 else ""
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{what} failed: {exc.strerror}{where}{others}"
    reason = " ".join(str(exc).split())[:200]
    return f"{what} failed: {type(exc).__name__}: {reason}{others}"


def exit_on_error(exc: BaseException) -> None:
    """End a rank after an error every rank raised the same way: rank 0 prints it as one line,
    then every rank exits 2 at once, skipping the collective tear-down (the others are gone or
    going)."""
    import sys

    folder = os.environ.get(LAUNCHER_PRINTS_THE_ERROR)
    if world_size() > 1 and folder and os.path.isdir(folder):
        # torchrun stops every rank as soon as one exits, so rank 0 may not get to print: each rank
        # leaves the line (the same on every rank) and the launcher prints it once, after all ended
        with open(os.path.join(folder, f"rank{rank()}.txt"), "w") as f:
            f.write(str(exc).replace("\n", " "))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    if is_main() or isinstance(exc, LaunchEnvironmentError):
        print(f"error: {exc}", file=sys.stderr, flush=True)
    if world_size() > 1:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(2)
    teardown()
    raise SystemExit(2)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else _environment_int("RANK", 0)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else _environment_int("WORLD_SIZE", 1)


def _environment_int(name: str, default: int) -> int:
    """An integer environment variable, ``default`` when it is unset or not an integer (how an
    error is reported must not fail on the variable being refused)."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


# The variables torchrun sets for each rank, and the values each may take.
LAUNCH_VARIABLES = {"RANK": (0, 2**31 - 1), "LOCAL_RANK": (0, 2**31 - 1),
                    "WORLD_SIZE": (1, 2**31 - 1), "LOCAL_WORLD_SIZE": (1, 2**31 - 1),
                    "MASTER_PORT": (1, 65535)}


class LaunchEnvironmentError(UsageError):
    """A rendezvous variable no process group can use. Every process that has it says so: one
    started by hand has no rank 0 to speak for it."""


def check_launch_environment() -> None:
    """Refuse, in one line, a rendezvous variable torch would choke on (``MASTER_PORT=notaport``,
    ``WORLD_SIZE=abc``, a rank outside the world), naming it and what it may be."""
    for name, (low, high) in LAUNCH_VARIABLES.items():
        text = os.environ.get(name)
        if text is None:
            continue
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise LaunchEnvironmentError(str(bad_value(f"environment variable {name}", text,
                                                       f"integers in [{low}, {high}]")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank_, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if rank_ >= world:
            raise LaunchEnvironmentError(str(bad_value("environment variable RANK", str(rank_),
                                                       f"integers below WORLD_SIZE ({world})")))


def is_main() -> bool:
    return rank() == 0


def print0(*args, all_ranks: bool = False, **kwargs) -> None:
    """Print on rank 0 only (or on every rank, prefixed, when ``all_ranks``), flushed unless told
    otherwise (several ranks share one terminal)."""
    kwargs.setdefault("flush", True)
    if all_ranks:
        print(f"[rank {rank()}]", *args, **kwargs)
    elif is_main():
        print(*args, **kwargs)


REDUCE_OPS = ("sum", "mean", "max", "min")


def reduce_scalar(value: float, op: str = "mean", device: torch.device | str = "cpu") -> float:
    """One number reduced over every rank: the loss they average, the step time of the slowest
    rank, a count they add up. The course's one helper for this; ``device`` is where the
    collective runs (``cpu`` works on every process group the course makes, CUDA ones included)."""
    if op not in REDUCE_OPS:
        raise bad_value("op", op, REDUCE_OPS)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], device=device, dtype=torch.float64)
    red = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(t, op=red)
    out = float(t.item())
    return out / dist.get_world_size() if op == "mean" else out


def all_reduce_mean(value: float, device: torch.device) -> float:
    """Average a Python float over ranks (loss logging)."""
    return float(reduce_scalar(float(value), "mean", device))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def watch_reduce_scatters(on_input: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``on_input`` with the input (the unsharded gradients) of every reduce-scatter this
    process issues while active, then issue it. FSDP1 and FSDP2 call
    ``torch.distributed.reduce_scatter_single`` (torch 2.13; ``reduce_scatter_tensor`` in older
    releases): whichever exist are wrapped for the duration, so what is seen is what went over the
    wire, not what a config says."""
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def watching(original):
        def call(*args, **kwargs):  # both take (output, input, ...)
            grad = kwargs.get("input", args[1] if len(args) > 1 else None)
            if isinstance(grad, torch.Tensor):
                on_input(grad)
            return original(*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, watching(originals[n]))
    try:
        yield
    finally:
        for n, original in originals.items():
            setattr(dist, n, original)
