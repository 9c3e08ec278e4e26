"""``fsdp-course check``: what this machine offers the course, in one screen."""

from __future__ import annotations

import platform

import torch

from utilities.bf16 import bf16_ready, nccl_version
from utilities.course.catalog import LESSONS
from utilities.devices import visible_gpus


def report() -> dict[str, object]:
    import transformers

    nccl = nccl_version()
    bf16 = bf16_ready()
    gpu_list = visible_gpus()
    lessons = {}
    for num, info in LESSONS.items():
        if not info.ready:
            lessons[num] = "not yet written"
        elif len(gpu_list) == 1 and info.memory_lesson:
            lessons[num] = (f"runs here as {info.one_gpu_nproc} ranks sharing the GPU over gloo "
                            "(per-rank memory is real; step times are not comparable)")
        elif gpu_list:
            lessons[num] = (f"runs here on {len(gpu_list)} GPU(s) with NCCL (gloo for CPU-side "
                            "collectives)")
        else:
            lessons[num] = "runs here on CPU (2 gloo ranks, tiny model)" + (
                f"; {info.gpu_note}" if info.gpu_note else "")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if nccl else None,
        "gpus": gpu_list,
        "bf16_ready": bool(bf16),
        "bf16": str(bf16),
        "lessons": lessons,
    }


def format_report(r: dict[str, object]) -> str:
    lines = [
        f"python {r['python']}, torch {r['torch']}, transformers {r['transformers']}",
        f"CUDA {r['cuda'] or 'none (CPU build)'}, NCCL {r['nccl'] or 'none'}",
    ]
    if r["gpus"]:
        for g in r["gpus"]:
            lines.append(f"GPU {g['index']}: {g['name']}, {g['memory_bytes'] / 1024**3:.1f} GiB "
                         f"(compute {g['capability']}, via {g['source']})")
    else:
        lines.append("GPUs: none visible; lessons run on CPU with 2 gloo ranks and a tiny model")
    lines.append(str(r["bf16"]))
    lines.append("lessons:")
    for num, status in r["lessons"].items():
        lines.append(f"  {num}: {status}")
    return "\n".join(lines)
