"""torchtitan's published context-parallel runs, predicted by ``fsdp-course plan --cp N`` (no GPU).

Source: torchtitan's Llama 3 H100 benchmarks, Table 2 (SOURCE_FILE; the same table is in its
docs/performance.md), "FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local
batch size 1. Full activation checkpointing", on Grand Teton hosts (8 H100 96GB HBM2e per host
on NVLink, 500 W; 400 Gb/s RDMA per GPU), bf16 with fp32 reduction, throughput read at the 90th
iteration:

    FSDP 8, CP 1, seq 32768:  3,890 TPS/GPU, 83.9 GiB
    FSDP 4, CP 2, seq 65536:  2,540 TPS/GPU, 84.2 GiB
    FSDP 2, CP 4, seq 131072: 1,071 TPS/GPU, 84.0 GiB
    FSDP 1, CP 8, seq 262144:   548 TPS/GPU, 84.5 GiB

(FSDP over all 8 GPUs in each: torchtitan's dp_shard_cp; one sequence per CP group, so 32,768
tokens per GPU in every row.) Which of torchtitan's memory readings the column is (its monitor
logs the peak active and the peak reserved memory) is not stated.

Predicted: the course's planner and time model for the same configuration (llama-8b is Llama 3
8B's architecture, the course's llama3.1 differs only in its rotary scaling): ``plan`` for the
peak per GPU (allocated, and the caching allocator's reserved model), ``estimate_step_time`` with
``compile`` and ``fp8`` on an ``h100-96gb`` for tokens/s per GPU. The planner does not model
Float8's or compile's memory (it traces the eager bf16 step). Ratios are reported as they come
(predicted / published); nothing here was tuned to them. Writes results/cp_check.json
(committed). About a minute on a laptop.

    python benchmarks/cp_check.py
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path(__file__).resolve().parent / "results" / "cp_check.json"
SOURCE_FILE = "pytorch/torchtitan: benchmarks/llama3_h100_202412_torchtitan.md, Table 2"
SOURCE_URL = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
# cp -> (sequence length, published TPS/GPU, published memory GiB)
PUBLISHED = {1: (32768, 3890, 83.9), 2: (65536, 2540, 84.2), 4: (131072, 1071, 84.0),
             8: (262144, 548, 84.5)}
GPU = "h100-96gb"
SETUP = {
    "model": "Llama 3.1 8B (torchtitan llama3 8B)",
    "gpus": "8 H100 96GB HBM2e (Grand Teton, NVLink, 500 W), 400 Gb/s RDMA per GPU",
    "parallelism": "FSDP2 over all 8 GPUs (FSDP 8/cp x CP cp), CP 1, 2, 4, 8",
    "batch": "local batch size 1 (one sequence per CP group)",
    "ac": "full activation checkpointing",
    "precision": "bf16, fp32 reduction; torch.compile + Float8 linears",
    "measured": "TPS/GPU at the 90th iteration; Memory(GiB), which reading not stated",
}


def row(cp: int) -> dict:
    """One row: published, predicted (memory and time), their ratios."""
    from utilities.measure.gpu_catalogue import get_gpu
    from utilities.measure.planner import plan
    from utilities.measure.step_time import estimate_step_time

    seq, tps, gib = PUBLISHED[cp]
    p = plan("llama-8b", 8, get_gpu(GPU).memory_bytes, ac="full", batch=1, seq=seq, cp=cp)
    t = estimate_step_time("llama-8b", 8, ac="full", batch=1, seq=seq, gpu=GPU, compile=True,
                           fp8=True, cp=cp)
    allocated = p.peak_bytes["total"] / 2**30
    reserved = p.reserved["reserved"] / 2**30 if p.reserved else None
    return {"cp": cp, "fsdp": 8, "seq": seq, "tokens_per_gpu": seq // cp,
            "published_tokens_per_s_per_gpu": tps, "published_memory_gib": gib,
            "predicted_tokens_per_s_per_gpu": round(t.tokens_per_s_per_gpu, 1),
            "ratio_tokens_per_s": round(t.tokens_per_s_per_gpu / tps, 4),
            "predicted_peak_allocated_gib": round(allocated, 2),
            "ratio_memory_allocated": round(allocated / gib, 4),
            "predicted_peak_reserved_gib": round(reserved, 2) if reserved else None,
            "ratio_memory_reserved": round(reserved / gib, 4) if reserved else None,
            "predicted_step_s": round(t.step_s, 4),
            "predicted_cp_comm_s": round(sum(e.args.get("cp_comm_s", 0.0) for e in t.timeline), 4)}


def main() -> dict:
    from utilities.results import write_json

    t0 = time.perf_counter()
    rows = [row(cp) for cp in PUBLISHED]
    data = {"benchmark": "cp_check", "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source_file": SOURCE_FILE, "source_url": SOURCE_URL, "setup_confirmed": SETUP,
            "method": "fsdp-course plan --model llama-8b --gpus 8 --cp N --batch 1 --seq S --ac full "
                      f"--gpu {GPU} --compile --fp8: the planner's fake step (each GPU 1/N of the "
                      "tokens, K/V all-gathered per layer as torch's context_parallel does by "
                      "default) and the time model (CP's collectives on the compute lane); the "
                      "planner traces the eager bf16 step (Float8's and compile's memory not "
                      "modelled); ratios as they come, nothing tuned to them",
            "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
    write_json(OUT, data)
    for r in rows:
        print(f"CP {r['cp']} seq {r['seq']:>6}: tokens/s/GPU published "
              f"{r['published_tokens_per_s_per_gpu']:,} "
              f"predicted {r['predicted_tokens_per_s_per_gpu']:,.0f} (ratio {r['ratio_tokens_per_s']:.2f}); "
              f"memory published {r['published_memory_gib']} GiB, predicted "
              f"{r['predicted_peak_allocated_gib']} allocated (ratio {r['ratio_memory_allocated']:.2f}), "
              f"{r['predicted_peak_reserved_gib']} reserved")
    print(f"results written to {OUT}")
    return data


if __name__ == "__main__":
    main()
