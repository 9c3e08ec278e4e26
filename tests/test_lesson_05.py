"""Lesson 05: the batch search stops at the first unclean batch, survives OOMs, and the lesson's
quick run recommends a batch under the budget whose neighbour above is over it."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, cli, flag_error, notebook_results

from utilities.measure.batch_search import Trial, find_max_batch
from utilities.measure.memory import is_oom

MIB = 2**20


@pytest.fixture(autouse=True)
def no_collection_between_fake_trials(monkeypatch):
    """The fake trials below allocate nothing, and a full gc.collect() in this process (which holds
    torch, transformers and the notebooks' results) took ~0.5 s per trial late in the suite."""
    import utilities.measure.batch_search as B

    monkeypatch.setattr(B, "free_memory", lambda: None)


def linear_memory(base_mib: float = 10, per_sample_mib: float = 3):
    """A fake trial: peak memory grows linearly with the batch; records what was tried."""
    tried = []

    def try_batch(batch: int) -> Trial:
        tried.append(batch)
        peak = int((base_mib + per_sample_mib * batch) * MIB)
        return Trial(batch, throughput=10.0 * batch, peak_bytes=peak)

    return try_batch, tried


def test_finds_largest_batch_under_the_budget():
    try_batch, tried = linear_memory()
    budget = 100 * MIB  # 10 + 3 * 30 = 100 fits exactly; 31 does not
    result = find_max_batch(try_batch, start=1, limit=1024, budget_bytes=budget)
    assert result.best == 30
    assert result.trial(30).clean and result.trial(31).over_budget  # both neighbours were tried
    assert tried[:6] == [1, 2, 4, 8, 16, 32]  # grows by doubling, stops at the first failure
    assert max(tried) == 32 and len(tried) == len(set(tried))
    assert all(t.peak_bytes <= budget for t in result.trials if t.clean)
    assert "batch 30" in result.reason and "batch 31" in result.reason


def test_no_bisect_stops_at_first_failure():
    try_batch, tried = linear_memory()
    result = find_max_batch(try_batch, start=1, limit=1024, bisect=False, budget_bytes=100 * MIB)
    assert tried == [1, 2, 4, 8, 16, 32] and result.best == 16


def test_predicting_from_two_peaks_needs_fewer_and_smaller_trials():
    """``predict``: a line through two measured peaks names the batch that meets the budget; the
    search tries it and the one above it (lesson 02's CPU search). The answer is the classic one."""
    try_batch, tried = linear_memory()
    result = find_max_batch(try_batch, start=1, limit=1024, budget_bytes=100 * MIB, predict=True)
    assert result.best == 30 and tried == [1, 2, 30, 31]
    assert [t.phase for t in result.trials] == ["grow", "grow", "predict", "predict"]
    assert result.trial(31).over_budget

    def curved(batch: int) -> Trial:  # far from a line: the guesses miss, the answer still holds
        return Trial(batch, peak_bytes=int((10 + 0.05 * batch**2) * MIB))

    for budget in (20, 100, 700):
        classic = find_max_batch(curved, start=1, limit=1024, budget_bytes=budget * MIB)
        guessed = find_max_batch(curved, start=1, limit=1024, budget_bytes=budget * MIB, predict=True)
        assert guessed.best == classic.best and not guessed.trial(guessed.best + 1).clean, budget


def test_limit_and_smallest_batch_failing():
    try_batch, _ = linear_memory()
    result = find_max_batch(try_batch, start=3, limit=20, budget_bytes=10**12)
    assert result.best == 20 and [t.batch for t in result.trials] == [3, 6, 12, 20]
    assert "limit" in result.reason
    result = find_max_batch(try_batch, start=4, limit=64, budget_bytes=5 * MIB)
    assert result.best is None and len(result.trials) == 1 and "smallest" in result.reason


@pytest.mark.parametrize("oom", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
                                 RuntimeError("CUDA error: out of memory")])
def test_oom_is_survived_and_reported(oom):
    tried = []

    def try_batch(batch: int) -> Trial:
        tried.append(batch)
        if batch >= 12:
            raise oom
        return Trial(batch, throughput=float(batch), retries=1 if batch == 11 else 0)

    result = find_max_batch(try_batch, start=1, limit=64)
    assert result.best == 10  # 11 retried, 12+ OOMed
    ooms = [t for t in result.trials if t.ooms]
    assert [t.batch for t in ooms] == [16, 12]  # the search went on after the first OOM
    assert all(t.verdict == "OOM" and "out of memory" in t.error for t in ooms)
    assert result.trial(11).verdict == "1 retries"
    assert result.first_failure.batch == 11


def test_other_errors_are_not_swallowed():
    def try_batch(batch: int) -> Trial:
        raise ValueError("a bug, not memory")

    assert not is_oom(ValueError("out of memory"))
    with pytest.raises(ValueError):
        find_max_batch(try_batch)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return notebook_results("05", tmp_path_factory)  # the notebook runs `fsdp-course run 05 --quick`


def test_quick_run_recommends_largest_batch_under_budget(results):
    assert results["lesson"] == "05" and results["device"] == "cpu" and results["world_size"] == 2
    trials = {v["batch"]: v for v in results["variants"] if v["name"].startswith("batch-")}
    rec = next(v for v in results["variants"] if v["name"] == "recommendation")
    budget = rec["budget_mib"] * MIB
    best = rec["batch"]
    assert best is not None and best > min(trials)  # the answer is inside the sweep
    assert trials[best]["peak_bytes"] <= budget and trials[best]["clean"]
    assert trials[best + 1]["peak_bytes"] > budget and trials[best + 1]["over_budget"]
    for v in trials.values():
        assert v["step_time_s"] > 0 and v["samples_per_s"] > 0
        assert v["retries"] == 0 and v["ooms"] == 0 and v["max_reserved"] is None  # CPU: no allocator
        assert v["clean"] == (v["peak_bytes"] <= budget)
        assert v["peak_memory_bytes"]["total"] <= v["peak_bytes"]  # rank 0's peak <= max over ranks
    assert any("no caching allocator" in n for n in results["notes"])


def test_bad_budget_is_one_line_exit_2():
    assert "--budget-mib" in flag_error("05", "--budget-mib", "0")


def test_lesson_help_explains_every_flag():
    proc = cli("run", "05", "--", "--help")
    assert proc.returncode == 0
    for flag in ("--budget-mib", "--start-batch", "--max-batch", "--no-bisect", "--quick"):
        assert flag in proc.stdout
    assert (REPO / "lessons/05_memory_maximizer/README.md").is_file()


def test_readme_table_is_reproduced_by_the_quick_run(results):
    """The README's results table is rendered from results_cpu.json, the lesson's own `fsdp-course run
    05 --device cpu`; this quick run reproduces what it claims (the batches tried and their
    verdicts, the optimizer state at the peak)."""
    from conftest import assert_readme_table_is_reproduced

    assert_readme_table_is_reproduced("05", results)
