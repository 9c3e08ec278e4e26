"""The plain reference loop: lesson 10's model and data on one device, without FSDP.

It is the ceiling against which `end_to_end.py` judges FSDP's overhead: the same model (built the
same way, from the same seed), the same precision, the same per-block `torch.compile` and
activation checkpointing, the same data stream (lesson 10's own `data_stream`, as rank 0 of 1) and
the same gradient clipping, timed by the same rules (every step synchronized; the first two steps,
lesson 10's warm-up and memory-probe steps, not timed; the median of the rest). What it does not
have is everything FSDP adds: no sharding, no all-gather or reduce-scatter (copies on one GPU), no
mixed-precision policy (bf16 is `torch.autocast` over fp32 parameters, the plain-PyTorch way to
compute in bf16 with fp32 master weights), and AdamW is always the fused kernel (foreach where this
torch has no fused kernel for the device), so a slower optimizer in the course's code shows up as a
lower ratio.

    python benchmarks/reference.py --configs eager-ac_none compile-ac_none --out ref.json \\
        -- --model llama-1b --seq-len 2048 --batch-size 8 --steps 20 --precision bf16

The flags after `--` are lesson 10's (`lessons/10_end_to_end/train.py --help`); `end_to_end.py`
passes the ones it gives every lesson-10 configuration, and each reference configuration
(MODE-AC) sets compile and checkpointing as the FSDP configurations of the same name do.

On CPU the loop runs with `--threads` threads (end_to_end.py passes what one torchrun rank gets:
OMP_NUM_THREADS, 1 by default), so that "one device" is one rank's share of the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import REPO, pick_device, save, sync

MODES = ("eager", "compile")
ACS = ("none", "selective", "full")
CONFIGS = [f"{m}-ac_{a}" for m in MODES for a in ACS]


def lesson10():
    """Lesson 10's train.py as a module (its data_stream, tokens_in); it puts its folder on
    ``sys.path``, so its train_config (parse_args, finalize) is importable after it."""
    path = REPO / "lessons" / "10_end_to_end" / "train.py"
    spec = importlib.util.spec_from_file_location("lesson10_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fused_adamw(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW with the fused kernel where the device has one, else foreach: the fast plain choice."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as fused_on
        kind = {"fused": True} if device.type in fused_on() else {"foreach": True}
    except ImportError:
        kind = {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kind)


def run_reference(config: str, lesson_flags: list[str], device: torch.device) -> dict[str, Any]:
    """Train lesson 10's model on ``device`` alone for the lesson's ``--steps``; return the row."""
    from utilities.activation_checkpointing import apply_activation_checkpointing, block_units
    from utilities.data import ReverseTask
    from utilities.models import get_model_spec
    from utilities.training import peak_flops

    mode, ac = config.split("-ac_")
    T = lesson10()
    import train_config

    cfg = train_config.finalize(train_config.parse_args(lesson_flags), on_gpu=device.type == "cuda")
    cfg = dataclasses.replace(cfg, compile=mode == "compile", activation_checkpointing=ac != "none",
                              ac_every=2 if ac == "selective" else 1)
    spec = get_model_spec(cfg.model)
    block = spec.block_class()
    torch.manual_seed(cfg.seed)
    model = spec.build(device=device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, block, every=cfg.ac_every, api="fsdp2")
    if cfg.compile:
        for unit in block_units(model, block):  # per block, in place, as lesson 10 does
            unit.compile()
    optimizer = fused_adamw(model.parameters(), cfg.lr, cfg.weight_decay, device)
    autocast = (contextlib.nullcontext() if cfg.precision == "fp32"
                else torch.autocast(device.type, dtype=torch.bfloat16))
    mode_name = "seq2seq" if spec.is_seq2seq else "causal"
    data = ReverseTask(max(cfg.batch_size * cfg.steps, 64), cfg.seq_len, mode=mode_name, seed=cfg.seed)
    batches = T.data_stream(cfg, data, 0, 1, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    losses, times, tokens = [], [], 0
    batch = next(batches)
    model.train()
    for step in range(1, cfg.steps + 1):
        sync(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        tokens = T.tokens_in(batch)
        batch = next(batches)
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        sync(device)
        if step > 2:  # lesson 10 times neither its warm-up step nor its memory-probe step
            times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    median = statistics.median(times) if times else None
    tokens_per_s = tokens / median if median else None
    peak = peak_flops(device)
    row = {
        "config": f"reference-{config}", "mode": mode, "ac": ac, "status": "ok",
        "model": {"name": spec.name, "parameters": spec.num_parameters},
        "precision": cfg.precision,
        "precision_impl": "fp32" if cfg.precision == "fp32" else "torch.autocast bf16, fp32 parameters",
        "optimizer": "AdamW " + ("fused" if optimizer.defaults.get("fused") else "foreach"),
        "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "steps": cfg.steps,
        "tokens_per_step": tokens, "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * spec.flops_per_token(cfg.seq_len) / peak if peak and tokens_per_s else None,
        "step_time_median_s": median, "step_time_min_s": min(times) if times else None,
        "step_time_max_s": max(times) if times else None, "timed_steps": len(times),
        "step_times_s": times, "losses": [float(v) for v in losses],
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda"
        else None,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
    }
    del model, optimizer, batches, batch, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    lesson_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["eager-ac_none"], choices=CONFIGS, metavar="CONFIG",
                   help=f"MODE-AC reference configurations (default eager-ac_none; choices: "
                        f"{' '.join(CONFIGS)})")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="cuda when a GPU is visible, else cpu (default: auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: torch's; end_to_end.py passes one rank's share)")
    p.add_argument("--out", default=None, help="where the JSON list of reference rows goes (required)")
    args = p.parse_args(own)
    if not args.out:
        p.error("--out is required")
    args.lesson_flags = lesson_flags
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    for config in args.configs:
        try:
            row = run_reference(config, ["--device", device.type, *args.lesson_flags], device)
        except Exception as e:  # one failed configuration is reported, the others still run
            first = str(e).splitlines()[0][:300] if str(e) else ""
            row = {"config": f"reference-{config}", "status": f"failed: {type(e).__name__}: {first}"}
        rows.append(row)
        done = f"{row['tokens_per_s']:,.0f} tokens/s" if row.get("tokens_per_s") else row["status"]
        print(f"{row['config']} (plain loop, one device, no FSDP): {done}", flush=True)
    save({"references": rows}, Path(args.out))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
