"""The READMEs: the set-up block installs the CPU build first, every lesson's results table is
rendered from a run committed beside it (a hand edit is caught), the numbers the prose quotes are
the runs', and a run reproduces a committed run's claims within the peak's timing only. No lesson
is launched."""

from __future__ import annotations

import json
import re

from conftest import REPO

from utilities.course import readme_tables as T


# -- the README's set-up block ---------------------------------------------------------------------
def test_setup_block_installs_cpu_torch_before_the_requirements():
    """Someone who copies the block line by line on a CPU box must get the CPU build of torch:
    the CPU line is inside the block, marked, and comes before `pip install -r requirements.txt`."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    requirements = next(i for i, line in enumerate(block) if "pip install -r requirements.txt" in line)
    cpu = next(i for i, line in enumerate(block)
               if line.startswith('pip install "torch') and "download.pytorch.org/whl/cpu" in line)
    assert cpu < requirements
    assert any("CPU-only machine" in line for line in block[:cpu])
    # the CPU line pins the range requirements.txt accepts, so the next line keeps that build
    pinned = re.search(r'"(torch[^"]+)"', block[cpu]).group(1)
    assert pinned in (REPO / "requirements.txt").read_text().splitlines()


# -- README results tables come from a run ------------------------------------------------------------
def test_marked_readme_tables_match_their_committed_runs():
    """Every lesson's README has a results table rendered from a run committed beside it, which
    names its machine; every committed run is rendered somewhere (none left behind)."""
    from utilities.course.catalog import LESSONS

    lessons = T.marked_lessons()
    assert set(lessons) == set(LESSONS)
    for lesson in lessons:
        assert T.check(lesson) == [], f"python -m utilities.course.readme_tables --write {lesson}"
        folder = T.lesson_dir(lesson)
        readme = (folder / "README.md").read_text()
        blocks = [m for m in T.BLOCK.finditer(readme) if m.group(2) == lesson]
        assert blocks, lesson
        rendered = {name for m in blocks for name in m.group(3).split(",")}
        assert rendered == {p.name for p in folder.glob("results_cpu*.json")}, lesson
        for name in rendered:
            results = json.loads((folder / name).read_text())
            assert results["lesson"] == lesson and results["device"] == "cpu", (lesson, name)
            assert results["machine"]["cpu_cores"] and results["machine"]["memory_bytes"], (lesson, name)
            caption = next(line for line in readme.splitlines() if f"[`{name}`]({name})" in line)
            assert ("--quick" in caption) == bool(results["settings"].get("quick")), (lesson, name)


def test_a_hand_edited_number_is_caught(tmp_path, monkeypatch):
    """The check can fail: change one number in a copy of lesson 07's README and it differs."""
    folder = tmp_path / "lessons" / "07_mixed_precision"
    folder.mkdir(parents=True)
    src = T.lesson_dir("07")
    (folder / "results_cpu.json").write_text((src / "results_cpu.json").read_text())
    text = (src / "README.md").read_text()
    assert "| 27.89 MiB |" in text  # bf16's peak, rendered from the run
    (folder / "README.md").write_text(text.replace("| 27.89 MiB |", "| 28.89 MiB |", 1))
    monkeypatch.setattr(T, "REPO", tmp_path)
    problems = T.check("07")
    assert any("28.89" in p for p in problems) and any("27.89" in p for p in problems)
    T.check("07", write=True)
    assert T.check("07") == []


def test_numbers_the_prose_of_lessons_01_and_07_quotes_are_what_the_runs_say():
    r07 = json.loads((T.lesson_dir("07") / "results_cpu.json").read_text())
    reduce32 = next(v for v in r07["variants"] if v["name"] == "fsdp2-bf16-fp32-reduce")
    fp32 = next(v for v in r07["variants"] if v["name"] == "fsdp2-fp32")
    diff = max(abs(a - b) for a, b in zip(reduce32["losses"], fp32["losses"]))
    readme07 = (T.lesson_dir("07") / "README.md").read_text()
    assert f"{diff:.3f}" == "0.025" and "at most 0.025 from fp32" in readme07
    assert "0.032" not in readme07
    r01 = json.loads((T.lesson_dir("01") / "results_cpu.json").read_text())
    per_block = next(v for v in r01["variants"] if v["name"] == "fsdp2-per-block")
    # 1.19 MiB = one decoder block (262,528) + the root unit (49,408 parameters), 4 bytes each
    assert per_block["peak_unsharded_parameter_bytes"] == 4 * (262_528 + 49_408)
    readme01 = (T.lesson_dir("01") / "README.md").read_text()
    assert "plus the prefetched one" not in readme01 and "49,408 parameters" in readme01


def test_a_run_reproduces_the_readme_claims_within_the_peaks_timing_only():
    """Units, sizes, parameters and optimizer state must be equal; the peak's activations may
    differ by one short-lived tensor's timing (3%), not more."""
    from readme_claims import claim_differences, claims

    committed = claims("01", json.loads((T.lesson_dir("01") / "results_cpu.json").read_text()))
    ran = json.loads(json.dumps(committed))
    ran["fsdp2-per-block"]["peak"]["activations"] += 589_816  # seen under load: 1.5 logits
    assert claim_differences(ran, committed) == []
    ran["fsdp2-per-block"]["peak"]["activations"] += 10**6
    ran["fsdp2-one-unit"]["peak"]["optimizer"] += 4
    assert len(claim_differences(ran, committed)) == 2
