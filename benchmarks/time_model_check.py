"""Time model check: utilities.measure.step_time's predicted tokens/s per GPU vs published runs.

Every row, its source, its setup (confirmed in the source), its role and the matched pairs that
make an effect (eager vs compiled, bf16 vs Float8 of the same run) are data, in one file:
``benchmarks/time_model_rows.json``. ``--fit`` searches the fitted efficiencies from the file's
fixed starting values (coordinate descent on a grid, least squares of log(predicted / published)
over the fit rows, plus 4 x log(predicted effect / published effect) over the pairs whose two
rows are both fit rows) and reads the rows whose role is "fit" and nothing else: the held-out
rows are predicted afterwards, with whatever the fit gave, and reported as they come out.
``gpu_catalogue.CALIBRATED`` holds what ``--fit`` prints (a test checks they agree). Without
``--fit`` the check predicts every row with ``CALIBRATED``. No GPU is needed: the model traces
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

from utilities.measure import gpu_catalogue  # noqa: E402
from utilities.measure import step_time as st  # noqa: E402
from utilities.models import ModelSpec, llama_shapes  # noqa: E402
from utilities.text import HelpFormatter  # noqa: E402

NAME = "time_model_check"
OUT = REPO / "benchmarks" / "results" / f"{NAME}.json"
DATA = REPO / "benchmarks" / "time_model_rows.json"
PAIR_WEIGHT = 4.0


class _OffCatalogueSpec(ModelSpec):
    """A model the course's catalogue does not have (its parameter count from a meta build)."""

    @property
    def num_parameters(self) -> int:
        return _meta_count(self)


def _meta_count(spec) -> int:
    model = spec.build(device="meta")
    return sum(p.numel() for p in model.parameters())


# Llama 2 7B and 13B (torchtitan PR 165's "Llama 7B", fms-fsdp's 7b and 13b): no GQA, a
# 32,000-token vocabulary.
OFF_CATALOGUE = {
    "llama2-7b": _OffCatalogueSpec("llama2-7b", "llama", block_class_name="LlamaDecoderLayer",
                                   default_seq_len=4096,
                                   **llama_shapes(4096, 11008, 32, 32, 32, vocab=32000)),
    "llama2-13b": _OffCatalogueSpec("llama2-13b", "llama", block_class_name="LlamaDecoderLayer",
                                    default_seq_len=4096,
                                    **llama_shapes(5120, 13824, 40, 40, 40, vocab=32000)),
}
LLAMA2_7B = OFF_CATALOGUE["llama2-7b"]


def load_data(path: Path = DATA) -> dict:
    return json.loads(Path(path).read_text())


def _model(name: str):
    return OFF_CATALOGUE.get(name, name)


def predict(row: dict, eff: gpu_catalogue.Efficiencies) -> st.StepTime:
    cfg = dict(row["config"])
    model = _model(cfg.pop("model"))
    return st.estimate_step_time(model, efficiencies=eff, **cfg)


def efficiencies(params: dict[str, float],
                 base: gpu_catalogue.Efficiencies = gpu_catalogue.CALIBRATED) -> gpu_catalogue.Efficiencies:
    """``base`` with the fitted values in ``params`` in place: plain names are fields, "GPU.key"
    entries go to ``per_gpu`` (the fields that are not fitted, and the per-GPU entries that are
    not, stay as ``base`` states them with their sources)."""
    per_gpu = {k: dict(v) for k, v in base.per_gpu.items()}
    fields = {}
    for name, value in params.items():
        if "." in name:
            gpu, key = name.split(".", 1)
            per_gpu.setdefault(gpu, {})[key] = value
        else:
            fields[name] = value
    return gpu_catalogue.with_efficiencies(base, per_gpu=per_gpu, **fields)


def _rates(rows: list[dict], eff: gpu_catalogue.Efficiencies, predictor) -> dict[str, float]:
    return {r["id"]: predictor(r, eff).tokens_per_s_per_gpu for r in rows}


def _loss(rows, pairs, eff, predictor) -> float:
    rate = _rates(rows, eff, predictor)
    published = {r["id"]: r["published"] for r in rows}
    loss = sum(math.log(rate[i] / published[i]) ** 2 for i in rate)
    for p in pairs:
        want = published[p["variant"]] / published[p["base"]]
        loss += PAIR_WEIGHT * math.log(rate[p["variant"]] / rate[p["base"]] / want) ** 2
    return loss


def fit(rows: list[dict], pairs: list[dict], start: dict[str, float], ranges: dict[str, list[float]],
        rounds: int = 5, predictor=None) -> dict[str, float]:
    """Coordinate descent from ``start``: each parameter over its range on an 11-point grid that
    halves each round. ``rows`` are the fit rows (the only rows it reads); ``pairs`` whose two rows
    are among them add their effect's error."""
    predictor = predictor or predict
    ids = {r["id"] for r in rows}
    pairs = [p for p in pairs if p["base"] in ids and p["variant"] in ids]
    params = dict(start)
    span = {k: hi - lo for k, (lo, hi) in ranges.items()}
    for _ in range(rounds):
        for name, (lo, hi) in ranges.items():
            centre = params[name]
            grid = sorted({min(hi, max(lo, centre + span[name] * (i / 10 - 0.5))) for i in range(11)})
            best = min(grid, key=lambda v: _loss(rows, pairs, efficiencies({**params, name: v}), predictor))
            params[name] = float(f"{best:.3g}")
            span[name] /= 2
    return params


def fit_from_data(data: dict, rounds: int = 5, predictor=None) -> dict[str, float]:
    """The fit as ``--fit`` runs it: the data file's fit rows only, from its starting values."""
    fit_rows = [r for r in data["rows"] if r["role"] == "fit"]
    return fit(fit_rows, data["pairs"], data["fit_start"], data["fit_ranges"], rounds, predictor)


def check(rows: list[dict], eff: gpu_catalogue.Efficiencies) -> list[dict]:
    out = []
    for r in rows:
        t = predict(r, eff)
        out.append(dict(
            id=r["id"], role=r["role"], source=r["source"], setup=r["setup"], config=r["config"],
            published_tokens_per_s_per_gpu=r["published"],
            published_range=r.get("published_range"), loose=r.get("loose", False),
            predicted_tokens_per_s_per_gpu=round(t.tokens_per_s_per_gpu, 1),
            ratio=round(t.tokens_per_s_per_gpu / r["published"], 4),
            predicted_mfu=round(t.mfu, 4), predicted_step_s=round(t.step_s, 4),
            exposed_comm_s=round(t.exposed_comm_s, 4), notes=r.get("notes", "")))
    return out


def effects(rows: list[dict], pairs: list[dict]) -> list[dict]:
    """Each matched pair: the published and the predicted effect (variant / base)."""
    by_id = {r["id"]: r for r in rows}
    out = []
    for p in pairs:
        b, v = by_id[p["base"]], by_id[p["variant"]]
        published = v["published_tokens_per_s_per_gpu"] / b["published_tokens_per_s_per_gpu"]
        predicted = v["predicted_tokens_per_s_per_gpu"] / b["predicted_tokens_per_s_per_gpu"]
        role = "fit" if b["role"] == v["role"] == "fit" else "held_out"
        out.append(dict(effect=p["effect"], base=p["base"], variant=p["variant"], role=role,
                        published=round(published, 4), predicted=round(predicted, 4),
                        difference=round(predicted - published, 4)))
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
    """The README's tables and error summary, from a result file: never typed by hand."""
    def published(r: dict) -> str:
        low_high = r.get("published_range")
        text = f"{low_high[0]:,}-{low_high[1]:,}" if low_high else f"{r['published_tokens_per_s_per_gpu']:,}"
        return ("~" if r.get("loose") else "") + text

    lines = [f"_Rendered from `results/time_model_check.json` ({data['date'][:10]}, torch "
             f"{data['torch']}) by `python benchmarks/time_model_check.py`; tokens/s per GPU; rows, "
             "roles and sources from `benchmarks/time_model_rows.json`._", "",
             "| row | role | source | setup | predicted | published | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        setup = r["setup"] + (f" ({r['notes']})" if r.get("notes") else "")
        lines.append(f"| {r['id']} | {r['role'].replace('_', ' ')} | {r['source']} | {setup} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {published(r)} | {r['ratio']:.3f} |")
    lines += ["", "Effects, the same run with and without the knob (variant / base tokens/s):", "",
              "| effect | base -> variant | role | published | predicted | difference |",
              "|---|---|---|---|---|---|"]
    for e in data["effects"]:
        lines.append(f"| {e['effect']} | {e['base']} -> {e['variant']} | {e['role'].replace('_', ' ')} | "
                     f"{e['published']:.3f} | {e['predicted']:.3f} | {e['difference']:+.3f} |")
    s = data["summary"]
    fit, held = s["fit"], s["held_out"]
    lines += ["", f"Mean absolute error: fit rows {fit['mean_abs_error']:.1%} ({fit['rows']} rows), "
                  f"held-out rows {held['mean_abs_error']:.1%} ({held['rows']} rows, largest "
                  f"{s['held_out']['max_abs_error']:.1%}; {s['held_out_not_loose']['mean_abs_error']:.1%} "
                  "without the rows published as approximate, `~`)."]
    lines += ["", "Published runs the model cannot express:", ""]
    for r in data["not_expressible"]:
        lines.append(f"- {r['id']} ({r['source']}, {r['published']}): {r['why']}")
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
                   help="fit the efficiencies on the data file's 'fit' rows, from its fixed starting "
                        "values, print them and check every row with them instead of CALIBRATED")
    p.add_argument("--data", default=str(DATA), help=f"rows file (default {DATA.relative_to(REPO)})")
    p.add_argument("--out", default=str(OUT), help=f"result file (default {OUT.relative_to(REPO)})")
    return p.parse_args(argv)


def fitted_params(eff: gpu_catalogue.Efficiencies, names) -> dict[str, float]:
    """The values of the fitted parameters in ``eff`` (``GPU.key`` names from ``per_gpu``)."""
    out = {}
    for name in names:
        if "." in name:
            gpu, key = name.split(".", 1)
            out[name] = eff.per_gpu.get(gpu, {}).get(key)
        else:
            out[name] = getattr(eff, name)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    data = load_data(Path(args.data))
    eff = gpu_catalogue.CALIBRATED
    params = None
    if args.fit:
        params = fit_from_data(data)
        eff = efficiencies(params)
        print("fitted:", json.dumps(params))
    rows = check(data["rows"], eff)
    result = {
        "benchmark": NAME, "device": "cpu", "device_name": "none (a model, no GPU)",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tiny": False, "settings": {"fit": args.fit},
        "efficiencies": {k: v for k, v in vars(eff).items() if k not in ("sources", "per_gpu")},
        "per_gpu": eff.per_gpu,
        "fitted": fitted_params(eff, data["fit_ranges"]),
        "fit_start": data["fit_start"],
        "efficiency_sources": gpu_catalogue.CALIBRATED.sources,
        "fitted_here": params is not None,
        "fit_rows": [r["id"] for r in data["rows"] if r["role"] == "fit"],
        "held_out_rows": [r["id"] for r in data["rows"] if r["role"] == "held_out"],
        "rows": rows, "effects": effects(rows, data["pairs"]), "summary": summary(rows),
        "not_expressible": data["not_expressible"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"{'row':<40}{'role':>9}{'predicted':>11}{'published':>11}{'ratio':>8}")
    for r in rows:
        print(f"{r['id'][:40]:<40}{r['role']:>9}{r['predicted_tokens_per_s_per_gpu']:>11,.0f}"
              f"{r['published_tokens_per_s_per_gpu']:>11,}{r['ratio']:>8.3f}")
    for e in result["effects"]:
        print(f"{e['effect']:<8}{e['variant'][:40]:<41}{e['role']:>9} published {e['published']:.3f} "
              f"predicted {e['predicted']:.3f}")
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
