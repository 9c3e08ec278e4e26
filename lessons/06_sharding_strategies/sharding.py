"""Lesson 06's arithmetic: bytes per parameter, communication per step, the largest model.

Every strategy keeps the same three kinds of training state per parameter (fp32 + AdamW: 4 bytes of
parameter, 4 of gradient, 8 of optimizer state); they differ in how much of it each rank holds.
The formulas here are per rank, in bytes, for ``world`` ranks (``replicate`` x ``shard`` for
hybrid sharding); sharding_strategies.py checks them against what it measures, and ``capacity``
carries its measurements over to other GPU counts.

Strategy names (FSDP2 equivalent in brackets):

    ddp            DistributedDataParallel: every rank holds everything
    no_shard       FSDP1 NO_SHARD (deprecated; use DDP): the same memory as DDP
    full_shard     FSDP1 FULL_SHARD   [fully_shard(reshard_after_forward=True)]
    shard_grad_op  FSDP1 SHARD_GRAD_OP [fully_shard(reshard_after_forward=False)]
    hybrid_shard   FSDP1 HYBRID_SHARD [fully_shard(mesh=2-D (replicate, shard))]
    reshard_to     [fully_shard(reshard_after_forward=d)], d a non-trivial divisor of the world
"""

from __future__ import annotations

from dataclasses import dataclass

from utilities.errors import bad_value

STRATEGIES = ("ddp", "no_shard", "full_shard", "shard_grad_op", "hybrid_shard", "reshard_to")
PRECISIONS = {"fp32": 4, "bf16": 2}  # bytes per element of parameters, gradients, Adam moments
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each the size of the parameter


@dataclass(frozen=True)
class PerParam:
    """Bytes per model parameter held by one rank, by category."""

    parameters: float
    gradients: float
    optimizer: float
    unsharded_parameters: float  # full parameters kept alive from forward to backward, at most

    @property
    def resident(self) -> float:
        """Kept between steps: sharded (or replicated) parameters, gradients, optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        """At the peak of a step, not counting activations or the one or two units being gathered."""
        return self.resident + self.unsharded_parameters


def _check(strategy: str, world: int, precision: str, replicate: int, reshard_to: int | None):
    if strategy not in STRATEGIES:
        raise bad_value("strategy", strategy, STRATEGIES)
    if precision not in PRECISIONS:
        raise bad_value("precision", precision, PRECISIONS)
    if world < 1:
        raise bad_value("world", world, "integers >= 1")
    if strategy == "hybrid_shard" and (replicate < 1 or world % replicate):
        raise bad_value("replicate", replicate, f"divisors of the world size {world}")
    if strategy == "reshard_to":
        if reshard_to is None or not (1 < reshard_to < world and world % reshard_to == 0):
            raise bad_value("reshard_to", reshard_to,
                            f"non-trivial divisors of the world size {world} (not 1, not {world})")


def shard_group(strategy: str, world: int, replicate: int = 1) -> int:
    """How many ranks share one copy of the state (1 = every rank holds everything)."""
    if strategy in ("ddp", "no_shard"):
        return 1
    if strategy == "hybrid_shard":
        return world // replicate
    return world


def bytes_per_param(strategy: str, world: int, precision: str = "fp32", replicate: int = 1,
                    reshard_to: int | None = None) -> PerParam:
    """Bytes per parameter one rank holds for ``strategy`` on ``world`` ranks.

    Sharded state is divided by the shard group size S (world, or world / replicate for hybrid
    sharding). SHARD_GRAD_OP (reshard_after_forward=False) also keeps every unit's full parameters
    from its forward to its backward, so at the peak it holds a whole unsharded copy; an int
    ``reshard_to`` d keeps a 1/d copy instead.
    """
    _check(strategy, world, precision, replicate, reshard_to)
    b = PRECISIONS[precision]
    s = shard_group(strategy, world, replicate)
    unsharded = {"shard_grad_op": b, "reshard_to": b / (reshard_to or 1)}.get(strategy, 0.0)
    return PerParam(parameters=b / s, gradients=b / s, optimizer=ADAM_MOMENTS * b / s,
                    unsharded_parameters=unsharded)


def comm_bytes_per_step(strategy: str, world: int, num_params: int, precision: str = "fp32",
                        replicate: int = 1, reshard_to: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per training step (ring collectives), by collective.

    With Psi = parameter bytes of the model and N ranks in a collective, a ring all-gather or
    reduce-scatter sends Psi*(N-1)/N per rank and an all-reduce twice that:

        ddp, no_shard   all-reduce of gradients                      2 Psi (N-1)/N
        full_shard      all-gather fwd + all-gather bwd + reduce-scatter   3 Psi (N-1)/N
        shard_grad_op   all-gather fwd + reduce-scatter              2 Psi (N-1)/N
        reshard_to d    all-gather fwd (N) + all-gather bwd (d) + reduce-scatter (N)
        hybrid_shard    full_shard inside each shard group of S ranks, then an all-reduce
                        of the 1/S gradient shard across the R replicas: 2 (Psi/S)(R-1)/R
    """
    _check(strategy, world, precision, replicate, reshard_to)
    psi = float(num_params * PRECISIONS[precision])

    def ring(n: int) -> float:
        return psi * (n - 1) / n

    n = world
    if strategy in ("ddp", "no_shard"):
        return {"all_reduce": 2 * ring(n)}
    if strategy == "full_shard":
        return {"all_gather_forward": ring(n), "all_gather_backward": ring(n),
                "reduce_scatter": ring(n)}
    if strategy == "shard_grad_op":
        return {"all_gather_forward": ring(n), "all_gather_backward": 0.0,
                "reduce_scatter": ring(n)}
    if strategy == "reshard_to":
        d = reshard_to or n
        return {"all_gather_forward": ring(n), "all_gather_backward": psi * (d - 1) / d,
                "reduce_scatter": ring(n)}
    s = world // replicate
    r = replicate
    return {"all_gather_forward": ring(s), "all_gather_backward": ring(s),
            "reduce_scatter": ring(s), "all_reduce_replicas": 2 * (psi / s) * (r - 1) / r}


def largest_model(strategy: str, gpus: int, gpu_mem_bytes: float, activation_bytes: float = 0.0,
                  precision: str = "fp32", replicate: int = 1, reshard_to: int | None = None,
                  per_param: PerParam | None = None) -> int:
    """The largest parameter count whose training state fits on each of ``gpus`` GPUs.

    ``activation_bytes`` is reserved per GPU for activations and working buffers (all-gathered
    units, communication buckets); pass ``per_param`` to use measured bytes per parameter instead
    of the formula (it must have been measured at the same world size).
    """
    pp = per_param or bytes_per_param(strategy, gpus, precision, replicate, reshard_to)
    free = gpu_mem_bytes - activation_bytes
    return max(0, int(free // pp.total)) if pp.total > 0 else 0


def scale_measured(measured: PerParam, measured_world: int, strategy: str, world: int,
                   replicate: int = 1, measured_replicate: int = 1) -> PerParam:
    """Carry bytes per parameter measured on ``measured_world`` ranks over to ``world`` ranks.

    The sharded categories scale with 1 / shard group size; the unsharded copy does not.
    """
    s0 = shard_group(strategy, measured_world, measured_replicate)
    s1 = shard_group(strategy, world, replicate)
    f = s0 / s1
    return PerParam(measured.parameters * f, measured.gradients * f, measured.optimizer * f,
                    measured.unsharded_parameters)


# Which measured variant of lesson 06 stands for each strategy in the capacity chart (FSDP2 first).
CAPACITY_FROM = {"ddp": ("ddp", "fsdp1-no-shard"),
                 "shard_grad_op": ("fsdp2-reshard-false", "fsdp1-shard-grad-op"),
                 "full_shard": ("fsdp2-reshard-true", "fsdp1-full-shard"),
                 "hybrid_shard": ("fsdp2-hsdp", "fsdp1-hybrid-shard")}
CLASSIC_A10_8GPU = {"ddp": 750e6, "shard_grad_op": 2e9, "full_shard": 2.5e9}  # the classic series


def capacity(measured: dict[str, PerParam], world: int, replicate: int, gpus: int,
             gpu_mem_bytes: float, activation_bytes: float) -> dict:
    """The largest trainable model per strategy on 1 to 64 GPUs (and ``gpus``), from the bytes per
    parameter measured on ``world`` ranks (keyed by variant name), scaled to each GPU count.

    HSDP shards inside a node of up to 8 GPUs and replicates across nodes. The unsharded copy
    (SHARD_GRAD_OP) comes from the formula: the tiny model's peak also holds the one or two units
    being gathered, which a large model's does not.
    """
    node = min(gpus, 8)
    gpu_counts = sorted({1, 2, 4, 8, 16, 32, 64, gpus})
    curves: dict[str, list[int]] = {}
    at_gpus = []
    for strategy, sources in CAPACITY_FROM.items():
        src = next((s for s in sources if s in measured), None)
        curve = []
        for g in gpu_counts:
            rep = max(1, g // node) if g % node == 0 else 1
            pp = bytes_per_param(strategy, g, replicate=rep)
            if src is not None:
                scaled = scale_measured(measured[src], world, strategy, g, replicate=rep,
                                        measured_replicate=replicate)
                pp = PerParam(scaled.parameters, scaled.gradients, scaled.optimizer,
                              pp.unsharded_parameters)
            n_max = largest_model(strategy, g, gpu_mem_bytes, activation_bytes, per_param=pp)
            curve.append(n_max)
            if g == gpus:
                at_gpus.append({"strategy": strategy, "measured_from": src,
                                "bytes_per_param": pp.total, "largest_model": n_max})
        curves[strategy] = curve
    return {"gpus": gpus, "gpu_mem_bytes": gpu_mem_bytes, "activation_bytes": activation_bytes,
            "gpus_per_node_for_hsdp": node, "gpu_counts": gpu_counts, "largest_model": curves,
            "at_gpus": at_gpus, "classic_a10_8gpu": dict(CLASSIC_A10_8GPU)}
