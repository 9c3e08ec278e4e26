"""Regenerate the results table in benchmarks/README.md from benchmarks/results/*.json.

    python benchmarks/report.py [--results-dir DIR] [--readme PATH] [--print]

The table sits between the two marker comments in the README; everything else in the README is kept.
GPU rows are always present: filled from GPU result files (device "cuda") when there are any,
otherwise left empty with "not yet measured". CPU rows come from the --tiny runs and say so.
The published figures stand beside our rows (see /work/shared/reference/anchors.md), and the
"vs reference (same run)" column gives each row's ratio to what the same run measured as its
reference: the plain one-device loop (end_to_end), eager / compiled bf16 (layer), the retrying
batch (memory_maximizer), the measured peak (planner_check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NO_GPU, REPO, RESULTS_DIR
from end_to_end import ALL_CONFIGS as E2E_GPU_CONFIGS
from end_to_end import reference_of
from layer import CONFIGS as LAYER_CONFIGS

HERE = Path(__file__).resolve().parent
START, END = "<!-- results:start -->", "<!-- results:end -->"
EMPTY = f"*{NO_GPU}*"
PUB_E2E = ("torchtitan, Llama 3.1 8B, 8x H100, FSDP2 + selective AC: MFU 33-39%; 5,762 tokens/s/GPU "
           "(+compile 6,667)")
PUB_TE_BF16 = "TransformerEngine, H100: bf16 PyTorch baseline 48.28 ms"
PUB_TORCHAO = "torchao Float8 (Llama3-8B, 8x H100, FSDP2 + compile): +25% tokens/s over bf16"
PUB_LAYER = {("eager", 8): PUB_TE_BF16, ("compile", 8): PUB_TE_BF16,
             ("fp8", 8): f"TransformerEngine, H100: TE layer + FP8 21.67 ms; {PUB_TORCHAO}",
             ("fp8", 4): f"TransformerEngine, H100: fp8 27.8 ms; {PUB_TORCHAO}"}
PUB_MM = "classic lesson 05, 2B ViT: batch 16 (0 retries) +25% over batch 17 (9 retries)"
PUB_PLANNER = "PyTorch tests hold the mem trackers within 10% of the allocator's peak"
HEAD = ["benchmark", "configuration", "where", "result (median; min-max)", "MFU", "vs reference (same run)",
        "peak memory/rank", "published, for comparison"]


def mib(b) -> str:
    return "" if b is None else f"{b / 2**20:,.1f} MiB"


def evidence_dirs() -> list[Path]:
    """The benchmark steps' folders in every chunked GPU evidence folder (``fsdp-course evidence``)."""
    from utilities.course.evidence import evidence_folders

    return [step for folder in evidence_folders(REPO) for step in sorted(folder.glob("bench-*"))
            if step.is_dir()]


def load_all(directories: Path | list[Path]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    directories = [directories] if isinstance(directories, Path) else directories
    for path in sorted(p for d in directories for p in d.glob("*.json")):
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


def _spread(r: dict) -> str:
    lo, hi = r.get("step_time_min_s"), r.get("step_time_max_s")
    if lo is None or r.get("step_time_median_s") is None:
        return ""
    return f" (step {r['step_time_median_s'] * 1e3:.1f} ms, {lo * 1e3:.1f}-{hi * 1e3:.1f})"


def _mfu(r: dict, device: str) -> str:
    return f"{r['mfu']:.1%}" if r.get("mfu") else "n/a (CPU)" if device == "cpu" else ""


def e2e_rows(files: list[dict]) -> list[list[str]]:
    rows = []
    gpu = [f for f in files if f["device"] == "cuda"]
    if not gpu:
        refs = list(dict.fromkeys(reference_of(c) for c in E2E_GPU_CONFIGS))
        rows += [["end_to_end", f"llama-1b, seq 2048, bf16: reference-{r} (plain loop, 1 GPU, no FSDP)",
                  "GPU", EMPTY, "", "", "", ""] for r in refs]
        rows += [["end_to_end", f"llama-1b, seq 2048, bf16: {c}", "GPU", EMPTY, "", "", "", PUB_E2E]
                 for c in E2E_GPU_CONFIGS]
    for f in gpu + [f for f in files if f["device"] == "cpu"]:
        s = f["settings"]
        head = f"{s['model']}, seq {s['seq_len']}, batch {s['batch_size']}, {s['precision']}"
        for r in f.get("references", []):
            label = f"{head}: {r['config']} (plain loop, 1 device, no FSDP)"
            if r.get("status") != "ok":
                rows.append(["end_to_end", label, where(f), r.get("status", "failed"), "", "", "", ""])
                continue
            rows.append(["end_to_end", label, where(f), f"{r['tokens_per_s']:,.0f} tokens/s{_spread(r)}",
                         _mfu(r, f["device"]), "1.00 (the reference)", mib(r.get("peak_memory_bytes")),
                         ""])
        for r in f["runs"]:
            label = f"{head}, {s['nproc']} ranks: {r['config']}"
            if r.get("status") != "ok":
                rows.append(["end_to_end", label, where(f), r.get("status", "failed"), "", "", "", ""])
                continue
            if r.get("peak_memory_method") == "census" and f["device"] == "cpu":
                label += " (peak: census of resident state, no activations)"
            ratio = r.get("ratio_to_reference")
            vs = f"{ratio:.2f}x {r['reference']} (per device)" if ratio is not None else ""
            rows.append(["end_to_end", label, where(f), f"{r['tokens_per_s']:,.0f} tokens/s{_spread(r)}",
                         _mfu(r, f["device"]), vs, mib(r["peak_memory_bytes"]),
                         PUB_E2E if f["device"] == "cuda" else ""])
    return rows


def _layer_pub(variant: str, batch: int) -> str:
    return PUB_LAYER.get(("fp8" if LAYER_CONFIGS.get(variant, (None, None))[1] else variant, batch), "")


def _layer_vs(r: dict) -> str:
    parts = []
    if r.get("speedup_vs_eager") is not None and r["variant"] != "eager":
        parts.append(f"{r['speedup_vs_eager']:.2f}x eager")
    if r.get("speedup_vs_compile") is not None:
        parts.append(f"{r['speedup_vs_compile']:.2f}x compile")
    return "; ".join(parts) or ("1.00 (the reference)" if r["variant"] == "eager" else "")


def layer_rows(files: list[dict]) -> list[list[str]]:
    rows = []
    gpu = [f for f in files if f["device"] == "cuda"]
    if not gpu:
        for v, (compiled, recipe) in LAYER_CONFIGS.items():
            for b in (4, 8):
                what = (f"{v} (torchao Float8Linear {recipe}, compiled: {compiled or 'no'})" if recipe
                        else f"bf16, {v}")
                rows.append(["layer", f"h4096 ffn16384 32 heads seq 2048, batch {b}, {what}", "GPU",
                             EMPTY, "", "", "", _layer_pub(v, b)])
    for f in gpu + [f for f in files if f["device"] == "cpu"]:
        s = f["settings"]
        shape = f"h{s['hidden']} ffn{s['ffn']} {s['heads']} heads seq {s['seq_len']}"
        for r in f["rows"]:
            pub = _layer_pub(r["variant"], r["batch"]) if f["device"] == "cuda" else ""
            variant = r["variant"] + (f" ({r['compile_backend']})" if r.get("compile_backend") not in
                                      (None, "inductor") else "")
            rows.append(["layer", f"{shape}, batch {r['batch']}, {r['dtype']}, {variant}", where(f),
                         f"{r['median_ms']:.2f} ms fwd+bwd ({r['min_ms']:.2f}-{r['max_ms']:.2f}, "
                         f"{r['iters']} iters)", "", _layer_vs(r), mib(r.get("peak_memory_bytes")), pub])
        for sk in f.get("skipped", []):
            rows.append(["layer", f"{shape}, {sk['variant']}", where(f), f"skipped: {sk['reason']}", "", "",
                         "", ""])
    return rows


def mm_rows(files: list[dict]) -> list[list[str]]:
    rows = []
    gpu = [f for f in files if f["device"] == "cuda"]
    if not gpu:
        rows.append(["memory_maximizer", "largest retry-free vs smallest retrying batch (lesson 05 search, "
                     "doubling then bisection)", "GPU", EMPTY, "", "", "", PUB_MM])
    for f in gpu + [f for f in files if f["device"] == "cpu"]:
        if f.get("status") != "ok":
            rows.append(["memory_maximizer", "lesson 05 search", where(f), f.get("status", "failed"), "", "",
                         "", ""])
            continue
        label = f"{f['model']['name']}, {f['world_size']} rank(s), seq {f['seq_len']}: batch search"
        tps = f.get("retry_free_tokens_per_s")
        clean = f"batch {f['retry_free_batch']}: {tps:,.0f} tokens/s" if tps else \
            f"batch {f['retry_free_batch']}"
        if f.get("speedup") is None:
            result, vs = f"{clean}; no comparison ({f.get('why') or 'no retrying batch seen'})", ""
        else:
            result = (f"{clean} vs batch {f['retrying_batch']} ({f['retrying_kind']}): "
                      f"{f['retrying_tokens_per_s']:,.0f} tokens/s")
            vs = f"{f['speedup']:+.1%} retry-free over retrying"
            if f["device"] == "cpu":
                vs += " (budget stand-in; no claim)"
        rows.append(["memory_maximizer", label, where(f), result, "", vs,
                     mib(f.get("retry_free_peak_memory_bytes")), PUB_MM if f["device"] == "cuda" else ""])
    return rows


def planner_rows(files: list[dict]) -> list[list[str]]:
    rows = []
    gpu = [f for f in files if f.get("measured_on", f["device"]) == "cuda"]
    if not gpu:
        rows.append(["planner_check", "planned vs torch.cuda.max_memory_allocated, every GPU configuration "
                     "above", "GPU", EMPTY, "", "", "", PUB_PLANNER])
    for f in gpu + [f for f in files if f not in gpu]:
        on_gpu = f in gpu
        for r in f["rows"]:
            caveat = f" [{'; '.join(r['caveats'])}]" if r.get("caveats") else ""
            rows.append(["planner_check", f"{r['source']}{caveat}", where(f) if not on_gpu else
                         f"measured on GPU, planned on {f['device_name']}",
                         f"planned {mib(r['predicted_bytes'])} vs measured {mib(r['measured_bytes'])} "
                         f"({r.get('measured_method', 'tracker')})", "", f"{r['relative_error']:+.1%} error",
                         mib(r["measured_bytes"]), PUB_PLANNER if on_gpu else ""])
    return rows


def table(directory: Path | list[Path]) -> str:
    found = load_all(directory)
    rows = (e2e_rows(found.get("end_to_end", [])) + layer_rows(found.get("layer", []))
            + mm_rows(found.get("memory_maximizer", [])) + planner_rows(found.get("planner_check", [])))
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


CALIBRATION_START, CALIBRATION_END = "<!-- calibration:start -->", "<!-- calibration:end -->"


def calibration_table() -> str:
    """The time model's efficiencies as the newest GPU evidence measured them (``fsdp-course plan
    --calibrate``, the evidence step ``calibrate``), beside the model's fitted ones."""
    from utilities.course.evidence import evidence_folders
    from utilities.measure.step_time import CALIBRATED

    found = [f / "calibrate" / "calibration.json" for f in evidence_folders(REPO)]
    found = [p for p in found if p.is_file()]
    fitted = (f"fitted on published figures: matmul {CALIBRATED.matmul:.3f}, attention "
              f"{CALIBRATED.attention:.3f}, memory {CALIBRATED.memory:.3f}")
    if not found:
        return (f"*{NO_GPU}: `fsdp-course evidence` measures it (step `calibrate`).* The model's "
                f"efficiencies are the ones {fitted}.")
    path = found[-1]
    data = json.loads(path.read_text())
    m, e = data["measured"], data["efficiencies"]
    head = ["GPU", "date", "matmul", "attention", "memory", "file"]
    row = [data["device_name"], data["date"][:10], f"{m['matmul_tflops']:.0f} TFLOP/s ({e['matmul']:.3f})",
           f"{m['attention_tflops']:.0f} TFLOP/s ({e['attention']:.3f})",
           f"{m['memory_gbytes_per_s']:,.0f} GB/s ({e['memory']:.3f})", f"`{os.path.relpath(path, REPO)}`"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(row) + " |",
                      "", f"Measured (efficiency in brackets); the model's defaults are the ones {fitted}. "
                      "`fsdp-course plan --calibration FILE` predicts with the measured ones."])


def render_block(readme: str, start: str, end: str, body: str) -> str:
    if start not in readme or end not in readme:
        return readme
    before, rest = readme.split(start, 1)
    return f"{before}{start}\n{body}\n{end}{rest.split(end, 1)[1]}"


def render(readme: str, body: str) -> str:
    block = (f"{START}\n<!-- generated by `python benchmarks/report.py`; edits here are overwritten -->\n\n"
             f"{body}\n\n{END}")
    if START in readme and END in readme:
        before, rest = readme.split(START, 1)
        return before + block + rest.split(END, 1)[1]
    return readme.rstrip("\n") + "\n\n## Results\n\n" + block + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", nargs="+", default=None, metavar="DIR",
                   help="where the result files are (default benchmarks/results and the benchmark "
                        "steps of every GPU evidence folder, benchmarks/results/gpu/*/bench-*)")
    p.add_argument("--readme", default=str(HERE / "README.md"),
                   help="the README whose table is replaced (default benchmarks/README.md)")
    p.add_argument("--print", action="store_true", help="print the table instead of writing the README")
    args = p.parse_args(argv)
    dirs = [Path(d) for d in args.results_dir] if args.results_dir else [RESULTS_DIR, *evidence_dirs()]
    body = table(dirs)
    if args.print:
        print(body)
        return 0
    path = Path(args.readme)
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_block(render(old, body), CALIBRATION_START, CALIBRATION_END,
                                 calibration_table()))
    print(f"table written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
