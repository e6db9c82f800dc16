"""Resumable training checkpoints and run directories (safetensors + JSON, never pickles).

A checkpoint directory `checkpoint-<k>/` holds the state after exactly k optimizer updates:
the model in Hugging Face layout (so `load_pretrained` loads it), the AdamW state flattened into
optimizer.safetensors with its structure in trainer_state.json, and the RNG states as uint8
tensors in rng.safetensors. It is written to a temporary directory and renamed into place, so a
crash leaves the previous checkpoint or the new one, never half of one.

A run directory holds a run's checkpoints next to its logs; `find_checkpoint` picks the latest
*intact* one (a truncated file or NaN weights make a checkpoint unusable, and resuming falls back
to the one before, saying so), and `check_new_run_dir` keeps a new run from overwriting an old.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from .files import atomic_save_safetensors, atomic_write_json, read_json
from .weights import load_hf_state_dict, non_finite_tensors, read_safetensors, save_pretrained

STATE_FILE = "trainer_state.json"
_CHECKPOINT_NAME = re.compile(r"checkpoint-\d+")  # not checkpoint-3.tmp / .old leftovers
# What a run writes into its directory; a new run refuses a directory holding any of these.
RUN_FILES = ("config.json", "metrics.csv", "samples.jsonl", "summary.json", "metrics.png",
             "final", "reference", "tensorboard", "wandb")


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
# Save, verify, find, load
# ----------------------------------------------------------------------------------------------

def save_checkpoint(out_dir, model, tokenizer, optimizer, step, config, extra=None) -> Path:
    """Write a resumable checkpoint directory atomically (temp dir, then rename).

    `step` is the number of optimizer updates the weights contain; `config` a dataclass or dict
    saved in trainer_state.json with `extra`.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tokenizer, tmp)  # HF layout: load_pretrained(out_dir) works
    tensors, structure = _optimizer_to_flat(optimizer)
    atomic_save_safetensors(tensors, tmp / "optimizer.safetensors")
    atomic_save_safetensors(_rng_tensors(), tmp / "rng.safetensors")
    atomic_write_json(tmp / STATE_FILE, {
        "step": step, "config": asdict(config) if is_dataclass(config) else dict(config),
        "optimizer": structure, **(extra or {}),
    })
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
    try:
        read_trainer_state(path)
        weights = load_hf_state_dict(path)
        read_safetensors(path / "optimizer.safetensors")
        read_safetensors(path / "rng.safetensors")
    except (OSError, ValueError, KeyError) as err:
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


def load_checkpoint(path, model, optimizer) -> dict:
    """Load weights, optimizer and RNG states of a checkpoint in place; returns trainer_state."""
    path = find_checkpoint(path)
    state = read_trainer_state(path)
    load_weights_into(model, path)
    opt_tensors = read_safetensors(path / "optimizer.safetensors", device=str(model.device))
    optimizer.load_state_dict(_optimizer_from_flat(opt_tensors, state["optimizer"]))
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
            f"--resume {run_dir}, pass --overwrite to replace it, or choose another --output-dir")


def clear_run_dir(run_dir) -> None:
    """Remove a previous run's files and checkpoints from `run_dir` (other files are kept)."""
    run_dir = Path(run_dir)
    for name in run_contents(run_dir):
        target = run_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
