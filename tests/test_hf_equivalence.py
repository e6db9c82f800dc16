"""Optional: our Qwen3 against Hugging Face transformers' Qwen3ForCausalLM on the same weights.

Skipped when transformers is not installed (it is not a dependency of the package).
"""

import pytest
import torch
from tolerance import assert_rounded_alike, forward_terms

transformers = pytest.importorskip("transformers")

from reasoning_from_scratch.generation import generate  # noqa: E402
from reasoning_from_scratch.qwen3 import KVCache, Qwen3Config, Qwen3Model, tiny_config  # noqa: E402

V = 64


def make_pair(tie=True):
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=V, tie_word_embeddings=tie, rope_theta=1_000_000.0)
    hf_cfg = transformers.Qwen3Config(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norm weights so QK-norm and RMSNorm really matter
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = Qwen3Model(Qwen3Config.from_hf_dict(hf_cfg.to_dict())).eval()
    sd = hf.state_dict()
    assert sorted(sd) == sorted(ours.state_dict())
    ours.load_state_dict(sd)
    return ours, hf


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_hf_uncached_and_cached(tie):
    ours, hf = make_pair(tie)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        full = ours(ids)
        cache = KVCache(ours.cfg.num_hidden_layers)
        chunks = [ours(ids[:, :7], cache=cache)]
        chunks += [ours(ids[:, t : t + 1], cache=cache) for t in range(7, 12)]
    terms = forward_terms(ours.cfg, 12)  # two implementations: summed in other orders
    assert_rounded_alike(full, ref, terms)
    assert_rounded_alike(torch.cat(chunks, dim=1), ref, terms)


def test_left_padded_logits_match_hf():
    ours, hf = make_pair()
    ids = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    ids[1, :4], mask[1, :4] = 0, 0
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=position_ids).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert_rounded_alike(got[real], ref[real], forward_terms(ours.cfg, 9))


def test_greedy_generation_matches_hf():
    ours, hf = make_pair()
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert torch.equal(generate(ours, ids, max_new_tokens=10).sequences, ref)
