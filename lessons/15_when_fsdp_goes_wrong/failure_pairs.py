"""Lesson 15's driver: each failure's pair run on the same ranks, measured and made a row.

The mistakes and the fixes are the lesson script's functions (``when_fsdp_goes_wrong.py``, handed
in as ``code``); here: how each pair is run and what is measured around it (losses, memory,
collectives, seconds, norms), and whether the symptom showed and the fix removed it, the same
answer on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from utilities.course.lesson import Lesson
from utilities.distributed import reduce_scalar, world_mesh
from utilities.doctor import diagnose
from utilities.measure import fmt_bytes
from utilities.measure.memory import MemoryProbe
from utilities.measure.transfers import CollectiveCounter
from utilities.parallelize import apply_fsdp


def train_losses(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor],
                 steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(batches[step % len(batches)])
        loss.backward()
        optimizer.step()
        losses.append(reduce_scalar(loss.item(), "mean"))
    return losses


@contextlib.contextmanager
def mixed_unit_warnings_off():
    """FSDP1's warning, once per unit and rank, that a unit mixes frozen and trainable parameters
    (its gradient memory is the whole unit's): the pair makes that mix on purpose and measures it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has both parameters with requires_grad=True and False")
        yield


def first_line(e: BaseException) -> str:
    """An exception as the user reads it: its type and the first line of its message, without the
    source path gloo puts in front."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", str(e).strip()).splitlines()[0]
    return f"{type(e).__name__}: {text}"[:300]


def short(text: str | None, n: int = 72) -> str | None:
    """An error as a table cell: its first ``n`` characters (results.json keeps the line)."""
    return text if text is None or len(text) <= n else text[: n - 3] + "..."


def tokens(equal: bool) -> str:
    return "the unsharded model's tokens" if equal else "other tokens"


def said(error: str | None) -> str:
    return "an error" if error else "no error"


def all_reduce_and(flag: bool) -> bool:
    """An all-reduce (min) of ``flag`` over the ranks: True only where every rank's is, the same
    answer on every rank. Every rank must call it, the same number of times."""
    return bool(reduce_scalar(int(bool(flag)), "min"))


class Failures:
    """The variants, each a method returning the fields of its row: ``measure`` (what is compared),
    ``mistake`` and ``fix`` (the two values, from the run), ``symptom_shown`` and ``fix_works``.
    ``code``: the lesson script, whose functions are the mistakes and the fixes (and its model)."""

    def __init__(self, lesson: Lesson, args: argparse.Namespace, code: SimpleNamespace):
        self.lesson, self.args, self.code = lesson, args, code
        self.vocab, self.seq = 64, 17
        self.rank = dist.get_rank()

    def model(self, seed: int = 0, **kw) -> nn.Module:
        torch.manual_seed(self.args.seed + seed)
        model = self.code.TinyLM(self.vocab, **kw)
        self.lesson.track(model)
        return model

    def batches(self, n: int, batch: int = 8, same_on_every_rank: bool = False) -> list[torch.Tensor]:
        offset = 0 if same_on_every_rank else 1000 * (self.rank + 1)
        return [self.code.counting_batch(batch, self.seq, self.vocab, self.args.seed + offset + i)
                for i in range(n)]

    # 1
    def optimizer_before_shard(self) -> dict:
        code = self.code
        data, steps = self.batches(4), self.args.fail_steps
        result = {}
        halves = (("mistake", code.optimizer_before_sharding), ("fix", code.optimizer_after_sharding))
        for half, build in halves:
            model = self.model()
            optimizer = build(model, 3e-3)
            losses = train_losses(model, optimizer, data, steps)
            result[f"{half}_loss_drop"] = round(losses[0] - losses[-1], 4)
            result[f"{half}_losses"] = [round(x, 4) for x in losses]
        return dict(result, measure=f"loss drop, {steps} steps",
                    mistake=f"{result['mistake_loss_drop']:.3f}", fix=f"{result['fix_loss_drop']:.3f}",
                    symptom_shown=abs(result["mistake_loss_drop"]) < 0.05,
                    fix_works=result["fix_loss_drop"] > 0.3)

    # 2
    def bf16_weights(self) -> dict:
        code = self.code
        data, steps = self.batches(4), self.args.bf16_steps
        result = {}
        for half, build in (("mistake", code.bf16_weights), ("fix", code.bf16_policy)):
            model = build(self.model(d=64))
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.args.bf16_lr)
            losses = train_losses(model, optimizer, data, steps - 1)
            before = [p.to_local().detach().clone() for p in model.parameters()]
            losses += train_losses(model, optimizer, data[steps % len(data):], 1)
            same = sum(int((b == p.to_local()).sum()) for b, p in zip(before, model.parameters()))
            total = sum(b.numel() for b in before)
            result[f"{half}_final_loss"] = round(sum(losses[-3:]) / 3, 4)
            share = reduce_scalar(same, "sum") / reduce_scalar(total, "sum")
            result[f"{half}_unchanged_fraction"] = round(share, 4)
            result[f"{half}_param_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        gap = result["mistake_final_loss"] - result["fix_final_loss"]
        return dict(result, loss_gap=round(gap, 4),
                    measure=f"weights the last step left unchanged; loss at step {steps}",
                    mistake=f"{result['mistake_unchanged_fraction']:.0%}; {result['mistake_final_loss']:.3f}",
                    fix=f"{result['fix_unchanged_fraction']:.0%}; {result['fix_final_loss']:.3f}",
                    symptom_shown=result["mistake_unchanged_fraction"] > 0.3
                    and result["mistake_final_loss"] > 1.25 * result["fix_final_loss"],
                    fix_works=result["fix_unchanged_fraction"] < 0.05)

    # 3
    def grad_accumulation(self) -> dict:
        code = self.code
        micro = self.batches(self.args.micro_batches, batch=4)
        result, finals = {}, []
        halves = (("mistake", code.accumulate_without_sync), ("fix", code.accumulate_with_sync))
        for half, accumulate in halves:
            model = code.shard(self.model(d=64, layers=4))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            probe, collectives = MemoryProbe(model, optimizer, self.lesson.device), CollectiveCounter()
            with probe, collectives:
                accumulate(model, micro, probe.next_iteration)
            optimizer.step()
            finals.append([p.to_local().detach().clone() for p in model.parameters()])
            detail = probe.peak["detail"]
            result[f"{half}_peak_gradient_bytes"] = probe.peak["gradients"]
            result[f"{half}_resident_gradient_bytes"] = detail["resident_after_step"]["gradients"]
            result[f"{half}_reduce_scatters"] = collectives.counts.get("reduce_scatter", 0)
        diff = max(float((a - b).abs().max()) for a, b in zip(*finals))
        full = 4 * sum(p.numel() for p in self.model(d=64, layers=4).parameters())
        return dict(result, micro_batches=len(micro), unsharded_gradient_bytes=full,
                    same_update_max_abs_diff=diff,
                    measure=f"peak grads; reduce-scatters ({len(micro)} micro-batches)",
                    mistake=f"{fmt_bytes(result['mistake_peak_gradient_bytes'])}; "
                            f"{result['mistake_reduce_scatters']}",
                    fix=f"{fmt_bytes(result['fix_peak_gradient_bytes'])}; {result['fix_reduce_scatters']}",
                    symptom_shown=result["mistake_peak_gradient_bytes"] >= 0.9 * full,
                    fix_works=result["fix_peak_gradient_bytes"] < 0.75 * full and diff < 1e-5)

    # 4
    def tied_weights(self) -> dict:
        """Newer torch refuses the split tie at the first forward (an error naming the weight);
        older torch trains two copies that drift apart. Either is the symptom."""
        code = self.code
        data, result = self.batches(2), {}
        for half, wrap in (("mistake", code.shard_tie_split), ("fix", code.shard_tie_together)):
            model = wrap(self.model(tie=True))
            embed, head = model.embed.weight, model.head.weight
            copies = {id(p) for p in model.parameters() if p.shape == embed.shape}
            result[f"{half}_weight_copies"] = len(copies)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            try:
                train_losses(model, optimizer, data, 3)
                result[f"{half}_error"] = None
                gap = (embed.full_tensor() - head.full_tensor()).abs().max()
                result[f"{half}_tie_max_abs_diff"] = float(gap.detach())
            except ValueError as e:
                result[f"{half}_error"], result[f"{half}_tie_max_abs_diff"] = first_line(e), None
        m = result["mistake_tie_max_abs_diff"]
        return dict(result, measure="copies of the tied weight; training",
                    mistake=f"{result['mistake_weight_copies']}; "
                            + (short(result["mistake_error"]) or f"|embed - head| {m:.2g} after 3 steps"),
                    fix=f"{result['fix_weight_copies']}; |embed - head| {result['fix_tie_max_abs_diff']:.2g}",
                    symptom_shown=result["mistake_weight_copies"] == 2
                    and (result["mistake_error"] is not None or (m or 0) > 0),
                    fix_works=result["fix_weight_copies"] == 1 and result["fix_tie_max_abs_diff"] == 0
                    and embed is head)

    # 5
    def meta_init_buffers(self) -> dict:
        code = self.code
        spec = self.lesson.spec
        torch.manual_seed(self.args.seed)
        eager = spec.build("cpu")
        state = {k: v.detach().clone() for k, v in eager.state_dict().items()}
        ids = code.counting_batch(2, 16, 64, self.args.seed)
        with torch.no_grad():
            reference = eager(input_ids=ids).logits
        result = {}
        halves = (("mistake", code.materialize_weights_only), ("fix", code.materialize_and_reinit_buffers))
        for half, materialize in halves:
            model = spec.build("meta")
            self.lesson.track(model)
            block = spec.block_class()
            apply_fsdp(model, mesh=world_mesh(),
                       units=[m for m in model.modules() if isinstance(m, block)])
            materialize(model, state, self.lesson.device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            err = (logits - reference).abs().max()
            result[f"{half}_logits_max_abs_diff"] = float(err) if torch.isfinite(err) else None
            result[f"{half}_finite"] = all_reduce_and(bool(torch.isfinite(logits).all()))
            buffers = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
            result[f"{half}_inv_freq_matches"] = all_reduce_and(all(torch.equal(b, eager.get_buffer(n))
                                                       for n, b in model.named_buffers()
                                                       if n.endswith("inv_freq")) and bool(buffers))
        bad = result["mistake_logits_max_abs_diff"]
        return dict(result, measure=f"max |logits - eager {spec.name}'s|",
                    mistake="NaN" if bad is None else f"{bad:.3g}",
                    fix=f"{result['fix_logits_max_abs_diff']:.3g}",
                    symptom_shown=(bad is None or bad > 1e-3) and not result["mistake_inv_freq_matches"],
                    fix_works=result["fix_logits_max_abs_diff"] is not None
                    and result["fix_logits_max_abs_diff"] < 1e-5 and result["fix_inv_freq_matches"])

    # 6
    def frozen_fsdp1(self) -> dict:
        code = self.code
        def lora(model: nn.Module) -> nn.Module:
            for name, p in model.named_parameters():
                p.requires_grad_(".down." in name or ".up." in name)
            return model

        try:
            with mixed_unit_warnings_off():
                code.fsdp1_mixed_unit(lora(self.model(adapter=4)), self.lesson.device, use_orig_params=False)
            error = None
        except (ValueError, RuntimeError) as e:
            error = first_line(e)
        model = code.shard(lora(self.model(adapter=4)))
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=3e-3)
        losses = train_losses(model, optimizer, self.batches(2), 3)
        model.loss(self.batches(1)[0]).backward()
        grads = {flag: sum(p.grad.to_local().numel() * 4 for p in model.parameters()
                           if p.requires_grad == flag and p.grad is not None) for flag in (True, False)}
        with mixed_unit_warnings_off():
            fsdp1 = code.fsdp1_mixed_unit(lora(self.model(adapter=4)), self.lesson.device,
                                          use_orig_params=True)
        fsdp1_ok = all(p.grad is None for p in fsdp1.parameters() if not p.requires_grad)
        n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        return dict(fsdp1_error=error, fsdp2_loss_drop=round(losses[0] - losses[-1], 4),
                    trainable_gradient_bytes_per_rank=grads[True],
                    frozen_gradient_bytes_per_rank=grads[False],
                    optimizer_states=len(optimizer.state), frozen_parameters_sharded=n_frozen,
                    fsdp1_orig_params_wraps=fsdp1_ok,
                    measure="FSDP1 wrap; FSDP2 grads frozen / trainable",
                    mistake=short(error) or "accepted",
                    fix=f"{fmt_bytes(grads[False])} / {fmt_bytes(grads[True])}",
                    symptom_shown=error is not None and "requires_grad" in error,
                    fix_works=grads[False] == 0 and grads[True] > 0 and losses[-1] < losses[0])

    # 7
    def reshard_after_forward(self) -> dict:
        code = self.code
        data, result = self.batches(2), {}
        for half, reshard in (("mistake", False), ("fix", True)):
            model = code.shard_reshard(self.model(d=64, layers=4), reshard)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            train_losses(model, optimizer, data, 1)
            probe, collectives = MemoryProbe(model, optimizer, self.lesson.device), CollectiveCounter()
            with probe, collectives:
                train_losses(model, optimizer, data, 1)
            unsharded = probe.peak["detail"].get("unsharded_parameters")
            result[f"{half}_peak_unsharded_parameter_bytes"] = unsharded
            result[f"{half}_all_gathers"] = collectives.counts.get("all_gather", 0)
        m, f = result["mistake_peak_unsharded_parameter_bytes"], result["fix_peak_unsharded_parameter_bytes"]
        return dict(result, measure="False vs True: unsharded at peak; all-gathers",
                    mistake=f"{fmt_bytes(m)}; {result['mistake_all_gathers']}",
                    fix=f"{fmt_bytes(f)}; {result['fix_all_gathers']}",
                    symptom_shown=m > f, fix_works=result["fix_all_gathers"] > result["mistake_all_gathers"])

    # 8
    def skipped_collective(self) -> dict:
        code = self.code
        seconds = self.args.hang_timeout
        mine = self.batches(3 if self.rank == 0 else 2, batch=2)
        result = {}
        for half, detail, epoch in (("mistake", False, code.uneven_epoch),
                                    ("detail", True, code.uneven_epoch), ("fix", False, code.even_epoch)):
            group = code.timeout_group(seconds, detail)
            mesh = _mesh_of(group, self.lesson.device)
            model = self.model()
            apply_fsdp(model, mesh=mesh, units=model.blocks)
            t0 = time.perf_counter()
            try:
                epoch(model, mine, group)
                error, names = None, ""
            except RuntimeError as e:
                error, names = first_line(e), _fingerprints(str(e))
            result[f"{half}_names"] = _from_rank0(names)
            result[f"{half}_seconds"] = round(reduce_scalar(time.perf_counter() - t0, "max"), 2)
            result[f"{half}_error_rank0"] = _from_rank0(error)
            del model
            dist.destroy_process_group(group)
        named = result["detail_names"]
        return dict(result, timeout_s=seconds,
                    measure=f"seconds to an error (timeout {seconds:g} s); names",
                    mistake=f"{result['mistake_seconds']:.1f} s, {said(result['mistake_error_rank0'])}; "
                            f"DETAIL: {result['detail_seconds']:.2f} s, {named or 'nothing named'}",
                    fix=f"{result['fix_seconds']:.2f} s, {said(result['fix_error_rank0'])}",
                    symptom_shown=result["mistake_error_rank0"] is not None
                    and result["mistake_seconds"] >= 0.8 * seconds and not result["mistake_names"]
                    and "rank 0" in named and "rank 1" in named,
                    fix_works=result["fix_error_rank0"] is None and result["fix_seconds"] < seconds / 2)

    # 9
    def hand_clipping(self) -> dict:
        code = self.code
        ids = self.batches(1, same_on_every_rank=True)[0]
        reference = self.model()
        reference.loss(ids).backward()
        true_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")))
        result = {"reference_norm": round(true_norm, 6)}
        for half, clip in (("mistake", code.clip_by_hand), ("fix", code.clip_dtensors)):
            model = code.shard(self.model())
            model.loss(ids).backward()
            norms = _gather_objects(clip(list(model.parameters()), 1e9))
            result[f"{half}_norms_per_rank"] = [round(n, 6) for n in norms]
            result[f"{half}_max_rel_error"] = round(max(abs(n - true_norm) / true_norm for n in norms), 6)
        fsdp1 = FSDP(self.model(), auto_wrap_policy=ModuleWrapPolicy({code.Block}),
                     device_id=self.lesson.device)
        code.lm_loss(fsdp1, ids).backward()
        plain = _gather_objects(float(torch.nn.utils.clip_grad_norm_(fsdp1.parameters(), 1e9)))
        own = _gather_objects(float(fsdp1.clip_grad_norm_(1e9)))
        result.update(fsdp1_plain_max_rel_error=round(max(abs(n - true_norm) / true_norm for n in plain), 6),
                      fsdp1_method_max_rel_error=round(max(abs(n - true_norm) / true_norm for n in own), 6))
        return dict(result, measure="norm per rank / the unsharded model's",
                    mistake=" ".join(f"{n / true_norm:.3f}" for n in result["mistake_norms_per_rank"]),
                    fix=" ".join(f"{n / true_norm:.3f}" for n in result["fix_norms_per_rank"]),
                    symptom_shown=result["mistake_max_rel_error"] > 0.05,
                    fix_works=result["fix_max_rel_error"] < 1e-4
                    and result["fsdp1_method_max_rel_error"] < 1e-4)

    # 10
    def optimizer_state(self) -> dict:
        code = self.code
        data, steps = self.batches(4), 3
        self.lesson.out.mkdir(parents=True, exist_ok=True)
        model = code.shard(self.model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train_losses(model, optimizer, data, steps)
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # every rank
        weights = {k: v.clone() for k, v in weights.items()}
        files = {}
        for half, save in (("mistake", code.save_plain), ("fix", code.save_optimizer_by_name)):
            files[half] = self.lesson.out / f"optimizer_{half}.pt"
            save(model, optimizer, files[half])
        onward = train_losses(model, optimizer, data[steps % len(data):], 2)
        result = {"uninterrupted_losses": [round(x, 6) for x in onward]}
        for half, load in (("mistake", code.load_plain), ("fix", code.load_optimizer_by_name)):
            fresh = code.shard(self.model(seed=1))
            set_model_state_dict(fresh, weights, options=StateDictOptions(full_state_dict=True))
            opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
            try:
                load(fresh, opt, files[half])
                error = None
            except (KeyError, ValueError, RuntimeError, AssertionError) as e:
                error = first_line(e)
            errors = [f"rank {r}: {e}" for r, e in enumerate(_gather_objects(error)) if e]
            result[f"{half}_error"], result[f"{half}_max_abs_loss_diff"] = (errors or [None])[0], None
            if not errors:  # every rank resumes, or none: a rank alone in a step would hang
                resumed = train_losses(fresh, opt, data[steps % len(data):], 2)
                result[f"{half}_max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(resumed, onward))
        for path in files.values():
            dist.barrier()
            if self.rank == 0:
                path.unlink(missing_ok=True)
        m = result["mistake_max_abs_loss_diff"]
        return dict(result, measure="max |resumed - uninterrupted loss|",
                    mistake=short(result["mistake_error"]) or f"{m:.2g}",
                    fix=f"{result['fix_max_abs_loss_diff']:.2g}",
                    symptom_shown=result["mistake_error"] is not None or m > 1e-4,
                    fix_works=result["fix_max_abs_loss_diff"] == 0.0)

    # 11
    def non_forward_method(self) -> dict:
        code = self.code
        prompt = self.batches(1, batch=2, same_on_every_rank=True)[0][:, :4]
        reference = self.model().generate(prompt, 6)
        result = {}
        for half, prepare in (("mistake", lambda m: m), ("fix", code.register_generate)):
            model = prepare(code.shard(self.model()))
            said = [f.line for f in diagnose(model, methods=["generate"]) if f.check == "unregistered-method"]
            result[f"{half}_doctor"] = said[0] if said else None  # said before the call, from the code
            try:
                out = model.generate(prompt, 6)
                error, equal = None, all_reduce_and(torch.equal(out, reference))
            except (RuntimeError, TypeError, ValueError, AssertionError) as e:
                error, equal = first_line(e), False
            result[f"{half}_error"], result[f"{half}_equal_to_unsharded"] = error, equal
        return dict(result, measure="generate() on the FSDP2 model",
                    mistake=short(result["mistake_error"]) or tokens(result["mistake_equal_to_unsharded"]),
                    fix=short(result["fix_error"]) or tokens(result["fix_equal_to_unsharded"]),
                    symptom_shown=result["mistake_error"] is not None
                    or not result["mistake_equal_to_unsharded"],
                    fix_works=result["fix_error"] is None and result["fix_equal_to_unsharded"])

    # 14
    def bf16_reduce(self) -> dict:
        code = self.code
        ids = self.batches(1)[0]  # each rank its own batch: the ranks' gradients differ
        result, grads = {}, {}
        for half, wrap in (("mistake", code.bf16_policy_without_reduce_dtype), ("fix", code.bf16_policy)):
            model = wrap(self.model(d=64))
            with CollectiveCounter() as collectives:
                model.loss(ids).backward()
            grads[half] = torch.cat([p.grad.full_tensor().float().flatten() for p in model.parameters()])
            result[f"{half}_reduce_dtypes"] = sorted(collectives.dtypes.get("reduce_scatter", ()))
            said = [f.line for f in diagnose(model) if f.check == "low-precision-reduce"]
            result[f"{half}_doctor"] = said[0] if said else None
        error = float((grads["mistake"] - grads["fix"]).norm() / grads["fix"].norm())
        result["mistake_grad_rel_error"] = round(error, 6)
        m, f = result["mistake_reduce_dtypes"], result["fix_reduce_dtypes"]
        return dict(result, measure="reduce-scatter dtype; gradients vs an fp32 reduction; doctor",
                    mistake=f"{'/'.join(m)}; {error:.2%}; "
                            + ("low-precision-reduce" if result["mistake_doctor"] else "nothing said"),
                    fix=f"{'/'.join(f)}; 0%; "
                        + ("low-precision-reduce" if result["fix_doctor"] else "nothing said"),
                    symptom_shown=m == ["bfloat16"] and error > 1e-4 and result["mistake_doctor"] is not None,
                    fix_works=f == ["float32"] and result["fix_doctor"] is None)

    # 12
    def memory_vs_rss(self) -> dict:
        code = self.code
        rss_before = process_rss_bytes()
        model = code.shard(self.model(d=128, layers=4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = self.batches(2, batch=8)
        train_losses(model, optimizer, data, 1)
        with MemoryProbe(model, optimizer, self.lesson.device) as probe:
            train_losses(model, optimizer, data, 1)
        rss = process_rss_bytes()
        peak = probe.peak
        parts = sum(peak[k] for k in ("parameters", "gradients", "optimizer", "activations"))
        other = sum(v for k, v in peak["detail"].items() if k in ("buffers", "temporaries", "all_gather",
                                                                   "reduce_scatter", "inputs", "other"))
        cached = allocator_model(model, optimizer, data, self.lesson.device)
        return dict(process_rss_bytes=rss, rss_before_model_bytes=rss_before,
                    tracker_peak_bytes=peak["total"], tracker_categories_bytes=parts + other,
                    rss_to_tracker_ratio=round(rss / peak["total"], 1),
                    allocator_allocated_bytes=cached["allocated"],
                    allocator_reserved_bytes=cached["reserved"],
                    reserved_to_allocated_ratio=round(cached["reserved"] / cached["allocated"], 2),
                    measure="RSS vs tracker peak; categories vs peak; reserved (allocator model)",
                    mistake=f"{fmt_bytes(rss)} vs {fmt_bytes(peak['total'])}",
                    fix=f"{fmt_bytes(parts + other)} of {fmt_bytes(peak['total'])}, "
                        f"reserved {fmt_bytes(cached['reserved'])}",
                    symptom_shown=rss > 10 * peak["total"],
                    fix_works=abs(parts + other - peak["total"]) <= 0.01 * peak["total"]
                    and peak["total"] <= cached["allocated"] <= cached["reserved"])


    # 13
    def rank_seeds(self) -> dict:
        code = self.code
        result = {}
        for half, build in (("mistake", code.build_seeded_per_rank), ("fix", code.build_seeded_alike)):
            model = build(self.args.seed, vocab=self.vocab)
            self.lesson.track(model)
            said = code.check_same_build(model)
            builds = _gather_objects({n: p.detach().cpu().clone() for n, p in model.named_parameters()})
            code.shard(model)
            as_built, farthest = 0, 0.0
            for name, p in model.named_parameters():
                gathered = p.full_tensor().detach().cpu()
                gaps = [float((gathered - build[name]).abs().max()) for build in builds]
                as_built += min(gaps) == 0.0
                farthest = max(farthest, min(gaps))
            result[f"{half}_tensors_as_a_rank_built"] = as_built
            result[f"{half}_max_abs_diff_from_nearest_build"] = farthest
            result[f"{half}_doctor"] = said[0] if said else None
        tensors = len(list(model.parameters()))
        m, f = result["mistake_tensors_as_a_rank_built"], result["fix_tensors_as_a_rank_built"]
        return dict(result, tensors=tensors,
                    measure="tensors as some rank built them, max |gathered - nearest build|; check",
                    mistake=f"{m} of {tensors}, {result['mistake_max_abs_diff_from_nearest_build']:.2g}; "
                            + ("rank-divergent-build" if result["mistake_doctor"] else "nothing said"),
                    fix=f"{f} of {tensors}, {result['fix_max_abs_diff_from_nearest_build']:.2g}; "
                        + ("rank-divergent-build" if result["fix_doctor"] else "nothing said"),
                    symptom_shown=m < tensors and result["mistake_max_abs_diff_from_nearest_build"] > 1e-3
                    and result["mistake_doctor"] is not None,
                    fix_works=f == tensors and result["fix_max_abs_diff_from_nearest_build"] == 0.0
                    and result["fix_doctor"] is None)

def allocator_model(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor],
                    device: torch.device) -> dict[str, int]:
    """One more step, its allocations and frees recorded by the memory tracker and replayed through
    the model of CUDA's caching allocator that ``fsdp-course plan`` reports as ``reserved``
    (``utilities.measure.allocator.reserved_peak``): what the step allocates at its peak, rounded
    to the allocator's 512-byte blocks, and what the allocator reserves (its cached segments:
    what ``torch.cuda.memory_reserved``, ``nvidia-smi`` less the CUDA context, torchtitan's memory
    column and an out-of-memory message report)."""
    from utilities.measure.allocator import EventRecorder, reserved_peak
    from utilities.measure.memory import TrackerHooks
    from utilities.torch_internals import fsdp_mem_tracker

    tracker = fsdp_mem_tracker()(model, optimizer)
    recorder = EventRecorder(tracker, device.type)
    with TrackerHooks(), tracker:
        start = len(recorder.events)
        train_losses(model, optimizer, data, 1)
    return reserved_peak(recorder.events[:start], recorder.events[start:])


def process_rss_bytes() -> int:
    """What the operating system says the process holds (``top``'s RES): every page the process
    has touched and not returned, torch's libraries included."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _mesh_of(group, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def _gather_objects(value):
    """Every rank's ``value``, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _from_rank0(text: str | None) -> str | None:
    out = [text]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def _fingerprints(message: str | None) -> str:
    """The ranks and collectives TORCH_DISTRIBUTED_DEBUG=DETAIL names in its mismatch error
    ("rank 0: _ALLGATHER_BASE, rank 1: ALLREDUCE"), read from the message itself."""
    found = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
                       r"OpType=(\w+)", message or "")
    return ", ".join(f"rank {r}: {op}" for r, op in found)


PAIRS: dict[str, Callable[[Failures], dict]] = {
    "optimizer-before-shard": Failures.optimizer_before_shard,
    "bf16-weights": Failures.bf16_weights,
    "grad-accumulation": Failures.grad_accumulation,
    "tied-weights": Failures.tied_weights,
    "meta-init-buffers": Failures.meta_init_buffers,
    "frozen-fsdp1": Failures.frozen_fsdp1,
    "reshard-after-forward": Failures.reshard_after_forward,
    "skipped-collective": Failures.skipped_collective,
    "hand-clipping": Failures.hand_clipping,
    "optimizer-state": Failures.optimizer_state,
    "non-forward-method": Failures.non_forward_method,
    "memory-vs-rss": Failures.memory_vs_rss,
    "rank-seeds": Failures.rank_seeds,
    "bf16-reduce": Failures.bf16_reduce,
}


def run_pairs(lesson: Lesson, args: argparse.Namespace, code: SimpleNamespace) -> None:
    """Each pair of ``args.variants`` in turn, its row added to the lesson's results and a line
    printed: the mistake, then the fix (``code``: the lesson script's names)."""
    lesson.results.columns("symptom_shown", "fix_works", "measure", "mistake", "fix")
    failures = Failures(lesson, args, code)
    for name in args.variants:
        with lesson.variant(name):
            t0 = time.perf_counter()
            fields = PAIRS[name](failures)
            fields["seconds"] = round(reduce_scalar(time.perf_counter() - t0, "max"), 2)
            lesson.results.add(name, **fields)
            lesson.print(f"  {name}: {fields['measure']}: mistake {fields['mistake']} -> fix "
                         f"{fields['fix']} (symptom shown: {'yes' if fields['symptom_shown'] else 'NO'}, "
                         f"fix works: {'yes' if fields['fix_works'] else 'NO'})")
