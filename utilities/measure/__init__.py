"""Measurement: memory by category (PyTorch's own trackers on CPU, the allocator on GPU), timing,
the largest batch that fits, and the memory planner that predicts all of it without the hardware.

``Memory_Maximizer`` (the classic cudaMalloc-retry watcher) stays at ``utilities.Memory_Maximizer``.
"""

from utilities.measure.memory import (
    CATEGORIES,
    MemoryProbe,
    categorize,
    census,
    fmt_bytes,
    gathered_parameter_bytes,
    is_compiled,
    tracker_supported,
    unsharded_parameter_bytes,
)

__all__ = ["CATEGORIES", "MemoryProbe", "categorize", "census", "fmt_bytes", "gathered_parameter_bytes",
           "is_compiled", "tracker_supported", "unsharded_parameter_bytes"]
