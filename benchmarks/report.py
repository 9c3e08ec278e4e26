"""Regenerate the results table in benchmarks/README.md from benchmarks/results/*.json.

    python benchmarks/report.py [--results-dir DIR] [--readme PATH] [--print]

The table sits between the two marker comments in the README; everything else in the README is kept.
GPU rows are always present: filled from GPU result files (device "cuda") when there are any,
otherwise left empty with "not yet measured". CPU rows come from the --tiny runs and say so.
The published figures stand beside our rows (see /work/shared/reference/anchors.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NO_GPU, RESULTS_DIR  # noqa: E402
from end_to_end import ALL_CONFIGS as E2E_GPU_CONFIGS  # noqa: E402

HERE = Path(__file__).resolve().parent
START, END = "<!-- results:start -->", "<!-- results:end -->"
EMPTY = f"*{NO_GPU}*"
PUB_E2E = ("torchtitan, Llama 3.1 8B, 8x H100, FSDP2 + selective AC: MFU 33-39%; 5,762 tokens/s/GPU "
           "(+compile 6,667)")
PUB_LAYER = {("eager", 8): "TransformerEngine, H100: bf16 PyTorch baseline 48.28 ms",
             ("compile", 8): "TransformerEngine, H100: bf16 PyTorch baseline 48.28 ms",
             ("fp8", 8): "TransformerEngine, H100: TE layer + FP8 21.67 ms",
             ("fp8", 4): "TransformerEngine, H100: fp8 27.8 ms"}
PUB_MM = "classic lesson 05, 2B ViT: batch 16 (0 retries) +25% over batch 17 (9 retries)"
PUB_PLANNER = "PyTorch tests hold the mem trackers within 10% of the allocator's peak"


def mib(b) -> str:
    return "" if b is None else f"{b / 2**20:,.1f} MiB"


def load_all(directory: Path) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if "benchmark" in data:
            found.setdefault(data["benchmark"], []).append(data)
    return found


def where(data: dict) -> str:
    if data["device"] == "cpu":
        return f"CPU, tiny ({data['device_name']}, torch {data['torch']}, {data['date'][:10]})"
    return f"{data['device_name']} (torch {data['torch']}, {data['date'][:10]})"


def e2e_rows(files: list[dict]) -> list[list[str]]:
    rows = []
    gpu = [f for f in files if f["device"] == "cuda"]
    if not gpu:
        rows += [["end_to_end", f"llama-1b, seq 2048, bf16: {c}", "GPU", EMPTY, "", "", PUB_E2E]
                 for c in E2E_GPU_CONFIGS]
    for f in gpu + [f for f in files if f["device"] == "cpu"]:
        s = f["settings"]
        for r in f["runs"]:
            label = f"{s['model']}, seq {s['seq_len']}, {s['precision']}, {s['nproc']} ranks: {r['config']}"
            if r.get("status") != "ok":
                rows.append(["end_to_end", label, where(f), r.get("status", "failed"), "", "", ""])
                continue
            if r.get("peak_memory_method") == "census":
                label += " (peak: census of resident state, no activations)"
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a (CPU)" if f["device"] == "cpu" else ""
            lo, hi = r.get("step_time_min_s"), r.get("step_time_max_s")
            spread = f" (step {r['step_time_median_s'] * 1e3:.1f} ms, {lo * 1e3:.1f}-{hi * 1e3:.1f})" \
                if lo is not None else ""
            rows.append(["end_to_end", label, where(f), f"{r['tokens_per_s']:,.0f} tokens/s{spread}", mfu,
                         mib(r["peak_memory_bytes"]), PUB_E2E if f["device"] == "cuda" else ""])
    return rows


def layer_rows(files: list[dict]) -> list[list[str]]:
    rows = []
    gpu = [f for f in files if f["device"] == "cuda"]
    if not gpu:
        for v in ("eager", "compile", "fp8"):
            for b in (4, 8):
                what = "bf16, fp8 (torchao Float8Linear, compiled)" if v == "fp8" else f"bf16, {v}"
                rows.append(["layer", f"h4096 ffn16384 32 heads seq 2048, batch {b}, {what}", "GPU",
                             EMPTY, "", "", PUB_LAYER.get((v, b), "")])
    for f in gpu + [f for f in files if f["device"] == "cpu"]:
        s = f["settings"]
        shape = f"h{s['hidden']} ffn{s['ffn']} {s['heads']} heads seq {s['seq_len']}"
        for r in f["rows"]:
            pub = PUB_LAYER.get((r["variant"], r["batch"]), "") if f["device"] == "cuda" else ""
            variant = r["variant"] + (f" ({r['compile_backend']})" if r.get("compile_backend") not in
                                      (None, "inductor") else "")
            rows.append(["layer", f"{shape}, batch {r['batch']}, {r['dtype']}, {variant}", where(f),
                         f"{r['median_ms']:.2f} ms fwd+bwd ({r['min_ms']:.2f}-{r['max_ms']:.2f}, "
                         f"{r['iters']} iters)", "", mib(r.get("peak_memory_bytes")), pub])
        for sk in f.get("skipped", []):
            rows.append(["layer", f"{shape}, {sk['variant']}", where(f), f"skipped: {sk['reason']}", "", "",
                         ""])
    return rows


def mm_rows(files: list[dict]) -> list[list[str]]:
    rows = []
    gpu = [f for f in files if f["device"] == "cuda"]
    if not gpu:
        rows.append(["memory_maximizer", "largest retry-free vs retrying batch (lesson 05 search)", "GPU",
                     EMPTY, "", "", PUB_MM])
    for f in gpu + [f for f in files if f["device"] == "cpu"]:
        if f.get("status") != "ok":
            rows.append(["memory_maximizer", "lesson 05 search", where(f), f.get("status", "failed"), "", "",
                         ""])
            continue
        label = f"{f['model']['name']}, {f['world_size']} rank(s), seq {f['seq_len']}: batch search"
        if f["device"] == "cpu":
            result = (f"retry-free batch {f['retry_free_batch']} ({f['retry_free_samples_per_s']} "
                      "samples/s); retry effect needs a GPU")
        else:
            sp = f"{f['speedup']:+.0%}" if f.get("speedup") is not None else "no retrying batch seen"
            result = (f"batch {f['retry_free_batch']}: {f['retry_free_samples_per_s']} samples/s vs batch "
                      f"{f['retrying_batch']}: {f['retrying_samples_per_s']} samples/s ({sp})")
        peak = mib(f.get("retry_free_peak_memory_bytes"))
        rows.append(["memory_maximizer", label, where(f), result, "", peak,
                     PUB_MM if f["device"] == "cuda" else ""])
    return rows


def planner_rows(files: list[dict]) -> list[list[str]]:
    rows = []
    gpu = [f for f in files if f["device"] == "cuda"]
    if not gpu:
        rows.append(["planner_check", "planned vs measured peak, every GPU configuration above", "GPU",
                     EMPTY, "", "", PUB_PLANNER])
    for f in gpu + [f for f in files if f["device"] == "cpu"]:
        for r in f["rows"]:
            caveat = f" [{'; '.join(r['caveats'])}]" if r.get("caveats") else ""
            rows.append(["planner_check", f"{r['source']}{caveat}", where(f),
                         f"planned {mib(r['predicted_bytes'])} vs measured {mib(r['measured_bytes'])} "
                         f"({r['relative_error']:+.1%})", "", mib(r["measured_bytes"]),
                         PUB_PLANNER if f["device"] == "cuda" else ""])
    return rows


def table(directory: Path) -> str:
    found = load_all(directory)
    rows = (e2e_rows(found.get("end_to_end", [])) + layer_rows(found.get("layer", []))
            + mm_rows(found.get("memory_maximizer", [])) + planner_rows(found.get("planner_check", [])))
    head = ["benchmark", "configuration", "where", "result (median; min-max)", "MFU", "peak memory/rank",
            "published, for comparison"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def render(readme: str, body: str) -> str:
    block = (f"{START}\n<!-- generated by `python benchmarks/report.py`; edits here are overwritten -->\n\n"
             f"{body}\n\n{END}")
    if START in readme and END in readme:
        before, rest = readme.split(START, 1)
        return before + block + rest.split(END, 1)[1]
    return readme.rstrip("\n") + "\n\n## Results\n\n" + block + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", default=str(RESULTS_DIR),
                   help="where the result files are (default benchmarks/results)")
    p.add_argument("--readme", default=str(HERE / "README.md"),
                   help="the README whose table is replaced (default benchmarks/README.md)")
    p.add_argument("--print", action="store_true", help="print the table instead of writing the README")
    args = p.parse_args(argv)
    body = table(Path(args.results_dir))
    if args.print:
        print(body)
        return 0
    path = Path(args.readme)
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(old, body))
    print(f"table written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
