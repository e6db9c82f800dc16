"""Execute the notebooks top to bottom and save them with their outputs and plots.

The notebooks are committed executed, so a reader browsing them sees the results. Each runs in a
fresh kernel of *this* interpreter (a kernelspec written to a temporary directory, so `python`
on PATH does not matter), with no network (HF_HUB_OFFLINE=1) and one CPU thread (on a small
shared CPU, several threads per process are many times slower). tests/test_notebooks.py uses
`execute_notebook` too, without writing.

    python notebooks/execute.py       # every notebook in notebooks/ and notebooks/solutions/
    python notebooks/execute.py notebooks/ch06_grpo.ipynb notebooks/solutions/ch06_solutions.ipynb

A notebook runs in its own directory, so its relative paths (../docs/...) work as in Jupyter.
The committed outputs show the opt-in cells of chapters 2-9 skipped: this script unsets QWEN3_DIR
(the local Qwen3 checkpoint those cells run on; notebooks/README.md), which a reader sets to run
them in Jupyter.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent
SOLUTIONS_DIR = NOTEBOOK_DIR / "solutions"
KERNEL_NAME = "rfs-python"
CELL_TIMEOUT_S = 300
# The kernel inherits these: no hub access, one thread.
KERNEL_ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
OPT_IN_ENV = "QWEN3_DIR"  # unset by main(): the committed outputs show the opt-in cells skipped


def write_kernelspec(kernels_dir: Path) -> None:
    """A kernelspec in `kernels_dir` whose kernel runs this interpreter."""
    spec_dir = kernels_dir / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"Python ({sys.executable})", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def execute_notebook(nb, kernels_dir: Path, timeout: int = CELL_TIMEOUT_S,
                     cwd: Path = NOTEBOOK_DIR) -> float:
    """Run every cell of notebook `nb` in place (outputs filled in), in directory `cwd`;
    returns the wall seconds."""
    os.environ.update(KERNEL_ENV)
    specs = KernelSpecManager(kernel_dirs=[str(kernels_dir)])
    client = NotebookClient(
        nb, km=AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs),
        timeout=timeout, resources={"metadata": {"path": str(cwd)}},
    )
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("notebooks", nargs="*", type=Path,
                   help="notebooks to execute (none: every notebooks/*.ipynb and "
                   "notebooks/solutions/*.ipynb)")
    args = p.parse_args(argv)
    if os.environ.pop(OPT_IN_ENV, None):
        print(f"{OPT_IN_ENV} unset for this run: the saved notebooks show the opt-in cells "
              "skipped")
    paths = args.notebooks or (sorted(NOTEBOOK_DIR.glob("*.ipynb"))
                               + sorted(SOLUTIONS_DIR.glob("*.ipynb")))
    with tempfile.TemporaryDirectory() as kernels:
        write_kernelspec(Path(kernels))
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            seconds = execute_notebook(nb, Path(kernels), cwd=path.resolve().parent)
            nb.metadata.pop("widgets", None)
            nbformat.write(nb, path)
            print(f"{path}: executed in {seconds:.0f} s, saved with its outputs")


if __name__ == "__main__":
    main()
