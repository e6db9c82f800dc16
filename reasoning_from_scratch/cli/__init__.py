"""Command lines of the training scripts: `train` (chapters 6-7 GRPO runs, flags generated from
GRPOConfig's field metadata) and `distill` (chapter 9). Drivers beside the core: the core never
imports them."""
