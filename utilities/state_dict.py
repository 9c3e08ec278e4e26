"""Full (gathered, CPU-offloaded, rank-0-only) checkpoints of an FSDP model and its optimizer.

A *full* state dict is the model as if it had never been sharded: every parameter whole, keyed by
its original name. Gathering it costs one all-gather per tensor and it must fit in one host's CPU
memory, because rank 0 holds all of it (``cpu_offload=True`` moves each gathered tensor to CPU at
once; the other ranks keep nothing). In exchange the file is one ordinary ``torch.save`` file that
any world size, FSDP1 or FSDP2, or plain ``transformers`` can read.

    save_full(path, model, optimizer, step)          # every rank calls it; rank 0 writes
    step = load_full(path, model, optimizer)         # every rank calls it; rank 0 reads
    export_hf(model_state_dict, config, directory)   # rank 0: a from_pretrained-able folder

Lesson 03 writes the gathering and the ``set_*_state_dict`` calls out itself and uses the pieces
here that it does not teach: ``read_on_rank0`` (the safe, checked read), ``FORMAT``, ``export_hf``.

Saving works for FSDP2 (``fully_shard``) and FSDP1 through ``torch.distributed.checkpoint.state_dict``
(``how="dcp"``) and for FSDP1 through its classic ``FullStateDictConfig`` (``how="fsdp1-classic"``);
both write the same keys, so either can be loaded by ``load_full``. Loading broadcasts rank 0's
tensors into the already sharded model and optimizer (``broadcast_from_rank0=True``), after checking
the keys and shapes ourselves: a wrong file is one line naming it, never a partial load.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from utilities.distributed import fail_together, one_line_error
from utilities.errors import UsageError
from utilities.owned_paths import (
    OWNED_MARKER,
    discard_owned,
    folder_state,
    mark_owned,
    owned_entry,
    owned_names,
)
from utilities.safe_files import (
    atomic_torch_save,
    exchange_in,
    fsync_files,
    regular_file_size,
    staging_path,
    swap_in,
)
from utilities.torch_zip import safe_torch_load

FORMAT = "fsdp-course-full-state-dict-v1"
HOWS = ("dcp", "fsdp1-classic")


# -- gathering ---------------------------------------------------------------------------------
def gather_full(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                how: str = "dcp") -> tuple[dict[str, Any], dict[str, Any]]:
    """The full model and optimizer state dicts on rank 0's CPU (empty dicts on other ranks).

    Every rank must call this: each tensor is all-gathered, then kept only on rank 0.
    """
    if how == "dcp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=_offload(model))
        if optimizer is None:
            return get_model_state_dict(model, options=options), {}
        return get_state_dict(model, optimizer, options=options)
    if how == "fsdp1-classic":
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if not isinstance(model, FSDP):
            raise UsageError("--save-with 'fsdp1-classic' needs an FSDP1 model; allowed for FSDP2: dcp")
        offload = _offload(model)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True)):
            msd = model.state_dict()
            osd = FSDP.optim_state_dict(model, optimizer) if optimizer is not None else {}
        if _rank() != 0:
            return {}, {}
        return msd, osd
    raise UsageError(f"how {how!r} is not allowed; allowed: {', '.join(HOWS)}")


def _offload(model: nn.Module) -> bool:
    """Offload to CPU only from a GPU. On a CPU-resident FSDP1 model "offloading" is a no-op that
    hands back views into the unsharded flat parameter, which FSDP frees as soon as the gather
    ends (torch 2.13: "setStorage ... storage of size 0", or a hang in the classic path)."""
    return any(p.device.type == "cuda" for p in model.parameters())


# -- saving ------------------------------------------------------------------------------------
def save_full(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
              step: int, how: str = "dcp", extra: dict[str, Any] | None = None) -> int:
    """Gather and write a full checkpoint (rank 0 writes); returns its size in bytes on every rank.

    The file is written to a temporary name in the same directory and renamed into place, so a
    crash mid-write leaves the previous checkpoint, never a half-written one.
    """
    msd, osd = gather_full(model, optimizer, how)
    size = 0
    with fail_together(f"saving {path}"):  # rank 0 failing alone would leave the others waiting
        if _rank() == 0:
            payload = {"format": FORMAT, "step": int(step), "model": msd, "optimizer": osd,
                       "extra": dict(extra or {})}
            size = atomic_torch_save(payload, Path(path))
    return int(_broadcast_object(size))


# -- loading -----------------------------------------------------------------------------------
def read_full(path: str | os.PathLike) -> dict[str, Any]:
    """Read a full checkpoint on this process (``weights_only=True``: tensors and plain data only,
    no arbitrary pickled code). A missing, truncated, foreign or code-carrying file is a one-line
    UsageError."""
    p = Path(path)
    if not os.path.lexists(p):
        raise UsageError(f"checkpoint {p} does not exist")
    ckpt = safe_torch_load(p, f"checkpoint {p}")
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UsageError(f"checkpoint {p} is not a full state dict checkpoint "
                         f"(no format {FORMAT!r}; found {_describe(ckpt)})")
    if not isinstance(ckpt.get("model"), dict) or not isinstance(ckpt.get("step"), int):
        raise UsageError(f"checkpoint {p} is incomplete: it lacks the model state dict or the step")
    return ckpt


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Original parameter/buffer names and global (unsharded) shapes of a sharded model.

    Every rank must call this (FSDP1's sharded state dict talks to the other ranks); nothing is
    gathered: DTensor and ShardedTensor already know their global size.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model)
    return {k: tuple(v.size()) for k, v in sd.items() if isinstance(v, torch.Tensor)
            or hasattr(v, "size")}


def check_model_keys(path: str | os.PathLike, got: dict[str, Any],
                     expected: dict[str, tuple[int, ...]], show: int = 3) -> None:
    """Refuse, in one line, a checkpoint whose keys or shapes are not this model's."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    wrong = [f"{k} {tuple(got[k].shape)} vs {expected[k]}" for k in expected
             if k in got and isinstance(got[k], torch.Tensor) and tuple(got[k].shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys ({_first(missing, show)})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys ({_first(unexpected, show)})")
    if wrong:
        problems.append(f"{len(wrong)} wrong shapes ({_first(wrong, show)})")
    if problems:
        raise UsageError(f"checkpoint {path} is not of this model: {'; '.join(problems)}")


def read_on_rank0(path: str | os.PathLike, model: nn.Module,
                  optimizer: torch.optim.Optimizer | None = None
                  ) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Rank 0 reads and checks a full checkpoint for ``model``: ``(step, model_sd, optim_sd)``,
    the two dicts empty on the other ranks (what ``broadcast_from_rank0=True`` expects).

    Every rank must call this. The file is read with ``weights_only=True`` and its keys and shapes
    are checked against the model (and the optimizer's, when one is given) on rank 0; the verdict
    is shared, so every rank raises the same one-line UsageError and none starts a partial load.
    For FSDP1 the tied aliases are left out (``drop_tied_aliases``).
    """
    expected = expected_shapes(model)
    ckpt, error = None, None
    if _rank() == 0:
        try:
            ckpt = read_full(path)
            check_model_keys(path, ckpt["model"], expected)
            if optimizer is not None:
                osd = ckpt.get("optimizer") or {}
                if not osd.get("param_groups"):
                    raise UsageError(f"checkpoint {path} holds no optimizer state")
                check_optimizer_keys(path, osd, expected)
        except Exception as e:  # noqa: BLE001 - any failure here must reach the waiting ranks
            error = one_line_error(f"reading {path}", e)
    error = _broadcast_object(error)
    if error is not None:
        raise UsageError(error)
    step = int(_broadcast_object(ckpt["step"] if ckpt is not None else None))
    if ckpt is None:
        return step, {}, {}
    msd = ckpt["model"]
    if _is_fsdp1(model):
        msd = drop_tied_aliases(path, msd, getattr(model, "module", model))
    return step, msd, (ckpt.get("optimizer") or {}) if optimizer is not None else {}


def load_full(path: str | os.PathLike, model: nn.Module,
              optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load a full checkpoint into an already sharded model (and optimizer); returns the step.

    Every rank must call this. Only rank 0 reads the file (its CPU holds one full copy); the
    tensors reach the other ranks' shards through ``broadcast_from_rank0=True``. The keys are
    checked first on rank 0 and the verdict is shared, so every rank raises the same UsageError.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    step, msd, osd = read_on_rank0(path, model, optimizer)
    fsdp1 = _is_fsdp1(model)
    # strict: every key must be used. FSDP1 then reports the dropped tied aliases as "missing"
    # although they share storage with their target, so there we rely on our own check above.
    options = StateDictOptions(full_state_dict=True, cpu_offload=_offload(model),
                               broadcast_from_rank0=True, strict=not fsdp1)
    # Two calls, not set_state_dict: with an empty model dict on ranks > 0, set_state_dict would
    # treat those ranks as "optimizer only" and skip the model broadcast (a hang in torch 2.13).
    set_model_state_dict(model, msd, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=options)
    return step


def drop_tied_aliases(path: str | os.PathLike, msd: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """Leave out the tied copies (``lm_head.weight`` = ``shared.weight``...) for FSDP1.

    FSDP1 keeps a tied weight once inside its flat parameter, and the rank-0 broadcast in torch 2.13
    looks up every key of the full dict among the model's *deduplicated* names, so an alias key
    fails there. The alias is the same tensor as its target; we check that before dropping it.
    """
    tied = getattr(module, "_tied_weights_keys", None) or {}
    if not isinstance(tied, dict):
        return msd
    out = dict(msd)
    for alias, target in tied.items():
        if alias in out and target in out:
            if not torch.equal(out[alias], out[target]):
                raise UsageError(f"checkpoint {path}: tied weights {alias} and {target} differ")
            del out[alias]
    return out


def _is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, FSDP)


def check_optimizer_keys(path: str | os.PathLike, osd: dict[str, Any],
                         expected: dict[str, tuple[int, ...]]) -> None:
    names = set(osd.get("state", {}))
    for group in osd.get("param_groups", []):
        names.update(group.get("params", []))
    unexpected = sorted(n for n in names if n not in expected)
    if unexpected:
        raise UsageError(f"checkpoint {path} has optimizer state for parameters this model lacks: "
                         f"{len(unexpected)} ({_first(unexpected, 3)})")


# -- Hugging Face export -----------------------------------------------------------------------
def export_hf(model_state_dict: dict[str, torch.Tensor], config: Any, directory: str | os.PathLike,
              model_class: type | None = None) -> Path:
    """Write ``directory`` so ``from_pretrained(directory)`` rebuilds this model (safetensors).

    Run it on rank 0 with the full state dict. Tied weights (T5's ``shared`` / ``embed_tokens`` /
    ``lm_head``) are one tensor in the model: we load every key strictly into a model built from
    the config, and ``save_pretrained`` stores each tied tensor once (safetensors refuses aliases).

    ``directory`` is a new folder, an empty one, or an earlier export: its marker
    (``owned_paths.OWNED_MARKER``) lists the files the course wrote there, and only those are
    replaced or deleted; a user's files beside them (a tokenizer, a README) are kept. Anything else
    (a file, a downloaded model folder) is refused in one line, nothing replaced or deleted.
    """
    if model_class is None:
        model_class = hf_model_class(config)
    model = model_class(config)
    result = model.load_state_dict(model_state_dict, strict=False)
    tied = set(_tied_keys(model))
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise UsageError(f"cannot export to {directory}: {len(missing)} missing keys "
                         f"({_first(missing, 3)}), {len(result.unexpected_keys)} unexpected keys "
                         f"({_first(result.unexpected_keys, 3)})")
    model.tie_weights()
    directory = Path(directory)
    what = f"cannot export to {str(directory)!r}"
    user_files = _files_beside_export(directory, what)
    # written beside it, then published over it with one atomic rename where the system has one
    # (an exchange: a kill at any instant leaves an export, old or new, under its name); elsewhere
    # with swap_in's two renames, between which a kill leaves only .NAME.old and .NAME.tmp. The
    # user's files beside an earlier export are hard-linked into the new one, and of the folder
    # replaced only what the course wrote is deleted (``discard_owned``).
    def discard(folder: Path) -> None:
        discard_owned(folder, directory, what)

    tmp = staging_path(directory)
    discard(tmp)
    if os.path.lexists(tmp):
        raise UsageError(f"{what}: {str(tmp)!r}, where the export is staged, holds files the course "
                         "did not write; move them away")
    tmp.mkdir(parents=True)
    try:
        mark_owned(tmp, None)
        model.save_pretrained(tmp, safe_serialization=True)
        written = sorted(set(os.listdir(tmp)) - {OWNED_MARKER})
        taken = sorted(set(written) & set(user_files))
        if taken:
            raise UsageError(f"{what}: it holds {_first(taken, 3)}, which the course did not write "
                             "there (not in its marker); not replaced: move it or export elsewhere")
        fsync_files(tmp)
        for name in user_files:
            _keep_beside(owned_entry(directory, name, what), owned_entry(tmp, name, what), what)
        mark_owned(tmp, written)
        if not exchange_in(tmp, directory, discard):
            swap_in(tmp, directory, discard)
    except BaseException as e:
        discard(tmp)
        if isinstance(e, OSError):
            raise UsageError(f"{what}: {type(e).__name__}: {e.strerror or e} ({e.filename}); the "
                             "earlier export, if any, is left as it was") from None
        raise
    return directory


def _files_beside_export(directory: Path, what: str) -> list[str]:
    """The names in the folder ``directory`` that an earlier export did not write there (the user's,
    to keep); refuses, in one line, anything but a missing folder, an empty one or an earlier
    export (its ``OWNED_MARKER`` lists what the course wrote), and a user's folder inside it."""
    state = folder_state(directory, OWNED_MARKER)
    if state == "missing":
        return []
    if state in ("link", "file"):
        kind = "a symbolic link" if state == "link" else "a file"
        raise UsageError(f"{what}: it is {kind}, not a folder; refused, nothing was replaced or "
                         "deleted; allowed: a new folder or an earlier export")
    ours = owned_names(directory, what)
    entries = sorted(set(os.listdir(directory)) - {OWNED_MARKER})
    if ours is None and entries:
        raise UsageError(f"{what}: it holds files and is not an export the course wrote (no "
                         f"{OWNED_MARKER}); refused, nothing was replaced or deleted; allowed: a new "
                         "folder or an earlier export")
    beside = [name for name in entries if name not in (ours or ())]
    folders = [name for name in beside if not os.path.islink(directory / name)
               and regular_file_size(directory / name) is None]
    if folders:
        raise UsageError(f"{what}: it holds {_first(folders, 3)}, which is not a file the course "
                         "wrote; only files are kept beside an export: move it or export elsewhere")
    return beside


def _keep_beside(source: Path, target: Path, what: str) -> None:
    """A user's file ``source`` beside an export, also at ``target`` in the new one: a hard link
    (one file, two names), or a copy of a symbolic link."""
    try:
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        else:
            os.link(source, target, follow_symlinks=False)
    except OSError as e:
        raise UsageError(f"{what}: its file {source.name!r} cannot be kept beside the new export "
                         f"({e.strerror}); move it away and export again") from None


def hf_model_class(config: Any) -> type:
    """The transformers class with a language-model head for ``config``: seq2seq (T5) or causal
    (Llama), the one ``AutoModelFor...LM.from_pretrained`` gives back."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    for auto in (AutoModelForSeq2SeqLM, AutoModelForCausalLM):
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise UsageError(f"cannot export a {type(config).__name__}: no seq2seq or causal LM class "
                     "in transformers for it")


def _tied_keys(model: nn.Module) -> Iterable[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return tied.keys() if isinstance(tied, dict) else tied


# -- helpers -----------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast_object(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _first(items: list[str], n: int) -> str:
    shown = ", ".join(str(i) for i in items[:n])
    return shown + (", ..." if len(items) > n else "")


def _describe(obj: Any) -> str:
    if isinstance(obj, dict):
        return f"a dict with keys {_first([str(k) for k in obj], 3)}"
    return f"a {type(obj).__name__}"
