"""reasoning_from_scratch: reasoning LLMs trained with reinforcement learning, built by hand in PyTorch."""
