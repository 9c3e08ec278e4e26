"""Time model check: utilities.measure.step_time's predicted tokens/s per GPU vs published figures.

The rows are the throughput figures of ../shared/reference/anchors.md (torchtitan's Llama 3.1 8B on
8 H100s, torchtitan PR 165's Llama 7B, torchao's Float8 table, accelerate's FP8 example) and the
course's own one-H100 measurements (benchmarks/results/gpu/2026-11-22-h100: the plain llama-1b loop and
lesson 10's FSDP2 runs). Each row says which settings the source states and which are assumed.

The model has one set of efficiencies (``step_time.CALIBRATED``). ``--fit`` searches them
(coordinate descent on a grid, least squares of log(predicted / published)) on the rows whose
role is "fit" only, prints them and records them; the held-out rows are never used to tune. The
fit rows are the course's own measurements on one H100 (three plain-loop rows, lesson 10's
FSDP2 eager row) and torchao's Float8 row (the only source of an FP8 efficiency); every
torchtitan row is held out. The
result file has, per row, the prediction, the published figure, their ratio and the role, and the
mean absolute error of the fit rows and of the held-out rows. No GPU is needed: the model traces
each configuration on fake tensors (one trace per model/batch/sequence/AC, about 5 s each).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from utilities.measure import step_time as st  # noqa: E402
from utilities.models import ModelSpec, _llama  # noqa: E402
from utilities.text import HelpFormatter  # noqa: E402

NAME = "time_model_check"
OUT = REPO / "benchmarks" / "results" / f"{NAME}.json"
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
EVIDENCE = "course benchmarks/results/gpu/2026-11-22-h100"


class _OffCatalogueSpec(ModelSpec):
    """A model the course's catalogue does not have (its parameter count from a meta build)."""

    @property
    def num_parameters(self) -> int:
        return _meta_count(self)


def _meta_count(spec) -> int:
    model = spec.build(device="meta")
    return sum(p.numel() for p in model.parameters())


# Llama 2 7B (torchtitan PR 165's "Llama 7B"): hidden 4096, FFN 11008, 32 layers, 32 heads (no
# GQA), 32,000-token vocabulary.
LLAMA2_7B = _OffCatalogueSpec("llama2-7b", "llama", block_class_name="LlamaDecoderLayer",
                              default_seq_len=4096, **_llama(4096, 11008, 32, 32, 32, vocab=32000))

TITAN_8B = dict(model="llama-8b", gpus=8, gpu="h100-96gb", strategy="full_shard", precision="bf16",
                ac="selective", batch=2, seq=8192)
COURSE_1B = dict(model="llama-1b", gpus=1, gpu="h100", precision="bf16", seq=2048)

ROWS = [
    dict(id="course-plain-eager-b4", role="fit", source=EVIDENCE + " (README: plain loop)",
         published=39978, config=dict(COURSE_1B, strategy="no_shard", ac="none", batch=4),
         notes="plain one-GPU loop, no FSDP: modelled as no_shard on 1 GPU"),
    dict(id="course-plain-compile-b8", role="fit", source=EVIDENCE + " (README: plain loop)",
         published=58144, config=dict(COURSE_1B, strategy="no_shard", ac="none", batch=8,
                                      compile=True),
         notes="torch.compile per decoder block"),
    dict(id="course-plain-compile-b4", role="fit", source=EVIDENCE + " (README: plain loop)",
         published=54012, config=dict(COURSE_1B, strategy="no_shard", ac="none", batch=4,
                                      compile=True)),
    dict(id="course-fsdp2-eager-b4", role="fit", source=EVIDENCE + "/end_to_end-h100.json",
         published=34977, config=dict(COURSE_1B, strategy="full_shard", ac="none", batch=4),
         notes="lesson 10, FSDP2 on one GPU (its copies, no communication)"),
    dict(id="course-fsdp2-compile-b4", role="held_out", source=EVIDENCE + "/end_to_end-h100.json",
         published=43092, config=dict(COURSE_1B, strategy="full_shard", ac="none", batch=4,
                                      compile=True)),
    dict(id="course-fsdp2-compile-selective-b4", role="held_out",
         source=EVIDENCE + "/end_to_end-h100.json", published=41848,
         config=dict(COURSE_1B, strategy="full_shard", ac="every-2nd-block", batch=4, compile=True),
         notes="lesson 10's selective is block-level (--ac-every 2)"),
    dict(id="torchtitan-8b-fsdp2", role="held_out", source=TITAN, published=5762, config=TITAN_8B,
         notes="torchtitan's selective AC is op-level, as the planner's 'selective'"),
    dict(id="torchtitan-8b-fsdp2-compile", role="held_out", source=TITAN, published=6667,
         config=dict(TITAN_8B, compile=True)),
    dict(id="torchtitan-8b-fsdp2-compile-fp8", role="held_out", source=TITAN, published=8532,
         config=dict(TITAN_8B, compile=True, fp8=True)),
    dict(id="torchtitan-pr165-7b-compile-selective", role="held_out",
         source="torchtitan PR 165 (anchors.md)", published=8250, published_range=[8100, 8400],
         config=dict(model="llama2-7b", gpus=8, gpu="h100-96gb", strategy="full_shard",
                     precision="bf16", ac="selective", batch=8, seq=2048, compile=True),
         notes="GPU part not stated: assumed torchtitan's 96 GB hosts; range midpoint"),
    dict(id="torchtitan-pr165-7b-compile-noac", role="held_out",
         source="torchtitan PR 165 (anchors.md)", published=9200, published_range=[9100, 9300],
         config=dict(model="llama2-7b", gpus=8, gpu="h100-96gb", strategy="full_shard",
                     precision="bf16", ac="none", batch=8, seq=2048, compile=True),
         notes="GPU part not stated: assumed torchtitan's 96 GB hosts; range midpoint"),
    dict(id="torchao-8b-bf16", role="held_out", source="pytorch/ao torchao/float8/README.md",
         published=6150, config=dict(TITAN_8B, batch=1, compile=True),
         notes="batch and AC not in anchors.md: assumed batch 1, selective AC, torchtitan's hosts"),
    dict(id="torchao-8b-fp8", role="fit", source="pytorch/ao torchao/float8/README.md",
         published=7689, config=dict(TITAN_8B, batch=1, compile=True, fp8=True),
         notes="tensorwise scaling with FP8 all-gather; batch and AC assumed as the bf16 row"),
    dict(id="accelerate-8b-bf16", role="held_out", source="accelerate FSDP2 + torchao example",
         published=8000, loose=True,
         config=dict(model="llama-8b", gpus=8, gpu="h100", strategy="full_shard",
                     precision="bf16", ac="none", batch=1, seq=8192, compile=False),
         notes="'~8,000': batch, AC and compile not stated (assumed 1, none, eager); H100 SXM"),
    dict(id="accelerate-8b-fp8", role="held_out", source="accelerate FSDP2 + torchao example",
         published=10000, loose=True,
         config=dict(model="llama-8b", gpus=8, gpu="h100", strategy="full_shard",
                     precision="bf16", ac="none", batch=1, seq=8192, compile=False, fp8=True),
         notes="'~10,000': as the bf16 row"),
]

FIT_FIELDS = {"matmul": (0.40, 0.95), "memory": (0.30, 0.95), "compile_memory": (0.10, 1.0),
              "fp8_matmul": (0.20, 0.90), "kernel_floor_s": (1e-6, 20e-6),
              "unit_overhead_s": (0.0, 2e-3)}


def _model(name: str):
    return LLAMA2_7B if name == "llama2-7b" else name


def predict(row: dict, eff: st.Efficiencies) -> st.StepTime:
    cfg = dict(row["config"])
    model = _model(cfg.pop("model"))
    return st.estimate_step_time(model, efficiencies=eff, **cfg)


def _loss(rows, eff) -> float:
    return sum(math.log(predict(r, eff).tokens_per_s_per_gpu / r["published"]) ** 2 for r in rows)


def fit(rows: list[dict], start: st.Efficiencies, rounds: int = 4) -> st.Efficiencies:
    """Coordinate descent: each field over its range on a grid that narrows each round."""
    eff = start
    span = {k: hi - lo for k, (lo, hi) in FIT_FIELDS.items()}
    for _ in range(rounds):
        for name, (lo, hi) in FIT_FIELDS.items():
            centre = getattr(eff, name)
            grid = [min(hi, max(lo, centre + span[name] * (i / 10 - 0.5))) for i in range(11)]
            best = min(grid, key=lambda v: _loss(rows, st.with_efficiencies(eff, **{name: v})))
            eff = st.with_efficiencies(eff, **{name: float(f"{best:.3g}")})
            span[name] /= 2
    return eff


def check(eff: st.Efficiencies) -> list[dict]:
    out = []
    for r in ROWS:
        t = predict(r, eff)
        out.append(dict(
            id=r["id"], role=r["role"], source=r["source"], config=r["config"],
            published_tokens_per_s_per_gpu=r["published"],
            published_range=r.get("published_range"), loose=r.get("loose", False),
            predicted_tokens_per_s_per_gpu=round(t.tokens_per_s_per_gpu, 1),
            ratio=round(t.tokens_per_s_per_gpu / r["published"], 4),
            predicted_mfu=round(t.mfu, 4), predicted_step_s=round(t.step_s, 4),
            exposed_comm_s=round(t.exposed_comm_s, 4), notes=r.get("notes", "")))
    return out


def summary(rows: list[dict]) -> dict:
    def err(sel):
        errs = [abs(r["ratio"] - 1) for r in sel]
        return {"rows": len(errs), "mean_abs_error": round(sum(errs) / len(errs), 4) if errs else None,
                "max_abs_error": round(max(errs), 4) if errs else None}

    return {"fit": err([r for r in rows if r["role"] == "fit"]),
            "held_out": err([r for r in rows if r["role"] == "held_out"]),
            "held_out_not_loose": err([r for r in rows if r["role"] == "held_out" and not r["loose"]])}


READMES = (REPO / "benchmarks" / "README.md", REPO / "lessons" / "14_memory_planner" / "README.md")
README_BLOCK = re.compile(r"(<!-- time-model:start -->\n)(.*?)(<!-- time-model:end -->)", re.S)


def render(data: dict) -> str:
    """The README's table and error summary, from a result file: never typed by hand."""
    def published(r: dict) -> str:
        low_high = r.get("published_range")
        text = f"{low_high[0]:,}-{low_high[1]:,}" if low_high else f"{r['published_tokens_per_s_per_gpu']:,}"
        return text + (" (loose)" if r.get("loose") else "")

    lines = [f"_Rendered from `results/time_model_check.json` ({data['date'][:10]}, torch "
             f"{data['torch']}) by `python benchmarks/time_model_check.py`; tokens/s per GPU._", "",
             "| row | role | predicted | published | ratio |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['id']} | {r['role'].replace('_', ' ')} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {published(r)} | {r['ratio']:.2f} |")
    s = data["summary"]
    lines += ["", f"Mean absolute error: fit rows {s['fit']['mean_abs_error']:.1%}, held-out rows "
                  f"{s['held_out']['mean_abs_error']:.1%} (largest {s['held_out']['max_abs_error']:.0%}; "
                  f"{s['held_out_not_loose']['mean_abs_error']:.1%} without the loose rows)."]
    return "\n".join(lines) + "\n"


def write_readmes(data: dict, readmes: tuple[Path, ...] = READMES) -> list[Path]:
    """Re-render the marked block of each README (the benchmarks', lesson 14's); those changed."""
    changed = []
    for readme in readmes:
        text = readme.read_text()
        new = README_BLOCK.sub(lambda m: m.group(1) + render(data) + m.group(3), text)
        if new != text:
            readme.write_text(new)
            changed.append(readme)
    return changed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--fit", action="store_true",
                   help="search the efficiencies on the 'fit' rows (from step_time.CALIBRATED) and "
                        "check with the result instead of CALIBRATED")
    p.add_argument("--fit-rows", nargs="+", default=None, metavar="ID",
                   help="with --fit: the rows to fit on (default: those whose role is 'fit'); the "
                        "others are held out")
    p.add_argument("--out", default=str(OUT), help=f"result file (default {OUT.relative_to(REPO)})")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    eff = st.CALIBRATED
    fitted = None
    if args.fit_rows:
        unknown = set(args.fit_rows) - {r["id"] for r in ROWS}
        if unknown:
            raise SystemExit(f"unknown rows: {sorted(unknown)}")
        for r in ROWS:
            r["role"] = "fit" if r["id"] in args.fit_rows else "held_out"
    if args.fit:
        eff = fitted = fit([r for r in ROWS if r["role"] == "fit"], st.CALIBRATED)
        print("fitted:", {k: getattr(eff, k) for k in FIT_FIELDS})
    rows = check(eff)
    result = {
        "benchmark": NAME, "device": "cpu", "device_name": "none (a model, no GPU)",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tiny": False, "settings": {"fit": args.fit},
        "efficiencies": {k: v for k, v in vars(eff).items() if k != "sources"},
        "efficiency_sources": st.CALIBRATED.sources,
        "fitted_here": fitted is not None,
        "fit_rows": [r["id"] for r in ROWS if r["role"] == "fit"],
        "held_out_rows": [r["id"] for r in ROWS if r["role"] == "held_out"],
        "rows": rows, "summary": summary(rows),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"{'row':<40}{'role':>9}{'predicted':>11}{'published':>11}{'ratio':>8}")
    for r in rows:
        print(f"{r['id'][:40]:<40}{r['role']:>9}{r['predicted_tokens_per_s_per_gpu']:>11,.0f}"
              f"{r['published_tokens_per_s_per_gpu']:>11,}{r['ratio']:>8.3f}")
    print(json.dumps(result["summary"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {args.out}")
    if Path(args.out).resolve() == OUT.resolve():
        for readme in write_readmes(result):
            print(f"{readme.relative_to(REPO)}: time model table re-rendered")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
