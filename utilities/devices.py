"""Where a run goes, decided before torch is loaded: the device, the process-group backend and
how many ranks share a GPU. ``fsdp-course run`` plans a launch with these alone (importing torch
costs seconds per command); ``utilities.distributed`` uses the same functions in every rank.
"""

from __future__ import annotations

import math
import os

from utilities.errors import UsageError, bad_value

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
# What ``--backend auto`` asks for on CUDA: NCCL for GPU tensors, gloo for the CPU-side collectives.
CUDA_BACKEND = "cpu:gloo,cuda:nccl"
# ... and with ranks sharing a GPU, where NCCL refuses to run: gloo for both.
SHARED_GPU_BACKEND = "cpu:gloo,cuda:gloo"
SHARED_GPU_NOTE = "step times host-staged: not comparable"
# What a run records, in place of a number, for an effect its collectives cannot show: gloo on CUDA
# tensors blocks the host thread in every collective and launches no NCCL kernel, so nothing
# overlaps, no all-gather is issued ahead, and a profiler sees no communication kernel at all.
NOT_MEASURABLE = "not measurable here"


def shared_gpu_sentence(ranks: int, per_gpu: int, backend: str, gpus: int | None = None) -> str:
    """What the launcher and every rank say first when ranks share GPUs: one sentence for both."""
    where = f" on {gpus} GPU{'s' if gpus > 1 else ''}" if gpus else ""
    return (f"{ranks} ranks{where}, {per_gpu} per GPU, over {backend} (NCCL refuses two ranks on "
            f"one device): memory per rank is the allocator's own; {SHARED_GPU_NOTE}")


def resolve_device(device: str = "auto") -> str:
    """Turn ``auto`` into ``cuda`` or ``cpu``; refuse ``cuda`` where there is no GPU."""
    if device not in DEVICES:
        raise bad_value("--device", device, DEVICES)
    if device == "cpu":
        return device
    import torch  # only here: the launcher decides everything else without loading torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise UsageError("--device 'cuda' is not allowed: no CUDA GPU is visible here; allowed: cpu, auto")
    return device


def ranks_per_gpu(local_ranks: int, gpus: int) -> int:
    """How many of a node's ``local_ranks`` ranks the busiest of its ``gpus`` GPUs carries
    (rank i runs on GPU ``i % gpus``); 1 when every rank has a GPU of its own."""
    if gpus < 1:
        raise UsageError("no CUDA GPU is visible here; allowed: --device cpu")
    return max(1, math.ceil(local_ranks / gpus))


def resolve_backend(device: str, backend: str = "auto", shared_gpu: bool = False) -> str:
    """The backend string for ``init_process_group``.

    ``auto``: ``gloo`` on CPU; on CUDA ``cpu:gloo,cuda:nccl`` (a CPU backend beside NCCL, for
    ``dcp.async_save`` and CPU-tensor all-reduces), or ``cpu:gloo,cuda:gloo`` when ranks share a
    GPU. A forced ``nccl`` on CUDA is NCCL for the GPU tensors with that same gloo beside it (an
    NCCL-only group fails the course's CPU-side collectives: lesson 08's ``dcp.async_save``, lesson
    09's evaluation); a forced ``gloo`` is used as given; ``nccl`` is refused on CPU and on a shared
    GPU, where NCCL cannot run.
    """
    if backend not in BACKENDS:
        raise bad_value("--backend", backend, BACKENDS)
    if device == "cuda" and shared_gpu:
        if backend == "nccl":
            raise UsageError("--backend 'nccl' is not allowed with several ranks sharing a GPU "
                             "(NCCL refuses two ranks on one device); allowed: gloo, auto")
        return SHARED_GPU_BACKEND if backend == "auto" else backend
    if backend == "auto":
        return CUDA_BACKEND if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise UsageError("--backend 'nccl' is not allowed with --device cpu; allowed: gloo")
    return CUDA_BACKEND if backend == "nccl" else backend


def visible_gpus() -> list[dict[str, object]]:
    """Name and memory of each visible GPU, from NVML where present, else from torch."""
    import torch

    out = []
    if not torch.cuda.is_available():
        return out
    try:
        import pynvml

        pynvml.nvmlInit()
        nvml = True
    except Exception:
        nvml = False
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        row: dict[str, object] = {"index": i, "name": props.name, "memory_bytes": props.total_memory,
                                  "capability": f"{props.major}.{props.minor}", "source": "torch"}
        if nvml:
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(physical_gpu_index(i))
                row["memory_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
                row["driver"] = pynvml.nvmlSystemGetDriverVersion()
                row["source"] = "nvml"
            except Exception:
                pass
        out.append(row)
    if nvml:
        pynvml.nvmlShutdown()
    return out


def physical_gpu_index(index: int) -> int:
    """The index NVML knows a visible GPU by (``CUDA_VISIBLE_DEVICES`` renumbers them for torch)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(ids) and ids[index].isdigit():
            return int(ids[index])
    return index
