"""``Memory_Maximizer``: watch the CUDA caching allocator while you train.

The classic insight: the fastest batch size is not the largest that avoids OOM, but the largest
that avoids cudaMalloc retries. A retry happens when the allocator cannot find a free cached block,
frees its whole cache and calls cudaMalloc again: a stall on every step. This class records reserved
memory per update and reads the retry and OOM counters, and advises a smaller batch when retries
happen. Without a GPU it says so once and does nothing else: it never breaks a training script.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from utilities.devices import physical_gpu_index

GB = 1024**3


def gpu_total_memory(device: int = 0) -> tuple[int, str]:
    """Total memory of the GPU in bytes and where the number came from (NVML, else torch)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(physical_gpu_index(device))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        free, total = torch.cuda.mem_get_info(device)
        return int(total), "torch.cuda.mem_get_info"


class Memory_Maximizer:  # noqa: N801 - the classic lessons' name, kept for their users
    """Track reserved memory, max reserved, cudaMalloc retries and OOMs over a training run.

    Call ``start()`` before training, ``update()`` once per epoch or mini-batch, ``stop()`` at the
    end (prints and returns the report); ``summary()`` returns the report at any time. Also a
    context manager: ``with Memory_Maximizer() as mm: ... mm.update()``.
    """

    def __init__(self, device: int | str | torch.device | None = None, verbose: bool = True):
        self.verbose = verbose
        self.enabled = torch.cuda.is_available()
        self.device = None
        if self.enabled:
            d = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            self.device = d.index if d.index is not None else torch.cuda.current_device()
        self.total_bytes: int | None = None
        self.total_source: str | None = None
        self.reserved_gb: list[float] = []
        self.reserved_pct: list[float] = []
        self.started = False
        self._final: dict[str, Any] | None = None  # the report stop() printed
        self._retries_at_start = 0
        self._ooms_at_start = 0
        self._warned = False

    # -- the classic API -------------------------------------------------------------------
    def start(self) -> None:
        if not self._gpu():
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        stats = torch.cuda.memory_stats(self.device)
        self._retries_at_start = stats.get("num_alloc_retries", 0)
        self._ooms_at_start = stats.get("num_ooms", 0)
        self.total_bytes, self.total_source = gpu_total_memory(self.device)
        self.reserved_gb.clear()
        self.reserved_pct.clear()
        self._final = None
        self.started = True
        self._say(f"Memory_Maximizer started: GPU {self.device} total "
                  f"{self.total_bytes / GB:.2f} GB (via {self.total_source})")

    def update(self) -> None:
        if not self._gpu():
            return
        if not self.started:
            self.start()
        reserved = torch.cuda.memory_reserved(self.device)
        self.reserved_gb.append(round(reserved / GB, 4))
        self.reserved_pct.append(round(100 * reserved / self.total_bytes, 2))

    def stop(self, verbose: bool | None = None) -> dict[str, Any]:
        """End the run: print the report (if ``verbose``; default: the constructor's ``verbose``)
        and return it. ``stop(verbose=True)`` also prints every update's reserved memory, as the
        classic ``stop(verbose=...)`` did."""
        report = self.summary()
        say = self.verbose if verbose is None else verbose
        if report.get("gpu") and say:
            self._say(self.format(report), force=True)
            if verbose:
                self._say(f"  every update (GB): {report['reserved_gb']}\n"
                          f"  every update (% of GPU): {report['reserved_pct']}", force=True)
        self.started = False
        self._final = report
        return report

    def summary(self) -> dict[str, Any]:
        if not self._gpu():
            return {"gpu": False, "message": "no CUDA GPU: Memory_Maximizer records nothing"}
        if not self.started:
            if self._final is not None:  # after stop(): the report of the run that ended
                return self._final
            self.start()
        stats = torch.cuda.memory_stats(self.device)
        retries = stats.get("num_alloc_retries", 0) - self._retries_at_start
        ooms = stats.get("num_ooms", 0) - self._ooms_at_start
        max_reserved = torch.cuda.max_memory_reserved(self.device)
        return {
            "gpu": True,
            "device": torch.cuda.get_device_name(self.device),
            "total_gb": round(self.total_bytes / GB, 3),
            "total_source": self.total_source,
            "reserved_gb": list(self.reserved_gb),
            "reserved_pct": list(self.reserved_pct),
            "max_reserved_gb": round(max_reserved / GB, 3),
            "max_reserved_pct": round(100 * max_reserved / self.total_bytes, 2),
            "max_allocated_gb": round(torch.cuda.max_memory_allocated(self.device) / GB, 3),
            "cuda_malloc_retries": int(retries),
            "ooms": int(ooms),
            "advice": self._advice(retries, ooms),
        }

    @staticmethod
    def format(report: dict[str, Any]) -> str:
        if not report.get("gpu"):
            return report["message"]
        lines = [
            f"Memory_Maximizer report for {report['device']} ({report['total_gb']:.2f} GB):",
            f"  max reserved {report['max_reserved_gb']:.2f} GB = {report['max_reserved_pct']:.1f}% "
            f"of the GPU (max allocated {report['max_allocated_gb']:.2f} GB)",
            f"  reserved per update (GB): {report['reserved_gb'][-10:]}",
            f"  cudaMalloc retries: {report['cuda_malloc_retries']}, OOMs: {report['ooms']}",
            f"  {report['advice']}",
        ]
        return "\n".join(lines)

    @staticmethod
    def _advice(retries: int, ooms: int) -> str:
        if ooms:
            return "out-of-memory errors happened: lower the batch size."
        if retries:
            return ("cudaMalloc retries happened: each one stalls a step while the allocator "
                    "frees its cache. Lower the batch size until retries are 0; that batch is "
                    "usually faster than the largest one that fits.")
        return "no cudaMalloc retries: you may be able to raise the batch size."

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> Memory_Maximizer:
        self.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    _said_no_gpu = False  # the notice is the process's, not each watcher's: said once

    def _gpu(self) -> bool:
        if not self.enabled and not self._warned and not Memory_Maximizer._said_no_gpu:
            self._warned = Memory_Maximizer._said_no_gpu = True
            self._say("Memory_Maximizer: no CUDA GPU here, so there is no caching allocator to "
                      "watch; it will record nothing.")
        return self.enabled

    # -- the classic attribute names, read-only (0 / [] where nothing was recorded) -------------
    def _classic_report(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        if self._final is not None and not self.started:
            return self._final
        return self.summary() if self.started else None

    @property
    def m_total_gpu_memory(self) -> float:
        """Total GPU memory in GB (GiB), as the classic attribute."""
        return round((self.total_bytes or 0) / GB, 4)

    @property
    def m_reserved_memory_list(self) -> list[float]:
        return list(self.reserved_gb)

    @property
    def m_reserved_memory_pct(self) -> list[float]:
        return list(self.reserved_pct)

    @property
    def m_num_retries(self) -> int:
        report = self._classic_report()
        return report["cuda_malloc_retries"] if report else 0

    @property
    def m_cuda_ooms(self) -> int:
        report = self._classic_report()
        return report["ooms"] if report else 0

    m_total_ooms = m_cuda_ooms

    @property
    def m_max_reserved(self) -> float:
        report = self._classic_report()
        return report["max_reserved_gb"] if report else 0

    def _say(self, text: str, force: bool = False) -> None:
        if self.verbose or force:
            from utilities.distributed import is_main

            if is_main():
                print(text, file=sys.stdout, flush=True)
