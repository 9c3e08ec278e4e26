"""Every import among ``utilities/`` modules points down: no module imports, at its top or inside a
function, one that imports it back (directly or through others). The circles still open are
listed by name in ``KNOWN_CIRCLES``, each with who closes it; remove an entry once it is closed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Circles owned elsewhere, each a set of modules; a circle found must lie inside one of them.
KNOWN_CIRCLES: tuple[frozenset[str], ...] = ()


def module_imports(root: Path, package: str = "utilities") -> dict[str, set[str]]:
    """Each module of ``package`` under ``root`` and the modules of the package it imports,
    wherever the import statement stands (lazy imports inside functions count)."""
    paths = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted((root / package).rglob("*.py"))}
    edges: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"  # `from pkg import submodule`
                    if target in paths:
                        edges[name].add(target)
                    elif node.module in paths:
                        edges[name].add(node.module)
        edges[name].discard(name)
    return edges


def import_circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The groups of modules that reach each other through imports (strongly connected
    components of more than one module), by Tarjan's algorithm without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(frozenset(group))
    return circles


def test_no_import_circle_among_the_library_modules():
    circles = import_circles(module_imports(ROOT))
    unknown = [c for c in circles if not any(c <= known for known in KNOWN_CIRCLES)]
    assert not unknown, "import circles (give the shared pieces one home below both): " + "; ".join(
        " <-> ".join(sorted(c)) for c in unknown)


def test_the_circle_check_finds_a_circle_through_a_lazy_import(tmp_path):
    """Not vacuous: a -> b at the top, b -> c, c -> a inside a function is one circle of three;
    d, which only imports a, is in none."""
    package = tmp_path / "utilities"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from utilities.b import x\n")
    (package / "b.py").write_text("from utilities import c\nx = 1\n")
    (package / "c.py").write_text("def f():\n    import utilities.a\n")
    (package / "d.py").write_text("from utilities.a import x\n")
    circles = import_circles(module_imports(tmp_path))
    assert circles == [frozenset({"utilities.a", "utilities.b", "utilities.c"})]


def course_imports(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The library modules (all of ``utilities`` but ``utilities.course`` and the ``python -m
    utilities`` entry point) that import a module of ``utilities.course``, and which."""
    def course(name: str) -> bool:
        return name == "utilities.course" or name.startswith("utilities.course.")

    return {name: {t for t in targets if course(t)} for name, targets in edges.items()
            if not course(name) and name != "utilities.__main__" and any(course(t) for t in targets)}


def test_the_library_never_imports_the_course():
    """The course (lessons' harness, results, the CLI) sits on the library, never under it."""
    found = course_imports(module_imports(ROOT))
    assert not found, "library modules importing utilities.course: " + "; ".join(
        f"{name} -> {', '.join(sorted(t))}" for name, t in sorted(found.items()))


def test_the_layer_check_sees_a_library_module_importing_the_course(tmp_path):
    """Not vacuous: a lazy import of the course in a library module is found; the entry point's
    import of the course is allowed."""
    package = tmp_path / "utilities"
    (package / "course").mkdir(parents=True)
    for path in ("__init__.py", "course/__init__.py", "course/lesson.py"):
        (package / path).write_text("")
    (package / "training.py").write_text("def f():\n    from utilities.course.lesson import x\n")
    (package / "__main__.py").write_text("from utilities.course import lesson\n")
    assert course_imports(module_imports(tmp_path)) == {"utilities.training": {"utilities.course.lesson"}}
