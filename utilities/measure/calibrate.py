"""Calibrate the step-time model on the GPU at hand: ``fsdp-course plan --calibrate``.

The time model (``utilities.measure.step_time``) turns FLOPs and bytes into seconds with a few
efficiencies: the fraction of the datasheet peak a GEMM reaches, the fraction a fused attention
reaches, the fraction of the HBM bandwidth a memory-bound op reaches. Its defaults are fitted on
published figures (``benchmarks/time_model_check.py``). Here the three are measured on this GPU in
well under a minute, each the median of timed repetitions after a warm-up:

* a bf16 matrix multiplication, 8192 x 8192 x 8192 (2 n^3 FLOPs);
* causal ``scaled_dot_product_attention``, batch 4 x 32 heads x 2048 tokens x head dim 128 (the
  FLOPs FlashAttention does: 2 matmuls of 2 b h s^2 d, halved by the causal mask);
* a memory-bound ``x * 2`` over 1 GiB (reads and writes 2 GiB).

The all-gather's bandwidth needs 2 or more GPUs in one job: this single process does not measure it
(the interconnect constants stay the published ones, and the result file says so). The result is
saved as JSON; ``fsdp-course plan --calibration FILE`` predicts with it.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from utilities.errors import UsageError


def _median_seconds(fn: Callable[[], Any], device: torch.device, warmup: int = 3, iters: int = 10) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(gpu, device: torch.device, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """The three efficiencies of ``gpu`` (a ``step_time.GPU``), measured on ``device``. ``sizes``
    shrinks the problems (the CPU twin in the tests); a GPU uses the defaults above."""
    n = (sizes or {}).get("matmul", 8192)
    b, h, s, d = (sizes or {}).get("attention", (4, 32, 2048, 128))
    elements = (sizes or {}).get("memory", 2**29)  # bf16: 1 GiB
    dtype = torch.bfloat16
    peak = gpu.peak_flops["bf16"]

    a, w = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul_s = _median_seconds(lambda: a @ w, device)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    attention_s = _median_seconds(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), device)
    x = torch.empty(elements, device=device, dtype=dtype)
    memory_s = _median_seconds(lambda: x * 2, device)
    moved = 2 * x.numel() * x.element_size()
    measured = {"matmul_tflops": 2 * n**3 / matmul_s / 1e12,
                "attention_tflops": 2 * 2 * b * h * s * s * d / 2 / attention_s / 1e12,
                "memory_gbytes_per_s": moved / memory_s / 1e9}
    return {
        "gpu": gpu.name, "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                         else "cpu"),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sizes": {"matmul": n, "attention": [b, h, s, d], "memory_elements": elements},
        "measured": measured,
        "efficiencies": {"matmul": measured["matmul_tflops"] * 1e12 / peak,
                         "attention": measured["attention_tflops"] * 1e12 / peak,
                         "memory": measured["memory_gbytes_per_s"] * 1e9 / gpu.hbm_bytes_per_s},
        "not_measured": "the interconnect (an all-gather needs 2+ GPUs in one job): the published "
                        "NCCL constants stay",
    }


def catalogue_part(device_name: str, memory_bytes: int) -> str | None:
    """The step-time catalogue's part for a GPU as torch names it (``get_device_name``) with its
    memory, or None for one the catalogue does not hold (then ``--gpu`` names it)."""
    name = device_name.upper()
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-96gb" if memory_bytes > 90 * 2**30 else "h100"
    if "A100" in name:
        return "a100-80gb" if memory_bytes > 60 * 2**30 else "a100-40gb"
    if name.endswith(" L4") or " L4 " in name:
        return "l4"
    return None


def calibrate(gpu_name: str | None, out: str | Path, device: torch.device | None = None) -> dict[str, Any]:
    """Measure on this machine's GPU 0 and save to ``out``; one line without a GPU. ``gpu_name``:
    the catalogue part measured (default: GPU 0's, ``catalogue_part``; an H100's where the
    catalogue has none)."""
    from utilities.measure.gpu_catalogue import get_gpu

    if device is None:
        if not torch.cuda.is_available():
            raise UsageError("--calibrate needs a CUDA GPU and none is visible here; without one, "
                             "plan uses the committed efficiencies (benchmarks/results/"
                             "time_model_check.json)")
        device = torch.device("cuda", 0)
    if gpu_name is None and device.type == "cuda":
        gpu_name = catalogue_part(torch.cuda.get_device_name(device),
                                  torch.cuda.get_device_properties(device).total_memory)
    result = measure(get_gpu(gpu_name or "h100"), device)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def load_efficiencies(path: str | Path):
    """The step-time model's efficiencies with a calibration file's measured ones in place."""
    from utilities.json_input import read_json
    from utilities.measure.gpu_catalogue import CALIBRATED, with_efficiencies

    try:
        data = read_json(path)
    except UsageError as e:
        raise UsageError(f"--calibration {str(path)!r} is not allowed: {e}; allowed: a file "
                         "`fsdp-course plan --calibrate` wrote") from None
    try:
        values = {k: float(data["efficiencies"][k]) for k in ("matmul", "attention", "memory")}
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--calibration {str(path)!r} is not allowed: not a calibration file "
                         f"({type(e).__name__}); allowed: a file `fsdp-course plan --calibrate` "
                         "wrote") from None
    if not all(0 < v <= 1.5 for v in values.values()):
        raise UsageError(f"--calibration {str(path)!r} is not allowed: efficiencies {values} outside "
                         "(0, 1.5]; allowed: a file `fsdp-course plan --calibrate` wrote")
    return with_efficiencies(CALIBRATED, **values, per_gpu=rebased_parts(data.get("gpu")))


def rebased_parts(measured_on: str | None) -> dict[str, dict[str, float]]:
    """``CALIBRATED.per_gpu`` for efficiencies measured on ``measured_on``: that part takes them as
    measured (its own tensor-core fraction is in the measurement); every other part scales them
    by its fraction over the measured part's (its other fields as before)."""
    from utilities.measure.gpu_catalogue import CALIBRATED, GPUS

    parts = {name: CALIBRATED.part(name) for name in GPUS}
    base = parts.get(measured_on, {}).get("tensor", 1.0)
    out = {name: dict(over, tensor=over.get("tensor", 1.0) / base) for name, over in parts.items()}
    if measured_on in out:
        out[measured_on] = {}
    return out
