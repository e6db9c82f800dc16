"""Device and default dtype selection: CUDA, then Apple MPS, then CPU."""

from __future__ import annotations

import torch

__all__ = ["get_device", "default_dtype"]


def get_device(prefer: str | None = None) -> torch.device:
    """The best available device (cuda > mps > cpu), or `prefer` if given (e.g. "cpu")."""
    if prefer is not None:
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on CUDA (halves memory, tensor cores), float32 elsewhere (CPU bf16 is slow)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
