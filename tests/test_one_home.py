"""One home per name, and one writer of results.json, checked on the source of every lesson script.

* A function or class a lesson script defines never takes the name of a public name of a
  ``utilities`` module: a lesson either imports the library's one (and shows it), or teaches its
  own under a name of its own, so ``grep NAME`` never finds two different things.
* Lesson scripts read ``lesson.results.data`` but never write into it: assignments, ``del`` and
  mutating calls go through ``Results``' methods (``add``, ``setting``, ``record``, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSON_SCRIPTS = sorted((ROOT / "lessons").glob("*/*.py"))
LIBRARY_MODULES = sorted((ROOT / "utilities").rglob("*.py"))

# every lesson script's entry point, as the course CLI's and the planner's are theirs
ENTRY_POINTS = {"main"}
MUTATORS = {"update", "setdefault", "append", "extend", "insert", "pop", "popitem", "clear", "remove",
            "sort", "reverse", "__setitem__", "__delitem__"}


def _top_level_definitions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def _public_names(path: Path) -> set[str]:
    """What a utilities module defines at its top level (functions, classes, assigned names)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def library_names() -> dict[str, str]:
    """Each public name of the utilities package, and the module that defines it."""
    import utilities

    owners: dict[str, str] = {}
    for path in LIBRARY_MODULES:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for name in _public_names(path):
            owners.setdefault(name, module)
    for name in utilities.__all__:
        owners.setdefault(name, "utilities")
    return owners


def name_collisions(scripts: list[Path], lessons_dir: Path) -> dict[tuple[str, str], str]:
    """``(script, name) -> the library's name`` for each lesson definition named like the library's."""
    owners = library_names()
    found = {}
    for script in scripts:
        where = script.relative_to(lessons_dir).as_posix()
        for name in _top_level_definitions(script):
            if name in owners and name not in ENTRY_POINTS:
                found[(where, name)] = f"{owners[name]}.{name}"
    return found


def test_no_lesson_defines_a_name_the_library_owns():
    found = name_collisions(LESSON_SCRIPTS, ROOT / "lessons")
    assert not found, "a lesson script defines a name the utilities own (import theirs, or rename): " + \
        ", ".join(f"{where}: {name} (also {owner})" for (where, name), owner in sorted(found.items()))


def test_the_name_check_sees_a_collision(tmp_path):
    """Not vacuous: a lesson defining ``save_full`` (utilities.state_dict's) or ``fsdp1_meta_init``
    is found; its ``main`` and a name of its own are not."""
    script = tmp_path / "99_x" / "x.py"
    script.parent.mkdir()
    script.write_text("def save_full(path):\n    pass\n\n\nclass fsdp1_meta_init:\n    pass\n\n\n"
                      "def save_full_checkpoint(path):\n    pass\n\n\ndef main():\n    pass\n")
    assert name_collisions([script], tmp_path) == {
        ("99_x/x.py", "save_full"): "utilities.state_dict.save_full",
        ("99_x/x.py", "fsdp1_meta_init"): "utilities.wrapping.fsdp1_meta_init"}


# -- results.data is written by Results only ----------------------------------------------------------
def _is_results(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "results") or \
        (isinstance(node, ast.Attribute) and node.attr == "results")


def _inside_results_data(node: ast.AST) -> bool:
    """``node`` is ``<...>.results.data`` or a subscript / attribute reached from it."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        if isinstance(node, ast.Attribute) and node.attr == "data" and _is_results(node.value):
            return True
        node = node.value
    return False


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def results_data_writes(source: str, filename: str = "<lesson>") -> list[str]:
    """Each place ``source`` writes into ``*.results.data``: ``file:line`` and the code."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        written = [t for t in _targets(node) if isinstance(t, (ast.Subscript, ast.Attribute))
                   and (_inside_results_data(t) or _inside_results_data(t.value))]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS and _inside_results_data(node.func.value):
            written.append(node)
        found += [f"{filename}:{node.lineno}: {ast.unparse(node)[:90]}" for _ in written[:1]]
    return found


@pytest.mark.parametrize("code", [
    'lesson.results.data["capacity"] = cap',
    'cap = lesson.results.data["capacity"] = S.capacity()',
    'lesson.results.data["settings"]["x"] = 1',
    'lesson.results.data["settings"].update(x=1)',
    'lesson.results.data.setdefault("skipped", {})["a"] = "why"',
    'lesson.results.data["variants"][0]["ratio"] += 1',
    'del lesson.results.data["notes"]',
    'results.data["model"] = {}',
    'lesson.results.data["notes"].append("x")',
])
def test_the_write_check_sees_a_write(code):
    assert results_data_writes(code)


@pytest.mark.parametrize("code", [
    'rows = lesson.results.data["variants"]',
    'lesson.results.record("capacity", S.capacity(lesson.results.data["variants"]))',
    'lesson.results.extend_variants(compare(lesson.results.data["variants"]))',
    'data = {}; data["x"] = lesson.results.data["settings"]',
    'lesson.results.setting(x=1)',
])
def test_the_write_check_lets_reads_pass(code):
    assert results_data_writes(code) == []


def test_no_lesson_writes_into_results_data():
    found = [w for script in LESSON_SCRIPTS
             for w in results_data_writes(script.read_text(), str(script.relative_to(ROOT)))]
    assert not found, "write through Results' methods (record, setting, skipped, ...): " + "; ".join(found)


# -- the sharding sequence has one home: utilities/parallelize.py ---------------------------------------
SHARDING_HOME = ROOT / "utilities" / "parallelize.py"


def fully_shard_calls(source: str, filename: str = "<library>") -> list[str]:
    """Each call of ``fully_shard`` in ``source`` (by name or as an attribute), ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name == "fully_shard":
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:90]}")
    return found


def test_the_library_shards_only_in_its_one_home():
    """``fully_shard`` over the blocks is written once in the library, in ``utilities.parallelize``
    (``apply_fsdp``); the planner's fake step, the TP code, ``shard_model`` and the doctor call it.
    The teaching lessons keep their own inline calls (that is what they teach)."""
    found = [c for path in LIBRARY_MODULES if path != SHARDING_HOME
             for c in fully_shard_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "call utilities.parallelize.apply_fsdp instead: " + "; ".join(found)
    assert fully_shard_calls(SHARDING_HOME.read_text())  # the home itself is found


def test_the_sharding_check_sees_a_copy():
    """Not vacuous: the loop of lesson 10 and the fake step, written again, is found (by name and
    as ``torch.distributed.fsdp.fully_shard``); a mention in a docstring is not."""
    copy = ("def shard(model, mesh):\n    '''fully_shard(block) for each block'''\n"
            "    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n"
            "    torch.distributed.fsdp.fully_shard(model, mesh=mesh)\n")
    assert len(fully_shard_calls(copy)) == 2
    assert fully_shard_calls("x = 'fully_shard(model)'\n") == []


def test_no_test_file_imports_another():
    """What tests share lives in helper modules (conftest, gpu_cases, fakes, hostile_files, ...),
    never in another test file: a test file can be read, run and changed on its own."""
    root = Path(__file__).resolve().parent
    found = []
    for path in sorted(root.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(path.name, n) for n in names if n.split(".")[-1].startswith("test_")]
    assert not found, found
