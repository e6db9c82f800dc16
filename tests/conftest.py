"""Shared fixtures: a tiny random Qwen3 in Hugging Face layout and a reward with signal for it."""

import signal

import pytest
import torch

from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.rewards import CompositeReward, RewardTerm
from reasoning_from_scratch.tiny_world import build_corpus, document_text, train_bpe_tokenizer
from reasoning_from_scratch.weights import save_pretrained


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Every test sees SIGINT raise KeyboardInterrupt, as in a terminal: a shell starts background
    jobs (`pytest &`) with SIGINT ignored, and the Ctrl-C tests would then wait for nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random-init tiny Qwen3 with a small byte-level BPE tokenizer, saved in HF layout."""
    out = tmp_path_factory.mktemp("tiny")
    tok = train_bpe_tokenizer((document_text(d) for d in build_corpus(100, seed=0)),
                              vocab_size=300, out_dir=out / "tok")
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    save_pretrained(Qwen3Model(cfg), tok, out / "model")
    return out / "model"


def frac_even(text, ids, prompt_len, example):
    """The fraction of even generated token ids: a reward with signal even for a random model."""
    gen = ids[prompt_len:]
    return float((gen % 2 == 0).float().mean()) if gen.numel() else 0.0


@pytest.fixture(scope="session")
def even_reward():
    """A CompositeReward of `frac_even` named "correct"."""
    return CompositeReward([RewardTerm("correct", frac_even)])
