"""Stopping at a safe moment: Ctrl-C and the schedulers' stop signals end a run with a checkpoint.

An optimizer step, a metrics row and a checkpoint write must happen whole: interrupted halfway,
the weights would hold part of an update, or the metrics a row the checkpoint does not know.
Inside `defer_interrupts()` a SIGINT is remembered instead of raised, and handed on when the
block ends: KeyboardInterrupt in a plain process. Everywhere else (sampling rollouts,
evaluating) Ctrl-C acts at once, because those phases change nothing that a checkpoint holds.

Runs end in practice by SIGTERM more often than by Ctrl-C: a SLURM or Kubernetes preemption,
`timeout`, systemd, a spot-instance notice, torchrun stopping its workers. A training loop
therefore treats the *stop signals* (`DEFAULT_STOP_SIGNALS`: SIGTERM, SIGHUP, and SIGUSR1, which
SLURM's `--signal=USR1@90` sends before the time limit) exactly as Ctrl-C: `stop_signals_raise`
turns each into a `StopSignal`, a KeyboardInterrupt, so the loop's one `except KeyboardInterrupt`
saves `checkpoint-<k>` for both, and `defer_interrupts` defers them as it defers SIGINT. A
command line then exits with `exit_status`: 130 after Ctrl-C (the shell's convention), 75
(EX_TEMPFAIL, "try again") after a stop signal; both mean "stopped with a checkpoint, resumable".
While the run saves after a stop signal, further stop signals are noted and dropped: a scheduler
that repeats its SIGTERM does not cut the save short.

Data-parallel runs (several processes, distributed.py) cannot stop at once: a rank that raised
in the middle of its rollouts would leave the others waiting in their next collective. There
`record_interrupts()` remembers SIGINT and the stop signals for the whole run (a
`defer_interrupts` block hands its signal on to it instead of raising), and the loop asks, at
points every rank passes in the same order, whether any rank got one (`distributed.any_rank`);
if so every rank raises there (`interrupt_exception`).

A rollout or evaluation phase can decode for minutes, longer than a scheduler's grace period
between its stop signal and its SIGKILL. Inside such a phase the decode loops (generation.py)
therefore call `poll_for_stop()` every few tokens: within a `polling_stops(poll)` block that
asks `poll` (distributed.AgreedStop: the flag of every rank, agreed on by one all-reduce), and
raises the stop there, on every rank at the same poll; outside one it does nothing (a lone
process raises where the signal lands anyway). The phase is abandoned (it changed nothing a
checkpoint holds) and the run saves its last finished update.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Protocol

# Signals that stop a run like Ctrl-C (with a checkpoint) unless a run chooses others.
DEFAULT_STOP_SIGNALS = "SIGTERM,SIGHUP,SIGUSR1"
# Exit status of a command line stopped by a stop signal, its checkpoint saved: EX_TEMPFAIL of
# sysexits.h ("a temporary failure; the user is invited to retry"). Ctrl-C keeps 130.
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130
# Signals a run cannot take as stop signals: Ctrl-C is always handled, the others cannot be.
_NOT_STOP_SIGNALS = {"SIGINT", "SIGKILL", "SIGSTOP"}

_watched: tuple[int, ...] = ()  # the stop signals the current run handles (`_handling`)
_stopping = False  # a StopSignal was raised: the run is saving and exiting


class StopPoll(Protocol):
    """What `polling_stops` installs: asked by the decode loops, settled before collectives."""

    def poll(self) -> None:
        """Raise the run's stop (KeyboardInterrupt / StopSignal) if it is to stop here."""

    def settle(self) -> None:
        """Finish this phase's polling (every process), raising the stop if one comes."""


_poll: StopPoll | None = None  # the stop poll of the phase running now (`polling_stops`)


class StopSignal(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP, SIGUSR1, ...) raised where Ctrl-C raises: every
    `except KeyboardInterrupt` that saves a checkpoint saves one for it too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self):
        return f"stopped by {signal.Signals(self.signum).name}"


def parse_stop_signals(text: str) -> tuple[int, ...]:
    """"SIGTERM,HUP,usr1" -> signal numbers ("" or "none": no stop signals). Names this
    platform lacks (SIGHUP, SIGUSR1 on Windows) are left out; unknown names raise ValueError."""
    if not text.strip() or text.strip().lower() == "none":
        return ()
    out = []
    for part in text.split(","):
        name = part.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in _NOT_STOP_SIGNALS:
            raise ValueError(f"{name} cannot be a stop signal (Ctrl-C is always handled; "
                             "SIGKILL and SIGSTOP cannot be caught)")
        if name not in signal.Signals.__members__:
            if name in ("SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT"):
                continue  # a POSIX signal this platform does not have
            raise ValueError(f"unknown signal {part.strip()!r} (e.g. SIGTERM,SIGHUP,SIGUSR1)")
        out.append(int(signal.Signals[name]))
    return tuple(dict.fromkeys(out))


def stop_signal_names(value) -> str | None:
    """A validation rule (validation.py): why `value` is not a list of stop signals, or None."""
    try:
        parse_stop_signals(value)
    except (ValueError, AttributeError) as err:
        return str(err) if isinstance(err, ValueError) else f"expected signal names, got {value!r}"
    return None


def interrupt_exception(signum: int) -> KeyboardInterrupt:
    """What a run raises for a signal: KeyboardInterrupt for SIGINT, StopSignal otherwise."""
    return KeyboardInterrupt() if signum == signal.SIGINT else StopSignal(signum)


def exit_status(stop: KeyboardInterrupt) -> int:
    """A command line's exit status after a stop with a checkpoint: 75 (EXIT_STOPPED) for a stop
    signal, 130 (EXIT_INTERRUPTED) for Ctrl-C."""
    return EXIT_STOPPED if isinstance(stop, StopSignal) else EXIT_INTERRUPTED


def stop_reason(stop: KeyboardInterrupt) -> str:
    """'interrupted' (Ctrl-C) or 'stopped by SIGTERM' (a stop signal), for the run's last line."""
    return str(stop) if isinstance(stop, StopSignal) else "interrupted"


class InterruptFlag:
    """Set by `record_interrupts`'s handler: a Ctrl-C or stop signal that was not raised."""

    def __init__(self, agreed: bool = False):
        self.received = False
        self.signum = 0  # the first signal recorded (0: none)
        self.agreed = agreed  # several processes: a stop is agreed on before anyone raises

    def set(self, signum=signal.SIGINT, frame=None):
        """The signal handler: remember the signal."""
        self.received = True
        self.signum = self.signum or int(signum)


def _main_thread() -> bool:
    """Only the main thread may install signal handlers."""
    return threading.current_thread() is threading.main_thread()


def _raise_stop(signum, frame):
    """One process's stop-signal handler: raise StopSignal where the signal lands, once."""
    global _stopping
    if _stopping:  # already saving after a stop: let the save finish
        print(f"{signal.Signals(signum).name} received while stopping: finishing the checkpoint",
              file=sys.stderr)
        return
    _stopping = True
    raise StopSignal(signum)


@contextlib.contextmanager
def _handling(signals, handler):
    """Install `handler` for `signals` for the block (and record them as the stop signals that
    `defer_interrupts` defers); restore the previous handlers after."""
    global _watched, _stopping
    watched, stopping = _watched, _stopping
    previous = {s: signal.signal(s, handler) for s in signals}
    _watched, _stopping = tuple(signals), False
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _watched, _stopping = watched, stopping


@contextlib.contextmanager
def stop_signals_raise(signals: str = DEFAULT_STOP_SIGNALS):
    """Within the block, each of `signals` (names, `parse_stop_signals`) raises `StopSignal`
    where it lands, as Ctrl-C raises KeyboardInterrupt (one-process runs)."""
    if not _main_thread():
        yield
        return
    with _handling(parse_stop_signals(signals), _raise_stop):
        yield


@contextlib.contextmanager
def defer_interrupts():
    """Run the block to the end even if Ctrl-C (SIGINT) or a stop signal arrives; then hand the
    first signal on to the handler that was in place before (KeyboardInterrupt, StopSignal, or
    `record_interrupts`'s flag)."""
    if not _main_thread():
        yield
        return
    received = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in dict.fromkeys((signal.SIGINT, *_watched))}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if received:
        handler = previous[received[0]]
        if callable(handler):  # default_int_handler or _raise_stop raise; a flag records
            handler(received[0], None)
        else:
            raise interrupt_exception(received[0])


@contextlib.contextmanager
def record_interrupts(enabled: bool = True, signals: str = ""):
    """Yield an `InterruptFlag` that SIGINT and the stop `signals` set for the whole block,
    raising nothing; the caller decides where to stop. With `enabled=False` (one process)
    Ctrl-C raises as usual and the stop signals raise StopSignal (`stop_signals_raise`)."""
    flag = InterruptFlag(agreed=enabled)
    if not _main_thread():
        yield flag
        return
    if not enabled:
        with stop_signals_raise(signals):
            yield flag
        return
    with _handling((signal.SIGINT, *parse_stop_signals(signals)), flag.set):
        yield flag


def stops_on_signals(train):
    """Decorator for a one-process training function with a `config` argument: while it runs,
    config.stop_signals raise StopSignal (`stop_signals_raise`), so its Ctrl-C handling saves
    and stops for them too."""
    params = inspect.signature(train)

    @functools.wraps(train)
    def run(*args, **kwargs):
        config = params.bind(*args, **kwargs).arguments["config"]
        with stop_signals_raise(config.stop_signals):
            return train(*args, **kwargs)
    return run


def exit_on_stop(main, argv):
    """Run a script's `main(argv)`; a Ctrl-C or stop signal that ends it (the run below saved what
    it had) exits with `exit_status` (130 / 75) instead of a traceback."""
    try:
        return main(argv)
    except KeyboardInterrupt as stop:
        raise SystemExit(exit_status(stop)) from None


@contextlib.contextmanager
def polling_stops(poll: StopPoll | None) -> Iterator[None]:
    """Within the block, `poll_for_stop()` (the decode loops, every few tokens) asks `poll`;
    the block ends with `poll.settle()`. None: nothing is polled (a one-process run, whose
    stop signals raise at once)."""
    global _poll
    if poll is None:
        yield
        return
    previous, _poll = _poll, poll
    try:
        yield
        poll.settle()  # an exception leaves without: a stop was agreed, or the run failed
    finally:
        _poll = previous


def poll_for_stop() -> None:
    """Called by long loops (generation's decode loops, every STOP_CHECK_EVERY tokens): raise
    the run's stop here if the phase's `StopPoll` says so; nothing outside `polling_stops`."""
    if _poll is not None:
        _poll.poll()


def settle_stop_polls() -> None:
    """Called before a collective (distributed.py's helpers): inside `polling_stops`, first
    wait until every process has finished polling, so a poll never meets another collective."""
    if _poll is not None:
        _poll.settle()
