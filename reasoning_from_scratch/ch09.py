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
from .downloads import download_qwen3_distill_checkpoints
from .experiments.distill_vs_rl import run_distill_vs_rl
from .sft import collate, completion_loss, train_sft
