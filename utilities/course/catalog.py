"""The course's lessons: number, folder, title, script. A lesson is "ready" when its script exists.

``one_gpu_nproc`` is how many ranks a lesson runs on a machine with one GPU. A lesson whose point
is per-rank memory (what sharding saves) teaches nothing at world size 1, where FSDP shards
nothing: it runs 2 ranks sharing the GPU (``utilities.distributed``: gloo, host-staged
collectives, true per-rank allocator figures). Lessons 01 (unsharded parameters at the peak), 06
(bytes per rank vs theory), 11 (``limit_all_gathers``: with one rank FSDP1 runs NO_SHARD and has no
all-gather to limit), 14 (the planner at N ranks) and 17 (the sequence split over ranks) need ranks
to shard over. The others keep 1
rank: 02's activations are per-rank batch memory that sharding does not change (and its
batch search to the edge of memory needs the GPU to itself), and the rest measure time, numerics
or state that one rank shows as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from utilities.errors import bad_value

REPO_ROOT = Path(__file__).resolve().parents[2]
LESSONS_DIR = REPO_ROOT / "lessons"


@dataclass(frozen=True)
class Run:
    """How big a lesson runs by default: the model and per-rank batch on a GPU and on a CPU (or with
    ``--quick``), and the steps per variant. Flags override each; the launcher reads them here to
    plan ranks that share a GPU, so this is their one source."""

    gpu_model: str = "t5-large"
    gpu_batch_size: int = 8
    cpu_model: str = "t5-tiny"
    batch_size: int = 4
    steps: int = 12
    quick_steps: int = 6
    lr: float = 3e-3

    def model(self, on_gpu: bool, quick: bool) -> str:
        return self.gpu_model if on_gpu and not quick else self.cpu_model

    def batch(self, on_gpu: bool, quick: bool) -> int:
        return self.gpu_batch_size if on_gpu and not quick else self.batch_size


@dataclass(frozen=True)
class LessonInfo:
    number: str
    folder: str
    title: str
    script: str
    gpu_note: str = ""  # what only a GPU shows, for the learning path
    one_gpu_nproc: int = 1  # ranks on a one-GPU machine (2: a per-rank memory lesson)
    run: Run = Run()
    # how a run's sizes read in its README caption, where its variants choose their own steps and
    # batches ("" : the run's steps and batch)
    sizes: str = ""
    # the ids of the lesson's GPU claims: each a case of tests/gpu_cases.py, run on a GPU by
    # tests/gpu/test_gpu_smoke.py (an evidence step) and on the CPU by its twin
    gpu_claims: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return LESSONS_DIR / self.folder

    @property
    def script_path(self) -> Path:
        return self.path / self.script

    @property
    def ready(self) -> bool:
        return self.script_path.is_file()

    @property
    def notebook(self) -> Path:
        return self.path / f"{self.folder}.ipynb"

    @property
    def memory_lesson(self) -> bool:
        """Whether the lesson's point is per-rank memory (it shares one GPU between 2 ranks)."""
        return self.one_gpu_nproc > 1


LESSONS: dict[str, LessonInfo] = {
    info.number: info
    for info in (
        LessonInfo("01", "01_auto_wrap", "transformer auto-wrap", "auto_wrap.py",
                   one_gpu_nproc=2,
                   run=Run(steps=12, quick_steps=5, batch_size=4),
                   gpu_claims=("01-wrap",)),
        LessonInfo("02", "02_activation_checkpointing", "activation checkpointing",
                   "activation_checkpointing.py",
                   run=Run(steps=10, quick_steps=4, batch_size=8),
                   gpu_claims=("02-activation-checkpointing",)),
        LessonInfo("03", "03_full_state_dict", "full state dict save/load", "full_state_dict.py",
                   run=Run(steps=8, quick_steps=3, batch_size=4),
                   gpu_claims=("03-full-state-dict",)),
        LessonInfo("04", "04_backward_prefetch", "backward prefetch", "backward_prefetch.py",
                   "overlap of communication and compute shows only on GPUs",
                   run=Run(steps=12, quick_steps=4, batch_size=4),
                   gpu_claims=("04-prefetch",)),
        LessonInfo("05", "05_memory_maximizer", "memory maximizer (cudaMalloc retries)",
                   "memory_maximizer.py", "cudaMalloc retries exist only on GPUs",
                   run=Run(steps=5, quick_steps=3, batch_size=1, gpu_batch_size=1),
                   gpu_claims=("05-memory-maximizer",)),
        LessonInfo("06", "06_sharding_strategies", "sharding strategies", "sharding_strategies.py",
                   one_gpu_nproc=2,
                   run=Run(steps=10, quick_steps=4, batch_size=2)),
        LessonInfo("07", "07_mixed_precision", "mixed precision (+ bf16 checker)",
                   "mixed_precision.py", "bf16 speed-ups need a GPU",
                   run=Run(steps=12, quick_steps=4, batch_size=4),
                   gpu_claims=("07-mixed-precision",)),
        LessonInfo("08", "08_local_state_dict", "local / sharded state dict (distributed checkpoint)",
                   "sharded_state_dict.py",
                   run=Run(steps=8, quick_steps=3, batch_size=4),
                   gpu_claims=("08-distributed-checkpoint",)),
        LessonInfo("09", "09_fine_tuning", "fine-tuning (freezing, child-tuning)", "fine_tuning.py",
                   run=Run(steps=30, quick_steps=6, batch_size=8, gpu_batch_size=8, lr=1e-2)),
        LessonInfo("10", "10_end_to_end", "end-to-end training codebase", "train.py",
                   run=Run(gpu_model="llama-1b", gpu_batch_size=4, cpu_model="llama-tiny",
                           batch_size=8)),
        LessonInfo("11", "11_rate_limiter", "rate limiter (limit_all_gathers)", "rate_limiter.py",
                   "the caching allocator's over-reservation exists only on GPUs", one_gpu_nproc=2,
                   run=Run(steps=12, quick_steps=4, batch_size=4)),
        LessonInfo("12", "12_tensor_parallel", "tensor + 2-D parallel", "tensor_parallel.py",
                   run=Run(gpu_model="llama-1b", gpu_batch_size=4, steps=8, quick_steps=4,
                           batch_size=4)),
        LessonInfo("13", "13_fp8_compile", "FP8 training with torch.compile", "fp8_compile.py",
                   "FP8 needs a Hopper / Ada or newer GPU",
                   run=Run(gpu_model="llama-tiny", gpu_batch_size=4, steps=20, quick_steps=6,
                           batch_size=8)),
        LessonInfo("14", "14_memory_planner", "memory planning without the hardware",
                   "memory_planner.py", one_gpu_nproc=2,
                   run=Run(gpu_model="llama-1b", gpu_batch_size=2, steps=4, quick_steps=3,
                           batch_size=4)),
        LessonInfo("15", "15_when_fsdp_goes_wrong", "when FSDP goes wrong", "when_fsdp_goes_wrong.py",
                   "allocated vs reserved memory and NCCL timeouts show only on GPUs", one_gpu_nproc=2,
                   run=Run(gpu_model="llama-tiny", gpu_batch_size=4, cpu_model="llama-tiny",
                           steps=1, quick_steps=1, batch_size=4),
                   sizes="each failure at the steps and batches its row needs to show it"),
        LessonInfo("16", "16_cpu_offload", "CPU offload", "cpu_offload.py",
                   "the GPU memory offload saves and the time its copies cost show only on GPUs",
                   run=Run(steps=8, quick_steps=4, batch_size=4),
                   gpu_claims=("16-cpu-offload",)),
        LessonInfo("17", "17_context_parallel", "context parallelism", "context_parallel.py",
                   "torch's own context_parallel runs only on GPUs (CUDA SDPA kernels)",
                   one_gpu_nproc=2,
                   run=Run(gpu_model="llama-tiny", gpu_batch_size=2, cpu_model="llama-tiny", steps=6,
                           quick_steps=4, batch_size=2),
                   gpu_claims=("17-context-parallel",)),
    )
}


def get_lesson(number: str) -> LessonInfo:
    """Find a lesson by number ("1", "01"); an unknown number is a one-line error."""
    key = number.zfill(2) if number.isdigit() else number
    if key not in LESSONS:
        raise bad_value("lesson", number, list(LESSONS) + ["all"])
    return LESSONS[key]


def run_defaults(info: LessonInfo, quick: bool) -> tuple[str, int]:
    """The model and per-rank batch a lesson runs by default on GPU (or with ``--quick``)."""
    return info.run.model(on_gpu=True, quick=quick), info.run.batch(on_gpu=True, quick=quick)
