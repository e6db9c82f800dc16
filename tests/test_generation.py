"""Tests for KV-cache generation: sampling filters, greedy/batched equivalence, EOS, rollouts."""

import pytest
import torch

from reasoning_from_scratch.device import default_dtype, get_device
from reasoning_from_scratch.generation import (
    Rollouts,
    TextStreamer,
    generate,
    generate_batch,
    sample_next_token,
    sample_response,
    sample_rollouts,
    sample_rollouts_batch,
    top_p_filter,
)
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 "
V = len(CHARS) + 2  # 0 = pad, 1 = eos


class CharTokenizer:
    """Tiny character tokenizer with the interface generation needs."""

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self, eos_token_id=1):
        self.eos_token_id = eos_token_id

    def encode(self, text):
        return [CHARS.index(c) + 2 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        names = {0: "<pad>", 1: "<eos>"}
        out = []
        for i in ids:
            if i in names:
                if not skip_special_tokens:
                    out.append(names[i])
            else:
                out.append(CHARS[i - 2])
        return "".join(out)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen3Model(tiny_config(vocab_size=V)).eval()


def greedy_reference(model, ids, n):
    """Greedy decoding without any cache: re-run the full sequence each step."""
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


# ----------------------------------------------------------------------------- filters


def test_top_p_filter_hand_computed():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    # Sorted: 0.5, 0.3, 0.15, 0.05. Mass before each: 0, 0.5, 0.8, 0.95.
    # top_p=0.7 keeps 0.5 and 0.3 (the token crossing 0.7 stays): renormalised 0.625/0.375.
    out = top_p_filter(probs, 0.7)
    assert torch.allclose(out, torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    # A tiny top_p still keeps the most likely token.
    assert torch.allclose(top_p_filter(probs, 0.01), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_sample_next_token_greedy_top_k_and_seed():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_next_token(logits, temperature=0.0).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next_token(logits, 1.0, top_k=2, generator=g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3}  # top-2 of row 0
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = sample_next_token(logits.repeat(50, 1), 1.0, generator=g1)
    b = sample_next_token(logits.repeat(50, 1), 1.0, generator=g2)
    assert torch.equal(a, b)


def test_sampling_follows_top_p_filter():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(4000, 1)  # 4000 independent draws in one batch
    g = torch.Generator().manual_seed(0)
    draws = sample_next_token(logits, temperature=1.0, top_p=0.7, generator=g)
    assert set(draws.tolist()) == {1, 3}  # the filter of the hand-computed example
    assert abs((draws == 1).float().mean().item() - 0.625) < 0.03


# ----------------------------------------------------------------------------- generate


def test_greedy_matches_uncached_reference_and_is_deterministic(model):
    ids = torch.tensor([[5, 9, 3, 7]])
    out = generate(model, ids, max_new_tokens=6)
    assert torch.equal(out.sequences, greedy_reference(model, ids, 6))
    assert torch.equal(generate(model, ids, max_new_tokens=6).sequences, out.sequences)
    assert out.completion_mask.all() and out.truncated.all() and out.lengths.tolist() == [6]


def test_batched_left_padded_equals_unbatched_greedy(model):
    tok = CharTokenizer(eos_token_id=None)
    prompts = ["hello world", "hi", "abc 123"]
    texts, ids, mask = generate_batch(model, tok, prompts, "cpu", max_new_tokens=5)
    for i, p in enumerate(prompts):
        alone = generate(model, torch.tensor([tok.encode(p)]), max_new_tokens=5)
        assert torch.equal(ids[i], alone.completion_ids[0])
        assert texts[i] == tok.decode(alone.completion_ids[0].tolist())
    assert mask.all()


def test_num_return_sequences_shares_prefill(model):
    ids = torch.tensor([[4, 8, 15, 16], [23, 4, 2, 9]])
    greedy = generate(model, ids, max_new_tokens=4, num_return_sequences=3)
    single = generate(model, ids, max_new_tokens=4)
    assert greedy.sequences.shape == (6, 8)
    # rows b*G .. b*G+G-1 belong to prompt b
    assert torch.equal(greedy.sequences, single.sequences.repeat_interleave(3, dim=0))


def test_sampling_reproducible_with_generator(model):
    ids = torch.tensor([[5, 9, 3]])
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.95, num_return_sequences=4)
    a = generate(model, ids, generator=torch.Generator().manual_seed(1), **kw)
    b = generate(model, ids, generator=torch.Generator().manual_seed(1), **kw)
    c = generate(model, ids, generator=torch.Generator().manual_seed(2), **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)


def test_eos_stops_row_masks_and_pads(model):
    ids = torch.tensor([[5, 9, 3, 7], [12, 2, 30, 6]])
    free = generate(model, ids, max_new_tokens=6).completion_ids  # no EOS
    eos = int(free[0, 2])  # row 0 must stop at its first occurrence of this token
    stop0 = (free[0] == eos).nonzero()[0].item()
    hits1 = (free[1] == eos).nonzero()
    stop1 = hits1[0].item() if len(hits1) else None
    out = generate(model, ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    T = out.completion_ids.shape[1]
    assert T == 6 if stop1 is None else T == max(stop0, stop1) + 1  # stops when all finished
    row0 = out.completion_ids[0]
    assert torch.equal(row0[: stop0 + 1], free[0, : stop0 + 1])  # EOS kept
    assert (row0[stop0 + 1 :] == 0).all()  # padding after EOS
    assert out.completion_mask[0].tolist() == [i <= stop0 for i in range(T)]
    assert out.lengths[0] == stop0 + 1 and not out.truncated[0]
    n1 = T if stop1 is None else stop1 + 1
    assert torch.equal(out.completion_ids[1, :n1], free[1, :n1])
    assert bool(out.truncated[1]) == (stop1 is None)


def test_streaming_callback_sees_every_step(model):
    seen = []
    out = generate(
        model, torch.tensor([[3, 4]]), max_new_tokens=5, callback=lambda t, r: seen.append(t)
    )
    assert torch.equal(torch.stack(seen, 1), out.completion_ids)


def test_text_streamer_prints_text_without_eos(model):
    free = generate(model, torch.tensor([[3, 4]]), max_new_tokens=5).completion_ids[0]
    tok = CharTokenizer(eos_token_id=int(free[2]))
    chunks = []
    out = generate(model, torch.tensor([[3, 4]]), max_new_tokens=5, eos_token_id=tok.eos_token_id,
                   callback=TextStreamer(tok, write=chunks.append))
    n = int(out.lengths[0]) - 1  # real tokens before the EOS
    assert "".join(chunks) == tok.decode(out.completion_ids[0, :n].tolist())


def test_zero_new_tokens(model):
    out = generate(model, torch.tensor([[3, 4]]), max_new_tokens=0)
    assert out.completion_ids.shape == (1, 0) and out.sequences.tolist() == [[3, 4]]


# ----------------------------------------------------------------------------- book wrappers


def test_sample_response_contract(model):
    prompt = "what is 2 plus 3"
    free = CharTokenizer(eos_token_id=None)
    ids_free, _, _ = sample_response(model, free, prompt, "cpu", max_new_tokens=6, temperature=0)
    P = len(free.encode(prompt))
    eos = int(ids_free[P + 3])  # make the 4th (or an earlier equal) generated token the EOS
    tok = CharTokenizer(eos_token_id=eos)
    ids, prompt_len, text = sample_response(
        model, tok, prompt, "cpu", max_new_tokens=6, temperature=0.0
    )
    assert prompt_len == P and ids.dim() == 1
    assert ids[-1] == eos  # EOS kept in the ids
    assert (ids[P:-1] != eos).all()
    assert text == tok.decode(ids[P:-1].tolist())  # ... but not in the text


def test_sample_rollouts_contract(model):
    tok = CharTokenizer(eos_token_id=None)
    g = torch.Generator().manual_seed(0)
    r = sample_rollouts(model, tok, "abc", 4, "cpu", max_new_tokens=5, temperature=1.0,
                        top_p=1.0, generator=g)
    assert isinstance(r, Rollouts) and len(r) == 4 and r.prompt_len == 3
    assert r.completion_ids.shape == (4, 5) and r.completion_mask.all()
    assert r.truncated.all() and r.lengths.tolist() == [5] * 4
    assert r.texts[2] == tok.decode(r.completion_ids[2].tolist())
    assert torch.equal(r.full_ids(1), torch.cat([r.prompt_ids, r.completion_ids[1]]))


def test_sample_rollouts_batch_equals_one_prompt_at_a_time(model):
    """Several prompts in one left-padded batch give each prompt's own greedy rollouts."""
    tok = CharTokenizer(eos_token_id=5)
    prompts = ["abc", "hello there", "x"]
    batch = sample_rollouts_batch(model, tok, prompts, 2, "cpu", max_new_tokens=6, temperature=0)
    for prompt, got in zip(prompts, batch):
        alone = sample_rollouts(model, tok, prompt, 2, "cpu", max_new_tokens=6, temperature=0)
        assert got.texts == alone.texts
        assert torch.equal(got.prompt_ids, alone.prompt_ids)
        assert torch.equal(got.lengths, alone.lengths)
        T = int(alone.lengths.max())
        assert torch.equal(got.completion_ids[:, :T], alone.completion_ids[:, :T])


def test_device_helpers():
    assert get_device("cpu") == torch.device("cpu")
    assert get_device().type in {"cuda", "mps", "cpu"}
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda") == torch.bfloat16
