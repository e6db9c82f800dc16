"""Running a command-line job inside its process group, for the training and distillation
scripts: join torchrun's group (a no-op without torchrun; a group of one process for `--fsdp`
started with plain python), run, and leave the group together."""

from __future__ import annotations

import sys

from ..device import get_device
from ..distributed import init_distributed, shutdown_distributed
from ..fsdp import init_group_of_one
from .arguments import set_threads


def run_in_process_group(work, run, script: str):
    """`work(run, device)` inside the process group; its result. A device torchrun cannot use
    (e.g. MPS) exits with argparse's status 2 and message."""
    set_threads(run.threads)
    try:
        device = init_distributed(get_device(run.device))  # a no-op without torchrun
        if run.config.fsdp:  # sharding needs a process group, even one of one process
            init_group_of_one()
    except ValueError as err:
        print(f"{script}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        result = work(run, device)
    except BaseException:  # the others may never arrive: leave without waiting
        shutdown_distributed()
        raise
    shutdown_distributed(wait=True)  # every process finished: leave together
    return result
