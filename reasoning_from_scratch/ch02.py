"""Chapter 2 index: the Qwen3 model, tokenizer, weights and KV-cache generation (imports only,
and the line that makes it a `book.BookIndex`). Also the book's names for this chapter; a name
the book defines is the book's function (docs/book_compatibility.md)."""

import sys

from .book import (
    BookIndex,
    generate_stats,
    generate_text_basic,
    generate_text_basic_cache,
    generate_text_basic_stream,
    generate_text_basic_stream_cache,
    sample_response,
)
from .device import default_dtype, get_device
from .generation import generate, generate_batch, sample_next_token, sample_rollouts, top_p_filter
from .qwen3 import (
    QWEN3_0_6B_CONFIG,
    QWEN_CONFIG_06_B,
    FeedForward,
    GroupedQueryAttention,
    KVCache,
    Qwen3Config,
    Qwen3Model,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    compute_rope_params,
    load_hf_weights_into_qwen,
    tiny_config,
)
from .tokenizer import END_THINK_TOKEN_ID, THINK_TOKEN_ID, Qwen3Tokenizer
from .weights import load_pretrained, save_pretrained

__all__ = [
    "generate_stats",
    "generate_text_basic",
    "generate_text_basic_cache",
    "generate_text_basic_stream",
    "generate_text_basic_stream_cache",
    "sample_response",
    "default_dtype",
    "get_device",
    "generate",
    "generate_batch",
    "sample_next_token",
    "sample_rollouts",
    "top_p_filter",
    "QWEN3_0_6B_CONFIG",
    "QWEN_CONFIG_06_B",
    "FeedForward",
    "GroupedQueryAttention",
    "KVCache",
    "Qwen3Config",
    "Qwen3Model",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "compute_rope_params",
    "load_hf_weights_into_qwen",
    "tiny_config",
    "END_THINK_TOKEN_ID",
    "THINK_TOKEN_ID",
    "Qwen3Tokenizer",
    "load_pretrained",
    "save_pretrained",
]

sys.modules[__name__].__class__ = BookIndex  # a book function replaced here reaches its callers
