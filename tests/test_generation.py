"""Tests for KV-cache generation: sampling filters, greedy/batched equivalence, EOS, rollouts,
the preallocated cache (the compiled decode step: tests/test_compiled_decode.py)."""


import pytest
import torch
import torch._dynamo

from reasoning_from_scratch import generation
from reasoning_from_scratch.device import default_dtype, get_device
from reasoning_from_scratch.generation import (
    Rollouts,
    TextStreamer,
    branch_continuations,
    chat_turn,
    gather_cache_rows,
    generate,
    generate_batch,
    new_chat,
    prefill_rows,
    sample_next_token,
    sample_response,
    sample_rollouts,
    sample_rollouts_batch,
    top_p_filter,
)
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.qwen3 import KVCache, Qwen3Model, tiny_config
from reasoning_from_scratch.weights import load_pretrained

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


# ----------------------------------------------------------------------------- speed knobs

PADDED_IDS = torch.tensor([[5, 9, 3, 7, 11], [0, 0, 12, 2, 30]])
PADDED_MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])


@pytest.mark.parametrize("kw", [
    dict(),  # greedy, batched with left padding
    dict(num_return_sequences=3),  # expand after the prefill
    dict(num_return_sequences=2, temperature=1.0, top_p=0.9, return_logprobs=True),
])
def test_preallocated_cache_gives_the_tokens_of_the_cat_cache(model, kw):
    outs = [generate(model, PADDED_IDS, PADDED_MASK, max_new_tokens=12, preallocate=pre,
                     generator=torch.Generator().manual_seed(3), **kw) for pre in (True, False)]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].completion_mask, outs[1].completion_mask)
    if kw.get("return_logprobs"):
        assert torch.equal(outs[0].logprobs, outs[1].logprobs)


def test_generate_allocates_the_cache_once(model):
    """Every decoding step writes into the same buffer: no re-allocation per step."""
    cache = KVCache(model.cfg.num_hidden_layers, max_len=0)
    ptrs = []
    generate(model, PADDED_IDS, PADDED_MASK, max_new_tokens=9, num_return_sequences=2,
             cache=cache, callback=lambda t, r: ptrs.append(cache.values[1].data_ptr()))
    assert len(ptrs) == 9 and len(set(ptrs)) == 1
    assert cache.max_len == 5 + 9 and cache.seq_len == 5 + 8  # the last token is not fed back
    assert cache.batch_size == 4


@pytest.fixture(scope="module")
def bundled():
    """The bundled tiny-arith model (float32, CPU) and its tokenizer (with chat tokens)."""
    return load_pretrained("tiny-arith", device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("enable_thinking", [True, False])  # False: the cache is cut each turn
def test_chat_with_preallocated_cache_equals_cat_cache(bundled, enable_thinking):
    model, tok = bundled
    pre = new_chat(model, system="You are a calculator.")
    cat = new_chat(model, system="You are a calculator.")
    cat.cache = KVCache(model.cfg.num_hidden_layers)  # grows by torch.cat
    assert pre.cache.preallocated and not cat.cache.preallocated
    for user in ["What is 17+25?", "What is 3+4?", "And 12*3?"]:
        room = pre.cache.max_len
        replies = [chat_turn(model, tok, state, user, max_new_tokens=12,
                             enable_thinking=enable_thinking) for state in (pre, cat)]
        assert replies[0] == replies[1] and pre.ids == cat.ids
        # Each turn needed more room than the cache had: it grew once, up front.
        assert pre.cache.max_len > room and pre.cache.max_len >= pre.cache.seq_len
        assert pre.cache.seq_len == cat.cache.seq_len == len(pre.ids)
        for i in range(model.cfg.num_hidden_layers):
            assert torch.equal(pre.cache.keys[i], cat.cache.keys[i])


def test_device_helpers():
    assert get_device("cpu") == torch.device("cpu")
    assert get_device().type in {"cuda", "mps", "cpu"}
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda") == torch.bfloat16


# ----------------------------------------------------------------------------- branching


def test_gathered_prefix_cache_gives_the_logits_of_a_fresh_prefill(model):
    torch.manual_seed(1)
    seqs = [torch.randint(2, V, (n,)).tolist() for n in (9, 6, 11)]
    cache = prefill_rows(model, seqs)  # right padded to 11 slots
    rows, lengths = [0, 2, 1, 2, 0], [4, 11, 6, 1, 9]
    branch = gather_cache_rows(cache, rows, lengths)  # left padded to 11 slots
    assert branch.key_mask.sum(1).tolist() == lengths and branch.next_pos.tolist() == lengths
    nxt = torch.tensor([[3], [4], [5], [6], [7]])  # one more token per row
    with torch.no_grad():
        got = model(nxt, None, branch)[:, -1]  # (5, V)
        for r, (b, n) in enumerate(zip(rows, lengths)):
            want = model(torch.tensor([seqs[b][:n] + [3 + r]]))[:, -1]
            torch.testing.assert_close(got[r : r + 1], want, rtol=1e-4, atol=1e-5)


def test_branch_continuations_equal_generation_from_the_prefix(bundled):
    model, tok = bundled
    stop = generation.stop_token_ids(tok)
    prompt = tok.encode(render_prompt("Compute ((17+25)*3)-8"))
    full = generate(model, torch.tensor([prompt]), max_new_tokens=50, temperature=0.0,
                    eos_token_id=stop).sequences[0].tolist()
    seqs = [full, prompt + tok.encode(" <think>")]
    cuts = [(0, len(prompt) + 3), (1, len(seqs[1])), (0, len(prompt) + 12), (0, len(prompt) + 3)]
    budgets = [40, 40, 6, 40]
    out = branch_continuations(model, seqs, cuts, budgets, temperature=0.0, eos_token_id=stop,
                               batch_size=3)
    for (i, n), ids, budget, cut in zip(cuts, out.ids, budgets, out.truncated):
        ref = generate(model, torch.tensor([seqs[i][:n]]), max_new_tokens=budget,
                       temperature=0.0, eos_token_id=stop)
        assert ids == ref.completion_ids[0][ref.completion_mask[0]].tolist()
        assert cut == bool(ref.truncated[0])
    assert out.truncated[2] and len(out.ids[2]) == 6  # its budget ran out first
    # Each sequence is prefilled once up to its longest cut (minus the token fed per branch).
    assert out.prefill_tokens == (len(prompt) + 11) + (len(seqs[1]) - 1) + len(cuts)
    with pytest.raises(ValueError, match="outside"):
        branch_continuations(model, seqs, [(0, len(full) + 1)], 4)
