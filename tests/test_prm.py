"""Tests for prm.py: step encoding, BCE training above chance, save/load, datasets, the scorer."""

import os
import random
import signal

import pytest
import torch

from reasoning_from_scratch.arithmetic import format_solution, make_split
from reasoning_from_scratch.interrupts import StopSignal
from reasoning_from_scratch.prm import (
    PRMStepScorer,
    ProcessRewardModel,
    encode_steps,
    evaluate_prm,
    load_prm,
    make_prm_dataset_from_verifier,
    prm_loss,
    save_prm,
    train_prm,
)
from reasoning_from_scratch.process import split_steps, step_texts
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.step_scorers import VerifierStepScorer


@pytest.fixture(scope="module")
def tokenizer():
    from reasoning_from_scratch.tiny_world import train_bpe_tokenizer

    exs = make_split("train", 40, seed=0)
    texts = [render_prompt(e["problem"]) + format_solution(e) + "<|endoftext|>" for e in exs]
    return train_bpe_tokenizer(texts, vocab_size=300)


def _prm(tokenizer, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16)
    return ProcessRewardModel(cfg)


def _records(n, seed=0):
    """Reference solutions, half of them with one corrupted step; verifier labels."""
    rng = random.Random(seed)
    recs = []
    for ex in make_split("train", n, seed=seed, min_ops=2):
        text = format_solution(ex)
        if rng.random() < 0.5:
            k = rng.randrange(len(ex["steps"]))
            lhs, rhs = ex["steps"][k].split("=")
            text = text.replace(ex["steps"][k], f"{lhs}={int(rhs) + rng.choice([-2, -1, 1, 3])}")
        steps = step_texts(text, split_steps(text))
        labels = [x == 1.0 for x in VerifierStepScorer().score("", steps, ex)]
        # The bare problem as prompt keeps sequences short (fast); the format is the same.
        recs.append({"prompt": ex["problem"] + "\nAnswer:", "completions": steps,
                     "labels": labels})
    return recs


def test_encode_steps_reads_each_steps_last_token(tokenizer):
    prompt = render_prompt("Compute (15*6)-17")
    steps = [" <think>\nStep 1: 15*6=90\n", "Step 2: 90-17=73\n", "</think>\n\\boxed{73}"]
    ids, ends = encode_steps(tokenizer, prompt, steps)
    assert ids == tokenizer.encode(prompt + "".join(steps))
    n_prompt = len(tokenizer.encode(prompt))
    sizes = [len(tokenizer.encode(s)) for s in steps]
    assert ends == [n_prompt + sum(sizes[: j + 1]) - 1 for j in range(3)]
    assert tokenizer.decode(ids[ends[0]: ends[0] + 1]) == "\n"
    # An empty step is read where the previous one ends.
    _, ends2 = encode_steps(tokenizer, prompt, [steps[0], "", steps[1]])
    assert ends2 == [ends[0], ends[0], ends[1]]


def test_prm_forward_shapes_and_bad_records(tokenizer):
    prm = _prm(tokenizer)
    logits = prm(torch.tensor([tokenizer.encode("Step 1: 2+2=4")]))
    assert logits.shape == (1, len(tokenizer.encode("Step 1: 2+2=4")))
    assert logits.dtype == torch.float32
    with pytest.raises(ValueError, match="record 0: 2 steps but 1 labels"):
        train_prm(prm, tokenizer, [{"prompt": "p", "completions": ["a", "b"], "labels": [True]}])
    with pytest.raises(ValueError, match="missing key 'labels'"):
        evaluate_prm(prm, tokenizer, [{"prompt": "p", "completions": ["a"]}])


def test_prm_trains_above_chance_on_a_tiny_set(tokenizer):
    torch.manual_seed(0)
    records = _records(24)
    prm = _prm(tokenizer)
    before = prm_loss(prm, tokenizer, records).item()
    losses = train_prm(prm, tokenizer, records, epochs=6, lr=3e-3, batch_size=8)
    after = prm_loss(prm, tokenizer, records).item()
    metrics = evaluate_prm(prm, tokenizer, records)
    assert after < before * 0.8, (before, after)
    assert losses and all(map(lambda x: x == x, losses))
    assert metrics["accuracy"] > metrics["majority_accuracy"] + 0.05, metrics
    assert metrics["balanced_accuracy"] > 0.6, metrics


def test_save_load_roundtrip_and_scorer(tokenizer, tmp_path):
    prm = _prm(tokenizer, seed=1)
    with torch.no_grad():
        prm.score_head.bias.fill_(0.3)
    save_prm(prm, tokenizer, tmp_path / "prm")
    assert (tmp_path / "prm" / "prm_head.safetensors").is_file()
    assert (tmp_path / "prm" / "model.safetensors").is_file()
    loaded, tok2 = load_prm(tmp_path / "prm", device="cpu", dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(render_prompt("Compute 2+3") + " <think>\nStep 1: 2+3=5")])
    torch.testing.assert_close(loaded(ids), prm.eval()(ids))
    scorer = PRMStepScorer(loaded, tok2)
    steps = [" <think>\nStep 1: 2+3=5\n", "</think>\n\\boxed{5}"]
    scores = scorer.score_group("P", [steps, steps[:1]], {})
    assert [len(s) for s in scores] == [2, 1]
    assert all(0.0 < x < 1.0 for s in scores for x in s)
    assert scores[0][0] == pytest.approx(scores[1][0], abs=1e-6)  # causal: later steps don't leak
    # its reads are counted as forward tokens: prompt + steps of each completion, once
    read = sum(len(encode_steps(tok2, "P", s)[0]) for s in (steps, steps[:1]))
    assert scorer.cost() == {"forward_tokens": read}
    with pytest.raises(FileNotFoundError, match="save_prm"):
        load_prm(tmp_path)


def test_make_prm_dataset_from_verifier_format(tokenizer):
    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size)).eval()
    exs = make_split("train", 2, seed=3)
    recs = make_prm_dataset_from_verifier(model, tokenizer, exs, num_samples=2, max_new_tokens=6,
                                          generator=torch.Generator().manual_seed(0))
    assert 1 <= len(recs) <= 4
    for r in recs:
        assert set(r) >= {"prompt", "completions", "labels"}
        assert len(r["completions"]) == len(r["labels"]) >= 1
        assert all(isinstance(x, bool) for x in r["labels"])
        assert r["prompt"] == render_prompt(r["problem"])


def _load_chapter(name):
    """Import a chapters/ script as a module (chapters/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "chapters" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ch08_train_prm_script_smoke(tokenizer, tmp_path):
    from reasoning_from_scratch.weights import save_pretrained

    torch.manual_seed(0)
    save_pretrained(Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=1)),
                    tokenizer, tmp_path / "policy")
    script = _load_chapter("ch08_train_prm")
    threads = torch.get_num_threads()
    try:
        report = script.main(["--model", str(tmp_path / "policy"), "--train-problems", "3",
                              "--eval-problems", "2", "--samples", "2", "--max-new-tokens", "6",
                              "--epochs", "1", "--device", "cpu", "--output-dir",
                              str(tmp_path / "prm")])
    finally:
        torch.set_num_threads(threads)  # the script sets 1 thread for itself
    assert report["held_out"]["n_steps"] >= 2
    assert report["settings"]["labels"] == "verifier" and report["sampled_tokens"] > 0
    assert (tmp_path / "prm" / "prm_report.json").is_file()
    prm, _ = load_prm(tmp_path / "prm", device="cpu")
    assert isinstance(prm, ProcessRewardModel)


def test_ch08_train_prm_refuses_reuse_and_keeps_an_interrupted_prm(tokenizer, tmp_path,
                                                                   monkeypatch, capsys):
    """A second run into the same --output-dir is refused; a stop signal (SIGTERM, handled as
    Ctrl-C) mid-training saves a PRM."""
    from reasoning_from_scratch import prm as prm_module
    from reasoning_from_scratch.weights import save_pretrained

    torch.manual_seed(0)
    save_pretrained(Qwen3Model(tiny_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=1)),
                    tokenizer, tmp_path / "policy")
    script = _load_chapter("ch08_train_prm")
    flags = ["--model", str(tmp_path / "policy"), "--train-problems", "2", "--eval-problems", "2",
             "--samples", "1", "--max-new-tokens", "6", "--epochs", "1", "--device", "cpu",
             "--threads", "0", "--output-dir", str(tmp_path / "prm")]
    real, calls = prm_module.train_prm, []

    def interrupted(prm, *args, **kwargs):
        calls.append(1)
        with torch.no_grad():
            prm.score_head.weight.add_(1.0)  # "trained" a little, then the scheduler stops it
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(prm_module, "train_prm", interrupted)
    with pytest.raises(StopSignal):
        script.main(flags)
    saved, _ = load_prm(tmp_path / "prm" / "interrupted", device="cpu")
    assert calls and isinstance(saved, ProcessRewardModel)
    monkeypatch.setattr(prm_module, "train_prm", real)
    script.main(flags)  # the finished PRM goes into --output-dir itself
    with pytest.raises(SystemExit) as exc:
        script.main(flags)
    assert exc.value.code == 2 and "--overwrite" in capsys.readouterr().err
