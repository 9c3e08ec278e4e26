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

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from utilities.bf16 import bf16_ready
from utilities.doctor_parts import (
    Finding,
    clean_name,
    elements,
    is_dtensor,
    local_tensor,
    modules_with_units,
    named_unique,
    some_names,
)
from utilities.doctor_units import fsdp1_mixed_units, unit_sizes, unmanaged_parameters, unregistered_methods
from utilities.torch_internals import (
    fsdp1_mixed_precision,
    fsdp2_mp_policy,
    fsdp2_sharded_parameters,
    is_flat_param,
)
from utilities.wrapping import fsdp_units

HUGE_VALUE = 1e20  # a parameter this large was never initialised
INV_FREQ_RANGE = (1e-12, 1.0)  # every rotary inverse frequency: base^(-2i/d), scaled down or not
LOW_PRECISION = (torch.bfloat16, torch.float16)


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
        findings += fsdp1_mixed_units(model, units)
    else:
        findings += unregistered_methods(model, units, tuple(methods))
    findings += unmanaged_parameters(params, units, api)
    findings += unit_sizes(model, units, api)
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
                out.append((clean_name(f"{module_name}.{name}".lstrip(".")), p))
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
        tensors = named_unique([*model.named_parameters(), *model.named_buffers()])
    tensors = [(n, t) for n, t in tensors
               if not is_dtensor(t) and not t.is_meta and t.is_floating_point()]
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
                       f"{worst_rank} ({some_names(differ)})")]


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
    kept = [] if api == "fsdp1" else [(n, p) for n, p in params if not is_dtensor(p)]
    return kept + named_unique(model.named_buffers())


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
                if not any(is_dtensor(p) for p in stale) else "tensors the model no longer holds")
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
                    f"{elements(low):,} of {elements(params):,} parameters are stored in {dtype} (the model "
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
    for name, module, unit in modules_with_units(model, units):
        for pname, p in module._parameters.items():
            if p is not None and not is_flat_param(p):
                owners.setdefault(id(p), {}).setdefault(id(unit), clean_name(f"{name}.{pname}".lstrip(".")))
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
        names = {id(m): clean_name(n) for n, m in module.named_modules()}
        return names.get(id(first), "the input embedding"), names.get(id(last), "the output head")
    return None


# -- values: meta, NaN, uninitialised --------------------------------------------------------------

def _meta_and_bad_values(model: nn.Module, params: list[tuple[str, torch.Tensor]]) -> list[Finding]:
    findings = []
    on_meta = [n for n, t in [*params, *named_unique(model.named_buffers())] if local_tensor(t).is_meta]
    if on_meta:
        findings.append(Finding(
            "meta-tensors",
            f"{len(on_meta)} parameters/buffers are still on the meta device ({some_names(on_meta)})",
            "they have no memory and no values: the first forward fails",
            "after sharding, model.to_empty(device=...) then re-initialise every parameter and "
            "buffer (the model's own init, e.g. model.apply(model._init_weights))"))
    bad_params, bad_buffers = [], []
    for name, p in params:
        local = local_tensor(p)
        if local.is_meta or not local.is_floating_point() or local.numel() == 0:
            continue
        low, high = (float(v) for v in torch.aminmax(local.detach()))  # NaN if any is NaN
        if not (math.isfinite(low) and math.isfinite(high)) or max(-low, high) > HUGE_VALUE:
            bad_params.append(name)
    for name, b in named_unique(model.named_buffers()):
        local = local_tensor(b)
        if not local.is_meta and local.is_floating_point() and bool(torch.isnan(local).any()):
            bad_buffers.append(name)
    if bad_params:
        findings.append(Finding(
            "bad-parameter-values",
            f"{len(bad_params)} parameters hold NaN, inf or values above {HUGE_VALUE:.0e} "
            f"({some_names(bad_params)})",
            "uninitialised memory (to_empty without an init) or a diverged run: every loss from "
            "here is NaN or garbage",
            "initialise after to_empty (the model's init on every module), or restart from a good "
            "checkpoint with a lower learning rate"))
    if bad_buffers:
        findings.append(Finding(
            "bad-buffer-values", f"{len(bad_buffers)} buffers hold NaN ({some_names(bad_buffers)})",
            "buffers are not trained: a NaN there poisons every forward",
            "recompute them after to_empty (the module's own init), or load them from a checkpoint"))
    return findings


def _rotary_buffers(model: nn.Module) -> list[Finding]:
    low, high = INV_FREQ_RANGE
    bad = []
    for name, buffer in named_unique(model.named_buffers()):
        if not name.endswith("inv_freq"):
            continue
        local = local_tensor(buffer)
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
        f"[{low:.0e}, {high:g}] ({some_names(bad)})",
        "a model built on meta and moved with to_empty() keeps uninitialised buffers; positions "
        "are encoded with garbage and the loss is far from the eager model's",
        "after to_empty, recompute them: the rotary module's init (transformers: "
        "model.apply(model._init_weights); or rotary.inv_freq.copy_(rotary.rope_init_fn(config, "
        "device)[0]))")]


# -- the batch -------------------------------------------------------------------------------------

def _batch(model: nn.Module, params: list[tuple[str, torch.Tensor]], batch: Any) -> list[Finding]:
    findings = []
    device = next((local_tensor(p).device for _, p in params), None)
    if device is not None and device.type == "meta":
        device = None  # inspected without values: the run puts the model on its device
    tensors = dict(_batch_tensors(batch))
    elsewhere = [n for n, t in tensors.items() if device is not None and t.device != device]
    if elsewhere:
        findings.append(Finding(
            "batch-device", f"the batch's {some_names(elsewhere)} on {tensors[elsewhere[0]].device}, "
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
