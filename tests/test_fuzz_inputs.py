"""Property-based fuzzing (hypothesis) of every reader and renderer of files the course did not
write: bounded JSON (``utilities.json_input``), results.json (``utilities.results``) and
the lesson README tables rendered from it (``utilities.course.readme_tables``), the benchmark
result files and calibration.json that ``benchmarks/report.py`` renders into benchmarks/README.md,
a ``--model`` config.json (``utilities.models``), and ``plan --trainable``.

Each property holds for every generated input: a one-line refusal (``UsageError``, or
``SystemExit(2)`` with one line on stderr) or a correct result, within ``TIME_BOUND_S`` per
example, with nothing written outside the example's temporary folder (the module checks the
repository is untouched). A renderer's README holds the same markup as the render of the clean
files (``markdown_oracle``: no tag, fence, heading, list, quote, rule, image or link, no bare URL
from a value), its marked blocks intact, and a render from the clean files gives it back.

Budget: by default each property runs a few examples (``DEFAULT_EXAMPLES``, the whole file in
seconds), derandomized: the same examples every run, so the suite cannot flake. A longer run
draws random examples instead, as many per property as the variable says:

    FSDP_COURSE_FUZZ_EXAMPLES=2000 python -m pytest -n 0 tests/test_fuzz_inputs.py

(a failure prints the smallest example found and ``@reproduce_failure`` to replay it).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from markdown_oracle import live_in_a_value, markup

from utilities.course.catalog import LESSONS
from utilities.errors import UsageError

# hypothesis keeps what it learns (the constants of the code under test) in a folder of its own,
# by default .hypothesis in the working directory: here a temporary one, removed at exit
_HOME = tempfile.mkdtemp(prefix="fsdp-course-hypothesis-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
set_hypothesis_home_dir(_HOME)
EXAMPLES = int(os.environ.get("FSDP_COURSE_FUZZ_EXAMPLES", "0"))
DEFAULT_EXAMPLES = {"escape": 150, "json": 60, "lesson": 25, "results": 40, "report": 15,
                    "calibration": 20, "config": 8, "trainable": 40}
TIME_BOUND_S = 20.0  # per example; each takes milliseconds (a config build, a tenth of a second)


def budget(kind: str):
    return settings(max_examples=EXAMPLES or DEFAULT_EXAMPLES[kind], derandomize=not EXAMPLES,
                    database=None, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# -- what is generated ------------------------------------------------------------------------------
# the first are the ones generation and shrinking start from
FRAGMENTS = ["[x](https://evil.example)", "https://evil.example", "<!-- /results -->", "\n```\n",
             "```", "~~~", "# ", "###### ", "> ", "- ", "+ ", "* ", "1. ", "2) ", "***", "___", "---",
             "===", "    ", "\t", "\n", "\r\n", "\r", "<", ">", "&", "&amp;", "&#96;", "&lt;", "`", "[",
             "]", "(", ")", "!", "|", "\\", "<!-- /results -->", "<!-- results:01 results_cpu.json -->",
             "<!-- results:end -->", "<!-- calibration:start -->", "<!-- /predicted -->",
             "<!-- /gpu-results -->", "<script>alert(1)</script>", "<img src=x onerror=alert(1)>",
             "[x](https://evil.example)", "![i](x.png)", "https://evil.example", "www.evil.example",
             "a@evil.example", "<https://evil.example>", "[x]: https://e", "\u2028", "\x00", "é", "💥"]
# text that starts with markup (a fence, a marker, a tag, a link...) and goes on with more or with
# anything at all
hostile_text = st.builds(lambda head, rest: head + "".join(rest), st.sampled_from(FRAGMENTS),
                         st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=6))
numbers = (st.integers() | st.floats() | st.sampled_from([10**40, -(10**39), 10**4000, 2**63, 1e308])
           | st.booleans() | st.none())
json_values = st.recursive(numbers | hostile_text,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner,
                                                                                       max_size=4),
                           max_leaves=12)


def one_line(text: str) -> bool:
    return bool(text.strip()) and "\n" not in text.strip()


def string_paths(value, path=()):
    """Where ``value`` holds a string: (path, None) for a value, (path, key) for a dict's key."""
    if isinstance(value, str):
        yield path, None
    elif isinstance(value, dict):
        for key, item in value.items():
            yield path, key
            yield from string_paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from string_paths(item, (*path, i))


def with_strings(value, replacements):
    """``value`` with the strings (or keys) at the ``string_paths`` given replaced."""
    value = copy.deepcopy(value)
    # values first, then keys from the deepest up, so that a renamed key moves no path still to come
    for (path, key), text in sorted(replacements, key=lambda r: (r[0][1] is not None, -len(r[0][0]))):
        parent = value
        for part in path[:-1] if key is None else path:
            parent = parent[part]
        if key is None:
            parent[path[-1]] = text
        elif key in parent and text not in parent:
            parent[text] = parent.pop(key)
    return value


ABSENT = object()  # put's item: the key removed


def put(value, path, item):
    value = copy.deepcopy(value)
    parent = value
    for part in path[:-1]:
        parent = parent[part]
    if item is ABSENT:
        parent.pop(path[-1], None)
    else:
        parent[path[-1]] = item
    return value


@contextlib.contextmanager
def timed():
    start = time.perf_counter()
    yield
    assert time.perf_counter() - start < TIME_BOUND_S


def refused(run) -> tuple[bool, str]:
    """Run ``run()``: (False, "") when it returns, (True, its one line) when it refuses; anything
    else (a traceback) fails the property."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run()
    except UsageError as e:
        assert one_line(str(e)), str(e)
        return True, str(e)
    except SystemExit as e:
        assert e.code == 2 and one_line(err.getvalue()), err.getvalue()
        return True, err.getvalue()
    return False, ""


@pytest.fixture(scope="module", autouse=True)
def repository_untouched():
    """Nothing a property runs writes into the repository's files these readers and renderers
    could reach (its READMEs, result files and configs; each example has its own folder), nor a
    .hypothesis folder into the working directory. (Other files are left to other tests, which
    may run beside these.)"""
    def files():
        found = {}
        for pattern in ("*.md", "lessons/*/*.md", "lessons/*/*.json", "benchmarks/*.md",
                        "benchmarks/results/**/*.json", "benchmarks/results/**/*.md"):
            for path in REPO.glob(pattern):
                info = path.stat()
                found[path] = (info.st_mtime_ns, info.st_size)
        return found

    before, home_before = files(), (Path.cwd() / ".hypothesis").exists()
    yield
    assert files() == before
    assert (Path.cwd() / ".hypothesis").exists() == home_before


# -- the escaping function ------------------------------------------------------------------------
@budget("escape")
@given(hostile_text)
def test_an_escaped_value_is_one_line_of_text_wherever_it_stands(text):
    from utilities.text import markdown_escape

    escaped = markdown_escape(text)
    assert "\n" not in escaped and "\r" not in escaped
    assert markdown_escape(escaped) == escaped
    assert live_in_a_value(escaped) == []


# -- bounded JSON -----------------------------------------------------------------------------------
raw_json = (st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode())
            | st.tuples(st.integers(0, 300), st.sampled_from(["[", "{\"a\":"]), st.integers(1, 6000)).map(
                lambda t: (t[1] * t[0] + "9" * t[2] + ("]" if t[1] == "[" else "}") * t[0]).encode()))


@budget("json")
@given(raw_json)
def test_any_bytes_read_as_json_are_a_bounded_value_or_one_line(data):
    from utilities.json_input import MAX_JSON_DEPTH, MAX_JSON_NUMBER_CHARS, json_depth, read_json

    with tempfile.TemporaryDirectory() as folder, timed():
        path = Path(folder) / "x.json"
        path.write_bytes(data)
        try:
            value = read_json(path)
        except UsageError as e:
            assert one_line(str(e))
            return
    assert json_depth(value) <= MAX_JSON_DEPTH
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            assert len(str(abs(item))) <= MAX_JSON_NUMBER_CHARS
        pending.extend(item.values() if isinstance(item, dict) else item if isinstance(item, list) else ())


# -- lesson README tables -----------------------------------------------------------------------------
LESSON_FILES = {n: LESSONS[n].folder for n in ("01", "02", "04", "08", "09")}


def lesson_copy(root: Path, lesson: str) -> Path:
    folder = root / "lessons" / LESSON_FILES[lesson]
    folder.mkdir(parents=True)
    for path in (REPO / "lessons" / LESSON_FILES[lesson]).glob("*.json"):
        shutil.copy(path, folder / path.name)
    shutil.copy(REPO / "lessons" / LESSON_FILES[lesson] / "README.md", folder / "README.md")
    return folder


# the parts of a results file its README table shows
RENDERED = {"lesson", "title", "device", "device_name", "torch", "date", "model", "settings", "variants",
            "skipped", "takeaway", "batch_search", "capacity"}


@budget("lesson")
@given(st.sampled_from(sorted(LESSON_FILES)), st.data())
def test_hostile_strings_in_a_results_file_leave_the_readme_s_markup_as_it_was(lesson, data):
    """Strings (values and keys) of a committed results file replaced by hostile text: the README
    renders with the committed one's markup, or the file is refused in one line and the README
    is untouched; a render from the clean file gives the committed README back."""
    from utilities.course import readme_tables

    committed = (REPO / "lessons" / LESSON_FILES[lesson] / "README.md").read_text()
    clean = json.loads((REPO / "lessons" / LESSON_FILES[lesson] / "results_cpu.json").read_text())
    shown = [(path, key) for path, key in string_paths(clean)
             if path and path[0] in RENDERED and len(path) <= 3]
    values = [(path, key) for path, key in shown if key is None]
    keys = [(path, key) for path, key in shown
            if key is not None and path[0] in ("variants", "settings", "skipped")]
    where = st.sampled_from(values) | st.sampled_from(keys)
    replacements = data.draw(st.lists(st.tuples(where, hostile_text), min_size=1, max_size=6))
    with tempfile.TemporaryDirectory() as root, pytest.MonkeyPatch.context() as patch, timed():
        patch.setattr(readme_tables, "REPO", Path(root))
        folder = lesson_copy(Path(root), lesson)
        (folder / "results_cpu.json").write_text(json.dumps(with_strings(clean, replacements)))
        was_refused, _ = refused(lambda: readme_tables.check(lesson, write=True))
        after = (folder / "README.md").read_text()
        if was_refused:
            assert after == committed
        else:
            assert markup(after) == markup(committed)
            assert readme_tables.check(lesson) == []
        (folder / "results_cpu.json").write_text(json.dumps(clean))
        readme_tables.check(lesson, write=True)
        assert (folder / "README.md").read_text() == committed


RESULT_KEYS = ["lesson", "title", "device", "device_name", "machine", "world_size", "torch", "date",
               "model", "settings", "variants", "notes", "columns", "takeaway", "skipped", "predicted",
               "batch_search", "capacity"]
VARIANT_KEYS = ["name", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "losses", "layout",
                "fisher_time_s", "kept_fraction", "load_s", "rank0_file_bytes"]
RENDERS = [("01", "01_auto_wrap", None), ("02", "02_activation_checkpointing", "search"),
           ("06", "06_sharding_strategies", "capacity"), ("08", "08_local_state_dict", None),
           ("09", "09_fine_tuning", None)]


@budget("results")
@given(st.sampled_from(RENDERS), st.sampled_from(RESULT_KEYS) | st.tuples(st.integers(0, 3),
                                                                          st.sampled_from(VARIANT_KEYS)),
       json_values | st.just(ABSENT))
def test_any_value_in_a_results_file_is_read_and_rendered_or_one_line(render, key, value):
    """A JSON value of any kind where a results file has a key (or a variant's), or the key
    removed: ``load`` returns it or refuses in one line, and what it returns renders or is refused
    in one line."""
    from utilities.course.readme_tables import render as render_table
    from utilities.results import load

    lesson, folder, name = render
    results = json.loads((REPO / "lessons" / folder / "results_cpu.json").read_text())
    if isinstance(key, tuple):
        index, field = key
        if index >= len(results["variants"]):
            return
        results = put(results, ("variants", index, field), value)
    else:
        results = put(results, (key,), value)
    with tempfile.TemporaryDirectory() as root, timed():
        path = Path(root) / "results.json"
        try:
            path.write_text(json.dumps(results))
        except ValueError:  # 10**4000 and beyond: json.dumps refuses to write it, so no file has it
            return
        loaded = {}
        was_refused, _ = refused(lambda: loaded.update(load(path)))
        if not was_refused:
            refused(lambda: render_table(lesson, loaded, "results.json", name=name))


# -- benchmarks/README.md -----------------------------------------------------------------------------
def report_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import report

    return report


BENCH_FILES = sorted(p.name for p in (REPO / "benchmarks" / "results").glob("*-cpu.json")
                     if "benchmark" in json.loads(p.read_text()))


def bench_folder(root: Path, changed: dict[str, object]) -> Path:
    folder = root / f"results-{len(list(root.iterdir()))}"
    folder.mkdir()
    for name in BENCH_FILES:
        value = changed.get(name, json.loads((REPO / "benchmarks" / "results" / name).read_text()))
        (folder / name).write_text(json.dumps(value))
    return folder


@budget("report")
@given(st.data())
def test_hostile_benchmark_results_render_as_text_or_one_line_and_a_clean_render_restores(data):
    """Hostile strings in the benchmark result files, or any JSON value at one of their keys:
    report.py writes a README with the clean render's markup, or refuses in one line and leaves
    it as it was; a clean render afterwards gives the clean README back."""
    report = report_module()
    name = data.draw(st.sampled_from(BENCH_FILES))
    original = json.loads((REPO / "benchmarks" / "results" / name).read_text())
    if not data.draw(st.booleans()):  # False first: generation and shrinking start there
        # the strings a row shows (not those that say which rows a file fills)
        paths = [(path, key) for path, key in string_paths(original) if key is None and len(path) <= 3
                 and path[0] not in ("benchmark", "device", "measured_on")]
        changed = with_strings(original, data.draw(st.lists(st.tuples(st.sampled_from(paths), hostile_text),
                                                            min_size=1, max_size=6)))
    else:
        keys = [(k,) for k in original] + [(k, 0, sub) for k, v in original.items()
                                           if isinstance(v, list) and v and isinstance(v[0], dict)
                                           for sub in v[0]]
        changed = put(original, data.draw(st.sampled_from(keys)), data.draw(json_values | st.just(ABSENT)))
    committed = (REPO / "benchmarks" / "README.md").read_text()
    with tempfile.TemporaryDirectory() as root, timed():
        root = Path(root)
        clean_readme, readme = root / "clean.md", root / "README.md"
        clean_readme.write_text(committed)
        readme.write_text(committed)
        report.main(["--results-dir", str(bench_folder(root, {})), "--readme", str(clean_readme)])
        clean = clean_readme.read_text()
        try:
            hostile = bench_folder(root, {name: changed})
        except ValueError:  # a number json.dumps will not write
            return
        args = ["--results-dir", str(hostile), "--readme", str(readme)]
        was_refused, _ = refused(lambda: report.main(args))
        if was_refused:
            assert readme.read_text() == committed
        else:
            assert markup(readme.read_text(), rows=False) == markup(clean, rows=False)
        report.main(["--results-dir", str(bench_folder(root, {})), "--readme", str(readme)])
        assert readme.read_text() == clean


CALIBRATION = {"device_name": "NVIDIA Fake", "date": "2026-11-27T10:00:00+00:00",
               "measured": {"matmul_tflops": 650.0, "attention_tflops": 400.0, "memory_gbytes_per_s": 2900.0},
               "efficiencies": {"matmul": 0.657, "attention": 0.404, "memory": 0.866}}


@budget("calibration")
@given(st.sampled_from([("device_name",), ("date",), ("measured",), ("efficiencies",),
                        ("measured", "matmul_tflops"), ("efficiencies", "memory")]),
       hostile_text | json_values)
def test_any_calibration_file_renders_as_text_or_one_line(key, value):
    from utilities.course import evidence

    report = report_module()
    with tempfile.TemporaryDirectory() as root, pytest.MonkeyPatch.context() as patch, timed():
        folder = Path(root) / "2026-11-27-nvidia-fake"
        (folder / "calibrate").mkdir(parents=True)
        patch.setattr(evidence, "evidence_folders", lambda root=None: [folder])
        (folder / "calibrate" / "calibration.json").write_text(json.dumps(CALIBRATION))
        clean = markup(report.calibration_table())
        try:
            (folder / "calibrate" / "calibration.json").write_text(json.dumps(put(CALIBRATION, key, value)))
        except ValueError:
            return
        table = {}
        if not refused(lambda: table.update(text=report.calibration_table()))[0]:
            assert markup(table["text"]) == clean


# -- config.json and --trainable ----------------------------------------------------------------------
TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}
CONFIG_KEYS = [*TINY_CONFIG, "text_config", "rope_scaling", "torch_dtype", "hidden_act", "head_dim",
               "tie_word_embeddings", "pad_token_id", "auto_map", "num_local_experts"]


@budget("config")
@given(st.sampled_from(CONFIG_KEYS), json_values)
def test_any_value_in_a_config_builds_a_model_or_is_one_line(key, value):
    from utilities.models import spec_from_config_file

    with tempfile.TemporaryDirectory() as root, timed():
        path = Path(root) / "config.json"
        try:
            path.write_text(json.dumps({**TINY_CONFIG, key: value}))
        except ValueError:
            return
        spec = {}
        if not refused(lambda: spec.update(s=spec_from_config_file(str(path))))[0]:
            assert spec["s"].num_parameters > 0


@budget("trainable")
@given(st.floats(min_value=0, max_value=1, exclude_min=True) | st.sampled_from([1e-300, 1e-7, 5e-324]),
       st.lists(st.integers(1, 64), min_size=1, max_size=6))
def test_trainable_trains_at_least_one_tensor_or_is_one_line(fraction, widths):
    """Whole tensors freeze; a fraction too small for the smallest is refused in one line, any
    other leaves the optimizer at least one tensor and at least the fraction asked for."""
    import torch
    from torch import nn

    from utilities.measure.plan_options import freeze_fraction

    blocks = [nn.Linear(w, 8) for w in widths]
    model = nn.Sequential(*blocks)
    total = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        trained = {}
        if refused(lambda: trained.update(n=freeze_fraction(model, blocks, fraction)))[0]:
            assert fraction * total < min(p.numel() for p in model.parameters())
            return
    train = [p for p in model.parameters() if p.requires_grad]
    assert train and trained["n"] == sum(p.numel() for p in train)
    assert trained["n"] >= math.floor(fraction * total)
