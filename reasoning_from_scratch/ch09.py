"""Chapter 9 index: distillation (teacher traces, rejection sampling, SFT; imports only)."""

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
from .sft import collate, completion_loss, train_sft
