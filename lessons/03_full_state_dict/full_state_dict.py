"""Lesson 03: full state dict save and load.

A full state dict is the sharded model gathered back into ordinary whole tensors, on rank 0's CPU,
in one file: readable by any world size, by FSDP1 or FSDP2, and (exported) by plain transformers.

For each variant this script trains a few steps, saves model + optimizer + step as one full
checkpoint, loads it into a freshly built and sharded model and a fresh optimizer, and checks:

    outputs      the loaded model's logits equal the trained model's (max abs diff)
    next step    one more training step gives the same loss and the same updated weights, so the
                 optimizer state (AdamW moments and step count) came back too
    HF export    transformers' from_pretrained on the exported folder gives the same logits

    fsdp2          fully_shard + torch.distributed.checkpoint.state_dict (get/set_state_dict)
    fsdp1          FullyShardedDataParallel + the same get/set_state_dict
    fsdp1-classic  FullyShardedDataParallel + FullStateDictConfig(offload_to_cpu, rank0_only)

Run: fsdp-course run 03 [--quick]   or   torchrun --nproc-per-node 2 full_state_dict.py --device cpu
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# cuBLAS reads this once, when its first handle is made: see deterministic_kernels() below.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

import torch
import torch.distributed as dist

from utilities.course.lesson import Lesson, lesson_parser
from utilities.distributed import reduce_scalar
from utilities.measure import fmt_bytes
from utilities.models import META_INIT_THRESHOLD
from utilities.state_dict import export_hf, gather_full, load_full, save_full
from utilities.training import sync
from utilities.wrapping import shard_model

VARIANTS = {
    # name: (api, how the full state dict is gathered for saving)
    "fsdp2": ("fsdp2", "dcp"),
    "fsdp1": ("fsdp1", "dcp"),
    "fsdp1-classic": ("fsdp1", "fsdp1-classic"),
}


def parse_args(argv=None):
    p = lesson_parser(__doc__)
    p.add_variants(VARIANTS)
    p.add_argument("--checkpoint-dir", default=None,
                   help="where checkpoints and HF exports go (default: OUT/checkpoints)")
    p.add_argument("--no-export", action="store_true", help="skip the Hugging Face export check")
    return p.parse(argv)


def max_over_ranks(value: float, device: torch.device) -> float:
    return reduce_scalar(value, "max", device)  # a save ends when its slowest rank ends


def deterministic_kernels(device: torch.device) -> bool:
    """Make GPU kernels bitwise reproducible, so "identical" can mean identical.

    On a CPU the same computation gives the same bits every time. On a GPU some kernels do not:
    an embedding's backward adds rows with atomics in whatever order the threads finish, and cuBLAS
    may split a reduction differently; float addition is not associative, so two runs of the same
    step can differ in the last bits. Deterministic mode picks order-fixed kernels (slower), and
    cuBLAS needs a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when its first handle is
    made: set at import, below).
    """
    if device.type != "cuda":
        return False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    return True


@torch.no_grad()
def logits(model, batch) -> torch.Tensor:
    return model(**batch).logits.float().cpu()


def main(args) -> None:
    with Lesson("03", args) as L:
        L.results.data["settings"]["deterministic_kernels"] = deterministic_kernels(L.device)
        block = L.spec.block_class()
        ckpt_dir = Path(args.checkpoint_dir or L.out / "checkpoints")
        probe = next(L.data(seed_offset=1000))  # a fixed batch, never trained on, for comparisons

        for name in args.variants:
            with L.variant(name):  # everything the variant made is freed before the next one
                api, how = VARIANTS[name]

                # 1. train, then save a full checkpoint
                model = L.materialize(shard_model(L.build_model(), api=api, block_class=block,
                                                  policy="block", device=L.device))
                optim = L.optimizer(model)
                stats = L.train(model, name, optimizer=optim, measure_memory=False)
                path = ckpt_dir / f"{name}.pt"
                sync(L.device)
                t0 = time.perf_counter()
                nbytes = save_full(path, model, optim, step=L.steps, how=how,
                                   extra={"model": L.spec.name, "api": api})
                save_s = max_over_ranks(time.perf_counter() - t0, L.device)
                reference = logits(model, probe)

                # 2. a fresh sharded model (other random weights) and a fresh optimizer, then load
                fresh, fresh_optim = build_fresh(L, api, block)
                before_load = max_over_ranks((logits(fresh, probe) - reference).abs().max().item(),
                                             L.device)
                sync(L.device)
                t0 = time.perf_counter()
                step = load_full(path, fresh, fresh_optim)
                sync(L.device)
                load_s = max_over_ranks(time.perf_counter() - t0, L.device)
                out_diff = max_over_ranks((logits(fresh, probe) - reference).abs().max().item(), L.device)

                # 3. the next optimizer step must be the same: same loss, same updated weights
                batch = next(L.data(seed_offset=2000))
                loss_a = train_step(model, optim, batch)
                loss_b = train_step(fresh, fresh_optim, batch)
                after_diff = max_over_ranks((logits(model, probe) - logits(fresh, probe)).abs().max()
                                            .item(), L.device)
                loss_diff = max_over_ranks(abs(loss_a - loss_b), L.device)

                # 4. export for transformers and reload with from_pretrained (rank 0)
                hf = {}
                if not args.no_export:
                    msd, _ = gather_full(fresh, None, how)  # the weights after the next step
                    after = logits(fresh, probe)
                    if L.dist.is_main:
                        hf = check_export(msd, L, ckpt_dir / f"{name}-hf", probe, after)
                    dist.barrier()

                ok = out_diff == 0.0 and loss_diff == 0.0 and after_diff == 0.0
                L.results.add(name, stats, api=api, saved_with=how, checkpoint_bytes=nbytes,
                              save_s=round(save_s, 4), load_s=round(load_s, 4), loaded_step=step,
                              diff_before_load=before_load, outputs_max_abs_diff=out_diff,
                              outputs_identical=out_diff == 0.0, next_loss_a=loss_a, next_loss_b=loss_b,
                              next_step_loss_diff=loss_diff, after_step_max_abs_diff=after_diff,
                              next_step_identical=loss_diff == 0.0 and after_diff == 0.0,
                              checkpoint=str(path), **hf)
                L.print(f"    {name}: saved {fmt_bytes(nbytes)} in {save_s:.3f}s, loaded in "
                        f"{load_s:.3f}s (step {step}); outputs diff {out_diff:g} (fresh model: "
                        f"{before_load:.3g}), next step loss {loss_a:.6f} vs {loss_b:.6f}, "
                        f"weights after diff {after_diff:g}" +
                        (f", HF export diff {hf['hf_max_abs_diff']:g}" if hf else "") +
                        ("" if ok else "  <-- NOT IDENTICAL"))
                del model, optim, fresh, fresh_optim

        L.results.note("checkpoint_bytes: model + AdamW state + step in one torch.save file, "
                       "written by rank 0 only (the other ranks hold nothing).")
        if L.device.type == "cpu":
            L.results.note("On CPU, nothing is offloaded (offload_to_cpu / cpu_offload=False): for "
                           "an FSDP1 model already on CPU, offloading returns views of freed "
                           "gather buffers in torch 2.13.")
            L.results.note("CPU run with gloo: save/load times are small and only indicative; on "
                           "GPUs the gather and the device-to-host copies dominate.")


def build_fresh(L, api, block):
    """A model built from other random weights than the trained one, sharded the same way."""
    torch.manual_seed(L.args.seed + 12345)
    big = L.spec.num_parameters > META_INIT_THRESHOLD
    model = L.spec.build(device="meta" if big else L.device)
    model = shard_model(model, api=api, block_class=block, policy="block", device=L.device)
    model = L.materialize(model)
    return model, L.optimizer(model)


def train_step(model, optimizer, batch) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def check_export(msd, L, directory, probe, expected):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    t0 = time.perf_counter()
    export_hf(msd, L.spec.config(), directory)
    export_s = time.perf_counter() - t0
    auto = AutoModelForSeq2SeqLM if L.spec.is_seq2seq else AutoModelForCausalLM
    hf_model = auto.from_pretrained(directory).to(L.device).eval()
    got = logits(hf_model, probe)
    diff = (got - expected).abs().max().item()
    size = sum(f.stat().st_size for f in Path(directory).iterdir() if f.is_file())
    return dict(hf_export_s=round(export_s, 4), hf_export_bytes=size, hf_max_abs_diff=diff,
                hf_identical=diff == 0.0, hf_dir=str(directory))


if __name__ == "__main__":
    main(parse_args())
