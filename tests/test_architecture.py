"""The house rules, checked: a flat core that never imports the drivers beside it (`cli/`,
`experiments/`), imports that go one way and sit at module level, chapter indexes and the top
level whose every name resolves, and a short `__init__.py`. The layering is also written as
import-linter contracts (pyproject.toml's [tool.importlinter]), run here as `lint-imports`."""

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import reasoning_from_scratch as pkg

PACKAGE_DIR = Path(pkg.__file__).parent
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
DRIVERS = ("cli", "experiments")


def _module_name(path):
    """'cli.train' for reasoning_from_scratch/cli/train.py ('cli' for its __init__.py)."""
    parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(_module_name(p) for p in PACKAGE_DIR.rglob("*.py")
                 if p.name != "__init__.py" or p.parent != PACKAGE_DIR)
# chapter indexes re-export a chapter's names (drivers' entry points included); nothing imports them
INDEXES = [m for m in MODULES if m.startswith("ch0")]
CORE = [m for m in MODULES if m not in INDEXES and m.split(".")[0] not in DRIVERS]


def _path(module):
    path = PACKAGE_DIR.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _package_imports(module):
    """(imported module, is at module level) for every relative import in `module`."""
    tree = ast.parse(_path(module).read_text())
    top = {id(node) for node in tree.body}
    here = module.split(".") if _path(module).name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[:len(here) - (node.level - 1)]
            if node.module:
                target = ".".join(base + node.module.split("."))
                out.append((target, id(node) in top))
            else:  # `from . import x`
                out += [(".".join(base + [a.name]), id(node) in top) for a in node.names]
    return out


def test_the_drivers_and_the_core_exist():
    assert {"cli.train", "cli.distill", "experiments.stats"} <= set(MODULES)
    assert {"qwen3", "tokenizer", "grpo", "training", "process_supervision"} <= set(CORE)


def test_no_package_import_inside_a_function():
    hidden = {m: [t for t, top in _package_imports(m) if not top] for m in MODULES}
    assert {m: t for m, t in hidden.items() if t} == {}  # a cycle hidden by a lazy import


def test_the_import_contracts_hold():
    # the drivers, indexes, book, grpo core, layers, chapters 2-3 and acyclic contracts; the
    # drivers contract replaces a hand-written check that the core never imports cli/ or
    # experiments/. Analysed from the source (no import), checking this checkout's package.
    path = [str(PACKAGE_DIR.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "COLUMNS": "120"}
    lint = subprocess.run(  # `lint-imports` reads the contracts from ./pyproject.toml
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
         "--no-cache", "--no-logo"],
        cwd=PYPROJECT.parent, env=env, capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_the_loss_layer_does_not_import_process_supervision():
    # callers build the process advantage and pass it in as `advantage_fn`
    assert not {t for t, _ in _package_imports("grpo")} & {
        "process_supervision", "process", "prm", "step_scorers"}


def test_imports_between_modules_go_one_way():
    graph = {m: {t for t, _ in _package_imports(m)} for m in MODULES}
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


@pytest.mark.parametrize("index", INDEXES)
def test_every_name_in_a_chapter_index_resolves(index):
    mod = importlib.import_module(f"{pkg.__name__}.{index}")
    tree = ast.parse(_path(index).read_text())
    names = [a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
             for a in node.names]
    assert names, f"{index} exports nothing"
    assert [n for n in names if not hasattr(mod, n)] == []


def test_all_lists_the_top_level_exports():
    assert sorted(pkg.__all__) == sorted(set(pkg.__all__))
    assert 20 <= len(pkg.__all__) <= 40  # chosen, not total
    for name in pkg.__all__:
        assert hasattr(pkg, name), name
    public = {n for n in vars(pkg) if not n.startswith("_")} - set(MODULES) - {"cli", "experiments"}
    assert public - {"annotations"} == set(pkg.__all__)  # nothing exported by accident


def test_init_stays_short():
    assert len((PACKAGE_DIR / "__init__.py").read_text().splitlines()) <= 150
