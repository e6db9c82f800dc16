"""Tests for batched evaluation: ordering, JSONL schema, summary arithmetic, a real tiny model."""

import json

import pytest
import torch

from reasoning_from_scratch import evaluation
from reasoning_from_scratch.arithmetic import classify_carry_steps
from reasoning_from_scratch.evaluation import evaluate, has_think_format
from reasoning_from_scratch.generation import generate_batch
from reasoning_from_scratch.prompts import render_prompt, render_prompt_with_think_tokens
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config

RECORD_KEYS = {
    "index", "problem", "ground_truth", "generated_text", "extracted_answer", "correct",
    "num_tokens", "level",
}  # fmt: skip


class ByteTokenizer:
    """Byte-level tokenizer: id = byte + 2; 0 = pad, 1 = eos."""

    pad_token_id = 0
    eos_token_id = 1
    vocab_size = 258

    def encode(self, text):
        return [b + 2 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i - 2 for i in ids if i >= 2).decode("utf-8", errors="replace")


class FakeModel(torch.nn.Module):
    """Stands in for a model when generate_batch is monkeypatched."""


EXAMPLES = [
    {"problem": "Compute 2+2", "answer": "4"},
    {"problem": "A much longer problem: compute 10*10 please", "answer": "100"},
    {"problem": "Half?", "answer": "0.5"},
    {"problem": "Compute (3+4)*2, a medium one", "answer": "14"},
    {"problem": "No box", "answer": "7"},
]
# canned completions (and their token counts) per problem
CANNED = {
    "Compute 2+2": (" <think>\nStep 1: 2+2=4\n</think>\n\\boxed{4}", 9),
    "A much longer problem: compute 10*10 please": (" \\boxed{100} <think>late</think>", 6),
    "Half?": (" <think>\nhalf\n</think>\n\\boxed{\\frac{1}{2}}", 12),
    "Compute (3+4)*2, a medium one": (" <think>\n7*2=14\n</think>\n\\boxed{15}", 10),
    "No box": (" the answer is 7", 5),
}


@pytest.fixture
def fake_generate(monkeypatch):
    """Replace generate_batch with a lookup in CANNED; records the prompts of each call."""
    calls = []

    def fake(model, tokenizer, prompts, device, max_new_tokens, temperature=0.0, top_p=1.0,
             generator=None, compile=False):
        calls.append(list(prompts))
        problems = [p.split("Question:\n", 1)[1].rsplit("\n\nAnswer:", 1)[0] for p in prompts]
        texts = [CANNED[q][0] for q in problems]
        lengths = torch.tensor([CANNED[q][1] for q in problems])
        mask = torch.arange(max_new_tokens)[None, :] < lengths[:, None]  # (B, T_new)
        ids = torch.where(mask, 5, 0)
        return texts, ids, mask

    monkeypatch.setattr(evaluation, "generate_batch", fake)
    return calls


def test_records_summary_and_jsonl(fake_generate, tmp_path):
    out = tmp_path / "runs" / "eval.jsonl"
    summary = evaluate(FakeModel(), ByteTokenizer(), EXAMPLES, "cpu", max_new_tokens=16,
                       batch_size=2, jsonl_path=out, progress=False)
    # correct: 2+2 (4), 10*10 (100), half (1/2 == 0.5); wrong: 15 != 14, no box (strict)
    assert summary["num_examples"] == 5
    assert summary["num_correct"] == 3
    assert summary["accuracy"] == pytest.approx(3 / 5)
    assert summary["mean_length"] == pytest.approx((9 + 6 + 12 + 10 + 5) / 5)
    # think block before the boxed answer: examples 0, 2, 3 (example 1 boxes before <think>)
    assert summary["format_rate"] == pytest.approx(3 / 5)
    assert summary["tokens_per_s"] > 0

    records = summary["records"]
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]  # input order kept
    assert [r["problem"] for r in records] == [ex["problem"] for ex in EXAMPLES]
    assert [r["correct"] for r in records] == [True, True, True, False, False]
    assert [r["extracted_answer"] for r in records] == ["4", "100", "\\frac{1}{2}", "15", ""]
    assert [r["num_tokens"] for r in records] == [9, 6, 12, 10, 5]

    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == records
    for record in records:
        assert set(record) == RECORD_KEYS
        assert isinstance(record["correct"], bool) and isinstance(record["num_tokens"], int)
        assert record["ground_truth"] == EXAMPLES[record["index"]]["answer"]


def test_batches_are_sorted_by_prompt_length(fake_generate):
    evaluate(FakeModel(), ByteTokenizer(), EXAMPLES, "cpu", max_new_tokens=16, batch_size=2,
             progress=False)
    assert [len(c) for c in fake_generate] == [2, 2, 1]
    lengths = [len(p) for call in fake_generate for p in call]
    assert lengths == sorted(lengths, reverse=True)
    assert fake_generate[0][0] == render_prompt(EXAMPLES[1]["problem"])  # the longest first


def test_prompt_fn_and_empty_input(fake_generate):
    evaluate(FakeModel(), ByteTokenizer(), EXAMPLES[:1], "cpu", max_new_tokens=16,
             prompt_fn=render_prompt_with_think_tokens, progress=False)
    assert fake_generate[0] == [render_prompt_with_think_tokens(EXAMPLES[0]["problem"])]
    summary = evaluate(FakeModel(), ByteTokenizer(), [], "cpu", progress=False)
    assert summary["num_examples"] == 0 and summary["accuracy"] == 0.0
    with pytest.raises(ValueError, match=r"examples\[0\]"):
        evaluate(FakeModel(), ByteTokenizer(), [{"question": "x"}], "cpu", progress=False)


def _record(problem, text, correct, level=None):
    return {"problem": problem, "generated_text": text, "correct": correct, "level": level}


def test_reasoning_stats_hand_built():
    p = "Compute ((17+25)*3)-8"  # 17+25=42, 42*3=126, 126-8=118
    records = [
        # think, correct, every step right
        _record(p, "<think>\nStep 1: 17+25=42\nStep 2: 42*3=126\nStep 3: 126-8=118\n"
                   "</think>\n\\boxed{118}", True, 3),
        # think, correct answer but step 2 wrong (and step 3 not continuing from it): lucky
        _record(p, "<think>\nStep 1: 17+25=42\nStep 2: 42*3=127\nStep 3: 126-8=118\n"
                   "</think>\n\\boxed{118}", True, 3),
        # think, wrong: a forgotten carry in step 1, later steps continue correctly (2 of 3)
        _record(p, "<think>\nStep 1: 17+25=32\nStep 2: 32*3=96\nStep 3: 96-8=88\n"
                   "</think>\n\\boxed{88}", False, 3),
        # think, skipped the last step: 2 right of 3 required
        _record(p, "<think>\nStep 1: 17+25=42\nStep 2: 42*3=126\n</think>\n\\boxed{126}",
                False, 3),
        # not think format: ignored by the think figures, counted per level
        _record("Compute 2+3", "\nStep 1: 2+3=5\nThe answer is 5.", False, 1),
        # a problem without a step verifier (MATH): counts for think accuracy only
        _record("What is $x$?", "<think>x</think>\\boxed{2}", True, None),
    ]
    stats = evaluation.reasoning_stats(records)
    assert stats["think_accuracy"] == pytest.approx(3 / 5)
    # steps right: 3 + 1 (step 3 does not continue from the written 127) + 2 + 2, of 4 x 3
    assert stats["step_correctness"] == pytest.approx(8 / 12)
    assert stats["right_answer_wrong_step"] == pytest.approx(1 / 2)
    assert evaluation.per_level_accuracy(records) == {1: 0.0, 3: 0.5}
    levels = evaluation.per_level_reasoning(records)
    assert sorted(levels) == [1, 3]
    assert levels[3]["think_rate"] == 1.0 and levels[3]["think_answers"] == 4
    assert levels[3]["think_steps"] == 12 and levels[1]["think_steps"] == 0
    assert levels[3]["step_correctness"] == pytest.approx(8 / 12)
    assert levels[3]["think_accuracy"] == pytest.approx(2 / 4)
    # level 1's only answer is not in the think format: no think figures
    assert levels[1]["think_rate"] == 0.0 and levels[1]["step_correctness"] is None
    assert evaluation.step_verdicts("What is $x$?", "Step 1: 1+1=2") is None
    # three-digit steps with a carry to forget: only 126-8 (a units borrow) of the first record;
    # 42*3 has no carry, the second record's 126-8 does not continue from its written 127
    assert stats["carry_step_correctness"] == 1.0
    empty = evaluation.reasoning_stats([_record(p, "\\boxed{118}", True)])
    assert empty == {"think_accuracy": None, "step_correctness": None,
                     "right_answer_wrong_step": None, "carry_step_correctness": None}


def test_carry_step_correctness_hand_built():
    p = "Compute (158+69)-8"  # 158+69=227 (units carry; the slip writes 217), 227-8=219
    right = "<think>\nStep 1: 158+69=227\nStep 2: 227-8=219\n</think>\n\\boxed{219}"
    slipped = "<think>\nStep 1: 158+69=217\nStep 2: 217-8=209\n</think>\n\\boxed{209}"
    other = "<think>\nStep 1: 158+69=237\nStep 2: 237-8=229\n</think>\n\\boxed{229}"
    # 227-8: a borrow (7 < 8) on a three-digit step: forgetting it gives 229
    assert classify_carry_steps(p, ["158+69=227", "227-8=219"]) == ["correct", "correct"]
    assert classify_carry_steps(p, ["158+69=217", "217-8=209"]) == ["slip", "correct"]
    assert classify_carry_steps(p, ["158+69=237", "237-8=239"]) == ["other", "slip"]
    records = [_record(p, right, True), _record(p, slipped, False), _record(p, other, False)]
    assert evaluation.reasoning_stats(records)["carry_step_correctness"] == pytest.approx(4 / 6)


def test_has_think_format():
    assert has_think_format("<think>a</think>\\boxed{1}")
    assert has_think_format("<think>a</think> no answer")
    assert not has_think_format("</think><think> wrong order")
    assert not has_think_format("\\boxed{1}<think>a</think>")
    assert not has_think_format("<think> never closed \\boxed{1}")


def test_tiny_model_end_to_end_matches_single_prompt_generation(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = Qwen3Model(cfg).eval()
    tok = ByteTokenizer()
    examples = EXAMPLES[:3]
    summary = evaluate(model, tok, examples, "cpu", max_new_tokens=6, batch_size=1,
                       jsonl_path=tmp_path / "tiny.jsonl", progress=False)
    for ex, record in zip(examples, summary["records"]):
        texts, _, mask = generate_batch(model, tok, [render_prompt(ex["problem"])], "cpu",
                                        max_new_tokens=6)
        assert record["generated_text"] == texts[0]
        assert record["num_tokens"] == int(mask.sum())
        assert record["correct"] is False  # a random model does not box the right answer
    assert len((tmp_path / "tiny.jsonl").read_text().splitlines()) == 3
    assert summary["accuracy"] == 0.0


def test_ch03_evaluate_script_offline(tmp_path):
    """The chapter script end to end on a saved random tiny model and the arithmetic set."""
    import runpy
    from pathlib import Path

    from reasoning_from_scratch.arithmetic import make_split
    from reasoning_from_scratch.tiny_world import train_bpe_tokenizer
    from reasoning_from_scratch.weights import save_pretrained

    texts = [render_prompt(ex["problem"]) + " \\boxed{" + ex["answer"] + "}"
             for ex in make_split("train", 50)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300, out_dir=tmp_path / "tok")
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    save_pretrained(Qwen3Model(cfg).eval(), tokenizer, tmp_path / "model")

    script = Path(__file__).resolve().parents[1] / "chapters" / "ch03_evaluate.py"
    main = runpy.run_path(str(script), run_name="ch03_evaluate")["main"]
    out = tmp_path / "arith.jsonl"
    summary = main(["--model", str(tmp_path / "model"), "--dataset", "arith", "--split", "test",
                    "--limit", "3", "--batch-size", "2", "--max-new-tokens", "4",
                    "--device", "cpu", "--output", str(out), "--no-progress"])
    assert summary["num_examples"] == 3
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert all(set(r) == RECORD_KEYS for r in records)


def test_problem_outcomes_hand_made_records():
    think_ok = " <think>\nStep 1: 2+3=5\nStep 2: 5*4=20\n</think>\n\\boxed{20}"
    think_slip = " <think>\nStep 1: 2+3=6\n</think>\n\\boxed{20}"  # one wrong, one missing
    records = [
        {"problem": "Compute (2+3)*4", "generated_text": think_ok, "correct": True},
        {"problem": "Compute (2+3)*4", "generated_text": think_slip, "correct": True},
        {"problem": "Compute (2+3)*4", "generated_text": "\\boxed{19}", "correct": False},
        {"problem": "What is the capital of France?", "generated_text": " <think>\nParis\n"
         "</think>\n\\boxed{Paris}", "correct": True},  # no step verifier for it
    ]
    out = evaluation.problem_outcomes(records)
    assert out == {"correct": [1, 1, 0, 1], "steps_good": [2, 0, 0, 0],
                   "steps_total": [2, 2, 0, 0]}
