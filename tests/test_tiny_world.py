"""Tests for the tiny world: BPE tokenizer, corpus, pretraining (`sft.train_sft`), bundled model."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reasoning_from_scratch.arithmetic import STYLES, make_split, parse_steps, verify_steps
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.sft import (
    batch_logits,
    collate,
    lr_at,
    shared_prefix_len,
    tokenize_documents,
    train_sft,
)
from reasoning_from_scratch.tiny_world import (
    SPECIAL_TOKENS,
    build_corpus,
    document_text,
    style_distribution,
    train_bpe_tokenizer,
)

BUNDLE = Path(__file__).resolve().parents[1] / "reasoning_from_scratch" / "assets" / "tiny-arith"
BUNDLE_PARAMETERS = 834_816  # documented next to tiny_world.TINY_ARITH_ARCH


@pytest.fixture(scope="module")
def docs():
    return build_corpus(300, seed=0)


@pytest.fixture(scope="module")
def tokenizer(docs, tmp_path_factory):
    return train_bpe_tokenizer(
        [document_text(d) for d in docs], vocab_size=320, out_dir=tmp_path_factory.mktemp("tok")
    )


def test_tokenizer_digits_and_special_tokens(tokenizer):
    ids = tokenizer.encode("Step 1: 128+7=135")
    digits = [tokenizer.decode([i]) for i in ids if tokenizer.decode([i]).strip().isdigit()]
    assert digits == list("1128713" + "5")  # every digit is its own token
    for tok in SPECIAL_TOKENS:
        assert len(tokenizer.encode(tok)) == 1
    assert tokenizer.encode("<think>") == [tokenizer.think_token_id]
    assert tokenizer.encode("</think>") == [tokenizer.end_think_token_id]
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|endoftext|>")
    text = render_prompt("Compute (3+4)*2") + " <think>\nStep 1: 3+4=7\n</think>\n\\boxed{7}"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_is_deterministic(docs, tokenizer, tmp_path):
    again = train_bpe_tokenizer([document_text(d) for d in docs], vocab_size=320, out_dir=tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == tokenizer.path.read_text()
    assert again.vocab_size == tokenizer.vocab_size


def test_corpus_mix(docs):
    assert docs == build_corpus(300, seed=0)
    assert all(d["prompt"] == render_prompt(d["problem"]) for d in docs)
    assert {d["style"] for d in docs} == set(STYLES)
    dominant = {}
    for problem in ("Compute 3+4", "Compute (3+4)*5", "Compute ((3+4)*5)-6",
                    "Compute (((3+4)*5)-6)+7", "Compute ((((3+4)*5)-6)+7)-8"):
        probs = style_distribution({"problem": problem})
        assert math.isclose(sum(probs.values()), 1.0)
        assert probs["think"] > 0.2  # every problem samples the think format fairly often
        dominant[problem.count("(") + 1] = max(probs, key=probs.get)
    assert dominant == {1: "direct_answer", 2: "think", 3: "steps_answer", 4: "think",
                        5: "steps_answer"}


def test_corpus_has_flawed_solutions_more_often_at_higher_levels():
    docs = build_corpus(1500, seed=1)
    rate = {lv: sum(bool(d["slips"]) for d in docs if d["level"] == lv)
            / sum(d["level"] == lv for d in docs) for lv in (1, 5)}
    assert rate[1] < 0.15 < 0.5 < rate[5]
    for d in docs:
        steps = parse_steps(d["completion"])
        if steps:  # a flawed document's first slipped step is exactly where the verifier objects
            verdicts = verify_steps(d["problem"], steps)
            assert (not all(verdicts)) == bool(d["slips"])
            if d["slips"]:
                assert verdicts.index(False) == d["slips"][0]
    clean = build_corpus(200, seed=1, slip_prob=None, operand_slip_prob=0.0)
    assert not any(d["slips"] for d in clean)
    assert all(all(verify_steps(d["problem"], parse_steps(d["completion"]))) for d in clean)


def test_collate_scores_only_completion_tokens():
    pairs = [([5, 6, 7], [8, 9]), ([5, 6], [4])]
    inputs, targets = collate(pairs, pad_id=0)
    assert inputs.tolist() == [[5, 6, 7, 8], [5, 6, 0, 0]]
    assert targets.tolist() == [[-100, -100, 8, 9], [-100, 4, -100, -100]]
    assert shared_prefix_len(pairs) == 1  # one token short of the shortest prompt
    inputs, targets = collate(pairs, pad_id=0, prefix_len=1)
    assert inputs.tolist() == [[6, 7, 8], [6, 0, 0]]
    assert targets.tolist() == [[-100, 8, 9], [4, -100, -100]]


def _tiny_model(vocab_size):
    torch.manual_seed(0)
    return Qwen3Model(tiny_config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, head_dim=8))


def test_shared_prefix_equals_full_sequences(docs, tokenizer):
    pairs = tokenize_documents(docs[:8], tokenizer)
    P = shared_prefix_len(pairs)
    assert P > 20  # the fixed instructions of the prompt
    model = _tiny_model(tokenizer.vocab_size)
    losses, grads = [], []
    for prefix_len in (0, P):
        inputs, targets = collate(pairs, 0, prefix_len)
        logits = batch_logits(model, torch.tensor(pairs[0][0][:prefix_len]), inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        grads.append(model.model.embed_tokens.weight.grad.clone())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_lr_schedule():
    assert lr_at(0, 100, 1.0, warmup=10) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, warmup=10) == pytest.approx(1.0)
    assert lr_at(10, 100, 1.0, warmup=10) == pytest.approx(1.0)
    assert lr_at(55, 100, 1.0, warmup=10) == pytest.approx(0.55)  # cosine midpoint
    assert lr_at(100, 100, 1.0, warmup=10) == pytest.approx(0.1)


def test_train_sft_lowers_the_loss(docs, tokenizer):
    model = _tiny_model(tokenizer.vocab_size)
    pairs = tokenize_documents(docs[:16], tokenizer)
    inputs, targets = collate(pairs, 0)

    def loss():
        with torch.no_grad():
            logits = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).item()

    before = loss()
    losses = train_sft(model, tokenizer, docs[:16], steps=3, batch_size=16, lr=1e-2, warmup=1,
                       progress=False)
    assert len(losses) == 3 and not model.training
    assert loss() < before - 0.1


def test_bundled_model_loads_and_generates():
    from reasoning_from_scratch.generation import generate
    from reasoning_from_scratch.weights import load_pretrained

    files = {p.name: p.stat().st_size for p in BUNDLE.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    assert sum(files.values()) < 10 * 2**20
    model, tokenizer = load_pretrained("tiny-arith")
    assert sum(p.numel() for p in model.parameters()) == BUNDLE_PARAMETERS
    assert model.dtype == torch.float32
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|endoftext|>")
    ex = make_split("test", 1)[0]
    prompt = torch.tensor([tokenizer.encode(render_prompt(ex["problem"]))])
    out = generate(model, prompt, max_new_tokens=96, eos_token_id=tokenizer.eos_token_id)
    assert not out.truncated[0]
    completion = out.completion_ids[0, : out.lengths[0]].tolist()
    assert completion[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(completion[:-1])
    assert "\\boxed{" in text or "The answer is" in text


def test_think_native_corpus_is_all_think_with_slips_on_small_steps():
    from reasoning_from_scratch.tiny_world import THINK_SLIP_PROB_SMALL, make_slip_prob

    docs = build_corpus(400, seed=3, slip_prob=make_slip_prob(THINK_SLIP_PROB_SMALL),
                        think_native=True)
    assert {d["style"] for d in docs} == {"think"}
    assert all(d["completion"].startswith(" <think>\n") and "\\boxed{" in d["completion"]
               for d in docs)
    assert style_distribution(docs[0], think_native=True) == {"think": 1.0}
    # 37+45: the carry forgotten (72) with the small-step probability
    assert make_slip_prob(THINK_SLIP_PROB_SMALL)(37, "+", 45) == THINK_SLIP_PROB_SMALL
    assert make_slip_prob(THINK_SLIP_PROB_SMALL)(95, "+", 45) == 0.6  # three digits: large
    one_step = [d for d in docs if d["level"] == 1]
    slipped = sum(bool(d["slips"]) for d in one_step) / len(one_step)
    assert 0.2 < slipped < 0.6  # about 0.65 x the one-step problems with a carry to forget


def test_think_native_build_is_deterministic(tmp_path):
    from reasoning_from_scratch.tiny_world import build_tiny_model
    from reasoning_from_scratch.weights import BUNDLED_MODELS

    def build(name):
        build_tiny_model(tmp_path / name, seed=5, steps=3, batch_size=4, n_test=2,
                         progress=False, think_native=True, slip_prob_small=0.65,
                         tokenizer_dir=BUNDLED_MODELS["tiny-arith"])
        return (tmp_path / name / "model.safetensors").read_bytes()

    assert build("a") == build("b")
    # the bundled tokenizer, unchanged
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        BUNDLED_MODELS["tiny-arith"] / "tokenizer.json").read_text()


def test_bundled_think_native_model_writes_think_format_with_a_box():
    from reasoning_from_scratch.evaluation import evaluate
    from reasoning_from_scratch.weights import load_pretrained

    model, tokenizer = load_pretrained("tiny-arith-think", device="cpu")
    assert sum(p.numel() for p in model.parameters()) == BUNDLE_PARAMETERS
    examples = make_split("test", 40)
    res = evaluate(model, tokenizer, examples, "cpu", max_new_tokens=112, batch_size=40,
                   temperature=0.0, progress=False)
    assert res["format_rate"] >= 0.95
    assert all("\\boxed{" in r["generated_text"] for r in res["records"])
    # calibrated mid-range on a small sample (the 200-problem figures: docs/tiny_world.md)
    assert 0.15 <= res["accuracy"] <= 0.6
