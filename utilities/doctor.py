"""The doctor: the FSDP mistakes that can be seen on a model, one line each.

    from utilities.doctor import diagnose, same_build_findings
    for finding in same_build_findings(model):   # before sharding, on every rank
        print(finding)
    for finding in diagnose(model, optimizer):   # after sharding
        print(finding)

``diagnose(model, optimizer=None, batch=None)`` reads the sharded model (FSDP1's
``FullyShardedDataParallel`` or FSDP2's ``fully_shard``), its optimizer and one batch when given,
and returns a ``Finding`` per problem: what is wrong (with the numbers), why it matters, the fix.
An empty list means nothing it knows how to see is wrong. It reads the model in the state it is
in (right after sharding, after a ``torch.no_grad()`` forward that left the root unsharded, in
eval mode, after steps or a checkpoint load), runs no collective unless ``every_rank=True`` and
changes nothing, so every rank may call it, or rank 0 alone. ``same_build_findings(model)`` is
the one collective check: whether every rank built the same model.

What it looks for:

* an optimizer built before sharding: its tensors are not the model's parameters any more;
* parameters stored in bf16 or fp16 (``model.to(torch.bfloat16)`` before sharding): no fp32
  master weights, instead of a mixed-precision policy;
* gradients summed across ranks in bf16 / fp16 (``reduce_dtype`` low, or unset with a low
  ``param_dtype``), on 2 ranks or more;
* ranks that built different models (seeded apart): ``same_build_findings`` before sharding;
  after it, ``diagnose(..., every_rank=True)`` compares what every rank holds in full;
* tied weights split across units (one tensor used by modules of two units), or a tie the model
  declares (``tie_word_embeddings``) broken by the wrapping;
* meta-device leftovers: parameters or buffers still on ``meta``, rotary ``inv_freq`` buffers
  left uninitialised after ``to_empty``; NaN or infinite parameters, NaN buffers (skipped with
  ``values=False``, for a model on meta or fake tensors);
* an FSDP1 unit mixing frozen and trainable parameters: refused without ``use_orig_params``, and
  with it, gradient memory for the frozen ones too;
* FSDP2: ``generate`` (or another method you name) not registered with
  ``register_fsdp_forward_method`` where the call fails: it runs, outside forward, modules whose
  parameters the root unit holds (checked in eval mode, set up to generate, or when ``methods``
  names it);
* parameters no unit manages (FSDP2: plain tensors among the sharded DTensors);
* most parameters left to the root unit (the whole model gathered at once: lesson 01), naming
  the blocks that are not units, or the root's own parameters and the calls that give them units;
  units far larger than the others;
* fp32 compute on a GPU with native bf16 and no mixed-precision policy;
* a batch on another device than the parameters, or token ids beyond the vocabulary.
"""

from __future__ import annotations

import ast
import inspect
import math
import statistics
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from utilities.bf16 import bf16_ready
from utilities.text import wrap_lines
from utilities.torch_internals import (
    fsdp1_flat_param,
    fsdp1_flat_param_contents,
    fsdp1_mixed_precision,
    fsdp1_orig_params,
    fsdp1_uses_orig_params,
    fsdp2_forward_method_registered,
    fsdp2_mp_policy,
    fsdp2_sharded_parameters,
    is_flat_param,
)
from utilities.wrapping import fsdp_units, unit_parameter_counts

COLUMNS = 80  # a printed finding is folded to this width
ROOT_SHARE_LIMIT = 0.5  # more of the parameters than this in the root unit: the model gathered at once
LARGE_UNIT_FACTOR = 4  # a unit this many times the median unit is far larger than the others
FROZEN_SHARE_LIMIT = 0.1  # frozen share of an FSDP1 use_orig_params unit worth its gradient memory
HUGE_VALUE = 1e20  # a parameter this large was never initialised
INV_FREQ_RANGE = (1e-12, 1.0)  # every rotary inverse frequency: base^(-2i/d), scaled down or not
LOW_PRECISION = (torch.bfloat16, torch.float16)
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class Finding:
    """One problem: ``check`` names it, ``problem`` says what is wrong (with the numbers),
    ``why`` why it matters, ``fix`` what to do. ``str()`` is the finding as one line folded at
    ``COLUMNS``; ``line`` the same unfolded."""

    check: str
    problem: str
    why: str
    fix: str

    @property
    def line(self) -> str:
        return f"{self.check}: {self.problem}; {self.why}. Fix: {self.fix}"

    def __str__(self) -> str:
        return wrap_lines(self.line, COLUMNS, indent="    ")


def findings_text(findings: list[Finding]) -> str:
    """The findings, one (folded) line each, or ``no problems found``."""
    return "\n".join(map(str, findings)) if findings else "no problems found"


def diagnose(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, batch: Any = None,
             methods: Iterable[str] | None = None, values: bool = True,
             every_rank: bool = False) -> list[Finding]:
    """Every problem the doctor can see on ``model`` after sharding (see the module's list), in
    the state it is in: right after sharding, after a forward (``torch.no_grad()`` or not), in
    eval mode, after optimizer steps or after loading a checkpoint.

    ``optimizer``: checked against the sharded parameters. ``batch``: a tensor, or a dict / list
    of them (``input_ids=...``), checked against the model's device and vocabulary. ``methods``:
    the methods besides ``forward`` you will call on an FSDP2 model (default ``generate`` when the
    model is in eval mode, as it is to generate; none in train mode); each is reported only where
    the call would fail: where it runs, outside forward, modules whose parameters the root unit
    holds. ``values=False``: skip what needs real values (a model on meta or fake tensors):
    non-finite and uninitialised tensors. ``every_rank=True`` when every rank calls diagnose: it
    then runs one collective (``same_build_findings``) comparing, across ranks, what every rank
    holds in full."""
    units = fsdp_units(model)
    if not units:
        return [Finding("not-sharded", f"no FSDP unit in this {type(model).__name__}",
                        "the doctor reads a sharded model (before sharding, call "
                        "same_build_findings(model) on every rank)",
                        "call diagnose after fully_shard(...) / FullyShardedDataParallel(...)")]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    api = "fsdp1" if isinstance(units[0], FSDP) else "fsdp2"
    params = _sharded_named_parameters(model, units, api)
    if methods is None:
        methods = () if model.training else ("generate",)
    findings: list[Finding] = []
    if optimizer is not None:
        findings += _stale_optimizer(model, params, optimizer, api)
    findings += _low_precision_storage(params, api)
    findings += _low_precision_reduce(units, api, params)
    findings += _tied_weights(model, units)
    if values:
        findings += _meta_and_bad_values(model, params)
        findings += _rotary_buffers(model)
    if api == "fsdp1":
        findings += _fsdp1_mixed_units(model, units)
    else:
        findings += _unregistered_methods(model, units, tuple(methods))
    findings += _unmanaged_parameters(params, units, api)
    findings += _unit_sizes(model, units, api)
    findings += _no_mixed_precision_on_bf16_gpu(params, units, api)
    if batch is not None:
        findings += _batch(model, params, batch)
    if every_rank:
        findings += same_build_findings(model, _replicated_tensors(model, params, api))
    return findings


def _sharded_named_parameters(model: nn.Module, units: list[nn.Module],
                              api: str) -> list[tuple[str, torch.Tensor]]:
    """Every parameter once, by its name in the user's model: for FSDP2 the sharded DTensor FSDP
    keeps, also while a unit is unsharded (its modules then hold plain gathered tensors)."""
    sharded: dict[tuple[int, str], torch.Tensor] = {}
    if api == "fsdp2":
        for unit in units:
            for module, name, param in fsdp2_sharded_parameters(unit) or ():
                sharded[(id(module), name)] = param
    out, seen = [], set()
    for module_name, module in model.named_modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            p = sharded.get((id(module), name), p)
            if id(p) not in seen:
                seen.add(id(p))
                out.append((_clean(f"{module_name}.{name}".lstrip(".")), p))
    return out


# -- every rank's build ----------------------------------------------------------------------------

SAME_BUILD_TOLERANCE = 1e-6  # relative: the same tensor summed on another device rounds differently


def same_build_findings(model: nn.Module, tensors: list[tuple[str, torch.Tensor]] | None = None,
                        group: Any = None) -> list[Finding]:
    """Whether every rank holds the same model: a collective, every rank of ``group`` calls it
    (one all-gather of a few numbers per tensor). Call it right after building the model, before
    ``fully_shard`` / ``FullyShardedDataParallel``: sharding keeps each rank's shard of its own
    build, so ranks built with different seeds train a mix no rank built, and nothing fails.

    ``tensors``: (name, tensor) pairs to compare; default every parameter and buffer. A tensor
    on meta, a sharded DTensor or an integer tensor is left out. Returns one ``Finding`` naming
    the tensors that differ, or none (also on one rank, or without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return []
    if tensors is None:
        tensors = _named_unique([*model.named_parameters(), *model.named_buffers()])
    tensors = [(n, t) for n, t in tensors
               if not _is_dtensor(t) and not t.is_meta and t.is_floating_point()]
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    mine = torch.zeros(len(tensors), 3, dtype=torch.float64)
    with torch.no_grad():
        for i, (_, t) in enumerate(tensors):
            values = t.detach().double()
            mine[i] = torch.stack([values.sum(), values.square().sum(), torch.tensor(float(t.numel()))]).cpu()
    ranks = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(ranks)]
    dist.all_gather(counts, torch.tensor([float(len(tensors))], dtype=torch.float64, device=device),
                    group=group)
    if len({int(c.item()) for c in counts}) > 1:
        return [_divergent(f"the ranks hold different numbers of tensors "
                           f"({', '.join(str(int(c.item())) for c in counts)})")]
    every = [torch.zeros_like(mine, device=device) for _ in range(ranks)]
    dist.all_gather(every, mine.to(device), group=group)
    first = every[0].cpu()
    differ: list[str] = []
    worst_rank = 0
    for rank, theirs in enumerate(every[1:], start=1):
        theirs = theirs.cpu()
        scale = (first[:, 1] * first[:, 2]).sqrt().clamp_min(1e-30)
        off = ((theirs[:, 0] - first[:, 0]).abs() > SAME_BUILD_TOLERANCE * scale) | \
            ((theirs[:, 1] - first[:, 1]).abs() > SAME_BUILD_TOLERANCE * first[:, 1].clamp_min(1e-30)) | \
            (theirs[:, 2] != first[:, 2])
        names = [tensors[i][0] for i in off.nonzero().flatten().tolist()]
        if len(names) > len(differ):
            differ, worst_rank = names, rank
    if not differ:
        return []
    return [_divergent(f"{len(differ)} of {len(tensors)} tensors differ between rank 0 and rank "
                       f"{worst_rank} ({_some(differ)})")]


def _divergent(problem: str) -> Finding:
    return Finding(
        "rank-divergent-build", problem,
        "sharding keeps each rank's shard of its own build, so the model trained is a mix of the "
        "ranks' builds that no rank built (and what every rank holds in full stays different on "
        "each): nothing fails, the run is just not the model you built",
        "seed every rank alike before building the model (torch.manual_seed(seed), not seed + rank; "
        "seed the data order per rank after), or load the same weights on every rank before "
        "sharding (FSDP1: sync_module_states=True)")


def _replicated_tensors(model: nn.Module, params: list[tuple[str, torch.Tensor]],
                        api: str) -> list[tuple[str, torch.Tensor]]:
    """What every rank holds in full after sharding: buffers, and (FSDP2) parameters no unit
    shards; FSDP1's parameters are all views of flat shards."""
    kept = [] if api == "fsdp1" else [(n, p) for n, p in params if not _is_dtensor(p)]
    return kept + _named_unique(model.named_buffers())


# -- the optimizer ---------------------------------------------------------------------------------

def _stale_optimizer(model: nn.Module, params: list[tuple[str, torch.Tensor]],
                     optimizer: torch.optim.Optimizer, api: str) -> list[Finding]:
    current = {id(p) for _, p in params}  # FSDP2: the sharded ones, also while a unit is unsharded
    held = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [p for p in held if id(p) not in current]
    if not stale:
        return []
    if api == "fsdp2":
        kind = ("plain tensors, not the DTensors fully_shard made"
                if not any(_is_dtensor(p) for p in stale) else "tensors the model no longer holds")
        fix = ("build the optimizer after fully_shard, from model.parameters(), while every unit is "
               "sharded (not after a torch.no_grad() forward, which leaves the root unsharded)")
    else:
        kind = ("the original tensors, not FSDP1's flat parameters"
                if not any(is_flat_param(p) for p in stale) else "tensors the model no longer holds")
        fix = "build the optimizer after FullyShardedDataParallel(...), from its parameters()"
    return [Finding("optimizer-before-sharding",
                    f"{len(stale)} of the optimizer's {len(held)} tensors are not the model's "
                    f"parameters ({kind})",
                    "the optimizer was built before sharding: it updates copies the model does not "
                    "use, so the loss does not move (or step() fails)", fix)]


# -- dtypes ----------------------------------------------------------------------------------------

def _low_precision_storage(named: list[tuple[str, torch.Tensor]], api: str) -> list[Finding]:
    params = [p for _, p in named if p.is_floating_point()]
    low = [p for p in params if p.dtype in LOW_PRECISION]
    if not low:
        return []
    dtype = str(low[0].dtype).replace("torch.", "")
    return [Finding("low-precision-weights",
                    f"{_count(low):,} of {_count(params):,} parameters are stored in {dtype} (the model "
                    "was cast before sharding)",
                    "there are no fp32 master weights: optimizer state is in bf16 and updates "
                    "smaller than bf16's resolution are lost, so the loss stalls above a mixed-"
                    "precision run's",
                    f"keep the model in fp32 and pass {_mixed_precision_policy(api)} (lessons 07 and 15)")]


def _mixed_precision_policy(api: str) -> str:
    """The policy the course recommends, as code: bf16 compute, fp32 gradient reduction."""
    if api == "fsdp2":
        return ("mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) "
                "to every fully_shard call")
    return ("mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, "
            "buffer_dtype=torch.bfloat16) to FullyShardedDataParallel")


def _low_precision_reduce(units: list[nn.Module], api: str,
                          params: list[tuple[str, torch.Tensor]]) -> list[Finding]:
    """Gradients summed across ranks in bf16 / fp16: ``reduce_dtype`` low, or left unset with a
    low ``param_dtype`` (both APIs then reduce in ``param_dtype``)."""
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks < 2:
        return []  # nothing is summed: the reduction's dtype does not matter
    read = fsdp2_mp_policy if api == "fsdp2" else fsdp1_mixed_precision
    low = []
    for unit in units:
        policy = read(unit)
        compute = getattr(policy, "param_dtype", None)
        reduce = getattr(policy, "reduce_dtype", None) or compute
        if reduce in LOW_PRECISION:
            low.append((unit, reduce, getattr(policy, "reduce_dtype", None) is None))
    owned = {id(u) for u in units if any(True for _ in u.parameters())}
    low = [entry for entry in low if id(entry[0]) in owned]
    if not low or not any(p.requires_grad for _, p in params):
        return []
    dtype = low[0][1]
    unset = all(entry[2] for entry in low)
    name = str(dtype).replace("torch.", "")
    eps = torch.finfo(dtype).eps
    how = f"reduce_dtype is unset and param_dtype is {name}" if unset else f"reduce_dtype is {name}"
    return [Finding(
        "low-precision-reduce",
        f"{how} in {len(low)} of {len(units)} units: gradients are summed across the {ranks} "
        f"ranks in {name}",
        f"each addition of a gradient's reduce-scatter ({ranks - 1} per element) rounds the sum to "
        f"{round(-math.log2(eps)) + 1} significant bits (up to {eps / 2:.2%} of it each), on top of "
        f"the {name} gradients' own rounding, on every gradient of every step (lesson 15's "
        "bf16-reduce row measures the gradients against an fp32 reduction); it does not matter on "
        "one rank, where nothing is summed, and grows with the ranks",
        f"pass {_mixed_precision_policy(api)}")]


def _no_mixed_precision_on_bf16_gpu(params: list[tuple[str, torch.Tensor]], units: list[nn.Module],
                                    api: str) -> list[Finding]:
    gpu = _bf16_gpu([p for _, p in params])
    if gpu is None:
        return []
    if any(p.dtype in LOW_PRECISION for _, p in params):
        return []  # stored in low precision: low-precision-weights says so
    read = fsdp2_mp_policy if api == "fsdp2" else fsdp1_mixed_precision
    policies = [read(u) for u in units]
    if any(getattr(p, "param_dtype", None) in LOW_PRECISION for p in policies):
        return []
    return [Finding("no-mixed-precision",
                    f"the model computes in fp32 on {gpu}, which has native bf16, and no unit has "
                    "a mixed-precision policy",
                    "bf16 compute halves the bytes all-gathered and the activations kept, and runs "
                    "matmuls several times faster", f"pass {_mixed_precision_policy(api)} (lesson 07)")]


def _bf16_gpu(params: list[torch.Tensor]) -> str | None:
    """The name of the GPU the parameters are on, if it has native bf16; else None."""
    device = next((p.device for p in params), None)
    if device is None or device.type != "cuda" or not bf16_ready():
        return None
    return torch.cuda.get_device_name(device)


# -- tied weights ----------------------------------------------------------------------------------

def _tied_weights(model: nn.Module, units: list[nn.Module]) -> list[Finding]:
    findings = []
    owners: dict[int, dict[int, str]] = {}  # tensor -> {unit: a name it has there}
    for name, module, unit in _modules_with_units(model, units):
        for pname, p in module._parameters.items():
            if p is not None and not is_flat_param(p):
                owners.setdefault(id(p), {}).setdefault(id(unit), _clean(f"{name}.{pname}".lstrip(".")))
    split = [names for names in owners.values() if len(names) > 1]
    if split:
        shown = ", ".join(" and ".join(sorted(names.values())) for names in split[:2])
        findings.append(Finding(
            "tied-weights-split",
            f"{len(split)} tensor(s) are used by modules of different units ({shown})",
            "each unit gathers and reshards its own parameters, so the other unit meets the tensor "
            "sharded (an error, or wrong results on 2+ ranks)",
            "make both modules part of one unit: wrap a module above both, or "
            "fully_shard([module_a, module_b]) (FSDP2)"))
    broken = _broken_declared_tie(model)
    if broken:
        findings.append(Finding(
            "tie-broken",
            f"the model declares tie_word_embeddings but {broken[0]} and {broken[1]} are now "
            "different tensors",
            "sharding the two modules in different units split one weight in two: they train "
            "apart and the checkpoint stores both",
            "keep the embedding and the output head in one unit (e.g. leave both to the root), "
            "or shard them with fully_shard([embedding, head])"))
    return findings


def _broken_declared_tie(model: nn.Module) -> tuple[str, str] | None:
    """The input and output embeddings' names when the model (a transformers one) declares them
    tied and they are different tensors; None otherwise."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(module, "get_input_embeddings"):
            continue
        if not getattr(config, "tie_word_embeddings", False):
            return None
        try:
            first, last = module.get_input_embeddings(), module.get_output_embeddings()
        except (NotImplementedError, AttributeError):
            return None
        if first is None or last is None:
            return None
        if getattr(first, "weight", None) is getattr(last, "weight", None):
            return None
        names = {id(m): _clean(n) for n, m in module.named_modules()}
        return names.get(id(first), "the input embedding"), names.get(id(last), "the output head")
    return None


# -- values: meta, NaN, uninitialised --------------------------------------------------------------

def _meta_and_bad_values(model: nn.Module, params: list[tuple[str, torch.Tensor]]) -> list[Finding]:
    findings = []
    on_meta = [n for n, t in [*params, *_named_unique(model.named_buffers())] if _local(t).is_meta]
    if on_meta:
        findings.append(Finding(
            "meta-tensors",
            f"{len(on_meta)} parameters/buffers are still on the meta device ({_some(on_meta)})",
            "they have no memory and no values: the first forward fails",
            "after sharding, model.to_empty(device=...) then re-initialise every parameter and "
            "buffer (the model's own init, e.g. model.apply(model._init_weights))"))
    bad_params, bad_buffers = [], []
    for name, p in params:
        local = _local(p)
        if local.is_meta or not local.is_floating_point() or local.numel() == 0:
            continue
        low, high = (float(v) for v in torch.aminmax(local.detach()))  # NaN if any is NaN
        if not (math.isfinite(low) and math.isfinite(high)) or max(-low, high) > HUGE_VALUE:
            bad_params.append(name)
    for name, b in _named_unique(model.named_buffers()):
        local = _local(b)
        if not local.is_meta and local.is_floating_point() and bool(torch.isnan(local).any()):
            bad_buffers.append(name)
    if bad_params:
        findings.append(Finding(
            "bad-parameter-values",
            f"{len(bad_params)} parameters hold NaN, inf or values above {HUGE_VALUE:.0e} "
            f"({_some(bad_params)})",
            "uninitialised memory (to_empty without an init) or a diverged run: every loss from "
            "here is NaN or garbage",
            "initialise after to_empty (the model's init on every module), or restart from a good "
            "checkpoint with a lower learning rate"))
    if bad_buffers:
        findings.append(Finding(
            "bad-buffer-values", f"{len(bad_buffers)} buffers hold NaN ({_some(bad_buffers)})",
            "buffers are not trained: a NaN there poisons every forward",
            "recompute them after to_empty (the module's own init), or load them from a checkpoint"))
    return findings


def _rotary_buffers(model: nn.Module) -> list[Finding]:
    low, high = INV_FREQ_RANGE
    bad = []
    for name, buffer in _named_unique(model.named_buffers()):
        if not name.endswith("inv_freq"):
            continue
        local = _local(buffer)
        if local.is_meta or local.numel() == 0:
            continue  # meta-tensors says so
        values = local.detach().float()
        if bool(torch.isnan(values).any()):
            continue  # bad-buffer-values says so
        if not (bool(torch.isfinite(values).all()) and bool((values >= low).all())
                and bool((values <= high * (1 + 1e-6)).all())):
            bad.append(name)
    if not bad:
        return []
    return [Finding(
        "uninitialised-rotary",
        f"{len(bad)} rotary inv_freq buffers hold values no rotary embedding has, outside "
        f"[{low:.0e}, {high:g}] ({_some(bad)})",
        "a model built on meta and moved with to_empty() keeps uninitialised buffers; positions "
        "are encoded with garbage and the loss is far from the eager model's",
        "after to_empty, recompute them: the rotary module's init (transformers: "
        "model.apply(model._init_weights); or rotary.inv_freq.copy_(rotary.rope_init_fn(config, "
        "device)[0]))")]


# -- FSDP1: frozen and trainable in one unit -------------------------------------------------------

def _fsdp1_mixed_units(model: nn.Module, units: list[nn.Module]) -> list[Finding]:
    findings = []
    names = _unit_names(model, units)
    for unit in units:
        params = fsdp1_orig_params(unit)
        if not params:
            continue
        frozen = [p for p in params if not p.requires_grad]
        if not frozen or len(frozen) == len(params):
            continue
        share = _count(frozen) / max(1, _count(params))
        if not fsdp1_uses_orig_params(unit):
            findings.append(Finding(
                "fsdp1-mixed-unit",
                f"unit {names[id(unit)]} mixes {_count(frozen)} frozen and "
                f"{_count(params) - _count(frozen)} trainable parameters without use_orig_params",
                "one flat parameter has one requires_grad: FSDP1 refuses the unit, or trains the "
                "frozen part",
                "FullyShardedDataParallel(..., use_orig_params=True), or FSDP2's fully_shard "
                "(per-parameter; lesson 09)"))
        elif share >= FROZEN_SHARE_LIMIT:
            findings.append(Finding(
                "fsdp1-frozen-gradients",
                f"unit {names[id(unit)]} is {share:.0%} frozen parameters mixed with trainable "
                "ones",
                "FSDP1 keeps one gradient for the unit's whole flat parameter, so the frozen part "
                "costs gradient memory as if it trained",
                "wrap frozen and trainable modules in separate units, or use FSDP2's fully_shard "
                "(frozen parameters get no gradient; lesson 09)"))
    return findings


# -- FSDP2: methods other than forward -------------------------------------------------------------

def _unregistered_methods(model: nn.Module, units: list[nn.Module],
                          methods: tuple[str, ...]) -> list[Finding]:
    """A method other than forward, not registered, that runs modules whose parameters the root
    unit holds: FSDP2 gathers them only in the hooks around forward, so the call meets them
    sharded. A method that only calls forward, or a root that holds no parameter itself (every
    module's parameters gathered by its own unit's hooks), works unregistered: nothing said."""
    findings = []
    unit_ids = {id(u) for u in units}
    names = _unit_names(model, units)
    for root in _top_units(units):
        held = _held_directly(root, unit_ids)
        if not held:
            continue
        for method in methods:
            if not callable(getattr(root, method, None)):
                continue
            if fsdp2_forward_method_registered(root, method) is not False:
                continue  # registered, or this torch's FSDP2 cannot be read
            reached = _run_outside_forward(root, method, held)
            if not reached:
                continue
            owner = names[id(root)].replace("(root)", "model")
            findings.append(Finding(
                "unregistered-method",
                f"{owner}.{method} is not registered with register_fsdp_forward_method and "
                f"runs {reached} outside forward",
                "FSDP2 all-gathers a unit's parameters only around forward(): the call meets them "
                "sharded and fails ('mixed torch.Tensor and DTensor', or wrong shapes); a method "
                "that only calls forward would work",
                f"register_fsdp_forward_method({owner}, {method!r}) after fully_shard "
                "(from torch.distributed.fsdp)"))
    return findings


def _held_directly(unit: nn.Module, unit_ids: set[int]) -> dict[int, str]:
    """The modules under ``unit``, not inside an inner unit, that hold parameters of their own:
    {id: name under the unit}."""
    held, stack = {}, [("", unit)]
    while stack:
        name, module = stack.pop()
        if any(p is not None for p in module._parameters.values()):
            held[id(module)] = _clean(name) or "the root"
        for child_name, child in module.named_children():
            if id(child) not in unit_ids:
                stack.append((f"{name}.{child_name}".lstrip("."), child))
    return held


def _run_outside_forward(root: nn.Module, method: str, held: dict[int, str]) -> str:
    """Which of the ``held`` modules ``root.method`` runs itself (not through forward), named;
    '' where it runs none, or where its code cannot be read (nothing claimed)."""
    config = getattr(root, "config", None)
    if method == "generate" and getattr(config, "is_encoder_decoder", False) and hasattr(root, "get_encoder"):
        encoder = root.get_encoder()  # transformers' generate runs the encoder once, directly
        inside = [held[id(m)] for m in encoder.modules() if id(m) in held]
        if inside:
            return f"its encoder, which uses {_some(inside)}"
    children = dict(root.named_children())
    used, seen, todo = [], set(), [method]
    while todo and len(seen) < 8:  # the method, and the methods of the model it calls
        name = todo.pop()
        seen.add(name)
        function = inspect.unwrap(getattr(type(root), name, None) or (lambda: None))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self"):
                continue
            attr = node.attr
            if attr in children:
                inside = [held[id(m)] for m in children[attr].modules() if id(m) in held]
                used += [n for n in inside if n not in used]
            elif (attr not in seen and attr not in ("forward", "__call__")
                  and inspect.isfunction(getattr(type(root), attr, None))
                  and getattr(type(root), attr).__module__ == type(root).__module__):
                todo.append(attr)
    return _some(used) if used else ""


# -- what the units hold ---------------------------------------------------------------------------

def _unmanaged_parameters(params: list[tuple[str, torch.Tensor]], units: list[nn.Module],
                          api: str) -> list[Finding]:
    if api == "fsdp2":
        loose = [n for n, p in params if not _is_dtensor(p)]
        fix = "fully_shard the module that holds them, or the root (fully_shard(model)) last"
    else:
        managed = set()
        for unit in units:
            flat = fsdp1_flat_param(unit)
            if flat is not None:
                managed.add(id(flat))
                managed.update(id(p) for p in (fsdp1_orig_params(unit) or ()))
        loose = [n for n, p in params if id(p) not in managed]
        fix = "wrap the root module with FullyShardedDataParallel (or drop it from ignored_modules)"
    if not loose:
        return []
    return [Finding(
        "unmanaged-parameters",
        f"{len(loose)} parameters belong to no FSDP unit ({_some(loose)})",
        "every rank keeps a full copy and their gradients are not averaged across ranks, so "
        "the ranks' copies drift apart", fix)]


def _unit_sizes(model: nn.Module, units: list[nn.Module], api: str) -> list[Finding]:
    counts = dict(zip(map(id, units), unit_parameter_counts(model)))
    total = sum(counts.values())
    if total == 0:
        return []
    findings = []
    root = model if id(model) in counts else None  # the model itself, when it is a unit
    in_root = counts[id(model)] if root is not None else 0
    inner = [u for u in units if u is not root and counts[id(u)] > 0]
    if in_root / total > ROOT_SHARE_LIMIT:
        blocks = _unwrapped_blocks(model, units)
        if blocks:
            hint = f"; its {blocks} are not units of their own"
            fix = (f"fully_shard each of the {blocks} before the root (FSDP2), or auto_wrap_policy="
                   "transformer_auto_wrap_policy with the block class (FSDP1)")
        else:
            hint, fix = _root_own_parameters(model, units, api, in_root)
        findings.append(Finding(
            "root-holds-most",
            f"the root unit holds {in_root / total:.0%} of the parameters ({in_root:,} of "
            f"{total:,}; {len(inner)} inner units){hint}",
            "FSDP all-gathers a unit's parameters at once, so every rank holds that much unsharded "
            "in forward and backward: sharding saves little at the peak (lesson 01)", fix))
    if len(inner) >= 3:
        median = statistics.median(counts[id(u)] for u in inner)
        large = [u for u in inner if counts[id(u)] > LARGE_UNIT_FACTOR * median]
        if large:
            names = _unit_names(model, units)
            biggest = max(large, key=lambda u: counts[id(u)])
            findings.append(Finding(
                "uneven-units",
                f"{len(large)} unit(s) hold over {LARGE_UNIT_FACTOR}x the median unit's "
                f"{int(median):,} parameters; the largest, {names[id(biggest)]}, "
                f"{counts[id(biggest)]:,}",
                "the peak is set by the largest unit gathered (and the one prefetched with it), "
                "so one big unit costs what many small ones would",
                "split it: fully_shard its blocks or large children separately (FSDP2), or wrap "
                "by block class instead of by size (FSDP1)"))
    return findings


def _root_own_parameters(model: nn.Module, units: list[nn.Module], api: str,
                         in_root: int) -> tuple[str, str]:
    """What the root unit holds itself, named with sizes (the largest first, as many as make up
    most of it), and the change that gives them units of their own: ('; ...', fix)."""
    modules = {_clean(n): m for n, m in model.named_modules()}
    users: dict[str, list[str]] = {}  # a parameter's name -> the modules that hold it
    shapes: dict[str, torch.Size] = {}
    if api == "fsdp1":
        for name, shape in fsdp1_flat_param_contents(model) or ():
            name = _clean(name)
            users[name], shapes[name] = [name.rpartition(".")[0]], torch.Size(shape)
    else:
        first: dict[int, str] = {}
        for name, module, unit in _modules_with_units(model, units):
            if unit is not model:
                continue
            for pname, p in module._parameters.items():
                if p is None:
                    continue
                key = first.setdefault(id(p), _clean(f"{name}.{pname}".lstrip(".")))
                shapes[key] = torch.Size(p.shape)
                if _clean(name) not in users.setdefault(key, []):
                    users[key].append(_clean(name))
    if not shapes:
        return "", "fully_shard the root's largest children before the root"
    ranked = sorted(shapes, key=lambda n: -shapes[n].numel())
    shown, covered = [], 0
    for name in ranked[:3]:
        shown.append(name)
        covered += shapes[name].numel()
        if covered > in_root / 2:
            break
    sizes = ", ".join(f"{n} ({' x '.join(f'{d:,}' for d in shapes[n])}: {shapes[n].numel() / in_root:.0%})"
                      for n in shown)
    hint = f"; its own parameters, not in any inner unit: {sizes}"
    targets = []
    for name in shown:
        owners = [_python_path(o) for o in users.get(name, [])]
        target = owners[0] if len(owners) == 1 else f"[{', '.join(owners)}]"
        if target not in targets and target != "model":
            targets.append(target)
    if not targets:
        return hint, "fully_shard the root's largest children before the root"
    if api == "fsdp2":
        calls = "; ".join(f"fully_shard({t})" for t in targets)
        tied = any(t.startswith("[") for t in targets)
        fix = (f"give them units of their own after the blocks and before the root: {calls}; then "
               "fully_shard(model)" + (" (a tied weight's modules in one call, torch 2.7+)" if tied else ""))
    else:
        chosen = {id(modules[o]) for n in shown for o in users.get(n, []) if o in modules}
        classes = {type(modules[o]) for n in shown for o in users.get(n, []) if o in modules}
        only_these = all(id(m) in chosen for m in model.modules() if type(m) in classes)
        fix = (f"wrap {', '.join(targets)} as units of their own: auto_wrap_policy="
               + ("ModuleWrapPolicy({the block class, " + ", ".join(sorted(c.__name__ for c in classes))
                  + "})" if only_these else
                  "_or_policy over the block policy and a lambda_auto_wrap_policy whose lambda_fn "
                  "picks these modules (their classes are used elsewhere too)")
               + "; tied modules must stay in one unit")
    return hint, fix


def _python_path(name: str) -> str:
    """A module's name as the code that reaches it from ``model``: 'layers.0.mlp' -> model.layers[0].mlp."""
    parts = [part for part in name.split(".") if part]
    return "model" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in parts)


def _unwrapped_blocks(model: nn.Module, units: list[nn.Module]) -> str:
    """'N ClassName blocks' for the longest list of same-class modules none of which is a unit
    (the blocks a per-block wrapping would have made units); '' when there is none."""
    unit_ids = {id(u) for u in units}
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            inner = [_unwrapped(m) for m in module]
            if len({type(m) for m in inner}) == 1 and not any(id(m) in unit_ids for m in module):
                if best is None or len(module) > len(best):
                    best = inner
    return f"{len(best)} {type(best[0]).__name__} blocks" if best else ""


# -- the batch -------------------------------------------------------------------------------------

def _batch(model: nn.Module, params: list[tuple[str, torch.Tensor]], batch: Any) -> list[Finding]:
    findings = []
    device = next((_local(p).device for _, p in params), None)
    if device is not None and device.type == "meta":
        device = None  # inspected without values: the run puts the model on its device
    tensors = dict(_batch_tensors(batch))
    elsewhere = [n for n, t in tensors.items() if device is not None and t.device != device]
    if elsewhere:
        findings.append(Finding(
            "batch-device", f"the batch's {_some(elsewhere)} on {tensors[elsewhere[0]].device}, "
            f"the parameters on {device}",
            "the forward fails with a device mismatch (or copies every step)",
            f"move the batch: batch = {{k: v.to({str(device)!r}) for k, v in batch.items()}}"))
    vocab = _vocab_size(model)
    ids = tensors.get("input_ids")
    if vocab and ids is not None and ids.numel() and not ids.is_floating_point():
        top = int(ids.max())
        if top >= vocab or int(ids.min()) < 0:
            findings.append(Finding(
                "token-ids", f"input_ids run from {int(ids.min())} to {top} but the vocabulary "
                f"has {vocab} entries",
                "the embedding lookup fails (on a GPU: a device-side assert that names nothing)",
                "use the model's tokenizer, or a config whose vocab_size covers every id"))
    return findings


def _batch_tensors(batch: Any, name: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield name, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _batch_tensors(value, str(key))
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from _batch_tensors(value, f"{name}[{i}]")


def _vocab_size(model: nn.Module) -> int | None:
    for module in model.modules():
        vocab = getattr(getattr(module, "config", None), "vocab_size", None)
        if isinstance(vocab, int):
            return vocab
    return None


# -- helpers ---------------------------------------------------------------------------------------

def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _named_unique(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    seen, out = set(), []
    for name, t in named:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((_clean(name), t))
    return out


def _count(tensors: Iterable[torch.Tensor]) -> int:
    """Parameters (elements) in ``tensors``, at their global (unsharded) shape."""
    return sum(int(torch.Size(t.shape).numel()) for t in tensors)


def _clean(name: str) -> str:
    """A module or parameter name as the user wrote the model (no FSDP1 / checkpoint wrappers)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _some(names: list[str], shown: int = 2) -> str:
    more = f", +{len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module inside FSDP1's and activation checkpointing's wrappers."""
    while True:
        inner = (getattr(module, "_fsdp_wrapped_module", None)
                 or getattr(module, "_checkpoint_wrapped_module", None))
        if inner is None:
            return module
        module = inner


def _top_units(units: list[nn.Module]) -> list[nn.Module]:
    """The units no other unit contains (the root, normally the model itself)."""
    inside = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inside]


def _unit_names(model: nn.Module, units: list[nn.Module]) -> dict[int, str]:
    unit_ids = {id(u) for u in units}
    return {id(m): (_clean(n) or "(root)") for n, m in model.named_modules() if id(m) in unit_ids}


def _modules_with_units(model: nn.Module,
                        units: list[nn.Module]) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """Every module (a shared one once per place it is used), its name, and the unit whose
    parameters it uses: the nearest unit at or above it."""
    unit_ids = {id(u) for u in units}
    stack = [("", model, model)]
    while stack:
        name, module, unit = stack.pop()
        if id(module) in unit_ids:
            unit = module
        yield name, module, unit
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child, unit))
