"""Tests for the from-scratch Qwen3: layers against formulas, cache and padding equivalence."""

import json
import math

import pytest
import torch
from tolerance import assert_rounded_alike, forward_terms

from reasoning_from_scratch.qwen3 import (
    QWEN3_0_6B_CONFIG,
    GroupedQueryAttention,
    KVCache,
    Qwen3Config,
    Qwen3Model,
    RMSNorm,
    apply_rope,
    compute_rope_params,
    tiny_config,
)

V = 50


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=V, **overrides)
    return Qwen3Model(cfg).eval()


# The real Qwen3-0.6B config.json (huggingface.co/Qwen/Qwen3-0.6B).
QWEN3_0_6B_JSON = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


# ----------------------------------------------------------------------------- config


def test_config_from_real_hf_json_equals_preset(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_0_6B_JSON))
    assert Qwen3Config.from_json(path) == QWEN3_0_6B_CONFIG


def test_config_round_trip_and_dtype_key():
    cfg = tiny_config(vocab_size=77, num_hidden_layers=3, eos_token_id=5)
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["Qwen3ForCausalLM"] and d["model_type"] == "qwen3"
    assert d["hidden_act"] == "silu" and d["attention_bias"] is False
    assert d["max_window_layers"] == 3 and d["rope_scaling"] is None
    assert Qwen3Config.from_hf_dict(json.loads(json.dumps(d))) == cfg
    # newer transformers write "dtype" instead of "torch_dtype"
    d2 = dict(QWEN3_0_6B_JSON)
    del d2["torch_dtype"]
    d2["dtype"] = "float32"
    assert Qwen3Config.from_hf_dict(d2).torch_dtype == "float32"


def test_config_rejects_other_architectures(tmp_path):
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        Qwen3Config.from_hf_dict({**QWEN3_0_6B_JSON, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="model_type"):
        Qwen3Config.from_hf_dict({**QWEN3_0_6B_JSON, "model_type": "llama"})
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ValueError, match="config.json.*vocab_size"):
        Qwen3Config.from_json(bad)


# ----------------------------------------------------------------------------- names


def test_state_dict_keys_equal_hf_names():
    model = make_model(num_hidden_layers=2)
    expected = ["model.embed_tokens.weight"]
    for i in range(2):
        p = f"model.layers.{i}."
        expected += [
            p + "input_layernorm.weight",
            p + "self_attn.q_proj.weight",
            p + "self_attn.k_proj.weight",
            p + "self_attn.v_proj.weight",
            p + "self_attn.o_proj.weight",
            p + "self_attn.q_norm.weight",
            p + "self_attn.k_norm.weight",
            p + "post_attention_layernorm.weight",
            p + "mlp.gate_proj.weight",
            p + "mlp.up_proj.weight",
            p + "mlp.down_proj.weight",
        ]
    expected += ["model.norm.weight", "lm_head.weight"]
    model(torch.zeros(1, 3, dtype=torch.long))  # builds the RoPE tables: must stay out
    assert sorted(model.state_dict()) == sorted(expected)


def test_tied_weights_are_one_parameter():
    tied = make_model(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = make_model(tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == V * 64


# ----------------------------------------------------------------------------- layers


def test_rmsnorm_hand_computed():
    norm = RMSNorm(2, eps=0.0)
    x = torch.tensor([[3.0, 4.0]])  # rms = sqrt((9 + 16) / 2) = 3.5355339
    assert torch.allclose(norm(x), torch.tensor([[0.8485281, 1.1313708]]), atol=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, -1.0]))
    assert torch.allclose(norm(x), torch.tensor([[1.6970563, -1.1313708]]), atol=1e-6)
    y = norm.to(torch.bfloat16)(x.bfloat16())  # computed in float32, returned in bf16
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), torch.tensor([[1.6970563, -1.1313708]]), atol=1e-2)


def test_rmsnorm_matches_formula_random():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 8)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.allclose(norm(x), expected, atol=1e-6)


def test_rope_hand_computed():
    # head_dim 2: one pair, frequency 1; position 1 rotates (1, 0) by 1 radian.
    cos, sin = compute_rope_params(2, 10_000.0, 3)
    x = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2).expand(1, 1, 3, 2)
    y = apply_rope(x, cos, sin)[0, 0]
    expected = torch.tensor([[1.0, 0.0], [math.cos(1), math.sin(1)], [math.cos(2), math.sin(2)]])
    assert torch.allclose(y, expected, atol=1e-6)


def test_rope_equals_complex_rotation():
    torch.manual_seed(0)
    D, T, theta = 8, 6, 10_000.0
    cos, sin = compute_rope_params(D, theta, T)
    x = torch.randn(2, 3, T, D)
    y = apply_rope(x, cos, sin)
    # Split halves: (x_j, x_{j + D/2}) is the complex number x_j + i x_{j+D/2}, rotated by
    # angle p * theta^(-2j/D) (RoFormer eq. 15).
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :])
    j = torch.arange(D // 2, dtype=torch.float64)
    p = torch.arange(T, dtype=torch.float64)
    angle = p[:, None] * theta ** (-2 * j / D)  # (T, D/2)
    z = z * torch.polar(torch.ones_like(angle), angle).to(torch.complex64)
    expected = torch.cat([z.real, z.imag], dim=-1)
    assert torch.allclose(y, expected, atol=1e-5)
    # Per-row positions (B, T, D) tables give the same thing as shared (T, D) tables.
    pos = torch.arange(T).expand(2, T)
    assert torch.allclose(apply_rope(x, cos[pos], sin[pos]), y)


def test_gqa_matches_explicit_repeated_head_attention():
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=V)  # 4 query heads, 2 kv heads
    attn = GroupedQueryAttention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B, T, H, Hkv, D = 2, 5, 4, 2, 16
    x = torch.randn(B, T, cfg.hidden_size)
    cos, sin = compute_rope_params(D, cfg.rope_theta, T)
    pos = torch.arange(T).expand(B, T)

    # Written out: each query head h attends with key/value head h // (H / Hkv).
    q = attn.q_norm(attn.q_proj(x).view(B, T, H, D)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(B, T, Hkv, D)).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_rep = torch.stack([k[:, h // 2] for h in range(H)], dim=1)  # (B, H, T, D)
    v_rep = torch.stack([v[:, h // 2] for h in range(H)], dim=1)
    scores = q @ k_rep.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, T)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = (weights @ v_rep).transpose(1, 2).reshape(B, T, H * D)
    expected = attn.o_proj(out)

    got = attn(x, cos[pos], sin[pos], None)  # causal kernel path
    assert torch.allclose(got, expected, atol=1e-5)
    mask = (~future).expand(B, 1, T, T)  # explicit boolean mask path
    assert torch.allclose(attn(x, cos[pos], sin[pos], mask), expected, atol=1e-5)


# ----------------------------------------------------------------------------- cache / padding


def assert_same_logits(got, want, model, seq_len: int = 16):
    """`got` and `want` are one forward pass summed in another order (a cache, a batch, padding):
    within the rounding bound of tests/tolerance.py, for sequences up to `seq_len`."""
    assert_rounded_alike(got, want, forward_terms(model.cfg, seq_len))


def test_cached_equals_uncached():
    model = make_model()
    torch.manual_seed(1)
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        full = model(ids)  # (B, T, V)
        cache = KVCache(model.cfg.num_hidden_layers)
        chunks = [model(ids[:, :4], cache=cache)]  # prefill
        for t in range(4, 9):  # then token by token
            chunks.append(model(ids[:, t : t + 1], cache=cache))
    assert_same_logits(torch.cat(chunks, dim=1), full, model)
    assert len(cache) == cache.seq_len == 9
    assert cache.next_pos.tolist() == [9, 9]


def test_left_padded_batch_equals_rows_alone():
    model = make_model()
    torch.manual_seed(2)
    a, b = torch.randint(1, V, (7,)), torch.randint(1, V, (4,))
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 3:], mask[1, 3:] = b, 1
    nxt = torch.tensor([[11], [12]])
    with torch.no_grad():
        cache = KVCache(model.cfg.num_hidden_layers)
        batched = model(ids, attention_mask=mask, cache=cache)
        step = model(nxt, cache=cache)
        alone_a = model(torch.cat([a, nxt[0]])[None])
        alone_b = model(torch.cat([b, nxt[1]])[None])
    assert torch.isfinite(batched).all()  # padded query rows must not produce NaN
    assert_same_logits(batched[0], alone_a[0, :7], model)
    assert_same_logits(batched[1, 3:], alone_b[0, :4], model)
    assert_same_logits(step[0, 0], alone_a[0, 7], model)
    assert_same_logits(step[1, 0], alone_b[0, 4], model)
    assert cache.next_pos.tolist() == [8, 5]


def test_cache_expand_equals_separate_runs():
    model = make_model()
    torch.manual_seed(3)
    prompt = torch.randint(0, V, (1, 5))
    nxt = torch.tensor([[1], [2], [3]])
    with torch.no_grad():
        cache = KVCache(model.cfg.num_hidden_layers)
        model(prompt, cache=cache)
        cache.expand(3)
        assert cache.batch_size == 3
        step = model(nxt, cache=cache)[:, 0]  # (3, V)
        full = model(torch.cat([prompt.expand(3, 5), nxt], dim=1))[:, -1]
    assert_same_logits(step, full, model)


def run_chunks(model, cache, ids, mask, chunks):
    """Feed `ids`/`mask` (B, T) to `model` in column chunks; returns the logits (B, T, V)."""
    out, start = [], 0
    with torch.no_grad():
        for size in chunks:
            sl = slice(start, start + size)
            out.append(model(ids[:, sl], attention_mask=mask[:, sl], cache=cache))
            start += size
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("max_len", [0, 5, 64])  # 0 and 5: the buffers must grow on the way
def test_preallocated_cache_equals_cat_cache(max_len):
    """Left-padded prefill, then token by token: identical logits from both storages."""
    model = make_model()
    torch.manual_seed(4)
    ids = torch.randint(1, V, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = mask[2, :6] = 0  # left padding
    chunks = [6, 1, 1, 2, 1, 1]
    grown = KVCache(model.cfg.num_hidden_layers)
    pre = KVCache(model.cfg.num_hidden_layers, max_len=max_len)
    expected = run_chunks(model, grown, ids, mask, chunks)
    got = run_chunks(model, pre, ids, mask, chunks)
    assert pre.preallocated and not grown.preallocated
    assert torch.equal(got, expected)
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
    real = mask.bool()  # padded query slots differ (they attend everywhere), unused
    assert_same_logits(got[real], full[real], model)
    assert pre.max_len >= 12 and pre.seq_len == grown.seq_len == 12
    assert torch.equal(pre.next_pos, grown.next_pos)
    for i in range(model.cfg.num_hidden_layers):
        assert torch.equal(pre.keys[i], grown.keys[i])
        assert torch.equal(pre.values[i], grown.values[i])


def test_preallocated_cache_writes_in_place_without_reallocating():
    model = make_model()
    ids = torch.randint(0, V, (2, 9))
    cache = KVCache(model.cfg.num_hidden_layers, max_len=9)
    with torch.no_grad():
        model(ids[:, :4], cache=cache)  # prefill allocates (2, H_kv, 9, D) once
        buffer_ptrs = [cache.keys[0].data_ptr(), cache.values[1].data_ptr()]
        for t in range(4, 9):
            model(ids[:, t : t + 1], cache=cache)
            assert [cache.keys[0].data_ptr(), cache.values[1].data_ptr()] == buffer_ptrs
            assert cache.keys[0].shape[2] == t + 1  # a view of the filled part
    assert cache.max_len == 9
    cache.reserve(5)  # already large enough: nothing happens
    assert cache.keys[0].data_ptr() == buffer_ptrs[0]
    kept = cache.keys[0].clone()
    cache.reserve(20)  # one re-allocation, the filled part copied
    assert cache.max_len == 20 and cache.keys[0].data_ptr() != buffer_ptrs[0]
    assert torch.equal(cache.keys[0], kept)


def test_preallocated_cache_truncate_and_expand_equal_cat_cache():
    model = make_model()
    torch.manual_seed(5)
    prompt, more = torch.randint(0, V, (1, 7)), torch.randint(0, V, (1, 3))
    nxt = torch.tensor([[1], [2], [3]])
    results = []
    for cache in (KVCache(model.cfg.num_hidden_layers), KVCache(model.cfg.num_hidden_layers, 8)):
        with torch.no_grad():
            model(prompt, cache=cache)
            cache.truncate(4)  # keep the first 4 positions
            assert cache.seq_len == 4 and cache.next_pos.tolist() == [4]
            model(more, cache=cache)  # 4 + 3 slots: within the 8 preallocated
            cache.expand(3)
            assert cache.batch_size == 3 and cache.keys[1].shape[:3] == (3, 2, 7)
            results.append(model(nxt, cache=cache)[:, 0])  # (3, V)
            cache.truncate(0)
            assert cache.seq_len == 0 and cache.keys[0] is None
            results.append(model(nxt, cache=cache))  # an emptied cache starts over
    with torch.no_grad():
        expected = model(torch.cat([torch.cat([prompt[:, :4], more], 1).expand(3, 7), nxt], 1))
    assert torch.equal(results[0], results[2])
    assert_same_logits(results[0], expected[:, -1], model)
    assert torch.equal(results[1], results[3])


def test_preallocated_cache_refuses_gradients():
    model = make_model()
    cache = KVCache(model.cfg.num_hidden_layers, max_len=4)
    with pytest.raises(RuntimeError, match="gradients"):
        model(torch.tensor([[1, 2]]), cache=cache)  # grad mode, parameters require grad
    with pytest.raises(ValueError, match="max_len"):
        KVCache(2, max_len=-1)


def test_bad_inputs_raise_clear_errors():
    model = make_model()
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="empty"):
        KVCache(2).expand(3)


def test_bfloat16_forward_and_last_only():
    model = make_model().to(torch.bfloat16)
    ids = torch.randint(0, V, (2, 4))
    with torch.no_grad():
        logits = model(ids)
        last = model(ids, last_only=True)
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 4, V)
    assert torch.equal(last[:, 0], logits[:, -1])
