"""The book's download helpers: a file from a URL with a backup URL, the book's Qwen3-0.6B
files (its ``.pth`` weights and ``tokenizer-*.json``), its GRPO and distillation checkpoints,
and files of its GitHub repository (rasbt/reasoning-from-scratch).

Same signatures and file names as the book's ``utils.download_file``,
``qwen3.download_qwen3_small`` / ``download_qwen3_grpo_checkpoints`` /
``download_qwen3_distill_checkpoints`` and ``ch07.download_from_github``; the bytes are fetched
with ``datasets.fetch_url`` (urllib, written atomically, so an interrupted download leaves no
half file). A file that is already there is used as it is, without asking the network.
The URLs are the book's (its repository, chapter 2 and appendix D).
"""

from __future__ import annotations

import urllib.error
from pathlib import Path
from urllib.parse import urlparse

from .datasets import fetch_url

__all__ = [
    "download_file",
    "download_qwen3_small",
    "download_qwen3_grpo_checkpoints",
    "download_qwen3_distill_checkpoints",
    "download_from_github",
]

QWEN3_SMALL_REPO = "https://huggingface.co/rasbt/qwen3-from-scratch/resolve/main"
QWEN3_SMALL_BACKUP = "https://f001.backblazeb2.com/file/reasoning-from-scratch/qwen3-0.6B"
QWEN3_SMALL_FILES = {
    "base": {"model": "qwen3-0.6B-base.pth", "tokenizer": "tokenizer-base.json"},
    "reasoning": {"model": "qwen3-0.6B-reasoning.pth", "tokenizer": "tokenizer-reasoning.json"},
}
GRPO_CHECKPOINTS_REPO = (
    "https://huggingface.co/rasbt/qwen3-from-scratch-grpo-checkpoints/resolve/main")
GRPO_CHECKPOINTS_BACKUP = (
    "https://f001.backblazeb2.com/file/reasoning-from-scratch/qwen3-0.6B-checkpoints")
# The book's chapter 6-7 GRPO runs: grpo_type -> folder of the checkpoint repository.
GRPO_CHECKPOINT_FOLDERS = {
    "no_kl": "grpo_original_no_kl",
    "tracking": "7_3_plus_tracking/checkpoints",
    "clip_ratio": "7_4_plus_clip_ratio/checkpoints",
    "kl": "7_5_plus_kl/checkpoints",
    "format_reward": "7_6_plus_format_reward/checkpoints",
}
DISTILL_CHECKPOINTS_REPO = (
    "https://huggingface.co/rasbt/qwen3-from-scratch-distill-checkpoints/resolve/main")
# The book's chapter 8 distillation runs: teacher -> (folder, {step: file name}).
DISTILL_CHECKPOINTS = {
    "deepseek_r1": ("ch08_distill_deepseek_r1/checkpoints", {
        "06682": "qwen3-0.6B-distill-step06682-epoch1.pth",
        "13364": "qwen3-0.6B-distill-step13364-epoch2.pth",
        "20046": "qwen3-0.6B-distill-step20046-epoch3.pth",
    }),
    "qwen3_235b_a22b": ("ch08_distill_qwen3_235b_a22b/checkpoints", {
        "05746": "qwen3-0.6B-distill-step05746-epoch1.pth",
        "11492": "qwen3-0.6B-distill-step11492-epoch2.pth",
        "17238": "qwen3-0.6B-distill-step17238-epoch3.pth",
    }),
}
GITHUB_RAW = "https://raw.githubusercontent.com/rasbt/reasoning-from-scratch/refs/heads/main/"


def download_file(url: str, out_dir=".", backup_url: str | None = None) -> Path:
    """Download `url` into `out_dir` (file name from the URL), trying `backup_url` if it fails.

    Returns the file's path. A file already there is returned without a download.
    RuntimeError naming both URLs, their errors and the manual fix when neither works.
    """
    dest = Path(out_dir) / Path(urlparse(url).path).name
    if dest.is_file() and dest.stat().st_size > 0:
        return dest
    errors = []
    for u in [url] + ([backup_url] if backup_url else []):
        try:
            return fetch_url(u, dest)
        except (urllib.error.URLError, OSError, ValueError) as err:
            label = "Primary URL failed" if u == url else "Backup URL failed"
            errors.append(f"  {label}: {u}: {err}")
    raise RuntimeError(
        f"could not download {dest.name}:\n" + "\n".join(errors) + "\n"
        f"Download it by hand (e.g. curl -L -o {dest} {url}) and run again; the file is then "
        "used as it is."
    )


def download_qwen3_small(kind: str = "base", tokenizer_only: bool = False, out_dir=".") -> None:
    """The book's Qwen3-0.6B files: `kind` 'base' or 'reasoning'; weights (.pth) and tokenizer."""
    if kind not in QWEN3_SMALL_FILES:
        raise ValueError(f"kind must be 'base' or 'reasoning', got {kind!r}")
    for part in ["tokenizer"] if tokenizer_only else ["model", "tokenizer"]:
        name = QWEN3_SMALL_FILES[kind][part]
        download_file(f"{QWEN3_SMALL_REPO}/{name}", out_dir=out_dir,
                      backup_url=f"{QWEN3_SMALL_BACKUP}/{name}")


def _step_string(step) -> str:
    """'50' or 50 -> '00050' (the book's five-digit step numbers); other strings unchanged."""
    step = str(step)
    return step.zfill(5) if step.isdigit() else step


def download_qwen3_grpo_checkpoints(grpo_type: str = "no_kl", step="00050", out_dir=".") -> Path:
    """One of the book's chapter 6-7 GRPO checkpoints (.pth, the book's parameter names)."""
    if grpo_type not in GRPO_CHECKPOINT_FOLDERS:
        raise ValueError(f"grpo_type must be one of {list(GRPO_CHECKPOINT_FOLDERS)}, "
                         f"got {grpo_type!r}")
    step = _step_string(step)
    name = f"qwen3-0.6B-rlvr-grpo-step{step}.pth"
    folder = GRPO_CHECKPOINT_FOLDERS[grpo_type]
    backup = None
    if grpo_type == "no_kl" and step == "00050":  # the one checkpoint with a mirror
        backup = f"{GRPO_CHECKPOINTS_BACKUP}/{folder}/{name}"
    return download_file(f"{GRPO_CHECKPOINTS_REPO}/{folder}/{name}", out_dir=out_dir,
                         backup_url=backup)


def download_qwen3_distill_checkpoints(distill_type: str = "deepseek_r1", step="06682",
                                       out_dir=".") -> Path:
    """One of the book's chapter 8 distillation checkpoints (.pth, the book's names)."""
    if distill_type not in DISTILL_CHECKPOINTS:
        raise ValueError(f"distill_type must be one of {list(DISTILL_CHECKPOINTS)}, "
                         f"got {distill_type!r}")
    folder, files = DISTILL_CHECKPOINTS[distill_type]
    step = _step_string(step)
    if step not in files:
        raise ValueError(f"step must be one of {list(files)} for {distill_type}, got {step!r}")
    return download_file(f"{DISTILL_CHECKPOINTS_REPO}/{folder}/{files[step]}", out_dir=out_dir)


def download_from_github(rel_path, out=None) -> Path:
    """A file of the book's repository by its path there (e.g. 'ch07/README.md').

    Saved as `out` (default: the file's name in the current directory); a file already there
    is used as it is.
    """
    rel_path = Path(rel_path)
    out = Path(out) if out is not None else Path(rel_path.name)
    if not out.is_file():
        fetch_url(GITHUB_RAW + rel_path.as_posix(), out)
    print(f"{out}: {out.stat().st_size / 1e3:.1f} KB")
    return out
