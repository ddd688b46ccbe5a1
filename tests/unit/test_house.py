"""The house's rules (DESIGN §5 and §9), read off the source tree: who may import whom, no import circle,
no file over 500 lines and no class over 400 (docs/architecture.md gives the layout these keep). The size rule
holds for the benchmarks too (bench/*.py): they are read and changed like the packages.

Imports are read from the syntax tree, those inside functions too: a lazy import is an edge like any other.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

PACKAGES = ("pathways_torch", "controller", "executor")
SIZED_TOO = ("bench",)   # under the size rule only, not the import rules: a benchmark may import any part
# The frontend modules that may import the controller: the one that embeds it behind the ControllerClient protocol,
# and pathways-controller's composition root, which hosts it as a service.
CLIENT_MODULES = ("pathways_torch.client", "pathways_torch.launch.controller_main")
SHARED = ("pathways_torch.wire", "pathways_torch.errors")   # what every part may import
MAX_FILE_LINES, MAX_CLASS_LINES = 500, 400


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} (line {self.line})"


def _source_files() -> dict[str, str]:
    """Module name -> path, for every Python file of the three packages (generated protobuf code aside)."""
    found = {}
    for package in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO_ROOT, package)):
            for name in files:
                if name.endswith(".py") and not name.endswith("_pb2.py"):
                    path = os.path.join(root, name)
                    module = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                    found[module.removesuffix(".__init__")] = path
    return found


def _sized_files() -> dict[str, str]:
    """Module name -> path, for every Python file the size rule covers: the packages' and the benchmarks'."""
    found = _source_files()
    for folder in SIZED_TOO:
        for name in sorted(os.listdir(os.path.join(REPO_ROOT, folder))):
            if name.endswith(".py"):
                found[f"{folder}.{name[:-3]}"] = os.path.join(REPO_ROOT, folder, name)
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imported_names(tree: ast.AST, module: str, is_package: bool):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def _edges(files: dict[str, str]) -> list[Edge]:
    """Every import of one project module by another, resolved to the longest module name that exists."""
    edges = set()
    for module, path in files.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for name, line in _imported_names(tree, module, path.endswith("__init__.py")):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(Edge(module, name, line))
    return sorted(edges, key=lambda e: (e.importer, e.imported, e.line))


def _part(module: str) -> str:
    top = module.split(".")[0]
    if top != "pathways_torch":
        return top
    return "shared" if any(module == s or module.startswith(s + ".") for s in SHARED) else "frontend"


def _is_shared(module: str) -> bool:
    return _part(module) == "shared"


def broken_import_rules(edges: list[Edge]) -> list[str]:
    """DESIGN §5: the controller and the executor import only the wire, the errors and themselves; the shared
    modules import only each other; the frontend reaches the controller only through the client module."""
    broken = []
    for edge in edges:
        importer, imported = _part(edge.importer), _part(edge.imported)
        if importer == imported or imported == "shared":
            continue
        if importer == "frontend" and imported == "controller" and edge.importer in CLIENT_MODULES:
            continue
        broken.append(f"{importer} imports {imported}: {edge}")
    return broken


def import_circles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected sets of modules (Tarjan). A package importing its own children is not a circle, nor
    a child importing its own package's ``__init__``."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        a, b = edge.importer, edge.imported
        if b.startswith(a + ".") or a.startswith(b + "."):
            continue
        graph.setdefault(a, set()).add(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def oversized(files: dict[str, str]) -> list[str]:
    too_big = []
    for path in files.values():
        with open(path) as f:
            text = f.read()
        short = os.path.relpath(path, REPO_ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            too_big.append(f"{short}: {text.count(chr(10))} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"{short}: class {node.name} is {node.end_lineno - node.lineno + 1} lines "
                               f"(at most {MAX_CLASS_LINES})")
    return too_big


@pytest.fixture(scope="module")
def files():
    return _source_files()


def test_each_part_imports_only_what_design_allows(files):
    broken = broken_import_rules(_edges(files))
    assert not broken, "imports that cross the parts' boundaries (DESIGN §5):\n" + "\n".join(broken)


def test_no_import_circle(files):
    circles = import_circles(_edges(files))
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_file_or_class_too_big():
    too_big = oversized(_sized_files())
    assert not too_big, "split these by idea (DESIGN §9):\n" + "\n".join(too_big)


def test_the_size_rule_covers_the_benchmarks_and_catches_what_it_forbids(tmp_path):
    """The size check on made-up files: a file one line too long and a class one line too long are reported, a
    file and a class at the limits are not."""
    assert {"bench.islands", "bench.pipeline", "bench.train", "pathways_torch.context"} <= set(_sized_files())
    made_up = {"long": "x = 1\n" * (MAX_FILE_LINES + 1),
               "big_class": "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES,
               "at_limits": "class Fits:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 1)
                            + "y = 2\n" * (MAX_FILE_LINES - MAX_CLASS_LINES)}
    for name, text in made_up.items():
        (tmp_path / f"{name}.py").write_text(text)
    found = oversized({name: str(tmp_path / f"{name}.py") for name in made_up})
    assert [f.split(": ", 1)[1] for f in found] == [
        f"{MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES})",
        f"class Big is {MAX_CLASS_LINES + 1} lines (at most {MAX_CLASS_LINES})"]


def test_the_rules_catch_what_they_forbid():
    """The checks themselves, on made-up edges: each forbidden kind is reported, the allowed ones are not."""
    edges = [Edge("controller.x", "executor.y", 1), Edge("executor.y", "pathways_torch.context", 2),
             Edge("pathways_torch.wire.a", "pathways_torch.array", 3),
             Edge("pathways_torch.array", "controller.x", 4),
             Edge(CLIENT_MODULES[0], "controller.x", 5), Edge("executor.y", "pathways_torch.wire.a", 6),
             Edge("controller.x", "pathways_torch.errors", 7)]
    broken = broken_import_rules(edges)
    assert [b.split(": ", 1)[0] for b in broken] == ["controller imports executor", "executor imports frontend",
                                                     "shared imports frontend", "frontend imports controller"]
    assert import_circles([Edge("a.b", "a.c", 1), Edge("a.c", "a.b", 2), Edge("a", "a.b", 3),
                           Edge("a.b", "a", 4)]) == [["a.b", "a.c"]]


TEST_ONLY_HANDLES = ("controller", "_server", "_data", "_keys", "_cluster")


def context_test_handles(source: str) -> list[str]:
    """What class ``Context`` of ``source`` defines or sets on ``self`` of `TEST_ONLY_HANDLES`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and node.name == "Context"):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and inner.name in TEST_ONLY_HANDLES:
                found.append(f"def {inner.name} (line {inner.lineno})")
            elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store) and inner.id in TEST_ONLY_HANDLES:
                found.append(f"{inner.id} = (line {inner.lineno})")
            elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store) \
                    and isinstance(inner.value, ast.Name) and inner.value.id == "self" \
                    and inner.attr in TEST_ONLY_HANDLES:
                found.append(f"self.{inner.attr} = (line {inner.lineno})")
    return found


def test_the_context_has_no_test_only_surface():
    """Issue 48: `pw.Context` is what users hold; tests and benchmarks reach the parts behind it (the embedded
    controller, its server, the data client, the keys, the local executors) through tests/handles.py."""
    import pathways_torch as pw

    assert [name for name in TEST_ONLY_HANDLES if hasattr(pw.Context, name)] == []
    with open(os.path.join(REPO_ROOT, "pathways_torch", "context.py")) as f:
        assert context_test_handles(f.read()) == []
    made_up = ("class Context:\n    controller = property(lambda self: 1)\n"
               "    def __init__(self):\n        self._keys = 1\n        self.config = 2\n"
               "    @property\n    def _cluster(self):\n        return 3\n")
    assert sorted(context_test_handles(made_up)) == ["controller = (line 2)", "def _cluster (line 7)",
                                                     "self._keys = (line 4)"]
