"""Resumable training checkpoints and run directories (safetensors + JSON, never pickles).

A checkpoint directory `checkpoint-<k>/` holds the state after exactly k optimizer updates:
the model in Hugging Face layout (so `load_pretrained` loads it), the AdamW state flattened into
optimizer.safetensors with its structure in trainer_state.json, and the RNG states as uint8
tensors in rng.safetensors, and the state of any other learner the run keeps (process
supervision's online PRM: its weights, AdamW state and counters) in `<name>.safetensors`, named
under "states" in trainer_state.json (`save_states`; a run without one writes neither). An FSDP
run's checkpoint holds the model and AdamW shards instead
(fsdp.py, DCP) and, beside them, the model's config and tokenizer; the whole weights in HF
layout (a full copy that rank 0 writes while the other processes wait) only in final/ and
where the run asks for them (`export_hf_checkpoints`): resuming reads the shards alone.
A checkpoint is written to a temporary directory and renamed into place, so a crash leaves
the previous checkpoint or the new one, never half of one.

A run directory holds a run's checkpoints next to its logs; `find_checkpoint` picks the latest
*intact* one (a truncated file or NaN weights make a checkpoint unusable, and resuming falls back
to the one before, saying so), and `check_new_run_dir` keeps a new run from overwriting an old.
A run killed before its first checkpoint is started over in place (`find_checkpoint_or_restart`).

Checkpoint policy (`CheckpointPolicy`): besides final/ and the one a stop writes, a run saves
`checkpoint-<k>` every N updates and/or every M minutes of wall time, and keeps only the latest
K of them, so an uncatchable kill (SIGKILL, the OOM killer, a power cut) loses at most M
minutes and the disk holds at most K + 1 copies of the model and its optimizer state. A write
that fails (a full disk) raises `CheckpointWriteError`, naming the path and the free space; the
half-written directory is removed and the checkpoints before it stay whole.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
import warnings
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from .files import atomic_save_safetensors, atomic_write_json, free_space, read_json
from .fsdp import is_sharded, is_sharded_checkpoint, load_sharded
from .weights import (
    has_weights,
    load_hf_state_dict,
    non_finite_tensors,
    read_safetensors,
    save_pretrained,
)

STATE_FILE = "trainer_state.json"
_CHECKPOINT_NAME = re.compile(r"checkpoint-\d+")  # not checkpoint-3.tmp / .old leftovers
# A stopped run's exit status (75 after a stop signal, 130 after Ctrl-C), written beside its
# checkpoints and removed when it resumes: under torchrun, which itself exits 1, it tells a
# batch script to requeue the job (docs/preemption.md).
STOPPED_FILE = "stopped"
# What a run writes into its directory; a new run refuses a directory holding any of these.
RUN_FILES = ("config.json", "metrics.csv", "samples.jsonl", "summary.json", "metrics.png",
             "final", "reference", "tensorboard", "wandb", STOPPED_FILE)


# ----------------------------------------------------------------------------------------------
# Optimizer and RNG state as tensors
# ----------------------------------------------------------------------------------------------

def _optimizer_to_flat(optimizer):
    """AdamW state -> ({"state.<param>.<key>": tensor}, JSON-able structure)."""
    sd = optimizer.state_dict()
    tensors, structure = {}, {"param_groups": sd["param_groups"], "state": {}}
    for pid, state in sd["state"].items():
        entry = {}
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{key}"] = value
                entry[key] = {"tensor": f"state.{pid}.{key}"}
            else:
                entry[key] = {"value": value}
        structure["state"][str(pid)] = entry
    return tensors, structure


def _optimizer_from_flat(tensors, structure):
    """Inverse of `_optimizer_to_flat`: a state dict for `optimizer.load_state_dict`."""
    state = {
        int(pid): {k: (tensors[v["tensor"]] if "tensor" in v else v["value"])
                   for k, v in entry.items()}
        for pid, entry in structure["state"].items()
    }
    return {"state": state, "param_groups": structure["param_groups"]}


def _rng_tensors():
    """Global RNG states (torch CPU, CUDA, Python) as uint8 tensors."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    py = json.dumps(random.getstate()).encode()
    out["python"] = torch.frombuffer(bytearray(py), dtype=torch.uint8)
    return out


def _restore_rng(tensors):
    """Inverse of `_rng_tensors`."""
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    state = json.loads(bytes(tensors["python"].tolist()).decode())
    random.setstate((state[0], tuple(state[1]), state[2]))


# ----------------------------------------------------------------------------------------------
# Other learners' state (e.g. the online PRM) as tensors
# ----------------------------------------------------------------------------------------------

def state_to_flat(state) -> tuple[dict, object]:
    """A nested `state_dict()` (dicts with str or int keys, lists, tuples, tensors, JSON values)
    -> ({"<path>": tensor}, a JSON structure naming them). A tensor whose storage an earlier one
    holds (tied weights) is copied: a safetensors file holds no shared memory."""
    tensors, seen = {}, set()

    def walk(obj, path):
        if torch.is_tensor(obj):
            if path in tensors:
                raise ValueError(f"state_to_flat: two tensors at {path!r}")
            ptr = obj.untyped_storage().data_ptr()
            tensors[path] = obj.detach().clone() if ptr and ptr in seen else obj.detach()
            seen.add(ptr)
            return {"tensor": path}
        if isinstance(obj, dict):
            return {"dict": [[k, walk(v, f"{path}.{k}" if path else str(k))]
                             for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        return {"value": obj}

    return tensors, walk(state, "")


def state_from_flat(tensors, structure):
    """Inverse of `state_to_flat`: the nested state, keys with their types (int or str)."""
    (kind, value), = structure.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "dict":
        return {k: state_from_flat(tensors, v) for k, v in value}
    if kind in ("list", "tuple"):
        items = [state_from_flat(tensors, v) for v in value]
        return items if kind == "list" else tuple(items)
    return value


def copy_state(state):
    """A copy of a nested state whose tensors are clones (on their own devices): the state as it
    is now, whatever later updates do to the original."""
    tensors, structure = state_to_flat(state)
    return state_from_flat({k: t.clone() for k, t in tensors.items()}, structure)


def save_states(directory, states: dict) -> dict:
    """Each learner's state (name -> `state_dict()` result) into `directory`/<name>.safetensors,
    atomically; returns trainer_state.json's "states" entry: name -> file and structure."""
    entry = {}
    for name, state in states.items():
        tensors, structure = state_to_flat(state)
        atomic_save_safetensors(tensors, Path(directory) / f"{name}.safetensors")
        entry[name] = {"file": f"{name}.safetensors", "structure": structure}
    return entry


def load_states(path, trainer_state: dict, states: dict) -> None:
    """Each learner in `states` (name -> object with `load_state_dict`) from checkpoint `path`;
    a checkpoint written before it kept one warns (the learner keeps its initial state, so the
    resumed run is not exact)."""
    saved = trainer_state.get("states", {})
    for name, learner in states.items():
        if name not in saved:
            warnings.warn(f"{path} holds no {name} state (written before checkpoints kept it): "
                          f"the {name} restarts from its initial state, so the resumed run is "
                          "not the uninterrupted one", RuntimeWarning, stacklevel=3)
            continue
        tensors = read_safetensors(Path(path) / saved[name]["file"])
        learner.load_state_dict(state_from_flat(tensors, saved[name]["structure"]))


# ----------------------------------------------------------------------------------------------
# Save, verify, find, load
# ----------------------------------------------------------------------------------------------

class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a failing device); the previous
    checkpoints are untouched."""


def save_checkpoint(out_dir, model, tokenizer, optimizer, step, config, extra=None,
                    hf_weights: bool = True, states: dict | None = None) -> Path:
    """Write a resumable checkpoint directory atomically (temp dir, then rename).

    `step` is the number of optimizer updates the weights contain; `config` a dataclass or dict
    saved in trainer_state.json with `extra`. A failed write raises CheckpointWriteError after
    removing the temp dir (giving its space back); an existing `out_dir` survives it.
    optimizer None: an FSDP run's checkpoint, whose model and AdamW shards every process has
    already written into the temp dir (`fsdp.save_sharded`); `model` is then the unsharded
    replica, whose weights go beside them in HF layout if `hf_weights` (else only its config
    and tokenizer: resuming reads the shards). Without FSDP the HF-layout weights are the
    checkpoint's model state and always written.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    try:
        structure = "sharded"
        if optimizer is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        # HF layout: load_pretrained(out_dir) works (FSDP without hf_weights: config only)
        save_pretrained(model, tokenizer, tmp, weights=hf_weights or optimizer is not None)
        if optimizer is not None:
            tensors, structure = _optimizer_to_flat(optimizer)
            atomic_save_safetensors(tensors, tmp / "optimizer.safetensors")
        atomic_save_safetensors(_rng_tensors(), tmp / "rng.safetensors")
        saved = save_states(tmp, states) if states else {}
        atomic_write_json(tmp / STATE_FILE, {
            "step": step, "config": asdict(config) if is_dataclass(config) else dict(config),
            "optimizer": structure, **({"states": saved} if saved else {}), **(extra or {}),
        })
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"could not write checkpoint {out_dir} ({err.strerror or err}; "
            f"{free_space(out_dir.parent)}); the checkpoints before it are intact: make room, "
            f"then continue with --resume {out_dir.parent}") from err
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
    return out_dir


def read_trainer_state(path) -> dict:
    """A checkpoint's trainer_state.json (errors name the file)."""
    state = read_json(Path(path) / STATE_FILE)
    if not isinstance(state.get("step"), int):
        raise ValueError(f"{Path(path) / STATE_FILE}: no integer 'step'")
    return state


def checkpoint_problem(path) -> str | None:
    """Why checkpoint dir `path` cannot be resumed from (unreadable or non-finite), or None."""
    path = Path(path)
    sharded = is_sharded_checkpoint(path)
    try:
        state = read_trainer_state(path)
        # an FSDP checkpoint may hold no HF weights: its shards are its model state
        weights = load_hf_state_dict(path) if not sharded or has_weights(path) else {}
        if not sharded:  # DCP checks its own shards when it loads them
            read_safetensors(path / "optimizer.safetensors")
        read_safetensors(path / "rng.safetensors")
        for entry in state.get("states", {}).values():  # other learners' (an online PRM)
            read_safetensors(path / entry["file"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return str(err)
    bad = non_finite_tensors(weights)
    if bad:
        return f"{path}: weights hold NaN or inf ({', '.join(bad[:3])})"
    return None


def _candidates(run_dir: Path) -> list[Path]:
    """Checkpoint dirs of a run (checkpoint-<k>, final), latest first.

    Ordered by the step in trainer_state.json (a resumed run's final/ can be older than its
    checkpoint-<k>), by the directory name where that file is unreadable; final/ wins a tie.
    """
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir()
             if p.is_dir() and (_CHECKPOINT_NAME.fullmatch(p.name) or p.name == "final")]

    def order(p):
        try:
            step = read_trainer_state(p)["step"]
        except (OSError, ValueError):
            step = -1 if p.name == "final" else int(p.name.split("-")[1])
        return step, p.name == "final"
    return sorted(found, key=order, reverse=True)


def find_checkpoint(path, log=print) -> Path:
    """`path` if it is an intact checkpoint, else the latest intact checkpoint of run dir `path`.

    A corrupt latest checkpoint (truncated file, NaN weights) is skipped with a message via
    `log`; asking for a corrupt checkpoint by name raises, naming the intact alternatives.
    """
    path = Path(path)
    if (path / STATE_FILE).exists() or _CHECKPOINT_NAME.fullmatch(path.name) \
            or path.name == "final":
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        intact = [p.name for p in _candidates(path.parent) if checkpoint_problem(p) is None]
        raise ValueError(f"checkpoint {path} is unusable: {problem}. Intact checkpoints of "
                         f"that run: {', '.join(intact) or 'none'}")
    candidates = _candidates(path)
    if not candidates:
        raise FileNotFoundError(f"no checkpoint in {path}: expected checkpoint-<step>/ or final/ "
                                "directories written by a training run")
    for ckpt in candidates:
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        log(f"skipping unusable checkpoint {ckpt}: {problem}")
    raise ValueError(f"every checkpoint in {path} is unusable "
                     f"({', '.join(p.name for p in candidates)}); start a new run")


def find_checkpoint_or_restart(path, log=print) -> Path | None:
    """`find_checkpoint(path)`, or None when `path` is a run directory whose run stopped before
    its first checkpoint (config.json written, no checkpoint): resuming it means starting it
    over in place with its saved settings, which `log` says."""
    path = Path(path)
    if path.is_dir() and not _candidates(path) and (path / "config.json").is_file() \
            and not (path / STATE_FILE).exists():
        log(f"{path} holds no checkpoint (the run stopped before its first one): starting it "
            "over in place with its saved settings")
        return None
    return find_checkpoint(path, log)


def load_checkpoint(path, model, optimizer, states: dict | None = None) -> dict:
    """Load weights, optimizer and RNG states of a checkpoint in place; returns trainer_state.
    A sharded (FSDP) model loads the shards of a sharded checkpoint, with any number of
    processes; the two kinds do not mix. `states`: other learners (name -> object with
    `load_state_dict`) loaded from their files (`load_states`)."""
    path = find_checkpoint(path)
    state = read_trainer_state(path)
    if is_sharded(model) != is_sharded_checkpoint(path):
        kind = "with" if is_sharded_checkpoint(path) else "without"
        raise ValueError(f"{path} was written by a run {kind} --fsdp; resume it the same way")
    if is_sharded(model):
        load_sharded(path, model, optimizer)
    else:
        load_weights_into(model, path)
        opt_tensors = read_safetensors(path / "optimizer.safetensors", device=str(model.device))
        optimizer.load_state_dict(_optimizer_from_flat(opt_tensors, state["optimizer"]))
    load_states(path, state, states or {})
    _restore_rng(read_safetensors(path / "rng.safetensors"))
    return state


def load_weights_into(model, model_dir):
    """Copy a HF-layout checkpoint's tensors into `model` (tied lm_head may be absent)."""
    sd = load_hf_state_dict(model_dir, device=model.device, dtype=model.dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing tensors {missing}, unexpected {unexpected}")


# ----------------------------------------------------------------------------------------------
# Run directories
# ----------------------------------------------------------------------------------------------

def run_dir_of(checkpoint) -> Path:
    """The run directory a checkpoint lives in (wherever the run was moved or copied)."""
    return Path(checkpoint).resolve().parent


def run_contents(run_dir) -> list[str]:
    """Names of the run files and checkpoints already in `run_dir` (empty for a new run)."""
    run_dir = Path(run_dir)
    names = [name for name in RUN_FILES if (run_dir / name).exists()]
    return names + [p.name for p in _candidates(run_dir) if p.name != "final"]


def check_new_run_dir(run_dir) -> None:
    """Raise FileExistsError if `run_dir` already holds a run (nothing is written or removed)."""
    found = run_contents(run_dir)
    if found:
        raise FileExistsError(
            f"{run_dir} already holds a run ({', '.join(found[:4])}); continue it with "
            f"--resume {run_dir} (from its latest checkpoint, or from the start if it has none), "
            "pass --overwrite to replace it, or choose another --output-dir")


def clear_run_dir(run_dir) -> None:
    """Remove a previous run's files and checkpoints from `run_dir` (other files are kept)."""
    run_dir = Path(run_dir)
    for name in run_contents(run_dir):
        target = run_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()


# ----------------------------------------------------------------------------------------------
# Checkpoint policy: when to save, how many to keep
# ----------------------------------------------------------------------------------------------

def _step_of(name: str) -> int:
    """The step in a `checkpoint-<k>` (or `checkpoint-<k>.tmp` / `.old`) directory name."""
    return int(name.split("-")[1].split(".")[0])


def prune_checkpoints(run_dir, keep: int, upto: int) -> list[Path]:
    """Remove all but the latest `keep` checkpoint-<k> of `run_dir` with k <= `upto` (0 keeps
    all), and leftovers of interrupted writes (`.tmp` / `.old` dirs); final/ and checkpoints
    past `upto` (a resumed run will rewrite them) stay. Returns what was removed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    leftover = re.compile(r"checkpoint-\d+\.(tmp|old)")
    names = [p.name for p in run_dir.iterdir() if p.is_dir()]
    done = sorted((n for n in names if _CHECKPOINT_NAME.fullmatch(n) and _step_of(n) <= upto),
                  key=_step_of)
    doomed = (done[:-keep] if keep else []) + [n for n in names if leftover.fullmatch(n)]
    for name in doomed:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return [run_dir / n for n in doomed]


class CheckpointPolicy:
    """When a run saves `checkpoint-<k>` on its own (besides final/ and the checkpoint a stop
    writes), and how many it keeps.

    every_steps: after every N-th update (0: off). every_minutes: once this much wall time has
    passed since the last checkpoint or the start (0: off), checked after each update, so a kill
    loses at most that long plus the step (and evaluation) in progress. keep: checkpoint-<k>
    dirs kept, the latest (0: all; `prune_checkpoints`).
    """

    def __init__(self, every_steps: int = 0, every_minutes: float = 0.0, keep: int = 0,
                 clock=time.monotonic):
        self.every_steps, self.every_minutes, self.keep = every_steps, every_minutes, keep
        self.clock = clock
        self.last_save = clock()

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after update `step`."""
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        by_time = bool(self.every_minutes) and \
            self.clock() - self.last_save >= 60 * self.every_minutes
        return by_steps or by_time

    def saved(self) -> None:
        """Note that a checkpoint was just written (the time interval starts again)."""
        self.last_save = self.clock()
