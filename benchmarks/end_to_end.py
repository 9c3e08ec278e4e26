"""End-to-end benchmark: lesson 10's training program on a ~1B Llama, configuration by configuration.

Measures tokens/s, MFU and peak memory per rank for FSDP1 vs FSDP2, eager vs torch.compile, and
activation checkpointing none / selective (every other block) / full (every block). Each
configuration is one launch of lesson 10 through the course CLI (torchrun underneath); its
results.json is read back. Lesson 10 times every step after the first two (warm-up, memory probe),
synchronized, and reports the median; min and max are computed here from its step times. Use --steps
>= 12 for at least 10 timed steps.

"Selective" here is lesson 10's --ac-every 2 (every other block recomputed), the block-level
middle ground lesson 02 teaches, not torchtitan's op-level selective checkpointing.

The reference: in the same run, before the FSDP configurations, benchmarks/reference.py trains the
same model on one device without FSDP (same precision, compile and checkpointing setting, same
data and flags; fused AdamW), once per MODE-AC setting the configurations use. Every configuration
gets `reference` (the row it is compared with) and `ratio_to_reference` = its tokens/s per device
(tokens/s / ranks) / the reference's tokens/s: 1.0 means FSDP costs nothing over the plain loop,
and ratios from different machines and GPU counts compare where raw tokens/s do not.

GPU (default): llama-1b, seq 2048, bf16, batch 8 per GPU, 20 steps, every GPU of the host. Batch 8
(16,384 tokens per GPU per step, as torchtitan's Llama 3 8B runs: batch 2 x seq 8192) rather than
4: at batch 4 the fixed per-step work (the optimizer over 1.2B parameters, FSDP's copies) weighs on
half as many tokens. Measured on one H100 at commit 33b7010: lesson 10, FSDP2 + compile, 43,092
tokens/s (MFU 35.8%) at batch 4, 51,804 (43.4%) at batch 8; batch 8 without activation
checkpointing peaked at 56.6 GiB, so it fits 80 GB.
--tiny (CPU): llama-tiny, seq 32, fp32, 4 steps, 2 ranks, two configurations (one per API, one
with checkpointing: each lesson-10 launch costs ~13 s on a 2-core machine, mostly start-up).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import json
import os
import subprocess

from common import (
    REPO,
    base_parser,
    metadata,
    output_path,
    pick_device,
    run_lesson,
    save,
)

NAME = "end_to_end"
APIS = ("fsdp2", "fsdp1")
MODES = ("eager", "compile")
ACS = ("none", "selective", "full")
AC_FLAGS = {"ac_none": [], "ac_selective": ["--activation-checkpointing", "--ac-every", "2"],
            "ac_full": ["--activation-checkpointing"]}
ALL_CONFIGS = [f"{a}-{m}-ac_{c}" for a in APIS for m in MODES for c in ACS]
TINY_CONFIGS = ["fsdp2-eager-ac_none", "fsdp1-eager-ac_selective"]


def parse_args(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--model", default=None, help="named model (default llama-1b; llama-tiny with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; 32 tiny)")
    p.add_argument("--batch-size", type=int, default=None, help="micro-batch per rank (default 8)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per configuration; the first 2 are not timed (default 20; 4 tiny)")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16", "bf16-fp32-reduce"),
                   help="mixed precision policy (default bf16 on GPU, fp32 tiny/CPU)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 2 on CPU)")
    p.add_argument("--configs", nargs="+", default=None, choices=ALL_CONFIGS, metavar="CONFIG",
                   help=f"configurations to run, API-MODE-AC (default all 12 on GPU; tiny: "
                        f"{' '.join(TINY_CONFIGS)}); choices: {' '.join(ALL_CONFIGS)}")
    p.add_argument("--work-dir", default=None,
                   help="where each configuration's lesson-10 run goes (default runs/benchmarks/end_to_end)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per configuration (default 1800)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the plain one-device reference loop (then no ratio_to_reference)")
    args = p.parse_args(argv)
    on_gpu = pick_device(args.device).type == "cuda"
    tiny = args.tiny or not on_gpu and args.model is None
    args.model = args.model or ("llama-tiny" if tiny else "llama-1b")
    args.seq_len = args.seq_len or (32 if tiny else 2048)
    args.batch_size = args.batch_size or 8
    args.steps = args.steps or (4 if tiny else 20)
    args.precision = args.precision or ("bf16" if on_gpu and not args.tiny else "fp32")
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count() if on_gpu else 2
    args.configs = args.configs or (TINY_CONFIGS if args.tiny else ALL_CONFIGS)
    args.work_dir = args.work_dir or str(REPO / "runs" / "benchmarks" / NAME)
    return args


def base_flags(args) -> list[str]:
    """The lesson-10 flags every configuration and the reference share."""
    return ["--model", args.model, "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--precision", args.precision, "--ckpt-every", "0", "--eval-every", str(args.steps),
            "--eval-batches", "1", "--log-every", str(args.steps), "--warmup-steps", "1"]


def lesson_flags(args, config: str) -> list[str]:
    api, mode, ac = config.split("-")
    flags = ["--api", api, *base_flags(args)]
    if mode == "compile":
        flags.append("--compile")
    return flags + AC_FLAGS[ac]


def reference_of(config: str) -> str:
    """fsdp2-compile-ac_none -> compile-ac_none: the reference with the same compile and AC."""
    return config.split("-", 1)[1]


def run_references(args, device, configs: list[str]) -> list[dict]:
    """benchmarks/reference.py in its own process (fresh device memory), one row per MODE-AC."""
    needed = list(dict.fromkeys(reference_of(c) for c in configs))  # in order, once each
    out = Path(args.work_dir) / "reference.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "benchmarks" / "reference.py"), "--device", device.type,
           "--out", str(out), "--configs", *needed]
    if device.type == "cpu":  # one rank's share of the CPU: torchrun gives each rank 1 thread
        cmd += ["--threads", os.environ.get("OMP_NUM_THREADS", "1") if args.nproc > 1 else
                str(os.cpu_count() or 1)]
    cmd += ["--", *base_flags(args)]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if out.exists():
        return json.loads(out.read_text())["references"]
    tail = (proc.stdout + proc.stderr)[-800:]
    print(tail, file=sys.stderr, flush=True)
    return [{"config": f"reference-{r}", "status": f"failed (exit {proc.returncode})", "log_tail": tail}
            for r in needed]


def add_ratio(row: dict, references: list[dict]) -> None:
    """``ratio_to_reference`` = tokens/s per device / the matching reference's tokens/s."""
    name = f"reference-{reference_of(row['config'])}"
    ref = next((r for r in references if r["config"] == name), None)
    row["reference"] = name
    row["tokens_per_s_per_device"] = (row["tokens_per_s"] / row["world_size"]
                                      if row.get("tokens_per_s") else None)
    ok = ref is not None and ref.get("status") == "ok" and ref.get("tokens_per_s") and \
        row["tokens_per_s_per_device"]
    row["ratio_to_reference"] = row["tokens_per_s_per_device"] / ref["tokens_per_s"] if ok else None


def summarize(config: str, res: dict) -> dict:
    api, mode, ac = config.split("-")
    v = res["variants"][0]
    times = v.get("step_times_s") or []
    peak = v.get("peak_memory_bytes") or {}
    return {
        "config": config, "api": api, "compile": mode == "compile", "ac": ac.removeprefix("ac_"),
        "status": "ok", "world_size": res["world_size"], "model": res["model"],
        "tokens_per_s": v.get("tokens_per_s"), "mfu": v.get("mfu"),
        "step_time_median_s": v.get("step_time_s"),
        "step_time_min_s": min(times) if times else None,
        "step_time_max_s": max(times) if times else None,
        "timed_steps": len(times), "peak_memory_bytes": peak.get("total"),
        "peak_memory_method": (peak.get("detail") or {}).get("method"),
        "peak_memory_detail": {k: val for k, val in peak.items() if k != "detail"},
        "lesson_settings": res["settings"], "lesson_notes": res.get("notes", []),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    data = metadata(NAME, device, args)
    data["runs"] = []
    data["references"] = [] if args.no_reference else run_references(args, device, args.configs)
    failed = 0
    for config in args.configs:
        out = Path(args.work_dir) / config
        rc, res, tail = run_lesson("10", out, device.type, args.nproc, lesson_flags(args, config),
                                   timeout=args.timeout)
        if res is None:
            failed += 1
            data["runs"].append({"config": config, "status": f"failed (exit {rc})", "log_tail": tail[-800:]})
            continue
        row = summarize(config, res)
        if not args.no_reference:
            add_ratio(row, data["references"])
        data["runs"].append(row)
        mfu = f", MFU {row['mfu']:.1%}" if row["mfu"] else ""
        ratio = f", {row['ratio_to_reference']:.2f}x the plain loop" \
            if row.get("ratio_to_reference") else ""
        print(f"{config}: {row['tokens_per_s'] or 0:,.0f} tokens/s{mfu}{ratio}, peak "
              f"{(row['peak_memory_bytes'] or 0) / 2**20:,.1f} MiB/rank", flush=True)
    if device.type == "cpu":
        data["notes"] = ["CPU, tiny: step times on a shared CPU are only indicative; MFU needs a GPU; "
                         "peak memory from the torch.distributed._tools trackers. The reference runs "
                         "with one rank's share of the CPU (its threads); ranks and reference share "
                         "2 cores with whatever else runs, so ratios here show the plumbing works, "
                         "not FSDP's overhead."]
    save(data, output_path(NAME, device, args.out))
    failed += sum(r.get("status") != "ok" for r in data["references"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
