"""Ctrl-C at a safe moment: critical sections of a training loop finish before the interrupt.

An optimizer step, a metrics row and a checkpoint write must happen whole: interrupted halfway,
the weights would hold part of an update, or the metrics a row the checkpoint does not know.
Inside `defer_interrupts()` a SIGINT is remembered instead of raised, and KeyboardInterrupt is
raised when the block ends. Everywhere else (sampling rollouts, evaluating) Ctrl-C acts at once,
because those phases change nothing that a checkpoint holds.
"""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def defer_interrupts():
    """Run the block to the end even if Ctrl-C (SIGINT) arrives; then raise KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may install signal handlers
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
