"""Data parallelism across processes started by `torchrun`: one process (rank) per GPU or per
group of CPU cores, each holding the whole model, each sampling and learning from its share of
a step's prompts.

torchrun starts N copies of a script and tells each who it is through environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `init_distributed` joins them into one
process group (NCCL between CUDA GPUs, Gloo between CPU processes). Without torchrun nothing is
initialised and every helper here acts as in a group of one (`world_size() == 1`, gathers return
`[obj]`, reductions return their input), so the training loop runs the same code either way.

What the GRPO loop (training.py) needs, and why each helper exists:
- `shard_range`: a step's prompts split into contiguous blocks, whole groups per rank, so the
  group-relative advantages need no communication and concatenating the blocks in rank order
  gives back the original order (samples, evaluation records).
- `all_reduce_sum` / `any_rank` / `all_gather_objects`: global loss normalisers (token and
  completion counts), interrupt agreement, and the step's rewards and samples for the metrics.
- `data_parallel`: the model seen through torch's DistributedDataParallel, whose backward sums
  each bucket of gradients over the ranks while the rest of the backward still runs (overlap).
  The per-rank losses are already divided by the *global* normalisers, so the sum (`_sum_hook`)
  is exactly the gradient of the one-process loss on the whole batch (DDP's own average would
  be right only with equal shares).
- `run_on_main`: file writes happen on rank 0 alone; its errors reach every rank, so no rank
  waits forever in a collective that rank 0 never joins.

Chapter 9's distillation (`sft.sft_step`) uses the same pieces: each process takes its `shard`
of a batch of traces, divides its summed loss by the whole batch's completion tokens and runs
its backward through `data_parallel`.

- `AgreedStop`: a stop signal that reached any rank, agreed on inside a rollout or evaluation
  phase: the decode loops poll it every few tokens (interrupts.py's `polling_stops`), and every
  helper here first settles the polls, so a poll never meets another collective.

This is replicated data parallelism: every process holds the whole model and its AdamW state.
fsdp.py shards them instead (`--fsdp`), reusing these helpers for everything but the gradients.
"""

from __future__ import annotations

import gc
import inspect
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .interrupts import InterruptFlag, interrupt_exception, settle_stop_polls

# How long a collective waits for the other processes before it fails the run (minutes). Work that
# one process does while the others wait in the next collective must fit: rank 0's checkpoint and
# Hugging Face writes, the base evaluation's stragglers. NCCL's own default is 10 minutes.
DEFAULT_TIMEOUT_MINUTES = 30.0

# How long a process leaving the group waits for the others (seconds, `shutdown_distributed`).
# After a normal end or a stop signal they all come within moments; after an error on one
# process the others may never come (they wait in a collective until torchrun stops them).
LEAVE_TIMEOUT_S = 30.0
# How long a process that left the group lets the group's threads finish when something still
# holds the group (seconds, `shutdown_distributed`): ample for a thread that only waits for the
# GIL to release a finished collective's tensors.
LEAVE_GRACE_S = 0.5

# What torchrun sets for every worker (see `launched_by_torchrun`).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """Whether this process is a torchrun worker (its environment names a rank and a group)."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def env_world_size() -> int:
    """WORLD_SIZE from the environment (1 without torchrun), readable before initialisation."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    """Whether a process group is initialised (a torchrun run, even with one process)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 .. world_size() - 1 (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes in the group (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Rank 0: the one process that writes files and prints progress."""
    return rank() == 0


def backend_for(device) -> str:
    """The process group's backend for `device`: NCCL between CUDA GPUs, Gloo between CPUs."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device: torch.device, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
                     group_of_one: bool = False) -> torch.device:
    """Join torchrun's process group (`backend_for` the device); returns this rank's device.

    Outside torchrun nothing happens and `device` comes back, unless `group_of_one`: then a
    group of this process alone (in-memory store), which FSDP needs even for one process.
    Already initialised: nothing happens. On CUDA every rank takes GPU LOCAL_RANK of its
    machine: one process per GPU. timeout_minutes: how long any collective may wait for the
    other processes before it fails (`DEFAULT_TIMEOUT_MINUTES`).
    """
    device = torch.device(device)
    if timeout_minutes <= 0:
        raise ValueError(f"the process group timeout must be positive, got {timeout_minutes} "
                         "minutes")
    torchrun = launched_by_torchrun()
    if is_distributed() or not (torchrun or group_of_one):
        return device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"data-parallel runs need CUDA or CPU processes, not {device.type} "
                         "(torch.distributed has no backend for it)")
    local = int(os.environ["LOCAL_RANK"]) if torchrun else 0
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local)
        elif torchrun and env_world_size() > 1 and device.index != local:
            raise ValueError(f"--device {device}: under torchrun each process takes GPU "
                             "LOCAL_RANK; pass --device cuda (choose GPUs with "
                             "CUDA_VISIBLE_DEVICES)")
        torch.cuda.set_device(device)  # NCCL and the object collectives use the current GPU
    timeout = timedelta(minutes=timeout_minutes)
    if torchrun:  # the rendezvous from torchrun's environment variables
        dist.init_process_group(backend_for(device), timeout=timeout)
    else:
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timeout)
    return device


def shutdown_distributed(timeout_s: float = LEAVE_TIMEOUT_S) -> None:
    """Meet the other processes, then leave the process group (if any) and stop its threads;
    every way out of a data-parallel program (an entry point, a test worker) ends here.

    Why always meet: destroying a Gloo group stops this process's connection threads, and a
    process that leaves while another is still exchanging the last collective's messages with
    it aborts that other ("terminate called without an active exception": SIGABRT at exit, at
    random). A process that never comes (one that failed, or one waiting in another collective)
    is waited for `timeout_s` seconds at most; then this one leaves anyway.

    Why stop the threads here: `destroy_process_group` forgets the group, but its backend (and
    Gloo's worker threads) lives on while anything still refers to it: a sharded model's FSDP
    state, a DDP view. A worker thread that drops a finished collective's tensors takes the
    GIL to release their Python objects; if that happens while the interpreter shuts down, the
    thread is ended inside C++ code that cannot unwind, and the process aborts with the same
    message. So the group's last references are collected here, while the interpreter still
    runs, and a group that something else still holds gets LEAVE_GRACE_S seconds, with the GIL
    released, for its threads to finish what they hold.

    Why the last reference is this function's own: the backend's destructor waits for its
    worker threads, and one of them may still be waiting for the GIL to release a finished
    collective's tensors. A DDP reducer dropping the last reference keeps the GIL while that
    destructor waits: a deadlock (seen: the main thread in ~Reducer -> ~ProcessGroupGloo, a
    worker in ~AsyncAllgatherWork waiting for the GIL). torch drops a Python reference to a
    group with the GIL released, so the collection runs while `group` still holds the backend,
    and `del group` stops it.
    """
    if not is_distributed():
        return
    if dist.get_world_size() > 1:
        try:
            _meet(timeout_s)
        except RuntimeError:  # someone did not come in time: leave without them
            pass
    group, threads = dist.group.WORLD, _os_thread_count()
    dist.destroy_process_group()
    gc.collect()  # a model, its hooks, a DDP reducer: freed now; `group` keeps the backend
    del group  # if this was the last reference, the backend stops here, GIL released
    if threads is None or _os_thread_count() >= threads:  # its threads still run
        time.sleep(LEAVE_GRACE_S)  # GIL released: they finish what they hold


def _os_thread_count() -> int | None:
    """This process's operating-system threads, C++ ones included (Linux: /proc/self/task);
    None where that cannot be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _meet(timeout_s: float) -> None:
    """A barrier that gives up after `timeout_s` (RuntimeError): Gloo's monitored barrier
    (point-to-point with rank 0, so it cannot pair up with another process's collective), or
    an asynchronous NCCL barrier waited for at most that long."""
    timeout = timedelta(seconds=timeout_s)
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timeout)
    else:
        dist.barrier(async_op=True).wait(timeout=timeout)


def refuse_multiple_processes(script: str, why: str) -> None:
    """Raise SystemExit when started by torchrun with more than one process (before any work)."""
    if env_world_size() > 1:
        raise SystemExit(f"{script} runs in one process only ({why}); start it with python, "
                         "not torchrun")


def _comm_device() -> torch.device:
    """Where collective tensors live: the current GPU for NCCL, the CPU for Gloo."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait until every rank gets here (e.g. until rank 0 has written a checkpoint)."""
    if world_size() > 1:
        settle_stop_polls()
        dist.barrier()


def shard_range(n: int, rank_: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[start, stop) of this rank's contiguous share of n items (shares differ by at most 1)."""
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    return r * n // w, (r + 1) * n // w


def shard(items: Sequence, rank_: int | None = None, world: int | None = None) -> list:
    """This rank's contiguous share of `items` (`shard_range`); all of them in a group of one."""
    start, stop = shard_range(len(items), rank_, world)
    return list(items[start:stop])


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (any picklable object)."""
    if world_size() == 1:
        return [obj]
    settle_stop_polls()
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_lists(items: list) -> list:
    """Every rank's list, concatenated in rank order (the inverse of `shard`), on every rank."""
    return [x for part in all_gather_objects(list(items)) for x in part]


def gather_groups(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(every rank's x concatenated along dim 0, where this rank's rows start): the groups of a
    whole batch, for statistics over all of them (GRPO's batch-std scaling, GDPO)."""
    if world_size() == 1:
        return x, 0
    parts = all_gather_objects(x.detach().cpu())
    start = sum(p.shape[0] for p in parts[:rank()])
    return torch.cat(parts).to(x.device), start


def _all_reduce(values: Sequence[float], op: str) -> list[float]:
    """A float64 all-reduce ("sum" or "max") of a few numbers (exact for counts below 2**53)."""
    if world_size() == 1:
        return [float(v) for v in values]
    settle_stop_polls()
    return _reduce_now(values, op)


def _reduce_now(values: Sequence[float], op: str) -> list[float]:
    """`_all_reduce` without settling the stop polls first (the polls' own collective)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Each value summed over the ranks (token counts, loss statistics)."""
    return _all_reduce(values, "sum")


def all_reduce_max(values: Sequence[float]) -> list[float]:
    """Each value's maximum over the ranks."""
    return _all_reduce(values, "max")


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (e.g. Ctrl-C reached one of them)."""
    return all_reduce_max([float(bool(flag))])[0] > 0


def all_ranks(flag: bool) -> bool:
    """True on every rank only if `flag` is true on all of them (e.g. every loss finite)."""
    return not any_rank(not flag)


def _sum_hook(state, bucket):
    """DDP communication hook: a bucket of gradients summed over the ranks (DDP's default hook
    divides by the world size first; our losses are already shares of the whole batch)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class _Methods(nn.Module):
    """What DDP wraps: a forward that calls the model's forward method `method` by name, so the
    loss code's passes (`forward`, and `forward_hidden` whose output meets `lm_head` in chunks)
    all run through DDP's forward, which readies the gradient reduction of the next backward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, method: str, *args, **kwargs):
        return getattr(self.model, method)(*args, **kwargs)


# DDP's option for "no buffer broadcast before each forward": `forward_sync_buffers=False` where
# torch has it (2.13); older torch (2.11, the GPU machines' image) calls it broadcast_buffers.
NO_FORWARD_BUFFER_SYNC = {
    "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
        DistributedDataParallel.__init__).parameters else "broadcast_buffers": False}


class Replicated:
    """A replicated model seen through `DistributedDataParallel`: calling it, or its
    `forward_hidden`, runs through DDP; every other attribute (`lm_head`, `cfg`, the blocks) is
    the model's own. DDP registers hooks on the parameters: each bucket of gradients (reverse
    parameter order, `bucket_cap_mb`) is summed over the ranks (`_sum_hook`) as soon as the
    backward has produced it; `sync_next_backward(False)`: a backward that only accumulates
    locally (all but the last micro-batch of a step). The model itself is not changed: its state
    dict, checkpoints and optimizer see the plain parameters, and a deep copy of it (the KL
    reference) comes without the view."""

    def __init__(self, model: nn.Module):
        self.module = model
        self.group = dist.group.WORLD
        # buffers (RoPE tables) are the same everywhere: synced once when DDP starts (as the
        # weights are), not broadcast again before each forward
        self.ddp = DistributedDataParallel(_Methods(model), **NO_FORWARD_BUFFER_SYNC)
        self.ddp.register_comm_hook(None, _sum_hook)

    def __call__(self, *args, **kwargs):
        return self.ddp("forward", *args, **kwargs)

    def forward_hidden(self, *args, **kwargs):
        return self.ddp("forward_hidden", *args, **kwargs)

    def sync_next_backward(self, sync: bool) -> None:
        """Whether the backward of the next forward sums the gradients over the ranks; False:
        it only accumulates them locally (what DDP's `no_sync` context sets)."""
        self.ddp.require_backward_grad_sync = sync

    def __getattr__(self, name):  # only for names not found on the view itself
        return getattr(self.__dict__["module"], name)

    def __deepcopy__(self, memo):  # a copy of the model (the reference) is not wrapped
        return None


def data_parallel(model):
    """`model` for the update's forward and backward passes: with several replicated processes
    its `Replicated` DDP view (made once per model and process group; DDP's construction is a
    collective, so every rank calls this at the same point), else `model` itself (one process).
    Not for a sharded model: FSDP reduces its gradients itself."""
    if world_size() == 1:
        return model
    settle_stop_polls()  # DDP's broadcast at construction and its backward are collectives
    view = model.__dict__.get("_replicated")
    if view is None or view.group is not dist.group.WORLD:
        view = model.__dict__["_replicated"] = Replicated(model)  # not a submodule: no state
    return view


# Elements summed at a time by `params_checksum`: its float64 copy is this small, whatever the
# tensor (a whole 8B embedding in float64 would be 5 GB).
CHECKSUM_CHUNK_NUMEL = 1 << 20


@torch.no_grad()
def params_checksum(params) -> float:
    """Sum of every parameter element in float64: a cheap fingerprint to compare weights across
    ranks. Summed chunk by chunk, so no tensor is ever copied whole to float64."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        for chunk in p.detach().reshape(-1).split(CHECKSUM_CHUNK_NUMEL):
            total += chunk.sum(dtype=torch.float64).cpu()
    return float(total)


def check_same_on_all_ranks(value: float, what: str) -> None:
    """Raise RuntimeError on every rank if `value` differs between ranks (diverged replicas)."""
    values = all_gather_objects(value)
    if any(v != values[0] for v in values):
        raise RuntimeError(f"{what} differs between ranks: {values}")


def check_replicas_agree(model) -> None:
    """Raise RuntimeError on every rank if `model`'s weights differ between the ranks (their
    `params_checksum`); nothing in a group of one. Runs after the final save, so a run whose
    replicas drifted apart still leaves its files, and then fails."""
    if world_size() > 1:
        check_same_on_all_ranks(params_checksum(model.parameters()), "model weights")


def run_on_main(fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) on rank 0 only; every rank returns its result, or raises its error.

    For file writes: if rank 0 fails (a run directory in use, a full disk), the other ranks
    raise the same exception instead of waiting for rank 0 in the next collective.
    """
    if world_size() == 1:
        return fn(*args, **kwargs)
    box = [None]
    if is_main():
        try:
            box[0] = ("ok", fn(*args, **kwargs))
        except Exception as err:  # sent to the other ranks, then raised here too
            box[0] = ("error", err)
    settle_stop_polls()  # after fn: rank 0's own decoding may poll, the others answer
    dist.broadcast_object_list(box, src=0, device=_comm_device())
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


class AgreedStop:
    """A stop signal agreed on inside a phase by every process (`interrupts.StopPoll`).

    Each process's decode loops call `poll` every few tokens: one all-reduce of (the signal
    this process recorded, 1 = still working); any signal raises the stop on every process at
    the same poll. Processes decode different numbers of tokens, so a process whose work ended
    first `settle`s, answering the others' polls with 0, until every one reports 0: the polls
    pair up in order, whatever each process decoded, and the next collective meets its
    partners. A poll costs one small all-reduce (a host sync) per STOP_CHECK_EVERY tokens.
    """

    def __init__(self, flag: InterruptFlag):
        self.flag = flag

    def _agree(self, working: bool) -> bool:
        """One all-reduce of (signal, working); raises an agreed stop; True while any works."""
        signum, working_anywhere = _reduce_now([self.flag.signum, float(working)], "max")
        if signum:
            raise interrupt_exception(int(signum))
        return working_anywhere > 0

    def poll(self) -> None:
        """A decode loop's look at the stop (this process still works)."""
        self._agree(True)

    def settle(self) -> None:
        """This process is done with the phase: answer the others' polls until all are."""
        while self._agree(False):
            pass


def agreed_stop(flag: InterruptFlag) -> AgreedStop | None:
    """The stop poll of a run whose interrupts `flag` records: `AgreedStop` with several
    processes, None for one (its stop signals raise where they land)."""
    return AgreedStop(flag) if world_size() > 1 else None
