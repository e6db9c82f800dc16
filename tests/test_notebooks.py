"""The chapter notebooks (notebooks/*.ipynb): they run, they are clean, they match the package.

- Each notebook runs top to bottom without an error in a fresh kernel of *this* interpreter
  (notebooks/execute.py's `execute_notebook`: no network, one CPU thread); its wall time is
  printed and must stay under 3 minutes (set RFS_NOTEBOOK_TIME_LIMIT_S to change the limit, 0 to
  disable it).
- They are committed executed (`python notebooks/execute.py`): at least 80% of the code cells
  have outputs, the cells were run in order, no output is an error, from chapter 4 on at least one
  plot; every source line is at most 100 characters.
- Every function or class a notebook defines at top level must have a package twin: the
  notebook imports a same-named object from `reasoning_from_scratch` and uses it (to show both
  give the same result). Names starting with `_` are notebook-local helpers and exempt.

Select these tests with `pytest -m notebooks`, skip them with `pytest -m "not notebooks"`.
"""

import ast
import importlib.util
import os
import sys
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
MIN_OUTPUT_SHARE = 0.8


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


def _silent_by_nature(source):
    """True for a cell of only definitions, imports and assignments (no output expected)."""
    lines = ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return False
    quiet = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom,
             ast.Assign, ast.AnnAssign, ast.AugAssign)
    return all(isinstance(node, quiet) for node in tree.body)


def executed_problems(nb, name):
    """Why a notebook does not look committed executed (empty list if it does)."""
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    problems = []
    # cells that only define, import or assign print nothing by nature: they do not count
    shown = [c for c in code if not _silent_by_nature(c.source)]
    with_output = sum(bool(c.get("outputs")) for c in shown)
    if shown and with_output < MIN_OUTPUT_SHARE * len(shown):
        problems.append(f"only {with_output} of {len(shown)} code cells that show something have "
                        "outputs (run `python notebooks/execute.py` before committing)")
    counts = [c.get("execution_count") for c in code]
    if None in counts or counts != sorted(counts):
        problems.append("cells not executed top to bottom in one kernel")
    errors = [i for i, c in enumerate(code)
              if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    if errors:
        problems.append(f"code cells {errors} have error outputs")
    chapter = int(name[2:4]) if name[:2] == "ch" and name[2:4].isdigit() else 0
    plots = sum("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", []))
    if chapter >= 4 and not plots:
        problems.append("no plot among the outputs")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_committed_executed(path):
    """Outputs and plots present, cells run in order, no errors, lines of <= 100 characters."""
    nb = _read(path)
    problems = executed_problems(nb, path.name)
    for i, cell in enumerate(nb.cells):
        for n, line in enumerate(cell.source.splitlines(), start=1):
            if len(line) > MAX_LINE:
                problems.append(f"cell {i} line {n}: {len(line)} > {MAX_LINE} characters")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_executed_check_flags_a_stripped_notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("print(x)")]
    assert len(executed_problems(nb, "ch05_x.ipynb")) == 3  # outputs, order, plot
    assert _silent_by_nature("import torch\nx = 1\ndef f():\n    print(x)")
    assert not _silent_by_nature("x = 1\nprint(x)")


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


def _execute_script():
    """notebooks/execute.py as a module (notebooks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("execute", NOTEBOOK_DIR / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, tmp_path, monkeypatch, capsys):
    pytest.importorskip("ipykernel")
    import reasoning_from_scratch

    execute = _execute_script()
    for key, value in execute.KERNEL_ENV.items():
        monkeypatch.setenv(key, value)  # (execute_notebook sets them; undone after the test)
    execute.write_kernelspec(tmp_path)
    nb = _read(path)
    # First, prove the kernel runs this interpreter and imports this checkout's package.
    check = (
        "import sys, reasoning_from_scratch\n"
        f"assert sys.prefix == {sys.prefix!r}, sys.prefix\n"
        f"assert reasoning_from_scratch.__file__ == {reasoning_from_scratch.__file__!r}, "
        "reasoning_from_scratch.__file__"
    )
    nb.cells.insert(0, nbformat.v4.new_code_cell(check))
    wall = execute.execute_notebook(nb, tmp_path, timeout=CELL_TIMEOUT_S)
    with capsys.disabled():
        print(f"\n[notebooks] {path.name}: {wall:.1f} s")
    if TIME_LIMIT_S > 0:
        assert wall < TIME_LIMIT_S, f"{path.name} took {wall:.0f} s (limit {TIME_LIMIT_S:.0f} s)"
