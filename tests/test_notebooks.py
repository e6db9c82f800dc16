"""The chapter notebooks (notebooks/*.ipynb): they run, they are clean, they match the package.

- Each notebook runs top to bottom without an error in a fresh kernel of *this* interpreter
  (a kernelspec written to a temporary directory, so `python` on PATH does not matter), with no
  network (HF_HUB_OFFLINE=1) and one CPU thread; its wall time is printed and must stay under
  3 minutes (set RFS_NOTEBOOK_TIME_LIMIT_S to change the limit, 0 to disable it).
- Outputs are stripped (no outputs, execution_count None) and every source line is at most
  100 characters.
- Every function or class a notebook defines at top level must have a package twin: the
  notebook imports a same-named object from `reasoning_from_scratch` and uses it (to show both
  give the same result). Names starting with `_` are notebook-local helpers and exempt.

Select these tests with `pytest -m notebooks`, skip them with `pytest -m "not notebooks"`.
"""

import ast
import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

pytestmark = pytest.mark.notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
PACKAGE = "reasoning_from_scratch"
MAX_LINE = 100
CELL_TIMEOUT_S = 300
TIME_LIMIT_S = float(os.environ.get("RFS_NOTEBOOK_TIME_LIMIT_S", "180"))
KERNEL_NAME = "rfs-test-python"


def _ids(paths):
    return [p.name for p in paths]


def _read(path):
    return nbformat.read(path, as_version=4)


def _code_sources(nb):
    """Source of each code cell, IPython magics and shell lines blanked out (keeps line numbers)."""
    sources = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines = [
            "" if line.lstrip().startswith(("%", "!")) else line
            for line in cell.source.splitlines()
        ]
        sources.append("\n".join(lines))
    return sources


def untwinned_definitions(nb):
    """Top-level functions/classes of a notebook without a package twin that it uses."""
    defined, package_bindings, loaded, attributes = [], {}, set(), set()
    for i, source in enumerate(_code_sources(nb)):
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            raise AssertionError(f"code cell {i} does not parse: {e}") from None
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.append(node.name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and (node.module == PACKAGE or node.module.startswith(PACKAGE + "."))
            ):
                for alias in node.names:
                    package_bindings[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        package_bindings[alias.asname or alias.name.split(".")[0]] = None
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                loaded.add(node.id)
            elif isinstance(node, ast.Attribute):
                attributes.add((node.value, node.attr))
    twins = {orig for bound, orig in package_bindings.items() if orig and bound in loaded}
    # `qwen3.RMSNorm` after `from reasoning_from_scratch import qwen3` also counts.
    for value, attr in attributes:
        if isinstance(value, ast.Name) and value.id in package_bindings:
            twins.add(attr)
    return sorted({n for n in defined if not n.startswith("_") and n not in twins})


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    for required in ("ch02_model_and_generation.ipynb", "ch03_evaluation.ipynb"):
        assert required in names, f"missing notebooks/{required}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_clean(path):
    """Stripped outputs, no execution counts, lines of at most 100 characters."""
    nb = _read(path)
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            if cell.get("outputs"):
                problems.append(f"cell {i}: has outputs (strip them before committing)")
            if cell.get("execution_count") is not None:
                problems.append(f"cell {i}: execution_count={cell.execution_count}")
        for n, line in enumerate(cell.source.splitlines(), start=1):
            if len(line) > MAX_LINE:
                problems.append(f"cell {i} line {n}: {len(line)} > {MAX_LINE} characters")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_definitions_have_package_twins(path):
    offenders = untwinned_definitions(_read(path))
    assert not offenders, (
        f"{path.name} defines {offenders} without importing and using a same-named object from "
        f"{PACKAGE} (compare each taught function with its package version; prefix notebook-only "
        "helpers with '_')"
    )


def test_twin_check_flags_missing_twins():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("def RMSNorm():\n    pass\n\nclass Orphan:\n    pass"),
        nbformat.v4.new_code_cell("def _helper():\n    pass\n\ndef unused_twin():\n    pass"),
        nbformat.v4.new_code_cell("%time x = 1\nfrom reasoning_from_scratch import qwen3"),
        nbformat.v4.new_code_cell(
            "from reasoning_from_scratch.prompts import unused_twin\n"
            "assert RMSNorm is not qwen3.RMSNorm"
        ),
    ]
    assert untwinned_definitions(nb) == ["Orphan", "unused_twin"]


@pytest.fixture(scope="module")
def kernel_manager_factory(tmp_path_factory):
    """Make kernel managers whose kernel runs this interpreter (not `python` from PATH)."""
    jupyter_client = pytest.importorskip("jupyter_client")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager

    kernels = tmp_path_factory.mktemp("kernels")
    spec_dir = kernels / KERNEL_NAME
    spec_dir.mkdir()
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

    def make():
        specs = KernelSpecManager(kernel_dirs=[str(kernels)])
        return jupyter_client.AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)

    return make


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, kernel_manager_factory, monkeypatch, capsys):
    from nbclient import NotebookClient

    import reasoning_from_scratch

    # The kernel inherits this environment: no network, and one thread (on a small shared
    # CPU, several threads per process fighting over two cores are many times slower).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    nb = _read(path)
    # First, prove the kernel runs this interpreter and imports this checkout's package.
    check = (
        "import sys, reasoning_from_scratch\n"
        f"assert sys.prefix == {sys.prefix!r}, sys.prefix\n"
        f"assert reasoning_from_scratch.__file__ == {reasoning_from_scratch.__file__!r}, "
        "reasoning_from_scratch.__file__"
    )
    nb.cells.insert(0, nbformat.v4.new_code_cell(check))
    client = NotebookClient(
        nb,
        km=kernel_manager_factory(),
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    start = time.perf_counter()
    client.execute()
    wall = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n[notebooks] {path.name}: {wall:.1f} s")
    if TIME_LIMIT_S > 0:
        assert wall < TIME_LIMIT_S, f"{path.name} took {wall:.0f} s (limit {TIME_LIMIT_S:.0f} s)"
