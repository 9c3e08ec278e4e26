"""Every private piece of torch the course reads, in one place, each behind a check; and the list of
private torch modules the course imports as tools (``PRIVATE_MODULES``).

Public APIs cover what the lessons teach; a few things the course *measures* or *cleans up* have
no public API: what FSDP2 registered to prefetch (lesson 04 shows it back to the learner), how
many parameters an FSDP1 unit manages before padding (lesson 01), FSDP1's flat parameters and
their back-references (freed between variants), and the fake process-group store behind
``fsdp-course plan``. They are read here only. On a torch without them, the course says so in one
line (``UnsupportedTorch``, a ``UsageError``) instead of an AttributeError from deep inside.
Checked against torch 2.6 to 2.14 (the versions ``requirements.txt`` accepts).

Some of torch's tools live only under private module paths (the memory trackers, fake tensors,
``checkpoint_wrapper``). The course imports them where it uses them, and ``PRIVATE_MODULES`` names
each with what it is for: ``tests/test_torch_internals.py`` imports every one on the torch at hand
and fails on any private import anywhere in the course that the list does not name.
"""

from __future__ import annotations

import contextlib
import functools
from copy import deepcopy
from types import MethodType
from typing import Any

import torch
from torch import nn

from utilities.errors import UsageError

SUPPORTED = "torch 2.6 to 2.14"

PRIVATE_MODULES = {
    "torch._subclasses.fake_tensor": "FakeTensorMode: the planner's and time model's tensors without storage",
    "torch._guards": "active_fake_mode: the time model skips DTensor's sharding propagation ops",
    "torch.distributed._tools": "the memory trackers' package (mod_tracker's hook registration)",
    "torch.distributed._tools.mem_tracker": "MemTracker: memory by category for FSDP1 and plain models",
    "torch.distributed._tools.fsdp2_mem_tracker": "FSDPMemTracker: memory by category for FSDP2",
    "torch.distributed._tools.mod_tracker": "ModTracker: which module runs (the time model's units)",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper":
        "checkpoint_wrapper, apply_activation_checkpointing: checkpointing as FSDP's docs teach it",
    "torch.distributed._functional_collectives":
        "functional collectives: the planner's CP step gathers K/V and passes dK/dV with them",
    "torch.distributed._shard.metadata": "ShardMetadata: FSDP1 sharded checkpoints the safe loader admits",
    "torch.distributed._shard.sharded_tensor.api": "ShardedTensor: FSDP1's sharded state dict",
    "torch.distributed._shard.sharded_tensor.metadata": "ShardedTensor metadata the safe loader admits",
    "torch.distributed._shard.sharded_tensor.shard": "Shard: FSDP1's sharded state dict",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec": "ChunkShardingSpec: the same",
    "torch.distributed.fsdp._flat_param": "FlatParameter: FSDP1's units, read and freed here",
    "torch.testing._internal.distributed.fake_pg": "FakeStore: the planner's fake process group",
    "torch.utils._foreach_utils": "which devices have fused AdamW kernels",
    "torch.utils._python_dispatch": "TorchDispatchMode: the time model counts each op",
    "torch.utils._pytree": "tree_leaves: the tensors among an op's arguments (compile's memory)",
}


class UnsupportedTorch(UsageError):
    """A private torch attribute the course reads is missing in this torch version."""


def _unsupported(feature: str, missing: str) -> UnsupportedTorch:
    return UnsupportedTorch(f"torch {torch.__version__} is not allowed for {feature}: it has no "
                            f"{missing}; allowed: {SUPPORTED}")


# -- FSDP2 -----------------------------------------------------------------------------------------

def fsdp2_prefetch_states(module: nn.Module) -> tuple[list[Any], list[Any]]:
    """The FSDP states ``module`` will prefetch in forward and in backward, as FSDP2 registered
    them (``set_modules_to_*_prefetch`` has no getter)."""
    try:
        state = module._get_fsdp_state()
        return list(state._states_to_forward_prefetch), list(state._states_to_backward_prefetch)
    except AttributeError as e:
        raise _unsupported("reading FSDP2's prefetch lists", f"'{e.name}' on an FSDP module") from None


def fsdp2_state(module: nn.Module) -> Any:
    """The FSDP state object of a ``fully_shard``-ed module (an identity to match prefetch lists)."""
    try:
        return module._get_fsdp_state()
    except AttributeError:
        raise _unsupported("reading FSDP2's state", "FSDPModule._get_fsdp_state") from None


def fsdp_forward_method_registrar() -> Any:
    """``register_fsdp_forward_method`` (``torch.distributed.fsdp``, torch 2.6 to 2.14); a torch
    without it is refused in one line."""
    try:
        from torch.distributed.fsdp import register_fsdp_forward_method
    except ImportError:
        raise _unsupported("a method other than forward under FSDP2",
                           "torch.distributed.fsdp.register_fsdp_forward_method") from None
    return register_fsdp_forward_method


# -- FSDP1 -----------------------------------------------------------------------------------------

def fsdp1_flat_param(unit: nn.Module) -> torch.Tensor | None:
    """The FlatParameter of an FSDP1 unit (None when the unit manages no parameter)."""
    handle = getattr(unit, "_handle", None)
    return getattr(handle, "flat_param", None)


def fsdp1_unit_numel(unit: nn.Module) -> int:
    """How many parameters an FSDP1 unit manages, without the padding its flat parameter adds."""
    flat = fsdp1_flat_param(unit)
    if flat is None:
        return 0
    size = getattr(flat, "_unpadded_unsharded_size", None)
    if size is None:
        raise _unsupported("counting an FSDP1 unit's parameters",
                           "FlatParameter._unpadded_unsharded_size")
    return int(size.numel())


def flat_param_types() -> tuple[type, ...]:
    """The exact classes of FSDP1's flat parameters (``FlatParameter``, or ``nn.Parameter`` where
    FSDP1 made a plain one): a cheap first filter over every object the garbage collector holds."""
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:  # no FSDP1 here: no flat parameters to find
        return (nn.Parameter,)
    return (nn.Parameter, FlatParameter)


def is_flat_param(t: Any) -> bool:
    """Whether ``t`` is an FSDP1 FlatParameter (the flat tensor a unit's parameters are views of)."""
    return bool(getattr(t, "_is_flat_param", False))


# Attributes by which a FlatParameter points back at its modules and original parameters (FSDP1
# stores them on the tensor): removed when a finished variant is freed, so the loop can go.
FLAT_PARAM_BACKREFS = ("_modules", "_params", "_shared_params", "_tensors", "_param_infos",
                       "_shared_param_infos", "_param_extensions", "_fqns")
FLAT_PARAM_HOOKS = ("_post_backward_hook_handle", "_post_backward_hook_state")


# -- the memory trackers --------------------------------------------------------------------------

def global_peak_only(tracker: Any, observe: Any = None) -> Any:
    """Make a ``MemTracker`` / ``FSDPMemTracker`` keep only the global peak, which is all the
    course reads (``get_tracker_snapshot("peak")``); ``observe(current)``, when given, is called at
    every sample with the current snapshot by device (the planner's scaling reads them all).

    After every operator the stock tracker also walks every module it has seen to update that
    module's own peak (``_update_peak_stats``): a third of ``fsdp-course plan``'s time on llama-8b
    and a fifth of a lesson's. Per-module peaks (``memory_tracking``, ``display_modulewise_stats``)
    then keep only what the module hooks record on entry and exit. On a torch whose tracker lacks
    the attributes this relies on, the tracker is left as it is (slower, same numbers).
    """
    if not (callable(getattr(type(tracker), "_update_peak_stats", None))
            and isinstance(getattr(tracker, "_peak_mem", None), dict)
            and isinstance(getattr(tracker, "_peak_mem_snap", None), dict)):
        if observe is not None:
            raise _unsupported("the planner's scaled trace", "MemTracker._update_peak_stats")
        return tracker
    tracker._course_observe = observe
    tracker._update_peak_stats = MethodType(_update_global_peak, tracker)
    return tracker


def _update_global_peak(self: Any, peak_state: Any) -> None:
    """The global half of ``MemTracker._update_peak_stats`` (the same comparison and copy)."""
    del peak_state
    current = getattr(self, "_curr_mem_snap", None)
    if current is None:  # older trackers build the current snapshot on request
        current = self.get_tracker_snapshot()
    for dev, snap in current.items():
        if self._peak_mem.get(dev, 0) < snap["Total"]:
            self._peak_mem[dev] = snap["Total"]
            self._peak_mem_snap[dev] = deepcopy(snap)
    observe = getattr(self, "_course_observe", None)
    if observe is not None:
        observe(current)


def mod_tracker_of(tracker: Any) -> Any:
    """The ``ModTracker`` a ``MemTracker`` / ``FSDPMemTracker`` follows the modules with (its
    ``_mod_tracker``, in torch 2.6 to 2.14): the time model reads the same module boundaries."""
    modules = getattr(tracker, "_mod_tracker", None)
    if modules is None or not hasattr(modules, "register_user_hooks"):
        raise _unsupported("the planner's time trace", "MemTracker._mod_tracker")
    return modules


# -- the fake process group ----------------------------------------------------------------------

def untraceable_op(error: BaseException) -> str | None:
    """The ATen op a step on fake tensors could not run (FakeTensorMode's refusals: an op without
    a fake kernel, an output whose shape or value depends on the data), from ``error`` or an error
    it was raised from; None for any other error."""
    try:
        import torch._subclasses.fake_tensor as ft
    except ImportError:
        return None
    kinds = tuple(getattr(ft, n) for n in ("UnsupportedOperatorException",
                                           "DynamicOutputShapeException",
                                           "DataDependentOutputException") if hasattr(ft, n))
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if kinds and isinstance(error, kinds):
            return str(getattr(error, "func", type(error).__name__))
        error = error.__cause__ or error.__context__
    return None


def fake_store() -> Any:
    """The store of torch's "fake" process group: one process plays rank 0 of N, collectives do
    nothing, so ``fsdp-course plan`` can shard a model for 8 GPUs on a laptop."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise _unsupported("fsdp-course plan",
                           "torch.testing._internal.distributed.fake_pg.FakeStore") from None
    return FakeStore()


# -- DTensor ---------------------------------------------------------------------------------------

def clear_dtensor_sharding_cache() -> bool:
    """Empty DTensor's sharding-propagation cache (in this thread; it is thread-local from 2.8), so
    the next op of each kind propagates afresh, as in a new process. False when torch has none."""
    try:
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    except (ImportError, AttributeError):
        return False
    return True


# -- cuBLAS workspaces ----------------------------------------------------------------------------

@contextlib.contextmanager
def dtensor_meta_from_cache():
    """DTensor's output-metadata propagation answered from its cache, even under FakeTensorMode.

    ``loss_parallel()``'s handlers ask the sharding propagator for each op's output metadata, and
    under an active fake mode it skips its cache and runs the op at its whole, unsplit size in that
    mode: under the planner's fake step, the memory tracker then booked a whole-vocabulary
    log-softmax on every rank (what loss parallel exists to avoid). The step's untracked warm-up
    fills the cache; the tracked step reads it. Yields whether the cache is used (not on a torch
    without these private names)."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    cached = getattr(propagator, "_propagate_tensor_meta_cached", None)
    if cached is None or not hasattr(propagator, "_propagate_tensor_meta"):
        yield False
        return
    propagator._propagate_tensor_meta = cached
    try:
        yield True
    finally:
        del propagator._propagate_tensor_meta


def clear_cublas_workspaces() -> bool:
    """Free the workspaces cuBLAS keeps per (handle, stream): 32 MiB each on sm90, one for the
    forward thread and one for the autograd thread, allocated through the caching allocator (so
    ``memory_allocated`` counts them) and never freed by ``empty_cache``. torch's own call for it
    (``torch._C._cuda_clearCublasWorkspaces``, in CUDA builds of 2.6 to 2.14); returns False where
    this torch has none (a CPU build, or a version without it), having done nothing."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


# -- gloo's AVG reduce -----------------------------------------------------------------------------

GLOO_AVG_SINCE = (2, 8)


def require_gloo_avg(feature: str) -> None:
    """FSDP2 reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG``; gloo has that op from
    torch 2.8, and before it the first backward of 2+ ranks over gloo fails. Refuse in one line
    there (an ``UnsupportedTorch``) rather than fail in the middle of a step."""
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < GLOO_AVG_SINCE:
        raise UnsupportedTorch(f"torch {torch.__version__} is not allowed for {feature}: its gloo "
                               "has no ReduceOp.AVG, which FSDP2's reduce-scatter uses (gloo has it "
                               "from torch 2.8); allowed: torch 2.8 to 2.14, or one rank per GPU "
                               "over NCCL")


# -- the memory trackers ---------------------------------------------------------------------------
@functools.cache
def fsdp_mem_tracker():
    """``FSDPMemTracker`` (the class), booking every FSDP all-gather output as an all-gather buffer;
    the lessons and the planner both track FSDP2 with it.

    The stock tracker books an all-gather's output as such only while a unit's own pre-forward or
    pre-backward runs. An explicit backward prefetch (``set_modules_to_backward_prefetch``) is
    issued just after that, from the unit's state, so its output was booked as a temporary: a
    depth-2 prefetch's two gathered blocks showed as temporaries, and the bytes gathered at the
    peak did not grow with the depth. And the unsharded gradients FSDP2 accumulates in its
    reduce dtype between micro-batches without gradient sync are booked as unsharded gradients,
    not temporaries. The totals are unchanged; only the category moves. On a torch
    whose tracker lacks the private names this relies on, it is the stock tracker.
    """
    from torch.distributed._tools import fsdp2_mem_tracker as module

    stock = module.FSDPMemTracker
    names = ("_FSDPRefType", "_FSDPState", "c10d")
    if not (all(hasattr(module, n) for n in names) and hasattr(stock, "_update_and_maybe_create_winfos")
            and hasattr(module._FSDPRefType, "ALL_GATHER")):
        return stock
    all_gather = module.c10d._allgather_base_.default
    clone = torch.ops.aten.clone.default
    booked = (module._FSDPState.PRE_FW, module._FSDPState.PRE_BW)
    post_forward = getattr(module._FSDPState, "POST_FW", None)
    kept = getattr(module._FSDPRefType, "UNSHARDED_PARAM", None)
    to_copy = torch.ops.aten._to_copy.default
    post_backward = getattr(module._FSDPState, "POST_BW", None)
    unsharded_grad = getattr(module._FSDPRefType, "UNSHARDED_GRAD", None)

    class FSDPMemTracker(stock):  # the name results.json reports as the method
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            state = getattr(self, "_fsdp_state", None)
            if func is all_gather and out is not NotImplemented and state not in booked:
                self._rebook(args[0], module._FSDPRefType.ALL_GATHER)
            elif (func is clone and state is post_forward and kept is not None
                  and isinstance(out, torch.Tensor)):
                # reshard_after_forward=N: the parameters' copy kept on groups of N ranks until
                # backward (FSDPParam.to_sharded_post_forward clones it out of the all-gather),
                # which the stock tracker books as an activation; False keeps the whole
                # gathered parameters, booked as unsharded parameters: so is this
                self._rebook(out, kept)
            elif (func is to_copy and state is post_backward and unsharded_grad is not None
                  and isinstance(out, torch.Tensor)):
                # accumulation without gradient sync under a reduce dtype: FSDP2 keeps the unsharded
                # gradients upcast (FSDPParam.unsharded_accumulated_grad), on no parameter's .grad,
                # which the stock tracker booked as temporaries (a copy that becomes a sharded
                # gradient is re-booked as one by the stock tracker after post-backward)
                self._rebook(out, unsharded_grad)
            return out

        def _rebook(self, t, category) -> None:
            try:
                self._update_and_maybe_create_winfos(t, category, update_existing=True)
            except KeyError:
                pass  # a buffer the tracker did not see allocated (under another fake mode)

    return FSDPMemTracker


# -- DCP's file reader -------------------------------------------------------------------------------

def require_dcp_reader_hooks(reader: Any) -> None:
    """The two places of DCP's ``FileSystemReader`` that the course's safe reader replaces (torch
    2.6 to 2.14 have both): ``fs``, the object that opens each data file, and ``_slice_file``, which
    hands an entry's bytes to ``torch.load``. Without them the data files would be opened and read
    unchecked: refused in one line instead."""
    from torch.distributed.checkpoint import FileSystemReader

    if not callable(getattr(FileSystemReader, "_slice_file", None)):
        raise _unsupported("loading a DCP checkpoint safely", "FileSystemReader._slice_file")
    if not hasattr(reader, "fs"):
        raise _unsupported("loading a DCP checkpoint safely", "FileSystemReader.fs")


# -- the doctor's reads ------------------------------------------------------------------------------

FSDP2_FORWARD_METHOD_CHECKED = ((2, 6), (2, 14))


def fsdp2_forward_method_registered(module: nn.Module, name: str) -> bool | None:
    """Whether ``register_fsdp_forward_method(module, name)`` was called: FSDP2 keeps no record of
    it, it replaces the method on the instance by a bound ``wrapped_method`` (``functools.wraps``
    of the original) that runs the pre- and post-forward hooks around it. None where this torch
    is outside the versions that wrapper was checked on (``FSDP2_FORWARD_METHOD_CHECKED``)."""
    from torch.torch_version import TorchVersion

    low, high = FSDP2_FORWARD_METHOD_CHECKED
    version = TorchVersion(torch.__version__)
    if version < low or version >= (high[0], high[1] + 1):
        return None
    method = module.__dict__.get(name)
    function = getattr(method, "__func__", None)
    code = getattr(function, "__code__", None)
    return bool(code is not None and code.co_name == "wrapped_method"
                and hasattr(function, "__wrapped__") and "fsdp" in code.co_filename)


def fsdp2_mp_policy(module: nn.Module) -> Any | None:
    """The ``MixedPrecisionPolicy`` a ``fully_shard``-ed module was given (no public getter);
    None where this torch keeps it elsewhere."""
    try:
        return module._get_fsdp_state()._mp_policy
    except AttributeError:
        return None


def _fsdp2_param_groups(module: nn.Module) -> list[Any]:
    """The parameter groups of a ``fully_shard``-ed module's state (AttributeError where this
    torch keeps them elsewhere)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # an older torch: one group per state
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def fsdp2_offloaded_units(model: nn.Module, take: bool = False) -> tuple[int, int]:
    """(units given a ``CPUOffloadPolicy``, units) among ``model``'s ``fully_shard`` units (FSDP2
    keeps the policy on each unit's parameter group; no public getter). ``take``, before the model
    is materialized: those units go back to FSDP2's default placement (shards on the device, the
    foreach copy-in), their offload left to whoever plans it (the planner's offload arithmetic)."""
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy

    policy_class = cpu_offload_policy_class()
    units = offloaded = 0
    try:
        for m in model.modules():
            if not isinstance(m, FSDPModule):
                continue
            units += 1
            groups = [g for g in _fsdp2_param_groups(m) if isinstance(g.offload_policy, policy_class)]
            offloaded += bool(groups)
            for group in groups if take else ():
                group.offload_policy = OffloadPolicy()
                for param in group.fsdp_params:
                    param.offload_to_cpu, param.pin_memory = False, False
    except AttributeError as e:
        raise _unsupported("reading FSDP2's offload policy", f"'{e.name}' on an FSDP module") from None
    return offloaded, units


def fsdp2_sharded_parameters(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]] | None:
    """The parameters a ``fully_shard``-ed module manages, as (owning module, name, sharded
    DTensor parameter), a tied parameter once per module holding it. Between an unshard and its
    reshard (after a ``torch.no_grad()`` forward the root stays unsharded) the modules hold plain
    unsharded tensors; FSDP2 keeps the sharded ones here. None where this torch keeps them
    elsewhere."""
    try:
        groups = _fsdp2_param_groups(module)
        out = []
        for param in (p for group in groups for p in group.fsdp_params):
            info = param._module_info
            places = [(info.module, info.param_name),
                      *zip(getattr(info, "shared_modules", ()), getattr(info, "shared_param_names", ()))]
            out += [(module, name, param.sharded_param) for module, name in places]
        return out
    except AttributeError:
        return None


def fsdp1_uses_orig_params(unit: nn.Module) -> bool:
    """Whether an FSDP1 unit was built with ``use_orig_params=True``."""
    return bool(getattr(unit, "_use_orig_params", False))


def fsdp1_orig_params(unit: nn.Module) -> list[torch.Tensor] | None:
    """The original parameters an FSDP1 unit flattened, where FSDP1 keeps them
    (``use_orig_params=True``); None otherwise."""
    params = getattr(fsdp1_flat_param(unit), "_params", None)
    return list(params) if params is not None else None


def fsdp1_flat_param_contents(unit: nn.Module) -> list[tuple[str, torch.Size]] | None:
    """The (name under the unit, unsharded shape) of each parameter an FSDP1 unit flattened (its
    FlatParameter's ``_fqns`` and ``_shapes``); None where this torch keeps them elsewhere."""
    flat = fsdp1_flat_param(unit)
    names, shapes = getattr(flat, "_fqns", None), getattr(flat, "_shapes", None)
    if names is None or shapes is None:
        return None
    return list(zip(names, shapes))


def fsdp1_mixed_precision(unit: nn.Module) -> Any | None:
    """The ``MixedPrecision`` an FSDP1 unit runs with (FSDP1 stores an all-None one for none)."""
    return getattr(unit, "mixed_precision", None)


# -- CPU offload -----------------------------------------------------------------------------------

def cpu_offload_policy_class() -> type:
    """FSDP2's ``CPUOffloadPolicy``: public in ``torch.distributed.fsdp`` from torch 2.6; earlier
    releases kept it beside ``fully_shard`` under ``torch.distributed._composable.fsdp``."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:
        import importlib

        try:
            return importlib.import_module("torch.distributed._composable.fsdp").CPUOffloadPolicy
        except (ImportError, AttributeError):
            raise _unsupported("CPU offload with fully_shard", "CPUOffloadPolicy") from None
    return CPUOffloadPolicy
