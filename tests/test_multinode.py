"""Two "nodes" on one machine: two torchrun agents meeting through torchrun's own c10d rendezvous on
127.0.0.1, as the README's multi-node section tells people to start them on a cluster.

HSDP on 2 nodes x 2 ranks shards within a node and replicates across: each rank holds what
full sharding over its node's 2 ranks would give it, and the losses are full sharding's. And the
README's own multi-node command, run as written (the head node and the GPU count filled in), is that run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port, variant

pytestmark = pytest.mark.slow


def readme_multinode_command() -> str:
    """The first torchrun line of the README's "Multi-node" section, continuation lines joined."""
    section = (REPO / "README.md").read_text().split("## Multi-node", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    command = re.sub(r"\\\n\s*", "", block)
    return next(line.strip() for line in command.splitlines() if line.strip().startswith("torchrun"))


def two_agents(argv: list[str], out: Path, timeout: float = 300) -> dict:
    """Start the same torchrun command twice (node 0 and node 1 of 2), wait for both, and return the
    results.json rank 0 wrote."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    agents = [subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    return json.loads((out / "results.json").read_text())


def torchrun_argv(command: str, port: int) -> list[str]:
    """The README's command with $HEAD_NODE on this machine and torchrun as this Python's module."""
    words = command.replace("$HEAD_NODE:29500", f"127.0.0.1:{port}").split()
    assert words[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", *words[1:]]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> dict:
    """The README's command as written (its head node on this machine, 2 ranks per "node"), run
    once for this file's tests. The run skips the lesson's GPU-cluster prediction (a fake step of
    t5-large that these checks do not read)."""
    command = readme_multinode_command()
    assert "--rdzv-backend c10d" in command and "--nnodes 2" in command and "$HEAD_NODE" in command
    out = tmp_path_factory.mktemp("two_nodes")
    argv = torchrun_argv(command.replace("--nproc-per-node 8", "--nproc-per-node 2"), free_port())
    return two_agents([*argv, "--device", "cpu", "--quick", "--predict-on", "none", "--out", str(out)],
                      out)


def test_the_readmes_multinode_command_is_hsdp_that_shards_within_a_node(two_nodes):
    """The two agents meet through c10d; full sharding over all 4 ranks holds a quarter of the
    parameters per rank, HSDP half (its node's 2 ranks shard, the 2 nodes replicate), FSDP1's
    hybrid sharding as FSDP2's HSDP, and all train the same model."""
    r = two_nodes
    assert r["world_size"] == 4 and r["device"] == "cpu"
    full = variant(r, "fsdp2-reshard-true")
    whole = r["model"]["parameters"] * 4  # fp32 bytes of the whole model
    assert full["resident_bytes"]["parameters"] == pytest.approx(whole / 4, rel=0.05)
    for name in ("fsdp1-hybrid-shard", "fsdp2-hsdp"):
        hybrid = variant(r, name)
        assert hybrid["mesh"] == [2, 2], name
        assert hybrid["resident_bytes"]["parameters"] == pytest.approx(whole / 2, rel=0.05), name
        assert hybrid["losses"] == pytest.approx(full["losses"], abs=5e-3), name
    assert full["losses"][-1] < full["losses"][0]


def test_resharding_to_a_nodes_ranks_sits_between_true_and_false(two_nodes):
    """reshard_after_forward=2 (the only lesson-06 variant a 2-rank run skips): after forward each
    block is resharded over a node's 2 ranks, not all 4, so backward all-gathers inside the node.
    Its peak and its traffic sit between True and False, and it trains the same model. Lesson
    06's 4-rank README table is these variants' run on one machine: this run reproduces it."""
    from conftest import assert_readme_table_is_reproduced

    true, two, false = (variant(two_nodes, f"fsdp2-reshard-{k}") for k in ("true", "int", "false"))

    def peak(v):
        return v["peak_memory_bytes"]["total"]

    assert peak(true) < peak(two) < peak(false)
    assert false["comm_bytes_per_step"] < two["comm_bytes_per_step"] < true["comm_bytes_per_step"]
    assert two["losses"] == pytest.approx(true["losses"], abs=1e-5)
    # Four processes on two cores catch the int variant's peak at different moments (its
    # activations: 11.66 or 13.10 MiB in two runs of the same code), so the split of the peak is
    # not compared, only the rest.
    assert_readme_table_is_reproduced("06", two_nodes, "results_cpu_4ranks.json",
                                      peak_parts=("parameters", "optimizer"))
