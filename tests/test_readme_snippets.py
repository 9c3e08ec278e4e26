"""The code in the lesson READMEs runs: every ```python block of a README, in order, in one fresh
process, from the lesson's folder, with a one-rank gloo process group already up (what a reader
who pastes the blocks into a python session after `torch.distributed.init_process_group` gets).

A block that cannot run on a CPU (GPU-only, multi-node) is fenced ```text / ```bash, or starts
with the line ``# not run: <why>``. Run one README by hand:

    python tests/test_readme_snippets.py lessons/01_auto_wrap/README.md
"""

from __future__ import annotations

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

_PRELUDE = """
import os, sys
sys.path[:0] = [{root!r}, {folder!r}]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
import socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
"""


def snippets(readme: Path) -> list[str]:
    """The README's runnable python blocks, in order."""
    blocks = _BLOCK.findall(readme.read_text())
    return [b for b in blocks if not b.lstrip().startswith(SKIP_MARK)]


def script(readme: Path) -> str:
    """One program: the prelude, then each block (announced, so a failure names its block)."""
    parts = [_PRELUDE.format(root=str(ROOT), folder=str(readme.parent))]
    for i, block in enumerate(snippets(readme), 1):
        parts.append(f"print('--- block {i}', flush=True)\n{block}")
    parts.append("dist.destroy_process_group()\n")
    return "\n".join(parts)


def run(readme: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script(readme)], cwd=readme.parent, text=True,
                          capture_output=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_lesson_readmes_have_runnable_code():
    """At least most lessons show code a reader can run; a README made only of prose and shell
    lines would make the check below pass on nothing."""
    with_code = [r.parent.name for r in READMES if snippets(r)]
    assert len(with_code) >= len(READMES) // 2, with_code


@pytest.mark.parametrize("readme", READMES, ids=[r.parent.name[:2] for r in READMES])
def test_readme_python_blocks_run(readme: Path):
    if not snippets(readme):
        pytest.skip("no python blocks")
    proc = run(readme)
    assert proc.returncode == 0, (
        f"{readme.relative_to(ROOT)}: a python block failed "
        f"(the last '--- block N' line names it):\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")


def test_a_failing_block_fails_the_check(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("```python\nx = 1\n```\n\n```python\n# not run: GPU only\nraise SystemExit(3)\n"
                      "```\n\n```python\nassert x == 2, 'wrong'\n```\n")
    assert len(snippets(readme)) == 2
    proc = run(readme)
    assert proc.returncode != 0 and "--- block 2" in proc.stdout and "wrong" in proc.stderr


if __name__ == "__main__":
    for path in sys.argv[1:]:
        done = run(Path(path).resolve())
        print(done.stdout[-3000:], done.stderr[-4000:], sep="\n")
        print(f"{path}: {'ok' if done.returncode == 0 else 'FAILED'} "
              f"({len(snippets(Path(path)))} blocks)")
