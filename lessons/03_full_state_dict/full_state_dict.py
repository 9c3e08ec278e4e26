"""Lesson 03: full state dict save and load.

A full state dict is the sharded model gathered back into ordinary whole tensors, on rank 0's CPU,
in one file: readable by any world size, by FSDP1 or FSDP2, and (exported) by plain transformers.

For each variant this script trains a few steps, saves model + optimizer + step as one full
checkpoint, loads it into a freshly built and sharded model and a fresh optimizer, and checks:

    outputs      the loaded model's logits equal the trained model's (max abs diff)
    next step    one more training step gives the same loss and the same updated weights, so the
                 optimizer state (AdamW moments and step count) came back too
    HF export    transformers' from_pretrained on the exported folder gives the same logits

    fsdp2          fully_shard + get_model_state_dict / get_optimizer_state_dict (full_state_dict)
    fsdp1          FullyShardedDataParallel + the same calls
    fsdp1-classic  FullyShardedDataParallel + FSDP.state_dict_type(FULL_STATE_DICT, rank0_only)

Run: fsdp-course run 03 [--quick]   or   torchrun --nproc-per-node 2 full_state_dict.py --device cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import fail_together, reduce_scalar
from utilities.measure import fmt_bytes
from utilities.models import META_INIT_THRESHOLD
from utilities.safe_files import lock_checkpoints
from utilities.state_dict import FORMAT, export_hf, read_on_rank0
from utilities.training import sync
from utilities.wrapping import shard_model

# cuBLAS reads this once, when its first handle is made (the first matmul on a GPU, long after
# these imports): see deterministic_kernels() below.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

StateDicts = tuple[dict[str, Any], dict[str, Any]]  # (model, optimizer)


# -- the code this lesson teaches -----------------------------------------------------------------
def offload_to_cpu(model: nn.Module) -> bool:
    """Offload each gathered tensor to CPU only from a GPU, so GPU memory never holds the whole
    model. On a CPU-resident FSDP1 model "offloading" is a no-op that hands back views into the
    gathered flat parameter, which FSDP frees as soon as the gather ends (torch 2.13: "setStorage
    ... storage of size 0", or a hang in the classic path)."""
    return any(p.device.type == "cuda" for p in model.parameters())


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateDicts:
    """FSDP2, and FSDP1 through the same API: whole tensors under the original parameter names.

    Every rank must call it: each tensor is all-gathered. With ``cpu_offload`` each one goes to
    rank 0's CPU as it arrives and the other ranks get ``{}``, so the host holds one copy, not N.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload_to_cpu(model))
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = {} if optimizer is None else get_optimizer_state_dict(model, optimizer, options=options)
    return model_sd, optim_sd


def gather_full_state_fsdp1_classic(model: nn.Module,
                                    optimizer: torch.optim.Optimizer | None = None) -> StateDicts:
    """FSDP1's own way, deprecated in favour of ``gather_full_state`` (it writes the same keys, so
    either file loads the same): inside ``FULL_STATE_DICT``, ``state_dict()`` and ``optim_state_dict``
    gather, and ``rank0_only`` leaves the other ranks nothing."""
    if not isinstance(model, FSDP):
        raise TypeError("the FSDP1 classic full state dict needs a FullyShardedDataParallel model")
    offload = offload_to_cpu(model)
    with warnings.catch_warnings():  # the deprecation notice, once per call, on every rank
        warnings.filterwarnings("ignore", message=r"FSDP\.state_dict_type", category=FutureWarning)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True)):
            model_sd = model.state_dict()
            optim_sd = {} if optimizer is None else FSDP.optim_state_dict(model, optimizer)
    return (model_sd, optim_sd) if dist.get_rank() == 0 else ({}, {})


def save_on_rank0(path: str | os.PathLike, model_sd: dict[str, Any], optim_sd: dict[str, Any],
                  step: int) -> int:
    """Rank 0 writes one ``torch.save`` file; returns its size on every rank.

    It writes to a temporary file of its own in the same directory (``mkstemp``: a unique name, so
    two saves never write into one temporary), flushes it to disk, and renames it over ``path``
    (``os.replace`` is atomic), so a crash mid-write leaves the previous checkpoint whole. Two runs
    saving into one folder would still overwrite each other's files: ``main`` locks the folder.

    Only rank 0 writes, so only rank 0 can fail (a full disk, a folder it may not write): the other
    ranks would wait for its answer for ever. ``fail_together`` shares the outcome, and every rank
    raises the same one-line error.
    """
    path, size = Path(path), [0]
    with fail_together(f"saving {path}"):
        if dist.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            tmp = Path(name)
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save({"format": FORMAT, "step": step, "model": model_sd,
                                "optimizer": optim_sd}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            size = [path.stat().st_size]
    dist.broadcast_object_list(size, src=0)
    return size[0]


def save_full_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                         step: int, gather: Callable[..., StateDicts] = gather_full_state) -> int:
    """Every rank gathers, rank 0 writes: the whole save, model + optimizer + step."""
    return save_on_rank0(path, *gather(model, optimizer), step)


def load_full_checkpoint(path: str | os.PathLike, model: nn.Module,
                         optimizer: torch.optim.Optimizer) -> int:
    """Load a full checkpoint into an already sharded model and optimizer; returns the step.

    Every rank calls it. Rank 0 alone reads the file (``weights_only``, its keys and shapes checked
    against the model: a wrong file is one line on every rank, never a partial load); then
    ``broadcast_from_rank0`` sends each rank its own shard of every tensor.
    """
    step, model_sd, optim_sd = read_on_rank0(path, model, optimizer)  # {} on ranks > 0
    # FSDP1 keeps a tied weight once, so read_on_rank0 dropped the alias keys: not strict there
    fsdp1 = isinstance(model, FSDP)
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload_to_cpu(model),
                               broadcast_from_rank0=True, strict=not fsdp1)
    # Two calls, not set_state_dict: given an empty model dict (ranks > 0), set_state_dict treats
    # the call as optimizer-only and skips the model broadcast, and rank 0 waits forever.
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
    return step


GATHER = {"dcp": gather_full_state, "fsdp1-classic": gather_full_state_fsdp1_classic}
VARIANTS = {"fsdp2": ("fsdp2", "dcp"), "fsdp1": ("fsdp1", "dcp"),  # name: (api, GATHER key)
            "fsdp1-classic": ("fsdp1", "fsdp1-classic")}


# -- the experiment -------------------------------------------------------------------------------
NOTE = ("checkpoint_bytes: model + AdamW state + step in one torch.save file, written by rank 0 only "
        "(the other ranks hold nothing).")
CPU_NOTE = ("On CPU, nothing is offloaded (offload_to_cpu / cpu_offload=False): for an FSDP1 model "
            "already on CPU, offloading returns views of freed gather buffers in torch 2.13. Save/load "
            "times on CPU with gloo are small and only indicative; on GPUs the gather and the "
            "device-to-host copies dominate.")


def deterministic_kernels(device: torch.device) -> bool:
    """Make GPU kernels bitwise reproducible, so "identical" can mean identical.

    On a CPU the same computation gives the same bits every time. On a GPU some kernels do not:
    an embedding's backward adds rows with atomics in whatever order the threads finish, and cuBLAS
    may split a reduction differently; float addition is not associative, so two runs of the same
    step can differ in the last bits. Deterministic mode picks order-fixed kernels (slower), and
    cuBLAS needs a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, set at import, above).
    """
    if device.type != "cuda":
        return False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    return True


@torch.no_grad()
def logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).logits.float().cpu()


def sharded(lesson: Lesson, api: str, fresh: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The lesson's model sharded per block (wrapping is lesson 01's topic) and its AdamW.
    ``fresh``: built from other random weights, so a load that does nothing cannot pass."""
    if fresh:
        torch.manual_seed(lesson.args.seed + 12345)
        on_meta = lesson.spec.num_parameters > META_INIT_THRESHOLD
        model = lesson.spec.build(device="meta" if on_meta else lesson.device)
    else:
        model = lesson.build_model()
    model = lesson.materialize(shard_model(model, api=api, block_class=lesson.spec.block_class(),
                                           policy="block", device=lesson.device))
    return model, lesson.optimizer(model)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the seconds its slowest rank took: a save ends when its last rank ends."""
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args)
    sync(device)
    return out, reduce_scalar(time.perf_counter() - t0, "max", device)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    return reduce_scalar((a - b).abs().max().item(), "max", device)  # the worst rank's


def round_trip(lesson: Lesson, name: str, probe: dict, ckpt_dir: Path, export: bool) -> None:
    """Train, save, load into a fresh model, compare outputs and the next step, export to HF."""
    api, how = VARIANTS[name]
    gather, device = GATHER[how], lesson.device

    # 1. train, then save a full checkpoint (model + optimizer + step)
    model, optim = sharded(lesson, api)
    stats = lesson.train(model, name, optimizer=optim, measure_memory=False)
    path = ckpt_dir / f"{name}.pt"
    nbytes, save_s = timed(device, save_full_checkpoint, path, model, optim, lesson.steps, gather)
    reference = logits(model, probe)

    # 2. a fresh sharded model (other random weights) and a fresh optimizer, then load
    fresh, fresh_optim = sharded(lesson, api, fresh=True)
    before_load = max_abs_diff(logits(fresh, probe), reference, device)
    step, load_s = timed(device, load_full_checkpoint, path, fresh, fresh_optim)
    out_diff = max_abs_diff(logits(fresh, probe), reference, device)

    # 3. the next optimizer step must be the same: same loss, same updated weights
    batch = next(lesson.data(seed_offset=2000))
    loss_a, loss_b = train_step(model, optim, batch), train_step(fresh, fresh_optim, batch)
    after_diff = max_abs_diff(logits(model, probe), logits(fresh, probe), device)
    loss_diff = reduce_scalar(abs(loss_a - loss_b), "max", device)

    # 4. export the weights after that step for transformers; from_pretrained must match (rank 0)
    hf = {}
    if export:
        hf = check_export(lesson, gather(fresh)[0], ckpt_dir / f"{name}-hf", probe, logits(fresh, probe))
    ok = out_diff == 0.0 and loss_diff == 0.0 and after_diff == 0.0
    lesson.results.add(name, stats, api=api, saved_with=how, checkpoint_bytes=nbytes,
                       save_s=round(save_s, 4), load_s=round(load_s, 4), loaded_step=step,
                       diff_before_load=before_load, outputs_max_abs_diff=out_diff,
                       outputs_identical=out_diff == 0.0, next_loss_a=loss_a, next_loss_b=loss_b,
                       next_step_loss_diff=loss_diff, after_step_max_abs_diff=after_diff,
                       next_step_identical=loss_diff == 0.0 and after_diff == 0.0,
                       checkpoint=str(path), **hf)
    lesson.print(f"    {name}: saved {fmt_bytes(nbytes)} in {save_s:.3f}s, loaded in {load_s:.3f}s (step "
                 f"{step}); outputs diff {out_diff:g} (fresh model: {before_load:.3g}), next step loss "
                 f"{loss_a:.6f} vs {loss_b:.6f}, weights after diff {after_diff:g}"
                 + (f", HF export diff {hf['hf_max_abs_diff']:g}" if hf else "")
                 + ("" if ok else "  <-- NOT IDENTICAL"))
    del model, optim, fresh, fresh_optim


def check_export(lesson: Lesson, model_sd: dict, directory: Path, probe: dict,
                 expected: torch.Tensor) -> dict[str, Any]:
    """Rank 0 writes a safetensors folder and reloads it with plain ``from_pretrained``."""
    result: dict[str, Any] = {}
    with fail_together(f"exporting to {directory}"):  # rank 0 failing stops every rank
        if lesson.dist.is_main:
            from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

            t0 = time.perf_counter()
            export_hf(model_sd, lesson.spec.config(), directory)
            export_s = time.perf_counter() - t0
            auto = AutoModelForSeq2SeqLM if lesson.spec.is_seq2seq else AutoModelForCausalLM
            reloaded = auto.from_pretrained(directory).to(lesson.device).eval()
            diff = (logits(reloaded, probe) - expected).abs().max().item()
            size = sum(f.stat().st_size for f in directory.iterdir()  # the hidden one: the
                       if f.is_file() and not f.name.startswith("."))  # course's list of its files
            result = dict(hf_export_s=round(export_s, 4), hf_export_bytes=size,
                          hf_max_abs_diff=diff, hf_identical=diff == 0.0, hf_dir=str(directory))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = lesson_parser(__doc__)
    parser.add_variants(VARIANTS)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints and HF exports go (default: OUT/checkpoints)")
    parser.add_argument("--no-export", action="store_true", help="skip the Hugging Face export check")
    return parser.parse(argv)


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    exact = all(v.get("outputs_identical") and v.get("next_step_identical") for v in results["variants"])
    return (f"full state dict: {'every' if exact else 'NOT every'} reload gives identical outputs and "
            f"an identical next step ({', '.join(v['name'] for v in results['variants'])})")


def main(args: argparse.Namespace) -> None:
    with Lesson("03", args, notes=(NOTE,), cpu_note=CPU_NOTE, takeaway=takeaway) as lesson:
        lesson.results.setting(deterministic_kernels=deterministic_kernels(lesson.device))
        lesson.results.columns("checkpoint_bytes", "save_s", "load_s", "outputs_identical",
                               "next_step_identical", "hf_identical")
        ckpt_dir = Path(args.checkpoint_dir or lesson.out / "checkpoints")
        with fail_together(f"locking {ckpt_dir}"):  # a second run saving there: one line, exit 2
            lock = lock_checkpoints(ckpt_dir) if dist.get_rank() == 0 else None  # noqa: F841 - held
        probe = next(lesson.data(seed_offset=1000))  # a fixed batch, never trained on, for comparisons
        for name in args.variants:
            with lesson.variant(name):  # everything the variant made is freed before the next one
                round_trip(lesson, name, probe, ckpt_dir, export=not args.no_export)


if __name__ == "__main__":
    main(parse_args())
