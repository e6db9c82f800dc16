"""Running a command-line job inside its process group, for the training and distillation
scripts: join torchrun's group (a no-op without torchrun; a group of one process for `--fsdp`
started with plain python), run, and leave the group through `shutdown_distributed`, which
meets the other processes first, however the job ended."""

from __future__ import annotations

import sys

from ..device import get_device
from ..distributed import DEFAULT_TIMEOUT_MINUTES, init_distributed, shutdown_distributed
from .arguments import set_threads

TIMEOUT_HELP = ("minutes any collective waits for the other processes before the run fails: "
                "work one process does alone (rank 0's checkpoint writes) must fit")


def add_timeout_argument(parser) -> None:
    """--dist-timeout-minutes, for every script that may run under torchrun."""
    parser.add_argument("--dist-timeout-minutes", type=float, default=DEFAULT_TIMEOUT_MINUTES,
                        help=TIMEOUT_HELP)


def run_in_process_group(work, run, script: str):
    """`work(run, device)` inside the process group; its result. A device torchrun cannot use
    (e.g. MPS) or a timeout that is not positive exits with argparse's status 2 and message."""
    set_threads(run.threads)
    try:
        # a no-op without torchrun; sharding needs a process group, even one of one process
        device = init_distributed(get_device(run.device), run.dist_timeout_minutes,
                                  group_of_one=run.config.fsdp)
    except ValueError as err:
        print(f"{script}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        return work(run, device)
    finally:  # normal end, stop signal or error: every process leaves the same way
        shutdown_distributed()
