"""The course's lessons: number, folder, title, script. A lesson is "ready" when its script exists."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import bad_value

REPO_ROOT = Path(__file__).resolve().parent.parent
LESSONS_DIR = REPO_ROOT / "lessons"


@dataclass(frozen=True)
class LessonInfo:
    number: str
    folder: str
    title: str
    script: str
    gpu_note: str = ""  # what only a GPU shows, for the learning path

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


LESSONS: dict[str, LessonInfo] = {
    info.number: info
    for info in (
        LessonInfo("01", "01_auto_wrap", "transformer auto-wrap", "auto_wrap.py"),
        LessonInfo("02", "02_activation_checkpointing", "activation checkpointing",
                   "activation_checkpointing.py"),
        LessonInfo("03", "03_full_state_dict", "full state dict save/load", "full_state_dict.py"),
        LessonInfo("04", "04_backward_prefetch", "backward prefetch", "backward_prefetch.py",
                   "overlap of communication and compute shows only on GPUs"),
        LessonInfo("05", "05_memory_maximizer", "memory maximizer (cudaMalloc retries)",
                   "memory_maximizer.py", "cudaMalloc retries exist only on GPUs"),
        LessonInfo("06", "06_sharding_strategies", "sharding strategies", "sharding_strategies.py"),
        LessonInfo("07", "07_mixed_precision", "mixed precision (+ bf16 checker)",
                   "mixed_precision.py", "bf16 speed-ups need a GPU"),
        LessonInfo("08", "08_local_state_dict", "local / sharded state dict (distributed checkpoint)",
                   "sharded_state_dict.py"),
        LessonInfo("09", "09_fine_tuning", "fine-tuning (freezing, child-tuning)", "fine_tuning.py"),
        LessonInfo("10", "10_end_to_end", "end-to-end training codebase", "train.py"),
        LessonInfo("11", "11_rate_limiter", "rate limiter (limit_all_gathers)", "rate_limiter.py",
                   "the caching allocator's over-reservation exists only on GPUs"),
        LessonInfo("12", "12_tensor_parallel", "tensor + 2-D parallel", "tensor_parallel.py"),
        LessonInfo("13", "13_fp8_compile", "FP8 training with torch.compile", "fp8_compile.py",
                   "FP8 needs a Hopper / Ada or newer GPU"),
        LessonInfo("14", "14_memory_planner", "memory planning without the hardware",
                   "memory_planner.py"),
    )
}


def get_lesson(number: str) -> LessonInfo:
    """Find a lesson by number ("1", "01"); an unknown number is a one-line error."""
    key = number.zfill(2) if number.isdigit() else number
    if key not in LESSONS:
        raise bad_value("lesson", number, list(LESSONS) + ["all"])
    return LESSONS[key]
