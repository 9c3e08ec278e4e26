"""The code in the lesson READMEs runs: every ```python block of a README, in order, in one
namespace, from the lesson's folder, with a one-rank gloo process group already up (what a reader
who pastes the blocks into a python session after `torch.distributed.init_process_group` gets).

All READMEs run in one fresh process (each in its own namespace and folder), started once per
test session: importing torch and transformers once instead of once per README.

A block that cannot run on a CPU (GPU-only, multi-node) is fenced ```text / ```bash, or starts
with the line ``# not run: <why>``. Run READMEs by hand:

    python tests/test_readme_snippets.py lessons/01_auto_wrap/README.md
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted((ROOT / "lessons").glob("*/README.md"))
SKIP_MARK = "# not run:"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def snippets(readme: Path) -> list[str]:
    """The README's runnable python blocks, in order."""
    blocks = _BLOCK.findall(readme.read_text())
    return [b for b in blocks if not b.lstrip().startswith(SKIP_MARK)]


def _run_here(readmes: list[Path]) -> dict[str, dict]:
    """Run each README's blocks in this process (the child's side of ``run``): one namespace per
    README, its folder as the working directory and first on ``sys.path``. Returns, per README,
    ``{"ok": bool, "blocks": n, "failed_block": i, "error": traceback}``."""
    import socket
    import traceback

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    sys.path.insert(0, str(ROOT))
    results = {}
    for readme in readmes:
        blocks = snippets(readme)
        os.chdir(readme.parent)
        sys.path.insert(0, str(readme.parent))
        namespace = {"__name__": "__main__"}
        outcome = {"ok": True, "blocks": len(blocks)}
        for i, block in enumerate(blocks, 1):
            try:
                exec(compile(block, f"{readme.relative_to(readme.parents[2])} (python block {i})",
                             "exec"), namespace)
            except BaseException:  # noqa: BLE001 - SystemExit included: a block must not exit
                outcome = {"ok": False, "blocks": len(blocks), "failed_block": i,
                           "error": traceback.format_exc()[-4000:]}
                break
        results[str(readme)] = outcome
        sys.path.remove(str(readme.parent))
        print(f"{readme}: {'ok' if outcome['ok'] else 'FAILED'} ({len(blocks)} blocks)", flush=True)
    dist.destroy_process_group()
    return results


def run(readmes: list[Path], timeout: float = 900) -> dict[str, dict]:
    """Run the READMEs' blocks in one fresh python process; their outcomes by path."""
    proc = subprocess.run([sys.executable, __file__, "--json", *map(str, readmes)], cwd=ROOT,
                          text=True, capture_output=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    marker = "READMES-JSON "
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    assert lines, (f"the README runner died (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                   f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(marker):])


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    return run([r for r in READMES if snippets(r)])


def test_lesson_readmes_have_runnable_code():
    """At least most lessons show code a reader can run; a README made only of prose and shell
    lines would make the check below pass on nothing."""
    with_code = [r.parent.name for r in READMES if snippets(r)]
    assert len(with_code) >= len(READMES) // 2, with_code


@pytest.mark.parametrize("readme", READMES, ids=[r.parent.name[:2] for r in READMES])
def test_readme_python_blocks_run(readme: Path, outcomes):
    if not snippets(readme):
        pytest.skip("no python blocks")
    outcome = outcomes[str(readme)]
    assert outcome["ok"], (f"{readme.relative_to(ROOT)}: python block {outcome['failed_block']} "
                           f"failed:\n{outcome['error']}")


def test_the_main_readme_snippet_runs_as_written(tmp_path):
    """README.md's "Using the utilities in your own code" block, exactly as a reader pastes it into
    a fresh python on a CPU (no process group, no torchrun, an empty folder): it trains 3 steps."""
    proc = _run_main_readme(_main_readme_block(), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss after 3 steps:" in proc.stdout and "Traceback" not in proc.stderr


def test_the_main_readme_doctor_lines_run_on_its_model(tmp_path):
    """README.md's "When something goes wrong" lines, on the model and optimizer of the block
    above (before its ``destroy_process_group``): the course's own wrapping, so nothing printed."""
    doctor = [b for b in snippets(ROOT / "README.md") if "diagnose(" in b]
    assert len(doctor) == 1 and len(doctor[0].strip().splitlines()) == 3
    main = _main_readme_block()
    end = "dist.destroy_process_group()"
    assert main.rstrip().endswith(end)
    script = main.rstrip()[:-len(end)] + doctor[0] + "print('doctor done')\n" + end + "\n"
    proc = _run_main_readme(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-2].startswith("loss after 3 steps:") and lines[-1] == "doctor done", proc.stdout


def _main_readme_block() -> str:
    """README.md's "Using the utilities in your own code" block."""
    blocks = [b for b in snippets(ROOT / "README.md") if "init_process_group" in b]
    assert len(blocks) == 1
    return blocks[0]


def _run_main_readme(code: str, folder: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh python on a CPU, as a reader pastes it: no process group, no torchrun
    variables, an empty folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-c", code], cwd=folder, text=True,
                          capture_output=True, timeout=300, env=dict(env, OMP_NUM_THREADS="1"))


def test_a_failing_block_fails_the_check(tmp_path):
    folder = tmp_path / "lessons" / "99_x"
    folder.mkdir(parents=True)
    readme = folder / "README.md"
    readme.write_text("```python\nx = 1\n```\n\n```python\n# not run: GPU only\nraise SystemExit(3)\n"
                      "```\n\n```python\nassert x == 2, 'wrong'\n```\n")
    assert len(snippets(readme)) == 2
    outcome = run([readme])[str(readme)]
    assert not outcome["ok"] and outcome["failed_block"] == 2 and "wrong" in outcome["error"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--json"]:
        print("READMES-JSON " + json.dumps(_run_here([Path(p).resolve() for p in sys.argv[2:]])))
        from utilities.course.gc_at_exit import skip_final_collections

        skip_final_collections()
    else:
        for path, outcome in _run_here([Path(p).resolve() for p in sys.argv[1:]]).items():
            if not outcome["ok"]:
                print(f"{path}: python block {outcome['failed_block']} failed:\n{outcome['error']}")
