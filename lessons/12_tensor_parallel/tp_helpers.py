"""What lesson 12 measures around its tensor-parallel code (tensor_parallel.py holds the plans).

* ``split_parameter_names`` / ``weight_bytes``: what each rank holds, split and replicated;
* ``max_abs_diffs``: a split model against its unsplit twin after the same forward and backward;
* ``data_parallel_loader``: data sharded over the dp ranks only (a TP group shares one batch);
* ``run_mlp`` / ``run_llama``: build the unsplit reference, split a copy with the lesson's code,
  compare the two on one batch, then train the split one and record what it holds;
* ``run_variants``: the lesson's variants (``VARIANTS``), each on its mesh, made rows.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from utilities.data import ReverseTask, batches, make_loader
from utilities.errors import UsageError
from utilities.measure import MemoryProbe, fmt_bytes
from utilities.measure.tensor_parallel import FeedForward, check_mlp_tensor_parallel, check_tensor_parallel
from utilities.training import TrainStats, sync, train

PUBLISHED_GB = {1: 4.04, 2: 2.03, 4: 1.02, 8: 0.60}  # Lightning TP docs, FeedForward(8192, 8192)


def split_parameter_names(model: nn.Module, tp_dim: str = "tp") -> set[str]:
    """Names of the parameters that TP split: DTensors sharded along the mesh dimension named
    ``tp_dim`` (FSDP's shards along "dp" do not count: in 2-D every parameter has those)."""
    names = set()
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            dims = p.device_mesh.mesh_dim_names or ()
            if any(isinstance(pl, Shard) and d == tp_dim for d, pl in zip(dims, p.placements)):
                names.add(name)
    return names


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def weight_bytes(model: nn.Module, names: set[str] | None = None) -> dict[str, int]:
    """Per-rank parameter bytes: all of them, the ``names`` subset (the split ones) and the rest."""
    total = split = 0
    for name, p in model.named_parameters():
        local = _local(p)
        n = local.numel() * local.element_size()
        total += n
        if names is not None and name in names:
            split += n
    return {"weight_bytes_per_rank": total, "split_weight_bytes_per_rank": split,
            "replicated_weight_bytes_per_rank": total - split}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_abs_diffs(ref: nn.Module, par: nn.Module) -> dict[str, float]:
    """Largest |difference| of parameters and of gradients between a model and its split copy
    (same parameter names), after both ran the same forward and backward."""
    ref_params = dict(ref.named_parameters())
    dp = dg = 0.0
    # Gathering a 2-D (FSDP x TP) DTensor logs that it takes two all-gathers: true, and harmless here.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        for name, p in par.named_parameters():
            r = ref_params[name]
            dp = max(dp, (_full(p.detach()) - r.detach()).abs().max().item())
            if r.grad is not None or p.grad is not None:
                dg = max(dg, (_full(p.grad) - r.grad).abs().max().item())
    finally:
        log.setLevel(level)
    return {"params": dp, "grads": dg}


def data_parallel_loader(dataset, batch_size: int, dp_rank: int, dp_size: int, seed: int = 0):
    """A loader that shards the data over the *data-parallel* ranks only.

    Every rank of one TP group computes slices of the same matmuls, so it must see the same batch:
    the sampler's rank is the dp rank (``mesh["dp"].get_local_rank()``) and its number of replicas
    the dp size, never the global rank and world size.
    """
    return make_loader(dataset, batch_size, dp_rank, dp_size, seed=seed)


def _summary(model: nn.Module, split: set[str], diff_out: float, diff_grads: float) -> dict[str, Any]:
    return dict(**weight_bytes(model, split), max_abs_diff_output=diff_out,
                max_abs_diff_grads=diff_grads, max_abs_diff_vs_unsplit=max(diff_out, diff_grads))


def run_mlp(lesson, name: str, parallelize: Callable[[nn.Module], nn.Module] | None, dim: int,
            hidden: int) -> tuple[TrainStats, dict[str, Any]]:
    """Split a FeedForward with ``parallelize`` (None: keep it whole), check it against the unsplit
    one on the first input, then time and measure training steps on it (step 0 warm-up, step 1
    measured for memory, the rest timed). Its loss is a plain square mean of the output: the
    reversal task's batches do not fit an MLP of random inputs."""
    lesson.seed()
    ref = FeedForward(dim, hidden).to(lesson.device)
    model = copy.deepcopy(ref)
    if parallelize is not None:
        parallelize(model)
    split = split_parameter_names(model) if parallelize else {n for n, _ in model.named_parameters()}
    g = torch.Generator().manual_seed(lesson.args.seed + 1)
    xs = [torch.randn(lesson.batch_size, lesson.seq_len, dim, generator=g).to(lesson.device)
          for _ in range(lesson.steps)]

    out_ref = ref(xs[0])
    out_ref.square().mean().backward()
    out = model(xs[0])
    out.square().mean().backward()
    diff_out = (out - out_ref).abs().max().item()
    diffs = max_abs_diffs(ref, model)
    del ref, out_ref, out
    model.zero_grad(set_to_none=True)

    opt = lesson.optimizer(model)
    stats = TrainStats()
    for step, x in enumerate(xs):
        sync(lesson.device)
        t0 = time.perf_counter()
        if step == 1:
            with MemoryProbe(model, opt, lesson.device) as probe:
                loss = _mlp_step(model, opt, x)
            stats.peak_memory_bytes = probe.peak
        else:
            loss = _mlp_step(model, opt, x)
        sync(lesson.device)
        if step > 1:
            stats.step_times_s.append(time.perf_counter() - t0)
            stats.tokens_per_step = x.shape[0] * x.shape[1]
        stats.losses.append(loss)
    row = _summary(model, split, diff_out, diffs["grads"])
    lesson.print(f"  {name}: weights per rank {fmt_bytes(row['weight_bytes_per_rank'])}, peak "
                 f"{fmt_bytes(stats.peak_memory_bytes.get('total'))}, max |diff| output {diff_out:.2e} "
                 f"grads {diffs['grads']:.2e}")
    return stats, row


def _mlp_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def _llama_data(lesson, dp_rank: int, dp_size: int):
    n = max(lesson.batch_size * dp_size * max(lesson.steps, 1), 64)
    ds = ReverseTask(n, lesson.seq_len, mode="causal", seed=lesson.args.seed)
    loader = data_parallel_loader(ds, lesson.batch_size, dp_rank, dp_size, seed=lesson.args.seed)
    return batches(loader, lesson.device)


def run_llama(lesson, name: str, parallelize: Callable[[nn.Module], nn.Module] | None, dp: int,
              dp_rank: int) -> tuple[TrainStats, dict[str, Any]]:
    """Split a copy of the lesson's Llama with ``parallelize`` (None: keep it whole), check it
    against the unsplit model on the same global batch, then train it on this dp group's data."""
    ref = lesson.build_model()
    model = copy.deepcopy(ref)
    if parallelize is not None:
        parallelize(model)
    split = split_parameter_names(model)

    # The unsplit reference sees the whole global batch: every dp group's batch, concatenated.
    firsts = [next(_llama_data(lesson, r, dp)) for r in range(dp)]
    glob = {k: torch.cat([b[k] for b in firsts]) for k in firsts[0]}
    out_ref = ref(**glob)
    out_ref.loss.backward()
    out = model(**firsts[dp_rank])
    out.loss.backward()
    rows = slice(dp_rank * lesson.batch_size, (dp_rank + 1) * lesson.batch_size)
    diff_out = (out.logits - out_ref.logits[rows]).abs().max().item()
    diffs = max_abs_diffs(ref, model)
    del ref, out_ref, out
    model.zero_grad(set_to_none=True)

    stats = train(model, lesson.optimizer(model), _llama_data(lesson, dp_rank, dp), lesson.steps,
                  lesson.device, progress=name, flops_per_token=lesson.spec.flops_per_token(lesson.seq_len))
    stats.tokens_per_step = stats.tokens_per_step * dp // lesson.dist.world_size  # TP ranks share a batch
    row = _summary(model, split, diff_out, diffs["grads"])
    lesson.print(f"  {name}: loss {stats.losses[0]:.3f} -> {stats.losses[-1]:.3f}, weights per rank "
                 f"{fmt_bytes(row['weight_bytes_per_rank'])} "
                 f"(split {fmt_bytes(row['split_weight_bytes_per_rank'])}), "
                 f"peak {fmt_bytes(stats.peak_memory_bytes.get('total'))}, max |diff| logits {diff_out:.2e} "
                 f"grads {diffs['grads']:.2e}")
    return stats, row


def ratios_vs_tp1(variants: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each split MLP's weights and peak as a ratio to the unsplit one's, beside the published
    ratio at the same tp (Lightning's figure), by variant name (none without an unsplit MLP)."""
    mlps = [v for v in variants if v["kind"] == "mlp"]
    base = next((v for v in mlps if v["tp_size"] == 1), None)
    if base is None:
        return {}
    ratios = {}
    for v in mlps:
        tp = v["tp_size"]
        if tp == 1:
            continue
        row = ratios[v["name"]] = {}
        row["weight_ratio_vs_tp1"] = round(v["weight_bytes_per_rank"] / base["weight_bytes_per_rank"], 4)
        row["peak_ratio_vs_tp1"] = round(v["peak_memory_bytes"]["total"] /
                                         base["peak_memory_bytes"]["total"], 4)
        if tp in PUBLISHED_GB:
            row["published_ratio_vs_tp1"] = round(PUBLISHED_GB[tp] / PUBLISHED_GB[1], 4)
    return ratios


# -- the lesson's variants -----------------------------------------------------------------------
# name: (kind, dp size or None for "whatever is left", tp size)
VARIANTS = {
    "tp1-mlp": ("mlp", None, 1),
    "tp2-mlp": ("mlp", None, 2),
    "tp4-mlp": ("mlp", None, 4),
    "tp1-llama": ("llama", 1, 1),
    "tp2-llama": ("llama", 1, 2),
    "tp2-llama-sp": ("llama-sp", 1, 2),
    "dp1xtp2-2d": ("2d", 1, 2),
    "dp2xtp2-2d": ("2d", 2, 2),
}
TOLERANCE = 1e-5  # fp32: splitting a matmul only reorders its sums
NOTES = (
    f"max_abs_diff_vs_unsplit: largest |difference| of outputs and gradients from the unsplit model "
    f"on the same batch (fp32; expected below {TOLERANCE:g}).",
    "split weights: q/k/v/o and gate/up/down of every block (MLP: w1/w2/w3); embeddings, norms and "
    "the LM head are replicated on every TP rank, except with -sp, where the embedding and the head "
    "are split too (norms stay whole: they are tiny; their activations are what SP shards).",
    "published (Lightning TP docs, FeedForward(8192, 8192), peak per GPU): 4.04 / 2.03 / 1.02 / "
    "0.60 GB on 1 / 2 / 4 / 8 GPUs.",
)
CPU_NOTE = "CPU run: memory from torch.distributed._tools trackers; step times on gloo are only indicative."


def fits(kind: str, dp: int | None, tp: int, world: int) -> bool:
    """tpN-mlp needs a multiple of N ranks, tp1-llama any number, the others exactly dp x tp."""
    if kind == "mlp":
        return world % tp == 0
    if tp == 1 and kind == "llama":
        return True
    return dp * tp == world


def parallelize(kind: str, tp: int, mesh: DeviceMesh | None, code: SimpleNamespace):
    """The variant's split as a function of the model (None: the unsplit baseline)."""
    if tp == 1 and kind != "2d":
        return None
    if kind == "mlp":
        return lambda model: code.apply_mlp_tp(model, mesh["tp"])
    if kind == "2d":
        return lambda model: code.apply_2d(model, mesh)
    return lambda model: code.apply_llama_tp(model, mesh["tp"], sequence_parallel=kind == "llama-sp")


def takeaway(results: dict) -> str:
    """The lesson's point, from what the run measured (printed last)."""
    worst = max(v.get("max_abs_diff_vs_unsplit") or 0 for v in results["variants"])
    return f"tensor parallel computes what the unsplit model does (max |diff| {worst:.1e})"


def run_variants(lesson, args, code: SimpleNamespace) -> None:
    """Every variant that fits this number of ranks: its split (the lesson script's functions,
    handed in as ``code``) checked, its mesh made once per tp size, run and made a row; the ratios
    against tp1 added, the skipped ones noted."""
    if lesson.spec.family != "llama":
        raise UsageError(f"--model {lesson.spec.name!r} is not allowed: this lesson splits Llama "
                         "attention heads; allowed: llama-tiny, llama-1b, llama-8b")
    world = lesson.dist.world_size
    dim = args.mlp_dim or (8192 if lesson.device.type == "cuda" and not args.quick
                           else 512 if args.quick else 1024)
    hidden = args.mlp_hidden or dim
    lesson.results.setting(mlp_dim=dim, mlp_hidden=hidden)
    lesson.results.columns("tp_size", "dp_size", "max_abs_diff_vs_unsplit", "weight_bytes_per_rank",
                           "peak_ratio_vs_tp1", "split_weight_bytes_per_rank")
    skipped = [n for n in args.variants if not fits(*VARIANTS[n], world)]
    meshes: dict[int, DeviceMesh] = {}  # one (world // tp, tp) mesh per tp size, made once
    for name in (n for n in args.variants if n not in skipped):
        kind, dp, tp = VARIANTS[name]
        dp = dp or world // tp
        if kind == "mlp":
            check_mlp_tensor_parallel(hidden, tp)
        elif tp > 1:
            check_tensor_parallel(lesson.spec.config(), tp, sequence_parallel=kind == "llama-sp")
        if (tp > 1 or kind == "2d") and tp not in meshes:
            meshes[tp] = code.mesh_2d(lesson.device.type, world // tp, tp)
        mesh = meshes.get(tp)
        with lesson.variant(name):  # everything the variant made is freed before the next one
            if kind == "mlp":
                stats, row = run_mlp(lesson, name, parallelize(kind, tp, mesh, code), dim, hidden)
            else:
                dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
                stats, row = run_llama(lesson, name, parallelize(kind, tp, mesh, code), dp, dp_rank)
            lesson.results.add(name, stats, kind=kind, tp_size=tp, dp_size=dp, **row)
            del stats
    lesson.results.extend_variants(ratios_vs_tp1(lesson.results.data["variants"]))
    if skipped:
        lesson.results.note(f"skipped (need another number of ranks than {world}): {', '.join(skipped)}")
