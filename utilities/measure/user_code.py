"""Your own code in a plan: a model builder and a sharding function, as your training script has them.

``fsdp-course plan --model FILE.py:FUNCTION --parallelize FILE.py:FUNCTION [--batch-fn FILE.py:FUNCTION]``
and ``plan(model=builder, parallelize=fn, batch_fn=fn)``. The files are your own code: each is
imported as ``python FILE.py`` would import it (its folder first on ``sys.path``), and its module
level runs. Nothing the planner reads from a checkpoint, an archive or a config file is ever
imported; only a file named on the command line (or a function handed to ``plan``).

* ``--model FILE.py:FUNCTION``: ``FUNCTION()`` returns an ``nn.Module``. The planner calls it under
  ``torch.device("meta")`` (nothing allocated: any size on a laptop), shards it, then materializes
  it on fake tensors. Its forward follows Hugging Face's convention: ``model(input_ids=...,
  labels=...)`` returns the loss, or an output with ``.loss``.
* ``--batch-fn FILE.py:FUNCTION`` for any other forward: ``FUNCTION(batch, seq)`` returns
  ``(inputs, loss_fn)``: ``inputs`` a dict (``model(**inputs)``) or a tuple (``model(*inputs)``),
  ``loss_fn(output)`` the scalar loss. It runs on fake tensors, so it allocates nothing either.
* ``--parallelize FILE.py:FUNCTION``: ``FUNCTION(model, *, mesh, world_size, device, mp_policy)``
  shards the model in place (``fully_shard`` its units and its root, checkpoint, split...) as your
  training script does; it may leave out any of the keywords it does not need (``fn(model)`` alone
  can call ``utilities.distributed.world_mesh()``). ``mesh``: the planned world's DeviceMesh (1-D
  over ``--gpus`` ranks; with ``--strategy hybrid_shard`` 2-D ("replicate", "shard"); with ``--tp``
  2-D ("dp", "tp")); ``mp_policy``: the ``MixedPrecisionPolicy`` of the planned ``--precision``
  (``utilities.precision.fsdp2_policy``), for a function that passes ``fully_shard`` one. It runs
  on the fake process group at the planned world size, so everything ``plan`` reports comes from
  the model it made.

A model the course does not know is traced whole (no depth scaling), and its step time counts the
FLOPs of the traced matmuls and attention (no 6N formula it cannot know).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from utilities.errors import UsageError, bad_value
from utilities.models import ModelSpec, get_model_spec

FUNCTION_REF = re.compile(r"^(?P<file>.+\.py):(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")
PARALLELIZE_KEYWORDS = ("mesh", "world_size", "device", "mp_policy")
FORWARD_CONVENTION = ("a forward(input_ids, labels) that returns the loss or an output with .loss "
                      "(Hugging Face's convention), or --batch-fn FILE.py:FUNCTION returning "
                      "(inputs, loss_fn)")
DEFAULT_SEQ = 1024  # a builder's model: the sequence when --seq is not given


@dataclasses.dataclass(frozen=True)
class PlannedSpec(ModelSpec):
    """A ``ModelSpec`` with the user's code: ``parallelize`` (shards the built model),
    ``make_batch`` (the step's inputs and loss), ``flops_from_trace`` (a model the course cannot
    count with 6N: the time model sums the traced ops' FLOPs)."""

    parallelize: Callable[..., Any] | None = None
    make_batch: Callable[..., Any] | None = None
    flops_from_trace: bool = False


class NoBlocks(nn.Module):
    """The block class of a model without an ``nn.ModuleList``: nothing is one, the root is the
    one unit the course's sequence shards."""


_REGISTRY: dict[str, ModelSpec] = {}  # a plan's model name -> its spec (the time model's way back)


def is_function_ref(text: Any) -> bool:
    return isinstance(text, str) and FUNCTION_REF.match(text.strip()) is not None


def load_function(ref: str, flag: str) -> Callable[..., Any]:
    """``FILE.py:FUNCTION``: the file imported as ``python FILE.py`` imports it (its folder first
    on ``sys.path``) and its function; one line for a file that is not there, does not import, or
    lacks the function."""
    m = FUNCTION_REF.match(str(ref).strip())
    if m is None:
        raise bad_value(flag, ref, "FILE.py:FUNCTION (your own Python file and a function in it)")
    path = os.path.abspath(os.path.expanduser(m.group("file")))
    if not os.path.isfile(path):
        raise bad_value(flag, ref, f"FILE.py:FUNCTION of an existing file (no such file: {path})")
    name = f"_fsdp_course_user_{abs(hash((path, os.stat(path).st_mtime_ns)))}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        folder = os.path.dirname(path)
        sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the user's module failed at import: say so in one line
            raise UsageError(f"{flag} {ref} is not allowed: importing {os.path.basename(path)} raised "
                             f"{type(e).__name__}: {_first_line(e)}; allowed: a file that "
                             "imports as `python FILE.py` would") from None
        finally:
            if sys.path and sys.path[0] == folder:
                sys.path.pop(0)
        sys.modules[name] = module
    fn = getattr(module, m.group("name"), None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v)
                       and v.__module__ == name and not k.startswith("_"))
        raise bad_value(flag, ref, f"a function of {os.path.basename(path)}: "
                        + (", ".join(found) if found else "it defines none"))
    return fn


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def function_name(fn: Callable[..., Any], ref: str | None) -> str:
    """How a plan names a function: its ``FILE.py:FUNCTION``, else ``module.qualname`` (a
    ``functools.partial`` with its arguments' names)."""
    if ref:
        return ref
    base = getattr(fn, "func", fn)
    name = f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', type(base).__name__)}"
    if base is fn:
        return name
    args = [getattr(a, "__name__", repr(a)) for a in getattr(fn, "args", ())]
    args += [f"{k}={getattr(v, '__name__', repr(v))}" for k, v in getattr(fn, "keywords", {}).items()]
    return f"{name}({', '.join(args)})"


def build_user_model(builder: Callable[[], Any], name: str) -> nn.Module:
    """``builder()`` on the meta device: its module, or one line for a builder that raises or
    returns something else."""
    try:
        with torch.device("meta"):
            model = builder()
    except Exception as e:
        raise UsageError(f"--model {name} is not allowed: the builder raised {type(e).__name__}: "
                         f"{_first_line(e)}; allowed: a function that returns an nn.Module") from None
    if not isinstance(model, nn.Module):
        raise bad_value("--model", name, f"a function that returns an nn.Module (it returned "
                        f"{type(model).__name__})")
    return model


def _takes_hf_batch(model: nn.Module) -> bool:
    """``model.forward`` takes ``input_ids`` and ``labels`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return "input_ids" in params and "labels" in params


def _vocab_size(model: nn.Module) -> int | None:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def _repeated_block(model: nn.Module) -> type[nn.Module] | None:
    """The class of the children of the model's largest ``nn.ModuleList`` (its blocks)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None
    return type(max(lists, key=len)[0])


def builder_spec(builder: Callable[[], Any], ref: str | None = None,
                 batch_fn: Callable[..., Any] | None = None) -> PlannedSpec:
    """The spec of a model your ``builder`` makes (built once on meta to check and count it)."""
    name = function_name(builder, ref)
    model = build_user_model(builder, name)
    if batch_fn is None and not _takes_hf_batch(model):
        raise UsageError(f"--model {name} is not allowed: {type(model).__name__}.forward does not "
                         f"take input_ids and labels; allowed: {FORWARD_CONVENTION}")
    vocab = _vocab_size(model)
    if batch_fn is None and vocab is None:
        raise UsageError(f"--model {name} is not allowed: no nn.Embedding gives the token ids' "
                         f"range; allowed: {FORWARD_CONVENTION}")
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    block = _repeated_block(model)
    config = SimpleNamespace(vocab_size=vocab, model_type="")

    def make_model(_config):
        return build_user_model(builder, name)

    block = block or NoBlocks  # without a list of blocks: the root is the one unit
    return PlannedSpec(name=name, family="custom", make_config=lambda: config,
                       block_class_name=block.__name__, default_seq_len=DEFAULT_SEQ,
                       make_model=make_model, block_type=block, known_parameters=count,
                       make_batch=batch_fn, flops_from_trace=True)


def resolve_spec(model: Any, parallelize: Any = None, batch_fn: Any = None) -> ModelSpec:
    """The spec a plan traces: a course model's name, a config.json, ``FILE.py:FUNCTION`` or a
    builder function (``--model``), with the user's ``parallelize`` and ``batch_fn`` (functions
    or ``FILE.py:FUNCTION``) on it. Remembered by name for the time model."""
    par_ref = parallelize if isinstance(parallelize, str) else None
    batch_ref = batch_fn if isinstance(batch_fn, str) else None
    if par_ref is not None:
        parallelize = load_function(par_ref, "--parallelize")
    if batch_ref is not None:
        batch_fn = load_function(batch_ref, "--batch-fn")
    for flag, fn in (("--parallelize", parallelize), ("--batch-fn", batch_fn)):
        if fn is not None and not callable(fn):
            raise bad_value(flag, fn, "a function, or FILE.py:FUNCTION")
    if is_function_ref(model):
        spec = builder_spec(load_function(model, "--model"), model.strip(), batch_fn)
    elif callable(model) and not isinstance(model, (str, ModelSpec)):
        spec = builder_spec(model, None, batch_fn)
    else:
        spec = get_model_spec(model)
        if batch_fn is not None:
            raise bad_value("--batch-fn", batch_ref or function_name(batch_fn, None),
                            "only with --model FILE.py:FUNCTION (a course model's batch is its own)")
    if parallelize is None:
        if getattr(spec, "parallelize", None) is not None:  # already the user's
            return spec
        if isinstance(spec, PlannedSpec):
            _REGISTRY[spec.name] = spec
        return spec
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)}
    if isinstance(spec, PlannedSpec):
        fields.update(make_batch=spec.make_batch, flops_from_trace=spec.flops_from_trace)
    name = f"{spec.name} sharded by {function_name(parallelize, par_ref)}"
    fields["name"] = name
    planned = _REGISTRY.get(name)
    if not (isinstance(planned, PlannedSpec) and planned.parallelize is parallelize
            and planned.make_batch is fields.get("make_batch")
            and planned.make_model is fields["make_model"]):
        planned = PlannedSpec(**fields, parallelize=parallelize)
        _REGISTRY[name] = planned
    return planned


def user_batch(make_batch: Callable[..., Any], batch: int, seq: int, name: str):
    """The loss of the model as a function of it, from the user's ``make_batch(batch, seq)`` ->
    ``(inputs, loss_fn)``; one line when it raises or returns something else."""
    try:
        inputs, loss_fn = make_batch(batch, seq)
    except Exception as e:
        raise UsageError(f"--batch-fn of {name} is not allowed: it raised {type(e).__name__}: "
                         f"{_first_line(e)}; allowed: a function (batch, seq) -> (inputs, "
                         "loss_fn)") from None
    if not callable(loss_fn) or not isinstance(inputs, (dict, tuple, list)):
        raise bad_value("--batch-fn", name, "a function (batch, seq) returning (inputs: a dict "
                        "or a tuple, loss_fn: output -> loss)")

    def loss_of(model: nn.Module) -> torch.Tensor:
        return loss_fn(model(**inputs) if isinstance(inputs, dict) else model(*inputs))

    return loss_of


def check_user_code(spec: ModelSpec, strategy: str, ac: str, options) -> None:
    """Refuse in one line the settings a user's sharding function decides itself: activation
    checkpointing, offload, reshard_after_forward, a strategy other than full_shard or
    hybrid_shard (its mesh); and the options a builder's model has no blocks for."""
    if getattr(spec, "parallelize", None) is not None:
        name = spec.name.rpartition(" sharded by ")[2]
        if ac != "none":
            raise bad_value("--ac", ac, f"none with --parallelize {name} (your function "
                            "checkpoints what it checkpoints)")
        if strategy not in ("full_shard", "hybrid_shard"):
            raise bad_value("--strategy", strategy, f"full_shard or hybrid_shard with --parallelize "
                            f"{name} (the mesh it gets: 1-D, or 2-D for hybrid_shard; your "
                            "function decides reshard_after_forward)")
        if options.offload or options.reshard_after_forward is not None:
            raise bad_value("--parallelize", name, "without --offload and --reshard-after-forward "
                            "(your function passes fully_shard what it passes)")
    if getattr(spec, "flops_from_trace", False) and options.frozen:
        raise bad_value("--model", spec.name, "a course model or a config.json with --trainable "
                        "or --lora-rank (they pick a course model's blocks)")


def planned_spec(name: Any) -> ModelSpec:
    """A plan's model back from its name: the user's spec when it was one, else the course's."""
    if isinstance(name, str) and name in _REGISTRY:
        return _REGISTRY[name]
    return get_model_spec(name)


def takes_keyword(fn: Callable[..., Any], keyword: str) -> bool:
    """``fn`` takes ``keyword`` by name (or any keyword, through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def call_parallelize(fn: Callable[..., Any], model: nn.Module, mesh, device: torch.device,
                     name: str, mp_policy: Any = None, take_offload: bool = False) -> None:
    """``fn(model, mesh=..., world_size=..., device=..., mp_policy=...)``, passing the keywords it
    takes; one line when it raises, or leaves the root unsharded. ``take_offload``: the plan's
    offload arithmetic stands for the ``CPUOffloadPolicy`` the function gave its units, which the
    traced model then does not keep (``torch_internals.fsdp2_offloaded_units``)."""
    from torch.distributed.fsdp import FSDPModule

    offered = {"mesh": mesh, "world_size": mesh.size(), "device": device, "mp_policy": mp_policy}
    kwargs = {k: v for k, v in offered.items() if v is not None and takes_keyword(fn, k)}
    from utilities.distributed import run_device

    try:
        with run_device(device):  # world_mesh() in the user's code: the planned world's device
            fn(model, **kwargs)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"--parallelize {name} is not allowed: it raised {type(e).__name__}: "
                         f"{_first_line(e)}; allowed: a function fn(model, *, mesh, world_size, "
                         "device, mp_policy) that shards the model in place") from None
    if not isinstance(model, FSDPModule):
        raise UsageError(f"--parallelize {name} is not allowed: it left the model's root without "
                         "fully_shard; allowed: a function that ends with fully_shard(model, ...) "
                         "(the root unit), as a training script's does")
    if take_offload:
        from utilities.torch_internals import fsdp2_offloaded_units

        fsdp2_offloaded_units(model, take=True)

