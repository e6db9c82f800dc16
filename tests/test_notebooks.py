"""The notebooks (notebooks/*.ipynb and their exercise solutions, notebooks/solutions/*.ipynb):
they run, they are clean, they match the package, their text agrees with their outputs.

- Each notebook runs top to bottom without an error in a fresh kernel of *this* interpreter
  (notebooks/execute.py's `execute_notebook`: no network, one CPU thread); its wall time is
  printed and must stay under 3 minutes for a chapter, 1 minute for a solutions notebook (set
  RFS_NOTEBOOK_TIME_LIMIT_S / RFS_SOLUTIONS_TIME_LIMIT_S to change the limits, 0 to disable).
  Two notebooks execute at a time (each kernel computes on one thread, and the suite's machine
  has two cores; RFS_NOTEBOOK_WORKERS changes it), so the executions take half the wall time.
- They are committed executed (`python notebooks/execute.py`): at least 80% of the code cells
  have outputs, the cells were run in order, no output is an error, from chapter 4 on at least one
  plot in the chapter notebook; every source line is at most 100 characters.
- Every function or class a notebook defines at top level must have a package twin: the
  notebook imports a same-named object from `reasoning_from_scratch` and uses it (to show both
  give the same result). Names starting with `_` are notebook-local helpers and exempt.
- The learner's code carries over (notebooks/learner/): each committed learner/chNN.py is
  exactly what chapter NN's stored notebook writes from its cells marked
  `# carried over to learner/chNN.py`, it imports everything its functions read, and a notebook
  imports from it only names it defines, and only from an earlier chapter's module (a chapter's
  solutions and experiment notebook also from its own).
- A chapter may have an experiment notebook beside its tutorial (`EXPERIMENTS`: the runs and
  the results read from docs/); the two link each other, and the exercises and diagrams are
  the tutorial's.
- A measured number quoted in the text (a decimal such as 0.35, a percentage, a duration in
  seconds) must be one the notebook prints (possibly rounded), a literal of its code, or one
  held by a file the same cell links or names (`docs/...md`, `../README.md`): text written
  before the run, or left unchanged after a re-run, contradicts the outputs. A quantity in
  words or a multiple ("about a third", "one step in five", "two of three seeds", "2x") must
  gloss such a number in its own sentence (or a paper's, cited there by arXiv number), and the
  N of a "best-of-N", "pass@N" or "majority@N" must be one the notebook uses or the linked
  file holds.
- Every chapter notebook ends with an "Exercises" section of 2-3 exercises (headed
  `### Exercise N.k: ...`, or paragraphs led by `**N.k ...**`) and has a solutions notebook,
  notebooks/solutions/chNN_solutions.ipynb, that answers each under a `## N.k` heading.
- Chapters 2-9 each have one opt-in cell (id `qwen3-optin`, in the tutorial, not an experiment
  notebook) that runs the chapter's own code on a real Qwen3 checkpoint when the environment
  variable QWEN3_DIR names one, and otherwise prints that it was skipped; the committed outputs
  show it skipped. The executions set QWEN3_DIR to a stand-in checkpoint (the bundled tiny
  model re-saved in bfloat16, in Hugging Face layout), so these cells run in the suite: an
  execution fails unless its opt-in cell ran on the stand-in.
- No code cell is longer than 30 lines: a cell does one job (drawing code lives in
  notebooks/figures/, long functions are split into helpers).
- The `[notebooks]` extra of pyproject.toml installs what opening them takes (JupyterLab, its
  kernel, matplotlib), and the README and chapter 2 say how to open them.
- Every image a notebook's text shows exists; the diagrams under notebooks/figures/ can be
  redrawn by the scripts beside them (notebooks/figures/*_diagrams.py); chapters 6 and 7 show
  at least 8 figures each (embedded diagrams plus plots among the outputs), chapters 3, 4, 5,
  8 and 9 embed at least two diagrams each.

`pytest -m notebooks` selects the executions, `pytest -m "not notebooks"` skips them; the checks
of the stored notebooks are quick and always run.
"""

import ast
import builtins
import dis
import importlib
import importlib.util
import inspect
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import reasoning_from_scratch
from reasoning_from_scratch.weights import load_pretrained, save_pretrained

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
SOLUTIONS_DIR = NOTEBOOK_DIR / "solutions"
CHAPTERS = sorted(NOTEBOOK_DIR.glob("ch*.ipynb"))
# A chapter's experiment notebook: the runs and results of a chapter whose tutorial notebook
# builds the pieces (its exercises are the tutorial's).
EXPERIMENTS = {"ch08_process_vs_outcome.ipynb": "ch08_process_supervision.ipynb"}
TUTORIALS = [p for p in CHAPTERS if p.name not in EXPERIMENTS]
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb")) + sorted(SOLUTIONS_DIR.glob("*.ipynb"))
PACKAGE = "reasoning_from_scratch"
MAX_LINE = 100
CELL_TIMEOUT_S = 300
TIME_LIMIT_S = float(os.environ.get("RFS_NOTEBOOK_TIME_LIMIT_S", "180"))
SOLUTIONS_TIME_LIMIT_S = float(os.environ.get("RFS_SOLUTIONS_TIME_LIMIT_S", "60"))
# Solutions that train a model of their own get a chapter's limit: chapter 9's exercise 9.3
# trains the 20-step GRPO teacher it distils from (about a minute on one thread).
TRAINING_SOLUTIONS = ("ch09_solutions.ipynb",)
NOTEBOOK_WORKERS = int(os.environ.get("RFS_NOTEBOOK_WORKERS", "2"))  # kernels running at once
MIN_OUTPUT_SHARE = 0.8
EXERCISES = (2, 3)  # exercises per chapter, at least and at most
MAX_CELL_LINES = 30
QWEN3_ENV = "QWEN3_DIR"  # the opt-in cells' switch: a local Qwen3 checkpoint directory
OPT_IN_CELL_ID = "qwen3-optin"
OPT_IN_CHAPTERS = (2, 3, 4, 5, 6, 7, 8, 9)  # their tutorials (TUTORIALS)
MIN_FIGURES = {6: 8, 7: 8}  # chapter -> figures it shows at least
# chapter -> diagrams of notebooks/figures/ its text embeds at least (the idea, drawn)
MIN_DIAGRAMS = {2: 3, 3: 2, 4: 2, 5: 2, 8: 2, 9: 2}


def _name(path):
    """The notebook's path below notebooks/: "ch05_best_of_n.ipynb", "solutions/ch05_..."."""
    return path.relative_to(NOTEBOOK_DIR).as_posix()


def _ids(paths):
    return [_name(p) for p in paths]


def _chapter(path):
    """The chapter number of "chNN_....ipynb" (chapter or solutions notebook), else None."""
    m = re.match(r"ch(\d\d)_", path.name)
    return int(m.group(1)) if m else None


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


def _requirement_names(requirements):
    """Distribution names of requirement strings: "jupyterlab>=4.0" -> "jupyterlab"."""
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_notebooks_extra_installs_jupyter():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "notebooks" in extras, 'pyproject.toml has no [notebooks] extra'
    names = _requirement_names(extras["notebooks"])
    assert {"jupyterlab", "ipykernel", "matplotlib"} <= names, names
    assert _requirement_names(["jupyterlab>=4.0", "ipykernel", "matplotlib ; python_version>'3'"]
                              ) == {"jupyterlab", "ipykernel", "matplotlib"}
    command = 'pip install -e ".[notebooks]"'
    cells = _read(NOTEBOOK_DIR / "ch02_model_and_generation.ipynb").cells
    first_code = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    chapter2 = "\n".join(c.source for c in cells[:first_code])  # its introduction
    readme = (ROOT / "README.md").read_text()
    for where, text in (("README.md", readme), ("ch02 introduction", chapter2)):
        assert command in text and "jupyter lab notebooks/" in text, f"{where}: how to open them"


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
    # a chapter notebook ("ch05_best_of_n.ipynb"), not a solutions one ("solutions/ch05_...")
    chapter = int(name[2:4]) if name[:2] == "ch" and name[2:4].isdigit() else 0
    plots = sum("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", []))
    if chapter >= 4 and not plots:
        problems.append("no plot among the outputs")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_committed_executed(path):
    """Outputs and plots present, cells run in order, no errors, lines of <= 100 characters."""
    nb = _read(path)
    problems = executed_problems(nb, _name(path))
    for i, cell in enumerate(nb.cells):
        for n, line in enumerate(cell.source.splitlines(), start=1):
            if len(line) > MAX_LINE:
                problems.append(f"cell {i} line {n}: {len(line)} > {MAX_LINE} characters")
    problems += long_cells(nb)
    assert not problems, f"{_name(path)}:\n" + "\n".join(problems)


def long_cells(nb):
    """A problem line for each code cell of more than MAX_CELL_LINES lines."""
    return [f"code cell {i} has {n} lines (at most {MAX_CELL_LINES}: split it)"
            for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and (n := len(cell.source.rstrip().splitlines())) > MAX_CELL_LINES]


def test_long_cell_check_flags_a_long_cell():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("\n".join(["x = 1"] * MAX_CELL_LINES)),
                nbformat.v4.new_markdown_cell("\n".join(["text"] * 50)),
                nbformat.v4.new_code_cell("\n".join(["x = 1"] * (MAX_CELL_LINES + 1)))]
    assert long_cells(nb) == [f"code cell 2 has {MAX_CELL_LINES + 1} lines (at most 30: split it)"]


def test_executed_check_flags_a_stripped_notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("print(x)")]
    assert len(executed_problems(nb, "ch05_x.ipynb")) == 3  # outputs, order, plot
    assert len(executed_problems(nb, "solutions/ch05_solutions.ipynb")) == 2  # no plot needed
    assert _silent_by_nature("import torch\nx = 1\ndef f():\n    print(x)")
    assert not _silent_by_nature("x = 1\nprint(x)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_definitions_have_package_twins(path):
    offenders = untwinned_definitions(_read(path))
    assert not offenders, (
        f"{_name(path)} defines {offenders} without importing and using a same-named object from "
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


def _run_notebook(execute, path, kernels):
    """Execute notebook `path` in a fresh kernel (not saved); returns the wall seconds and the
    executed notebook. A first cell proves the kernel runs this interpreter and imports this
    checkout's package."""
    nb = _read(path)
    check = (
        "import sys, reasoning_from_scratch\n"
        f"assert sys.prefix == {sys.prefix!r}, sys.prefix\n"
        f"assert reasoning_from_scratch.__file__ == {reasoning_from_scratch.__file__!r}, "
        "reasoning_from_scratch.__file__"
    )
    nb.cells.insert(0, nbformat.v4.new_code_cell(check))
    return execute.execute_notebook(nb, kernels, timeout=CELL_TIMEOUT_S, cwd=path.parent), nb


def write_qwen3_standin(out_dir):
    """A stand-in for a real Qwen3 checkpoint, for the opt-in cells: the bundled tiny model
    re-saved in Hugging Face layout with bfloat16 weights (the dtype Qwen's checkpoints are
    stored in; the cells load it as float32). Returns the directory."""
    model, tokenizer = load_pretrained("tiny-arith", device="cpu", dtype=torch.bfloat16)
    return save_pretrained(model, tokenizer, out_dir)


@pytest.fixture(scope="module")
def notebook_runs(request, tmp_path_factory):
    """The selected notebooks' executions, started together on NOTEBOOK_WORKERS threads (each
    waits on its own kernel process): path -> future of (wall seconds, executed notebook), in
    test order. QWEN3_DIR
    names a stand-in checkpoint, so that the opt-in cells run too."""
    pytest.importorskip("ipykernel")
    execute = _execute_script()
    kernels = tmp_path_factory.mktemp("kernels")
    execute.write_kernelspec(kernels)
    selected = [item.callspec.params["path"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_notebook_runs"]
    with pytest.MonkeyPatch.context() as mp, \
            ThreadPoolExecutor(max_workers=max(1, NOTEBOOK_WORKERS)) as pool:
        for key, value in execute.KERNEL_ENV.items():  # undone after the module
            mp.setenv(key, value)  # (execute_notebook sets them too)
        if any(_chapter(p) in OPT_IN_CHAPTERS for p in selected):
            mp.setenv(QWEN3_ENV, str(write_qwen3_standin(tmp_path_factory.mktemp("qwen3"))))
        yield {path: pool.submit(_run_notebook, execute, path, kernels) for path in selected}


@pytest.mark.notebooks
@pytest.mark.slow  # every notebook executed: most of the suite's notebook time
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, notebook_runs, capsys):
    wall, nb = notebook_runs[path].result()  # a cell's error is raised here
    if path in TUTORIALS and _chapter(path) in OPT_IN_CHAPTERS:
        (cell,) = [c for c in nb.cells if c.get("id") == OPT_IN_CELL_ID]
        shown = "".join(o.get("text", "") for o in cell.outputs)
        assert shown and not shown.startswith("skipped"), f"the opt-in cell did not run: {shown}"
    with capsys.disabled():
        print(f"\n[notebooks] {_name(path)}: {wall:.1f} s")
    limit = (SOLUTIONS_TIME_LIMIT_S if path.parent == SOLUTIONS_DIR
             and path.name not in TRAINING_SOLUTIONS else TIME_LIMIT_S)
    if limit > 0:
        assert wall < limit, f"{_name(path)} took {wall:.0f} s (limit {limit:.0f} s)"


def opt_in_problems(nb):
    """Why a chapter notebook lacks exactly one opt-in Qwen3 cell whose stored output shows it
    skipped (empty list if nothing is wrong)."""
    reading = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
               and "opt_in_qwen3()" in c.source]  # `weights.opt_in_qwen3` reads QWEN3_DIR
    if len(reading) != 1:
        return [f"{len(reading)} code cells load the opt-in Qwen3 (want exactly one)"]
    i = reading[0]
    cell, problems = nb.cells[i], []
    if cell.get("id") != OPT_IN_CELL_ID:
        problems.append(f"the opt-in cell {i} has id {cell.get('id')!r}, not {OPT_IN_CELL_ID!r}")
    above = nb.cells[i - 1] if i else None
    if above is None or above.cell_type != "markdown" or QWEN3_ENV not in above.source:
        problems.append(f"no markdown cell above the opt-in cell {i} says how to turn it on")
    shown = "".join(o.get("text", "") for o in cell.get("outputs", [])
                    if o.get("output_type") == "stream")
    if len(cell.get("outputs", [])) != 1 or not shown.startswith("skipped:") \
            or QWEN3_ENV not in shown or shown.count("\n") != 1:
        problems.append(f"the opt-in cell's stored output is {shown!r}, not the one line saying "
                        f"it was skipped (execute it with {QWEN3_ENV} unset)")
    return problems


@pytest.mark.parametrize("chapter", OPT_IN_CHAPTERS)
def test_chapter_has_a_skipped_opt_in_cell(chapter):
    path = _chapter_notebook(chapter)  # the tutorial (chapter 8's experiment notebook has none)
    problems = opt_in_problems(_read(path))
    assert not problems, f"{_name(path)}: " + "; ".join(problems)
    assert QWEN3_ENV in (NOTEBOOK_DIR / "README.md").read_text(), "README: how to turn it on"


def test_opt_in_check_flags_a_cell_run_on_weights():
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook()
    cell = code("qwen3 = opt_in_qwen3()\nif qwen3:\n    print(qwen3.model)")
    cell.id = OPT_IN_CELL_ID
    skipped = nbformat.v4.new_output("stream", text=f"skipped: set {QWEN3_ENV} to run it\n")
    cell.outputs = [skipped]
    nb.cells = [md(f"Set `{QWEN3_ENV}`."), cell]
    assert opt_in_problems(nb) == []
    cell.outputs = [nbformat.v4.new_output("stream", text="12,345 parameters\nmatches\n")]
    assert len(opt_in_problems(nb)) == 1
    nb.cells = [md("text"), cell, cell]
    assert opt_in_problems(nb) == ["2 code cells load the opt-in Qwen3 (want exactly one)"]
    nb.cells = [code("x = 1"), cell]
    cell.outputs, cell.id = [skipped], "other"
    assert len(opt_in_problems(nb)) == 2  # the id, and no markdown above


# --- numbers quoted in the text must be numbers the notebook prints ---------------------------

NUMBER = r"\d+(?:\.\d+)?"
# What the text quotes as a measurement: a decimal (0.35, -0.448), a percentage (44%, 24 %) or
# a duration (42 s, 1.5 seconds). Plain integers ("40 problems", "chapter 7") are settings and
# references far more often than results, so they are not checked. A number glued to a word
# ("Qwen3-0.6B", "v2.1") is a name, not a quote.
QUOTED = re.compile(
    rf"(?<![\w.])(?<![\w.]-)(?P<num>{NUMBER})"
    r"(?:(?P<pct>\s?%)|(?P<sec>\s(?:s|ms|seconds?)\b))?(?![\w%]|\.\d)"
)
# Decimals after these words are references, not measurements: "arXiv 2203.11171", "section 5.2"
# (and the numbers listed after one: "sections 2.4 and 4.1").
REFERENCE_WORDS = ("arxiv", "section", "sections", "eq.", "equation", "table", "figure", "fig.",
                   "exercise", "exercises", "version", "python", "chapter", "chapters")
REFERENCE_LIST = re.compile(r"\s*(?:,|and|or|to|-)?\s*")
# Code spans, math, link targets and HTML tags are not prose (a hand computation written as
# math, $6/13 = 0.4615$, is not a quote of an output).
NOT_PROSE = re.compile(r"```.*?```|`[^`]*`|\$\$.*?\$\$|\$[^$]*\$|\]\([^)]*\)|<[^>]*>", re.S)


def _output_text(nb):
    """Everything the code cells printed or displayed as text."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            for kind in ("text/plain", "text/markdown"):
                parts.append(out.get("data", {}).get(kind, ""))
    return "\n".join(parts)


def _decimals(text):
    return len(text.split(".")[1]) if "." in text else 0


def quoted_numbers(markdown):
    """(quoted text, value, decimals, is_percent) for each measured number the prose quotes."""
    prose = NOT_PROSE.sub(" ", markdown)
    quotes, reference_end = [], None
    for m in QUOTED.finditer(prose):
        num = m.group("num")
        before = prose[: m.start()].rstrip().rsplit(None, 1)
        if (before and before[-1].lower().strip("([:") in REFERENCE_WORDS) or (
                reference_end is not None
                and REFERENCE_LIST.fullmatch(prose[reference_end: m.start()])):
            reference_end = m.end()
            continue
        reference_end = None
        if not (m.group("pct") or m.group("sec") or "." in num):
            continue  # a plain integer
        negative = m.start() > 0 and prose[m.start() - 1] == "-" and (
            m.start() < 2 or not prose[m.start() - 2].isalnum())
        value = float(num) * (-1 if negative else 1)
        text = ("-" if negative else "") + m.group(0).strip()
        quotes.append((text, value, _decimals(num), bool(m.group("pct"))))
    return quotes


def _supported(value, decimals, percent, printed):
    """True if a printed (value, decimals) rounds to the quoted value (a fraction, for a %)."""
    tolerance = 0.5 * 10.0 ** -decimals + 1e-9
    for v, d in printed:
        if d < decimals:  # a printed 0.3 is not the source of a quoted 0.35 (but of 0.30)
            if v == value or (value >= 0 and -v == value):
                return True
            continue
        if abs(v - value) <= tolerance or (value >= 0 and abs(-v - value) <= tolerance):
            return True  # a printed -0.45 may be quoted as a loss of 0.45, not the reverse
        if percent and d >= decimals + 2 and abs(100 * v - value) <= tolerance:
            return True  # 0.44 printed, "44%" quoted
    return False


# A quantity in words or a multiple: "half the tokens", "about a third", "twice the", "2x",
# "1.7 times", "one step in five". It glosses a number, so the number must stand in the same
# sentence (and be supported), or the sentence cites a paper (by arXiv number). "The first
# half", "one half" and "twice that" are not measurements.
WORD_QUANTITY = re.compile(
    r"(?<![\w-])(?<!first )(?<!second )(?<!last )(?<!one )(?<!and a )"
    r"(?:half|a third|two thirds|a quarter|three quarters|a fifth|a tenth|"
    r"(?:twice|double|triple)(?= (?:the|as|its|their)\b)|\d+(?:\.\d+)?x|\d+\.\d+ times|"
    r"one (?:(?!(?:was|is|were|are) )[\w-]+ ){0,2}in (?:two|three|four|five|six|seven|eight|"
    r"nine|ten|\d+))(?![\w-])", re.I)
# A count: "4 of the 10 problems", "two of three seeds". Both numbers must be integers the
# notebook prints or runs (or the linked file holds), or the sentence must quote the figures
# it counts.
_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_N = r"(?:\d+|" + "|".join(_WORDS) + ")"
COUNT_OF = re.compile(
    rf"(?<![\w.-])(?P<a>{_N}) of (?:the |its |their )?(?P<b>{_N})"
    r"(?= (?:seeds?|runs?|problems?|samples?|steps?|completions?|answers?|groups?|tokens?)\b)",
    re.I)


def _count_value(word):
    return str(_WORDS.index(word.lower()) + 1) if word.lower() in _WORDS else word


# The N of a sampling budget written into a name: best-of-32, pass@16, majority@8.
BUDGET_NAME = re.compile(r"(?:best-of-|pass@|maj(?:ority)?@)(\d+)\b", re.I)
# Files a cell links or names, whose numbers may be quoted: [text](../docs/x.md), `docs/x.json`.
LINKED_FILE = re.compile(r"(?:\]\(|`|\b)((?:\.\./)?(?:docs/)?[\w./-]*\w\.(?:md|json))\b")
SENTENCE_END = re.compile(r"(?<=[.;:!?])\s+(?=[A-Z(`*\[])|\n\s*\n|\n\s*[-*] |\n\s*\d+\. ")


def _numbers(text):
    """(value, decimals) of every number in `text`; "-" is a sign unless a digit or letter
    precedes it ("20-5"), and 1,000 is one thousand."""
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    found = re.findall(rf"(?<![\w.])-?{NUMBER}|{NUMBER}", text)
    return [(float(t), _decimals(t)) for t in found]


def linked_files(markdown, where=NOTEBOOK_DIR):
    """The text files of the repository that a markdown cell links or names."""
    files = []
    for m in LINKED_FILE.finditer(markdown):
        name = m.group(1)
        for base in (where, ROOT):
            path = (base / name).resolve()
            inside = ROOT in path.parents or Path(where).resolve() in path.parents
            if path.is_file() and inside and path.suffix != ".ipynb":
                files.append(path)
                break
    return files


def _sentences(prose):
    return [" ".join(s.split()) for s in SENTENCE_END.split(prose) if s.strip()]


def unsupported_numbers(nb, chapter=None, where=NOTEBOOK_DIR):
    """Quoted measured numbers of the markdown that no output prints, no code cell sets and
    no file the cell links holds; quantities in words that gloss no such number in their
    sentence; best-of-N budgets the notebook never uses.

    In chapter `chapter`'s notebooks, "6.2" is exercise or section 6.2, not a measurement.
    """
    printed = _numbers(_output_text(nb))
    literals = _numbers("\n".join(_code_sources(nb)))
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        held = [n for f in linked_files(cell.source, where) for n in _numbers(f.read_text())]
        support = printed + literals + held

        def supported(quote, support=support):
            text, value, decimals, percent = quote
            return (chapter is not None and re.fullmatch(rf"{chapter}\.\d", text)) or \
                _supported(value, decimals, percent, support)

        for quote in quoted_numbers(cell.source):
            if not supported(quote):
                problems.append(f"markdown cell {i} quotes {quote[0]!r}, which no output prints")
        sources = "\n".join([_output_text(nb), *_code_sources(nb),
                             *(f.read_text() for f in linked_files(cell.source, where))])
        counts = set(re.findall(r"(?<![\w.@-])\d+(?![\w.]\d*)", sources))  # not float32's 32
        counts |= {m.group(1) for m in BUDGET_NAME.finditer(sources)}
        prose = NOT_PROSE.sub(" ", cell.source)
        for sentence in _sentences(prose):
            glossed = "arxiv" in sentence.lower() or any(
                supported(q) and q[2] > 0 for q in quoted_numbers(sentence))
            if glossed:
                continue
            for m in WORD_QUANTITY.finditer(sentence):
                problems.append(f"markdown cell {i} quotes {m.group(0)!r}, which glosses "
                                "no printed number in its sentence")
            for m in COUNT_OF.finditer(sentence):
                if {_count_value(m["a"]), _count_value(m["b"])} - counts:
                    problems.append(f"markdown cell {i} quotes {m.group(0)!r}, a count no "
                                    "output prints")
        for m in BUDGET_NAME.finditer(cell.source):
            if m.group(1) not in counts:
                problems.append(f"markdown cell {i} quotes {m.group(0)!r}, which no output "
                                "prints and no code runs")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_markdown_numbers_are_printed(path):
    problems = unsupported_numbers(_read(path), _chapter(path), path.parent)
    assert not problems, (
        f"{_name(path)}: " + "; ".join(problems)
        + " (write the text after the run, from the printed values)"
    )


def test_number_check_flags_a_contradiction():
    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell("evaluate(temperature=0.8)")
    code.outputs = [nbformat.v4.new_output(
        "stream", text="accuracy by N: 0.07 0.12 0.35\nPRM trained in 42 s, step acc 0.842\n")]
    nb.cells = [
        nbformat.v4.new_markdown_cell(
            "Qwen3-0.6B at temperature 0.8 (`top_p=0.95`, arXiv 2203.11171, $x = 1.5$): "
            "accuracy rises from 0.07 to 0.35 in 42 s; the PRM is right on 84% of steps "
            "(0.84, ~84.2 %)."),
        code,
        nbformat.v4.new_markdown_cell(
            "Accuracy falls to 0.06, the PRM trains in half a minute (30 s) and is right on "
            "a third (33%) of steps; -0.842 is not 0.842, and 0.3 is not 0.35."),
    ]
    assert quoted_numbers("Qwen3-0.6B gets 0.5 in 3 s, 12% of 40; section 5.2") == [
        ("0.5", 0.5, 1, False), ("3 s", 3.0, 0, False), ("12%", 12.0, 0, True)]
    problems = unsupported_numbers(nb)
    assert [p.split(" quotes ")[1].split(",")[0] for p in problems] == [
        "'0.06'", "'30 s'", "'33%'", "'-0.842'"]
    assert all(p.startswith("markdown cell 2 ") for p in problems)
    nb.cells.append(nbformat.v4.new_markdown_cell("**5.2 Ties.** As in 5.1, then 4.2."))
    assert len(unsupported_numbers(nb, chapter=5)) == 5  # 5.1 and 5.2 are exercises, 4.2 not


def test_number_check_flags_words_counts_and_budgets(tmp_path):
    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell("best_of_n(n=16)")
    code.outputs = [nbformat.v4.new_output(
        "stream", text="best-of-16 0.57, refinement 0.35 at 140 tokens; 4 of 10 right\n")]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "runs.md").write_text("| best-of-32 | 0.665 | 1032 |\n| 2 of 3 |\n")
    md = nbformat.v4.new_markdown_cell
    nb.cells = [code,
                md("Refinement reaches 0.35, about a third of the way (arXiv 2410.08146 "
                   "reports 2x). Right on 4 of the 10 problems."),  # glossed, cited, printed
                md("It beats best-of-32 on about a third of its tokens, and misjudges one "
                   "held-out step in five; 5 of the 10 problems; the first half is warm-up."),
                md("In [docs/runs.md](docs/runs.md), best-of-32 reaches 0.665, twice the "
                   "base; gamed in two of three seeds.")]
    problems = unsupported_numbers(nb, where=tmp_path)
    assert [p.split(" quotes ")[1].split(",")[0] for p in problems] == [
        "'a third'", "'one held-out step in five'", "'5 of the 10'", "'best-of-32'"]
    assert all(p.startswith("markdown cell 2 ") for p in problems)


# --- every chapter ends with exercises, answered in a solutions notebook ----------------------

EXERCISES_HEADING = re.compile(r"^#{1,3}\s+(?:\d+\.\s+)?Exercises\s*$", re.M)
# "### Exercise 4.1: ...", "## 4.1 ..." or a paragraph led by "**4.1 ...**"
EXERCISE_HEADING = re.compile(r"^(?:#{2,4}\s+|\*\*)(?:Exercise\s+)?(\d+)\.(\d+)\b", re.M)
SECTION_HEADING = re.compile(r"^#{1,2}\s+\S", re.M)


def _exercise_numbers(cells):
    return [(int(a), int(b)) for c in cells if c.cell_type == "markdown"
            for a, b in EXERCISE_HEADING.findall(c.source)]


def exercise_problems(nb, chapter, solutions):
    """Why chapter `chapter`'s notebook `nb` lacks a closing exercises section answered by the
    notebook `solutions` (None if it does not exist); empty list if nothing is missing."""
    starts = [i for i, c in enumerate(nb.cells)
              if c.cell_type == "markdown" and EXERCISES_HEADING.search(c.source)]
    if not starts:
        return ["no '## Exercises' section"]
    start = starts[-1]
    problems = []
    body = nb.cells[start:]
    later_sections = [i for i, c in enumerate(body) if c.cell_type == "markdown" and i > 0
                      and SECTION_HEADING.search(c.source)]
    if later_sections:
        problems.append(f"the exercises section (cell {start}) is not the last section")
    numbers = _exercise_numbers(body)
    wanted = [(chapter, k) for k in range(1, len(numbers) + 1)]
    if not EXERCISES[0] <= len(numbers) <= EXERCISES[1]:
        problems.append(f"{len(numbers)} exercises (want {EXERCISES[0]}-{EXERCISES[1]}, "
                        f"headed '### Exercise {chapter}.1: ...' or led by '**{chapter}.1 ...**')")
    elif numbers != wanted:
        problems.append(f"exercises numbered {numbers}, want {wanted}")
    if solutions is None:
        problems.append(f"no solutions notebook solutions/ch{chapter:02d}_solutions.ipynb")
    else:
        missing = sorted(set(numbers) - set(_exercise_numbers(solutions.cells)))
        if missing:
            problems.append(f"the solutions notebook does not answer exercises {missing}")
    return problems


@pytest.mark.parametrize("path", TUTORIALS, ids=_ids(TUTORIALS))
def test_chapter_has_exercises_and_solutions(path):
    chapter = int(path.name[2:4])
    solutions_path = SOLUTIONS_DIR / f"ch{chapter:02d}_solutions.ipynb"
    solutions = _read(solutions_path) if solutions_path.is_file() else None
    problems = exercise_problems(_read(path), chapter, solutions)
    assert not problems, f"{_name(path)}: " + "; ".join(problems)


def test_exercise_check_flags_missing_exercises_and_solutions():
    md = nbformat.v4.new_markdown_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [md("# Chapter 4\n## 1. Sampling"), md("## Exercises"),
                md("### Exercise 4.1: more samples"), md("### Exercise 4.2: top-k")]
    solutions = nbformat.v4.new_notebook()
    solutions.cells = [md("## Exercise 4.1: more samples")]
    assert exercise_problems(nb, 4, solutions) == [
        "the solutions notebook does not answer exercises [(4, 2)]"]
    solutions.cells.append(md("## 4.2 Top-k"))  # the word "Exercise" is optional
    assert exercise_problems(nb, 4, solutions) == []
    bold = nbformat.v4.new_notebook()
    bold.cells = [md("## Summary\n\nText.\n\n## Exercises\n\n**4.1 More samples.** Try.\n\n"
                     "**4.2 Top-k.** Try.\n\n**4.3 Ties.** Try. (Section 4.2 helps.)")]
    assert exercise_problems(bold, 4, solutions) == [
        "the solutions notebook does not answer exercises [(4, 3)]"]
    assert len(exercise_problems(nb, 4, None)) == 1
    nb.cells.append(md("## Summary"))
    nb.cells.insert(2, md("### Exercise 3.1: wrong chapter"))
    assert exercise_problems(nb, 4, solutions) == [
        "the exercises section (cell 1) is not the last section",
        "exercises numbered [(3, 1), (4, 1), (4, 2)], want [(4, 1), (4, 2), (4, 3)]",
        "the solutions notebook does not answer exercises [(3, 1)]"]
    nb.cells = nb.cells[:1]
    assert exercise_problems(nb, 4, solutions) == ["no '## Exercises' section"]


# --- the learner's code carries over: notebooks/learner/chNN.py -------------------------------

LEARNER_DIR = NOTEBOOK_DIR / "learner"
LEARNER_MODULES = sorted(LEARNER_DIR.glob("ch*.py"))


def _learner():
    """notebooks/learner/__init__.py, the code that writes the modules, as a module."""
    spec = importlib.util.spec_from_file_location("_learner_writer", LEARNER_DIR / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chapter_notebook(chapter):
    (path,) = [p for p in TUTORIALS if _chapter(p) == chapter]
    return path


def test_learner_modules_exist():
    assert [p.name for p in LEARNER_MODULES] == ["ch07.py", "ch08.py"], "learner/ changed"


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiment_notebook_and_its_tutorial_link_each_other(name):
    tutorial = EXPERIMENTS[name]
    assert _chapter(Path(name)) == _chapter(Path(tutorial))
    for path, other in ((NOTEBOOK_DIR / name, tutorial), (NOTEBOOK_DIR / tutorial, name)):
        text = "\n".join(c.source for c in _read(path).cells if c.cell_type == "markdown")
        assert f"]({other})" in text, f"{path.name} does not link to {other}"


@pytest.mark.parametrize("module", LEARNER_MODULES, ids=[p.name for p in LEARNER_MODULES])
def test_learner_module_is_what_its_notebook_writes(module):
    learner, notebook = _learner(), _chapter_notebook(int(module.stem[2:]))
    assert learner.carried_cells(notebook, module.stem), f"{notebook.name} marks no cell"
    assert module.read_text(encoding="utf-8") == learner.module_source(notebook, module.stem), (
        f"learner/{module.name} is not what {notebook.name}'s marked cells give: "
        f"python notebooks/execute.py notebooks/{notebook.name}")


def _global_names(code):
    """Names a code object and the code nested in it read as globals."""
    names = {i.argval for i in dis.get_instructions(code)
             if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


@pytest.mark.parametrize("module", LEARNER_MODULES, ids=[p.name for p in LEARNER_MODULES])
def test_learner_module_stands_on_its_own(module, monkeypatch):
    """Outside its notebook's kernel, every name the module's functions read is defined."""
    monkeypatch.syspath_prepend(str(NOTEBOOK_DIR))
    imported = importlib.import_module(f"learner.{module.stem}")
    code = compile(module.read_text(encoding="utf-8"), str(module), "exec")
    missing = sorted(n for n in _global_names(code)
                     if not hasattr(imported, n) and not hasattr(builtins, n))
    assert not missing, f"learner/{module.name} reads {missing} without importing them"


def learner_imports(nb):
    """(chapter module, name) of every `from learner.chNN import name` of a notebook."""
    found = []
    for source in _code_sources(nb):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("learner."):
                found += [(node.module.split(".", 1)[1], a.name) for a in node.names]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_learner_imports_come_from_earlier_chapters(path):
    chapter, problems = _chapter(path), []
    for module, name in learner_imports(_read(path)):
        file = LEARNER_DIR / f"{module}.py"
        if not file.is_file():
            problems.append(f"learner/{module}.py does not exist")
            continue
        tree = ast.parse(file.read_text(encoding="utf-8"))
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}  # a carried setting
        if name not in defined:
            problems.append(f"learner/{module}.py defines no {name}")
        # a tutorial takes from earlier chapters; its solutions and experiments from its own too
        own = path.parent == SOLUTIONS_DIR or path.name in EXPERIMENTS
        if chapter is None or int(module[2:]) > chapter or (
                int(module[2:]) == chapter and not own):
            problems.append(f"imports learner/{module}.py, not an earlier chapter's")
    assert not problems, f"{_name(path)}: " + "; ".join(problems)


def test_learner_writer_carries_the_marked_cells(tmp_path, monkeypatch):
    learner = _learner()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"{learner.marker('ch05')}\ndef f():\n    return 1"),
                nbformat.v4.new_code_cell("def g():\n    return 2"),
                nbformat.v4.new_markdown_cell(f"{learner.marker('ch05')}\ntext"),
                nbformat.v4.new_code_cell(f"{learner.marker('ch04')}\nx = 1"),
                nbformat.v4.new_code_cell(f"{learner.marker('ch05')}\n\nimport os")]
    path = tmp_path / "ch05_x.ipynb"
    nbformat.write(nb, path)
    assert learner.carried_cells(path, "ch05") == ["def f():\n    return 1", "import os"]
    source = learner.module_source(path, "ch05")
    assert source.endswith('"""\n\n\ndef f():\n    return 1\n\n\nimport os\n')
    monkeypatch.setattr(learner, "LEARNER_DIR", tmp_path)
    assert learner.write_module(path, "ch05").read_text() == source

    def f():
        return 3  # another version than the saved notebook's

    f.__module__ = "__main__"  # as if the kernel had run it
    with pytest.raises(RuntimeError, match=r"\['f'\]"):
        learner.write_module(path, "ch05", {"f": f})


# --- figures: every image a notebook shows exists, and the diagrams can be redrawn -------------

IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_images_exist(path):
    missing = [link for cell in _read(path).cells if cell.cell_type == "markdown"
               for link in IMAGE_LINK.findall(cell.source)
               if "://" not in link and not (path.parent / link).is_file()]
    assert not missing, f"{_name(path)} shows images that do not exist: {missing}"


def figure_count(nb):
    """Figures a notebook shows: images its markdown embeds plus plots among its outputs."""
    embedded = sum(len(IMAGE_LINK.findall(c.source)) for c in nb.cells
                   if c.cell_type == "markdown")
    plots = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                for o in c.get("outputs", []))
    return embedded + plots


@pytest.mark.parametrize("chapter", sorted(MIN_FIGURES))
def test_chapter_shows_its_figures(chapter):
    (path,) = [p for p in TUTORIALS if _chapter(p) == chapter]
    shown = figure_count(_read(path))
    assert shown >= MIN_FIGURES[chapter], (
        f"{_name(path)} shows {shown} figures, want at least {MIN_FIGURES[chapter]}")


def diagram_count(nb):
    """Distinct images under figures/ that a notebook's markdown embeds."""
    return len({link for c in nb.cells if c.cell_type == "markdown"
                for link in IMAGE_LINK.findall(c.source) if link.startswith("figures/")})


@pytest.mark.parametrize("chapter", sorted(MIN_DIAGRAMS))
def test_chapter_shows_its_diagrams(chapter):
    (path,) = [p for p in TUTORIALS if _chapter(p) == chapter]
    shown = diagram_count(_read(path))
    assert shown >= MIN_DIAGRAMS[chapter], (
        f"{_name(path)} embeds {shown} diagrams of notebooks/figures/, want at least "
        f"{MIN_DIAGRAMS[chapter]}")


def test_figure_count_counts_images_and_plots():
    nb = nbformat.v4.new_notebook()
    plot = nbformat.v4.new_output("display_data", data={"image/png": "iVBOR", "text/plain": ""})
    nb.cells = [nbformat.v4.new_markdown_cell("![a](figures/a.png) and ![b](figures/b.png)"),
                nbformat.v4.new_code_cell("plt.show()", outputs=[plot]),
                nbformat.v4.new_code_cell("print(1)")]
    assert figure_count(nb) == 3
    nb.cells.append(nbformat.v4.new_markdown_cell("![a again](figures/a.png) ![c](../docs/c.png)"))
    assert diagram_count(nb) == 2  # figures/a.png once, figures/b.png; docs/ is not a diagram


# Pace and pictures of the whole course (tutorials and solutions): the book's way, short
# markdown cells and one figure per step of an idea, each with a caption that says what to see.
MAX_COURSE_WORDS, MAX_MEDIAN_WORDS, MAX_CELL_WORDS, MIN_COURSE_FIGURES = 22_000, 50, 250, 80
CAPTION = re.compile(r"^\*[^*].*\*$")  # one italic line


def _is_caption(line):
    return bool(CAPTION.match(line.strip())) and 6 <= len(line.split()) <= 40


def uncaptioned(nb):
    """Figures without a caption: an embedded image's caption is the next line of its cell, a
    plot's the first line of the markdown cell right after its code cell (one italic sentence
    of 6-40 words)."""
    missing = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            lines = cell.source.splitlines() + [""]
            missing += [f"cell {i}: {link}" for j, line in enumerate(lines[:-1])
                        for link in IMAGE_LINK.findall(line) if not _is_caption(lines[j + 1])]
        elif any("image/png" in o.get("data", {}) for o in cell.get("outputs", [])):
            after = nb.cells[i + 1] if i + 1 < len(nb.cells) else None
            first = (after.source.strip().splitlines() or [""])[0] \
                if after is not None and after.cell_type == "markdown" else ""
            if not _is_caption(first):
                missing.append(f"cell {i}: plot")
    return missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_every_figure_has_a_caption(path):
    missing = uncaptioned(_read(path))
    assert not missing, f"{_name(path)}: figures without a caption sentence: {missing}"


def test_caption_check_flags_missing_captions():
    plot = nbformat.v4.new_output("display_data", data={"image/png": "iVBOR", "text/plain": ""})
    good = "*The clipped term is flat outside the band, so no gradient there.*"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"![a](figures/a.png)\n{good}"),
                nbformat.v4.new_code_cell("plt.show()", outputs=[plot]),
                nbformat.v4.new_markdown_cell(good + "\nMore text."),
                nbformat.v4.new_markdown_cell("![b](figures/b.png)\nNot italic, so no caption."),
                nbformat.v4.new_code_cell("plt.show()", outputs=[plot]),
                nbformat.v4.new_code_cell("print(1)"),
                nbformat.v4.new_markdown_cell("![c](figures/c.png)\n*Too short.*")]
    assert uncaptioned(nb) == ["cell 3: figures/b.png", "cell 4: plot", "cell 6: figures/c.png"]


def test_course_pace_and_pictures():
    """The whole course: total and median markdown words, no long cell, enough figures."""
    cells = [c for p in NOTEBOOKS for c in _read(p).cells if c.cell_type == "markdown"]
    words = sorted(len(c.source.split()) for c in cells)
    assert sum(words) <= MAX_COURSE_WORDS, f"{sum(words)} markdown words"
    assert words[(len(words) - 1) // 2] <= MAX_MEDIAN_WORDS
    assert words[-1] <= MAX_CELL_WORDS, f"a markdown cell of {words[-1]} words"
    figures = sum(figure_count(_read(p)) for p in NOTEBOOKS)
    assert figures >= MIN_COURSE_FIGURES, f"{figures} figures across the course"


DIAGRAM_SCRIPTS = sorted((NOTEBOOK_DIR / "figures").glob("*_diagrams.py"))


@pytest.mark.parametrize("script", DIAGRAM_SCRIPTS, ids=[p.name for p in DIAGRAM_SCRIPTS])
def test_diagrams_are_drawn(script, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(script.parent))  # scripts share helpers, as when run
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(drawn) == len(module.DIAGRAMS)
    committed = {p.name for p in (NOTEBOOK_DIR / "figures").glob("*.png")}
    assert set(drawn) <= committed, f"redraw: python notebooks/figures/{script.name}"
    assert all((tmp_path / name).stat().st_size > 5_000 for name in drawn)
