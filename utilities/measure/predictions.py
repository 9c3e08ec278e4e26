"""The step-time model's predictions for the speed lessons: a lesson's variants on a cluster.

``add_prediction_arguments`` gives a lesson ``--predict-on 2x8xh100``, ``--predict-model`` and
``--predict-batch``; ``predict_from_arguments`` / ``predict_variants`` time each variant's knobs
with ``estimate_step_time`` into the lesson's ``predicted`` block; ``predicted_rows`` /
``format_predicted`` print it and ``draw_timelines`` draws its lanes. A prediction, not a
measurement: the block says so.

A variant's knobs may carry ``parallelize``: the lesson's own FSDP2 wrap function,
``fn(model, *, mesh, world_size, device, mp_policy)`` taking what it needs
(``utilities.measure.user_code``). Its step is traced from the model that function shards, not
from the course's sequence; the other knobs stay the time model's (``strategy`` names the schedule
of the ``fully_shard`` arguments the function passes). What the function decides is read from
the model it shards (``decided_by``): its checkpointing is the row's ``ac``, and a
``CPUOffloadPolicy`` on its units is the time model's offload (copies over PCIe, AdamW on the
host), the traced step running without it, so it counts once. A variant without one (FSDP1, DDP:
the planner traces FSDP2 only) is traced as the course's FSDP2 sequence, from its knobs. Each
row's ``traced`` says which.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Any

from utilities.errors import UsageError, bad_value
from utilities.measure.gpu_catalogue import GPUS, get_gpu
from utilities.measure.step_time import estimate_step_time


@dataclass(frozen=True)
class Cluster:
    """Where a lesson's variants are predicted: ``nodes`` x ``gpus_per_node`` GPUs of kind ``gpu``,
    NVLink inside a node and ``network_gbps`` per GPU between nodes."""

    nodes: int = 2
    gpus_per_node: int = 8
    gpu: str = "h100"
    network_gbps: float = 400.0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu} (NVLink inside a node, "
                f"{self.network_gbps:g} Gb/s per GPU between nodes)")


CLUSTER_FORMAT = "NODESxGPUSxGPU, e.g. 2x8xh100 (GPU: " + ", ".join(GPUS) + ")"


def parse_cluster(text: str, flag: str = "--predict-on") -> Cluster:
    """``2x8xh100`` -> Cluster(2, 8, "h100"); anything else is a one-line error."""
    parts = str(text).strip().lower().split("x", 2)
    try:
        nodes, per_node = int(parts[0]), int(parts[1])
        gpu = get_gpu(parts[2]).name
    except (ValueError, IndexError, UsageError):
        raise bad_value(flag, text, CLUSTER_FORMAT) from None
    if nodes < 1 or per_node < 1:
        raise bad_value(flag, text, CLUSTER_FORMAT + "; counts >= 1")
    return Cluster(nodes, per_node, gpu)


DEFAULT_MODEL_HELP = "the lesson's GPU size"


def add_prediction_arguments(parser: argparse.ArgumentParser, model: str, batch: int,
                             cluster: str = "2x8xh100", batch_help: str | None = None,
                             model_help: str | None = None) -> argparse._ArgumentGroup:
    """``--predict-on``, ``--predict-model`` and ``--predict-batch``: after a script's
    measurements, this model's prediction of its variants on a cluster (what a knob does to time
    where there is an interconnect), for ``model`` at ``batch`` per GPU unless the flags say
    otherwise (``predict_from_arguments``). Returns the flags' group, for a lesson's own."""
    from utilities.errors import positive_int

    g = parser.add_argument_group("prediction on a cluster (a model, not a measurement)")
    g.add_argument("--predict-on", default=cluster,
                   help=f"cluster to predict the variants' step time on: {CLUSTER_FORMAT}; "
                        f"'none' to skip (default {cluster})")
    g.add_argument("--predict-model", default=model,
                   help=f"model to predict for (default {model}, "
                        f"{model_help or DEFAULT_MODEL_HELP})")
    g.add_argument("--predict-batch", type=positive_int, default=batch,
                   help=f"{batch_help or 'per-GPU batch to predict for'} (default {batch})")
    return g


def check_prediction_arguments(args: argparse.Namespace) -> None:
    """Refuse a ``--predict-on`` or ``--predict-model`` that cannot be predicted (UsageError)."""
    if args.predict_on != "none":
        from utilities.models import get_model_spec

        parse_cluster(args.predict_on)
        get_model_spec(args.predict_model)


def predict_from_arguments(args: argparse.Namespace, variants: dict[str, dict[str, Any]],
                           precision: str = "bf16", ac: str = "none",
                           seq: int | None = None) -> dict[str, Any] | None:
    """A lesson's ``predicted`` block (``predict_variants``) from its prediction flags, made on
    rank 0 *before* the lesson joins its process group: the model traces one step on a fake group
    of its own. Other ranks, and ``--predict-on none``, get None."""
    if args.predict_on == "none" or int(os.environ.get("RANK", "0")) != 0:
        return None
    return predict_variants(args.predict_model, parse_cluster(args.predict_on), variants,
                            precision=precision, ac=ac, batch=args.predict_batch, seq=seq)


def predict_variants(model, cluster: Cluster, variants: dict[str, dict[str, Any]],
                     precision: str = "bf16", ac: str = "none", batch: int = 1,
                     seq: int | None = None) -> dict[str, Any]:
    """A lesson's ``predicted`` block: each variant's knobs (``estimate_step_time`` keywords) on
    ``cluster``, with its step time, exposed communication, tokens/s per GPU and timeline. One
    trace serves every variant. A prediction, not a measurement: the block says so. A variant's
    knobs may carry its own ``batch`` (with ``tp``, a TP group's): its row records it, and
    ``not_traced``: why the lesson's own function cannot be traced (its row's ``traced`` says it)."""
    from utilities.models import get_model_spec

    seq = seq or get_model_spec(model).default_seq_len
    rows = []
    for name, knobs in variants.items():
        knobs = dict(knobs)
        wrap = knobs.pop("parallelize", None)
        why_not = knobs.pop("not_traced", None)
        kw = {"precision": precision, "ac": ac, "batch": batch, "seq": seq, **knobs}
        traced, traced_text = model, (f"{COURSE_SEQUENCE_BASE}: the lesson's own code is not "
                                      f"traced: {why_not}" if why_not else COURSE_SEQUENCE)
        if wrap is not None:
            traced, traced_text = own_wrap_spec(model, wrap, name, kw,
                                                min(cluster.gpus, cluster.gpus_per_node))
        t = estimate_step_time(traced, cluster.gpus, gpu=cluster.gpu,
                               gpus_per_node=cluster.gpus_per_node,
                               network_gbps=cluster.network_gbps, **kw)
        rows.append({"name": name, "traced": traced_text,
                     **({"batch": knobs["batch"]} if "batch" in knobs else {}),
                     "step_s": t.step_s, "compute_s": t.compute_s, "comm_s": t.comm_s,
                     "exposed_comm_s": t.exposed_comm_s,
                     "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu,
                     "timeline": [asdict(e) for e in t.timeline]})
    return {"what": "PREDICTED by the course's step-time model (utilities.measure.step_time), "
                    "not measured", "cluster": cluster.describe(), "gpus": cluster.gpus,
            "model": getattr(model, "name", model), "precision": precision, "ac": ac,
            "batch": batch, "seq": seq, "variants": rows}


COURSE_SEQUENCE_BASE = "the course's FSDP2 sequence (utilities.parallelize), from the variant's knobs"
COURSE_SEQUENCE = f"{COURSE_SEQUENCE_BASE}: not the lesson's own code (the planner traces FSDP2 only)"


def wrap_text(fn: Any) -> str:
    """How a row names the lesson's wrap function: its file and name, with a ``functools.partial``'s
    arguments (``sharding_strategies.py:shard_fsdp2(block_class=T5Block, ...)``)."""
    from utilities.measure.user_code import function_name

    base = getattr(fn, "func", fn)
    code = getattr(base, "__code__", None)
    text = function_name(fn, None)
    if code is None:
        return text
    return text.replace(f"{base.__module__}.", f"{os.path.basename(code.co_filename)}:", 1)


def own_wrap_spec(model: Any, wrap: Any, name: str, kw: dict[str, Any], world: int
                  ) -> tuple[Any, str]:
    """The spec that traces variant ``name`` through the lesson's own wrap function ``wrap``, and
    the row's ``traced`` text; ``kw`` takes what the function decides, read from the model it
    shards on ``world`` fake ranks (``decided_by``): its checkpointing (``ac``: a knob
    saying otherwise is one line) and its ``CPUOffloadPolicy`` (the time model's offload copies and
    host AdamW, the traced model without it: counted once). One line for an offload or
    reshard_after_forward knob (what the function passes ``fully_shard`` decides them), DDP's
    no_shard (not FSDP2), and a function that cannot be given the prediction's mixed precision
    (it takes no ``mp_policy``)."""
    from dataclasses import replace

    from utilities.measure.plan_options import PlanOptions
    from utilities.measure.user_code import resolve_spec, takes_keyword

    text = wrap_text(wrap)
    where = f"with the lesson's own wrap function {text} (variant {name})"
    if kw.get("strategy", "full_shard") == "no_shard":
        raise bad_value("strategy", "no_shard", f"an FSDP2 strategy {where}: DDP is not fully_shard")
    options = kw.get("plan_options")
    if options is not None and (options.offload or options.reshard_after_forward is not None):
        raise bad_value("plan_options", "offload/reshard_after_forward",
                        f"neither {where}: it passes fully_shard what it passes, and the time "
                        "model adds an offload's copies itself (traced too, they would count twice)")
    if kw["precision"] != "fp32" and not takes_keyword(wrap, "mp_policy"):
        raise bad_value("parallelize", text, f"a function that takes mp_policy (the prediction's "
                        f"{kw['precision']} policy) for variant {name}, or precision fp32")
    spec = resolve_spec(model, parallelize=wrap)
    decided = decided_by(spec, world, kw)
    from utilities.parallelize import AC_MODES

    if decided.ac not in AC_MODES:
        raise bad_value("parallelize", text, f"a function that checkpoints as one of {AC_MODES} "
                        f"for variant {name} (it checkpoints {decided.ac})")
    op_level = {"selective", "op"}
    if kw["ac"] not in ("none", decided.ac) and not {kw["ac"], decided.ac} <= op_level:
        raise bad_value("ac", kw["ac"], f"none or {decided.ac!r} {where}: the function checkpoints "
                        f"what it checkpoints ({decided.ac})")
    if kw["ac"] == "none":
        kw["ac"] = decided.ac
    if decided.offload:
        kw["plan_options"] = replace(options or PlanOptions(), offload=True)
    return spec, f"the lesson's own {text}" + (", its CPUOffloadPolicy planned as the time model's "
                                              "offload" if decided.offload else "")


@dataclass(frozen=True)
class Decided:
    """What a sharding function decides itself, read from the model it shards: ``ac``, its
    checkpointing as ``AC_MODES`` names it (``checkpointing_of``); ``offload``: its units carry
    a ``CPUOffloadPolicy``."""

    ac: str
    offload: bool


def decided_by(spec: Any, world: int, kw: dict[str, Any]) -> Decided:
    """Run ``spec``'s sharding function once on a ``world``-rank fake world, on the mesh the trace
    gives it (``kw``'s ``tp`` and hybrid_shard's groups), over its model built on meta (nothing
    allocated) and read what it decided (``Decided``); one line for a function that offloads some
    units and not others."""
    import torch

    from utilities.activation_checkpointing import checkpointing_of
    from utilities.measure.fake_step import StepConfig, fake_world, step_meshes
    from utilities.measure.user_code import call_parallelize
    from utilities.precision import fsdp2_policy
    from utilities.torch_internals import fsdp2_offloaded_units

    name = spec.name.rpartition(" sharded by ")[2]
    hybrid = kw.get("strategy") == "hybrid_shard"
    config = StepConfig(world, tp=kw.get("tp", 1),
                        shard_size=min(world, kw.get("shard_size") or world) if hybrid else None)
    with fake_world(world):
        model = spec.build(device="meta")
        mesh, _ = step_meshes(config, torch.device("cpu"))
        call_parallelize(spec.parallelize, model, mesh, torch.device("cpu"), name,
                         mp_policy=fsdp2_policy(kw["precision"]))
        offloaded, units = fsdp2_offloaded_units(model)
    if 0 < offloaded < units:
        raise bad_value("--parallelize", name, f"a function that offloads every unit or none (it "
                        f"gave {offloaded} of {units} units a CPUOffloadPolicy)")
    return Decided(ac=checkpointing_of(model, spec.block_class()), offload=offloaded > 0)


def predicted_rows(block: dict[str, Any]) -> list[list[str]]:
    """The prediction's table, a header and a row per variant: what the lesson prints under its
    measurements and its README renders (``utilities.course.readme_tables``). Where variants carry
    their own batch (a TP group's) it is a column; where they carry the planner's peak
    (``peak_bytes``, ``fits``), so is the memory per GPU."""
    ms = lambda seconds: f"{seconds * 1e3:.1f}ms"  # noqa: E731
    variants = block["variants"]
    own_batch = any("batch" in v for v in variants)
    memory = bool(variants) and all("peak_bytes" in v for v in variants)

    def peak(v: dict[str, Any]) -> list[str]:
        if not memory:
            return []
        return [f"{v['peak_bytes'] / 2**30:.1f} GiB" + ("" if v.get("fits", True) else " (no fit)")]

    return [["variant", *(["batch"] if own_batch else []), "step", "comm", "exposed",
             "tokens/s/GPU", *(["peak/GPU"] if memory else [])],
            *[[v["name"], *([str(v.get("batch", block["batch"]))] if own_batch else []),
               ms(v["step_s"]), ms(v["comm_s"]), ms(v["exposed_comm_s"]),
               f"{v['tokens_per_s_per_gpu']:,.0f}", *peak(v)] for v in variants]]


def predicted_batch_text(block: dict[str, Any]) -> str:
    """The block's batch as its title says it: per GPU (or per what its ``batch_per`` names: a CP
    group), and, where variants carry their own (a TP group's), where the table gives it."""
    text = f"batch {block['batch']} x {block['seq']} per {block.get('batch_per', 'GPU')}"
    if any("batch" in v for v in block["variants"]):
        text += " (a variant with its own batch, a TP group's, says it in the batch column)"
    return text


def format_predicted(block: dict[str, Any]) -> str:
    """The prediction as a table under the lesson's measurements (80 columns)."""
    import textwrap

    title = (f"PREDICTED (the step-time model, not a measurement): {block['model']}, "
             f"{predicted_batch_text(block)}, on {block['cluster']}")
    table = predicted_rows(block)
    if len(table[0]) == 5:
        rows = [f"{name[:22]:<22}{step:>10}{comm:>10}{exposed:>10}{tokens:>14}"
                for name, step, comm, exposed, tokens in table]
    else:  # a batch or memory column: the names get the width they need
        width = min(22, max(len(r[0]) for r in table) + 2)
        rows = [f"{r[0][:width]:<{width}}" + "".join(f"{c:>{14 if h == 'tokens/s/GPU' else 10}}"
                                                    for h, c in zip(table[0][1:], r[1:]))
                for r in table]
    return "\n".join([*textwrap.wrap(title, 80), *rows])


def draw_timelines(predicted: dict[str, Any], names: list[str]) -> Any:
    """The step-time model's timelines of two or more of a lesson's variants, side by side: per
    variant a compute lane and a communication lane, each bar a unit's forward, backward,
    all-gather or reduce-scatter (``results["predicted"]``, a prediction, not a measurement)."""
    import matplotlib.pyplot as plt

    colors = {"forward": "tab:blue", "recompute": "tab:cyan", "backward": "tab:green",
              "optimizer": "tab:gray", "all_gather": "tab:orange", "reduce_scatter": "tab:red",
              "all_reduce": "tab:purple"}
    by_name = {v["name"]: v for v in predicted["variants"]}
    fig, axes = plt.subplots(len(names), 1, figsize=(14, 1.8 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        v = by_name[name]
        for row, lane in enumerate(("comm", "compute")):
            for e in (e for e in v["timeline"] if e["lane"] == lane):
                ax.broken_barh([(e["start"] * 1e3, (e["end"] - e["start"]) * 1e3)], (row * 10, 8),
                               color=colors.get(e["phase"], "k"))
        ax.set_yticks([4, 14], ["communication", "compute"])
        ax.set_title(f"{name}: step {v['step_s'] * 1e3:.1f} ms, exposed communication "
                     f"{v['exposed_comm_s'] * 1e3:.1f} ms", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms from the step's start (PREDICTED by the step-time model)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.suptitle(f"{predicted['model']} on {predicted['cluster']}", fontsize=10)
    fig.tight_layout()
    fig.legend(handles, list(colors), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=len(colors), fontsize=8)
    return fig
