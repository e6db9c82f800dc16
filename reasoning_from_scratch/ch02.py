"""Chapter 2 index: the Qwen3 model, tokenizer, weights and KV-cache generation (imports only).
Also the book's names for this chapter (docs/book_compatibility.md)."""

from .book import (
    generate_stats,
    generate_text_basic,
    generate_text_basic_cache,
    generate_text_basic_stream,
    generate_text_basic_stream_cache,
)
from .device import default_dtype, get_device
from .generation import (
    generate,
    generate_batch,
    sample_next_token,
    sample_response,
    sample_rollouts,
    top_p_filter,
)
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
