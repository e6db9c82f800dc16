"""Tests for reasoning_from_scratch.training: update, NaN guard, resume, ch06/ch07 scripts."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from reasoning_from_scratch import systems, training
from reasoning_from_scratch.checkpoints import find_checkpoint
from reasoning_from_scratch.cli import train as training_cli
from reasoning_from_scratch.grpo import batch_logprobs, collect_rollouts
from reasoning_from_scratch.process import step_statistics
from reasoning_from_scratch.process_supervision import make_process_advantage_fn, process_metrics
from reasoning_from_scratch.qwen3 import Qwen3Model
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.step_scorers import CallableStepScorer
from reasoning_from_scratch.training import (
    PROCESS_COLUMNS,
    TIMING_COLUMNS,
    GRPOConfig,
    compute_grpo_loss,
    grpo_loss_on_batch,
    train_grpo,
)
from reasoning_from_scratch.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a, b in [(2, 3), (4, 5), (6, 7), (8, 9)]]
HELD_OUT = [{"problem": "3+4", "answer": "7"}, {"problem": "5+6", "answer": "11"}]


def _config(tmp_path, **kw):
    base = dict(steps=4, lr=1e-2, warmup_steps=2, prompts_per_step=2, num_rollouts=4,
                max_new_tokens=6, eval_every=2, eval_examples=2, eval_batch_size=2,
                sample_every=1, seed=3, output_dir=str(tmp_path / "run"), progress=False,
                inner_epochs=2, beta=0.05)
    return GRPOConfig(**{**base, **kw})


def test_one_update_changes_parameters_and_lowers_loss_on_fixed_batch(tiny_dir, even_reward):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    gen = torch.Generator().manual_seed(0)
    batch = collect_rollouts(model, tok, TRAIN[:2], "cpu", even_reward, num_rollouts=4,
                             max_new_tokens=6, generator=gen)
    assert batch.advantages.abs().sum() > 0
    with torch.no_grad():
        old, _ = batch_logprobs(model, batch, with_entropy=False)
    config = GRPOConfig(lr=1e-2, warmup_steps=0)
    before = [p.detach().clone() for p in model.parameters()]
    loss_before = grpo_loss_on_batch(model, batch, old)["loss"].item()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    stats = training.update(model, opt, batch, old, None, config)
    assert stats["skipped"] == 0 and stats["grad_norm"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    loss_after = grpo_loss_on_batch(model, batch, old)["loss"].item()
    assert loss_after < loss_before


def test_non_finite_loss_skips_update(tiny_dir, monkeypatch, even_reward):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    batch = collect_rollouts(model, tok, TRAIN[:2], "cpu", even_reward, num_rollouts=4,
                             max_new_tokens=6, generator=torch.Generator().manual_seed(0))
    real = training.loss_on_batch

    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(training, "loss_on_batch", nan_loss)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = training.update(model, opt, batch, None, None, GRPOConfig())
    assert stats["skipped"] == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state  # AdamW moments untouched


def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_dir, even_reward):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    batch = collect_rollouts(model, tok, TRAIN[:2], "cpu", even_reward, num_rollouts=4,
                             max_new_tokens=6, generator=torch.Generator().manual_seed(1))
    for loss_type in ("grpo", "dapo", "dr_grpo", "sequence"):
        grads = []
        for mbs in (None, 3):
            model.zero_grad()
            cfg = GRPOConfig(loss_type=loss_type, micro_batch_size=mbs, max_grad_norm=1e9)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)  # keeps the weights fixed
            training.update(model, opt, batch, None, None, cfg)
            grads.append([p.grad.clone() for p in model.parameters()])
        for g1, g2 in zip(*grads):
            torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-4)


def _run(tiny_dir, config, reward_fn, resume_from=None):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    return train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, resume_from=resume_from,
                      reward_fn=reward_fn)


def _strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows]


def test_resume_continues_exactly(tiny_dir, tmp_path, even_reward):
    straight = _config(tmp_path / "a")
    _run(tiny_dir, straight, even_reward)
    rows_straight = read_metrics(Path(straight.output_dir) / "metrics.csv")
    assert len(rows_straight) == 4
    assert any(r["ratio_max"] != 1.0 for r in rows_straight)  # inner epochs moved the ratio

    # 2 steps, then a new process-like start from the checkpoint for the remaining 2
    first = _config(tmp_path / "b", steps=2, checkpoint_every=2)
    _run(tiny_dir, first, even_reward)
    ckpt = find_checkpoint(first.output_dir)
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 2
    second = _config(tmp_path / "b")  # same run dir, now 4 steps
    summary = _run(tiny_dir, second, even_reward, resume_from=first.output_dir)
    rows_resumed = read_metrics(Path(second.output_dir) / "metrics.csv")
    assert _strip_timing(rows_resumed) == _strip_timing(rows_straight)
    # an outcome run scores no steps: its process columns stay empty
    assert all(r[c] is None for r in rows_straight for c in PROCESS_COLUMNS.values())
    a = load_pretrained(Path(straight.output_dir) / "final", device="cpu")[0].state_dict()
    b = load_pretrained(Path(second.output_dir) / "final", device="cpu")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert set(summary) >= {"base_accuracy", "final_accuracy", "base_format_rate",
                            "final_format_rate", "steps", "wall_seconds"}


def test_process_metrics_hand_computed():
    """Pooled over completions: 5 steps, 4 judged correct; one completion errs, at its step 2."""
    samples = [{"step_rewards": [1.0, 0.0, 1.0]}, {"step_rewards": [1.0, 1.0]},
               {"step_rewards": []}]
    assert process_metrics(samples) == pytest.approx({
        "proc_steps_per_completion": 5 / 3, "proc_step_reward_mean": 4 / 5,
        "proc_step_correct_rate": 4 / 5, "proc_first_error_step": 2.0,
        "proc_error_free_rate": 2 / 3})
    # no erring completion: no first error step to average, the cell stays empty
    assert "proc_first_error_step" not in process_metrics(samples[1:])
    assert process_metrics([{"reward": 1.0}]) == {}  # outcome supervision


def _even_length_steps(prompt, step):
    """Step reward 1 for a step of even length, else 0: a mix of judgements on random text."""
    return float(len(step) % 2 == 0)


def _process_run(tiny_dir, config, reward_fn, resume_from=None):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    adv_fn = make_process_advantage_fn(tok, CallableStepScorer(_even_length_steps),
                                       split_mode="newlines")
    return train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, resume_from=resume_from,
                      reward_fn=reward_fn, advantage_fn=adv_fn)


def test_process_run_logs_step_statistics_and_resumes(tiny_dir, tmp_path, even_reward):
    """Each row's proc_ columns are `step_statistics` of that step's step rewards (samples.jsonl);
    a run stopped after step 2 and resumed writes the same rows."""
    kw = dict(supervision="process", max_new_tokens=12, inner_epochs=1, beta=0.0, steps=3)
    straight = _config(tmp_path / "a", **kw)
    _process_run(tiny_dir, straight, even_reward)
    out = Path(straight.output_dir)
    rows = read_metrics(out / "metrics.csv")
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        step_rewards = [s["step_rewards"] for s in samples if s["step"] == row["step"]]
        assert len(step_rewards) == 2 * 4  # every completion of the step was scored
        stats = step_statistics(step_rewards)
        for k, col in PROCESS_COLUMNS.items():
            if math.isnan(stats[k]):
                assert row[col] is None
            else:
                assert row[col] == pytest.approx(stats[k], rel=1e-5), col
        assert 0.0 <= row["proc_step_correct_rate"] <= 1.0
    assert any(0.0 < r["proc_step_correct_rate"] < 1.0 for r in rows)  # not a constant
    assert (out / "metrics.png").is_file()

    first = _config(tmp_path / "b", **{**kw, "steps": 2}, checkpoint_every=2)
    _process_run(tiny_dir, first, even_reward)
    second = _config(tmp_path / "b", **kw)
    _process_run(tiny_dir, second, even_reward, resume_from=first.output_dir)
    resumed = read_metrics(Path(second.output_dir) / "metrics.csv")
    assert _strip_timing(resumed) == _strip_timing(rows)


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "chapters" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ch07_script_three_steps_with_resume(tiny_dir, tmp_path):
    """ch07_train.py: 2 steps, then --resume the run dir with --steps 3 (flags given override)."""
    out = tmp_path / "ch07"
    script = _load_script("ch07_train")
    script.main([
        "--model", str(tiny_dir), "--steps", "2", "--prompts-per-step", "2",
        "--num-rollouts", "2", "--max-new-tokens", "4", "--eval-examples", "2",
        "--eval-every", "0", "--train-examples", "20", "--output-dir", str(out),
        "--no-progress", "--device", "cpu",
    ])
    summary = script.main(["--resume", str(out), "--steps", "3", "--device", "cpu"])
    assert summary["steps"] == 3
    for name in ("metrics.csv", "metrics.png", "samples.jsonl", "summary.json"):
        assert (out / name).is_file(), name
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1.0, 2.0, 3.0]
    state = json.loads((out / "final" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["config"]["max_new_tokens"] == 4  # kept from the run
    model, _ = load_pretrained(out / "final", device="cpu")  # the final checkpoint loads
    assert isinstance(model, Qwen3Model)


def test_ch06_defaults_are_plain_grpo():
    d = _load_script("ch06_train").CH06_DEFAULTS
    assert (d.epsilon, d.beta, d.format_reward_weight, d.loss_type) == (None, 0.0, 0.0, "sequence")


def test_ch07_script_process_supervision(tmp_path):
    """ch07_train.py --supervision process --step-scorer verifier trains on the bundled model."""
    out = tmp_path / "ch07-process"
    script = _load_script("ch07_train")
    summary = script.main([
        "--supervision", "process", "--step-scorer", "verifier", "--steps", "1",
        "--prompts-per-step", "2", "--num-rollouts", "4", "--max-new-tokens", "40",
        "--eval-examples", "4", "--eval-every", "0", "--train-examples", "20",
        "--output-dir", str(out), "--no-progress", "--device", "cpu",
    ])
    assert summary["steps"] == 1
    state = json.loads((out / "final" / "trainer_state.json").read_text())
    assert state["config"]["supervision"] == "process"
    assert state["config"]["step_scorer"] == "verifier"
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1.0]


@pytest.mark.parametrize("scorer,variant", [
    ("verifier", "first-error"), ("verifier-think", "progress"), ("verifier", "clip"),
    ("verifier", "delta"), ("verifier", "pure"), ("mc-branch", "value-delta"),
    ("format", "progress"), ("belief", "value-delta"), ("verifier-think-local", "progress-local"),
])
def test_ch07_script_runs_the_outcome_anchored_forms(tmp_path, monkeypatch, scorer, variant):
    """ch07_train.py --supervision process --process-variant NAME, one step each."""
    out = tmp_path / "run"
    policy_reads, real = [], training.forward_tokens
    monkeypatch.setattr(training, "forward_tokens",
                        lambda *a: policy_reads.append(real(*a)[0]) or real(*a))
    summary = _load_script("ch07_train").main([
        "--supervision", "process", "--step-scorer", scorer, "--process-variant", variant,
        "--process-alpha", "0.5", "--mc-rollouts", "2", "--steps", "1",
        "--prompts-per-step", "2", "--num-rollouts", "4", "--max-new-tokens", "40",
        "--eval-examples", "2", "--eval-every", "0", "--train-examples", "20",
        "--output-dir", str(out), "--no-progress", "--device", "cpu",
    ])
    assert summary["steps"] == 1
    config = json.loads((out / "config.json").read_text())
    assert (config["step_scorer"], config["process_variant"], config["process_alpha"]) == (
        scorer, variant, 0.5)
    row = read_metrics(out / "metrics.csv")[0]
    # sampled by the scorer: Monte-Carlo continuations only
    assert (row["scorer_tokens"] > 0) == (scorer == "mc-branch")
    assert row["decode_tokens"] == row["gen_tokens"] + row["scorer_tokens"]
    assert row["forward_tokens"] > 0  # rollout prompts and the update, for every arm
    # plus what the scorer read without sampling: the Monte-Carlo prefixes' prefill, the
    # belief probes' forward passes
    (own,) = policy_reads
    assert (row["forward_tokens"] > own > 0) == (scorer in ("mc-branch", "belief"))
    assert row["forward_tokens"] >= own


def test_compute_grpo_loss_process_gives_token_advantages():
    """supervision="process": per-token (B, Tc) advantages, zero on padding, finite loss."""
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    example = {"problem": "Compute (12+7)*3", "answer": "57"}
    g = torch.Generator().manual_seed(0)
    advantage_fn = make_process_advantage_fn(tokenizer, "verifier", model=model, device="cpu")
    out = compute_grpo_loss(model, tokenizer, example, "cpu", num_rollouts=8, max_new_tokens=40,
                            temperature=1.0, top_p=1.0, generator=g, supervision="process",
                            advantage_fn=advantage_fn)
    adv = torch.tensor(out["advantages"])
    assert adv.dim() == 2 or adv.numel() == 0  # (B, Tc) token advantages, or a skipped group
    assert torch.isfinite(out["loss_tensor"]).all()
    with pytest.raises(ValueError, match="supervision"):
        compute_grpo_loss(model, tokenizer, example, "cpu", num_rollouts=2, max_new_tokens=4,
                          supervision="steps")
    with pytest.raises(ValueError, match="advantage_fn"):  # the loss layer builds no scorer
        compute_grpo_loss(model, tokenizer, example, "cpu", num_rollouts=2, max_new_tokens=4,
                          supervision="process")


def test_summary_reasoning_figures_come_from_the_verifier(tiny_dir, tmp_path, monkeypatch):
    """summary.json's think accuracy, step correctness and per-level figures, hand-built case."""
    from reasoning_from_scratch import evaluation

    held_out = [{"problem": "Compute 17+25", "answer": "42", "level": 1},
                {"problem": "Compute (17+25)*3", "answer": "126", "level": 2}]
    canned = {  # evaluation call -> completion per problem
        0: {"Compute 17+25": " The answer is 42.",  # not think format, not boxed
            "Compute (17+25)*3": " <think>\nStep 1: 17+25=32\nStep 2: 32*3=96\n</think>\n"
                                 "\\boxed{96}"},  # a forgotten carry: step 1 wrong, step 2 right
        1: {"Compute 17+25": " <think>\nStep 1: 17+25=42\n</think>\n\\boxed{42}",
            "Compute (17+25)*3": " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\n</think>\n"
                                 "\\boxed{126}"},
    }
    calls = []

    def fake(model, tokenizer, prompts, device, max_new_tokens, temperature=0.0, top_p=1.0,
             generator=None, compile=False):
        texts = [canned[len(calls)][q] for p in prompts for q in canned[0] if q in p]
        calls.append(1)
        mask = torch.ones(len(texts), 3, dtype=torch.bool)
        return texts, torch.zeros(len(texts), 3, dtype=torch.long), mask

    monkeypatch.setattr(evaluation, "generate_batch", fake)
    config = _config(tmp_path, steps=1, eval_every=0, inner_epochs=1, beta=0.0)
    model, tok = load_pretrained(tiny_dir, device="cpu")
    summary = train_grpo(model, tok, TRAIN, held_out, "cpu", config)
    assert len(calls) == 2  # base and final evaluation
    assert summary["base_accuracy"] == 0.0 and summary["final_accuracy"] == 1.0
    assert summary["base_think_accuracy"] == 0.0 and summary["final_think_accuracy"] == 1.0
    assert summary["base_step_correctness"] == pytest.approx(1 / 2)
    assert summary["final_step_correctness"] == 1.0
    assert summary["per_level"] == {"1": {"base": 0.0, "final": 1.0},
                                    "2": {"base": 0.0, "final": 1.0}}
    saved = json.loads((Path(config.output_dir) / "summary.json").read_text())
    assert saved == summary
    last = read_metrics(Path(config.output_dir) / "metrics.csv")[-1]
    assert last["eval_step_correctness"] == 1.0 and last["eval_think_accuracy"] == 1.0


def test_train_level_weights_flag_and_data():
    import argparse

    assert training_cli.parse_level_weights("1,1,2,2,2") == [1.0, 1.0, 2.0, 2.0, 2.0]
    assert training_cli.parse_level_weights("none") is None
    for bad in ("1,2,3", "1,1,1,1,-1", "0,0,0,0,0", "a,b,c,d,e", "nan,1,1,1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            training_cli.parse_level_weights(bad)
    train, held_out = training_cli.load_grpo_data("arith", 300, "val", 50, [0, 0, 0, 1, 1])
    assert {ex["level"] for ex in train} == {4, 5}
    assert len({ex["level"] for ex in held_out}) == 5  # held-out levels stay uniform
    with pytest.raises(ValueError, match="arith"):
        training_cli.load_grpo_data("gsm8k", 10, train_level_weights=[1, 1, 1, 1, 1])


def test_forward_tokens_counts_prefill_and_update_passes_by_hand():
    from reasoning_from_scratch.grpo import RolloutBatch, pack_rollouts

    # prompts of 3 and 2 tokens, two completions each (3 and 1 tokens, 2 and 2)
    comp_a, comp_b = torch.tensor([[7, 8, 9], [7, 0, 0]]), torch.tensor([[6, 6], [5, 5]])
    mask_a = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    ids, am, P, cmask = pack_rollouts([torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
                                      [comp_a, comp_b], [mask_a, torch.ones(2, 2).bool()])
    assert ids.shape == (4, 6)  # 3 prompt columns + 3 completion columns
    samples = [{"prompt_tokens": 3}] * 2 + [{"prompt_tokens": 2}] * 2
    batch = RolloutBatch(ids, am, P, cmask, torch.zeros(4), torch.zeros(2, 2), samples)
    # prefill 3 + 3 + 2 + 2 = 10; the update computes 4 x 6 = 24 positions less the 2 left
    # pads of the second prompt's rows = 22 per pass, of which real: 3 + 3, 3 + 1, 2 + 2, 2 + 2
    # = 18 and right padding 4 (two after the 1-token completion, one after each 2-token one)
    assert training.forward_tokens(batch, GRPOConfig(inner_epochs=1), False) == (10 + 18, 4)
    assert training.forward_tokens(batch, GRPOConfig(inner_epochs=1), True) == (10 + 2 * 18, 8)
    # 2 epochs with gradients + the old policy's log-probs + the reference: 4 passes
    assert training.forward_tokens(batch, GRPOConfig(inner_epochs=2), True) == (10 + 4 * 18,
                                                                                 16)
    # without an attention mask (prompts of one width) every position is computed; a row
    # without loss tokens (a masked truncated rollout) counts its whole width as real
    ids, am, P, cmask = pack_rollouts([torch.tensor([1, 2])], [comp_a],
                                      [torch.tensor([[1, 1, 0], [0, 0, 0]]).bool()])
    assert am is None
    nomask = RolloutBatch(ids, am, P, cmask, torch.zeros(2), torch.zeros(1, 2), [])
    assert training.forward_tokens(nomask, GRPOConfig(inner_epochs=1), False) == (4 + 5, 1)


def test_more_processes_than_prompts_are_refused_before_anything_is_written(tmp_path,
                                                                            monkeypatch):
    """A process without a prompt of its own would sample nothing: `train_grpo` refuses the
    run before its directory exists."""
    monkeypatch.setattr(systems, "world_size", lambda: 3)
    out = tmp_path / "run"
    config = GRPOConfig(prompts_per_step=2, output_dir=str(out), progress=False)
    with pytest.raises(ValueError, match="3 processes need at least as many prompts per step"):
        train_grpo(None, None, TRAIN, HELD_OUT, "cpu", config)
    assert not out.exists()
    monkeypatch.setattr(systems, "world_size", lambda: 2)  # as many as prompts: no refusal
    systems.check_processes(config)
