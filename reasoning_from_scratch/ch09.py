"""Chapter 9 index: distillation (teacher traces, rejection sampling, SFT; imports only). The
book's chapter 8 is distillation: its checkpoints download here (docs/book_compatibility.md)."""

from .distillation import (
    filter_traces,
    generate_distillation_data,
    read_traces,
    traces_to_documents,
    verify_trace,
    write_traces,
)
from .distillation_training import DistillConfig, split_traces, train_distillation
from .experiments.distill_vs_rl import run_distill_vs_rl
from .qwen3 import download_qwen3_distill_checkpoints
from .sft import collate, completion_loss, soft_distillation_loss, train_sft

__all__ = [
    "filter_traces",
    "generate_distillation_data",
    "read_traces",
    "traces_to_documents",
    "verify_trace",
    "write_traces",
    "DistillConfig",
    "split_traces",
    "train_distillation",
    "download_qwen3_distill_checkpoints",
    "run_distill_vs_rl",
    "collate",
    "completion_loss",
    "soft_distillation_loss",
    "train_sft",
]
