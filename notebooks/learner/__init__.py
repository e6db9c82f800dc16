"""The learner's own code, carried from one chapter to the next.

A chapter notebook marks each cell whose functions later chapters build on with the first line
`# carried over to learner/chNN.py`. The cell runs as any other (its functions are checked
against the package's there), and the notebook's call `write_module("chNN_....ipynb", "chNN")`
writes the marked cells, in the notebook's order, to `notebooks/learner/chNN.py`. A later
chapter imports them from there (`from learner.ch07 import collect_rollouts`) instead of typing
them again or taking the package's. The module is committed as the executed notebook wrote it;
tests/test_notebooks.py checks that it is what the stored notebook's marked cells give, so the
two cannot drift apart.
"""

import inspect
import json
import os
import re
import tempfile
from pathlib import Path

LEARNER_DIR = Path(__file__).resolve().parent


def marker(module):
    """The first line of a cell carried over to learner/<module>.py."""
    return f"# carried over to learner/{module}.py"


def carried_cells(notebook, module):
    """Sources of the notebook's code cells marked for `module`, marker line dropped."""
    cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
    sources = []
    for cell in cells:
        source = cell["source"]
        source = "".join(source) if isinstance(source, list) else source
        first, _, rest = source.partition("\n")
        if cell["cell_type"] == "code" and first.strip() == marker(module):
            sources.append(rest.strip("\n"))
    return sources


def module_source(notebook, module):
    """The text of learner/<module>.py: a header, then the marked cells of `notebook`."""
    name = Path(notebook).name
    header = (f'"""The functions of {name} that later notebooks import.\n\n'
              f'Written by the notebook from its cells that start with "{marker(module)}", in\n'
              'its order: re-run the notebook to rewrite this file, do not edit it.\n"""')
    return "\n\n\n".join([header, *carried_cells(notebook, module)]) + "\n"


def _stale(source, namespace):
    """Names of the module's functions and classes (where their source can be found) that differ
    from the kernel's."""
    stale = []
    for name, obj in namespace.items():
        kind = "def" if inspect.isfunction(obj) else "class" if inspect.isclass(obj) else None
        defined = kind and re.search(rf"^{kind} {name}\b", source, re.M)
        if defined and obj.__module__ == "__main__":
            try:
                if inspect.getsource(obj).strip("\n") not in source:
                    stale.append(name)
            except (OSError, TypeError):
                continue
    return stale


def write_module(notebook, module, namespace=None):
    """Write learner/<module>.py from `notebook`'s marked cells; returns its path.

    The file is read from disk, so save the notebook first: with `namespace` (the kernel's
    `globals()`), a function the kernel ran in another version than the saved one is an error.
    The file is replaced in one step and only when it changes, so a notebook importing it at the
    same moment never reads half of it.
    """
    source, path = module_source(notebook, module), LEARNER_DIR / f"{module}.py"
    stale = _stale(source, namespace or {})
    if stale:
        raise RuntimeError(f"{notebook} on disk has other versions of {stale} than this kernel "
                           "ran: save the notebook, then run this cell again")
    if path.is_file() and path.read_text(encoding="utf-8") == source:
        return path
    fd, tmp = tempfile.mkstemp(dir=LEARNER_DIR, prefix=f".{module}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(source)
    os.replace(tmp, path)
    return path
