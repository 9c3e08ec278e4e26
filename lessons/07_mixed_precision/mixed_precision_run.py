"""Lesson 07's driver: each policy's model trained, with the dtypes it all-gathers and reduces in
observed, not read from its config.

The policies, wrappers and the scaler are the lesson script's (``mixed_precision.py``, handed in as
``code``); here: how each policy is trained and what is recorded around it.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from utilities.course.lesson import Lesson
from utilities.precision import DtypeProbe, attach_scaler, default_policy, observe_dtypes
from utilities.results import variant
from utilities.training import StepOptions, default_step


def run_policies(lesson: Lesson, args: argparse.Namespace, code: SimpleNamespace) -> None:
    """Each chosen policy, then what ``default_policy()`` picks on this machine."""
    lesson.results.columns("param_dtype", "reduce_dtype", "grad_zero_fraction",
                           "grad_fp16_underflow_fraction", "nonfinite_reductions")
    chosen, why = default_policy()  # the bf16 checker: bf16 where bf16_ready(), else fp32
    lesson.print(f"default_policy() here: {chosen} ({why})")
    for policy in args.policies:
        with lesson.variant(policy):  # everything the variant made is freed before the next one
            train_policy(lesson, code, args.api, policy)
    lesson.results.record("default_policy", {"name": chosen, "reason": why})


def train_policy(lesson: Lesson, code: SimpleNamespace, api: str, policy: str) -> None:
    """Shard with ``policy``, train with a scaler where it needs one, and record the dtypes seen."""
    block = lesson.spec.block_class()
    if api == "fsdp2":
        model = code.shard_fsdp2(lesson.build_model(), block, code.FSDP2_POLICIES[policy])
    else:
        model = code.shard_fsdp1(lesson.build_model(), block, code.FSDP1_POLICIES[policy], lesson.device)
    model = lesson.materialize(model)
    optimizer = lesson.optimizer(model)
    step_fn, extra = default_step, {}
    if policy in code.NEEDS_SCALER:
        scaler = code.fp16_scaler(lesson.device)
        step_fn, extra["loss_scales"] = code.scaled_step(scaler), attach_scaler(optimizer, scaler)
    # The probe's counts sync the host three times per reduce-scatter: it observes the untimed
    # steps (warm-up and memory) only, so the step times are those of plain training.
    seen = DtypeProbe()
    stats = lesson.train(model, f"{api}-{policy}", optimizer=optimizer, step_fn=step_fn,
                         options=StepOptions(untimed=lambda: observe_dtypes(model, seen)))
    mp = code.FSDP2_POLICIES[policy] if api == "fsdp2" else code.FSDP1_POLICIES[policy]  # None: not cast
    fields = dict(api=api, policy=policy, param_dtype=dtype_name(getattr(mp, "param_dtype", None)),
                  reduce_dtype=dtype_name(getattr(mp, "reduce_dtype", None)), **seen.as_dict())
    lesson.results.add(f"{api}-{policy}", stats, **fields, **extra)
    lesson.print(f"    forward weights {seen.forward_param_dtypes}, reduce-scatter {seen.reduce_dtypes}, "
                 f"zero grads {fields['grad_zero_fraction']:.3%}, below fp16 "
                 f"{fields['grad_fp16_underflow_fraction']:.3%}, reductions with inf/NaN "
                 f"{seen.nonfinite_reductions}/{seen.reductions}")


def dtype_name(dtype: torch.dtype | None) -> str:
    """A policy's dtype as results.json writes it; None (not cast) is fp32 here."""
    return str(dtype or torch.float32).removeprefix("torch.")


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    fp32, bf16 = variant(results, "fsdp2-fp32"), variant(results, "fsdp2-bf16")
    diff = max(abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"]))
    return (f"bf16: forward weights {', '.join(bf16['forward_param_dtypes'])}, gradients reduced in "
            f"{', '.join(bf16['reduce_dtypes'])}, loss within {diff:.3f} of fp32")
