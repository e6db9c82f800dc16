"""Device and default dtype selection: CUDA, then Apple MPS, then CPU."""

from __future__ import annotations

import argparse

import torch

__all__ = ["get_device", "default_dtype", "check_device", "device_arg"]


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


def check_device(name: str) -> torch.device:
    """`torch.device(name)` if this torch can use it, else ValueError saying what is missing."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r} (use cuda, cuda:N, mps or cpu)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this torch build or machine has no CUDA GPU "
                             f"(torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(f"device {name!r}: Apple MPS is not available here; use --device cpu")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r}: only cuda, mps and cpu are supported")
    return device


def device_arg(text: str) -> str:
    """argparse `type=` for --device: refuses a device this torch cannot use (exit status 2)."""
    try:
        check_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on CUDA (halves memory, tensor cores), float32 elsewhere (CPU bf16 is slow)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
