"""Command lines of the scripts: `train` (chapters 6-7 GRPO runs, flags generated from
GRPOConfig's field metadata), `distill` (chapter 9) and `arguments` (the flags every chapter
script and benchmark shares: model, evaluation set, sampling, seed, device, threads). Drivers
beside the core: the core never imports them."""
