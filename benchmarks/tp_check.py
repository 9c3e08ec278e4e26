"""Lightning's tensor-parallel memory table, predicted by the planner's kind of fake step (no GPU).

Source: Lightning's "Tensor Parallelism" page, SOURCE_URL (docs/source-pytorch/advanced/model_parallel/
tp.rst in Lightning-AI/pytorch-lightning). Its full training example, as confirmed there:

* ``FeedForward(8192, 8192)``: w1, w3 (8192 -> 8192) and w2, no biases, 201,326,592 parameters;
* plan ``{"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}`` through
  ``parallelize_module`` on the "tensor_parallel" mesh of ``ModelParallelStrategy()`` (all devices
  of the node in the TP group); "1 GPU (no TP)" is the model unsplit;
* fp32 (the Trainer's default precision), ``torch.optim.AdamW(lr=3e-3)`` (CUDA's default foreach
  path), loss ``output.sum()``, ``RandomDataset(8192, 64)`` in batches of 8: input (8, 8192);
* printed: ``torch.cuda.max_memory_allocated() / 1e9`` (decimal GB) after ``trainer.fit`` (one
  epoch, 8 steps): 4.04 / 2.03 / 1.02 / 0.60 GB on 1 / 2 / 4 / 8 GPUs. The GPU model is not given.

Predicted: the same module split by the same plan (``utilities.measure.tensor_parallel``) on a fake
process group of ``tp`` ranks, materialized under ``FakeTensorMode``, one forward + backward +
AdamW (foreach) step under the lessons' memory tracker (``fake_step_peak``, the function the
planner's TP path uses). ``max_memory_allocated`` also counts what the tracker cannot see: cuBLAS's
workspaces, one per (handle, stream) made through the caching allocator, here two (the forward's
thread and the autograd thread): 32 MiB each on sm90 (Hopper), 8 MiB + 128 KiB before it (torch's
``CUBLAS_WORKSPACE_CONFIG`` defaults). ``predicted_gb`` adds the Hopper pair; the row also keeps
the pre-Hopper sum. Writes results/tp_check.json (committed). About 10 s on a laptop.

    python benchmarks/tp_check.py
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utilities.measure.planner import CUBLAS_HANDLES as WORKSPACES  # noqa: E402
from utilities.measure.planner import CUBLAS_WORKSPACE_BYTES as CUBLAS_WORKSPACE  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "tp_check.json"
SOURCE_URL = "https://lightning.ai/docs/pytorch/stable/advanced/model_parallel/tp.html"
SOURCE_FILE = "Lightning-AI/pytorch-lightning: docs/source-pytorch/advanced/model_parallel/tp.rst"
PUBLISHED_GB = {1: 4.04, 2: 2.03, 4: 1.02, 8: 0.60}
DIM = HIDDEN = 8192
BATCH = 8  # RandomDataset(8192, 64) in a DataLoader of batch_size=8
GB = 10**9  # the docs divide by 1e9
SETUP = {
    "model": "FeedForward(8192, 8192): w2(silu(w1(x)) * w3(x)), no biases",
    "plan": {"w1": "ColwiseParallel()", "w2": "RowwiseParallel()", "w3": "ColwiseParallel()"},
    "strategy": "ModelParallelStrategy() (all devices in the tensor_parallel mesh); 1 GPU: no TP",
    "dtype": "fp32 (Trainer default precision)",
    "optimizer": "torch.optim.AdamW(lr=3e-3), default foreach on CUDA",
    "input": "RandomDataset(8192, 64), DataLoader(batch_size=8): (8, 8192); loss output.sum()",
    "measured": "torch.cuda.max_memory_allocated() / 1e9 after trainer.fit (1 epoch, 8 steps)",
    "gpu": "not published",
}


def predict_peak(tp: int, dim: int = DIM, hidden: int = HIDDEN, batch: int = BATCH) -> dict:
    """The tracker's peak (course categories, bytes) of one fake training step of the FeedForward
    split over ``tp`` ranks (``tp=1``: unsplit), as Lightning's example trains it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from utilities.measure import tensor_parallel as tp_lib
    from utilities.measure.fake_step import fake_world

    device = torch.device("cpu")
    world = fake_world(tp) if tp > 1 else contextlib.nullcontext()
    with world:
        model = tp_lib.FeedForward(dim, hidden).to("meta")
        if tp > 1:
            tp_lib.apply_mlp_tensor_parallel(model, init_device_mesh("cpu", (tp,),
                                                                     mesh_dim_names=("tp",)))
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            model.to_empty(device=device)
            x = torch.randn(batch, dim, device=device)
            return tp_lib.fake_step_peak(model, lambda m: m(x).sum(), device, foreach=True)


def row(tp: int) -> dict:
    """One table row: published, predicted (tracker + Hopper's cuBLAS workspaces), their ratio."""
    peak = predict_peak(tp)
    tracked = peak["total"]
    hopper = tracked + WORKSPACES * CUBLAS_WORKSPACE["sm90"]
    older = tracked + WORKSPACES * CUBLAS_WORKSPACE["before_sm90"]
    published = PUBLISHED_GB[tp]
    return {"gpus": tp, "published_gb": published, "predicted_gb": round(hopper / GB, 4),
            "ratio": round(hopper / GB / published, 4),
            "tracker_peak_gb": round(tracked / GB, 4),
            "ratio_tracker_only": round(tracked / GB / published, 4),
            "predicted_gb_before_sm90": round(older / GB, 4),
            "ratio_before_sm90": round(older / GB / published, 4),
            "peak_bytes": {k: int(v) for k, v in peak.items() if k != "detail"}}


def main() -> dict:
    from utilities.results import write_json

    t0 = time.perf_counter()
    rows = [row(tp) for tp in PUBLISHED_GB]
    data = {"benchmark": "tp_check", "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source_url": SOURCE_URL, "source_file": SOURCE_FILE, "setup_confirmed": SETUP,
            "method": "FeedForward split by parallelize_module on a fake process group, one "
                      "forward+backward+AdamW(foreach) step on FakeTensorMode under the memory "
                      "tracker (utilities.measure.tensor_parallel.fake_step_peak), plus "
                      f"{WORKSPACES} cuBLAS workspaces of 32 MiB (sm90) that max_memory_allocated "
                      "counts and the tracker does not",
            "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
    write_json(OUT, data)
    for r in rows:
        print(f"{r['gpus']} GPU(s): published {r['published_gb']:.2f} GB, predicted "
              f"{r['predicted_gb']:.3f} GB (ratio {r['ratio']:.3f}; tracker alone "
              f"{r['tracker_peak_gb']:.3f}, pre-Hopper workspaces {r['predicted_gb_before_sm90']:.3f})")
    print(f"results written to {OUT}")
    return data


if __name__ == "__main__":
    main()
