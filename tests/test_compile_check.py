"""`compile_check` at the precision CUDA runs use, on the CPU: a bfloat16 sampler of the bundled
tiny-arith model and its update under bfloat16 autocast. A correct compiled path (torch.compile
itself, and the eager code run as the compiled one) passes; each fault of tests/compile_faults.py
fails, each by the figure that sees it (the figures: docs/speed.md, "The first-use check").
"""

import copy
import dataclasses
import math
import weakref
from types import SimpleNamespace

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

from reasoning_from_scratch import compile_check, compiled_update
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
    # u = 0.9 lies above token 0's mass (0, 0.5] by 0.4; the logits doubled at temperature 2
    # are the same distribution
    gaps = compile_check.uniform_gaps(2 * logits, tokens, torch.full((3,), 0.1), 2.0, 1.0)
    torch.testing.assert_close(gaps, torch.tensor([0.4, 0.1, 0.0]))
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
    assert u[3, 0] == torch.rand(1, generator=torch.Generator().manual_seed(5 + 3))[0]
    P = ids.shape[1]
    with torch.no_grad():
        logits = model(out.sequences, torch.cat([mask, out.completion_mask], 1))[:, P - 1:-1]
    for t in range(6):
        assert torch.equal(pick_token(logits[:, t], u[:, t:t + 1], 1.0), out.completion_ids[:, t])


def test_first_difference_is_row_major_and_counts_a_shorter_output():
    """[row, col] of the first differing token in row-major order (not the first column, not
    the last difference); an output that stops early differs where it stops; equal -> None."""
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert compile_check._first_difference(a, a.clone()) is None
    b = torch.tensor([[1, 9, 3], [0, 5, 6]])  # differs at [0, 1] and [1, 0]
    assert compile_check._first_difference(a, b) == [0, 1]
    assert compile_check._first_difference(a, a[:, :2]) == [0, 2]
    assert compile_check._first_difference(a[:, :2], a) == [0, 2]


def test_no_decoding_steps_draw_no_uniforms():
    """A zero-token decode draws nothing: a (rows, 0) block, not an error."""
    assert compile_check._drawn_uniforms(3, 0, 0, "cpu").shape == (3, 0)


class _Head(torch.nn.Module):
    """A fake model for the update's roundings: the identity `lm_head` (hidden states are
    logits) and a KV-cache decode whose next-token logits are all 0, whatever was fed."""

    cfg = SimpleNamespace(num_hidden_layers=1)

    def lm_head(self, h):
        return h

    def forward(self, ids, mask=None, cache=None, last_only=False):
        return torch.zeros(ids.shape[0], 1, 2)  # (B, 1, V = 2)


def test_logit_rms_reads_only_the_real_positions():
    """Row 0 (both positions real) differs by 1 in two of its four logits: RMS sqrt(2 / 4),
    size 4 (its largest |eager logit|). Row 1 has no real position: its +7 everywhere and its
    logit 100 are not read."""
    eager = torch.tensor([[[3.0, -4.0], [0.0, 1.0]], [[100.0, 0.0], [0.0, 0.0]]])  # (2, 2, 2)
    compiled = eager + torch.tensor([[[1.0, 0.0], [0.0, -1.0]], [[7.0, 7.0], [7.0, 7.0]]])
    real = torch.tensor([[True, True], [False, False]])
    rms, size = compile_check._logit_rms(_Head(), compiled, eager, real)
    assert rms == pytest.approx(math.sqrt(0.5)) and size == 4.0


def test_stepwise_rounding_compares_the_decode_with_the_one_pass_logits():
    """The decode's logits are (0, 0); the one-pass ones (`eager`, through the identity head)
    are (2 ln 3, 0) at row 0's first token (token 0) and 0 elsewhere, except row 1's second
    position, which is not real (its 5 is not read). RMS: 2 ln 3 over 3 real positions x 2
    logits; at temperature 2 token 0's log-prob is ln(3/4) against ln(1/2): worst ln 1.5."""
    ids = torch.tensor([[1, 0, 1], [1, 1, 0]])  # prompt 1 token, completions of 2
    mask = torch.ones(2, 3, dtype=torch.long)
    real = torch.tensor([[True, True], [True, False]])
    eager = torch.zeros(2, 2, 2)
    eager[0, 0, 0], eager[1, 1, 0] = 2 * math.log(3), 5.0
    rms, worst = compile_check._stepwise_rounding(_Head(), ids, mask, 1, real, eager, 2.0)
    assert rms == pytest.approx(2 * math.log(3) / math.sqrt(6))
    assert worst == pytest.approx(math.log(1.5))


class _Fixed(torch.nn.Module):
    """A fake policy whose teacher-forced logits are `logits` (L, V) for every row."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, ids, mask):
        return self.logits[None]


def test_stepwise_rounding_skips_empty_rows_and_reads_at_the_temperature():
    """Row 0 has no real token (its recorded 9s are not read, and it does not end the loop);
    row 1's token 0 has logits (2 ln 3, 0): at temperature 2 its log-prob is ln(3/4), recorded
    ln(1/2): the rounding is ln 1.5 (at temperature 1 it would be ln 1.8)."""
    model = _Fixed(torch.tensor([[2 * math.log(3), 0.0], [0.0, 0.0], [0.0, 0.0]]))
    seq = torch.tensor([[1, 0, 1], [1, 0, 1]])  # prompt 1 token, completions of 2
    real = torch.tensor([[False, False], [True, False]])
    recorded = torch.tensor([[9.0, 9.0], [math.log(0.5), 9.0]])
    worst = compile_check.stepwise_rounding(recorded, model, seq, torch.ones(2, 1), real, 2.0)
    assert worst == pytest.approx(math.log(1.5))


def test_choice_figures_read_the_gaps_and_logprobs_of_the_real_tokens():
    """Eager probs (0.5, 0.3, 0.2) at temperature 2 for row 1's one real token (row 0 has none
    and does not end the loop). Sampled token 1 with r = 0.5 under top-p 0.7: u = 0.4 of the
    kept 0.8, token 1's mass (0.5, 0.8]: gap 0.125 (0 without top-p). Its recorded log-prob
    ln 0.3 + 0.25 differs by 0.25; size |ln 0.3|. Greedy (temperature None): token 1's gap is
    the max logit minus its own, 2 ln(0.5 / 0.3)."""
    model = _Fixed(2 * torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]).log())
    out = SimpleNamespace(sequences=torch.tensor([[2, 1], [2, 1]]),
                          completion_ids=torch.tensor([[1], [1]]),
                          completion_mask=torch.tensor([[False], [True]]),
                          logprobs=torch.tensor([[9.0], [math.log(0.3) + 0.25]]))
    prompt, r = torch.ones(2, 1), torch.full((2, 1), 0.5)  # P = 1: ids and mask
    found = compile_check._choice_figures(model, prompt, prompt, out, r, 2.0, 0.7, [0, 1])
    assert found == pytest.approx({"max_gap": 0.125, "max_logprob_diff": 0.25,
                                   "size": -math.log(0.3)})
    found = compile_check._choice_figures(model, prompt, prompt, out, None, None, 1.0, [0, 1])
    assert found["max_gap"] == pytest.approx(2 * math.log(0.5 / 0.3))


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_eager_against_itself_passes_and_measures_bfloat16_rounding(arith, monkeypatch, top_p):
    """The eager step run as the compiled one (`graph_replay`): ok, the sampled tokens equal,
    every uniform gap 0 (also under top-p: both paths and the gaps use the rollouts' top-p),
    the rows stopping at their stop tokens, and a measured rounding of bfloat16 size (> 1e-3
    nats: far above float32's 64-ulp floor, so the tolerance is the measured one)."""
    replay_decode_steps(monkeypatch)
    report = _check(_sampler(arith[0]), arith, top_p=top_p)
    sampled = report["sampled"]
    assert report["ok"] and sampled["ok"], report
    assert sampled["tokens_equal"] and sampled["max_uniform_gap"] == 0.0
    assert sampled["first_difference"] is None and report["rows"] == sampled["rows"] == 8
    assert report["tokens"] < 8 * NEW_TOKENS and sampled["tokens"] < 8 * NEW_TOKENS
    assert report["logit_tolerance"] == pytest.approx(4 * report["logprob_rounding"])
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


def test_the_row_where_the_outputs_part_is_always_read(arith, monkeypatch):
    """With no other row read (CHECK_ROWS 0), the row of the first difference still is: the
    runner-up fault fails the greedy check there."""
    faulty_decode_step(monkeypatch, "runner_up")
    monkeypatch.setattr(compile_check, "CHECK_ROWS", 0)
    report = _check(_sampler(arith[0]), arith, temperature=0.0)
    assert not report["ok"] and report["max_logit_gap"] > report["logit_tolerance"], report


def test_without_measured_rounding_the_decode_tolerances_are_the_bfloat16_floor(arith,
                                                                              monkeypatch):
    """A bfloat16 model's floor is one bfloat16 roundoff (2**-7) at the log-probs' size (>= 1),
    the same for the greedy gap and the log-probs, far above float32's 64 ulps. The rounding
    is measured at each batch's own temperature (greedy 0, sampled 0.7)."""
    replay_decode_steps(monkeypatch)
    temperatures = []
    monkeypatch.setattr(compile_check, "stepwise_rounding",
                        lambda *args: temperatures.append(args[-1]) or 0.0)
    report = _check(_sampler(arith[0]), arith, temperature=0.7)
    assert report["logit_tolerance"] == report["logprob_tolerance"] >= 2 ** -7, report
    assert temperatures == [0.0, 0.7]


def test_a_decode_figure_equal_to_its_tolerance_passes(arith, monkeypatch):
    """The bounds are inclusive: gaps and differences of 0 against tolerances of 0 pass. The
    decode runs `max_new_tokens` (3) tokens."""
    replay_decode_steps(monkeypatch)
    monkeypatch.setattr(compile_check, "rounding_tolerance", lambda *args, **kw: 0.0)
    monkeypatch.setattr(compile_check, "_choice_figures", lambda *args: {
        "max_gap": 0.0, "max_logprob_diff": 0.0, "size": 1.0})
    _, _, ids, mask, stops = arith
    report = compile_check.check_decoding(_sampler(arith[0]), ids, mask, 3, stops,
                                          temperature=0.0)
    assert report["ok"] and report["output"].completion_ids.shape[1] == 3, report


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
    assert report["rows"] == 8 and report["logit_rms_rounding"] > 1e-3  # bfloat16's, measured
    assert report["logprob_tolerance"] == pytest.approx(8 * report["logprob_rounding"])
    assert report["logit_rms_tolerance"] == pytest.approx(3 * report["logit_rms_rounding"])


@compiler
def test_the_compiled_bfloat16_update_passes(arith, batch):
    report = _check_update(arith[0], batch)
    assert report["ok"] and report["logit_rms"] > 0, report  # compiled: another rounding


@pytest.mark.parametrize("fault", ["scaled_block", "stale_layer", "position"])
def test_each_update_fault_fails_the_check(arith, batch, monkeypatch, fault):
    """Blocks 1% too large, layer 1 from before one AdamW step at lr 1e-3, the completion's
    positions one on: each fails, by the RMS of the logits, and moves the log-probs too (the
    compiled side's log-probs go through the compiled blocks)."""
    model, old = arith[0], None
    if fault == "stale_layer":
        old, model = copy.deepcopy(model.model.layers[1]), one_update(model, batch[0], 1e-3)
    faulty_update_block(monkeypatch, fault, model, old_layer=old, layer_index=1,
                        from_col=batch[4].prompt_cols)
    report = _check_update(model, batch)
    assert not report["ok"] and report["logit_rms"] > report["logit_rms_tolerance"], report
    assert report["max_logprob_diff"] > 0


def test_with_compile_off_the_check_pads_only(arith, batch, monkeypatch):
    """A shape with `compile` off pads only: a faulty compiled block is never run."""
    faulty_update_block(monkeypatch, "scaled_block", arith[0])
    seq, full, P, real, shape = batch
    report = _check_update(arith[0], (seq, full, P, real, dataclasses.replace(shape,
                                                                               compile=False)))
    assert report["ok"] and report["logit_rms"] == 0.0 and report["max_logprob_diff"] == 0.0


def test_a_block_that_fails_to_compile_runs_eagerly(arith, batch, monkeypatch):
    """A compile failure falls back to the eager blocks, with a warning, recorded against
    the model checked: the check then passes with nothing to compare."""
    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setitem(compiled_update._COMPILED_BLOCK, "block", broken)
    monkeypatch.setattr(compiled_update, "_BLOCK_COMPILE_FAILURES", weakref.WeakKeyDictionary())
    with pytest.warns(RuntimeWarning, match="no compiler"):
        report = _check_update(arith[0], batch)
    assert report["ok"] and report["logit_rms"] == 0.0
    assert arith[0] in compiled_update._BLOCK_COMPILE_FAILURES


def test_the_update_check_runs_the_updates_graph_on_its_first_rows(arith, batch, monkeypatch):
    """Both log-prob passes see the batch's masks at temperature 1 (the default), the first
    through the compiled blocks (`shape`), the second eagerly; the RMS and the roundings read
    the first CHECK_ROWS rows (3 here)."""
    calls = {"logprobs": [], "rounding": []}

    def spy(name, fn):
        def wrapper(*args):
            calls[name].append(args)
            return fn(*args)
        return wrapper

    monkeypatch.setattr(compile_check, "token_logprobs_and_entropy",
                        spy("logprobs", compile_check.token_logprobs_and_entropy))
    monkeypatch.setattr(compile_check, "_stepwise_rounding",
                        spy("rounding", compile_check._stepwise_rounding))
    monkeypatch.setattr(compile_check, "CHECK_ROWS", 3)
    eager_update_block(monkeypatch)
    seq, full, P, real, shape = batch
    _check_update(arith[0], batch)
    (compiled, eager), (rounding,) = calls["logprobs"], calls["rounding"]
    for args in compiled, eager:
        assert args[2] is full and args[4] is real and args[7] == 1.0
    assert compiled[8] is shape and eager[8] is None
    assert torch.equal(rounding[1], seq[:3]) and torch.equal(rounding[4], real[:3])
    assert rounding[6] == 1.0


def test_a_batch_without_completion_tokens_passes_with_zero_figures(arith, batch,
                                                                     monkeypatch):
    """No real completion token: nothing to compare, every difference 0, ok."""
    eager_update_block(monkeypatch)
    seq, full, P, real, shape = batch
    report = _check_update(arith[0], (seq, full, P, torch.zeros_like(real), shape))
    assert report["ok"] and report["max_logprob_diff"] == 0.0 and report["logit_rms"] == 0.0


def test_update_tolerances_without_rounding_and_at_zero(arith, batch, monkeypatch):
    """No measured rounding: the tolerances are float32's 64-ulp floor at the values' size
    (the log-probs' and the logits' largest, both > 1). Tolerances of 0: the eager path's
    zero differences still pass (the bounds are inclusive)."""
    eager_update_block(monkeypatch)
    monkeypatch.setattr(compile_check, "_stepwise_rounding", lambda *args: (0.0, 0.0))
    report = _check_update(arith[0], batch)
    floor = 64 * torch.finfo(torch.float32).eps
    assert report["ok"] and report["logprob_tolerance"] > floor
    assert report["logit_rms_tolerance"] > floor
    monkeypatch.setattr(compile_check, "rounding_tolerance", lambda *args, **kw: 0.0)
    assert _check_update(arith[0], batch)["ok"]
