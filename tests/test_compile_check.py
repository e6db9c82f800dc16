"""`compile_check` at the precision CUDA runs use, on the CPU: a bfloat16 sampler of the bundled
tiny-arith model and its update under bfloat16 autocast. A correct compiled path (torch.compile
itself, and the eager code run as the compiled one) passes; each fault of tests/compile_faults.py
fails, each by the figure that sees it (the figures: docs/speed.md, "The first-use check").
"""

import copy
import math

import pytest
import torch
import torch._dynamo
from compile_faults import (
    eager_update_block,
    faulty_decode_step,
    faulty_update_block,
    one_update,
)
from graph_replay import replay_decode_steps

from reasoning_from_scratch import compile_check
from reasoning_from_scratch.compiled_update import FixedShape
from reasoning_from_scratch.generation import generate, left_pad, pick_token, stop_token_ids
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.systems import sampling_replica
from reasoning_from_scratch.weights import load_pretrained

PROBLEMS = ["12+7", "3*4+5", "(8-3)*2", "45+17", "9*9", "100-37", "6+6+6", "14*3"]
NEW_TOKENS = 48
compiler = pytest.mark.skipif(
    not (callable(getattr(torch, "compile", None)) and torch._dynamo.is_dynamo_supported()),
    reason="torch.compile is not supported on this Python/platform")


@pytest.fixture(scope="module")
def arith():
    """(float32 model, tokenizer, prompts (8, P), mask, stop ids): tiny-arith's eight prompts."""
    model, tok = load_pretrained("tiny-arith", device="cpu")
    ids, mask = left_pad([tok.encode(render_prompt(p)) for p in PROBLEMS], tok.eos_token_id)
    return model.eval(), tok, ids, mask, stop_token_ids(tok)


def _sampler(model):
    """A bfloat16 sampling replica (what a CUDA run samples from)."""
    return sampling_replica(model, "cpu", torch.bfloat16).eval()


def _check(sampler, arith, **kw):
    _, _, ids, mask, stops = arith
    return compile_check.check_decoding(sampler, ids, mask, NEW_TOKENS, stops, **kw)


# ----------------------------------------------------------------------------- hand-checked parts


def test_uniform_gaps_are_the_distance_to_the_tokens_mass():
    """probs (0.5, 0.3, 0.2), u = 1 - r = 0.4: token 0 is picked (gap 0), token 1's mass is
    (0.5, 0.8] (gap 0.1), token 2's (0.8, 1] (gap 0.4). With top-p 0.7 token 2 is dropped and
    the kept mass is 0.8: u = 0.5 x 0.8 = 0.4, token 1 0.1 / 0.8 away, token 2 (empty, at 0.8)
    0.4 / 0.8. A gap is 0 exactly where `pick_token` picks the token."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(3, 3)
    tokens = torch.tensor([0, 1, 2])
    gaps = compile_check.uniform_gaps(logits, tokens, torch.full((3,), 0.6), 1.0, 1.0)
    torch.testing.assert_close(gaps, torch.tensor([0.0, 0.1, 0.4]))
    gaps = compile_check.uniform_gaps(logits, tokens, torch.full((3,), 0.5), 1.0, 0.7)
    torch.testing.assert_close(gaps, torch.tensor([0.0, 0.125, 0.5]))
    r = torch.rand(64, 1, generator=torch.Generator().manual_seed(0))
    noisy = torch.randn(64, 11, generator=torch.Generator().manual_seed(1)) * 3
    for top_p in (1.0, 0.8):
        picked = pick_token(noisy, r, 1.0, top_p)  # (64,)
        assert not compile_check.uniform_gaps(noisy, picked, r[:, 0], 1.0, top_p).any()
        assert compile_check.uniform_gaps(noisy, (picked + 1) % 11, r[:, 0], 1.0, top_p).all()


def test_the_tolerance_is_a_margin_over_the_measured_rounding_with_a_float32_floor():
    assert compile_check.rounding_tolerance(10.0, 0.01) == pytest.approx(0.04)  # 4 x 0.01
    assert compile_check.rounding_tolerance(10.0, 0.01, 8.0) == pytest.approx(0.08)
    floor = 64 * torch.finfo(torch.float32).eps * 10.0  # 7.6e-5: 64 ulps at size 10
    assert compile_check.rounding_tolerance(10.0, 0.0) == pytest.approx(floor)
    assert compile_check.rounding_tolerance(10.0, None) == pytest.approx(floor)
    assert compile_check.rounding_tolerance(0.5, None) == pytest.approx(floor / 10)  # size >= 1
    # a bfloat16 model: at least one bfloat16 roundoff (2**-7) at the size, 0.078 at size 10
    assert compile_check.rounding_tolerance(10.0, 0.0, dtype=torch.bfloat16) == \
        pytest.approx(10.0 / 128)
    assert compile_check.rounding_tolerance(10.0, 0.1, dtype=torch.bfloat16) == pytest.approx(0.4)


def test_the_check_draws_the_uniforms_generate_draws(arith):
    """`_drawn_uniforms` gives each row's token t the t-th draw of its own stream: sampling
    eagerly with those uniforms (`pick_token`) gives `generate`'s tokens."""
    model, _, ids, mask, stops = arith
    out = generate(model, ids, mask, max_new_tokens=6, temperature=1.0,
                   generator=compile_check._row_generators(8, 5, "cpu"))
    u = compile_check._drawn_uniforms(8, 6, 5, "cpu")  # (8, 6)
    assert u.shape == (8, 6) and len({round(float(x), 6) for x in u[:, 0]}) == 8
    P = ids.shape[1]
    with torch.no_grad():
        logits = model(out.sequences, torch.cat([mask, out.completion_mask], 1))[:, P - 1:-1]
    for t in range(6):
        assert torch.equal(pick_token(logits[:, t], u[:, t:t + 1], 1.0), out.completion_ids[:, t])


# ----------------------------------------------------------------------------- decoding


def test_eager_against_itself_passes_and_measures_bfloat16_rounding(arith, monkeypatch):
    """The eager step run as the compiled one (`graph_replay`): ok, the sampled tokens equal,
    every uniform gap 0, and a measured rounding of bfloat16 size (> 1e-3 nats: far above
    float32's 64-ulp floor, so the tolerance is the measured one)."""
    replay_decode_steps(monkeypatch)
    report = _check(_sampler(arith[0]), arith)
    sampled = report["sampled"]
    assert report["ok"] and sampled["ok"], report
    assert sampled["tokens_equal"] and sampled["max_uniform_gap"] == 0.0
    assert sampled["logprob_rounding"] > 1e-3 and report["logprob_rounding"] > 1e-3
    assert sampled["logprob_tolerance"] == pytest.approx(8 * sampled["logprob_rounding"])
    assert sampled["uniform_tolerance"] == pytest.approx(
        math.tanh(4 * sampled["logprob_rounding"] / 2))
    assert report["tokens"] > 50 and "output" in report and "output" not in sampled


@compiler
def test_the_compiled_bfloat16_step_passes(arith):
    """torch.compile's own decode step in bfloat16: within every tolerance."""
    report = _check(_sampler(arith[0]), arith, top_p=0.9)
    assert report["ok"], report
    assert report["sampled"]["top_p"] == 0.9 and report["sampled"]["ok"]


@pytest.mark.parametrize("fault, figure", [("stale_uniforms", "uniform"),
                                           ("runner_up", "logprob"), ("position", "logprob")])
def test_each_decode_fault_fails_the_check(arith, monkeypatch, fault, figure):
    """Stale uniforms (a token sampled with the first step's uniform) fail the sampled
    check's uniform gap; +2 on the runner-up logit and a position one on fail its log-probs
    (and the greedy gap)."""
    faulty_decode_step(monkeypatch, fault)
    report = _check(_sampler(arith[0]), arith)
    sampled = report["sampled"]
    assert not report["ok"] and not sampled["ok"] and not sampled["tokens_equal"]
    if figure == "uniform":
        assert sampled["max_uniform_gap"] > 2 * sampled["uniform_tolerance"]
        assert report["max_logit_gap"] <= report["logit_tolerance"]  # greedy cannot see it
    else:
        assert sampled["max_logprob_diff"] > 2 * sampled["logprob_tolerance"]
        assert report["max_logit_gap"] > 2 * report["logit_tolerance"]


def test_greedy_decoding_alone_does_not_see_stale_uniforms(arith, monkeypatch):
    """temperature 0 checks greedy decoding only, which draws no uniforms: it passes."""
    faulty_decode_step(monkeypatch, "stale_uniforms")
    report = _check(_sampler(arith[0]), arith, temperature=0.0)
    assert report["ok"] and "sampled" not in report


# ----------------------------------------------------------------------------- the update


@pytest.fixture(scope="module")
def batch(arith):
    """A sampled batch of the eight prompts, packed as the update packs it, and its shape."""
    model, _, ids, mask, stops = arith
    out = generate(model, ids, mask, max_new_tokens=NEW_TOKENS, temperature=1.0,
                   eos_token_id=stops, generator=torch.Generator().manual_seed(0))
    full = torch.cat([mask, out.completion_mask], 1).long()
    shape = FixedShape(rows=8, prompt_cols=ids.shape[1],
                       completion_cols=max(8, out.completion_ids.shape[1]))
    return out.sequences, full, ids.shape[1], out.completion_mask, shape


def _check_update(model, batch):
    seq, full, P, real, shape = batch
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    return compile_check.check_logprobs(model, seq, full, P, real, shape, autocast)


def test_the_eager_update_against_itself_passes(arith, batch, monkeypatch):
    eager_update_block(monkeypatch)
    report = _check_update(arith[0], batch)
    assert report["ok"] and report["max_logprob_diff"] == 0.0 and report["logit_rms"] == 0.0
    assert report["logit_rms_rounding"] > 1e-3  # bfloat16's, measured
    assert report["logit_rms_tolerance"] == pytest.approx(3 * report["logit_rms_rounding"])


@compiler
def test_the_compiled_bfloat16_update_passes(arith, batch):
    report = _check_update(arith[0], batch)
    assert report["ok"] and report["logit_rms"] > 0, report  # compiled: another rounding


@pytest.mark.parametrize("fault", ["scaled_block", "stale_layer", "position"])
def test_each_update_fault_fails_the_check(arith, batch, monkeypatch, fault):
    """Blocks 1% too large, layer 1 from before one AdamW step at lr 1e-3, the completion's
    positions one on: each fails, by the RMS of the logits."""
    model, old = arith[0], None
    if fault == "stale_layer":
        old, model = copy.deepcopy(model.model.layers[1]), one_update(model, batch[0], 1e-3)
    faulty_update_block(monkeypatch, fault, model, old_layer=old, layer_index=1,
                        from_col=batch[4].prompt_cols)
    report = _check_update(model, batch)
    assert not report["ok"] and report["logit_rms"] > report["logit_rms_tolerance"], report
