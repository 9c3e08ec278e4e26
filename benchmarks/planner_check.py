"""Planner check: utilities.measure.planner.plan's predicted peak vs the peak each benchmark measured.

Reads the other benchmarks' result files (end_to_end-*.json, memory_maximizer-*.json in
--results-dir) and, for every configuration with a measured per-rank peak, runs the planner on the
same model, ranks, precision, activation checkpointing, batch and sequence length (one fake
training step on FakeTensorMode + a fake process group, no real memory). Reports predicted,
measured and the relative error (predicted / measured - 1).

Every GPU configuration is compared: on a GPU the measured peak is always
`torch.cuda.max_memory_allocated` over the step (lesson 10 and lesson 05 call their GPU category
split a "census", but the total beside it is the allocator's real peak), and for the memory
maximizer every trial that ran without an OOM, not only the recommended batch; and
planner_check_accum.py's real CPU steps with bf16 parameters and gradient accumulation (not
counted in --max-checks), each planned with its options. On CPU, runs whose
"peak" is a census of resident state (where no tracker could follow the step, e.g. gradient
accumulation) are left out: they hold no activations and are no peak to compare with.

The planner needs no GPU (fake tensors), so GPU result files can be checked anywhere:
`--measured-on cuda` reads the cuda files in --results-dir whatever this machine has (the default
is this machine's device type). By hand, on the H100 at commit 33b7010 (llama-1b, bf16, batch 4 x
2048, no AC, FSDP2 eager): planned 40.68 GiB vs max_memory_allocated 39.50 GiB (+3.0%).
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

from common import RESULTS_DIR, base_parser, metadata, output_path, pick_device, save

NAME = "planner_check"


def parse_args(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--results-dir", default=str(RESULTS_DIR),
                   help="where the other benchmarks' JSON files are (default benchmarks/results)")
    p.add_argument("--gpu-memory", default="80GB",
                   help="GPU memory given to the planner for its 'fits' verdict (default 80GB)")
    p.add_argument("--max-checks", type=int, default=None,
                   help="compare at most this many configurations (default all; 4 tiny)")
    p.add_argument("--measured-on", default="auto", choices=("auto", "cpu", "cuda"),
                   help="compare the result files measured on this device type (default: this "
                        "machine's); the planner itself runs on fake tensors anywhere")
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


def measured_method(device_type: str, method: str | None) -> str:
    if device_type == "cuda":
        return "torch.cuda.max_memory_allocated"
    return method or "tracker"


def measured_configs(directory: Path, device_type: str) -> list[dict]:
    """Every configuration in the result files of this device type that has a measured peak."""
    configs = []
    for name, data in _load(directory, "end_to_end", device_type):
        for run in data.get("runs", []):
            if run.get("status") != "ok" or not run.get("peak_memory_bytes"):
                continue
            if run.get("peak_memory_method") == "census" and device_type != "cuda":
                continue  # CPU: resident state only (no tracker followed the step), not a peak
            s = run["lesson_settings"]
            configs.append({
                "source": f"{name}:{run['config']}", "model": s["model"], "gpus": run["world_size"],
                "precision": "fp32" if s["precision"] == "fp32" else "bf16",
                # lesson 10's "selective" is every second block; the planner's is op-level
                "ac": {"selective": "every-2nd-block"}.get(run["ac"], run["ac"]),
                "batch": s["batch_size"],
                "seq": s["seq_len"], "measured_bytes": run["peak_memory_bytes"],
                "measured_on": device_type,
                "measured_method": measured_method(device_type, run.get("peak_memory_method")),
                "caveats": [c for c, on in (("FSDP1 run, FSDP2 planned", run["api"] == "fsdp1"),
                                            ("compiled run, eager planned", run["compile"])) if on],
            })
    for name, data in _load(directory, "memory_maximizer", device_type):
        if data.get("status") != "ok":
            continue
        trials = [t for t in data.get("trials", []) if t.get("peak_bytes") and not t.get("ooms")]
        if device_type != "cuda":  # CPU: the recommended batch (the tiny run's tracked peaks)
            trials = [t for t in trials if t["batch"] == data.get("retry_free_batch")]
        for t in trials:
            configs.append({
                "source": f"{name}:batch-{t['batch']}", "model": data["model"]["name"],
                "gpus": data["world_size"], "precision": "fp32", "ac": "none",
                "batch": t["batch"], "seq": data["seq_len"], "measured_bytes": t["peak_bytes"],
                "measured_on": device_type, "measured_method": measured_method(device_type, None),
                "caveats": [f"{t['verdict']} trial"] if t.get("verdict") not in (None, "clean") else [],
            })
    return configs


def accumulation_configs(directory: Path, device_type: str) -> list[dict]:
    """planner_check_accum.py's runs (bf16 parameters, gradient accumulation, both syncs, a bf16
    or fp32 reduction; real 2-rank CPU steps under the tracker), each planned with its options."""
    configs = []
    for name, data in _load(directory, "planner_check_accum", device_type):
        for run in data.get("runs", []):
            if run.get("status") != "ok" or not run.get("peak_bytes"):
                continue
            configs.append({
                "source": f"{name}:{run['config']}", "model": data["model"]["name"],
                "gpus": data["world_size"], "precision": data["precision"], "ac": data["ac"],
                "batch": data["batch_size"], "seq": data["seq_len"], "options": run["options"],
                "measured_bytes": run["peak_bytes"], "measured_on": device_type,
                "measured_method": measured_method(device_type, "tracker"), "caveats": []})
    return configs


def main(argv=None) -> int:
    from utilities.measure.planner import parse_memory, plan

    args = parse_args(argv)
    device = pick_device(args.device)
    measured_on = device.type if args.measured_on == "auto" else args.measured_on
    data = metadata(NAME, device, args)
    data["measured_on"] = measured_on
    configs = measured_configs(Path(args.results_dir), measured_on)
    if args.max_checks is not None:
        configs = configs[: args.max_checks]
    configs += accumulation_configs(Path(args.results_dir), measured_on)
    data["rows"] = []
    for c in configs:
        p = plan(c["model"], c["gpus"], parse_memory(args.gpu_memory), strategy="full_shard",
                 precision=c["precision"], ac=c["ac"], batch=c["batch"], seq=c["seq"],
                 device_type=measured_on, options=c.get("options"))
        predicted = p.peak_bytes["total"]
        row = dict(c, predicted_bytes=predicted, predicted_detail=p.peak_bytes,
                   relative_error=predicted / c["measured_bytes"] - 1, planner_notes=p.notes)
        data["rows"].append(row)
        print(f"{c['source']}: planned {predicted / 2**20:,.1f} MiB, measured "
              f"{c['measured_bytes'] / 2**20:,.1f} MiB ({row['relative_error']:+.1%})", flush=True)
    if not configs:
        data["notes"] = [f"no measured peaks for device {measured_on} in {args.results_dir}: run "
                         "end_to_end.py and memory_maximizer.py first"]
        print(data["notes"][0], flush=True)
    elif measured_on == "cuda":
        data["notes"] = ["planned vs torch.cuda.max_memory_allocated per rank; the planner does not "
                         "add the CUDA context, NCCL buffers or fragmentation (its 10% headroom is "
                         "for those), nor model FSDP1 or torch.compile (marked per row)."]
    elif measured_on == "cpu":
        data["notes"] = ["CPU, tiny: planned vs the tiny runs' tracked peaks (same accounting); the "
                         "comparison against the allocator's real peak needs GPU result files "
                         "(--measured-on cuda)."]
    save(data, output_path(NAME, device, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
