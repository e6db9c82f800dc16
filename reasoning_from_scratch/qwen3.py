"""Qwen3 dense decoder written from scratch in plain PyTorch (chapter 2).

The module tree mirrors Hugging Face ``Qwen3ForCausalLM`` attribute for attribute, so
``model.state_dict()`` keys are exactly the Hugging Face checkpoint keys
(``model.layers.0.self_attn.q_proj.weight``, ...), and a checkpoint loads with a plain
``load_state_dict``. Building blocks:

- ``RMSNorm``: root-mean-square normalisation (Zhang & Sennrich, 2019), computed in float32.
- ``compute_rope_params`` / ``apply_rope``: rotary position embeddings (Su et al., 2021,
  "RoFormer") in the split-halves layout of the reference implementation (``rotate_half``).
- ``GroupedQueryAttention``: grouped-query attention (Ainslie et al., 2023) with the Qwen3
  per-head RMSNorm on queries and keys ("QK-norm"), applied before RoPE.
- ``FeedForward``: SwiGLU feed-forward (Shazeer, 2020).
- ``KVCache``: per-layer keys/values plus the key padding mask and the next position of
  every row, so the cache (not the model) knows where each row is. ``expand(G)`` turns a
  prefilled 1-row cache into G rows, letting G rollouts of one prompt share one prefill.
  Keys/values either grow by concatenation (default, differentiable) or live in preallocated
  buffers written in place (``max_len``; what ``generation.generate`` uses for decoding).
- ``StaticKVCache`` / ``Qwen3Model.decode_static``: a cache whose every tensor keeps its shape
  for a whole generation (the write position is a tensor), and the one-token step over it: what
  ``torch.compile`` turns into one graph (``generation.generate(compile=True)``).
- ``Qwen3Model``: ``model(input_ids, attention_mask=None, cache=None) -> logits (B, T, V)``.
  Batches of prompts of different lengths use left padding plus an attention mask. With
  ``activation_checkpointing`` set, a forward pass that records gradients keeps only each
  block's input and recomputes the block's insides in the backward pass (Chen et al., 2016,
  "Training Deep Nets with Sublinear Memory Cost"; ``torch.utils.checkpoint``).

Notes on the code that every forward pass runs:

- Precision (``at_least_float32``): squares, softmaxes and log-softmaxes are computed in float32,
  or in the input's own dtype where that is wider: bf16 loses too much precision there, and a
  float64 model (the equivalence tests) keeps all of its precision instead of rounding to
  float32 midway.
- Positions and masks (``Qwen3Model.forward_hidden``): the rotary position of a token is the
  number of real tokens before it in its row, so left padding shifts nothing. Without padding
  and without a cache the attention mask is None, and SDPA runs its fastest, causal kernel.
  Otherwise a left-pad query would see no key at all (softmax over nothing is NaN), so such rows
  attend everywhere: their outputs are never used and, being padding, they are masked out as
  keys for every real token.
- Grouped-query attention calls SDPA with ``enable_gqa``: query head h reads key/value head
  h // group_size, what ``k.repeat_interleave(group_size, dim=1)`` would give, without copying
  the whole cache every decoding step (tests compare it with the explicit repeat).
- The fast paths sit beside the plain one, in functions that a plain forward pass never calls:
  ``forward_hidden(block_fn=...)`` (the training path's compiled block) and
  ``activation_checkpointing`` go through ``Qwen3Model._block``; a ``StaticKVCache`` (the
  compiled decode step, ``decode_static``) switches attention to ``one_query_attention``.
- ``KVCache`` with ``max_len``: without a ``reserve`` a cache that runs out of room grows
  geometrically (to at least twice its slots), so single-token steps re-allocate O(log T)
  times, not every step. ``expand`` repeats rows with ``index_select`` rather than
  ``repeat_interleave``: the latter returns a view (of its own copy), and torch.compile guards
  views differently from the plain tensors the decoding steps produce, so the compiled decode
  step would be compiled twice.

The book's protocol works on the same classes (docs/book_compatibility.md): ``Qwen3Model``
also takes the book's config dict (``QWEN_CONFIG_06_B``: ``emb_dim``, ``n_layers``, ...), its
``cfg`` answers the book's keys (``model.cfg["n_layers"]``), ``load_state_dict`` also accepts
the book's ``.pth`` names (``tok_emb``, ``trf_blocks.N.att.W_query``, ``final_norm.scale``,
``out_head``; ``book_to_hf_state_dict`` / ``hf_to_book_state_dict`` convert both ways), and
``KVCache(n_layers=...)`` has the book's ``get`` / ``update`` / ``reset``. The book's
downloaders of its Qwen3-0.6B files live here too, as in the book's module
(``download_qwen3_small``, ``download_qwen3_grpo_checkpoints``,
``download_qwen3_distill_checkpoints``; the bytes come through ``downloads.download_file``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .downloads import download_file
from .tokenizer import Qwen3Tokenizer

__all__ = [
    "Qwen3Config",
    "QWEN3_0_6B_CONFIG",
    "QWEN_CONFIG_06_B",
    "book_to_hf_state_dict",
    "hf_to_book_state_dict",
    "load_hf_weights_into_qwen",
    # the book's qwen3 module also offers these (the tokenizer's home: tokenizer.py)
    "Qwen3Tokenizer",
    "download_qwen3_small",
    "download_qwen3_grpo_checkpoints",
    "download_qwen3_distill_checkpoints",
    "tiny_config",
    "RMSNorm",
    "compute_rope_params",
    "apply_rope",
    "one_query_attention",
    "GroupedQueryAttention",
    "FeedForward",
    "TransformerBlock",
    "Qwen3Decoder",
    "Qwen3Model",
    "KVCache",
    "StaticKVCache",
]


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------

_REQUIRED_HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass
class Qwen3Config:
    """Hyper-parameters of a Qwen3 dense model; field names follow HF ``config.json``."""

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"Qwen3Config: num_attention_heads={self.num_attention_heads} must be a multiple "
                f"of num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"Qwen3Config: head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config dict") -> Qwen3Config:
        """Build a config from the content of a HF ``Qwen3ForCausalLM`` config.json."""
        archs = d.get("architectures")
        if archs is not None and "Qwen3ForCausalLM" not in archs:
            raise ValueError(f"{source}: architectures={archs}, expected Qwen3ForCausalLM")
        if d.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"{source}: model_type={d.get('model_type')!r}, expected 'qwen3'")
        missing = [k for k in _REQUIRED_HF_FIELDS if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {missing}")
        if d.get("use_sliding_window", False):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        # transformers >= 5 may store rope settings in `rope_parameters` instead of `rope_theta`.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{source}: rope scaling {rope_type!r} is not supported")
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        if isinstance(eos, (list, tuple)):  # some configs list several stop ids
            eos = eos[0] if eos else None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen3Config:
        """Read a HF ``config.json`` file."""
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        return cls.from_hf_dict(d, source=str(path))

    @classmethod
    def from_book_dict(cls, d: Mapping) -> Qwen3Config:
        """Build a config from the book's dict (``emb_dim``, ``n_layers``, ``n_kv_groups``, ...)."""
        missing = [k for k in _BOOK_KEYS if k not in d and k != "head_dim"]
        if missing:
            raise ValueError(f"book config dict: missing key(s) {missing}")
        if not d.get("qk_norm", True):
            raise ValueError("book config dict: qk_norm=False is not Qwen3 (this model always "
                             "normalises queries and keys)")
        dtype = d["dtype"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["emb_dim"],
            intermediate_size=d["hidden_dim"],
            num_hidden_layers=d["n_layers"],
            num_attention_heads=d["n_heads"],
            num_key_value_heads=d["n_kv_groups"],
            head_dim=d.get("head_dim") or d["emb_dim"] // d["n_heads"],
            rope_theta=float(d["rope_base"]),
            max_position_embeddings=d["context_length"],
            # The book's model has its own output layer (its checkpoints store out_head).
            tie_word_embeddings=False,
            torch_dtype=str(dtype).removeprefix("torch.") if dtype is not None else "float32",
        )

    def to_book_dict(self) -> dict:
        """The book's config dict for this model."""
        return {
            "vocab_size": self.vocab_size,
            "context_length": self.max_position_embeddings,
            "emb_dim": self.hidden_size,
            "n_heads": self.num_attention_heads,
            "n_layers": self.num_hidden_layers,
            "hidden_dim": self.intermediate_size,
            "head_dim": self.head_dim,
            "qk_norm": True,
            "n_kv_groups": self.num_key_value_heads,
            "rope_base": self.rope_theta,
            "dtype": getattr(torch, self.torch_dtype),
        }

    def __getitem__(self, key: str):
        """The book's dict access: ``cfg["n_layers"]``, ``cfg["emb_dim"]``, ..."""
        if key not in _BOOK_KEYS:
            raise KeyError(f"{key!r} is not a key of the book's config dict {list(_BOOK_KEYS)}")
        return self.to_book_dict()[key]

    def to_hf_dict(self) -> dict:
        """Full HF ``config.json`` content, loadable by transformers' Qwen3ForCausalLM."""
        d = asdict(self)
        d.update(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_act": "silu",
                "attention_bias": False,
                "attention_dropout": 0.0,
                "initializer_range": 0.02,
                "use_cache": True,
                "rope_scaling": None,
                "sliding_window": None,
                "use_sliding_window": False,
                "max_window_layers": self.num_hidden_layers,
                "transformers_version": "4.51.0",
            }
        )
        return dict(sorted(d.items()))


# Keys of the book's config dict (its qwen3.QWEN_CONFIG_06_B), in the book's order.
_BOOK_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim",
              "head_dim", "qk_norm", "n_kv_groups", "rope_base", "dtype")


# The published Qwen3-0.6B hyper-parameters (huggingface.co/Qwen/Qwen3-0.6B, config.json).
QWEN3_0_6B_CONFIG = Qwen3Config(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    bos_token_id=151643,
    eos_token_id=151645,
)


# The same model as the book's config dict (the book's name); Qwen3Model takes either form.
QWEN_CONFIG_06_B = QWEN3_0_6B_CONFIG.to_book_dict()


def tiny_config(vocab_size: int = 256, **overrides) -> Qwen3Config:
    """A few-thousand-to-few-hundred-thousand parameter Qwen3 for tests and the tiny world."""
    base = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    unknown = set(overrides) - {f.name for f in fields(Qwen3Config)}
    if unknown:
        raise TypeError(f"tiny_config: unknown Qwen3Config field(s) {sorted(unknown)}")
    return replace(base, **overrides)


# --------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or in its own dtype where that is wider (module notes: precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 or wider (Zhang & Sennrich,
    2019)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = at_least_float32(x)  # bf16 squares lose too much precision
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # Same order as the reference: cast back first, then scale by the weight.
        return self.weight * x.to(in_dtype)


def compute_rope_params(
    head_dim: int, theta_base: float = 10_000.0, context_length: int = 4096, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (context_length, head_dim) for RoPE, float32, split-halves layout."""
    # Frequencies theta_i = base^(-2i/d), i = 0..d/2-1 (RoFormer, eq. 15).
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta_base**exponents)  # (D/2,)
    positions = torch.arange(context_length, dtype=torch.float32, device=device)
    angles = positions[:, None] * inv_freq[None, :]  # (T, D/2)
    # Split-halves layout: dimension j and j + D/2 form one rotated pair.
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               offset: int = 0) -> torch.Tensor:
    """Rotate x (B, H, T, D) by per-token angles cos/sin (B, T, D), or by a (L, D) table from
    position `offset` on (the book's form)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads: (B, 1, T, D)
    else:
        T = x.shape[-2]
        cos, sin = cos[offset : offset + T], sin[offset : offset + T]  # (T, D)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # "rotate_half"
    return x * cos + rotated * sin


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attn_mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v for one query per row, written as plain matmuls.

    q (B, H, 1, D); k, v (B, H_kv, L, D); attn_mask (B, 1, 1, L) bool, True = may attend. The
    same result as ``F.scaled_dot_product_attention(..., enable_gqa=True)`` up to rounding, but
    a compiler fuses it into a few small kernels, where SDPA's CPU kernel, built for long
    queries, spent more time than the rest of a compiled decode step together (tiny model).
    Query head h uses key/value head h // (H / H_kv), as ``enable_gqa`` does. Run eagerly
    (not under ``torch.compile``) it is SDPA: the products would be materialised there.
    """
    if not torch.compiler.is_compiling():  # eager (a failed compile): SDPA is faster there
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    q = q.reshape(B, H_kv, H // H_kv, D)  # (B, H_kv, group, D): a group shares its key head
    # Products and sums rather than batched matmuls: one query is a reduction the compiler
    # fuses, where CPU bmm pays a call per (row, head) of a few hundred multiply-adds.
    scores = (q[:, :, :, None] * k[:, :, None]).sum(-1).float() * D**-0.5  # (B, H_kv, group, L)
    scores = scores.masked_fill(~attn_mask, float("-inf"))  # mask (B, 1, 1, L) broadcasts
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    out = (weights[..., None] * v[:, :, None]).sum(-2)  # (B, H_kv, group, D)
    return out.reshape(B, H, 1, D)


class GroupedQueryAttention(nn.Module):
    """Causal self-attention where groups of query heads share one key/value head."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.group_size = self.num_heads // self.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # Qwen3 QK-norm: RMSNorm over each head's vector, before RoPE.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None, cache: KVCache | None = None,
                layer_idx: int = 0) -> torch.Tensor:
        """x (B, T, C), cos/sin (B, T, D), attn_mask (B, 1, T, S) bool (True = may attend; None:
        causal) -> (B, T, C); the new keys/values go to layer `layer_idx` of `cache`."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)  # (B, H_kv, S, D)
        if isinstance(cache, StaticKVCache):  # the compiled decode step
            out = one_query_attention(q, k, v, attn_mask)  # (B, H, 1, D)
        else:  # enable_gqa: query head h reads key/value head h // group_size, no copy
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=True
            )  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer, 2020)."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x, cos, sin, attn_mask, cache=None, layer_idx=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, cache, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------


class KVCache:
    """Keys/values of every layer plus the key padding mask and next position of each row.

    Two ways to store keys/values, with identical results (the tests compare them):

    - ``max_len=None`` (grow): every update concatenates the new keys/values to the old ones
      with ``torch.cat``, so each decoding step copies the whole cache (O(T^2) copying over T
      steps). Nothing is written in place, so gradients can flow through the cache
      (``tiny_world.batch_logits`` trains through a shared prefix this way).
    - ``max_len=n`` (preallocated; the book's chapter 2 speed knob): the first update allocates
      one (B, H_kv, n, D) buffer per layer for keys and one for values, and every update writes
      its new slots in place, so a decoding step copies only its own keys/values. A step that
      needs more than ``n`` slots re-allocates the buffers larger (``max_len`` grows) and copies
      the filled part once; ``reserve`` does that up front. No-grad only: an in-place write
      would change keys that autograd saved for the backward pass.

    Either way ``keys[i]``/``values[i]`` are the filled part (B, H_kv, S, D) of layer i (views
    of the buffers when preallocated).
    """

    def __init__(self, num_layers: int | None = None, max_len: int | None = None, *,
                 n_layers: int | None = None):
        num_layers = n_layers if num_layers is None else num_layers  # the book's keyword
        if num_layers is None:
            raise TypeError("KVCache needs num_layers (or the book's n_layers)")
        if max_len is not None and max_len < 0:
            raise ValueError(f"KVCache: max_len must be None or >= 0, got {max_len}")
        self.num_layers = num_layers
        self.max_len = max_len  # None: grow by torch.cat; else the slots of the buffers
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # (B, H_kv, S, D)
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # Preallocated storage, (B, H_kv, max_len, D) per layer; None until the first update.
        self._key_buffers: list[torch.Tensor | None] = [None] * num_layers
        self._value_buffers: list[torch.Tensor | None] = [None] * num_layers
        self.key_mask: torch.Tensor | None = None  # (B, S) bool, False = left padding
        self.next_pos: torch.Tensor | None = None  # (B,) long, real tokens held so far

    @property
    def preallocated(self) -> bool:
        """True when keys/values are written in place into preallocated buffers."""
        return self.max_len is not None

    @property
    def seq_len(self) -> int:
        """Number of key slots held (padding included)."""
        return 0 if self.key_mask is None else self.key_mask.shape[1]

    def __len__(self) -> int:
        return self.seq_len

    @property
    def batch_size(self) -> int | None:
        """Rows held, or None while empty."""
        return None if self.key_mask is None else self.key_mask.shape[0]

    def update(self, layer_idx: int, k, v: torch.Tensor | None = None):
        """Append new keys/values (B, H_kv, T, D) of one layer; return the full ones. The book's
        one-argument form ``update(layer_idx, (keys, values))`` sets them and returns None."""
        if v is None:
            self.keys[layer_idx], self.values[layer_idx] = k
            return None
        if self.max_len is None:
            return self._concatenate(layer_idx, k, v)
        return self._write_in_place(layer_idx, k, v)

    def _concatenate(self, i: int, k: torch.Tensor, v: torch.Tensor):
        """Grow mode: new tensors holding the old slots and the new ones (copies all S + T)."""
        if self.keys[i] is not None:
            k = torch.cat([self.keys[i], k], dim=2)  # (B, H_kv, S + T, D)
            v = torch.cat([self.values[i], v], dim=2)
        self.keys[i], self.values[i] = k, v
        return k, v

    def _write_in_place(self, i: int, k: torch.Tensor, v: torch.Tensor):
        """Preallocated mode: copy only the T new slots into the buffers; return views."""
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError(
                "a preallocated KVCache (max_len set) writes in place and cannot carry "
                "gradients; use KVCache(num_layers) to backpropagate through the cache"
            )
        start = 0 if self.keys[i] is None else self.keys[i].shape[2]
        end = start + k.shape[2]
        self._make_room(i, k, v, end)
        self._key_buffers[i][:, :, start:end] = k
        self._value_buffers[i][:, :, start:end] = v
        self.keys[i] = self._key_buffers[i][:, :, :end]  # (B, H_kv, S + T, D) views
        self.values[i] = self._value_buffers[i][:, :, :end]
        return self.keys[i], self.values[i]

    def _make_room(self, i: int, k: torch.Tensor, v: torch.Tensor, end: int) -> None:
        """(Re-)allocate layer i's buffers, holding its filled slots, unless they have `end`
        slots of rows like `k`; the caller then writes and views them."""
        buf = self._key_buffers[i]
        if (buf is not None and buf.shape[2] >= end and buf.shape[0] == k.shape[0]
                and buf.dtype == k.dtype and buf.device == k.device):
            return
        if end > self.max_len:  # out of room without a `reserve`: grow geometrically
            self.max_len = max(end, 2 * self.max_len)
        filled_k = k[:, :, :0] if self.keys[i] is None else self.keys[i]  # (B, H_kv, S, D)
        filled_v = v[:, :, :0] if self.values[i] is None else self.values[i]
        self._key_buffers[i] = _buffer_holding(filled_k, self.max_len)[0]
        self._value_buffers[i] = _buffer_holding(filled_v, self.max_len)[0]

    # ----- the book's protocol: get / update(layer_idx, (k, v)) / get_all / reset -----------
    @property
    def n_layers(self) -> int:
        return self.num_layers

    def get(self, layer_idx: int):
        """(keys, values) held for one layer, or None (the book's protocol)."""
        if self.keys[layer_idx] is None:
            return None
        return self.keys[layer_idx], self.values[layer_idx]

    def get_all(self) -> list:
        """``get(i)`` for every layer."""
        return [self.get(i) for i in range(self.num_layers)]

    def reset(self) -> None:
        """Forget everything held (the book's protocol); preallocated buffers are kept."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.key_mask = self.next_pos = None

    def reserve(self, n: int) -> None:
        """Preallocated cache: room for `n` slots now (the filled part copied once), so no later
        step re-allocates; a no-op when there is room already or the cache grows by torch.cat."""
        if self.max_len is None or n <= self.max_len:
            return
        self.max_len = n
        for i in range(self.num_layers):
            if self.keys[i] is None:
                self._key_buffers[i] = self._value_buffers[i] = None  # allocated when used
            else:
                self._key_buffers[i], self.keys[i] = _buffer_holding(self.keys[i], n)
                self._value_buffers[i], self.values[i] = _buffer_holding(self.values[i], n)

    def truncate(self, keep: int) -> None:
        """Drop every cached position from `keep` on, in place (keys, values, mask, positions).

        Preallocated buffers are kept: later updates overwrite the dropped slots.
        """
        if keep >= self.seq_len:
            return
        if keep == 0:
            self.keys = [None] * self.num_layers
            self.values = [None] * self.num_layers
            self.key_mask = self.next_pos = None
            return
        for i in range(self.num_layers):
            self.keys[i] = self.keys[i][:, :, :keep]  # (B, H_kv, keep, D)
            self.values[i] = self.values[i][:, :, :keep]
        self.key_mask = self.key_mask[:, :keep]  # (B, keep)
        self.next_pos = self.key_mask.sum(dim=1)  # (B,) real tokens left = next position

    def expand(self, G: int) -> KVCache:
        """Repeat every row G times (row b -> rows b*G..b*G+G-1), in place; returns self."""
        if self.key_mask is None:
            raise ValueError("KVCache.expand: the cache is empty; prefill it first")
        for i in range(self.num_layers):
            if self.keys[i] is None:
                continue
            keys = _repeat_rows(self.keys[i], G)  # (B*G, H_kv, S, D)
            values = _repeat_rows(self.values[i], G)
            if self.max_len is None:
                self.keys[i], self.values[i] = keys, values
            else:  # new (B*G)-row buffers with the same room
                self._key_buffers[i], self.keys[i] = _buffer_holding(keys, self.max_len)
                self._value_buffers[i], self.values[i] = _buffer_holding(values, self.max_len)
        self.key_mask = _repeat_rows(self.key_mask, G)  # (B*G, S)
        self.next_pos = _repeat_rows(self.next_pos, G)  # (B*G,)
        return self


class StaticKVCache:
    """Fixed-shape keys/values for a compiled decode step (``Qwen3Model.decode_static``).

    Every tensor keeps its shape and storage for a whole generation and is written in place, and
    the slot the next token writes (``pos``) is a tensor, not a Python int: one compiled graph
    (one CUDA graph on a GPU) then serves every step, with attention over all ``max_len`` slots
    and a key mask instead of over a growing filled part.

    keys/values: per layer (R, H_kv, L, D), zero where nothing was written (masked slots are
    multiplied by zero attention weights, and garbage such as NaN would survive that);
    key_mask (R, L) bool; next_pos (R,) long, the rotary position of each row's next token;
    pos (1,) long, the slot the next token writes.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 key_mask: torch.Tensor, next_pos: torch.Tensor, pos: torch.Tensor):
        self.keys, self.values = keys, values
        self.key_mask, self.next_pos, self.pos = key_mask, next_pos, pos

    @classmethod
    def from_cache(cls, cache: KVCache, rows: int, slots: int, start: int = 0) -> StaticKVCache:
        """Zero buffers of `rows` x `slots` holding `cache` as `fill` puts it there."""
        keys = [k.new_zeros(rows, k.shape[1], slots, k.shape[3]) for k in cache.keys]
        values = [v.new_zeros(rows, v.shape[1], slots, v.shape[3]) for v in cache.values]
        static = cls(keys, values, cache.key_mask.new_zeros(rows, slots),
                     cache.next_pos.new_zeros(rows),
                     torch.zeros(1, dtype=torch.long, device=cache.key_mask.device))
        static.fill(cache, start)
        return static

    def fill(self, cache: KVCache, start: int = 0) -> None:
        """Hold `cache`'s B rows x S slots at slots [start, start + S), in place: the slots
        before `start` are extra left padding (masked; rotary positions count real tokens only,
        so nothing else changes), rows B.. are empty rows, and everything else is zero. The
        next token writes slot start + S."""
        B, S = cache.key_mask.shape
        rows, slots = self.key_mask.shape
        if B > rows or start + S > slots:
            raise ValueError(f"StaticKVCache: a cache of {B} rows x {S} slots from slot {start} "
                             f"does not fit {rows} x {slots}")
        for buf, held in zip([*self.keys, *self.values], [*cache.keys, *cache.values]):
            buf.zero_()  # (R, H_kv, L, D)
            buf[:B, :, start : start + S] = held
        self.key_mask.zero_()  # (R, L) False: empty
        self.key_mask[:B, start : start + S] = cache.key_mask
        self.next_pos.zero_()  # (R,)
        self.next_pos[:B] = cache.next_pos
        self.pos.fill_(start + S)

    @property
    def max_len(self) -> int:
        return self.key_mask.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the decode step writes in place."""
        return [*self.keys, *self.values, self.key_mask, self.next_pos, self.pos]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Write one token's keys/values (R, H_kv, 1, D) at slot `pos`; return all L slots."""
        self.keys[layer_idx].index_copy_(2, self.pos, k)
        self.values[layer_idx].index_copy_(2, self.pos, v)
        return self.keys[layer_idx], self.values[layer_idx]


def _repeat_rows(x: torch.Tensor, G: int) -> torch.Tensor:
    """Row b of x -> rows b*G..b*G+G-1, as a new tensor, not a view (module notes: KVCache)."""
    rows = torch.arange(x.shape[0], device=x.device).repeat_interleave(G)  # (B*G,)
    return x.index_select(0, rows)


def _buffer_holding(filled: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(new buffer (B, H_kv, slots, D), view of its first S slots) holding `filled` (B, H_kv, S,
    D); the other slots are left uninitialised: only the filled part is ever read."""
    B, H, S, D = filled.shape
    buffer = filled.new_empty(B, H, slots, D)
    buffer[:, :, :S] = filled
    return buffer, buffer[:, :, :S]


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


class Qwen3Decoder(nn.Module):
    """Embedding, decoder blocks and final norm (HF ``Qwen3Model``, the ``model.`` prefix)."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3Model(nn.Module):
    """Qwen3 causal language model; ``state_dict()`` keys equal HF ``Qwen3ForCausalLM``.

    ``cfg``: a ``Qwen3Config`` or the book's config dict (then the weights take its ``dtype``).
    """

    def __init__(self, cfg: Qwen3Config | Mapping):
        super().__init__()
        book_dict = isinstance(cfg, Mapping)
        if book_dict:
            cfg = Qwen3Config.from_book_dict(cfg)
            rng = torch.random.get_rng_state()  # the book's init draws from here (below)
        self.cfg = cfg
        self.model = Qwen3Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not book_dict:
            self.reset_parameters()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # the same Parameter
        # RoPE tables: derived data, not weights, so non-persistent (absent from state_dict).
        # Built lazily on first use, on the model's device.
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        # Recompute each block in the backward instead of keeping its activations (`_block`);
        # set by the training loops (`--activation-checkpointing`), off for inference.
        self.activation_checkpointing = False
        if book_dict:
            self.to(getattr(torch, cfg.torch_dtype))
            torch.random.set_rng_state(rng)
            self.reset_parameters_like_book()

    def reset_kv_cache(self) -> None:
        """The book's call before a new generation; a no-op here, where the KVCache (not the
        model) knows each row's position, so a fresh cache is all a new generation needs."""

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` that also accepts the book's ``.pth`` names."""
        if "tok_emb.weight" in state_dict:
            state_dict = book_to_hf_state_dict(state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF-style init: normal(0, 0.02) linears/embedding, ones for norms."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def reset_parameters_like_book(self) -> None:
        """The book's random init, draw for draw: torch's default inits (embedding normal(0, 1),
        linears kaiming-uniform) in the order the book's Qwen3Model creates its modules
        (embedding; per block query, key, value, output, then gate, up, down; output head), in
        the weights' dtype, norms ones. A model built from the book's dict starts this way, so
        ``torch.manual_seed(s); Qwen3Model(QWEN_CONFIG_06_B)`` has the weights of the book's
        model built after the same seed."""
        self.model.embed_tokens.reset_parameters()
        for block in self.model.layers:
            att, mlp = block.self_attn, block.mlp
            for linear in (att.q_proj, att.k_proj, att.v_proj, att.o_proj,
                           mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                linear.reset_parameters()  # kaiming_uniform_(a=sqrt(5)); no bias
        if self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.reset_parameters()
        for m in self.modules():
            if isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _rope_tables(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables with at least `needed` positions (grown beyond max_pos if asked)."""
        if self.rope_cos is None or self.rope_cos.shape[0] < needed:
            length = max(needed, self.cfg.max_position_embeddings)
            cos, sin = compute_rope_params(
                self.cfg.head_dim, self.cfg.rope_theta, length, device=self.device
            )
            self.rope_cos, self.rope_sin = cos, sin
        return self.rope_cos, self.rope_sin

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits (B, T, V) for the new tokens; (B, 1, V) of the last token if `last_only`."""
        h = self.forward_hidden(input_ids, attention_mask, cache)  # (B, T, C)
        if last_only:
            h = h[:, -1:]  # with left padding the last slot is real for every row
        return self.lm_head(h)

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       cache: KVCache | None = None,
                       block_fn: Callable | None = None) -> torch.Tensor:
        """Final-normed hidden states (B, T, C), the lm_head input, of the new tokens input_ids
        (B, T), left padded where attention_mask (B, T) is 0, on top of what `cache` holds.
        block_fn(block, x, cos, sin, attn_mask) -> x, if given, runs each decoder block instead
        of calling it (no cache): the compiled update's (`compiled_update.compiled_block`)."""
        _check_inputs(input_ids, attention_mask, cache, block_fn)
        B, T = input_ids.shape
        dev = input_ids.device
        past = 0 if cache is None else cache.seq_len
        if attention_mask is None:
            new_mask = torch.ones(B, T, dtype=torch.bool, device=dev)
        else:
            new_mask = attention_mask.to(device=dev, dtype=torch.bool)
        if past:
            past_mask, past_pos = cache.key_mask, cache.next_pos  # (B, S - T), (B,)
        else:
            past_mask = torch.zeros(B, 0, dtype=torch.bool, device=dev)
            past_pos = torch.zeros(B, dtype=torch.long, device=dev)
        m = new_mask.long()
        positions = past_pos[:, None] + m.cumsum(dim=-1) - m  # (B, T) real tokens before
        key_mask = torch.cat([past_mask, new_mask], dim=1)  # (B, S)
        causal_only = past == 0 and (attention_mask is None or bool(new_mask.all()))
        attn_mask = None if causal_only else _attention_mask(key_mask, past)  # (B, 1, T, S)
        cos_table, sin_table = self._rope_tables(past + T)  # positions < S: no device sync
        cos, sin = cos_table[positions], sin_table[positions]  # (B, T, D)

        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        checkpointing = self.activation_checkpointing and cache is None and torch.is_grad_enabled()
        if block_fn is None and not checkpointing:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, attn_mask, cache, i)
        else:  # the fast paths: compiled blocks, activation checkpointing
            for i, layer in enumerate(self.model.layers):
                x = self._block(layer, x, cos, sin, attn_mask, cache, i, block_fn)
        if cache is not None:
            cache.key_mask = key_mask
            cache.next_pos = past_pos + m.sum(dim=-1)
        return self.model.norm(x)

    def _block(self, layer, x, cos, sin, attn_mask, cache, i, block_fn=None):
        """layer(x, ...) -> (B, T, C), or `block_fn(layer, x, cos, sin, attn_mask)` where given
        (`forward_hidden`'s block_fn); with `activation_checkpointing`, when gradients are
        recorded and no KV cache is written, through `torch.utils.checkpoint`: the backward
        pass keeps the block's input x alone (B*T*C values) instead of the dozens of tensors
        its attention and SwiGLU save, and reruns the block's forward to get them back (one
        more forward pass of compute). Non-reentrant (`use_reentrant=False`): the form torch
        recommends, which FSDP2's hooks also support (the rerun all-gathers the block's
        weights again)."""
        if block_fn is not None:
            run, args = functools.partial(block_fn, layer), (x, cos, sin, attn_mask)
        else:
            run, args = layer, (x, cos, sin, attn_mask, cache, i)
        if self.activation_checkpointing and cache is None and torch.is_grad_enabled():
            return checkpoint(run, *args, use_reentrant=False)
        return run(*args)

    def decode_static(self, token_ids: torch.Tensor, is_real: torch.Tensor,
                      cache: StaticKVCache) -> torch.Tensor:
        """Logits (R, V) after one token per row, token_ids/is_real (R,), over a StaticKVCache.

        The same computation as ``forward`` with one new token, but with shapes that never change
        (attention over all L slots, the empty ones masked) and no host synchronisation, so that
        ``torch.compile(fullgraph=True, dynamic=False)`` makes one graph of it. Advances the
        cache: slot ``pos`` written, ``pos`` + 1, ``next_pos`` + 1 where the token is real.
        """
        cache.key_mask.index_copy_(1, cache.pos, is_real[:, None])
        mask = cache.key_mask
        # A row with no real key (a padding row of the batch) attends everywhere, as in
        # `forward_hidden`: softmax over nothing is NaN. Its output is never used.
        mask = mask | ~mask.any(dim=-1, keepdim=True)  # (R, L)
        cos_table, sin_table = self._rope_tables(cache.max_len)
        positions = cache.next_pos[:, None]  # (R, 1)
        cos, sin = cos_table[positions], sin_table[positions]  # (R, 1, D)
        x = self.model.embed_tokens(token_ids[:, None])  # (R, 1, C)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask[:, None, None, :], cache, i)
        cache.next_pos.add_(is_real.long())
        cache.pos.add_(1)
        return self.lm_head(self.model.norm(x))[:, -1]  # (R, V)


def _check_inputs(input_ids, attention_mask, cache, block_fn) -> None:
    """`Qwen3Model.forward_hidden`'s argument checks."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    if block_fn is not None and cache is not None:
        raise ValueError("forward_hidden: block_fn runs the blocks without a cache")
    B = input_ids.shape[0]
    if cache is not None and cache.seq_len and cache.batch_size != B:
        raise ValueError(f"input_ids has {B} rows but the KVCache holds {cache.batch_size}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
            f"{tuple(input_ids.shape)} (it covers the new tokens only)"
        )


def _attention_mask(key_mask: torch.Tensor, past: int) -> torch.Tensor:
    """(B, 1, T, S) bool, True = may attend: the T = S - past new tokens' queries see the real
    keys of key_mask (B, S) up to their own slot; a query that sees none (a left-pad token)
    sees every key instead (module notes: positions and masks)."""
    S = key_mask.shape[1]
    q_idx = torch.arange(past, S, device=key_mask.device)
    k_idx = torch.arange(S, device=key_mask.device)
    causal = k_idx[None, :] <= q_idx[:, None]  # (T, S)
    attn_mask = causal[None] & key_mask[:, None, :]  # (B, T, S)
    attn_mask = attn_mask | ~attn_mask.any(dim=-1, keepdim=True)
    return attn_mask[:, None]  # (B, 1, T, S) broadcast over heads


# --------------------------------------------------------------------------------------
# The book's parameter names
# --------------------------------------------------------------------------------------

# The book's Qwen3Model names its modules after GPT-2 (tok_emb, trf_blocks, att.W_query, ...)
# and its norms' weights "scale"; same tensors, same shapes. SwiGLU: fc1 = gate, fc2 = up,
# fc3 = down (out = fc3(silu(fc1(x)) * fc2(x))).
_BOOK_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "final_norm.scale": "model.norm.weight",
    "out_head.weight": "lm_head.weight",
}
_BOOK_BLOCK = {
    "att.W_query.weight": "self_attn.q_proj.weight",
    "att.W_key.weight": "self_attn.k_proj.weight",
    "att.W_value.weight": "self_attn.v_proj.weight",
    "att.out_proj.weight": "self_attn.o_proj.weight",
    "att.q_norm.scale": "self_attn.q_norm.weight",
    "att.k_norm.scale": "self_attn.k_norm.weight",
    "ff.fc1.weight": "mlp.gate_proj.weight",
    "ff.fc2.weight": "mlp.up_proj.weight",
    "ff.fc3.weight": "mlp.down_proj.weight",
    "norm1.scale": "input_layernorm.weight",
    "norm2.scale": "post_attention_layernorm.weight",
}


def _rename(key: str, top: dict, block: dict, block_prefix: str, new_block_prefix: str) -> str:
    """Rename one parameter key with a top-level table and a per-block table."""
    if key in top:
        return top[key]
    if key.startswith(block_prefix):
        layer, _, rest = key[len(block_prefix):].partition(".")
        if layer.isdigit() and rest in block:
            return f"{new_block_prefix}{layer}.{block[rest]}"
    raise KeyError(f"{key!r} is not a Qwen3 parameter name")


def book_to_hf_state_dict(state_dict: Mapping) -> dict:
    """The book's ``.pth`` state dict (tok_emb, trf_blocks.N.att.W_query, ...) with HF names."""
    return {_rename(k, _BOOK_TOP, _BOOK_BLOCK, "trf_blocks.", "model.layers."): v
            for k, v in state_dict.items()}


def hf_to_book_state_dict(state_dict: Mapping) -> dict:
    """An HF-named state dict with the book's names; a tied lm_head becomes its own out_head."""
    top = {v: k for k, v in _BOOK_TOP.items()}
    block = {v: k for k, v in _BOOK_BLOCK.items()}
    out = {_rename(k, top, block, "model.layers.", "trf_blocks."): v
           for k, v in state_dict.items()}
    if "out_head.weight" not in out:  # tied checkpoints omit lm_head; the book stores a copy
        out["out_head.weight"] = out["tok_emb.weight"].clone()
    return out


def load_hf_weights_into_qwen(model: Qwen3Model, param_config: Mapping, params: Mapping) -> None:
    """The book's loader: copy HF-named `params` into `model` (shapes checked, lm_head tied to
    the embedding when `params` has none). `param_config` gives the book's ``n_layers``."""
    if param_config["n_layers"] != model.cfg.num_hidden_layers:
        raise ValueError(f"param_config n_layers={param_config['n_layers']} but the model has "
                         f"{model.cfg.num_hidden_layers} layers")
    params = dict(params)
    if "lm_head.weight" not in params:
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
    model.load_state_dict(params)


# --------------------------------------------------------------------------------------
# The book's Qwen3-0.6B files: weights, tokenizers, GRPO and distillation checkpoints
# --------------------------------------------------------------------------------------
# Here, as in the book's qwen3 module, so that a stub of `qwen3.download_file` (the book's
# readers patch it there) is the one these functions call. URLs: the book's repository,
# chapter 2 and appendix D.

QWEN3_SMALL_REPO = "https://huggingface.co/rasbt/qwen3-from-scratch/resolve/main"
QWEN3_SMALL_BACKUP = "https://f001.backblazeb2.com/file/reasoning-from-scratch/qwen3-0.6B"
QWEN3_SMALL_FILES = {
    "base": {"model": "qwen3-0.6B-base.pth", "tokenizer": "tokenizer-base.json"},
    "reasoning": {"model": "qwen3-0.6B-reasoning.pth", "tokenizer": "tokenizer-reasoning.json"},
}
GRPO_CHECKPOINTS_REPO = (
    "https://huggingface.co/rasbt/qwen3-from-scratch-grpo-checkpoints/resolve/main")
GRPO_CHECKPOINTS_BACKUP = (
    "https://f001.backblazeb2.com/file/reasoning-from-scratch/qwen3-0.6B-checkpoints")
# The book's chapter 6-7 GRPO runs: grpo_type -> folder of the checkpoint repository.
GRPO_CHECKPOINT_FOLDERS = {
    "no_kl": "grpo_original_no_kl",
    "tracking": "7_3_plus_tracking/checkpoints",
    "clip_ratio": "7_4_plus_clip_ratio/checkpoints",
    "kl": "7_5_plus_kl/checkpoints",
    "format_reward": "7_6_plus_format_reward/checkpoints",
}
DISTILL_CHECKPOINTS_REPO = (
    "https://huggingface.co/rasbt/qwen3-from-scratch-distill-checkpoints/resolve/main")
# The book's chapter 8 distillation runs: teacher -> (folder, {step: file name}).
DISTILL_CHECKPOINTS = {
    "deepseek_r1": ("ch08_distill_deepseek_r1/checkpoints", {
        "06682": "qwen3-0.6B-distill-step06682-epoch1.pth",
        "13364": "qwen3-0.6B-distill-step13364-epoch2.pth",
        "20046": "qwen3-0.6B-distill-step20046-epoch3.pth",
    }),
    "qwen3_235b_a22b": ("ch08_distill_qwen3_235b_a22b/checkpoints", {
        "05746": "qwen3-0.6B-distill-step05746-epoch1.pth",
        "11492": "qwen3-0.6B-distill-step11492-epoch2.pth",
        "17238": "qwen3-0.6B-distill-step17238-epoch3.pth",
    }),
}


def download_qwen3_small(kind: str = "base", tokenizer_only: bool = False, out_dir=".") -> None:
    """The book's Qwen3-0.6B files: `kind` 'base' or 'reasoning'; weights (.pth) and tokenizer."""
    if kind not in QWEN3_SMALL_FILES:
        raise ValueError(f"kind must be 'base' or 'reasoning', got {kind!r}")
    for part in ["tokenizer"] if tokenizer_only else ["model", "tokenizer"]:
        name = QWEN3_SMALL_FILES[kind][part]
        download_file(f"{QWEN3_SMALL_REPO}/{name}", out_dir=out_dir,
                      backup_url=f"{QWEN3_SMALL_BACKUP}/{name}")


def _step_string(step) -> str:
    """'50' or 50 -> '00050' (the book's five-digit step numbers); other strings unchanged."""
    step = str(step)
    return step.zfill(5) if step.isdigit() else step


def download_qwen3_grpo_checkpoints(grpo_type: str = "no_kl", step="00050", out_dir="."):
    """One of the book's chapter 6-7 GRPO checkpoints (.pth, the book's parameter names)."""
    if grpo_type not in GRPO_CHECKPOINT_FOLDERS:
        raise ValueError(f"grpo_type must be one of {list(GRPO_CHECKPOINT_FOLDERS)}, "
                         f"got {grpo_type!r}")
    step = _step_string(step)
    name = f"qwen3-0.6B-rlvr-grpo-step{step}.pth"
    folder = GRPO_CHECKPOINT_FOLDERS[grpo_type]
    backup = None
    if grpo_type == "no_kl" and step == "00050":  # the one checkpoint with a mirror
        backup = f"{GRPO_CHECKPOINTS_BACKUP}/{folder}/{name}"
    return download_file(f"{GRPO_CHECKPOINTS_REPO}/{folder}/{name}", out_dir=out_dir,
                         backup_url=backup)


def download_qwen3_distill_checkpoints(distill_type: str = "deepseek_r1", step="06682",
                                       out_dir="."):
    """One of the book's chapter 8 distillation checkpoints (.pth, the book's names)."""
    if distill_type not in DISTILL_CHECKPOINTS:
        raise ValueError(f"distill_type must be one of {list(DISTILL_CHECKPOINTS)}, "
                         f"got {distill_type!r}")
    folder, files = DISTILL_CHECKPOINTS[distill_type]
    step = _step_string(step)
    if step not in files:
        raise ValueError(f"step must be one of {list(files)} for {distill_type}, got {step!r}")
    return download_file(f"{DISTILL_CHECKPOINTS_REPO}/{folder}/{files[step]}", out_dir=out_dir)
