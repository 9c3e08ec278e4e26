"""The course's lessons, one record each: every fact the course keeps about a lesson lives here.

A lesson is "ready" when its script exists. Its record holds what the launcher runs (``Run``, its
ranks on one GPU), what its README's tables add (``readme_footer``, ``readme_summaries``) and what
the suite compares its committed run with (``Claims``), its GPU claims (``GpuClaim``) and runs on
ranks sharing a GPU (``SharedGpuRun``), and the minutes its evidence steps take (``Evidence``).
Adding a lesson is its folder plus one ``LessonInfo`` in ``LESSONS``.

``one_gpu_nproc`` is how many ranks a lesson runs on a machine with one GPU. A lesson whose point
is per-rank memory (what sharding saves) teaches nothing at world size 1, where FSDP shards
nothing: it runs 2 ranks sharing the GPU (``utilities.distributed``: gloo, host-staged
collectives, true per-rank allocator figures). Lessons 01 (unsharded parameters at the peak), 06
(bytes per rank vs theory), 11 (``limit_all_gathers``: with one rank FSDP1 runs NO_SHARD and has no
all-gather to limit), 14 (the planner at N ranks) and 17 (the sequence split over ranks) need ranks
to shard over. The others keep 1 rank: 02's activations are per-rank batch memory that sharding
does not change (and its batch search to the edge of memory needs the GPU to itself), and the rest
measure time, numerics or state that one rank shows as well.
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
class Claims:
    """What any run of the lesson must reproduce of its committed run, beyond the memory at the
    peak (compared by the suite's ``readme_claims``). A parameter, gradient or optimizer byte count
    is the product of shapes and dtypes, the same on every machine, so it is exact: one parameter
    more or less is a different model. A difference measured inside one run
    (``outputs_max_abs_diff``: a reload against the model it saved) is 0.0 on any machine, or a bug.

    ``columns``: a variant's columns claimed as they are (a row without one claims None).
    ``named``: (claim, column) pairs; a row without one of these columns (a summary row) claims
    only its peak. ``peak``: the parts of the peak claimed (None: every part). ``losses``: claimed
    columns that are losses (compared within the rounding of their precision). ``unclaimed_kinds``:
    the ``kind`` of variants a quick run does not repeat."""

    columns: tuple[str, ...] = ()
    named: tuple[tuple[str, str], ...] = ()
    peak: tuple[str, ...] | None = None
    losses: tuple[str, ...] = ()
    unclaimed_kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuClaim:
    """A claim only a GPU can settle: its id, the lesson flags it runs with, and whether the GPU
    runs the quick (tiny) configuration as well. The suite's ``gpu_cases`` holds what must hold
    (by id); it runs on a GPU as an evidence step and on the CPU as its twin."""

    id: str
    flags: tuple[str, ...] = ()
    gpu_quick: bool = False


@dataclass(frozen=True)
class SharedGpuRun:
    """A run of the lesson on ranks sharing one GPU: its key (the lesson's number, then what sets it
    apart), the ranks, the lesson flags, and the GPU test that asserts its point (a pytest node of
    tests/gpu/test_shared_gpu.py, the evidence step ``shared-KEY``)."""

    key: str
    nproc: int
    flags: tuple[str, ...]
    test: str


@dataclass(frozen=True)
class Evidence:
    """The lesson's evidence steps: the minutes each is estimated to take on one H100 (its quick
    run, and its run at GPU size), and why the GPU-size step runs ``--quick`` ("": it does not)."""

    quick_minutes: float = 0.5
    minutes: float = 1.0
    quick_because: str = ""


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
    # what the README's results table ends with (a footer of ``readme_tables``, "": nothing), and
    # the summaries of a run its README may render (``table=NAME``)
    readme_footer: str = ""
    readme_summaries: tuple[str, ...] = ()
    claims: Claims = Claims()
    gpu_claims: tuple[GpuClaim, ...] = ()
    shared_gpu_runs: tuple[SharedGpuRun, ...] = ()
    evidence: Evidence = Evidence()

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


WRAP_VARIANTS = "fsdp2-one-unit,fsdp2-per-block,fsdp1-one-unit,fsdp1-per-block"
OFFLOAD_VARIANTS = ("fsdp2", "fsdp2-offload", "fsdp1", "fsdp1-offload")
CP_VARIANTS = ("ring-contiguous", "ring-balanced", "torch-cp", "fsdp-cp1", "fsdp-cp2")
SHARED_06 = "test_lesson_06_full_shard_bytes_per_rank_equal_theory"

LESSONS: dict[str, LessonInfo] = {
    info.number: info
    for info in (
        LessonInfo("01", "01_auto_wrap", "transformer auto-wrap", "auto_wrap.py",
                   one_gpu_nproc=2,
                   run=Run(steps=12, quick_steps=5, batch_size=4),
                   claims=Claims(named=(("units", "fsdp_units"), ("largest", "largest_unit_parameters"),
                                        ("unsharded", "peak_unsharded_parameter_bytes"))),
                   gpu_claims=(GpuClaim("01-wrap", ("--variants", WRAP_VARIANTS, "--steps", "4")),),
                   shared_gpu_runs=(SharedGpuRun("01", 2, ("--variants", WRAP_VARIANTS, "--steps", "3",
                                                           "--batch-size", "2"),
                                                 "test_lesson_01_per_block_unsharded_peak_below_one_unit"),),
                   evidence=Evidence(minutes=0.8)),
        LessonInfo("02", "02_activation_checkpointing", "activation checkpointing",
                   "activation_checkpointing.py",
                   run=Run(steps=10, quick_steps=4, batch_size=8),
                   readme_summaries=("search",),
                   claims=Claims(columns=("checkpointed_blocks",)),
                   gpu_claims=(GpuClaim("02-activation-checkpointing",
                                        ("--variants", "fsdp2-none,fsdp2-all,fsdp1-none,fsdp1-all",
                                         "--steps", "4", "--search", "off")),),
                   evidence=Evidence(quick_minutes=0.8, quick_because="its batch search is long")),
        LessonInfo("03", "03_full_state_dict", "full state dict save/load", "full_state_dict.py",
                   run=Run(steps=8, quick_steps=3, batch_size=4),
                   # the next step's losses after the reload, taken after the run's ``steps`` steps
                   claims=Claims(columns=("checkpoint_bytes", "loaded_step", "outputs_max_abs_diff",
                                          "next_loss_a", "next_loss_b", "after_step_max_abs_diff",
                                          "hf_export_bytes", "hf_max_abs_diff"),
                                 losses=("next_loss_a", "next_loss_b")),
                   gpu_claims=(GpuClaim("03-full-state-dict", ("--variants", "fsdp2,fsdp1"),
                                        gpu_quick=True),),
                   evidence=Evidence(minutes=0.6)),
        LessonInfo("04", "04_backward_prefetch", "backward prefetch", "backward_prefetch.py",
                   "overlap of communication and compute shows only on GPUs",
                   run=Run(steps=12, quick_steps=4, batch_size=4),
                   claims=Claims(columns=("prefetch", "peak_unsharded_parameter_bytes",
                                          "peak_gathered_parameter_bytes")),
                   gpu_claims=(GpuClaim("04-prefetch", ("--variants", "fsdp1-no-prefetch,fsdp1-backward-pre,"
                                                        "fsdp2-implicit", "--steps", "4")),)),
        LessonInfo("05", "05_memory_maximizer", "memory maximizer (cudaMalloc retries)",
                   "memory_maximizer.py", "cudaMalloc retries exist only on GPUs",
                   run=Run(steps=5, quick_steps=3, batch_size=1, gpu_batch_size=1),
                   # Its small batches have two moments of backward within a few hundred KiB of each
                   # other, and which one is the peak depends on timing (batch 1: activations 3.67 or
                   # 4.27 MiB from one run of the same code to the next; its README says more), and
                   # the parameters booked at its peak move by a bias under load: only the state the
                   # batch does not change is claimed.
                   claims=Claims(columns=("batch", "phase", "verdict"), peak=("optimizer",)),
                   gpu_claims=(GpuClaim("05-memory-maximizer", ("--start-batch", "16")),),
                   evidence=Evidence(quick_minutes=0.8, quick_because="its batch search is long")),
        LessonInfo("06", "06_sharding_strategies", "sharding strategies", "sharding_strategies.py",
                   one_gpu_nproc=2,
                   run=Run(steps=10, quick_steps=4, batch_size=2),
                   readme_summaries=("capacity",),
                   claims=Claims(columns=("resident_bytes", "peak_unsharded_parameter_bytes",
                                          "sent_per_step_bytes")),
                   shared_gpu_runs=(
                       SharedGpuRun("06", 2, ("--variants", "fsdp1-full-shard,fsdp2-reshard-true",
                                              "--steps", "3", "--batch-size", "2"), f"{SHARED_06}[06]"),
                       SharedGpuRun("06x4", 4, ("--variants", "fsdp2-reshard-true", "--steps", "3",
                                                "--batch-size", "2"), f"{SHARED_06}[06x4]")),
                   evidence=Evidence(minutes=0.8)),
        LessonInfo("07", "07_mixed_precision", "mixed precision (+ bf16 checker)",
                   "mixed_precision.py", "bf16 speed-ups need a GPU",
                   run=Run(steps=12, quick_steps=4, batch_size=4),
                   claims=Claims(named=(("forward", "forward_param_dtypes"), ("reduce", "reduce_dtypes"))),
                   gpu_claims=(GpuClaim("07-mixed-precision", ("--policies", "fp32,bf16", "--steps", "6")),)),
        LessonInfo("08", "08_local_state_dict", "local / sharded state dict (distributed checkpoint)",
                   "sharded_state_dict.py",
                   run=Run(steps=8, quick_steps=3, batch_size=4),
                   readme_footer="checkpoints",
                   claims=Claims(columns=("format", "files", "flat_params", "reload_outputs_equal",
                                          "max_abs_loss_diff")),
                   gpu_claims=(GpuClaim("08-distributed-checkpoint", gpu_quick=True),),
                   evidence=Evidence(minutes=0.6)),
        LessonInfo("09", "09_fine_tuning", "fine-tuning (freezing, child-tuning)", "fine_tuning.py",
                   run=Run(steps=30, quick_steps=6, batch_size=8, gpu_batch_size=8, lr=1e-2),
                   readme_footer="fisher",
                   # its committed full run uses sequences the quick run does not: only the parts of
                   # the peak independent of them are claims
                   claims=Claims(columns=("trainable_parameters", "frozen_parameters",
                                          "gradient_bytes_per_rank", "optimizer_bytes_per_rank",
                                          "frozen_bit_identical"), peak=("parameters", "optimizer")),
                   evidence=Evidence(minutes=0.8)),
        LessonInfo("10", "10_end_to_end", "end-to-end training codebase", "train.py",
                   run=Run(gpu_model="llama-1b", gpu_batch_size=4, cpu_model="llama-tiny",
                           batch_size=8),
                   claims=Claims(columns=("precision", "activation_checkpointing")),
                   evidence=Evidence(quick_minutes=0.8, quick_because="a full training run is long")),
        LessonInfo("11", "11_rate_limiter", "rate limiter (limit_all_gathers)", "rate_limiter.py",
                   "the caching allocator's over-reservation exists only on GPUs", one_gpu_nproc=2,
                   run=Run(steps=12, quick_steps=4, batch_size=4),
                   claims=Claims(columns=("limit_all_gathers",)),
                   evidence=Evidence(minutes=0.8)),
        LessonInfo("12", "12_tensor_parallel", "tensor + 2-D parallel", "tensor_parallel.py",
                   run=Run(gpu_model="llama-1b", gpu_batch_size=4, steps=8, quick_steps=4,
                           batch_size=4),
                   # its committed full run uses widths the quick run does not: only the parts of the
                   # peak independent of them are claims, and its quick FeedForward ("mlp") is half
                   # as wide as the full run's
                   claims=Claims(columns=("tp_size", "dp_size", "weight_bytes_per_rank",
                                          "split_weight_bytes_per_rank", "replicated_weight_bytes_per_rank"),
                                 peak=("parameters", "optimizer"), unclaimed_kinds=("mlp",)),
                   evidence=Evidence(minutes=0.6)),
        LessonInfo("13", "13_fp8_compile", "FP8 training with torch.compile", "fp8_compile.py",
                   "FP8 needs a Hopper / Ada or newer GPU",
                   run=Run(gpu_model="llama-tiny", gpu_batch_size=4, steps=20, quick_steps=6,
                           batch_size=8),
                   claims=Claims(columns=("compiled_blocks", "parameters")),
                   evidence=Evidence(quick_minutes=1.5, minutes=1.5)),
        LessonInfo("14", "14_memory_planner", "memory planning without the hardware",
                   "memory_planner.py", one_gpu_nproc=2,
                   run=Run(gpu_model="llama-1b", gpu_batch_size=2, steps=4, quick_steps=3,
                           batch_size=4),
                   claims=Claims(named=(("planned", "predicted_peak_bytes"),)),
                   shared_gpu_runs=(SharedGpuRun("14", 2, ("--quick", "--model", "llama-1b", "--batch-size",
                                                           "2", "--variants", "full_shard-fp32"),
                                                 "test_lesson_14_plan_within_10_percent_of_the_allocator_peak"),)),
        LessonInfo("15", "15_when_fsdp_goes_wrong", "when FSDP goes wrong", "when_fsdp_goes_wrong.py",
                   "allocated vs reserved memory and NCCL timeouts show only on GPUs", one_gpu_nproc=2,
                   run=Run(gpu_model="llama-tiny", gpu_batch_size=4, cpu_model="llama-tiny",
                           steps=1, quick_steps=1, batch_size=4),
                   sizes="each failure at the steps and batches its row needs to show it",
                   # each failure's pair, and the byte and collective counts its shapes fix
                   claims=Claims(columns=(
                       "symptom_shown", "fix_works", "mistake_weight_copies", "fix_weight_copies",
                       "unsharded_gradient_bytes", "mistake_peak_gradient_bytes", "fix_peak_gradient_bytes",
                       "mistake_reduce_scatters", "fix_reduce_scatters", "mistake_all_gathers",
                       "fix_all_gathers", "trainable_gradient_bytes_per_rank",
                       "frozen_gradient_bytes_per_rank", "tensors", "mistake_tensors_as_a_rank_built",
                       "fix_tensors_as_a_rank_built", "mistake_reduce_dtypes", "fix_reduce_dtypes"))),
        LessonInfo("16", "16_cpu_offload", "CPU offload", "cpu_offload.py",
                   "the GPU memory offload saves and the time its copies cost show only on GPUs",
                   run=Run(steps=8, quick_steps=4, batch_size=4),
                   claims=Claims(columns=(
                       "parameters_on", "gradients_on", "optimizer_on", "pinned", "sharded_bytes",
                       "to_device_copies", "to_device_bytes", "to_device_moved_bytes", "to_host_copies",
                       "to_host_bytes", "to_host_moved_bytes")),
                   gpu_claims=(GpuClaim("16-cpu-offload", ("--variants", ",".join(OFFLOAD_VARIANTS),
                                                           "--steps", "4")),)),
        LessonInfo("17", "17_context_parallel", "context parallelism", "context_parallel.py",
                   "torch's own context_parallel runs only on GPUs (CUDA SDPA kernels)",
                   one_gpu_nproc=2,
                   run=Run(gpu_model="llama-tiny", gpu_batch_size=2, cpu_model="llama-tiny", steps=6,
                           quick_steps=4, batch_size=2),
                   # the work per rank and the bytes the ring sends are fixed by the shapes and the layout
                   claims=Claims(columns=("cp", "dp", "score_blocks_per_rank", "forward_sent_bytes",
                                          "backward_sent_bytes", "tokens_per_rank")),
                   # on one GPU: one rank (a ring of one: torch's API and its kernels, against SDPA);
                   # the 2-GPU ring is tests/gpu/test_context_parallel.py
                   gpu_claims=(GpuClaim("17-context-parallel", ("--variants", ",".join(CP_VARIANTS),
                                                                "--steps", "4"), gpu_quick=True),)),
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


def gpu_claims() -> list[GpuClaim]:
    """Every lesson's GPU claims, in lesson order."""
    return [claim for info in LESSONS.values() for claim in info.gpu_claims]


def shared_gpu_runs() -> dict[str, tuple[LessonInfo, SharedGpuRun]]:
    """Every run on ranks sharing one GPU, by key, with its lesson, in lesson order."""
    return {run.key: (info, run) for info in LESSONS.values() for run in info.shared_gpu_runs}
