"""Chapter 9: SFT loop (completion-only loss, exact resume), rejection sampling, trace files,
the distillation run (Ctrl-C and resume) and its command line (tiny random models, CPU)."""

import json
import os
import runpy
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reasoning_from_scratch import distillation
from reasoning_from_scratch.cli import distill as distillation_cli
from reasoning_from_scratch.distillation import (
    filter_traces,
    generate_distillation_data,
    read_traces,
    traces_to_documents,
    verify_trace,
    write_traces,
)
from reasoning_from_scratch.distillation_training import (
    DistillConfig,
    split_traces,
    train_distillation,
)
from reasoning_from_scratch.experiments.distill_vs_rl import accuracy_at, summarise_distill_vs_rl
from reasoning_from_scratch.generation import Rollouts
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.sft import (
    batch_schedule,
    collate,
    completion_loss,
    make_sft_optimizer,
    mean_completion_loss,
    soft_distillation_loss,
    train_sft,
)
from reasoning_from_scratch.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
GOOD = "<think>\nStep 1: 2 + 3 = 5\nStep 2: 5 * 4 = 20\n</think>\n\\boxed{20}"
SLIP = "<think>\nStep 1: 2 + 3 = 6\nStep 2: 6 * 4 = 20\n</think>\n\\boxed{20}"  # right answer
WRONG = "<think>\nStep 1: 2 + 3 = 5\nStep 2: 5 * 4 = 24\n</think>\n\\boxed{24}"
UNBOXED = "Step 1: 2 + 3 = 5\nStep 2: 5 * 4 = 20\nThe answer is 20."
PROBLEM = "Compute (2 + 3) * 4."


# ----------------------------------------------------------------------------------------------
# The SFT loop
# ----------------------------------------------------------------------------------------------

def test_collate_scores_only_completion_tokens_hand_built():
    # prompt [11, 12, 13], completion [21, 22] + EOS 2; a shorter second row is right-padded
    pairs = [([11, 12, 13], [21, 22, 2]), ([11, 14], [23, 2])]
    inputs, targets = collate(pairs, pad_id=0)
    assert inputs.tolist() == [[11, 12, 13, 21, 22], [11, 14, 23, 0, 0]]
    # position j predicts token j+1; prompt positions and padding are -100
    assert targets.tolist() == [[-100, -100, 21, 22, 2], [-100, 23, 2, -100, -100]]
    # with the shared first token left out of the inputs (prefix_len 1)
    inputs, targets = collate(pairs, pad_id=0, prefix_len=1)
    assert inputs.tolist() == [[12, 13, 21, 22], [14, 23, 0, 0]]
    assert targets.tolist() == [[-100, 21, 22, 2], [23, 2, -100, -100]]


def _tiny_model(vocab=40, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return Qwen3Model(cfg)


def test_completion_loss_equals_the_hand_computed_mean_over_completion_tokens():
    model = _tiny_model()
    pairs = [([5, 6, 7], [8, 9, 2]), ([5, 6, 10, 11], [12, 2])]
    inputs, targets = collate(pairs, pad_id=0)
    with torch.no_grad():
        loss = completion_loss(model, torch.empty(0, dtype=torch.long), inputs, targets)
        logp = F.log_softmax(model(inputs).float(), dim=-1)  # (B, T, V)
    # the scored positions by hand: row 0 predicts 8, 9, 2 at positions 2, 3, 4;
    # row 1 predicts 12, 2 at positions 3, 4
    picks = [(0, 2, 8), (0, 3, 9), (0, 4, 2), (1, 3, 12), (1, 4, 2)]
    expected = -sum(logp[b, t, tok] for b, t, tok in picks) / len(picks)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # the prompt tokens do not count: changing a prompt *target* cannot change the loss, and a
    # shared-prefix computation gives the same number
    with torch.no_grad():
        shared = completion_loss(model, torch.tensor([5, 6]), *collate(pairs, 0, prefix_len=2))
    assert shared.item() == pytest.approx(loss.item(), rel=1e-5)


def test_soft_distillation_loss_is_the_kl_to_the_teacher_on_completion_positions():
    student, teacher = _tiny_model(seed=0), _tiny_model(seed=1)
    pairs = [([5, 6, 7], [8, 9, 2]), ([5, 6, 10, 11], [12, 2])]
    inputs, targets = collate(pairs, pad_id=0)
    with torch.no_grad():
        s_logits, t_logits = student(inputs), teacher(inputs)
    picks = [(0, 2), (0, 3), (0, 4), (1, 3), (1, 4)]  # the scored positions, by hand
    for temperature in (1.0, 2.0):
        loss = soft_distillation_loss(s_logits, t_logits, targets, temperature)
        p = F.softmax(t_logits / temperature, dim=-1)
        q = F.softmax(s_logits / temperature, dim=-1)
        by_hand = sum((p[b, t] * (p[b, t].log() - q[b, t].log())).sum() for b, t in picks)
        assert loss.item() == pytest.approx(temperature**2 * by_hand.item() / len(picks),
                                            rel=1e-4)
    # zero against itself; prompt and padding positions do not count
    assert soft_distillation_loss(t_logits, t_logits, targets).item() == pytest.approx(0, abs=1e-6)
    noisy = s_logits.clone()
    noisy[targets == -100] += 5 * torch.randn_like(noisy[targets == -100])
    assert soft_distillation_loss(noisy, t_logits, targets).item() == pytest.approx(
        soft_distillation_loss(s_logits, t_logits, targets).item(), rel=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        soft_distillation_loss(s_logits, t_logits, targets, temperature=0.0)


class _IdTokenizer:
    """Token ids written as space-separated integers: exact, hand-checkable encodings."""

    eos_token_id, pad_token_id = 2, 0

    def encode(self, text):
        return [int(t) for t in text.split()]


def _docs(n=12):
    return [{"prompt": f"5 6 {7 + i % 3}", "completion": " ".join(str(8 + (i + j) % 20)
                                                                  for j in range(1 + i % 4))}
            for i in range(n)]


def test_train_sft_resumed_from_step_k_equals_the_straight_run():
    tok, docs = _IdTokenizer(), _docs()
    kw = dict(steps=6, batch_size=4, lr=1e-2, warmup=2, seed=1, progress=False)
    straight = _tiny_model()
    before = [p.detach().clone() for p in straight.parameters()]
    losses = train_sft(straight, tok, docs, **kw)
    assert any(not torch.equal(a, b) for a, b in zip(before, straight.parameters()))
    resumed = _tiny_model()
    opt = make_sft_optimizer(resumed, kw["lr"], 0.1)
    # run 3 steps, then continue from step 3 with the same optimizer (as a checkpoint restores)
    rows = []
    try:
        train_sft(resumed, tok, docs, **kw, optimizer=opt,
                  on_update=lambda k, row: rows.append((k, row["loss"])),
                  after_update=lambda k: _stop_at(k, 3))
    except _Stop:
        pass
    assert [k for k, _ in rows] == [1, 2, 3]
    rest = train_sft(resumed, tok, docs, **kw, optimizer=opt, start_step=3)
    assert [loss for _, loss in rows] + rest == pytest.approx(losses, rel=1e-6)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Stop(Exception):
    pass


def _stop_at(k, stop):
    if k == stop:
        raise _Stop


def test_batch_schedule_is_a_function_of_the_seed_and_covers_each_epoch():
    lengths = [3, 9, 4, 4, 7, 1, 2, 8, 5, 6]
    a, b = batch_schedule(lengths, 3, seed=5), batch_schedule(lengths, 3, seed=5)
    first = [next(a) for _ in range(8)]
    assert first == [next(b) for _ in range(8)]
    epoch = first[:4]  # 10 documents in batches of 3: 4 batches (the last holds 1)
    assert sorted(i for batch in epoch for i in batch) == list(range(10))


def test_mean_completion_loss_is_token_weighted():
    model, tok, docs = _tiny_model(), _IdTokenizer(), _docs(5)
    pairs = [(tok.encode(d["prompt"]), tok.encode(d["completion"]) + [2]) for d in docs]
    with torch.no_grad():
        sums = [completion_loss(model, torch.empty(0, dtype=torch.long), *collate([p], 0),
                                reduction="sum").item() for p in pairs]
    tokens = sum(len(c) for _, c in pairs)
    assert mean_completion_loss(model, tok, docs, batch_size=2) == pytest.approx(
        sum(sums) / tokens, rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Rejection sampling and trace files
# ----------------------------------------------------------------------------------------------

def test_verify_trace_answer_and_steps():
    assert verify_trace(PROBLEM, "20", GOOD)
    assert verify_trace(PROBLEM, "20", SLIP) and not verify_trace(PROBLEM, "20", SLIP, True)
    assert not verify_trace(PROBLEM, "20", WRONG)
    assert not verify_trace(PROBLEM, "20", UNBOXED)  # strict: a boxed answer, like the reward
    # no step verifier for a non-arithmetic problem: the answer alone decides
    assert verify_trace("What is the answer?", "20", SLIP, check_steps=True)


def _fake_sampler(texts_by_problem, truncated_by_problem):
    """A stand-in for sample_rollouts_batch returning hand-written completions."""
    def sample(model, tokenizer, prompts, num_rollouts, device, **kw):
        groups = []
        for prompt in prompts:
            key = next(k for k in texts_by_problem if k in prompt)
            texts = texts_by_problem[key]
            assert len(texts) == num_rollouts
            groups.append(Rollouts(
                prompt_ids=torch.tensor([1]), completion_ids=torch.ones(len(texts), 3).long(),
                completion_mask=torch.ones(len(texts), 3, dtype=torch.bool), texts=texts,
                lengths=torch.full((len(texts),), 3),
                truncated=torch.tensor(truncated_by_problem[key])))
        return groups
    return sample


@pytest.mark.parametrize("check_steps,max_per_problem", [(False, 4), (True, 4), (False, 1)])
def test_rejection_sampling_keeps_exactly_the_verified_traces(monkeypatch, check_steps,
                                                              max_per_problem):
    other = "Compute 7 - 2."
    texts = {PROBLEM: [WRONG, GOOD, SLIP, GOOD], other: ["\\boxed{5}", "\\boxed{5}", "\\boxed{4}",
                                                         "Step 1: 7 - 2 = 5\n\\boxed{5}"]}
    truncated = {PROBLEM: [False] * 4, other: [True, False, False, False]}
    monkeypatch.setattr(distillation, "sample_rollouts_batch", _fake_sampler(texts, truncated))
    examples = [{"problem": PROBLEM, "answer": "20", "level": 2},
                {"problem": other, "answer": "5", "level": 1}]
    model = _tiny_model()
    records, stats = generate_distillation_data(
        model, None, examples, num_samples=4, max_per_problem=max_per_problem,
        check_steps=check_steps, prompts_per_batch=1, progress=False, teacher_name="t")
    # PROBLEM: GOOD (twice, kept once: duplicates teach nothing new), SLIP only without steps;
    # other: the truncated boxed 5 is dropped; the bare "\\boxed{5}" skips its one step, which
    # the step check counts as a wrong step; "Step 1: ... \\boxed{5}" passes both checks
    bare, worked = (other, "\\boxed{5}"), (other, "Step 1: 7 - 2 = 5\n\\boxed{5}")
    if check_steps:
        expected, verified = [(PROBLEM, GOOD), worked], 2 + 1
    else:
        expected, verified = [(PROBLEM, GOOD), (PROBLEM, SLIP), bare, worked], 3 + 2
    if max_per_problem == 1:
        expected = [(PROBLEM, GOOD), bare]
    assert [(r["problem"], r["completion"]) for r in records] == expected
    assert stats["verified"] == verified  # samples that passed, duplicates included
    assert stats["kept"] == len(records) and stats["problems_covered"] == 2
    assert all(r["teacher"] == "t" and r["check_steps"] == check_steps for r in records)


def test_generation_with_a_real_tiny_model_keeps_only_verified(tiny_dir):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    examples = [{"problem": f"Compute {a} + {b}.", "answer": str(a + b)} for a, b in
                [(1, 2), (3, 4), (5, 6)]]
    records, stats = generate_distillation_data(model, tok, examples, num_samples=3,
                                                max_new_tokens=6, progress=False)
    assert stats["samples"] == 9 and stats["generated_tokens"] > 0
    assert all(verify_trace(r["problem"], r["answer"], r["completion"]) for r in records)


def test_traces_round_trip_and_documents(tmp_path):
    records = [{"problem": PROBLEM, "answer": "20", "completion": GOOD, "level": 2,
                "teacher": "t"}, {"problem": "Compute 1 + 1.", "answer": "2",
                                  "completion": "\\boxed{2} ünïcode"}]
    path = write_traces(records, tmp_path / "t.jsonl")
    assert read_traces(path) == records
    docs = traces_to_documents(records)
    assert docs[0]["completion"] == GOOD and PROBLEM in docs[0]["prompt"]


def test_other_providers_field_names_and_filtering(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps({"question": PROBLEM, "response": SLIP, "ground_truth": 20}) + "\n"
                    + json.dumps({"question": PROBLEM, "response": WRONG, "answer": "20"}) + "\n")
    records = read_traces(path)
    assert [r["answer"] for r in records] == ["20", "20"]
    assert [r["completion"] for r in filter_traces(records)] == [SLIP]
    assert filter_traces(records, check_steps=True) == []


@pytest.mark.parametrize("lines,message", [
    (['{"problem": "p", "answer": "1", "completion": "c"}', '{"problem": "p", "answer"'],
     "line 2: invalid JSON"),
    (['{"problem": "p", "answer": "1", "completion": "c"}', "", '{"problem": "p", "answer": "1"}'],
     "line 3: record has none of the fields 'completion'"),
    (['{"problem": "p", "completion": "c"}'], "line 1: record has none of the fields 'answer'"),
    (['["p", "c"]'], "line 1: expected a JSON object"),
    (['{"problem": ["p"], "answer": "1", "completion": "c"}'], "line 1: field 'problem' must be"),
])
def test_malformed_trace_lines_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl, {message}"):
        read_traces(path)


def test_missing_or_empty_trace_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_traces(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: the file holds no traces"):
        read_traces(tmp_path / "empty.jsonl")
    (tmp_path / "noanswer.jsonl").write_text('{"problem": "p", "completion": "c"}\n')
    assert read_traces(tmp_path / "noanswer.jsonl", require_answer=False)[0]["answer"] is None


def test_split_traces_by_problem():
    records = [{"problem": f"p{i % 10}", "completion": str(i)} for i in range(30)]
    train, val = split_traces(records, 0.2, seed=0)
    assert len({r["problem"] for r in val}) == 2 and len(train) + len(val) == 30
    assert not {r["problem"] for r in train} & {r["problem"] for r in val}
    assert split_traces(records, 0.0, seed=0) == (records, [])


# ----------------------------------------------------------------------------------------------
# The distillation run: Ctrl-C and resume
# ----------------------------------------------------------------------------------------------

TRACES = [{"problem": f"Compute {a} + {b}.", "answer": str(a + b),
           "completion": f"<think>\nStep 1: {a} + {b} = {a + b}\n</think>\n\\boxed{{{a + b}}}"}
          for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (3, 3)]]
HELD_OUT = [{"problem": "Compute 2 + 2.", "answer": "4"}, {"problem": "Compute 5 + 3.",
                                                          "answer": "8"}]


def _distill_config(out, **kw):
    base = dict(steps=4, batch_size=3, lr=1e-2, warmup=1, val_fraction=0.25, eval_every=2,
                eval_examples=2, eval_max_new_tokens=4, eval_batch_size=2, checkpoint_every=2,
                seed=1, output_dir=str(out), progress=False)
    return DistillConfig(**{**base, **kw})


def _distill(tiny_dir, config, resume_from=None, hook=None):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    return train_distillation(model, tok, TRACES, HELD_OUT, "cpu", config,
                              resume_from=resume_from, phase_hook=hook)


def test_train_distillation_says_why_there_is_nothing_to_train_on(tiny_dir, tmp_path):
    """No records at all, and records that the validation split took whole, are two errors."""
    model, tok = load_pretrained(tiny_dir, device="cpu")
    with pytest.raises(ValueError, match="the list of records is empty"):
        train_distillation(model, tok, [], HELD_OUT, "cpu", _distill_config(tmp_path / "a"))
    with pytest.raises(ValueError, match="all 1 were held back for validation"):
        train_distillation(model, tok, TRACES[:1], HELD_OUT, "cpu",
                           _distill_config(tmp_path / "b", val_fraction=0.75))


def _distill_outcome(run_dir):
    rows = [{k: v for k, v in r.items() if k not in ("step_s", "train_s")}
            for r in read_metrics(run_dir / "metrics.csv")]
    weights = load_pretrained(run_dir / "final", device="cpu")[0].state_dict()
    summary = json.loads((run_dir / "summary.json").read_text())
    return rows, weights, {k: v for k, v in summary.items()
                           if k not in ("wall_seconds", "train_seconds", "output_dir")}


@pytest.fixture(scope="module")
def straight_distill(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "run"
    summary = _distill(tiny_dir, _distill_config(out))
    return out, summary, _distill_outcome(out)


def test_distillation_run_writes_its_files_and_changes_the_weights(straight_distill, tiny_dir):
    out, summary, (rows, weights, _) = straight_distill
    assert {"config.json", "metrics.csv", "metrics.png", "summary.json", "final"} <= {
        p.name for p in out.iterdir()}
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["val_loss"] is not None and rows[1]["eval_accuracy"] is not None
    assert rows[0]["val_loss"] is None and rows[3]["val_loss"] is not None  # final evaluation
    assert summary["final_val_loss"] < summary["base_val_loss"]
    start = load_pretrained(tiny_dir, device="cpu")[0].state_dict()
    assert any(not torch.equal(start[k], weights[k]) for k in start)


def _kill_at(phase, step, sig=signal.SIGINT):
    def hook(p, s):
        if (p, s) == (phase, step):
            os.kill(os.getpid(), sig)
    return hook


@pytest.mark.parametrize("phase,step,holds,sig", [
    ("base_eval", 0, 0, signal.SIGINT), ("update", 3, 3, signal.SIGINT),
    ("eval", 2, 2, signal.SIGINT), ("checkpoint", 2, 2, signal.SIGINT),
    ("final_eval", 4, 4, signal.SIGINT), ("update", 3, 3, signal.SIGTERM),
    ("eval", 2, 2, signal.SIGTERM), ("checkpoint", 2, 2, signal.SIGUSR1)])
def test_distillation_ctrl_c_or_stop_signal_then_resume_equals_the_uninterrupted_run(
        straight_distill, tiny_dir, tmp_path, phase, step, holds, sig):
    out = tmp_path / "run"
    config = _distill_config(out)
    with pytest.raises(KeyboardInterrupt) as stop:
        _distill(tiny_dir, config, hook=_kill_at(phase, step, sig))
    assert getattr(stop.value, "signum", signal.SIGINT) == sig
    ckpt = out / f"checkpoint-{holds}"
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == holds
    _distill(tiny_dir, config, resume_from=out)
    rows, weights, summary = _distill_outcome(out)
    s_rows, s_weights, s_summary = straight_distill[2]
    assert rows == s_rows and summary == s_summary
    for k in s_weights:
        assert torch.equal(weights[k], s_weights[k]), k


def test_a_new_distillation_run_refuses_a_used_directory(straight_distill, tiny_dir):
    out = straight_distill[0]
    with pytest.raises(FileExistsError, match="already holds a run"):
        _distill(tiny_dir, _distill_config(out))


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------

def _ch09_main():
    return runpy.run_path(str(ROOT / "chapters" / "ch09_distill.py"), run_name="ch09")["main"]


CLI_FLAGS = ["--train-examples", "6", "--num-samples", "2", "--max-new-tokens", "6",
             "--steps", "3", "--batch-size", "2", "--eval-examples", "3",
             "--eval-max-new-tokens", "6", "--eval-every", "0", "--val-fraction", "0",
             "--no-progress", "--device", "cpu", "--threads", "1"]


def test_ch09_tiny_run_with_given_traces_and_teacher(tiny_dir, tmp_path):
    traces = write_traces(TRACES, tmp_path / "traces.jsonl")
    out = tmp_path / "run"
    summary = _ch09_main()(["--teacher", str(tiny_dir), "--student", str(tiny_dir),
                            "--traces", str(traces), "--output-dir", str(out), *CLI_FLAGS])
    saved = json.loads((out / "summary.json").read_text())
    for key in ("student_base_accuracy", "student_final_accuracy", "teacher_accuracy",
                "wall_seconds"):
        assert saved[key] is not None and saved[key] == summary[key]
    assert saved["traces"]["kept"] == len(TRACES)  # all of them verify
    assert read_traces(out / "traces.jsonl") == read_traces(traces)
    assert (out / "final" / "model.safetensors").is_file()


def test_ch09_record_collects_runs_in_one_file(tiny_dir, tmp_path):
    traces = write_traces(TRACES, tmp_path / "traces.jsonl")
    record = tmp_path / "docs" / "step_check.json"
    common = ["--teacher", str(tiny_dir), "--student", str(tiny_dir), "--traces", str(traces),
              "--record", str(record), *CLI_FLAGS]
    first = _ch09_main()([*common, "--output-dir", str(tmp_path / "a")])
    _ch09_main()([*common, "--output-dir", str(tmp_path / "b"), "--no-check-steps",
                  "--seed", "3"])
    runs = json.loads(record.read_text())["runs"]
    assert sorted(runs) == ["answer+steps-seed0", "answer-seed3"]
    entry = runs["answer+steps-seed0"]
    assert entry["check_steps"] is True and entry["seed"] == 0
    assert entry["recorded_by"] == "ch09_distill.py --record"
    assert entry["traces_kept"] == len(TRACES) and entry["output_dir"] == str(tmp_path / "a")
    for key in ("teacher_accuracy", "student_final_accuracy", "final_step_correctness"):
        assert entry[key] == first[key]
    assert runs["answer-seed3"]["check_steps"] is False
    # a rerun of one name replaces its entry, the others stay
    _ch09_main()([*common, "--output-dir", str(tmp_path / "c")])
    runs = json.loads(record.read_text())["runs"]
    assert sorted(runs) == ["answer+steps-seed0", "answer-seed3"]
    assert runs["answer+steps-seed0"]["output_dir"] == str(tmp_path / "c")


def test_ch09_resume_of_a_run_without_a_checkpoint_starts_it_over(tiny_dir, tmp_path, capsys):
    traces = write_traces(TRACES, tmp_path / "traces.jsonl")
    out = tmp_path / "run"
    _ch09_main()(["--teacher", str(tiny_dir), "--student", str(tiny_dir), "--traces",
                  str(traces), "--output-dir", str(out), *CLI_FLAGS])
    first = read_metrics(out / "metrics.csv")
    shutil.rmtree(out / "final")  # as if killed before its first checkpoint
    capsys.readouterr()
    _ch09_main()(["--resume", str(out), "--threads", "1"])
    assert "holds no checkpoint (the run stopped before its first one)" in capsys.readouterr().out
    again = read_metrics(out / "metrics.csv")
    assert [{k: v for k, v in r.items() if k not in ("step_s", "train_s")} for r in again] == \
        [{k: v for k, v in r.items() if k not in ("step_s", "train_s")} for r in first]


def test_ch09_samples_the_teacher_and_resumes(tiny_dir, tmp_path, monkeypatch):
    _accept_every_sample(monkeypatch)
    out = tmp_path / "run"
    argv = ["--teacher", str(tiny_dir), "--student", str(tiny_dir), "--output-dir", str(out),
            "--checkpoint-every", "1", *CLI_FLAGS]
    with pytest.raises(SystemExit) as exit_info:
        hook_run = distillation_cli.train_distillation

        def interrupted(*args, **kwargs):
            kwargs["phase_hook"] = _kill_at("update", 2)
            return hook_run(*args, **kwargs)
        monkeypatch.setattr(distillation_cli, "train_distillation", interrupted)
        _ch09_main()(argv)
    assert exit_info.value.code == 130
    traces = (out / "traces.jsonl").read_text()
    assert traces and json.loads((out / "data.json").read_text())["generation"]["samples"] == 12
    monkeypatch.setattr(distillation_cli, "train_distillation", hook_run)
    summary = _ch09_main()(["--resume", str(out), "--threads", "1"])
    assert (out / "traces.jsonl").read_text() == traces  # reused, not sampled again
    assert summary["steps"] == 3 and len(read_metrics(out / "metrics.csv")) == 3


def test_ch09_trains_the_chapter7_teacher_when_missing(tmp_path, monkeypatch):
    calls = []

    def fake_run_cli(argv, description, defaults, prefix):
        calls.append(argv)
        (tmp_path / "teacher" / "checkpoint-1").mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(distillation_cli, "run_cli", fake_run_cli)
    path = distillation_cli.chapter7_teacher(tmp_path / "teacher", threads=2)
    assert path == tmp_path / "teacher" / "final"
    assert calls[0] == ["--output-dir", str(tmp_path / "teacher"), "--threads", "2"]
    distillation_cli.chapter7_teacher(tmp_path / "teacher")  # interrupted: resume, not restart
    assert calls[1] == ["--resume", str(tmp_path / "teacher"), "--threads", "1"]


@pytest.mark.parametrize("flags,message", [
    (["--lr", "0"], "--lr"), (["--val-fraction", "1"], "--val-fraction"),
    (["--traces", "missing.jsonl"], "missing.jsonl"), (["--num-samples", "0"], "--num-samples")])
def test_ch09_bad_flags_exit_2_before_writing(tmp_path, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _ch09_main()(["--output-dir", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# The distillation-vs-RL experiment
# ----------------------------------------------------------------------------------------------

def test_accuracy_at_reads_the_last_model_within_budget():
    curve = [[0.0, 0.2], [50.0, 0.2], [80.0, 0.5], [120.0, 0.6]]
    assert accuracy_at(curve, 0) == 0.2 and accuracy_at(curve, 79.9) == 0.2
    assert accuracy_at(curve, 80) == 0.5 and accuracy_at(curve, 1e9) == 0.6


def test_summary_reads_grpo_at_each_seeds_distillation_cost():
    results = {
        "distill": {0: {"accuracy": 0.6, "seconds": 100.0, "gen_seconds": 40.0,
                        "sft_seconds": 60.0, "traces": 10, "step_correctness": 0.9,
                        "format_rate": 1.0},
                    1: {"accuracy": 0.7, "seconds": 200.0, "gen_seconds": 40.0,
                        "sft_seconds": 160.0, "traces": 12, "step_correctness": 0.8,
                        "format_rate": 1.0}},
        "grpo": {s: {"accuracy": 0.5, "seconds": 300.0, "step_correctness": 0.7,
                     "format_rate": 1.0,
                     "curve": [[0, 0.2], [90, 0.3], [150, 0.4], [300, 0.5]]} for s in (0, 1)},
    }
    summary = summarise_distill_vs_rl(results)
    assert summary["seeds"] == [0, 1]
    assert summary["grpo_equal_time"]["accuracy"]["mean"] == pytest.approx((0.3 + 0.4) / 2)
    assert summary["distill"]["accuracy"]["mean"] == pytest.approx(0.65)
    assert summary["grpo_full"]["accuracy"]["mean"] == pytest.approx(0.5)


def _accept_every_sample(monkeypatch):
    """A tiny random teacher never finishes a solution: count every sample as finished and
    verified, so the plumbing after rejection sampling runs."""
    real = distillation.sample_rollouts_batch

    def finished(*args, **kwargs):
        groups = real(*args, **kwargs)
        for g in groups:
            g.truncated[:] = False
        return groups
    monkeypatch.setattr(distillation, "sample_rollouts_batch", finished)
    monkeypatch.setattr(distillation, "verify_trace", lambda *a, **k: True)


def test_ch09_distill_vs_rl_without_verified_traces_exits_clearly(tiny_dir, tmp_path,
                                                                    monkeypatch):
    """A teacher whose every sample fails verification: an error naming the arm, the samples and
    the flags to change; no traces file, so a rerun samples again."""
    monkeypatch.setattr(distillation, "verify_trace", lambda *a, **k: False)
    main = runpy.run_path(str(ROOT / "chapters" / "ch09_distill_vs_rl.py"),
                          run_name="ch09_compare")["main"]
    out = tmp_path / "compare"
    with pytest.raises(SystemExit) as end:
        main(["--teacher", str(tiny_dir), "--student", str(tiny_dir), "--seeds", "0",
              "--arms", "distill", "--train-examples", "2", "--num-samples", "2",
              "--eval-examples", "2", "--max-new-tokens", "4", "--output-dir", str(out),
              "--threads", "1", "--device", "cpu"])
    assert str(end.value.code).startswith("error: distill, seed 0: the teacher")
    assert "no verified trace in 4 samples of 2 problems" in str(end.value.code)
    assert not (out / "distill-seed0" / "traces.jsonl").exists()


def test_ch09_distill_vs_rl_tiny_run(tiny_dir, tmp_path, monkeypatch):
    _accept_every_sample(monkeypatch)
    main = runpy.run_path(str(ROOT / "chapters" / "ch09_distill_vs_rl.py"),
                          run_name="ch09_compare")["main"]
    out = tmp_path / "compare"
    argv = ["--teacher", str(tiny_dir), "--student", str(tiny_dir), "--seeds", "0",
            "--train-examples", "4", "--num-samples", "2", "--distill-steps", "2",
            "--distill-eval-every", "1", "--grpo-steps", "2", "--grpo-eval-every", "1",
            "--eval-examples", "2", "--max-new-tokens", "4", "--output-dir", str(out),
            "--threads", "1", "--device", "cpu"]
    result = main(argv)
    assert {"distill", "grpo_equal_time", "grpo_full"} <= set(result["summary"])
    runs = json.loads((out / "results.json").read_text())["runs"]
    for arm in ("distill", "self_distill", "grpo"):
        curve = runs[arm]["0"]["curve"]
        assert len(curve) >= 3 and curve[0][0] == 0.0
        assert all(a[0] <= b[0] for a, b in zip(curve, curve[1:]))  # seconds only grow
    table = (out / "results.md").read_text()
    assert "**distillation**" in table and "self-distillation" in table
    settings = json.loads((out / "self_distill-seed0" / "settings.json").read_text())
    assert settings["teacher"] == str(tiny_dir)  # the student is its own teacher
    assert (out / "distill_vs_rl.png").stat().st_size > 0
    figures = (out / "distill-seed0" / "figures.json").read_text()
    again = main([*argv, "--report-only"])  # reuses the finished runs, trains nothing
    assert again["summary"] == result["summary"]
    assert (out / "distill-seed0" / "figures.json").read_text() == figures
