"""The book's API on this package: config/model/cache/tokenizer protocols, the book's .pth
checkpoints (both directions, and a malicious one refused), its download helpers (no network:
the fetch is replaced) and its chapter 2-7 functions, on tiny hand-built models."""

import ast
import hashlib
import importlib
import inspect
import json
import math
import os
import pickle
import re
import shutil

import matplotlib.pyplot as plt
import pytest
import requests
import sympy
import torch

import reasoning_from_scratch.book as book
import reasoning_from_scratch.downloads as downloads
import reasoning_from_scratch.grading as grading
import reasoning_from_scratch.plotting as plotting
import reasoning_from_scratch.search as search
from reasoning_from_scratch import (
    ch02,
    ch02_ex,
    ch03,
    ch04,
    ch05,
    ch06,
    ch07,
    ch08,
    ch09,
    qwen3,
    utils,
)
from reasoning_from_scratch.datasets import load_arith, load_math500_test, load_math_train
from reasoning_from_scratch.generation import generate
from reasoning_from_scratch.grpo import sequence_logprob_and_entropy
from reasoning_from_scratch.plotting import moving_average
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.qwen3 import (
    QWEN_CONFIG_06_B,
    KVCache,
    Qwen3Config,
    Qwen3Model,
    apply_rope,
    book_to_hf_state_dict,
    compute_rope_params,
    hf_to_book_state_dict,
    load_hf_weights_into_qwen,
    tiny_config,
)
from reasoning_from_scratch.tokenizer import Qwen3Tokenizer, render_chat
from reasoning_from_scratch.weights import (
    BUNDLED_MODELS,
    load_book_checkpoint,
    load_pretrained,
    read_book_checkpoint,
    save_book_checkpoint,
)

TINY_BOOK_CFG = {"vocab_size": 64, "context_length": 32, "emb_dim": 16, "n_heads": 4,
                 "n_layers": 2, "hidden_dim": 24, "head_dim": 8, "qk_norm": True,
                 "n_kv_groups": 2, "rope_base": 10_000.0, "dtype": torch.float32}


def _book_model(seed=0):
    torch.manual_seed(seed)
    return Qwen3Model(TINY_BOOK_CFG).eval()


def _greedy(model, ids, n, eos=None):
    out = generate(model, ids, max_new_tokens=n, eos_token_id=eos, preallocate=False)
    return out.completion_ids[0, : int(out.lengths[0])]


# ---------------------------------------------------------------- config, model, cache


def test_book_config_dict_round_trips_and_answers_the_book_keys():
    cfg = Qwen3Config.from_book_dict(TINY_BOOK_CFG)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (16, 2, 2)
    assert cfg.to_book_dict() == TINY_BOOK_CFG
    assert cfg["n_layers"] == 2 and cfg["emb_dim"] == 16 and cfg["dtype"] is torch.float32
    with pytest.raises(KeyError, match="n_blocks"):
        cfg["n_blocks"]
    with pytest.raises(ValueError, match="qk_norm"):
        Qwen3Config.from_book_dict({**TINY_BOOK_CFG, "qk_norm": False})
    # the published Qwen3-0.6B numbers, in the book's keys
    assert (QWEN_CONFIG_06_B["emb_dim"], QWEN_CONFIG_06_B["n_layers"],
            QWEN_CONFIG_06_B["n_kv_groups"], QWEN_CONFIG_06_B["hidden_dim"]) == (1024, 28, 8, 3072)
    assert QWEN_CONFIG_06_B["dtype"] is torch.bfloat16


def test_model_from_the_book_dict_is_untied_in_its_dtype():
    model = Qwen3Model({**TINY_BOOK_CFG, "dtype": torch.bfloat16})
    assert model.cfg["n_layers"] == 2 and model.dtype == torch.bfloat16
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.reset_kv_cache() is None


def test_a_model_from_the_book_dict_draws_its_weights_as_the_book_does():
    # the book's Qwen3Model draws torch's default inits module by module: embedding, then per
    # block query, key, value, output, gate, up, down, then the output head, in its dtype
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(7)
        model = Qwen3Model({**TINY_BOOK_CFG, "dtype": dtype})
        next_draw = torch.rand(3)
        torch.manual_seed(7)
        c, v, h, q, kv = 16, 64, 24, 4 * 8, 2 * 8
        emb = torch.nn.Embedding(v, c, dtype=dtype)
        blocks = [[torch.nn.Linear(i, o, bias=False, dtype=dtype)
                   for i, o in [(c, q), (c, kv), (c, kv), (q, c), (c, h), (c, h), (h, c)]]
                  for _ in range(2)]
        head = torch.nn.Linear(c, v, bias=False, dtype=dtype)
        assert torch.equal(torch.rand(3), next_draw)  # the same draws were used up
        assert torch.equal(model.model.embed_tokens.weight, emb.weight)
        for block, linears in zip(model.model.layers, blocks):
            a, f = block.self_attn, block.mlp
            ours = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj]
            assert all(torch.equal(x.weight, y.weight) for x, y in zip(ours, linears))
            assert torch.equal(block.input_layernorm.weight, torch.ones(c, dtype=dtype))
        assert torch.equal(model.lm_head.weight, head.weight)
    # a Qwen3Config keeps this package's normal(0, 0.02) init
    torch.manual_seed(7)
    std = Qwen3Model(Qwen3Config.from_book_dict(TINY_BOOK_CFG)).lm_head.weight.std().item()
    assert abs(std - 0.02) < 0.003  # 1,024 draws: the sd's sampling error is ~0.02 / sqrt(2048)


def test_the_books_kv_cache_protocol():
    cache = KVCache(n_layers=2)
    assert cache.n_layers == 2 and cache.get(0) is None
    k, v = torch.ones(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)
    assert cache.update(1, (k, v)) is None
    assert cache.get(1)[0] is k and cache.get_all()[0] is None
    cache.reset()
    assert cache.get_all() == [None, None] and len(cache) == 0
    with pytest.raises(TypeError, match="n_layers"):
        KVCache()


def test_the_books_sample_loop_runs_on_our_model():
    # The book's decoding loop, written as a reader would: one KVCache(n_layers=...), the
    # prompt once, then one token at a time. Same tokens as this package's generate().
    model = _book_model()
    ids = torch.tensor([[5, 9, 2, 7]])
    cache = KVCache(n_layers=model.cfg["n_layers"])
    model.reset_kv_cache()
    logits = model(ids, cache=cache)[:, -1]
    tokens = []
    for _ in range(6):
        nxt = torch.argmax(logits, dim=-1, keepdim=True)
        tokens.append(int(nxt))
        logits = model(nxt, cache=cache)[:, -1]
    assert tokens == _greedy(model, ids, 6).tolist()


def test_rope_table_offset_and_book_defaults():
    cos, sin = compute_rope_params(head_dim=8)  # the book's defaults: base 10,000, 4096 rows
    assert cos.shape == (4096, 8)
    ref_cos, ref_sin = compute_rope_params(8, 10_000.0, 4096)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    x = torch.randn(1, 2, 3, 8)
    torch.testing.assert_close(apply_rope(x, cos, sin, offset=5),
                               apply_rope(x, cos[5:8], sin[5:8]))


# ---------------------------------------------------------------- checkpoints


def test_book_pth_round_trips_with_equal_logits(tmp_path):
    model = _book_model(seed=1)
    path = save_book_checkpoint(model, tmp_path / "tiny.pth")
    state = read_book_checkpoint(path)
    assert "trf_blocks.1.att.W_query.weight" in state and "final_norm.scale" in state
    assert "trf_blocks.0.ff.fc1.weight" in state and "out_head.weight" in state
    block = model.model.layers[0]
    assert torch.equal(state["trf_blocks.0.ff.fc1.weight"], block.mlp.gate_proj.weight)
    assert torch.equal(state["trf_blocks.0.norm2.scale"], block.post_attention_layernorm.weight)
    loaded = load_book_checkpoint(path, model=_book_model(seed=2))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    # and back: book names -> HF names gives our state dict again
    back = book_to_hf_state_dict(state)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_tied_model_gets_its_own_out_head_and_unknown_names_are_named():
    torch.manual_seed(0)
    tied = Qwen3Model(tiny_config(vocab_size=40, num_hidden_layers=1))
    sd = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    book_sd = hf_to_book_state_dict(sd)
    assert torch.equal(book_sd["out_head.weight"], book_sd["tok_emb.weight"])
    with pytest.raises(KeyError, match="trf_blocks.0.att.W_qkv"):
        book_to_hf_state_dict({"trf_blocks.0.att.W_qkv.weight": torch.zeros(1)})


def test_load_hf_weights_into_qwen_ties_a_missing_lm_head():
    src = _book_model(seed=3)
    params = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}
    dst = _book_model(seed=4)
    load_hf_weights_into_qwen(dst, {"n_layers": 2, "hidden_dim": 24}, params)
    assert torch.equal(dst.lm_head.weight, src.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="n_layers=3"):
        load_hf_weights_into_qwen(dst, {"n_layers": 3}, params)


class _Payload:
    """Unpickling this object would create `marker` (a stand-in for any code)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


@pytest.mark.parametrize("fmt", ["torch.save", "plain pickle"])
def test_a_malicious_pth_is_refused_and_its_payload_never_runs(tmp_path, fmt):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.pth"
    state = {"tok_emb.weight": torch.zeros(2, 2), "x": _Payload(marker)}
    if fmt == "torch.save":
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps(state, protocol=2))
    with pytest.raises(ValueError, match="refused.*Nothing in it was run"):
        read_book_checkpoint(path)
    with pytest.raises(ValueError, match="refused"):
        load_book_checkpoint(path, model=_book_model())
    assert not marker.exists()


def test_read_book_checkpoint_names_missing_files_and_non_state_dicts(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth.*download_qwen3_small"):
        read_book_checkpoint(tmp_path / "nope.pth")
    torch.save([torch.zeros(1)], tmp_path / "list.pth")
    with pytest.raises(ValueError, match="not a state dict"):
        read_book_checkpoint(tmp_path / "list.pth")


# ---------------------------------------------------------------- tokenizer


@pytest.fixture()
def book_tokenizer_dir(tmp_path):
    src = BUNDLED_MODELS["tiny-arith"] / "tokenizer.json"
    for name in ("tokenizer-base.json", "tokenizer-reasoning.json"):
        shutil.copy(src, tmp_path / name)
    return tmp_path


def test_tokenizer_book_form(book_tokenizer_dir):
    base = Qwen3Tokenizer(tokenizer_file_path=book_tokenizer_dir / "tokenizer-base.json")
    assert base.eos_token == "<|endoftext|>" and base.pad_token == "<|endoftext|>"
    chat = Qwen3Tokenizer(tokenizer_file_path=book_tokenizer_dir / "tokenizer-reasoning.json",
                          apply_chat_template=True, add_generation_prompt=True,
                          add_thinking=False)
    assert chat.eos_token == "<|im_end|>"
    msg = [{"role": "user", "content": "1+2="}]
    expected = base.encode(render_chat(msg, add_generation_prompt=True, enable_thinking=False))
    ids = chat.encode("1+2=")
    assert ids == expected and chat.encode("1+2=", chat_wrapped=False) == base.encode("1+2=")
    assert chat.decode(ids).endswith("<think>\n\n</think>\n\n")


# ---------------------------------------------------------------- downloads (no network)


class _Response:
    """What `requests.get(url, stream=True, timeout=...)` returns, for bytes `body` (None: 404)."""

    def __init__(self, url, body):
        self.url, self.body, self.read = url, body, False
        self.headers = {} if body is None else {"Content-Length": str(len(body))}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def raise_for_status(self):
        if self.body is None:
            raise requests.HTTPError(f"404 Client Error: Not Found for url: {self.url}")

    def iter_content(self, chunk_size):
        self.read = True
        for i in range(0, len(self.body), chunk_size):
            yield self.body[i:i + chunk_size]


@pytest.fixture(autouse=True)
def server(monkeypatch):
    """`requests.get` for every test here: `files` {url: bytes} are served (None: a 404),
    `errors` {url: exception} are raised, any other URL is a connection error (no network in
    tests)."""
    class Server:
        files, errors, calls = {}, {}, []

    def get(url, **kwargs):
        Server.calls.append((url, kwargs))
        if url in Server.errors:
            raise Server.errors[url]
        if url not in Server.files:
            raise requests.ConnectionError(f"no network in tests: {url}")
        Server.responses.append(_Response(url, Server.files[url]))
        return Server.responses[-1]

    Server.files, Server.errors, Server.calls, Server.responses = {}, {}, [], []
    monkeypatch.setattr(requests, "get", get)
    return Server


def test_download_file_checks_the_size_of_a_file_that_is_there(tmp_path, server, capsys):
    url = "https://x.org/a.json"
    server.files[url] = b"1234"
    cached = tmp_path / "a.json"
    cached.write_bytes(b"abcd")  # same size as the server's: kept, the body is not read
    assert utils.download_file(url, out_dir=tmp_path) == cached
    assert cached.read_bytes() == b"abcd" and not server.responses[-1].read
    assert server.calls == [(url, {"stream": True, "timeout": 30})]
    cached.write_bytes(b"old")  # another size: downloaded again
    utils.download_file(url, out_dir=tmp_path)
    assert cached.read_bytes() == b"1234"
    del server.files[url]  # offline: the file that is there is used
    assert utils.download_file(url, out_dir=tmp_path) == cached
    assert "using the file that is there" in capsys.readouterr().out


def test_download_file_tries_the_backup_then_says_what_to_do(tmp_path, server):
    server.files["https://y.org/b.json"] = b"backup"
    path = utils.download_file("https://x.org/b.json", tmp_path, backup_url="https://y.org/b.json")
    assert path == tmp_path / "b.json" and path.read_bytes() == b"backup"
    assert [u for u, _ in server.calls] == ["https://x.org/b.json", "https://y.org/b.json"]
    with pytest.raises(RuntimeError) as info:
        utils.download_file("https://x.org/c.json", tmp_path, backup_url="https://y.org/c.json")
    message = str(info.value)
    assert "Primary URL failed (https://x.org/c.json): ConnectionError" in message
    assert "Backup URL failed (https://y.org/c.json)" in message
    assert f"curl -L -o {tmp_path / 'c.json'} https://x.org/c.json" in message
    assert downloads.TROUBLESHOOTING_URL in message and "VPN" not in message
    assert not (tmp_path / "c.json").exists()
    # a certificate error: the hint about VPNs and proxies that intercept HTTPS
    server.errors["https://x.org/d.pth"] = requests.exceptions.SSLError("CERTIFICATE_VERIFY_FAILED")
    with pytest.raises(RuntimeError, match="(?s)SSLError: CERTIFICATE_VERIFY_FAILED.*VPN, proxy"):
        utils.download_file("https://x.org/d.pth", tmp_path)


def test_fetch_url_is_atomic_and_checks_size_and_sha256(tmp_path, server):
    data = b"x" * (3 * downloads.CHUNK_BYTES // 2)  # two chunks
    server.files["https://x.org/f"] = data
    dest = tmp_path / "out" / "f"
    downloads.fetch_url("https://x.org/f", dest, sha256=hashlib.sha256(data).hexdigest(),
                        expected_size=len(data))
    assert dest.read_bytes() == data
    with pytest.raises(ValueError, match="sha256"):
        downloads.fetch_url("https://x.org/f", dest, sha256="0" * 64)
    with pytest.raises(ValueError, match="bytes"):
        downloads.fetch_url("https://x.org/f", dest, expected_size=1)
    server.files["https://x.org/missing"] = None  # the server answers 404
    with pytest.raises(requests.HTTPError, match="404"):
        downloads.fetch_url("https://x.org/missing", tmp_path / "m")
    assert dest.read_bytes() == data  # the failed downloads left it alone, and no temp files
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["f", "out"]


def test_every_download_is_one_requests_get(tmp_path, server, monkeypatch):
    # the datasets, the book's loaders and the book's Qwen3 files all reach the stub
    monkeypatch.setenv("RFS_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="math500"):
        load_math500_test(local_path=tmp_path / "none.json")
    with pytest.raises(RuntimeError, match="tokenizer-base.json"):
        qwen3.download_qwen3_small(tokenizer_only=True, out_dir=tmp_path)
    with pytest.raises(requests.ConnectionError):
        ch07.download_from_github("ch07/README.md", out=tmp_path / "r.md")
    urls = [u for u, _ in server.calls]
    assert urls[0].endswith("MATH-500/resolve/main/test.jsonl")
    assert urls[-3].endswith("tokenizer-base.json") and urls[-1].endswith("ch07/README.md")
    assert all(kw["stream"] and kw["timeout"] for _, kw in server.calls)  # never unbounded
    # a local file given to the book's loaders is read, not downloaded
    rows = [{"problem": "1+1", "answer": "2"}]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    server.calls.clear()
    assert ch06.load_math_train(local_path=tmp_path / "train.json") == rows
    assert server.calls == []
    # the book's modules have `requests` (their readers stub requests.get through them)
    assert ch03.requests is ch06.requests is ch07.requests is utils.requests is requests


def test_the_books_file_urls(monkeypatch):
    calls = []
    monkeypatch.setattr(qwen3, "download_file",  # where the book's readers patch it
                        lambda url, out_dir=".", backup_url=None: calls.append(
                            (url, out_dir, backup_url)) or "path")
    qwen3.download_qwen3_small(kind="reasoning", tokenizer_only=True, out_dir="d")
    assert calls[-1] == ("https://huggingface.co/rasbt/qwen3-from-scratch/resolve/main/"
                         "tokenizer-reasoning.json", "d",
                         "https://f001.backblazeb2.com/file/reasoning-from-scratch/qwen3-0.6B/"
                         "tokenizer-reasoning.json")
    assert qwen3.download_qwen3_grpo_checkpoints("no_kl", 50, "d") == "path"
    assert calls[-1][0].endswith("grpo_original_no_kl/qwen3-0.6B-rlvr-grpo-step00050.pth")
    assert calls[-1][2].endswith("grpo_original_no_kl/qwen3-0.6B-rlvr-grpo-step00050.pth")
    qwen3.download_qwen3_grpo_checkpoints("clip_ratio", "150", "d")
    assert calls[-1][0].endswith("7_4_plus_clip_ratio/checkpoints/"
                                 "qwen3-0.6B-rlvr-grpo-step00150.pth") and calls[-1][2] is None
    ch09.download_qwen3_distill_checkpoints("qwen3_235b_a22b", 5746, "d")
    assert calls[-1][0].endswith("ch08_distill_qwen3_235b_a22b/checkpoints/"
                                 "qwen3-0.6B-distill-step05746-epoch1.pth")
    with pytest.raises(ValueError, match="grpo_type"):
        qwen3.download_qwen3_grpo_checkpoints("ppo")
    with pytest.raises(ValueError, match="step"):
        qwen3.download_qwen3_distill_checkpoints("deepseek_r1", 1)
    with pytest.raises(ValueError, match="kind"):
        qwen3.download_qwen3_small(kind="chat")


def test_download_from_github(tmp_path, server, capsys):
    url = downloads.GITHUB_RAW + "ch07/README.md"
    server.files[url] = b"# Chapter 7"
    out = ch07.download_from_github("ch07/README.md", out=tmp_path / "r.md")
    assert [u for u, _ in server.calls] == [url] and out.read_bytes() == b"# Chapter 7"
    assert ch07.download_from_github("ch07/README.md", out=out) == out
    assert len(server.calls) == 1  # a file that is there: no request
    assert "KB" in capsys.readouterr().out


# ---------------------------------------------------------------- chapter 2 and 4 generation


class _FixedModel:
    """The book's stand-in model protocol: always prefers token `fixed`."""

    def __init__(self, fixed, vocab=6):
        self.fixed, self.vocab, self.cfg, self.calls = fixed, vocab, {"n_layers": 1}, []

    def eval(self):
        return self

    def reset_kv_cache(self):
        pass

    def __call__(self, ids, cache=None):
        self.calls.append(ids.shape[1])
        out = torch.zeros(ids.shape[0], ids.shape[1], self.vocab)
        out[..., self.fixed] = 1.0
        return out


def test_book_generators_equal_our_greedy_decoding():
    model = _book_model(seed=5)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ours = _greedy(model, ids, 7)
    assert ch02.generate_text_basic(model, ids, 7)[0].tolist() == ours.tolist()
    assert ch02.generate_text_basic_cache(model, ids, 7)[0].tolist() == ours.tolist()
    for stream in (ch02_ex.generate_text_basic_stream(model, ids, 7),
                   ch02_ex.generate_text_basic_stream_cache(model, ids, 7),
                   ch04.generate_text_temp_stream_cache(model, ids, 7, temperature=0.0),
                   # top_p=0 keeps only the most likely token: sampling is greedy
                   ch04.generate_text_top_p_stream_cache(model, ids, 7, temperature=1.0,
                                                         top_p=0.0)):
        assert [int(t) for t in stream] == ours.tolist()
    eos = int(ours[2])
    expected = ours[: ours.tolist().index(eos)].tolist()
    assert ch02.generate_text_basic_cache(model, ids, 7, eos_token_id=eos)[0].tolist() == expected


def test_streams_yield_as_they_go_and_the_cache_runs_one_token_per_step():
    model = _FixedModel(fixed=2)
    stream = ch02.generate_text_basic_stream_cache(model, torch.tensor([[0, 1, 3]]), 4)
    first = next(stream)
    assert first.shape == (1, 1) and int(first) == 2 and model.calls == [3]
    assert len(list(stream)) == 3 and model.calls == [3, 1, 1, 1]
    model = _FixedModel(fixed=2)
    out = ch02.generate_text_basic(model, torch.tensor([[0, 1]]), 5, eos_token_id=2)
    assert out.shape == (1, 0)
    assert model.calls == [2]


class _ScriptedModel:
    """The book's stand-in model for rollouts: a dict cfg, reset_kv_cache, no eval(); the k-th
    call prefers token script[k]."""

    def __init__(self, script, vocab=10):
        self.script, self.vocab, self.cfg, self.calls = script, vocab, {"n_layers": 1}, []

    def reset_kv_cache(self):
        self.calls.clear()

    def __call__(self, ids, cache=None):
        self.calls.append(ids.shape[1])
        out = torch.full((ids.shape[0], ids.shape[1], self.vocab), -1e9)
        out[..., self.script[len(self.calls) - 1]] = 0.0
        return out


class _Tok:
    eos_token_id = 0

    def encode(self, text):
        return [7, 8]

    def decode(self, ids):
        return "".join(f"<{int(i)}>" for i in ids)


def test_sample_response_is_the_books_rollout_with_the_eos_kept():
    model = _ScriptedModel([3, 4, 0, 5])
    ids, prompt_len, text = ch06.sample_response(model, _Tok(), "q", "cpu", max_new_tokens=9,
                                                 temperature=1.0, top_p=0.0)
    assert ids.tolist() == [7, 8, 3, 4, 0] and prompt_len == 2
    assert text == "<3><4><0>"  # the EOS is part of the text, as in the book
    assert model.calls == [2, 1, 1]  # the prompt once, then one token per step, none after EOS
    model = _ScriptedModel([3, 4, 0])
    ids, _, text = ch02.sample_response(model, _Tok(), "q", "cpu", max_new_tokens=2)
    assert ids.tolist() == [7, 8, 3, 4] and text == "<3><4>" and model.calls == [2, 1]


def test_sample_response_on_our_model_is_greedy_at_temperature_0(tiny):
    model, tok = tiny
    prompt = "12+7="
    ids, prompt_len, text = ch06.sample_response(model, tok, prompt, "cpu", 6, temperature=0.0)
    expected = _greedy(model, torch.tensor([tok.encode(prompt)]), 6, eos=tok.eos_token_id)
    assert ids[prompt_len:].tolist() == expected.tolist() and text == tok.decode(expected.tolist())


def test_a_book_function_replaced_on_its_index_reaches_its_callers(monkeypatch):
    original = book.generate_text_basic_stream_cache

    def fake(**kw):
        yield torch.tensor([1])
        yield torch.tensor([2])

    monkeypatch.setattr(ch03, "generate_text_basic_stream_cache", fake)
    assert book.generate_text_basic_stream_cache is fake and ch03.__name__.endswith("ch03")
    class Tok:
        eos_token_id = None

        def encode(self, text):
            return [5]

        def decode(self, ids):
            return "".join("AB"[i - 1] for i in ids)

    # the book's generate_text_stream_concat calls the replacement: no model is needed
    assert ch03.generate_text_stream_concat(None, Tok(), "p", "cpu", 2) == "AB"
    monkeypatch.undo()
    assert book.generate_text_basic_stream_cache is original
    assert ch03.generate_text_basic_stream_cache is original
    ch03.a_name_of_the_reader = 1  # other names stay the index's own
    assert not hasattr(book, "a_name_of_the_reader")
    del ch03.a_name_of_the_reader


def test_generate_stats_prints_speed(capsys):
    ch02.generate_stats(torch.zeros(1, 50), None, 10.0, 12.0)
    out = capsys.readouterr().out
    assert "Time: 2.00 sec" in out and "25 tokens/sec" in out


def test_scale_logits_and_heuristic_score():
    torch.testing.assert_close(ch04.scale_logits_by_temperature(torch.tensor([2.0, 4.0]), 2.0),
                               torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="temperature"):
        ch04.scale_logits_by_temperature(torch.tensor([1.0]), 0)
    # boxed: 2 + 1.5 * exp(-len/500); bare number: 1 + ...; no number: fulltext bonus only
    assert ch05.heuristic_score("\\boxed{7}") == pytest.approx(2 + 1.5 * math.exp(-9 / 500))
    assert ch05.heuristic_score("it is 7") == pytest.approx(1 + 1.5 * math.exp(-7 / 500))
    assert ch05.heuristic_score("none", brevity_bonus=4.0, fulltext_bonus=0.5) == pytest.approx(
        0.5 + 1.5 * math.exp(-1))


def test_avg_logprob_answer_needs_only_model_of_ids():
    class Tok:
        def encode(self, text):
            return {"p": [0, 1], "a": [2, 1]}[text]

    class Plain:  # the book's minimal model: logits (1, T, 3) from token ids only
        def __call__(self, ids):
            return torch.tensor([0.0, 1.0, 2.0]).repeat(1, ids.shape[1], 1)

    logp = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), dim=-1)
    expected = float(logp[2] + logp[1]) / 2
    assert ch05.avg_logprob_answer(Plain(), Tok(), "p", "a") == pytest.approx(expected)


def test_refinement_prompts_hold_their_parts():
    c = ch05.make_critique_prompt("Q?", "draft")
    assert "Question:\nQ?" in c and "Draft answer:\ndraft" in c and c.endswith("Critique:")
    r = ch05.make_refine_prompt("Q?", "draft", "fix it")
    assert "Previous answer:\ndraft" in r and "Critique:\nfix it" in r
    assert r.endswith("Revised answer:") and "\\boxed{ANSWER}" in r


def test_self_refinement_loop_is_the_books_and_keeps_revisions_that_do_not_score_worse(
        tiny, monkeypatch):
    model, tok = tiny
    texts = iter(["draft", "crit 1", "a longer draft", "crit 2", "short"])
    prompts = []

    def fake(**kw):  # the book's loop passes every argument by name
        prompts.append((kw["prompt"], kw["max_new_tokens"], kw["temperature"]))
        return next(texts)

    monkeypatch.setattr(ch05, "generate_text_stream_concat_flex", fake)  # as the book's readers
    out = ch05.self_refinement_loop(model, tok, raw_prompt="Q", device="cpu", iterations=2,
                                    max_response_tokens=9, max_critique_tokens=3,
                                    temperature=0.3, score_fn=lambda answer, prompt: len(answer),
                                    prompt_renderer=lambda q: f"<{q}>", prompt_suffix="!")
    assert [s["score_before"] for s in out["steps"]] == [5, 14]
    assert [s["score_after"] for s in out["steps"]] == [14, 5]
    assert out["final_full"] == "a longer draft" == out["steps"][1]["draft_full"]
    assert [p[1] for p in prompts] == [9, 3, 9, 3, 9] and prompts[0][0] == "<Q>!"
    assert "Critique:\ncrit 1" in prompts[2][0] and prompts[0][2] == 0.3
    # with the real generator on the tiny model: one draft, one critique, one revision
    monkeypatch.undo()
    real = ch05.self_refinement_loop(model, tok, "2+2", "cpu", iterations=1,
                                     max_response_tokens=3, max_critique_tokens=2)
    assert len(real["steps"]) == 1 and real["final_full"] == real["steps"][0]["revised_full"]
    # this package's refinement with a step critic keeps its own home and signature
    assert search.self_refinement_loop is not ch05.self_refinement_loop
    assert "critic" in inspect.signature(search.self_refinement_loop).parameters


# ---------------------------------------------------------------- chapter 3


@pytest.fixture()
def tiny():
    tok = Qwen3Tokenizer.from_pretrained(BUNDLED_MODELS["tiny-arith"])
    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tok.vocab_size, num_hidden_layers=1)).eval()
    return model, tok


def test_stream_concat_is_the_greedy_text(tiny, capsys):
    model, tok = tiny
    prompt = "12+7="
    ids = torch.tensor([tok.encode(prompt)])
    expected = tok.decode(_greedy(model, ids, 6, eos=tok.eos_token_id).tolist())
    if expected and tok.eos_token_id is not None:  # the greedy path may end on EOS
        expected = expected.removesuffix(tok.decode([tok.eos_token_id]))
    assert ch03.generate_text_stream_concat(model, tok, prompt, "cpu", 6, verbose=True) == expected
    assert capsys.readouterr().out == expected
    seen = []

    def gen(**kw):
        seen.append(kw)
        yield torch.tensor([[tok.encode("4")[0]]])

    assert ch04.generate_text_stream_concat_flex(model, tok, prompt, "cpu", 3, generate_func=gen,
                                                 temperature=0.5) == "4"
    assert seen[0]["temperature"] == 0.5 and seen[0]["eos_token_id"] == tok.eos_token_id


def test_evaluate_math500_stream_writes_a_record_per_problem(tiny, tmp_path, capsys):
    model, tok = tiny
    rows = [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": "4"}]
    out = tmp_path / "eval.jsonl"
    correct, n, acc = ch03.evaluate_math500_stream(model, tok, "cpu", rows, out, max_new_tokens=4)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 2 and [r["index"] for r in records] == [1, 2]
    assert correct == sum(r["correct"] for r in records) and acc == correct / 2
    for r, row in zip(records, rows):
        assert r["gtruth_answer"] == row["answer"]
        assert r["extracted"] == ch03.extract_final_candidate(r["generated_text"])
    assert "Accuracy:" in capsys.readouterr().out


def test_the_book_grader_parts():
    assert ch03.sympy_parser("2x + 3x") - 5 * ch03.sympy_parser("x") == 0
    assert ch03.sympy_parser("sqrt(") is None and ch03.sympy_parser(None) is None
    assert ch03.sympy_parser("1" * 2001) is None
    assert ch03.sympy_parser(r"\frac{3}{4}") == ch03.sympy_parser("3/4")  # LaTeX too
    # never evaluated as Python: a model's output could say anything
    assert ch03.sympy_parser("__import__('os').system('touch x')") is None
    assert ch03.equality_check("(1)/(2)", "0.5") and not ch03.equality_check("14/3", "5")
    assert not ch03.equality_check("(1, 2)", "(1, 2.0)")  # tuples: compare their parts
    assert ch03.split_into_parts("( 1 ,  2 )") == ["1", "2"]
    assert ch03.split_into_parts("(a, )") == ["(a, )"] and ch03.split_into_parts("") == []


def test_get_last_boxed_and_normalize_text_are_the_books():
    assert ch03.get_last_boxed(r"a \boxed{1} b \boxed  { {x}+1 } c") == " {x}+1 "
    assert ch03.get_last_boxed(r"\boxed 5") is None  # the book needs the brace
    assert ch03.get_last_boxed(r"\boxed x{y}") is None  # right after \boxed and spaces
    assert grading.get_last_boxed(r"\boxed 5") == "5"  # this package's grader reads it
    assert ch03.get_last_boxed(r"\boxed{2} \fbox{3}") == "2"  # the book reads \boxed only
    assert ch03.get_last_boxed(r"\boxed{cut") is None and ch03.get_last_boxed("none") is None
    book_form = {
        "  (1, 2)  ": "(1, 2)",  # spaces inside kept
        r"\dfrac{3}{4}": "(3)/(4)",
        r"\frac 1 2": "(1)/(2)",
        r"\sqrt{8}/2": "sqrt(8)/2",
        "x^2": "x**2",
        "2³": "2**3",
        "c. 7": "7",  # a multiple-choice label
        r"\text{Yes}": "yes",
        "2 1/2": "2+1/2",
        "12,345": "12345",
        r"90^\circ": "90",
        "$5\\%$": "5",
        "<|im_end|>{4}": "4",
    }
    assert {raw: ch03.normalize_text(raw) for raw in book_form} == book_form
    assert grading.normalize_text("  (1, 2)  ") == "(1,2)"  # this package's canonical form
    assert ch03.normalize_text("") == "" and ch03.normalize_text(None) == ""
    # the book's parser part reads the book's form; its comparison works on it
    assert ch03.sympy_parser("x**2") == ch03.sympy_parser("x^2") == sympy.Symbol("x") ** 2
    assert ch03.sympy_parser("13/4.") == sympy.Rational(13, 4)
    assert ch03.equality_check(ch03.normalize_text(r"\frac{13}{4}"), ch03.normalize_text("3.25"))
    assert not ch03.equality_check(ch03.normalize_text("2^3"), ch03.normalize_text("9"))


def test_the_books_call_forms_of_extraction_and_decoding(tiny):
    _, tok = tiny
    assert ch03.extract_final_candidate("so 42", fallback=None) == ""  # boxed required
    assert ch03.extract_final_candidate("so \\boxed{42}", fallback=None) == "42"
    ids = tok.encode("12+7")
    assert tok.decode(torch.tensor(ids[0]).tolist()) == tok.decode(ids[:1])  # one int


def test_run_demos_table_and_eta(capsys, monkeypatch):
    ch03.run_demos_table([("a", "1/2", "0.5", True), ("b", "1", "2", True)])
    out = capsys.readouterr().out
    assert "PASS" in out.splitlines()[1] and "FAIL" in out.splitlines()[2]
    assert "Passed 1/2" in out
    monkeypatch.setattr(book.time, "time", lambda: 100.0)
    msg = ch03.eta_progress_message(10, 40, start_time=80.0, show_eta=True, label="M")
    assert msg.startswith("M: 10/40 | ETA: 01m 00s")  # 2 s per item, 30 items left
    assert ch03.eta_progress_message(0, 40, 80.0).strip() == "M: 0/40".replace("M", "Progress")


def test_load_tokenizer_and_model_from_a_local_dir(book_tokenizer_dir, monkeypatch):
    tok = ch03.load_tokenizer_only("reasoning", local_dir=book_tokenizer_dir)  # no download
    assert tok.chat_wrap and tok.eos_token == "<|im_end|>"
    (book_tokenizer_dir / "qwen3-0.6B-base.pth").write_bytes(b"x")
    seen = []
    monkeypatch.setattr(book, "load_book_checkpoint", lambda p: seen.append(p) or _book_model())
    model, tok = ch03.load_model_and_tokenizer("base", "cpu", False, local_dir=book_tokenizer_dir)
    assert seen == [book_tokenizer_dir / "qwen3-0.6B-base.pth"] and not tok.chat_wrap
    with pytest.raises(ValueError, match="which_model"):
        ch03.load_tokenizer_only("chat")


def test_book_loaders_read_and_save_local_copies(tmp_path):
    rows = [{"problem": "1+1", "answer": "2", "level": "Level 1"}]
    local = tmp_path / "math500_test.json"
    local.write_text(json.dumps(rows))
    assert load_math500_test(local_path=local, save_copy=True) == rows
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "math_full_minus_math500.json").write_text(json.dumps(rows))
    copy = tmp_path / "math_train.json"
    assert ch06.load_math_train(cache_dir=cache, local_path=copy) == rows
    assert json.loads(copy.read_text()) == rows  # saved for next time
    assert load_math_train(local_path=copy) == rows


# ---------------------------------------------------------------- chapters 4, 6, 7


def test_self_consistency_vote_book_arguments(tiny, capsys):
    """The book's chapter 4 vote (`ch04.self_consistency_vote`, not this package's batched one)
    with the book's arguments on a model: sample i is the book's top-p stream after
    torch.manual_seed(seed + i + 1), one progress line each, the vote over the short answers;
    with top_p near 0 every sample is the greedy text and wins 3 votes of 3."""
    model, tok = tiny
    assert ch04.self_consistency_vote is book.self_consistency_vote
    kw = dict(num_samples=3, temperature=1.0, top_p=0.9, max_new_tokens=4)
    out = ch04.self_consistency_vote(model, tok, "3+4=", "cpu", **kw, show_progress=True,
                                     show_long_answer=False, seed=7)
    drawn = []
    for i in range(3):
        torch.manual_seed(7 + i + 1)
        drawn.append(ch04.generate_text_stream_concat_flex(
            model, tok, "3+4=", "cpu", 4, generate_func=ch04.generate_text_top_p_stream_cache,
            temperature=1.0, top_p=0.9))
    assert out["full_answers"] == drawn and len(set(drawn)) > 1  # seeded, one sample at a time
    printed = capsys.readouterr().out
    assert [f"[Sample {i}/3] -> {a!r}" in printed for i, a in enumerate(
        out["short_answers"], 1)] == [True] * 3
    assert sum(out["counts"].values()) == 3
    top = max(out["counts"].values())
    assert out["majority_winners"] == [a for a, c in out["counts"].items() if c == top]
    greedy = ch04.generate_text_stream_concat_flex(model, tok, "3+4=", "cpu", 4)
    same = ch04.self_consistency_vote(model, tok, "3+4=", "cpu", **{**kw, "top_p": 1e-9},
                                      show_progress=False, seed=7)
    assert same["full_answers"] == [greedy] * 3
    assert list(same["counts"].values()) == [3] and same["final_answer"] == same[
        "short_answers"][0] == same["majority_winners"][0]


def test_self_consistency_vote_is_the_books_one_sample_at_a_time(monkeypatch):
    texts = iter([r"\boxed{1/2}", "so it is 0.5", r"\boxed{3}", "2", "3"])
    calls = []

    def fake(**kw):  # the book's vote passes every argument by name
        calls.append({**kw, "draw": torch.rand(1).item()})
        return next(texts)

    monkeypatch.setattr(ch04, "generate_text_stream_concat_flex", fake)
    out = ch04.self_consistency_vote(None, _Tok(), "q", "cpu", num_samples=3, temperature=0.7,
                                     top_p=0.8, max_new_tokens=5, show_progress=False, seed=5)
    assert out["short_answers"] == ["1/2", "0.5", "3"]
    assert out["counts"] == {"1/2": 2, "3": 1}  # pooled by the grader: 1/2 and 0.5 agree
    assert out["final_answer"] == "1/2" and out["majority_winners"] == ["1/2"]
    assert out["full_answers"][1] == "so it is 0.5" and out["groups"]["1/2"] == [0, 1]
    assert calls[0]["generate_func"] is ch04.generate_text_top_p_stream_cache
    assert (calls[0]["temperature"], calls[0]["top_p"], calls[0]["max_new_tokens"]) == (0.7, 0.8, 5)
    for i, call in enumerate(calls):  # sample i is drawn after torch.manual_seed(seed + i + 1)
        torch.manual_seed(5 + i + 1)
        assert call["draw"] == torch.rand(1).item()
    tie = ch04.self_consistency_vote(None, _Tok(), "q", "cpu", num_samples=2, show_progress=False)
    assert tie["majority_winners"] == ["2", "3"] and tie["final_answer"] is None  # the book's


def test_compute_grpo_loss_is_the_books_chapter_6_loss(monkeypatch):
    rollouts = iter([(torch.tensor([1, 2, 3]), 2, "first"), (torch.tensor([1, 2, 4, 5]), 2, "b")])
    rewards, logps = iter([1.0, 0.0]), iter([torch.tensor(0.4), torch.tensor(0.2)])
    seen = []
    monkeypatch.setattr(ch06, "sample_response", lambda **kw: seen.append(kw) or next(rollouts))
    monkeypatch.setattr(ch06, "reward_rlvr", lambda text, answer: next(rewards))
    monkeypatch.setattr(ch06, "sequence_logprob", lambda model, ids, plen: next(logps))

    class Model:  # only the training-mode switches
        training = True

        def eval(self):
            self.training = False

        def train(self):
            self.training = True

    model = Model()
    out = ch06.compute_grpo_loss(model, _Tok(), {"problem": "1+1", "answer": "2"}, "cpu",
                                 num_rollouts=2, max_new_tokens=4, temperature=0.5, top_p=0.9)
    # advantages (r - mean) / (sd + 1e-4) with sd of [1, 0] = sqrt(1/2); loss -mean(A * logp)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert out["advantages"] == pytest.approx([a, -a], rel=1e-6)
    assert out["loss"] == out["pg_loss"] == pytest.approx(-(a * 0.4 - a * 0.2) / 2, rel=1e-6)
    assert out["rewards"] == [1.0, 0.0] and model.training
    assert [s["gen_len"] for s in out["samples"]] == [1, 2] and out["samples"][0]["text"] == "first"
    assert seen[0]["prompt"] == render_prompt("1+1") and seen[0]["temperature"] == 0.5
    with pytest.raises(ValueError, match="num_rollouts"):
        ch06.compute_grpo_loss(model, _Tok(), {"problem": "q", "answer": "a"}, "cpu", 1)


def test_compute_grpo_loss_backpropagates_through_the_rollouts(tiny, monkeypatch):
    model, tok = tiny
    model.train()
    rewards = iter([1.0, 0.0, 0.0])
    monkeypatch.setattr(ch06, "reward_rlvr", lambda text, answer: next(rewards))
    torch.manual_seed(0)
    out = ch06.compute_grpo_loss(model, tok, {"problem": "2+2", "answer": "4"}, "cpu", 3, 5, 1.0)
    assert model.training  # sampled in eval mode, given back in training mode
    out["loss_tensor"].backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(bool(g.abs().sum() > 0) for g in grads)
    assert out["loss"] == pytest.approx(out["loss_tensor"].item())


def test_plot_grpo_metrics_is_the_books_and_shows_the_figure(tmp_path, monkeypatch):
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("step,loss,reward_avg\n1,1.0,0.1\n2,0.5,0.3\n")
    shown = []
    monkeypatch.setattr(ch07.plt, "show", lambda: shown.append(True))
    fig = ch07.plot_grpo_metrics(csv_path, ["loss", "not_logged", "reward_avg"],
                                 save_as=tmp_path / "m.png")
    assert shown == [True] and (tmp_path / "m.png").stat().st_size > 0
    assert [ax.get_title() for ax in fig.axes] == ["loss", "reward_avg"]  # a missing one: skipped
    assert plt.fignum_exists(fig.number)  # a pyplot figure, so plt.show() shows it
    plt.close(fig)
    with pytest.raises(ValueError, match="not_logged"):  # this package's plot is strict
        plotting.plot_grpo_metrics(csv_path, ["not_logged"])


def test_the_books_chapter_8_names_point_to_chapter_9():
    with pytest.raises(ImportError, match=r"(?s)book's chapter 8.*ch09\.train_distillation"):
        from reasoning_from_scratch.ch08 import train_distillation  # noqa: F401
    assert set(ch08.BOOK_CHAPTER_8) >= {"load_distill_data", "build_examples"}
    for home in ch08.BOOK_CHAPTER_8.values():  # every pointer names a function that exists
        module, name = re.match(r"(\w+)\.(\w+)", home).groups()
        assert hasattr(importlib.import_module(f"reasoning_from_scratch.{module}"), name), home
    with pytest.raises(ImportError, match="cannot import name"):
        from reasoning_from_scratch.ch08 import no_such_name  # noqa: F401
    assert not hasattr(ch08, "no_such_name") and ch09.train_distillation


INDEXES = [ch02, ch02_ex, ch03, ch04, ch05, ch06, ch07, ch08, ch09]
# what an index holds besides its chapter's names: the book's modules' `requests` / `plt` (its
# readers stub them there), the BookIndex switch, ch08's pointers to the book's chapter 8
NOT_EXPORTED = {"requests", "plt", "sys", "BookIndex", "BOOK_CHAPTER_8"}


@pytest.mark.parametrize("index", INDEXES, ids=lambda m: m.__name__.split(".")[-1])
def test_an_index_exports_its_chapter_names_only(index):
    tree = ast.parse(inspect.getsource(index))
    imported = [a.asname or a.name for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.level for a in node.names]
    assert sorted(index.__all__) == sorted(set(imported) - {"BookIndex"})
    public = {n for n in vars(index) if not n.startswith("_")}
    assert public - set(index.__all__) <= NOT_EXPORTED


def test_a_name_in_several_indexes_is_one_function():
    homes = {}
    for index in INDEXES:
        for name in index.__all__:
            homes.setdefault(name, set()).add(id(getattr(index, name)))
    assert {name for name, ids in homes.items() if len(ids) > 1} == set()
    assert ch02.sample_response is ch06.sample_response is ch07.sample_response


def test_save_checkpoint_and_csv_metrics(tmp_path):
    model = _book_model()
    path = ch06.save_checkpoint(model, tmp_path, step=7, suffix="final")
    assert path.name == "qwen3-0.6B-rlvr-grpo-step00007-final.pth"
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(load_book_checkpoint(path, _book_model(seed=9))(ids), model(ids))
    log = tmp_path / "m.csv"
    ch06.append_csv_metrics(log, 1, 10, 0.5, 0.25, 12.0)
    ch06.append_csv_metrics(log, 2, 10, 0.25, 0.5, 10.0)
    assert log.read_text().splitlines() == ["step,total_steps,loss,reward_avg,avg_response_len",
                                            "1,10,0.500000,0.250000,12.000000",
                                            "2,10,0.250000,0.500000,10.000000"]


def test_train_rlvr_grpo_updates_logs_and_checkpoints(tmp_path, monkeypatch):
    model, tok = load_pretrained("tiny-arith", device="cpu", dtype=torch.float32)
    data = load_arith("test", n=2, seed=0, level_weights=[1, 0, 0, 0, 0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kw = dict(num_rollouts=4, max_new_tokens=8, temperature=1.0, top_p=1.0)
    # the tiny model never boxes its answer: every reward is 0, nothing to learn, no update
    torch.manual_seed(0)
    ch06.train_rlvr_grpo(model, tok, data, "cpu", steps=1, checkpoint_every=0,
                         csv_log_path=tmp_path / "flat.csv", **kw)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # rewards that differ across the rollouts (the stub reaches the loss through ch06)
    rewards = iter([1.0, 0.0] * 4)
    monkeypatch.setattr(ch06, "reward_rlvr", lambda text, answer: next(rewards))
    ch06.train_rlvr_grpo(model, tok, data, "cpu", steps=2, checkpoint_every=2,
                         checkpoint_dir=tmp_path, csv_log_path=tmp_path / "log" / "m.csv", **kw)
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    rows = (tmp_path / "log" / "m.csv").read_text().splitlines()
    assert rows[0] == "step,total_steps,loss,reward_avg,avg_response_len" and len(rows) == 3
    ckpt = tmp_path / "qwen3-0.6B-rlvr-grpo-step00002.pth"
    ids = torch.tensor([tok.encode("1+1=")])
    torch.testing.assert_close(load_book_checkpoint(ckpt, Qwen3Model(model.cfg))(ids), model(ids))
    # Ctrl-C in step 1: an "-interrupt" checkpoint, and the model comes back
    monkeypatch.setattr(ch06, "compute_grpo_loss", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt))
    assert ch06.train_rlvr_grpo(model, tok, data, "cpu", checkpoint_dir=tmp_path,
                                csv_log_path=tmp_path / "m2.csv") is model
    assert (tmp_path / "qwen3-0.6B-rlvr-grpo-step00001-interrupt.pth").is_file()


def test_book_edge_cases_of_chapter_7_maths():
    assert moving_average([1.0, 3.0], window_fraction=0.0) == [1.0, 3.0]
    logp, ent = sequence_logprob_and_entropy(_FixedModel(1, vocab=3), torch.tensor([1, 2]), 3)
    assert logp.item() == 0.0 and ent.item() == 0.0  # no answer tokens
    assert ch07.THINK_TOKEN_ID == 151667 and ch07.END_THINK_TOKEN_ID == 151668


BOOK_NAMES = {  # what the book's chapter 2-7 notebooks and scripts import, by module
    ch02: ["get_device", "generate_text_basic", "generate_text_basic_cache",
           "generate_text_basic_stream", "generate_text_basic_stream_cache", "generate_stats",
           "KVCache"],
    ch02_ex: ["generate_text_basic_stream", "generate_text_basic_stream_cache"],
    ch03: ["load_model_and_tokenizer", "load_tokenizer_only", "load_math500_test",
           "generate_text_stream_concat", "get_last_boxed", "extract_final_candidate",
           "normalize_text", "sympy_parser", "equality_check", "split_into_parts", "grade_answer",
           "run_demos_table", "render_prompt", "eta_progress_message", "evaluate_math500_stream"],
    ch04: ["generate_text_stream_concat_flex", "scale_logits_by_temperature", "top_p_filter",
           "generate_text_temp_stream_cache", "generate_text_top_p_stream_cache",
           "self_consistency_vote"],
    ch05: ["heuristic_score", "avg_logprob_answer", "make_critique_prompt", "make_refine_prompt",
           "self_refinement_loop"],
    ch06: ["load_math_train", "sample_response", "reward_rlvr", "sequence_logprob",
           "compute_grpo_loss", "save_checkpoint", "append_csv_metrics", "train_rlvr_grpo"],
    ch07: ["THINK_TOKEN_ID", "END_THINK_TOKEN_ID", "download_from_github", "moving_average",
           "plot_grpo_metrics", "compute_advantage_stats", "sequence_logprob_and_entropy",
           "reward_format"],
    qwen3: ["QWEN_CONFIG_06_B", "Qwen3Model", "Qwen3Tokenizer", "KVCache", "RMSNorm",
            "compute_rope_params", "apply_rope", "download_qwen3_small",
            "download_qwen3_grpo_checkpoints", "download_qwen3_distill_checkpoints",
            "load_hf_weights_into_qwen"],
    utils: ["download_file"],
}


@pytest.mark.parametrize("module", list(BOOK_NAMES), ids=lambda m: m.__name__.split(".")[-1])
def test_the_books_names_resolve(module):
    assert [n for n in BOOK_NAMES[module] if not hasattr(module, n)] == []
