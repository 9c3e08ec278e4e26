"""The doctor's checks of what the FSDP units hold: FSDP1 units mixing frozen and trainable
parameters, FSDP2 methods other than forward that run modules of the root unit, parameters no unit
manages, and units (the root above all) far larger than the rest."""

from __future__ import annotations

import ast
import inspect
import statistics
import textwrap

import torch
from torch import nn

from utilities.doctor_parts import (
    Finding,
    clean_name,
    elements,
    is_dtensor,
    modules_with_units,
    some_names,
    top_units,
    unit_names,
    unwrapped,
)
from utilities.torch_internals import (
    fsdp1_flat_param,
    fsdp1_flat_param_contents,
    fsdp1_orig_params,
    fsdp1_uses_orig_params,
    fsdp2_forward_method_registered,
)
from utilities.wrapping import unit_parameter_counts

ROOT_SHARE_LIMIT = 0.5  # more of the parameters than this in the root unit: the model gathered at once
LARGE_UNIT_FACTOR = 4  # a unit this many times the median unit is far larger than the others
FROZEN_SHARE_LIMIT = 0.1  # frozen share of an FSDP1 use_orig_params unit worth its gradient memory


# -- FSDP1: frozen and trainable in one unit -------------------------------------------------------

def fsdp1_mixed_units(model: nn.Module, units: list[nn.Module]) -> list[Finding]:
    findings = []
    names = unit_names(model, units)
    for unit in units:
        params = fsdp1_orig_params(unit)
        if not params:
            continue
        frozen = [p for p in params if not p.requires_grad]
        if not frozen or len(frozen) == len(params):
            continue
        share = elements(frozen) / max(1, elements(params))
        if not fsdp1_uses_orig_params(unit):
            findings.append(Finding(
                "fsdp1-mixed-unit",
                f"unit {names[id(unit)]} mixes {elements(frozen)} frozen and "
                f"{elements(params) - elements(frozen)} trainable parameters without use_orig_params",
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

def unregistered_methods(model: nn.Module, units: list[nn.Module],
                          methods: tuple[str, ...]) -> list[Finding]:
    """A method other than forward, not registered, that runs modules whose parameters the root
    unit holds: FSDP2 gathers them only in the hooks around forward, so the call meets them
    sharded. A method that only calls forward, or a root that holds no parameter itself (every
    module's parameters gathered by its own unit's hooks), works unregistered: nothing said."""
    findings = []
    unit_ids = {id(u) for u in units}
    names = unit_names(model, units)
    for root in top_units(units):
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
            held[id(module)] = clean_name(name) or "the root"
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
            return f"its encoder, which uses {some_names(inside)}"
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
    return some_names(used) if used else ""


# -- what the units hold ---------------------------------------------------------------------------

def unmanaged_parameters(params: list[tuple[str, torch.Tensor]], units: list[nn.Module],
                          api: str) -> list[Finding]:
    if api == "fsdp2":
        loose = [n for n, p in params if not is_dtensor(p)]
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
        f"{len(loose)} parameters belong to no FSDP unit ({some_names(loose)})",
        "every rank keeps a full copy and their gradients are not averaged across ranks, so "
        "the ranks' copies drift apart", fix)]


def unit_sizes(model: nn.Module, units: list[nn.Module], api: str) -> list[Finding]:
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
            names = unit_names(model, units)
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
    modules = {clean_name(n): m for n, m in model.named_modules()}
    users: dict[str, list[str]] = {}  # a parameter's name -> the modules that hold it
    shapes: dict[str, torch.Size] = {}
    if api == "fsdp1":
        for name, shape in fsdp1_flat_param_contents(model) or ():
            name = clean_name(name)
            users[name], shapes[name] = [name.rpartition(".")[0]], torch.Size(shape)
    else:
        first: dict[int, str] = {}
        for name, module, unit in modules_with_units(model, units):
            if unit is not model:
                continue
            for pname, p in module._parameters.items():
                if p is None:
                    continue
                key = first.setdefault(id(p), clean_name(f"{name}.{pname}".lstrip(".")))
                shapes[key] = torch.Size(p.shape)
                if clean_name(name) not in users.setdefault(key, []):
                    users[key].append(clean_name(name))
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
            inner = [unwrapped(m) for m in module]
            if len({type(m) for m in inner}) == 1 and not any(id(m) in unit_ids for m in module):
                if best is None or len(module) > len(best):
                    best = inner
    return f"{len(best)} {type(best[0]).__name__} blocks" if best else ""
