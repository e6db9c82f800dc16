"""Ctrl-C at a safe moment: critical sections of a training loop finish before the interrupt.

An optimizer step, a metrics row and a checkpoint write must happen whole: interrupted halfway,
the weights would hold part of an update, or the metrics a row the checkpoint does not know.
Inside `defer_interrupts()` a SIGINT is remembered instead of raised, and handed on when the
block ends: KeyboardInterrupt in a plain process. Everywhere else (sampling rollouts,
evaluating) Ctrl-C acts at once, because those phases change nothing that a checkpoint holds.

Data-parallel runs (several processes, distributed.py) cannot stop at once: a rank that raised
in the middle of its rollouts would leave the others waiting in their next collective. There
`record_interrupts()` remembers SIGINT for the whole run (a `defer_interrupts` block hands its
signal on to it instead of raising), and the loop asks, at points every rank passes in the same
order, whether any rank got one (`distributed.any_rank`); if so every rank raises there.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class InterruptFlag:
    """Set by `record_interrupts`'s SIGINT handler: a Ctrl-C that arrived and was not raised."""

    def __init__(self):
        self.received = False

    def set(self, signum=None, frame=None):
        """The SIGINT handler: remember the interrupt."""
        self.received = True


def _main_thread() -> bool:
    """Only the main thread may install signal handlers."""
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def defer_interrupts():
    """Run the block to the end even if Ctrl-C (SIGINT) arrives; then hand the signal on to the
    handler that was in place before (KeyboardInterrupt, or `record_interrupts`'s flag)."""
    if not _main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        if callable(previous):  # default_int_handler raises KeyboardInterrupt; a flag records
            previous(signal.SIGINT, None)
        else:
            raise KeyboardInterrupt


@contextlib.contextmanager
def record_interrupts(enabled: bool = True):
    """Yield an `InterruptFlag` that SIGINT sets for the whole block, raising nothing; the caller
    decides where to stop. With `enabled=False` (one process) Ctrl-C raises as usual."""
    flag = InterruptFlag()
    if not enabled or not _main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, flag.set)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
