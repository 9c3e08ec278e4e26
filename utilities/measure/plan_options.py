"""The settings ``fsdp-course plan`` takes beyond strategy, precision, AC and batch: one home.

``PlanOptions``' keyword fields are the flags with ``-`` written ``_``; a lesson or a script calls
``plan(..., options=PlanOptions(offload=True))`` or ``options={"grad_accum": 4, ...}``:

=========================  ==========================  ===============================================
flag                       field                       mechanism (memory; time)
=========================  ==========================  ===============================================
``--offload``              ``offload``                 FSDP2 ``CPUOffloadPolicy`` / FSDP1
                                                       ``CPUOffload(offload_params=True)``: parameter
                                                       shards, gradient shards and AdamW state live on
                                                       the host; the GPU holds what is gathered and
                                                       the activations. Time: host-device copies over
                                                       PCIe, AdamW on the host CPU.
``--host-memory``          ``host_memory_bytes``       host memory per node the offloaded state is
                                                       checked against (default ``HOST_MEMORY_BYTES``)
``--grad-accum N``         ``grad_accum``              N micro-batches per optimizer step
``--accum-sync``           ``accum_sync``              ``every``: reduce-scatter per micro-batch, the
                                                       sharded gradients held between them; ``last``:
                                                       FSDP2 ``set_requires_gradient_sync(False)`` /
                                                       FSDP1 ``no_sync()``: unsharded gradients held
                                                       until the last micro-batch's reduce-scatter
``--reshard-after-forward`` ``reshard_after_forward``  ``true`` / ``false`` / N (reshard to groups of
                                                       N ranks): None keeps the strategy's own
``--trainable FRACTION``   ``trainable``               freeze all but FRACTION of the parameters
                                                       (whole tensors, the earliest blocks first, as
                                                       lesson 09 freezes its encoder)
``--lora-rank R``          ``lora_rank``               freeze every parameter, add rank-R adapters to
                                                       the blocks' ``nn.Linear`` layers
``--param-dtype``          ``param_dtype``             ``fp32`` (masters kept) or ``bf16``: the model
                                                       stored in bf16, no fp32 master copy
``--reduce-dtype``         ``reduce_dtype``            ``fp32`` with ``--precision bf16``: FSDP2's
                                                       ``reduce_dtype`` (torchtitan's default). The
                                                       reduce-scatter in fp32; under ``--accum-sync
                                                       last`` FSDP2 keeps the unsharded gradients
                                                       between micro-batches upcast to fp32
                                                       (``FSDPParam.unsharded_accumulated_grad``),
                                                       twice the bf16 ones. None: the precision's own
``--gpus-per-node``        ``gpus_per_node``           ranks sharing one host's memory
``--no-loss-parallel``     ``loss_parallel``           with ``--tp``: True (default, torchtitan's) keeps
                                                       the LM head's logits split over the vocabulary
                                                       and computes the loss on the shards
                                                       (``loss_parallel()``); False gathers whole
                                                       logits on every rank
=========================  ==========================  ===============================================

What bf16 parameters cost: AdamW adds ``lr x update`` to a bf16 weight whose 8-bit mantissa
rounds away any change smaller than 2^-8 of it (~0.4%): late in training, most updates are
smaller than that and are lost (lesson 15's mistake 2), so the loss stalls or drifts above an
fp32-master run's. Use it knowingly (short fine-tunes, Kahan-summation or stochastic-rounding
optimizers), never to make a pre-training run fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from utilities.errors import UsageError, bad_value

ACCUM_SYNC = ("every", "last")
PARAM_DTYPES = ("fp32", "bf16")
REDUCE_DTYPES = ("bf16", "fp32")
# A typical 8-GPU node's host memory: a DGX H100 has 2 TB of system memory.
HOST_MEMORY_BYTES = 2 * 10**12
HOST_MEMORY_SOURCE = "2 TB, a DGX H100's system memory (a typical 8-GPU node)"
BF16_ACCURACY_NOTE = (
    "--param-dtype bf16 keeps no fp32 master copy: AdamW's update is added to a bf16 weight, "
    "whose 8-bit mantissa drops any change under ~0.4% of the weight, so small late-training "
    "updates are lost and the loss ends higher than with fp32 masters (lesson 15, mistake 2)")


@dataclass(frozen=True)
class PlanOptions:
    """The plan's knobs that move memory or time (the module's table: flag, field, mechanism)."""

    offload: bool = False
    grad_accum: int = 1
    accum_sync: str = "every"
    reshard_after_forward: bool | int | None = None
    trainable: float | None = None
    lora_rank: int | None = None
    param_dtype: str = "fp32"
    reduce_dtype: str | None = None  # None: the precision's own (bf16 reduces in bf16)
    host_memory_bytes: int = HOST_MEMORY_BYTES
    gpus_per_node: int = 8
    loss_parallel: bool = True  # with TP: the logits split over the vocabulary (torchtitan's default)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def default(self) -> bool:
        return self == PlanOptions(host_memory_bytes=self.host_memory_bytes,
                                   gpus_per_node=self.gpus_per_node,
                                   loss_parallel=self.loss_parallel)

    @property
    def frozen(self) -> bool:
        return self.trainable is not None or self.lora_rank is not None


def as_options(options: PlanOptions | dict[str, Any] | None) -> PlanOptions:
    """``options`` as a checked ``PlanOptions`` (a dict's unknown keys are refused in one line)."""
    if options is None:
        return PlanOptions()
    if isinstance(options, dict):
        names = {f.name for f in fields(PlanOptions)}
        for key in options:
            if key not in names:
                raise bad_value("plan option", key, sorted(names))
        options = PlanOptions(**options)
    check_options(options)
    return options


def check_options(o: PlanOptions, strategy: str = "full_shard", precision: str = "bf16",
                  gpus: int | None = None) -> None:
    """Each value, and the combinations that have no meaning, refused in one line."""
    if not isinstance(o.offload, bool):
        raise bad_value("--offload", o.offload, "true or false")
    if not isinstance(o.grad_accum, int) or isinstance(o.grad_accum, bool) or not 1 <= o.grad_accum <= 4096:
        raise bad_value("--grad-accum", o.grad_accum, "integers in [1, 4096]")
    if o.accum_sync not in ACCUM_SYNC:
        raise bad_value("--accum-sync", o.accum_sync, ACCUM_SYNC)
    r = o.reshard_after_forward
    if r is not None and not isinstance(r, bool) and (not isinstance(r, int) or r < 1):
        raise bad_value("--reshard-after-forward", r, "true, false or an integer >= 1")
    if o.trainable is not None:
        if (isinstance(o.trainable, bool) or not isinstance(o.trainable, (int, float))
                or not 0 < o.trainable <= 1):
            raise bad_value("--trainable", o.trainable, "fractions in (0, 1]")
        if o.lora_rank is not None:
            raise bad_value("--lora-rank", o.lora_rank, "only without --trainable")
    if o.lora_rank is not None and (isinstance(o.lora_rank, bool) or not isinstance(o.lora_rank, int)
                                    or not 1 <= o.lora_rank <= 65536):
        raise bad_value("--lora-rank", o.lora_rank, "integers in [1, 65536]")
    if o.param_dtype not in PARAM_DTYPES:
        raise bad_value("--param-dtype", o.param_dtype, PARAM_DTYPES)
    if o.param_dtype == "bf16" and precision == "fp32":
        raise bad_value("--param-dtype", o.param_dtype, "fp32 with --precision fp32 (bf16 "
                        "parameters compute in bf16: use --precision bf16)")
    if o.reduce_dtype is not None and o.reduce_dtype not in REDUCE_DTYPES:
        raise bad_value("--reduce-dtype", o.reduce_dtype, REDUCE_DTYPES)
    if o.reduce_dtype == "bf16" and precision == "fp32":
        raise bad_value("--reduce-dtype", o.reduce_dtype, "fp32 with --precision fp32")
    if not isinstance(o.host_memory_bytes, int) or o.host_memory_bytes < 1:
        raise bad_value("--host-memory", o.host_memory_bytes, "sizes > 0")
    if not isinstance(o.loss_parallel, bool):
        raise bad_value("--no-loss-parallel", o.loss_parallel, "true or false")
    if not isinstance(o.gpus_per_node, int) or o.gpus_per_node < 1:
        raise bad_value("--gpus-per-node", o.gpus_per_node, "integers >= 1")
    if strategy == "no_shard" and (o.offload or r is not None):
        flag = "--offload" if o.offload else "--reshard-after-forward"
        raise bad_value(flag, True if o.offload else r, "only with a sharded strategy (full_shard, "
                        "shard_grad_op, hybrid_shard), not no_shard (DDP)")
    if isinstance(r, int) and not isinstance(r, bool) and gpus is not None:
        group = gpus
        if strategy == "shard_grad_op":
            raise bad_value("--reshard-after-forward", r, "true or false with shard_grad_op (it "
                            "keeps the gathered parameters: use full_shard with an integer)")
        if r > group or group % r:
            raise bad_value("--reshard-after-forward", r, f"true, false or a divisor of the shard "
                            f"group ({group} ranks)")


def parse_reshard(text: str | None) -> bool | int | None:
    """``--reshard-after-forward``: true, false or an integer."""
    if text is None:
        return None
    key = str(text).strip().lower()
    if key in ("true", "false"):
        return key == "true"
    try:
        value = int(key)
    except ValueError:
        raise bad_value("--reshard-after-forward", text, "true, false or an integer >= 1") from None
    if value < 1:
        raise bad_value("--reshard-after-forward", text, "true, false or an integer >= 1")
    return value


def parse_fraction(flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:  # NaN fails too
        raise bad_value(flag, text, "fractions in (0, 1]")
    return value


# -- applying them to a model (the planner's fake one and a real CPU run alike) --------------------

class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-``rank`` update ``B A`` (B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        if w.device.type != "meta":
            nn.init.normal_(self.lora_a, std=rank ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def add_lora(model: nn.Module, blocks: list[nn.Module], rank: int) -> int:
    """Freeze every parameter of ``model`` and wrap each ``nn.Linear`` inside ``blocks`` with a
    ``LoRALinear``; the number of adapter parameters (refused when there is no Linear to adapt)."""
    for p in model.parameters():
        p.requires_grad_(False)
    added = 0
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, LoRALinear(child, rank))
                    added += rank * (child.in_features + child.out_features)
    if not added:
        raise bad_value("--lora-rank", rank, "models whose blocks hold nn.Linear layers")
    return added


def freeze_fraction(model: nn.Module, blocks: list[nn.Module], trainable: float) -> int:
    """Freeze whole parameter tensors, the first blocks' first, until at most ``1 - trainable`` of
    the parameters are frozen (then the others, never past it); the trainable count. A fraction
    smaller than the model's smallest tensor, which would freeze them all and leave the optimizer
    nothing, is refused in one line naming the smallest fraction that trains."""
    params = list(dict.fromkeys(p for b in blocks for p in b.parameters()))
    params += [p for p in model.parameters() if p not in set(params)]
    total = sum(p.numel() for p in params)
    smallest = min((p.numel() for p in params), default=0)
    if not smallest or trainable * total < max(smallest, 1) - 0.5 or trainable * total <= 0.5:
        raise bad_value("--trainable", trainable, f"fractions in [{smallest / max(total, 1):.3g}, 1] for "
                        f"this model (whole tensors are frozen; its smallest holds {smallest:,} of "
                        f"{total:,} parameters)")
    budget = (1 - trainable) * total
    frozen = 0
    for p in params:
        if frozen + p.numel() <= budget + 0.5:
            p.requires_grad_(False)
            frozen += p.numel()
    return total - frozen


def check_beside_fsdp2(flag: str, value: int, strategy: str, options: PlanOptions | None,
                       step: str, across: str) -> None:
    """What a step beside FSDP2 (``--tp``, ``--cp``) plans: FSDP2's full_shard or shard_grad_op
    ``across`` its groups, with accumulation and ``--param-dtype`` only; anything else is refused
    in one line naming ``flag``."""
    if strategy not in ("full_shard", "shard_grad_op"):
        raise bad_value("--strategy", strategy, f"full_shard or shard_grad_op with {flag} (FSDP2 "
                        f"{across})")
    if options is not None and (options.offload or options.frozen
                                or options.reshard_after_forward is not None):
        raise bad_value(flag, value, "1 with --offload, --trainable, --lora-rank or "
                        f"--reshard-after-forward (the {step} plans accumulation and "
                        "--param-dtype only)")


def apply_to_model(model: nn.Module, blocks: list[nn.Module], o: PlanOptions) -> None:
    """What the options do to the model before it is sharded: bf16 storage, freezing, adapters."""
    if o.param_dtype == "bf16":
        model.to(torch.bfloat16)
    if o.lora_rank is not None:
        add_lora(model, blocks, o.lora_rank)
    elif o.trainable is not None and o.trainable < 1:
        freeze_fraction(model, blocks, o.trainable)


def policy_name(precision: str, o: PlanOptions) -> str:
    """The ``utilities.precision`` policy FSDP2 gets for ``precision`` with ``o.reduce_dtype``:
    bf16 with an fp32 reduction is ``bf16-fp32-reduce``."""
    return "bf16-fp32-reduce" if precision == "bf16" and o.reduce_dtype == "fp32" else precision


def reduce_item(precision: str, o: PlanOptions | None) -> int:
    """Bytes per gradient element in the reduce-scatter: 4 in fp32 (``--precision fp32`` or
    ``--reduce-dtype fp32``), else 2."""
    return 4 if precision == "fp32" or (o is not None and o.reduce_dtype == "fp32") else 2


def shard_kwargs(o: PlanOptions, strategy: str) -> dict[str, Any]:
    """``fully_shard``'s ``reshard_after_forward`` (offload is planned by arithmetic on the trace:
    on a machine without a GPU, host and device are the same memory)."""
    r = o.reshard_after_forward
    kw: dict[str, Any] = {"reshard_after_forward": strategy != "shard_grad_op" if r is None else r}
    return kw


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def accumulate(model: nn.Module, batch: dict, o: PlanOptions, micro_batches: int,
               between: Any = None) -> None:
    """Forward and backward of ``micro_batches`` micro-batches as ``o.accum_sync`` says: gradient
    sync only on the last (``last``; FSDP2 ``set_requires_gradient_sync``) or on each (``every``)."""
    for i in range(micro_batches):
        last = i == micro_batches - 1
        if i and between is not None:
            between()  # FSDPMemTracker follows one forward per module: reset_mod_stats
        if o.accum_sync == "last" and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)
        step_loss(model, batch).backward()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(True)


def step_loss(model: nn.Module, batch) -> Any:
    """The step's loss: ``batch(model)`` for a batch function's (``--batch-fn``), else the model's
    forward on the batch, Hugging Face's way (the loss itself, or an output with ``.loss``)."""
    if callable(batch):
        return batch(model)
    out = model(**batch)
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        from utilities.measure.user_code import FORWARD_CONVENTION

        raise UsageError(f"--model {type(model).__name__} is not allowed: its forward returned "
                         f"{type(out).__name__}, neither the loss nor an output with .loss; "
                         f"allowed: {FORWARD_CONVENTION}")
    return loss


def traced_micro_batches(o: PlanOptions) -> int:
    """Micro-batches a trace runs: two stand for N >= 2 (the second's forward holds what the
    earlier ones left: sharded gradients under ``every``, unsharded ones under ``last``)."""
    return 1 if o.grad_accum == 1 else 2
