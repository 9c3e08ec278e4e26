"""House rules, checked on the source of every module under utilities/, lessons/ and benchmarks/:

* no module over ``MAX_MODULE_LINES`` lines, no function over ``MAX_FUNCTION_LINES`` lines, no
  function with more than ``MAX_PARAMETERS`` parameters (``self``/``cls`` not counted, ``*args``
  and ``**kwargs`` one each);
* the library (every module under utilities/) never reads ``tests/``: it imports no test module and
  opens no path under ``tests/``;
* a private name (``_x``) of a utilities module stays in it: no other module imports it or reads it
  as ``module._x``;
* every lesson script runs the code it teaches with a smaller harness: one ``# -- the lesson run``
  marker line ends the teaching code (from the end of the imports), and the lines after it, not
  counting ``parse_args`` (the command line), are no more than the lines before it.

Each check lists every offender in one message. The files are parsed once, for all the checks.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("utilities", "lessons", "benchmarks")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 10
# calls that open or look up a path: a "tests" path in one of them is a read of tests/
PATH_CALLS = {"open", "Path", "PurePath", "read_text", "read_bytes", "read_json", "load", "glob", "rglob",
              "joinpath", "exists", "is_file", "is_dir", "iterdir", "listdir", "walk", "scandir",
              "spec_from_file_location", "insert", "append"}
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@functools.cache
def modules() -> tuple[tuple[str, str, ast.Module], ...]:
    """Every checked module: its path from the repository root, its source and its tree."""
    found = []
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            source = path.read_text()
            found.append((path.relative_to(ROOT).as_posix(), source, ast.parse(source, str(path))))
    return tuple(found)


@functools.cache
def names_of_test_modules() -> frozenset[str]:
    """The names a test module is imported by (``conftest``, ``gpu_cases``, ``tests``...)."""
    return frozenset({"tests", *(p.stem for p in (ROOT / "tests").rglob("*.py"))})


def module_name(rel: str) -> str:
    """``utilities/course/evidence.py`` -> ``utilities.course.evidence`` (a package: its folder's)."""
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def report(rule: str, offenders: list[str]) -> str:
    return f"{len(offenders)} {rule}:\n  " + "\n  ".join(offenders)


# -- sizes ----------------------------------------------------------------------------------------
def long_module(rel: str, source: str) -> list[str]:
    lines = len(source.splitlines())
    return [f"{rel}: {lines} lines"] if lines > MAX_MODULE_LINES else []


@functools.cache
def nodes_of(tree: ast.AST) -> tuple[ast.AST, ...]:
    """Every node of a tree, walked once for all the checks."""
    return tuple(ast.walk(tree))


@functools.cache
def functions_of(tree: ast.AST) -> tuple[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef], ...]:
    """Every function, nested ones too, with its qualified name (``Class.method``, ``outer.inner``)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (*FUNCTIONS, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if isinstance(child, FUNCTIONS):
                    found.append((name, child))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return tuple(found)


def long_functions(rel: str, tree: ast.AST) -> list[str]:
    out = []
    for name, fn in functions_of(tree):
        lines = fn.end_lineno - fn.lineno + 1
        if lines > MAX_FUNCTION_LINES:
            out.append(f"{rel}:{fn.lineno} {name}: {lines} lines")
    return out


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def wide_functions(rel: str, tree: ast.AST) -> list[str]:
    return [f"{rel}:{fn.lineno} {name}: {parameter_count(fn)} parameters"
            for name, fn in functions_of(tree) if parameter_count(fn) > MAX_PARAMETERS]


# -- the library never reads tests/ ---------------------------------------------------------------
def is_tests_path(node: ast.AST) -> bool:
    """A string constant naming tests/ or a path under it (``"tests"``, ``"tests/x.py"``)."""
    if isinstance(node, ast.JoinedStr):
        return bool(node.values) and is_tests_path(node.values[0])
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.strip("./").split("/")[0] == "tests")


def reads_of_tests(rel: str, tree: ast.AST) -> list[str]:
    out = []
    for node in nodes_of(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            names = []
        tests = names_of_test_modules()
        out += [f"{rel}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in tests]
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in PATH_CALLS and any(is_tests_path(a) for a in [*node.args,
                                                                      *(k.value for k in node.keywords)]):
                out.append(f"{rel}:{node.lineno} {called}() of a path under tests/")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and is_tests_path(node.right):
            out.append(f"{rel}:{node.lineno} a path joined with tests/")
    return out


# -- private names stay in their module -------------------------------------------------------------
def is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def private_uses(rel: str, tree: ast.AST) -> list[str]:
    """Where a module imports a utilities module's private name, or reads one as ``module._x``
    (through ``import utilities.x as M``, ``from utilities import x`` or the dotted name)."""
    own = module_name(rel)
    package = own if rel.endswith("__init__.py") else own.rpartition(".")[0]
    bound: dict[str, str] = {}  # a local name -> the utilities module it holds
    out = []
    for node in nodes_of(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "utilities":
                    bound[alias.asname or alias.name.split(".")[0]] = (alias.name if alias.asname
                                                                       else "utilities")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + [base]).strip(".")
            if base.split(".")[0] != "utilities" or base == own:
                continue
            for alias in node.names:
                if is_private(alias.name):
                    out.append(f"{rel}:{node.lineno} imports {base}.{alias.name}")
                else:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in nodes_of(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            held = dotted(node.value, bound)
            if held is not None and held != own and is_module(held):
                out.append(f"{rel}:{node.lineno} reads {held}.{node.attr}")
    return out


@functools.cache
def is_module(name: str) -> bool:
    """Whether a dotted name is a module of the repository (a file, or a package's folder)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """The utilities module an expression names (``M``, ``utilities.course.evidence``), else None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = dotted(node.value, bound)
        return f"{base}.{node.attr}" if base is not None else None
    return None


# -- a lesson script: the code it teaches, then a smaller harness ----------------------------------
LESSON_RUN_MARKER = "# -- the lesson run"


def teaching_and_harness(source: str, tree: ast.Module) -> tuple[int, int] | None:
    """Lines of the code a lesson script teaches (after its last top-level import, before the
    ``# -- the lesson run`` marker) and of its harness (after the marker, ``parse_args`` not counted);
    None unless the marker is there exactly once."""
    lines = source.splitlines()
    marks = [number for number, line in enumerate(lines, 1) if line.startswith(LESSON_RUN_MARKER)]
    if len(marks) != 1:
        return None
    imports = (ast.Import, ast.ImportFrom)
    imports_end = max((node.end_lineno for node in tree.body if isinstance(node, imports)), default=0)
    command_line = sum(node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
                       for node in tree.body if isinstance(node, FUNCTIONS)
                       and node.name == "parse_args" and node.lineno > marks[0])
    return marks[0] - 1 - imports_end, len(lines) - marks[0] - command_line


def bigger_harness(rel: str, source: str, tree: ast.Module) -> list[str]:
    counts = teaching_and_harness(source, tree)
    if counts is None:
        return [f"{rel}: not one line starting {LESSON_RUN_MARKER!r}"]
    teaching, harness = counts
    return [f"{rel}: teaching {teaching} lines, harness {harness}"] if harness > teaching else []


# -- the checks on the repository -------------------------------------------------------------------
def everywhere(check) -> list[str]:
    return [o for rel, source, tree in modules() for o in check(rel, source, tree)]


def library(check) -> list[str]:
    return [o for rel, source, tree in modules() if rel.startswith("utilities/") for o in check(rel, tree)]


def test_no_module_is_over_800_lines():
    offenders = everywhere(lambda rel, source, tree: long_module(rel, source))
    assert not offenders, report(f"modules over {MAX_MODULE_LINES} lines (split by what they do)", offenders)


def test_no_function_is_over_80_lines():
    offenders = everywhere(lambda rel, source, tree: long_functions(rel, tree))
    assert not offenders, report(f"functions over {MAX_FUNCTION_LINES} lines", offenders)


def test_no_function_takes_more_than_10_parameters():
    offenders = everywhere(lambda rel, source, tree: wide_functions(rel, tree))
    assert not offenders, report(f"functions with more than {MAX_PARAMETERS} parameters", offenders)


def test_the_library_never_reads_tests():
    offenders = library(reads_of_tests)
    assert not offenders, report("reads of tests/ in the library", offenders)


def test_private_names_stay_in_their_module():
    offenders = everywhere(lambda rel, source, tree: private_uses(rel, tree))
    assert not offenders, report("private names used outside their utilities module", offenders)


def test_every_lesson_script_runs_its_code_with_a_smaller_harness():
    from utilities.course.catalog import LESSONS

    parsed_modules = {rel: (source, tree) for rel, source, tree in modules()}
    offenders = []
    for info in LESSONS.values():
        rel = info.script_path.relative_to(ROOT).as_posix()
        offenders += bigger_harness(rel, *parsed_modules[rel])
    assert not offenders, report("lesson scripts whose harness outgrows the code they teach (move the "
                                 "driver into a module beside the script)", offenders)


# -- each check can fail ----------------------------------------------------------------------------
def parsed(code: str) -> ast.Module:
    return ast.parse(code)


def test_the_size_checks_see_a_long_module_a_long_function_and_a_wide_one():
    assert long_module("utilities/x.py", "x = 1\n" * 801) == ["utilities/x.py: 801 lines"]
    assert long_module("utilities/x.py", "x = 1\n" * 800) == []
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    assert long_functions("u.py", parsed(f"def f():\n{body}")) == []  # 80 lines
    nested = parsed("class C:\n    def m(self):\n        def inner():\n"
                    + textwrap.indent(body, " " * 8) + "            return 1\n")
    assert long_functions("u.py", nested) == ["u.py:2 C.m: 82 lines", "u.py:3 C.m.inner: 81 lines"]
    nine = ", ".join(f"a{i}" for i in range(9))
    assert wide_functions("u.py", parsed(f"def f({nine}, *args, **kw): pass")) == ["u.py:1 f: 11 parameters"]
    assert wide_functions("u.py", parsed(f"class C:\n    def m(self, {nine}, *, b): pass")) == []


@pytest.mark.parametrize("code", [
    "import conftest", "from gpu_cases import CASES", "import tests.readme_claims",
    "open('tests/gpu_cases.py')", "Path('tests') / 'x.py'", "ROOT / 'tests' / 'x.py'",
    "(ROOT / 'tests/gpu_cases.py').read_text()", "sys.path.insert(0, 'tests')",
    "ROOT.joinpath(f'tests/{name}')",
])
def test_the_tests_check_sees_a_read(code):
    assert len(reads_of_tests("utilities/x.py", parsed(code))) == 1, code


def test_the_tests_check_lets_a_command_naming_a_test_pass():
    """The evidence command runs the GPU tests: naming them in a command is not reading them."""
    code = 'smoke = "tests/gpu/test_gpu_smoke.py"\nstep = ("pytest", f"{smoke}::test_x")\n'
    assert reads_of_tests("utilities/x.py", parsed(code)) == []


@pytest.mark.parametrize("code", [
    "from utilities.safe_files import _atomic", "from utilities.course.evidence import _relative as r",
    "from utilities import dcp as D\nD._check()", "import utilities.dcp as D\nD._check",
    "import utilities.dcp\nutilities.dcp._check()", "from utilities import dcp\ndcp._check()",
    "from .catalog import _x",
])
def test_the_private_check_sees_a_use(code):
    assert len(private_uses("utilities/course/other.py", parsed(code))) == 1, code


def test_the_private_check_lets_own_dunder_and_public_names_pass():
    code = ("from utilities.course.other import _mine\nimport utilities\nutilities.__version__\n"
            "from utilities import dcp\ndcp.check()\nself._private = 1\nfrom torch import _C\n"
            "from utilities.course.evidence import Manifest\nManifest._fields\n")
    assert private_uses("utilities/course/other.py", parsed(code)) == []


def test_the_harness_check_counts_teaching_and_harness_lines():
    head = "import torch\n\n\ndef shard(m):\n    return m\n"
    run = "# -- the lesson run ---\ndef main(args):\n    pass\n"
    command_line = "\n\ndef parse_args(argv=None):\n" + "    x = 1\n" * 20
    small = head + run + command_line
    assert teaching_and_harness(small, parsed(small)) == (4, 4)  # 2 blank lines, main; not parse_args
    assert bigger_harness("l.py", small, parsed(small)) == []
    big = small + "".join(f"x{i} = {i}\n" for i in range(2))
    assert bigger_harness("l.py", big, parsed(big)) == ["l.py: teaching 4 lines, harness 6"]
    unmarked = head + command_line
    assert bigger_harness("l.py", unmarked, parsed(unmarked)) == [
        "l.py: not one line starting '# -- the lesson run'"]
