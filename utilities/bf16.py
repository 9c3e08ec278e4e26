"""Is native bf16 ready here? The classic checker, rewritten without ``pkg_resources``.

``bf16_ready()`` returns a report that is truthy only when every requirement holds and lists each
one that does not, so a training script can pick its precision and tell the user why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bf16Report:
    """``bool(report)`` is the answer; ``reasons`` says what is missing; ``details`` what was seen."""

    ready: bool
    reasons: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ready

    def __str__(self) -> str:
        if self.ready:
            return "bf16 ready: " + ", ".join(f"{k} {v}" for k, v in self.details.items())
        return "bf16 not ready: " + "; ".join(self.reasons)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def nccl_version() -> tuple[int, ...] | None:
    """NCCL's version as a tuple, or None where this torch has no NCCL."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()):
            return None
        v = torch.cuda.nccl.version()
    except Exception:
        return None
    return tuple(v) if isinstance(v, tuple) else (v // 1000, (v % 1000) // 100, v % 100)


def bf16_ready() -> Bf16Report:
    """Native bf16 needs CUDA >= 11, a GPU that supports it (Ampere and newer) and NCCL >= 2.10."""
    reasons: list[str] = []
    details: dict[str, str] = {}
    cuda = torch.version.cuda
    if not cuda:
        reasons.append("this torch build has no CUDA (a CPU build)")
    else:
        details["CUDA"] = cuda
        if _version_tuple(cuda) < (11,):
            reasons.append(f"CUDA {cuda} is older than 11.0")
    if not torch.cuda.is_available():
        reasons.append("no CUDA GPU is visible")
    else:
        name = torch.cuda.get_device_name()
        details["GPU"] = name
        major, minor = torch.cuda.get_device_capability()
        details["compute capability"] = f"{major}.{minor}"
        # Not torch.cuda.is_bf16_supported(): by default it also says yes to emulated bf16 (V100, T4).
        if major < 8:
            reasons.append(f"GPU {name} (compute capability {major}.{minor}) has no native bf16 "
                           "(needs 8.0+: Ampere or newer)")
    nccl = nccl_version()
    if nccl is None:
        reasons.append("NCCL is not available in this torch build")
    else:
        details["NCCL"] = ".".join(map(str, nccl))
        if nccl < (2, 10):
            reasons.append(f"NCCL {details['NCCL']} is older than 2.10")
    return Bf16Report(not reasons, reasons, details)


def verify_bfloat_support() -> bool:
    """The classic checker's name and plain-bool answer, for code written against it."""
    return bool(bf16_ready())
