"""A real 2-rank CPU run (gloo) of one training step of a course model with its attention under
context parallelism over both ranks (``utilities.measure.context_parallel.cp_attention``: each
rank 1/2 of the sequence, K/V all-gathered, dK/dV passed round), FSDP2 over both, measured by the
function the fake step's comparison uses (``tensor_parallel.fake_step_peak``, the lessons'
MemoryProbe underneath): what tests/test_context_parallel_plan.py holds the fake step to.

    python tests/cp_plan_run.py OUT.json MODEL BATCH SEQ
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gloo_ranks import on_two_ranks  # noqa: E402 (this script runs from tests/, beside it)


def cp_peak(model, spec, batch: int, seq: int, device: torch.device) -> dict:
    """One step's peak of ``model`` (sharded over the world) with CP over the whole world: the
    batch of the fake step for one rank's seq / world tokens, attention under ``cp_attention``."""
    from utilities.measure import tensor_parallel as tp_lib
    from utilities.measure.context_parallel import cp_attention
    from utilities.measure.fake_step import fake_batch

    data = fake_batch(spec, batch, seq // dist.get_world_size(), device, mask=False)
    with cp_attention(dist.group.WORLD):
        return tp_lib.fake_step_peak(model, tp_lib.causal_lm_loss(data), device, foreach=False)


def measured_peak(model_name: str, batch: int, seq: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from utilities.models import get_model_spec
    from utilities.parallelize import parallelize_model
    from utilities.precision import fsdp2_policy

    spec = get_model_spec(model_name)
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    parallelize_model(model, block_class=spec.block_class(),
                      mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                      mp_policy=fsdp2_policy("bf16"))
    return cp_peak(model, spec, batch, seq, torch.device("cpu"))


def main(argv: list[str]) -> None:
    out, model, batch, seq = argv[0], argv[1], int(argv[2]), int(argv[3])
    on_two_ranks(out, measured_peak, model, batch, seq)


if __name__ == "__main__":
    main(sys.argv[1:])
