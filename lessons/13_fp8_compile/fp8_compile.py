"""Lesson 13: FP8 training with torch.compile.

FP8 (float8) matmuls run twice as fast as bf16 on Hopper / Ada tensor cores, and an FSDP2 all-gather
of float8 weights moves half the bytes. torchao's Float8Linear does the scaling: per tensor, it
measures the absolute maximum (amax), scales into float8's narrow range, multiplies in float8 and
rescales the result. That scaling is many small elementwise kernels, so FP8 only pays *compiled*
(inductor fuses them) and only on matmuls *large enough* that the 2x GEMM speed beats the scaling
overhead: at hidden 4096 it pays, at hidden 1024 it barely does.

The order is: convert Linear -> Float8Linear, then fully_shard, then torch.compile (per block).

Variants, each trained on the same data from the same weights:

    eager          FSDP2, bf16 (CPU too), no compile                 the baseline
    compiled       the same, each transformer block torch.compile'd
    fp8-compiled   torchao Float8Linear (tensorwise, float8 all-gather) + compile: GPU sm_89+ only

With --hidden (and on a GPU by default: 1024, 2048 and 4096) the lesson builds one Llama per width
and names every variant <variant>-h<hidden> (compiled-h1024, fp8-compiled-h4096, ...). It then
reports where FP8 starts to pay: fp8_crossover_hidden in results.json is the smallest width from
which fp8-compiled has more tokens/s than compiled at that width and every wider one measured
(compile_crossover_hidden: the same for compiled over eager).

On CPU the lesson runs eager and compiled in bf16 (--precision fp32 makes them agree to ~1e-7)
and records why FP8 was skipped. Compile time is the first step, reported apart from the timed steps.

Run: fsdp-course run 13 [--quick]   or   fsdp-course run 13 -- --hidden 1024,2048,4096 (GPU)
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

# Compile in this process rather than in a pool of workers: two ranks on a small machine each
# forking a compile pool oversubscribe it (and were seen to abort once in five runs on 2 cores).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

from fp8_compile_run import (
    COMPILE_NOTE,
    GPU_LAYERS,
    GPU_WIDTHS,
    VARIANTS,
    hidden_list,
    run_settings,
    run_variants,
    takeaway,
)
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from utilities.activation_checkpointing import apply_op_selective_checkpointing, block_units
from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import world_mesh
from utilities.fp8 import float8_module_filter, fp8_linear_names
from utilities.measure.predictions import add_prediction_arguments, predict_from_arguments
from utilities.models import get_model_spec


# -- the code this lesson teaches: convert -> shard -> compile, in that order ---------------------
def convert_to_fp8(model: nn.Module) -> list[str]:
    """1. Swap the filtered nn.Linear layers for torchao's Float8Linear, *before* fully_shard (it
    must see plain Linears, not DTensor parameters). Tensorwise scaling with float8 all-gather:
    FSDP2 casts each shard to float8 before gathering it, half the bytes of bf16. Needs torchao
    (optional) and an sm_89+ GPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    keep = float8_module_filter()  # dims multiples of 16; never lm_head or embeddings
    names = fp8_linear_names(model, keep)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=keep)
    return names


def shard(model: nn.Module, block_class: type[nn.Module], mp_policy: MixedPrecisionPolicy) -> None:
    """2. FSDP2: each transformer block one unit (its checkpoint wrapper, where it has one), the
    root takes what is left."""
    mesh = world_mesh()  # every rank, on this run's device (not the machine's accelerator)
    for module in block_units(model, block_class):
        fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def checkpoint_and_shard(model: nn.Module, block_class: type[nn.Module],
                         mp_policy: MixedPrecisionPolicy) -> None:
    """torchtitan's published Llama 3.1 8B run, which the cluster prediction holds the variants
    against: op-level selective checkpointing of every block (keep the matmul and attention
    outputs, recompute the rest), then 2."""
    apply_op_selective_checkpointing(model, block_class)
    shard(model, block_class, mp_policy)


def compile_blocks(model: nn.Module, block_class: type[nn.Module], backend: str = "inductor") -> int:
    """3. torch.compile each block in place, last, over the finished modules (torchtitan's way).
    Identical blocks share one compiled graph (compile time does not grow with depth); FSDP2's
    all-gather and reduce-scatter hooks stay at the block boundaries, outside the graphs; and
    Module.compile keeps parameter names (no "_orig_mod."), so checkpoints load either way."""
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    for block in blocks:
        block.compile(backend=backend, dynamic=False)
    return len(blocks)


def parallelize(model: nn.Module, variant: str, block_class: type[nn.Module],
                mp_policy: MixedPrecisionPolicy, backend: str) -> dict[str, int]:
    """The three steps for one variant; returns what was converted and compiled."""
    done = {}
    if variant == "fp8-compiled":
        done["fp8_linears"] = len(convert_to_fp8(model))
    shard(model, block_class, mp_policy)
    if variant != "eager":
        done["compiled_blocks"] = compile_blocks(model, block_class, backend)
    return done


def precompute_fp8_scales(model: nn.Module) -> None:
    """After optimizer.step(): every float8 weight's scale in one fused amax, not one per layer
    (an optimization only: a torchao without it computes each scale at its all-gather)."""
    try:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    except ImportError:
        return
    precompute_float8_dynamic_scale_for_fsdp(model)


# -- the lesson run: the variants (fp8_compile_run.py), and the prediction on a cluster -------
def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    add_prediction_arguments(p, "llama-8b", 2, cluster="1x8xh100-96gb")
    p.add_argument("--hidden", type=hidden_list, default=None,
                   help="model width(s) to compare, e.g. 1024,4096 (a Llama block per width; "
                        f"default: {','.join(map(str, GPU_WIDTHS))} on GPU, the tiny model on CPU)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"transformer blocks for --hidden models (default {GPU_LAYERS})")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="FSDP2 compute dtype: auto = bf16 (on CPU too; fp32 on a GPU without "
                        "native bf16); fp32 makes compiled and eager agree to ~1e-7")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled variants (default inductor, the one "
                        "that fuses; aot_eager captures the same graphs without generating kernels: "
                        "for debugging, and for the CPU tests)")
    args = p.parse(argv)
    if args.layers is not None and args.layers < 1:
        p.exit(2, f"error: --layers {args.layers} is not allowed; allowed: integers >= 1\n")
    if args.model is None:
        args.model = "llama-tiny"  # decoder-only: the Llama block is what torchao and torchtitan use
    return args


# torchtitan's published Llama 3.1 8B run (8 x H100 96GB, batch 2 x 8192, op-level selective AC):
# the lesson's variants predicted where published numbers exist to hold them against. Each traces
# checkpoint_and_shard; compile and Float8 are the time model's kernel factors (compile_blocks and
# convert_to_fp8 need inductor and torchao on a GPU, not fake tensors)
PREDICTED_KNOBS = {"eager": {}, "compiled": dict(compile=True), "fp8-compiled": dict(compile=True, fp8=True)}
PREDICTED_SEQ, PREDICTED_AC = 8192, "selective"


def prediction(args) -> dict | None:
    """The variants predicted on ``--predict-on`` (``predict_from_arguments``: rank 0, before the
    process group), each traced through ``checkpoint_and_shard``."""
    if args.predict_on == "none":
        return None
    own = functools.partial(checkpoint_and_shard,
                            block_class=get_model_spec(args.predict_model).block_class())
    return predict_from_arguments(args, {n: {**PREDICTED_KNOBS[n], "parallelize": own}
                                         for n in args.variants}, ac=PREDICTED_AC, seq=PREDICTED_SEQ)


def main(args) -> None:
    predicted = prediction(args)
    run = run_settings(args)
    with Lesson("13", args, settings=dict(precision=run.precision, widths=run.widths,
                                          compile_backend=args.compile_backend),
                notes=(COMPILE_NOTE,), cpu_note=run.cpu_note, takeaway=takeaway) as lesson:
        run_variants(lesson, run, SimpleNamespace(**globals()))  # the functions above, for the driver
        lesson.results.predicted(predicted)


if __name__ == "__main__":
    main(parse_args())
