"""Measured comparisons, one module each, named for what they measure: `grpo_variants`
(chapter 7), `process_vs_outcome` (chapter 8) and `tuning` (its step-size search, the same for
every arm), `inference_scaling` (chapter 5 accuracy vs
tokens), `distill_vs_rl` (chapter 9), and `stats`, their shared statistics and resume helpers.
Drivers beside the core: the core never imports them."""
