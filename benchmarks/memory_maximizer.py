"""Memory-maximizer benchmark: throughput at the largest retry-free batch vs a batch that retries.

Runs lesson 05's search (utilities.batch_search.find_max_batch under FSDP2, one launch through the
course CLI): it doubles the per-rank batch until the first trial that is not clean (cudaMalloc
retries, OOM, or over a memory budget), then bisects down to the largest clean batch. Read back:

* the largest retry-free batch (the recommendation) and its throughput;
* the largest batch tried that did not OOM but did retry (on a GPU, usually the recommendation
  + 1: the classic comparison, 16 vs 17 in the classic lesson) and its throughput;
* the speed-up of the first over the second (the classic lesson: about +25%).

Throughput is lesson 05's: samples/s from the median step time of its timed steps (synchronized).

On a CPU nothing retries (no caching allocator): --tiny runs the search on t5-tiny against a memory
budget, records the trials, and records that the retry effect needs a GPU; no speed-up is claimed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, base_parser, metadata, output_path, pick_device, run_lesson, save  # noqa: E402

NAME = "memory_maximizer"
PUBLISHED = {"speedup_retry_free_vs_retrying": 0.25,
             "source": "classic FSDP lesson 05 (2B ViT, SHARD_GRAD_OP): batch 16, 0 retries, 2.93 "
                       "img/s vs batch 17, 9 retries, 2.34 img/s"}
GPU_NOTE = "the cudaMalloc-retry effect needs a GPU: on CPU there is no caching allocator, nothing retries"


def parse_args(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--model", default=None, help="named model (default: lesson 05's, t5-large on GPU; "
                                                 "t5-tiny with --tiny)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 1 tiny)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per trial; the first 2 are not timed (default 12; 3 tiny)")
    p.add_argument("--max-batch", type=int, default=None, help="largest per-rank batch tried "
                                                               "(default 256 on GPU; 2 tiny)")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-rank memory budget in MiB (default none on GPU: retries decide; 34 tiny)")
    p.add_argument("--work-dir", default=None,
                   help="where lesson 05's run goes (default runs/benchmarks/memory_maximizer)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the search (default 3600)")
    args = p.parse_args(argv)
    on_gpu = pick_device(args.device).type == "cuda"
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count() if on_gpu else 1
    args.steps = args.steps or (3 if args.tiny or not on_gpu else 12)
    args.max_batch = args.max_batch or (2 if args.tiny or not on_gpu else 256)
    if args.budget_mib is None and (args.tiny or not on_gpu):
        args.budget_mib = 34.0
    args.work_dir = args.work_dir or str(REPO / "runs" / "benchmarks" / NAME)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    data = metadata(NAME, device, args)
    data["published"] = PUBLISHED
    flags = ["--steps", str(args.steps), "--max-batch", str(args.max_batch), "--no-bisect"]
    if args.tiny or device.type == "cpu":
        flags.append("--quick")
    if args.model:
        flags += ["--model", args.model]
    if args.budget_mib:
        flags += ["--budget-mib", f"{args.budget_mib:g}"]
    rc, res, tail = run_lesson("05", Path(args.work_dir), device.type, args.nproc, flags,
                               timeout=args.timeout)
    if res is None:
        data.update(status=f"failed (exit {rc})", log_tail=tail[-800:])
        save(data, output_path(NAME, device, args.out))
        return 1
    trials = [v for v in res["variants"] if v["name"].startswith("batch-")]
    rec = next(v for v in res["variants"] if v["name"] == "recommendation")
    clean = next((t for t in trials if t["batch"] == rec["batch"]), None)
    retrying = max((t for t in trials if not t["ooms"] and t["retries"]), key=lambda t: t["batch"],
                   default=None)
    peak = clean.get("peak_bytes") if clean else None
    data.update(
        status="ok", model=res["model"], world_size=res["world_size"], seq_len=res["settings"]["seq_len"],
        precision="fp32" if device.type == "cpu" else "lesson 05 default",
        trials=[{k: t.get(k) for k in ("batch", "samples_per_s", "step_time_s", "peak_bytes", "retries",
                                       "ooms", "over_budget", "verdict", "phase")} for t in trials],
        retry_free_batch=rec["batch"], retry_free_samples_per_s=clean and clean["samples_per_s"],
        retry_free_peak_memory_bytes=peak, reason=rec["reason"],
        retrying_batch=retrying and retrying["batch"],
        retrying_samples_per_s=retrying and retrying["samples_per_s"],
    )
    if clean and retrying and retrying["samples_per_s"]:
        data["speedup"] = clean["samples_per_s"] / retrying["samples_per_s"] - 1
    else:
        data["speedup"] = None
    if device.type == "cpu":
        data["notes"] = [f"CPU, tiny: {GPU_NOTE}; the search ran against a {args.budget_mib:g} MiB "
                         f"per-rank budget of tracked memory instead, and no speed-up is claimed."]
    speedup = "n/a" if data["speedup"] is None else f"{data['speedup']:+.0%}"
    print(f"largest retry-free batch {rec['batch']} ({rec['reason']}); speed-up over the retrying "
          f"batch: {speedup}", flush=True)
    save(data, output_path(NAME, device, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
