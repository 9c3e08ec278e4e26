"""Peak memory by category: parameters, gradients, optimizer state, activations.

The categories come from PyTorch's own trackers in ``torch.distributed._tools``, on CPU and GPU
alike: ``FSDPMemTracker`` for FSDP2 models (it also separates sharded from unsharded parameters and
the all-gather / reduce-scatter buffers) and ``MemTracker`` for everything else. They sit at the
dispatcher, attribute every tensor allocation to a category, and record the breakdown at the peak;
they are written for CUDA (they round each storage up to the caching allocator's 512-byte blocks).
On CPU, where there is no allocator to ask, the tracker's total is the total. On GPU the total is
``torch.cuda.max_memory_allocated`` (what the allocator really held, the figure every GPU
comparison uses); the tracker's own total is kept beside it (``detail.tracker_total``), and
``activations`` is what the tracker attributed to them. Where no tracker can follow the step (a
``torch.compile``-d model on GPU: inductor allocates its buffers below the dispatcher), the
categories are a census of the resident state and ``activations`` is the rest of the allocator's
peak.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from utilities.errors import UsageError
from utilities.torch_internals import fsdp_mem_tracker, global_peak_only

CATEGORIES = ("total", "parameters", "gradients", "optimizer", "activations")

# tracker category name -> (course category, detail key)
_TRACKER_MAP = {
    "Parameter": ("parameters", "parameters"),
    "Sharded Param": ("parameters", "sharded_parameters"),
    "Unsharded Param": ("parameters", "unsharded_parameters"),
    "Buffer": (None, "buffers"),
    "Gradient": ("gradients", "gradients"),
    "Sharded Grad": ("gradients", "sharded_gradients"),
    "Unsharded Grad": ("gradients", "unsharded_gradients"),
    "Activation": ("activations", "activations"),
    "Optstate": ("optimizer", "optimizer"),
    "OptState": ("optimizer", "optimizer"),
    "Temp": (None, "temporaries"),
    "All Gather": (None, "all_gather"),
    "Reduce Scatter": (None, "reduce_scatter"),
    "Inputs": (None, "inputs"),
    "Other": (None, "other"),
}


def _is_fsdp2(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


class MemoryProbe:
    """Context manager that records peak memory by category over the code it wraps.

    >>> with MemoryProbe(model, optimizer, device) as probe:
    ...     train_step()
    >>> probe.peak  # {"total": ..., "parameters": ..., ..., "detail": {...}}
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 device: torch.device, use_tracker: bool | None = None):
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        self.why_census: str | None = None
        if use_tracker is None:  # the same path on CPU and GPU, except where a tracker is blind
            use_tracker = not (self.device.type == "cuda" and is_compiled(model))
            if not use_tracker:
                self.why_census = "torch.compile on GPU: inductor's buffers bypass the tracker"
        self.use_tracker = use_tracker
        if self.use_tracker and not tracker_supported(model):
            self.use_tracker = False
            self.why_census = "FSDP1 use_orig_params: this torch's MemTracker cannot follow it"
        self.peak: dict[str, Any] = {}
        self._tracker = None

    def __enter__(self) -> MemoryProbe:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.use_tracker:
            self._tracker = _make_tracker(self.model, self.optimizer)
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            # The module tracker warns for FSDP1's hook-less backward wrappers; the numbers stand.
            warnings.filterwarnings("ignore", message="Module is None")
            self._hooks = TrackerHooks().__enter__()  # or the tracker keeps the model alive
            self._tracker.__enter__()
        return self

    def next_iteration(self) -> None:
        """Between two forward/backward passes inside one probe (micro-batches): the trackers
        refuse a module's second forward until its per-module statistics are cleared; the peak
        over both passes is kept."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def __exit__(self, *exc) -> None:
        if self._tracker is not None:
            try:
                self._tracker.__exit__(*exc)
            except Exception:
                if exc[0] is None:
                    raise
                # The step already failed (a batch search's out-of-memory, say): let its own
                # exception through, not the tracker's complaint about the half-done step.
            finally:
                self._hooks.__exit__(*exc)
                self._warnings.__exit__(*exc)
        if exc[0] is not None:
            return
        resident = census(self.model, self.optimizer)
        if self._tracker is not None:
            snaps = self._tracker.get_tracker_snapshot("peak")
            snap = _device_snapshot(snaps, self.device)
            self.peak = categorize(snap)
            self.peak["detail"]["method"] = type(self._tracker).__name__
        else:
            self.peak = dict(resident, detail={"method": "census"})
            if self.why_census:
                self.peak["detail"]["why_census"] = self.why_census
        # What stays allocated between steps: the sharded state each rank keeps.
        self.peak["detail"]["resident_after_step"] = {
            k: resident[k] for k in ("parameters", "gradients", "optimizer")}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if self.use_tracker:
                self.peak["detail"]["tracker_total"] = self.peak["total"]
            self.peak["total"] = int(torch.cuda.max_memory_allocated(self.device))
            self.peak["detail"]["total_from"] = "torch.cuda.max_memory_allocated"
            self.peak["detail"]["max_reserved"] = int(torch.cuda.max_memory_reserved(self.device))
            if not self.use_tracker:
                known = sum(self.peak[c] for c in ("parameters", "gradients", "optimizer"))
                self.peak["activations"] = max(0, self.peak["total"] - known)


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or any of its submodules is ``torch.compile``-d (in place or wrapped)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None
               or type(m).__name__ == "OptimizedModule" for m in model.modules())


def tracker_supported(model: nn.Module) -> bool:
    """Whether a tracker can follow ``model``: always, except FSDP1 with ``use_orig_params=True``
    on a torch whose ``MemTracker`` lacks the method we adjust for it (see ``_mem_tracker``)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not any(isinstance(m, FSDP) and m._use_orig_params for m in model.modules()):
        return True
    return hasattr(MemTracker, "_track_module_params_and_buffers")


def _make_tracker(model: nn.Module, optimizer):
    if _is_fsdp2(model):
        return global_peak_only(fsdp_mem_tracker()(model, optimizer))
    tracker = global_peak_only(_mem_tracker())
    tracker.track_external(*(x for x in (model, optimizer) if x is not None))
    return tracker


def _mem_tracker():
    """A ``MemTracker`` that also follows FSDP1 with ``use_orig_params=True``.

    In forward, such a module's parameters are views into FSDP's flat parameter (not leaves), and
    ``MemTracker`` fails registering its per-parameter gradient hooks on them (as it does on frozen
    parameters, which need no gradient). We skip those hooks for such modules only: every allocation
    is still seen (the tracker works at the dispatcher), and the flat parameter's gradient is still
    counted when it lands. Measured on a 4-block MLP on 2 ranks: the same peak, byte for byte and
    category by category, as with ``use_orig_params=False``.
    """
    from torch.distributed._tools.mem_tracker import MemTracker as _MemTracker

    class MemTracker(_MemTracker):  # the name results.json reports as the method
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            if any(not (p.is_leaf and p.requires_grad) for p in module.parameters()):
                install_grad_hooks = False  # views (use_orig_params) or frozen parameters
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return MemTracker()


def _device_snapshot(snaps: dict, device: torch.device) -> dict[str, int]:
    for dev, snap in snaps.items():
        if torch.device(dev).type == device.type:
            return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    return {}


def categorize(snap: dict[str, int]) -> dict[str, Any]:
    """Fold a tracker snapshot into the course's categories, keeping the fine detail."""
    out: dict[str, Any] = {c: 0 for c in CATEGORIES}
    detail: dict[str, int] = {}
    for name, nbytes in snap.items():
        if name == "Total":
            out["total"] = nbytes
            continue
        course, key = _TRACKER_MAP.get(name, (None, name.lower().replace(" ", "_")))
        detail[key] = detail.get(key, 0) + nbytes
        if course:
            out[course] += nbytes
    out["detail"] = detail
    return out


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes this rank holds of ``t``: a DTensor's local shard, any other tensor whole."""
    local = getattr(t, "_local_tensor", t)  # a DTensor holds only its local shard
    return local.numel() * local.element_size()


def census(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Bytes held right now by this rank's parameters, gradients and optimizer state."""
    params = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"total": params + grads + opt, "parameters": params, "gradients": grads,
            "optimizer": opt, "activations": 0, "detail": {}}




def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard


def shard_numels(model: nn.Module) -> dict[int, int]:
    """Each parameter's local size now, by ``id``: taken while the model is sharded (before its
    first forward: a forward without backward, an eval's, leaves FSDP2's root unit unsharded), it
    says later which gradients are shard-sized (``live_gradient_bytes``)."""
    return {id(p): _local(p).numel() for p in model.parameters()}


def live_gradient_bytes(model: nn.Module, shards: dict[int, int] | None = None) -> dict[str, int]:
    """Bytes of every gradient alive right now on this rank, split by whether it is a sharded one.

    ``sharded``: the storages behind the gradients of the model's own parameters whose size is the
    parameter's shard (``shards``, from ``shard_numels`` taken while the model was sharded; default:
    the parameters' local sizes now): what a reduce-scatter leaves. ``unsharded``: every other
    gradient storage alive, found on any live ``nn.Parameter``: the full-size gradients FSDP keeps
    while gradient synchronization is off (FSDP2's ``set_requires_gradient_sync(False)``, FSDP1's
    ``no_sync()``), before any reduce-scatter. Read between two micro-batches, it shows what
    accumulating without synchronizing holds."""
    import gc

    shards = shard_numels(model) if shards is None else shards
    own = list(model.parameters())
    found = [o for o in gc.get_objects() if isinstance(o, nn.Parameter)]
    size: dict[int, int] = {}  # every gradient storage alive: its bytes
    shard_sized: dict[int, bool] = {}  # whether every gradient of the model's on it is shard-sized
    for p in [*own, *found]:
        grad = p.grad
        if grad is None or grad.is_meta:
            continue
        storage = _local(grad).untyped_storage()
        size[storage.data_ptr()] = storage.nbytes()
        if id(p) in shards:  # FSDP1 keeps its parameters' gradients as views of one flat storage
            fits = _local(grad).numel() == shards[id(p)]
            shard_sized[storage.data_ptr()] = shard_sized.get(storage.data_ptr(), True) and fits
    sharded = {ptr for ptr, fits in shard_sized.items() if fits}
    return {"sharded": sum(size[ptr] for ptr in sharded),
            "unsharded": sum(n for ptr, n in size.items() if ptr not in sharded)}


def unsharded_parameter_bytes(peak: dict[str, Any]) -> int | None:
    """Bytes of all-gathered (unsharded) parameters alive at the peak, from a tracker's breakdown.

    FSDP2's tracker reports them directly; for FSDP1 they are what the parameters held at the peak
    beyond the sharded flat parameters each rank always keeps.
    """
    detail = peak.get("detail", {})
    if "unsharded_parameters" in detail:
        return int(detail["unsharded_parameters"])
    if detail.get("method") == "MemTracker":
        return int(peak["parameters"] - detail["resident_after_step"]["parameters"])
    return None


def gathered_parameter_bytes(peak: dict[str, Any]) -> int | None:
    """Bytes of gathered parameters alive at the peak: the unsharded parameters plus the all-gather
    buffers holding blocks gathered ahead of use (FSDP2 copies a prefetched block out of its buffer
    only when the block runs). FSDP1 gathers straight into its unsharded flat parameters, so for it
    this is ``unsharded_parameter_bytes``."""
    unsharded = unsharded_parameter_bytes(peak)
    if unsharded is None:
        return None
    return unsharded + int(peak.get("detail", {}).get("all_gather", 0))


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


class TrackerHooks:
    """Remove the autograd hooks that PyTorch's memory trackers leave behind.

    ``torch.distributed._tools``' ``ModTracker`` (inside ``MemTracker`` and ``FSDPMemTracker``)
    registers ``register_multi_grad_hook`` on every module's inputs and drops the handles. Each
    hook's closure holds the autograd nodes it is registered on, a loop through C++ that the garbage
    collector cannot see: the whole graph of the measured step, and with it every parameter of the
    model, would stay alive for the life of the process. Inside this context the handles are
    recorded, and removed on exit. A torch without that function is left alone.
    """

    def __enter__(self) -> TrackerHooks:
        self.handles: list[Any] = []
        try:
            from torch.distributed._tools import mod_tracker
        except ImportError:
            self._module = None
            return self
        self._module = mod_tracker
        self._original = getattr(mod_tracker, "register_multi_grad_hook", None)
        if self._original is not None:
            def recording(*args: Any, **kwargs: Any):
                handle = self._original(*args, **kwargs)
                self.handles.append(handle)
                return handle

            mod_tracker.register_multi_grad_hook = recording
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._module is not None and self._original is not None:
            self._module.register_multi_grad_hook = self._original
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def is_oom(exc: BaseException) -> bool:
    """True for CUDA's (and other backends') out-of-memory errors."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def available_bytes(device: torch.device) -> int | None:
    """Memory this machine can still give ``device``: the GPU's free memory, or on CPU what the
    kernel reports available (``MemAvailable``); None where neither can be read."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):  # no CUDA runtime here (a CPU build, a mocked GPU)
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_batch_fits(vocab_size: int, batch: int, seq: int, device: torch.device,
                     ranks_sharing: int = 1) -> None:
    """Refuse, in one line and before anything is allocated, a ``--batch-size`` x ``--seq-len``
    whose logits alone (batch x seq x vocabulary, 4 bytes each on CPU, at least 2 on a GPU) and
    token ids (input and labels, 8 bytes each) exceed this rank's share of the memory available
    now (``available_bytes`` over the ``ranks_sharing`` it)."""
    available = available_bytes(device)
    if available is None:
        return
    share = available // max(1, ranks_sharing)
    per_token = vocab_size * (4 if device.type == "cpu" else 2) + 16
    need = batch * seq * per_token
    if need <= share:
        return
    where = "GPU" if device.type == "cuda" else "host"
    raise UsageError(
        f"--batch-size {batch} x --seq-len {seq} is not allowed: {batch * seq:,} tokens per rank "
        f"need at least {fmt_bytes(need)} for their logits and ids alone, and this rank's share of "
        f"the {where} memory available now is {fmt_bytes(share)}; allowed: batch x seq <= "
        f"{share // per_token:,} tokens per rank")
