"""Tests for reasoning_from_scratch.tokenizer on a tiny hand-built byte-level BPE tokenizer."""

import json

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from reasoning_from_scratch.tokenizer import (
    END_THINK_TOKEN_ID,
    QWEN3_CHAT_TEMPLATE,
    THINK_TOKEN_ID,
    Qwen3Tokenizer,
)

# The pre-tokenizer split pattern of the real Qwen2/Qwen3 tokenizer.json.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NOT_SPECIAL = ["<think>", "</think>"]  # Qwen3 marks these "special": false


def build_tokenizer_json(path):
    """Write a Qwen3-shaped tokenizer.json: 256 byte tokens, 3 merges, 5 added tokens.

    The merges h+e, he+l, Ġ+w make tokenization hand-predictable: "hello" -> "hel" "l" "o".
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("h", "e"), ("he", "l"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in NOT_SPECIAL])
    tok.save(str(path))
    return path


@pytest.fixture
def tok_dir(tmp_path):
    build_tokenizer_json(tmp_path / "tokenizer.json")
    return tmp_path


@pytest.fixture
def tok(tok_dir):
    return Qwen3Tokenizer.from_pretrained(tok_dir)


def write_json(path, obj):
    path.write_text(json.dumps(obj), encoding="utf-8")


def test_special_tokens_looked_up_by_string(tok):
    assert (THINK_TOKEN_ID, END_THINK_TOKEN_ID) == (151667, 151668)
    base = 256 + 3  # bytes + merges, then the added tokens in order
    assert tok.endoftext_token_id == base
    assert tok.im_start_token_id == base + 1
    assert tok.im_end_token_id == base + 2
    assert tok.think_token_id == base + 3
    assert tok.end_think_token_id == base + 4
    assert tok.vocab_size == base + 5
    assert tok.encode("<think>x</think>") == [base + 3, tok.token_to_id("x"), base + 4]
    with pytest.raises(KeyError, match="not in the vocabulary"):
        tok.token_to_id("<nope>")


def test_encode_hand_computed_and_roundtrip(tok):
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["hel", "l", "o", "Ġw", "o", "r", "l", "d"]
    for text in ["hello world", "héllo wörld 漢字 🙂!\n\n  x", "a<|im_end|>b"]:
        assert tok.decode(tok.encode(text)) == text


def test_decode_keeps_or_skips_special_tokens(tok):
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>hey<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # <think> is a normal added token in Qwen3 ("special": false), so skipping keeps it.
    assert (
        tok.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n<think>\nok</think>hey"
    )


def test_decode_accepts_tensor(tok):
    torch = pytest.importorskip("torch")
    assert tok.decode(torch.tensor(tok.encode("hello"))) == "hello"


def test_offsets_hand_computed_non_ascii(tok):
    text = "hello wörld 🙂"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    tokens = [tok.id_to_token(i) for i in ids]
    # ö is 2 UTF-8 bytes and 🙂 is 4: each byte token reports the span of its whole character.
    assert tokens == ["hel", "l", "o", "Ġw", "Ã", "¶", "r", "l", "d", "Ġ", "ð", "Ł", "Ļ", "Ĥ"]
    assert offsets == [
        (0, 3), (3, 4), (4, 5), (5, 7), (7, 8), (7, 8), (8, 9), (9, 10), (10, 11), (11, 12),
        (12, 13), (12, 13), (12, 13), (12, 13),
    ]  # fmt: skip
    assert text[12:13] == "🙂"


def test_offsets_special_tokens_and_nfc_gap(tok):
    text = "<think>\nhe</think>"
    ids, offsets = tok.encode_with_offsets(text)
    assert offsets == [(0, 7), (7, 8), (8, 10), (10, 18)]
    # NFC composes e + U+0301 into é; the combining mark (index 4) joins the é token's span.
    text = "cafe\u0301!"
    ids, offsets = tok.encode_with_offsets(text)
    assert [tok.id_to_token(i) for i in ids] == ["c", "a", "f", "Ã", "©", "!"]
    assert offsets == [(0, 1), (1, 2), (2, 3), (3, 5), (3, 5), (5, 6)]
    assert tok.encode_with_offsets("e\u0301")[1] == [(0, 2), (0, 2)]


def test_offsets_cover_text(tok):
    text = "Step 1: 17+25=42\nStep 2: 漢字 héllo\n</think>\n\\boxed{42}"
    ids, offsets = tok.encode_with_offsets(text)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    for (s0, e0), (s1, _) in zip(offsets, offsets[1:]):
        assert s0 <= s1 and (e0 == s1 or (s0, e0) == (s1, _))
    for i, (s, e) in zip(ids, offsets):
        if text[s:e].isascii():  # whole-character tokens decode to exactly their span
            assert tok.decode([i]) == text[s:e]


def test_chat_template_matches_qwen3(tok):
    q = "Give me a short introduction to large language models."
    on = f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(q) == on
    assert tok.apply_chat_template([{"role": "user", "content": q}]) == on
    assert tok.apply_chat_template(q, enable_thinking=False) == on + "<think>\n\n</think>\n\n"
    assert (
        tok.apply_chat_template(q, add_generation_prompt=False)
        == on[: -len("<|im_start|>assistant\n")]
    )
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
        {"role": "user", "content": "u2"},
    ]
    # Reasoning of turns before the last user query is dropped, as in the Qwen3 template.
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nu2<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="role 'tool'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_jinja_template_equals_python_rendering(tok):
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The environment transformers uses for chat templates.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(QWEN3_CHAT_TEMPLATE)
    cases = [
        [{"role": "user", "content": "What is 2+3?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi\n"}],
        [
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
        ],
        [
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "\n\na1"},
        ],
    ]
    for msgs in cases:
        for gen in (True, False):
            for think in (True, False):
                expected = tok.apply_chat_template(msgs, gen, think)
                got = template.render(
                    messages=msgs, add_generation_prompt=gen, enable_thinking=think
                )
                assert got == expected, (msgs, gen, think)
    assert jinja2 is not None


def test_eos_from_generation_config_list(tok_dir, tok):
    write_json(tok_dir / "generation_config.json", {"eos_token_id": [tok.im_end_token_id, 0]})
    write_json(tok_dir / "config.json", {"eos_token_id": 5})
    write_json(tok_dir / "tokenizer_config.json", {"eos_token": "<|endoftext|>"})
    t = Qwen3Tokenizer.from_pretrained(tok_dir)
    assert t.eos_token_id == tok.im_end_token_id
    assert t.eos_token_ids == [tok.im_end_token_id, 0]
    assert t.eos_source == "generation_config.json"


def test_eos_fallbacks_and_pad(tok_dir, tok):
    assert tok.eos_token_id is None and tok.eos_token_ids == []  # no config file: not guessed
    assert tok.pad_token_id == tok.endoftext_token_id
    write_json(tok_dir / "config.json", {"eos_token_id": tok.im_end_token_id})
    assert Qwen3Tokenizer.from_pretrained(tok_dir).eos_token_id == tok.im_end_token_id
    (tok_dir / "config.json").unlink()
    write_json(
        tok_dir / "tokenizer_config.json",
        {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|im_start|>"},
    )
    t = Qwen3Tokenizer.from_pretrained(tok_dir)
    assert (t.eos_token_id, t.eos_source) == (tok.im_end_token_id, "tokenizer_config.json")
    assert t.pad_token_id == tok.im_start_token_id


def test_save_roundtrip_and_config(tok_dir, tmp_path):
    write_json(tok_dir / "generation_config.json", {"eos_token_id": 261})
    t = Qwen3Tokenizer.from_pretrained(tok_dir)
    out = tmp_path / "saved"
    t.save(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "Qwen2Tokenizer"
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert cfg["chat_template"] == QWEN3_CHAT_TEMPLATE
    assert cfg["added_tokens_decoder"]["262"] == {
        "content": "<think>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": False,
    }  # fmt: skip
    assert cfg["added_tokens_decoder"]["259"]["special"] is True
    assert isinstance(cfg["model_max_length"], int)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    t2 = Qwen3Tokenizer.from_pretrained(out)
    text = "<|im_start|>héllo 🙂<think>"
    assert t2.encode(text) == t.encode(text)
    assert t2.eos_token_id == 261  # from tokenizer_config eos_token now
    assert t2.apply_chat_template("q", enable_thinking=False) == t.apply_chat_template(
        "q", enable_thinking=False
    )


def test_missing_and_bad_files_name_the_path(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nothing" / "tokenizer.json")):
        Qwen3Tokenizer.from_pretrained(tmp_path / "nothing")
    (tok_dir / "generation_config.json").write_text('{\n"eos_token_id": ,\n}')
    with pytest.raises(ValueError, match=r"generation_config.json, line 2"):
        Qwen3Tokenizer.from_pretrained(tok_dir)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(ValueError, match="bad.json: not a valid tokenizer.json"):
        Qwen3Tokenizer(bad)
