"""The compiled decode step (`generate(compile=True)`): eager's tokens, one graph per shape
bucket, no graph break, no recompilation within a bucket, eager fallback when compiling fails.

Each compile costs seconds on a CPU, so the tests are few and reuse the graphs they make.
"""

import warnings
import weakref

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from reasoning_from_scratch import compiled_update, generation
from reasoning_from_scratch.generation import generate
from reasoning_from_scratch.qwen3 import KVCache, Qwen3Model, StaticKVCache, tiny_config

V = 24
EOS = [1, 2, 3]  # three stop ids out of 24: most rows stop early, some run to the budget

pytestmark = pytest.mark.skipif(
    not (callable(getattr(torch, "compile", None)) and torch._dynamo.is_dynamo_supported()),
    reason="torch.compile is not supported on this Python/platform")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen3Model(tiny_config(vocab_size=V)).eval()


def prompts(P: int):
    """Two prompts of length P, the second left padded by 2."""
    ids = torch.arange(2 * P).reshape(2, P) % (V - 4) + 4
    mask = torch.ones(2, P, dtype=torch.bool)
    mask[1, :2] = False
    return ids, mask


def both(model, ids, mask, **kw):
    """Eager and compiled outputs, each from its own copy of the same generators, and whether
    the generators ended in the same state."""
    outs, states = [], []
    for compile in (False, True):
        gens = [torch.Generator().manual_seed(10 + b) for b in range(ids.shape[0])]
        outs.append(generate(model, ids, mask, eos_token_id=EOS, generator=gens,
                             compile=compile, **kw))
        states.append([g.get_state() for g in gens])
    same_rng = all(torch.equal(a, b) for a, b in zip(*states))
    return outs[0], outs[1], same_rng


def assert_same(eager, fast):
    assert torch.equal(fast.sequences, eager.sequences)
    assert torch.equal(fast.completion_mask, eager.completion_mask)
    assert torch.equal(fast.truncated, eager.truncated)
    if eager.logprobs is not None:
        torch.testing.assert_close(fast.logprobs, eager.logprobs, atol=1e-5, rtol=0)


def test_static_cache_step_equals_the_eager_step(model):
    """Uncompiled: the static step over a padded, bucketed cache gives the eager logits."""
    ids, mask = prompts(5)
    cache = KVCache(model.cfg.num_hidden_layers)
    with torch.no_grad():
        model(ids, mask, cache)
        static = StaticKVCache.from_cache(cache, rows=4, slots=16, start=3)  # 2 empty rows
        token, real = torch.tensor([7, 9]), torch.tensor([True, False])
        eager = model(token[:, None], real[:, None], cache, last_only=True)[:, -1]
        fast = model.decode_static(torch.tensor([7, 9, 0, 0]),
                                   torch.tensor([True, False, False, False]), static)
    torch.testing.assert_close(fast[:2], eager, atol=1e-5, rtol=0)
    assert static.pos.tolist() == [3 + 5 + 1] and static.next_pos.tolist() == [6, 3, 0, 0]
    assert torch.isfinite(fast).all()  # empty rows attend to zeros, not to NaN


def test_compiled_tokens_equal_eager_and_one_graph_serves_a_bucket(model):
    counters.clear()
    # greedy, batched with left padding
    eager, fast, _ = both(model, *prompts(5), max_new_tokens=20)
    assert model not in generation._COMPILE_FAILURES, generation._COMPILE_FAILURES.get(model)
    assert_same(eager, fast)
    # sampled (fp32): the same uniforms give the same tokens; G = 3 rows per prompt (6 rows,
    # padded to 8), top-k and top-p inside the step, early EOS: the generators are rewound to
    # where the eager loop stopped drawing
    kw = dict(max_new_tokens=40, temperature=0.9, top_p=0.8, top_k=12, num_return_sequences=3,
              return_logprobs=True)
    eager, fast, same_rng = both(model, *prompts(5), **kw)
    assert_same(eager, fast)
    assert same_rng
    assert fast.completion_ids.shape[1] < 40 and fast.lengths.min() < fast.lengths.max()
    assert not counters["graph_break"]  # fullgraph: a break would have failed the compile
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2  # one per sampling setting
    # Other prompt lengths in the same bucket (<= 16): no new graph, no recompilation.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for P in (3, 9, 16):
            eager, fast, same_rng = both(model, *prompts(P), **kw)
            assert_same(eager, fast)
            assert same_rng
    assert counters["stats"]["unique_graphs"] == graphs
    # one set of buffers per shape, reused by every call of that shape (CUDA graphs keep
    # their input addresses)
    assert len(generation._BUFFERS[model].shapes) == 2


def test_compile_failure_falls_back_to_eager_with_one_warning(model, monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(generation, "_COMPILED", {})
    monkeypatch.setattr(generation, "_COMPILE_FAILURES", weakref.WeakKeyDictionary())
    ids, mask = prompts(5)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler here.*decoding eagerly"):
        out = generate(model, ids, mask, max_new_tokens=6, compile=True)
    assert torch.equal(out.sequences, generate(model, ids, mask, max_new_tokens=6).sequences)
    assert "no C++ compiler" in generation._COMPILE_FAILURES[model]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second attempt, no second warning
        again = generate(model, ids, mask, max_new_tokens=6, compile=True)
    assert torch.equal(again.sequences, out.sequences)


def test_a_compiled_training_run_makes_no_graph_after_its_warm_up(tiny_dir, tmp_path):
    """Prompts of different length buckets, rollouts, evaluations and the update compiled: the
    first-use check and the warm-ups (`systems._warm_up_decoding`, `_warm_up_update`) make
    every graph before the first step, none is made by the steps, the evaluations or the final
    evaluation, and the check found the compiled paths equal to eager."""
    from reasoning_from_scratch.prompts import render_prompt
    from reasoning_from_scratch.training import GRPOConfig, train_grpo
    from reasoning_from_scratch.weights import load_pretrained

    model, tok = load_pretrained(tiny_dir, device="cpu")
    long = "+".join(str(i) for i in range(1, 40))  # a prompt in a longer bucket
    train = [{"problem": p, "answer": "0"} for p in ("2+3", long, "4+5", "6+7")]
    lengths = [len(tok.encode(render_prompt(ex["problem"]))) for ex in train]
    assert len({generation._bucket(n, 16) for n in lengths}) == 2, lengths
    held_out = [{"problem": "3+4", "answer": "7"}, {"problem": "5+6", "answer": "11"}]
    config = GRPOConfig(steps=4, prompts_per_step=2, num_rollouts=2, max_new_tokens=6,
                        eval_every=2, eval_examples=2, eval_batch_size=1, sample_every=0,
                        seed=1, output_dir=str(tmp_path / "run"), progress=False, compile=True,
                        compile_update=True)
    graphs = {}

    def hook(phase, step):
        if phase == "rollouts":
            graphs[step] = counters["stats"]["unique_graphs"]

    summary = train_grpo(model, tok, train, held_out, "cpu", config, phase_hook=hook)
    assert model not in generation._COMPILE_FAILURES, generation._COMPILE_FAILURES.get(model)
    assert model not in compiled_update._BLOCK_COMPILE_FAILURES
    assert len(graphs) == 4 and len(set(graphs.values())) == 1, graphs
    assert counters["stats"]["unique_graphs"] == graphs[1]  # the last evaluation too
    check = summary["compile_check"]
    assert check["ok"] and check["decoding"]["tokens_equal"] and "max_logprob_diff" in check[
        "update"]
