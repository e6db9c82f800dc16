"""The house rules, checked: one-way imports between the package's modules, none hidden inside
functions, and every public function or class importable from the package top level."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import reasoning_from_scratch as pkg

PACKAGE_DIR = Path(pkg.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__")
# chapter indexes re-export a chapter's functions; nothing imports them
INDEXES = [m for m in MODULES if m.startswith("ch0")]


def _relative_imports(module):
    """(imported module, is at module level) for every `from .x import ...` in `module`."""
    tree = ast.parse((PACKAGE_DIR / f"{module}.py").read_text())
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            targets = [node.module] if node.module else [a.name for a in node.names]
            out += [(t.split(".")[0], id(node) in top) for t in targets]
    return out


def test_no_package_import_inside_a_function():
    hidden = {m: [t for t, top in _relative_imports(m) if not top] for m in MODULES}
    assert {m: t for m, t in hidden.items() if t} == {}  # a cycle hidden by a lazy import


def test_imports_between_modules_go_one_way():
    graph = {m: {t for t, _ in _relative_imports(m)} for m in MODULES}
    assert not any(t in INDEXES for deps in graph.values() for t in deps)
    done, path = set(), []

    def visit(m):  # depth-first search for a cycle
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for dep in sorted(graph.get(m, ())):
            visit(dep)
        path.pop()
        done.add(m)

    for m in MODULES:
        visit(m)


def _public_api(module):
    """Functions and classes defined in `module` whose names do not start with '_'."""
    mod = importlib.import_module(f"{pkg.__name__}.{module}")
    return {name: obj for name, obj in vars(mod).items()
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == mod.__name__}


@pytest.mark.parametrize("module", [m for m in MODULES if m not in INDEXES])
def test_every_public_function_is_importable_from_the_top_level(module):
    missing = [name for name, obj in _public_api(module).items()
               if getattr(pkg, name, None) is not obj]
    assert missing == [], f"not exported (or another object) at the top level: {missing}"


def test_all_lists_the_top_level_exports():
    assert sorted(pkg.__all__) == sorted(set(pkg.__all__))
    for name in pkg.__all__:
        assert hasattr(pkg, name), name
