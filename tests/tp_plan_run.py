"""A real 2-rank CPU run (gloo) of one 2-D training step of a course model, TP over both ranks
(mesh dp=1 x tp=2), measured by the same function the fake trace uses
(``utilities.measure.tensor_parallel.fake_step_peak``, the lessons' MemoryProbe underneath): what
tests/test_tensor_parallel_plan.py holds the fake prediction to.

    python tests/tp_plan_run.py OUT.json MODEL BATCH SEQ SEQUENCE_PARALLEL(0|1) LOSS_PARALLEL(0|1)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gloo_ranks import on_two_ranks  # noqa: E402 (this script runs from tests/, beside it)


def measured_peak(model_name: str, batch: int, seq: int, sequence_parallel: bool,
                  loss_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from utilities.measure import tensor_parallel as tp_lib
    from utilities.models import get_model_spec
    from utilities.parallelize import parallelize_model
    from utilities.precision import fsdp2_policy

    spec = get_model_spec(model_name)
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    parallelize_model(model, block_class=spec.block_class(), mesh=mesh,  # TP, then FSDP2
                      sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                      mp_policy=fsdp2_policy("bf16"))
    ids = torch.randint(0, spec.config().vocab_size, (batch, seq))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return tp_lib.fake_step_peak(model, tp_lib.causal_lm_loss(data), torch.device("cpu"),
                                 foreach=False)


def main(argv: list[str]) -> None:
    out, model, batch, seq = argv[0], argv[1], int(argv[2]), int(argv[3])
    on_two_ranks(out, measured_peak, model, batch, seq, argv[4] == "1", argv[5] == "1")


if __name__ == "__main__":
    main(sys.argv[1:])
