"""Test helper: `generation.Rollouts` built from written completions instead of sampled ones."""

import torch

from reasoning_from_scratch.generation import Rollouts


def rollouts_from_texts(tokenizer, prompt, texts, truncated=()):
    """Rollouts as sample_rollouts builds them: generated ids (+ EOS unless the index is in
    `truncated`), right padded, with `prompt`'s ids."""
    rows = []
    for i, t in enumerate(texts):
        ids = tokenizer.encode(t)
        rows.append(ids if i in truncated else ids + [tokenizer.eos_token_id])
    T = max(len(r) for r in rows)
    comp = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        comp[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    prompt_ids = torch.tensor(tokenizer.encode(prompt))
    return Rollouts(prompt_ids, comp, mask, list(texts), mask.sum(1),
                    torch.tensor([i in truncated for i in range(len(rows))]))
