"""The house's second step (issue 48, DESIGN §9), read off the source tree: no part reaches into another object's
private names (at most `MAX_PRIVATE_REACHES` in the three packages, each listed in the failure), and no class is
mostly one-line forwards to the objects it holds (at most `MAX_FORWARDS` each).

A reach is ``x._name`` where ``x`` is not ``self``, ``cls``, ``super()`` nor a module or name the file imports
(``torch._C`` is the module's own business; ``runner._built`` is another object's). A forward is a method whose
whole body, a docstring aside, is ``[return] self.a.b(...)``.
"""

from __future__ import annotations

import ast
import os

import pytest

from tests.unit.test_house import _source_files

pytestmark = pytest.mark.timeout(60)

MAX_PRIVATE_REACHES = 15   # what is left reaches into torch's, gloo's and torchax's objects (no public spelling)
MAX_FORWARDS = 8


def _imported_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def private_reaches(source: str) -> list[int]:
    """The lines of ``source`` that read or write another object's ``_private`` name."""
    tree = ast.parse(source)
    imported, lines = _imported_names(tree), []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        base = node.value
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in imported):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        lines.append(node.lineno)
    return lines


def forwards(cls: ast.ClassDef) -> int:
    """How many of ``cls``'s methods are one-line forwards (``[return] self.a.b(...)``)."""
    count = 0
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = [s for s in method.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        value = body[0].value if len(body) == 1 and isinstance(body[0], (ast.Return, ast.Expr)) else None
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                and isinstance(value.func.value, ast.Attribute) and isinstance(value.func.value.value, ast.Name) \
                and value.func.value.value.id == "self":
            count += 1
    return count


def forwarding_classes(source: str) -> list[tuple[str, int]]:
    """The classes of ``source`` with more than `MAX_FORWARDS` one-line forwards, and how many each has."""
    return [(node.name, forwards(node)) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and forwards(node) > MAX_FORWARDS]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_at_most_fifteen_reaches_into_another_objects_private_names():
    found = [f"{os.path.relpath(path)}:{line}" for path in _source_files().values()
             for line in private_reaches(_read(path))]
    assert len(found) <= MAX_PRIVATE_REACHES, \
        f"{len(found)} reaches into another object's private names (at most {MAX_PRIVATE_REACHES}): hand the " \
        f"object what it needs, or give the owner a public method:\n" + "\n".join(found)


def test_no_class_is_mostly_one_line_forwards():
    found = [f"{os.path.relpath(path)}: class {name} has {count} one-line forwards (at most {MAX_FORWARDS})"
             for path in _source_files().values() for name, count in forwarding_classes(_read(path))]
    assert not found, "let callers reach the part that does the work:\n" + "\n".join(found)


def test_the_measures_catch_what_they_forbid():
    """The checks on made-up code: each kind of reach and a forwarding class are found, the allowed forms are not."""
    code = (
        "import torch\n"
        "from x import helper\n"
        "class A(B):\n"
        "    def f(self, other):\n"
        "        self._mine = other._theirs\n"        # line 5: one reach (other._theirs)
        "        super()._parent()\n"
        "        torch._C.thing()\n"                  # an imported module's own name
        "        helper._cache.clear()\n"             # an imported name
        "        return cls._x, self.__dict__, other.public\n"
        "    def g(self):\n"
        "        self.part._hidden = 1\n"             # line 11: a reach through an attribute
        "        make()._made\n")                     # line 12: a reach into a call's result
    assert private_reaches(code) == [5, 11, 12]
    forwarding = "class F:\n" + "".join(
        f"    def m{i}(self):\n        \"\"\"doc\"\"\"\n        return self.part.m{i}()\n"
        for i in range(MAX_FORWARDS + 1))
    at_limit = "class G:\n" + "".join(f"    def m{i}(self):\n        self.part.m{i}()\n" for i in range(MAX_FORWARDS)) \
        + "    def own(self):\n        x = self.part.y()\n        return x\n"
    assert forwarding_classes(forwarding) == [("F", MAX_FORWARDS + 1)]
    assert forwarding_classes(at_limit) == []
