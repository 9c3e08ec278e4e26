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


class _VerifyBfloatSupport:
    """The classic checker's name, usable both ways code written against it uses it.

    In the classic FSDP tutorials ``verify_bfloat_support`` is a module-level *boolean* and the
    idiom is ``if verify_bfloat_support: mp_policy = bfSixteen``; this course first shipped it as a
    *function*, ``verify_bfloat_support()``. A plain function object is always truthy, so the classic
    line would pick bf16 on a CPU build or a pre-Ampere GPU. This object answers both: ``bool(it)``
    and ``it()`` each ask ``bf16_ready()`` now (not once at import, so it sees the device the
    process actually uses) and give a plain ``bool``; ``it == False`` compares that answer.
    """

    __slots__ = ()

    def __call__(self) -> bool:
        return bool(bf16_ready())

    def __bool__(self) -> bool:
        return self()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (bool, int)):
            return self() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        report = bf16_ready()
        return f"verify_bfloat_support = {bool(report)} ({report})"


verify_bfloat_support = _VerifyBfloatSupport()
"""True only where native bf16 is ready; also callable: ``verify_bfloat_support()`` is the same bool."""
