"""The course's lessons: number, folder, title, script. A lesson is "ready" when its script exists.

``one_gpu_nproc`` is how many ranks a lesson runs on a machine with one GPU. A lesson whose point
is per-rank memory (what sharding saves) teaches nothing at world size 1, where FSDP shards
nothing: it runs 2 ranks sharing the GPU (``utilities.distributed``: gloo, host-staged
collectives, true per-rank allocator figures). Lessons 01 (unsharded parameters at the peak), 06
(bytes per rank vs theory), 11 (``limit_all_gathers``: with one rank FSDP1 runs NO_SHARD and has no
all-gather to limit) and 14 (the planner at N ranks) need ranks to shard over. The others keep 1
rank: 02's activations are per-rank batch memory that sharding does not change (and its
batch search to the edge of memory needs the GPU to itself), and the rest measure time, numerics
or state that one rank shows as well.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from utilities.errors import bad_value

REPO_ROOT = Path(__file__).resolve().parents[2]
LESSONS_DIR = REPO_ROOT / "lessons"


@dataclass(frozen=True)
class LessonInfo:
    number: str
    folder: str
    title: str
    script: str
    gpu_note: str = ""  # what only a GPU shows, for the learning path
    one_gpu_nproc: int = 1  # ranks on a one-GPU machine (2: a per-rank memory lesson)
    # (model, batch) on GPU / with --quick, for scripts that do not use ``Lesson`` (see
    # ``run_defaults``); None: read from the script's ``Lesson(...)`` call.
    defaults: tuple[tuple[str, int], tuple[str, int]] | None = None

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
                   one_gpu_nproc=2),
        LessonInfo("02", "02_activation_checkpointing", "activation checkpointing",
                   "activation_checkpointing.py"),
        LessonInfo("03", "03_full_state_dict", "full state dict save/load", "full_state_dict.py"),
        LessonInfo("04", "04_backward_prefetch", "backward prefetch", "backward_prefetch.py",
                   "overlap of communication and compute shows only on GPUs"),
        LessonInfo("05", "05_memory_maximizer", "memory maximizer (cudaMalloc retries)",
                   "memory_maximizer.py", "cudaMalloc retries exist only on GPUs"),
        LessonInfo("06", "06_sharding_strategies", "sharding strategies", "sharding_strategies.py",
                   one_gpu_nproc=2),
        LessonInfo("07", "07_mixed_precision", "mixed precision (+ bf16 checker)",
                   "mixed_precision.py", "bf16 speed-ups need a GPU"),
        LessonInfo("08", "08_local_state_dict", "local / sharded state dict (distributed checkpoint)",
                   "sharded_state_dict.py"),
        LessonInfo("09", "09_fine_tuning", "fine-tuning (freezing, child-tuning)", "fine_tuning.py"),
        LessonInfo("10", "10_end_to_end", "end-to-end training codebase", "train.py",
                   defaults=(("llama-1b", 4), ("llama-tiny", 8))),
        LessonInfo("11", "11_rate_limiter", "rate limiter (limit_all_gathers)", "rate_limiter.py",
                   "the caching allocator's over-reservation exists only on GPUs", one_gpu_nproc=2),
        LessonInfo("12", "12_tensor_parallel", "tensor + 2-D parallel", "tensor_parallel.py"),
        LessonInfo("13", "13_fp8_compile", "FP8 training with torch.compile", "fp8_compile.py",
                   "FP8 needs a Hopper / Ada or newer GPU"),
        LessonInfo("14", "14_memory_planner", "memory planning without the hardware",
                   "memory_planner.py", one_gpu_nproc=2),
    )
}


def get_lesson(number: str) -> LessonInfo:
    """Find a lesson by number ("1", "01"); an unknown number is a one-line error."""
    key = number.zfill(2) if number.isdigit() else number
    if key not in LESSONS:
        raise bad_value("lesson", number, list(LESSONS) + ["all"])
    return LESSONS[key]


def run_defaults(info: LessonInfo, quick: bool) -> tuple[str, int]:
    """The model and per-rank batch a lesson runs by default on GPU (or with ``--quick``).

    The launcher plans the memory of ranks that share a GPU before it starts them, so it needs
    these numbers; the lesson script is their only source. They are read from the keywords of its
    ``Lesson(...)`` call (``gpu_model``, ``gpu_batch_size``, ``batch_size``; a module-level constant
    is followed), without running it, falling back to ``Lesson``'s own defaults. Scripts that do
    not use ``Lesson`` carry theirs in the catalog (``defaults``).
    """
    if info.defaults is not None:
        return info.defaults[1] if quick else info.defaults[0]
    import inspect

    from utilities.course.lesson import CPU_MODEL, Lesson

    params = inspect.signature(Lesson.__init__).parameters
    found = {k: params[k].default for k in ("gpu_model", "batch_size", "gpu_batch_size")}
    found.update(_lesson_call_keywords(info.script_path))
    batch = found["batch_size"]
    if quick:
        return CPU_MODEL, int(batch)
    return str(found["gpu_model"]), int(found["gpu_batch_size"] or batch)


def _lesson_call_keywords(script: Path) -> dict[str, object]:
    """Constant keywords of the first ``Lesson(...)`` call in ``script`` (names resolved through
    the module's top-level constant assignments, tuple unpacking included)."""
    tree = ast.parse(script.read_text())
    constants: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple)
                     and isinstance(value, ast.Tuple) else [(target, value)])
            for t, v in pairs:
                if isinstance(t, ast.Name) and isinstance(v, ast.Constant):
                    constants[t.id] = v.value
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Lesson":
            out = {}
            for kw in node.keywords:
                if isinstance(kw.value, ast.Constant):
                    out[kw.arg] = kw.value.value
                elif isinstance(kw.value, ast.Name) and kw.value.id in constants:
                    out[kw.arg] = constants[kw.value.id]
            return out
    return {}
