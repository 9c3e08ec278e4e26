"""Planner check: utilities.planner.plan's predicted peak vs the peak each benchmark measured.

Reads the other benchmarks' result files (end_to_end-*.json, memory_maximizer-*.json in
--results-dir) and, for every configuration with a measured per-rank peak, runs the planner on the
same model, ranks, precision, activation checkpointing, batch and sequence length (one fake
training step on FakeTensorMode + a fake process group, no real memory). Reports predicted,
measured and the relative error (predicted / measured - 1).

Runs whose "peak" is a census of resident state (where no tracker could follow the step, e.g.
gradient accumulation on CPU) are left out: they hold no activations and are no peak to compare
with.
What the planner does not model: FSDP1 (it simulates FSDP2; FSDP1 runs are compared anyway and
marked), torch.compile (eager activations are planned), and on a GPU the CUDA context, NCCL buffers
and allocator fragmentation (the planner keeps 10% headroom for these when it says "fits"; it does
not add them to its peak). On CPU the "measured" peak is itself a tracker's figure
(torch.distributed._tools), so the CPU comparison checks the planner's fake run against the real
run under the same accounting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, base_parser, metadata, output_path, pick_device, save  # noqa: E402

NAME = "planner_check"


def parse_args(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--results-dir", default=str(RESULTS_DIR),
                   help="where the other benchmarks' JSON files are (default benchmarks/results)")
    p.add_argument("--gpu-memory", default="80GB",
                   help="GPU memory given to the planner for its 'fits' verdict (default 80GB)")
    p.add_argument("--max-checks", type=int, default=None,
                   help="compare at most this many configurations (default all; 4 tiny)")
    args = p.parse_args(argv)
    if args.tiny and args.max_checks is None:
        args.max_checks = 4
    return args


def _load(directory: Path, prefix: str, device_type: str) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(directory.glob(f"{prefix}-*.json")):
        data = json.loads(path.read_text())
        if data.get("device") == device_type:
            found.append((path.name, data))
    return found


def measured_configs(directory: Path, device_type: str) -> list[dict]:
    """Every configuration in the result files of this device type that has a measured peak."""
    configs = []
    for name, data in _load(directory, "end_to_end", device_type):
        for run in data.get("runs", []):
            if run.get("status") != "ok" or not run.get("peak_memory_bytes"):
                continue
            if run.get("peak_memory_method") == "census":
                continue  # resident state only (FSDP1 use_orig_params on CPU): not a peak
            s = run["lesson_settings"]
            configs.append({
                "source": f"{name}:{run['config']}", "model": s["model"], "gpus": run["world_size"],
                "precision": "fp32" if s["precision"] == "fp32" else "bf16",
                "ac": run["ac"], "batch": s["batch_size"],
                "seq": s["seq_len"], "measured_bytes": run["peak_memory_bytes"],
                "caveats": [c for c, on in (("FSDP1 run, FSDP2 planned", run["api"] == "fsdp1"),
                                            ("compiled run, eager planned", run["compile"])) if on],
            })
    for name, data in _load(directory, "memory_maximizer", device_type):
        if data.get("status") != "ok" or not data.get("retry_free_peak_memory_bytes"):
            continue
        configs.append({
            "source": f"{name}:batch-{data['retry_free_batch']}", "model": data["model"]["name"],
            "gpus": data["world_size"], "precision": "fp32", "ac": "none",
            "batch": data["retry_free_batch"], "seq": data["seq_len"],
            "measured_bytes": data["retry_free_peak_memory_bytes"], "caveats": [],
        })
    return configs


def main(argv=None) -> int:
    from utilities.planner import parse_memory, plan

    args = parse_args(argv)
    device = pick_device(args.device)
    data = metadata(NAME, device, args)
    configs = measured_configs(Path(args.results_dir), device.type)
    if args.max_checks is not None:
        configs = configs[: args.max_checks]
    data["rows"] = []
    for c in configs:
        p = plan(c["model"], c["gpus"], parse_memory(args.gpu_memory), strategy="full_shard",
                 precision=c["precision"], ac=c["ac"], batch=c["batch"], seq=c["seq"],
                 device_type=device.type)
        predicted = p.peak_bytes["total"]
        row = dict(c, predicted_bytes=predicted, predicted_detail=p.peak_bytes,
                   relative_error=predicted / c["measured_bytes"] - 1, planner_notes=p.notes)
        data["rows"].append(row)
        print(f"{c['source']}: planned {predicted / 2**20:,.1f} MiB, measured "
              f"{c['measured_bytes'] / 2**20:,.1f} MiB ({row['relative_error']:+.1%})", flush=True)
    if not configs:
        data["notes"] = [f"no measured peaks for device {device.type} in {args.results_dir}: run "
                         "end_to_end.py and memory_maximizer.py first"]
        print(data["notes"][0], flush=True)
    elif device.type == "cpu":
        data["notes"] = ["CPU, tiny: planned vs the tiny runs' tracked peaks (same accounting); the GPU "
                         "comparison against the allocator's real peak needs a GPU."]
    save(data, output_path(NAME, device, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
