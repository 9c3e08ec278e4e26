"""Files and values a user (or an attacker) hands the course are answered in one line, within
bounds: a results file cannot write HTML or a marker into a README; a JSON file too deep or too
large, a 20-digit number, a seed or a size no machine holds, a bad torchrun variable, a rank killed
mid-run: one line each, never a traceback."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from conftest import REPO, cli_here

from utilities.errors import UsageError
from utilities.json_input import MAX_JSON_BYTES, json_depth, read_json
from utilities.text import markdown, markdown_escape

INJECTION = "ok <!-- /results --> <img src=x onerror=alert(1)> &copy"


# -- item 11: README marker injection ---------------------------------------------------------------

def test_markdown_cells_and_text_are_inert_and_escaping_twice_changes_nothing():
    assert markdown_escape(INJECTION) == "ok &lt;!-- /results --> &lt;img src=x onerror=alert(1)> &amp;copy"
    assert markdown_escape(markdown_escape(INJECTION)) == markdown_escape(INJECTION)
    assert markdown_escape("6.386->4.436 &lt; &#92;") == "6.386->4.436 &lt; &#92;"
    # a table keeps each cell one cell; the values in it are escaped where they are read
    cells = [markdown_escape("a|b\n# heading"), markdown_escape("<script>x</script>")]
    table = markdown([["name", "value"], cells])
    rows = table.splitlines()
    assert len(rows) == 3 and rows[2] == "| a\\|b # heading | &lt;script>x&lt;/script> |"
    assert markdown([["a"], ["**bold** `code`\nnext"]]).splitlines()[2] == "| **bold** `code` next |"


def test_a_results_file_cannot_break_its_readme(tmp_path, monkeypatch):
    """A results file holding the end marker and raw HTML in its takeaway, a variant's name and a
    key: ``--write`` keeps every marker where it was, the README holds no tag from the file, and a
    second ``--write`` (and the check) finds nothing to change."""
    from utilities.course import readme_tables

    folder = tmp_path / "lessons" / "01_auto_wrap"
    folder.mkdir(parents=True)
    source = REPO / "lessons" / "01_auto_wrap"
    shutil.copy(source / "README.md", folder / "README.md")
    results = json.loads((source / "results_cpu.json").read_text())
    results["takeaway"] = INJECTION
    results["variants"][0]["name"] = INJECTION
    results["variants"][0][INJECTION] = 1
    results["device_name"] = "cpu\n\n<!-- results:01 results_cpu.json -->"
    (folder / "results_cpu.json").write_text(json.dumps(results))
    monkeypatch.setattr(readme_tables, "REPO", tmp_path)
    before = (folder / "README.md").read_text()
    assert readme_tables.check("01", write=True)  # the new content is written
    after = (folder / "README.md").read_text()
    for marker in ("<!-- /results -->", "<!-- results:", "<!--"):  # a lone "-->" ends nothing
        assert after.count(marker) == before.count(marker), marker
    assert "<img" not in after and "&lt;img src=x" in after
    outside = before.split("<!-- /results -->", 1)[1]
    assert after.split("<!-- /results -->", 1)[1] == outside
    assert readme_tables.check("01") == []
    readme_tables.check("01", write=True)
    assert (folder / "README.md").read_text() == after


# -- item 11: deep, huge and sparse JSON --------------------------------------------------------------

def test_a_json_file_too_deep_too_large_or_not_regular_is_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UsageError, match="nested deeper than 64 levels"):
        read_json(deep)
    shallow_but_past = tmp_path / "past.json"
    shallow_but_past.write_text("[" * 65 + "]" * 65)  # parses, then is refused
    with pytest.raises(UsageError, match="nested deeper than 64 levels"):
        read_json(shallow_but_past)
    assert json_depth(json.loads("[" * 64 + "]" * 64)) == 64
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(64 * 2**30)  # sparse: 64 GiB that costs no disk, and must cost no memory
    start = time.perf_counter()
    with pytest.raises(UsageError, match=f"more than the {MAX_JSON_BYTES:,} a JSON file"):
        read_json(big)
    assert time.perf_counter() - start < 1
    with pytest.raises(UsageError, match="not a regular file"):
        read_json(tmp_path)


@pytest.mark.parametrize("content", ["deep", "sparse"])
@pytest.mark.parametrize("read_as", ["config", "calibration"])
def test_plan_refuses_a_deep_or_huge_json_file_in_one_line(tmp_path, content, read_as):
    """A --model config.json and a --calibration file are both read within the JSON bounds."""
    path = tmp_path / f"{read_as}.json"
    head = '{"model_type": "llama", "x": ' if read_as == "config" else '{"efficiencies": '
    if content == "deep":
        path.write_text(head + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        with open(path, "wb") as f:
            f.truncate(64 * 2**30)
    flags = (["--model", str(path), "--no-time"] if read_as == "config"
             else ["--model", "llama-tiny", "--calibration", str(path)])
    proc = cli_here("plan", *flags)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error:") and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert ("nested deeper" if content == "deep" else "more than the") in proc.stderr


def test_an_evidence_manifest_too_deep_is_one_line(tmp_path):
    from utilities.course.evidence import Manifest

    (tmp_path / "manifest.json").write_text('{"schema": 2, "steps": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UsageError, match="not an evidence manifest"):
        Manifest.read(tmp_path / "manifest.json")


def test_a_deep_results_file_is_one_line(tmp_path, monkeypatch, capsys):
    from utilities.course import readme_tables
    from utilities.results import load

    folder = tmp_path / "lessons" / "01_auto_wrap"
    folder.mkdir(parents=True)
    shutil.copy(REPO / "lessons" / "01_auto_wrap" / "README.md", folder / "README.md")
    (folder / "results_cpu.json").write_text('{"variants": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UsageError, match="results file .* cannot be read: it is nested deeper"):
        load(folder / "results_cpu.json")
    monkeypatch.setattr(readme_tables, "REPO", tmp_path)
    assert readme_tables.main(["01"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: lesson 01: results file") and err.strip().count("\n") == 0


# -- item 12: one line instead of a traceback -------------------------------------------------------

def test_record_into_a_folder_that_cannot_exist_is_one_line():
    proc = cli_here("record", "01", "--out", "/proc/x")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: --out '/proc/x' is not allowed")
    assert proc.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("number", ["01", "10"])
def test_a_seed_no_generator_takes_is_one_line(number):
    from conftest import lesson_module

    from utilities.course.launch import parse_flags_here

    code, _, err = parse_flags_here(lesson_module(number).parse_args, ["--quick", "--seed", str(2**70)])
    assert code == 2 and err.strip().count("\n") == 0
    assert f"{2**70} is not allowed; allowed: integers in [0, 4294967295]" in err


def test_a_batch_no_memory_holds_is_refused_before_it_is_allocated():
    import torch

    from utilities.measure.memory import available_bytes, check_batch_fits

    cpu = torch.device("cpu")
    assert available_bytes(cpu) > 0
    check_batch_fits(384, 8, 64, cpu, ranks_sharing=2)
    with pytest.raises(UsageError) as e:
        check_batch_fits(384, 4, 10**9, cpu, ranks_sharing=2)
    assert str(e.value).startswith("--batch-size 4 x --seq-len 1000000000 is not allowed")
    assert "allowed: batch x seq <=" in str(e.value)


@pytest.mark.parametrize("variables, says", [
    ({"MASTER_PORT": "notaport"}, "environment variable MASTER_PORT 'notaport' is not allowed"),
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE 'abc' is not allowed"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "environment variable RANK '3' is not allowed"),
])
def test_a_lesson_started_by_hand_with_bad_rendezvous_variables_is_one_line(variables, says):
    """A lesson script run directly (no torchrun) with a rendezvous variable torch cannot use;
    each process that has it says so (there is no rank 0 to speak for it)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT",
                        "MASTER_ADDR", "TORCHELASTIC_RUN_ID")}
    script = REPO / "lessons" / "01_auto_wrap" / "auto_wrap.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick", "--steps", "2"],
                          env={**env, **variables, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().count("\n") == 0 and says in proc.stderr, proc.stderr[-3000:]


def test_lost_a_rank_reads_the_whole_exception_chain():
    from utilities.distributed import lost_a_rank

    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
        except RuntimeError:
            raise RuntimeError("barrier failed") from None  # as the tear-down's barrier does
    except RuntimeError as e:
        assert lost_a_rank(e)
    assert not lost_a_rank(RuntimeError("CUDA out of memory")) and not lost_a_rank(None)


def test_a_rank_killed_mid_run_is_one_line_naming_it(tmp_path):
    """kill -9 of one rank in a collective: the launcher says which rank died and how, in one
    line; the surviving rank's failed collective (and its tear-down's) print no traceback."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "import torch, torch.distributed as dist\n"
        "from utilities import distributed as D\n"
        "D.setup('cpu')\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).write_text(str(os.getpid()))\n"
        "t = torch.zeros(1)\n"
        "try:\n"
        "    while True:\n"
        "        dist.all_reduce(t)\n"
        "        time.sleep(0.01)\n"
        "finally:\n"
        "    D.teardown()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "utilities.course.torchrun", "--standalone",
                                 "--nproc-per-node=2", str(script)], env=env, cwd=REPO,
                                start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / r).is_file() and (tmp_path / r).read_text() for r in "01"):
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.2)
        time.sleep(0.5)  # both inside the all-reduce loop
        victim = int((tmp_path / "1").read_text())
        os.kill(victim, signal.SIGKILL)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 1
    assert err.strip() == f"error: rank 1 (pid {victim}) was killed by SIGKILL; torchrun stopped the " \
                          "other ranks", err[-3000:]
    assert "Traceback" not in out + err


def test_a_twenty_digit_nproc_is_one_line_before_torchrun_starts():
    proc = cli_here("run", "01", "--quick", "--nproc", "9" * 20)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"error: --nproc {'9' * 20} is not allowed; allowed: integers in " \
                                  "[1, 128] (ranks on this machine)"


# -- README values are text: no fence, heading, list, quote, tag, link or marker from a file ---------

HOSTILE = {"takeaway": "```", "device_name": "[docs](https://evil.example) <b>x</b>",
           "torch": "# 2.13", "date": "> 2026-11-27", "title": "- item\n```python"}


def _readme_folder(tmp_path, lesson="01_auto_wrap"):
    folder = tmp_path / "lessons" / lesson
    folder.mkdir(parents=True)
    for path in (REPO / "lessons" / lesson).glob("*.json"):
        shutil.copy(path, folder / path.name)
    shutil.copy(REPO / "lessons" / lesson / "README.md", folder / "README.md")
    return folder


def test_a_fence_a_link_or_a_heading_in_a_results_file_is_text_and_a_clean_render_restores_it(
        tmp_path, monkeypatch):
    """A takeaway of three backticks (which opened a fence that swallowed the rest of the page), a
    markdown link in the device, a heading, a quote and a list in other fields: the README holds
    the same markup as the committed one (no fence, link, heading, list, tag), and a render from
    the clean file gives back the committed README byte for byte."""
    from markdown_oracle import markup

    from utilities.course import readme_tables

    folder = _readme_folder(tmp_path)
    committed = (folder / "README.md").read_text()
    clean = (folder / "results_cpu.json").read_text()
    results = json.loads(clean)
    results.update(HOSTILE)
    results["variants"][0]["name"] = "# heading"
    results["skipped"] = {"1. first": "```", "* star": "<!-- /results -->"}
    (folder / "results_cpu.json").write_text(json.dumps(results))
    monkeypatch.setattr(readme_tables, "REPO", tmp_path)
    assert readme_tables.check("01", write=True)
    hostile = (folder / "README.md").read_text()
    assert "&#96;&#96;&#96;" in hostile and "&#91;docs&#93;" in hostile  # shown, as text
    assert markup(hostile) == markup(committed)
    assert readme_tables.check("01") == []
    (folder / "results_cpu.json").write_text(clean)
    readme_tables.check("01", write=True)
    assert (folder / "README.md").read_text() == committed


@pytest.mark.parametrize("field, value, says", [
    pytest.param("variants", 10**4000, "a number of 4,001 characters", id="10**4000"),
    ("date", 20261127, "date is 20261127; allowed: a string"),
    ("variants", {"name": "a"}, "variants is {'name': 'a'}; allowed: a list"),
    ("world_size", 0, "world_size is 0; allowed: integers in [1, "),
    ("machine", {"cpu_cores": "16"}, "machine.cpu_cores is '16'; allowed: an integer or null"),
])
def test_a_results_file_of_the_wrong_types_is_one_line_and_the_readme_is_left_as_it_was(
        tmp_path, monkeypatch, capsys, field, value, says):
    from utilities.course import readme_tables

    folder = _readme_folder(tmp_path)
    committed = (folder / "README.md").read_text()
    text = (folder / "results_cpu.json").read_text()
    results = json.loads(text)
    results[field] = "VALUE"
    (folder / "results_cpu.json").write_text(json.dumps(results).replace('"VALUE"', str(value)
                                                                          if isinstance(value, int)
                                                                          else json.dumps(value)))
    monkeypatch.setattr(readme_tables, "REPO", tmp_path)
    assert readme_tables.main(["01", "--write"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: lesson 01: results file") and err.strip().count("\n") == 0, err
    assert says in err
    assert (folder / "README.md").read_text() == committed


def test_a_lesson_section_of_the_wrong_shape_is_one_line(tmp_path, monkeypatch, capsys):
    """A lesson's own section (lesson 08's checkpoint layout) is read by its table only: a list
    where an object was is one line naming the file, not a traceback."""
    from utilities.course import readme_tables

    folder = _readme_folder(tmp_path, "08_local_state_dict")
    results = json.loads((folder / "results_cpu.json").read_text())
    next(v for v in results["variants"] if v["name"] == "fsdp2-dcp")["layout"] = [1, 2]
    (folder / "results_cpu.json").write_text(json.dumps(results))
    monkeypatch.setattr(readme_tables, "REPO", tmp_path)
    assert readme_tables.main(["08"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "does not hold what its table reads (AttributeError" in err


def _report():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import report

    return report


def _bench_results(tmp_path, name="results", **device_names):
    folder = tmp_path / name
    folder.mkdir()
    for path in (REPO / "benchmarks" / "results").glob("*.json"):
        data = json.loads(path.read_text())
        if data.get("benchmark") in device_names:
            data["device_name"] = device_names[data["benchmark"]]
        (folder / path.name).write_text(json.dumps(data))
    return folder


def test_html_and_headings_in_benchmark_results_are_text_and_a_clean_render_removes_them(tmp_path):
    """report.py escaped only ``|``: a device name of HTML, a heading and the block's end marker
    wrote them into benchmarks/README.md, and they stayed once the data was gone. Now they are
    text; and a README a bad render left (its end marker forged inside the block, HTML after it)
    is wholly rewritten by a clean render."""
    from markdown_oracle import markup

    report = _report()
    evil = "<img src=x onerror=alert(1)>\n# pwned\n<!-- results:end -->\nleft behind [x](https://e.x)"
    committed = (REPO / "benchmarks" / "README.md").read_text()
    clean_readme, readme = tmp_path / "clean.md", tmp_path / "README.md"
    for path in (clean_readme, readme):
        path.write_text(committed)
    report.main(["--results-dir", str(_bench_results(tmp_path, "clean")), "--readme", str(clean_readme)])
    clean = clean_readme.read_text()
    hostile_results = _bench_results(tmp_path, end_to_end=evil, layer="```", planner_check="> q")
    report.main(["--results-dir", str(hostile_results), "--readme", str(readme)])
    hostile = readme.read_text()
    assert "&lt;img src=x" in hostile and markup(hostile) == markup(clean)
    assert hostile.count(report.END) == 1
    damaged = committed.replace(report.START, f"{report.START}\n{report.END}\n<img src=x>\n# pwned\n", 1)
    readme.write_text(damaged)
    report.main(["--results-dir", str(_bench_results(tmp_path, "clean2")), "--readme", str(readme)])
    assert readme.read_text() == clean


@pytest.mark.parametrize("calibration, says", [
    ({"device_name": "<script>alert(1)</script>\n# GPU", "date": "[d](https://e.x)"}, None),
    ({"device_name": "H100", "date": 20261127}, "does not hold what its table reads"),
    ({"device_name": "H100", "date": "2026", "measured": {"matmul_tflops": "fast"}},
     "does not hold what its table reads"),
])
def test_a_calibration_file_is_text_or_one_line(tmp_path, monkeypatch, capsys, calibration, says):
    from markdown_oracle import markup

    from utilities.course import evidence

    report = _report()
    data = {"device_name": "NVIDIA Fake", "date": "2026-11-27T10:00:00+00:00",
            "measured": {"matmul_tflops": 650.0, "attention_tflops": 400.0, "memory_gbytes_per_s": 2900.0},
            "efficiencies": {"matmul": 0.657, "attention": 0.404, "memory": 0.866}}
    folder = tmp_path / "2026-11-27-nvidia-fake"
    (folder / "calibrate").mkdir(parents=True)
    (folder / "calibrate" / "calibration.json").write_text(json.dumps(data))
    monkeypatch.setattr(evidence, "evidence_folders", lambda root=None: [folder])
    clean = report.calibration_table()
    (folder / "calibrate" / "calibration.json").write_text(json.dumps({**data, **calibration}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# B\n\n{report.CALIBRATION_START}\nold\n{report.CALIBRATION_END}\n")
    args = ["--results-dir", str(tmp_path / "none"), "--readme", str(readme)]
    if says is None:
        assert report.main(args) == 0
        assert "&lt;script>" in readme.read_text()
        assert markup(report.calibration_table()) == markup(clean)
        return
    with pytest.raises(SystemExit) as e:
        report.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().count("\n") == 0 and says in err, err
    assert "old" in readme.read_text()  # not half-written


def test_a_huge_number_in_a_benchmark_result_is_one_line(tmp_path, capsys):
    report = _report()
    folder = _bench_results(tmp_path)
    text = (folder / "end_to_end-cpu.json").read_text()
    huge = text.replace('"tokens_per_s": ', f'"tokens_per_s": {10**4000}, "x": ', 1)
    (folder / "end_to_end-cpu.json").write_text(huge)
    readme = tmp_path / "README.md"
    readme.write_text("# B\n")
    with pytest.raises(SystemExit) as e:
        report.main(["--results-dir", str(folder), "--readme", str(readme)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().count("\n") == 0 and "4,001 characters" in err, err
    assert readme.read_text() == "# B\n"


def test_a_five_thousand_digit_size_in_a_config_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}")
    proc = cli_here("plan", "--model", str(path), "--no-time")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "a number of 5,000 characters" in proc.stderr


def test_trainable_smaller_than_any_tensor_is_one_line_and_a_plan_says_what_trains():
    """--trainable 1e-7 froze every tensor of llama-tiny and the optimizer was built with none."""
    proc = cli_here("plan", "--model", "llama-tiny", "--trainable", "1e-7", "--no-time")
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.strip().count("\n") == 0
    assert "--trainable 1e-07 is not allowed; allowed: fractions in [0.000153, 1]" in proc.stderr


def test_trainable_says_how_much_actually_trains():
    from utilities.measure import planner as P

    p = P.plan("llama-tiny", 2, 10**12, "full_shard", "fp32", "none", 1, 32, "cpu",
               options={"trainable": 0.5})
    note = next(n for n in p.notes if n.startswith("--trainable"))
    assert note.startswith("--trainable 0.5 planned 418,432 of 836,736 parameters trainable (50.01%)")


def test_a_gpu_run_cannot_forge_the_gpu_block_s_end_marker(tmp_path):
    """The "On a GPU" table ``fsdp-course evidence`` renders from a run: a run holding the block's
    end marker, a fence and a link shows them as text, the README keeps the markup of the clean
    run's render, and rendering the clean run again gives that render back."""
    from markdown_oracle import markup

    from utilities.course.evidence import render_readmes

    clean = json.loads((REPO / "lessons" / "01_auto_wrap" / "results_cpu.json").read_text())
    hostile = {**clean, "takeaway": "<!-- /gpu-results -->\n```\nswallowed", "device_name": "[x](https://e.x)"}
    hostile["variants"] = [{**clean["variants"][0], "name": "<!-- gpu-results:01 -->"},
                           *clean["variants"][1:]]
    run = tmp_path / "ev" / "quick-01"
    run.mkdir(parents=True)
    renders = {}
    for name, results, readme in (("clean", clean, "a"), ("hostile", hostile, "b"), ("again", clean, "b")):
        (run / "results.json").write_text(json.dumps(results))
        lessons = tmp_path / readme / "lessons"
        if not lessons.is_dir():
            (lessons / "01_auto_wrap").mkdir(parents=True)
            shutil.copy(REPO / "lessons/01_auto_wrap/README.md", lessons / "01_auto_wrap" / "README.md")
        assert render_readmes(run.parent, lessons) == ["01"]
        renders[name] = (lessons / "01_auto_wrap" / "README.md").read_text()
    assert "&lt;!-- /gpu-results -->" in renders["hostile"]
    assert renders["hostile"].count("<!-- /gpu-results -->") == 1
    assert markup(renders["hostile"]) == markup(renders["clean"])
    assert renders["again"] == renders["clean"]
