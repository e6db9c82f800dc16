"""How much memory one process of a GRPO run holds, from a Qwen3 config: one formula per term.

docs/data_parallel.md's table comes from here, for the two data-parallel layouts the loop has:
replicated (every process holds the whole model, its gradients and AdamW state; training.py
with `distributed.py`) and sharded (`--fsdp`: 1/N of each, plus an unsharded replica that
samples; fsdp.py). Each term is a small function that says where its number comes from in the
code; `memory_per_process` adds them up in the dtypes the code uses (`run_dtypes`):

- weights, gradients, AdamW moments: the master weights' dtype (`--dtype`, float32 by default),
  whole when replicated, 1/N sharded (ZeRO stage 3, Rajbhandari et al., arXiv:1910.02054).
- sampler: the sampling dtype (`systems.sampler_dtype`: bf16 on CUDA, the master dtype on the
  CPU); the replicated path samples with the weights it trains when the two dtypes agree (no
  copy) and keeps a copy in the sampling dtype otherwise (`systems.sampling_replica`); the
  sharded path always has its unsharded replica.
- reference (beta > 0): a deep copy of the whole trained weights (`training._reference_model`):
  the master weights when replicated, the replica when sharded.
- KV cache: this process's share of a rollout batch, in the sampler's dtype.
- activations: what the update's backward pass keeps per micro-batch token, with and without
  activation checkpointing (`Qwen3Model.activation_checkpointing`), plus the lm_head's chunk of
  logits (`grpo.token_logprobs_and_entropy`).
- the unsharded root (sharded only): FSDP2 keeps the root module's gathered weights
  (embedding, final norm, an untied lm_head) from the forward to the backward pass, with their
  whole gradient until it is reduce-scattered, plus the gathered weights of the blocks in
  flight.

- the optimizer step: AdamW's temporaries (one more copy of the weights with CUDA's
  multi-tensor form, two of the largest tensor on the CPU).

The rollout phase, the update's passes and the optimizer step never overlap: their transient
terms (KV cache; activations, logits and the unsharded root; AdamW's temporaries) are not
added, the largest counts (`memory_per_process`).
"""

from __future__ import annotations

from .qwen3 import QWEN3_0_6B_CONFIG, Qwen3Config

# Published Qwen3 dense configs (Hugging Face Qwen/Qwen3-*/config.json): the memory table's rows.
QWEN3_SIZES = {
    "Qwen3-0.6B": QWEN3_0_6B_CONFIG,
    "Qwen3-1.7B": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8),
    "Qwen3-4B": Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8),
    "Qwen3-8B": Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8,
                            tie_word_embeddings=False),
}

GB = 1e9

# float32 copies of a (positions, vocabulary) block of logits alive at once while the backward
# pass recomputes one lm_head chunk (`grpo._logprob_entropy_chunk`: the logits, log_softmax,
# exp, p * log p and their gradients). Measured: 5.2 with 400 positions x 151,936.
LOGITS_COPIES = 5


# ----------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------

def block_parameters(cfg: Qwen3Config) -> int:
    """Parameters of one decoder block: q, k, v, o projections, the two QK-norms, the SwiGLU's
    three matrices and the block's two RMSNorms."""
    H, hd = cfg.hidden_size, cfg.head_dim
    attn = H * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 2 * hd
    return attn + 3 * H * cfg.intermediate_size + 2 * H


def root_parameters(cfg: Qwen3Config) -> int:
    """Parameters outside the blocks (FSDP's root module): the embedding, the final norm and an
    untied lm_head (a tied one is the embedding)."""
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + cfg.hidden_size + head


def count_parameters(cfg: Qwen3Config) -> int:
    """Trainable parameters of a Qwen3 dense model (lm_head counted once when tied)."""
    return cfg.num_hidden_layers * block_parameters(cfg) + root_parameters(cfg)


def run_dtypes(sharded: bool, device: str = "cuda", master_bytes: int = 4) -> dict[str, int]:
    """Bytes per element of what a run holds, as the code chooses them.

    master: the trained weights, their gradients and AdamW moments (`--dtype`: 4 by default).
    sample: what samples (`systems.sampler_dtype`'s auto: bf16 on CUDA, the master dtype on
    the CPU) and its KV cache. reference: the copy of the whole trained weights: the master
    dtype when replicated, the replica's when sharded. compute: the update's activations and
    gathered weights: bf16 on CUDA (autocast when replicated, FSDP's `mixed_precision` when
    sharded: `systems.autocast_dtype`); otherwise the master dtype.
    """
    low = 2 if device == "cuda" else master_bytes
    return {"master": master_bytes, "sample": low, "reference": low if sharded else master_bytes,
            "compute": low}


# ----------------------------------------------------------------------------------------------
# The terms
# ----------------------------------------------------------------------------------------------

def weights_bytes(cfg: Qwen3Config, world_size: int, sharded: bool, master_bytes: int) -> int:
    """The trained (master) weights: whole when replicated, 1/N of each tensor with FSDP."""
    return master_bytes * count_parameters(cfg) // (world_size if sharded else 1)


def gradients_bytes(cfg: Qwen3Config, world_size: int, sharded: bool, master_bytes: int) -> int:
    """Their gradients, kept from the backward pass to the next update's `zero_grad` (through
    the rollout phase between them): the weights' size and dtype, sharded like them."""
    return weights_bytes(cfg, world_size, sharded, master_bytes)


def adamw_bytes(cfg: Qwen3Config, world_size: int, sharded: bool, master_bytes: int) -> int:
    """AdamW's two moments per parameter (exp_avg, exp_avg_sq: Loshchilov & Hutter,
    arXiv:1711.05101) in the weights' dtype, sharded like them (the step counters are a
    scalar per tensor: not counted)."""
    return 2 * weights_bytes(cfg, world_size, sharded, master_bytes)


def sampler_bytes(cfg: Qwen3Config, sharded: bool, sample_bytes: int,
                  master_bytes: int = 4) -> int:
    """The copy that samples: the whole unsharded replica with FSDP (`fsdp.shard_with_replica`);
    when replicated, a copy only if the sampling dtype is not the master's
    (`systems.sampling_replica`), else none (the trained weights sample)."""
    copy = sharded or sample_bytes != master_bytes
    return sample_bytes * count_parameters(cfg) if copy else 0


def reference_bytes(cfg: Qwen3Config, sample_bytes: int, beta_positive: bool = True) -> int:
    """The frozen KL reference (beta > 0): `training._reference_model` deep-copies the model
    that samples, whole on every process, in its dtype."""
    return sample_bytes * count_parameters(cfg) if beta_positive else 0


def kv_cache_bytes(cfg: Qwen3Config, rows: int, tokens: int, dtype_bytes: int = 2) -> int:
    """Keys and values of `rows` sequences of `tokens` positions, every layer."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    return rows * tokens * per_token * dtype_bytes


def block_activation_bytes(cfg: Qwen3Config, compute_bytes: int, seq_len: int = 0) -> int:
    """Bytes one decoder block saves for its backward pass, per token (qwen3.py's block; the
    test reads them from autograd's saved tensors).

    Each RMSNorm of width d keeps its input in float32 (a float32 copy when computing in bf16,
    else the input itself) and a 1 / rms per row, and the weight product keeps the normalised
    input (compute dtype). Block norms: input, normalised, and the output the next projections
    keep (3H each). Attention: q (width qd = heads x head_dim) out of q_proj and its q_norm
    (1 + 1) and after RoPE (SDPA keeps it: 1), which keeps nothing of its own (its tables need
    no gradient); k the same (kd = kv_heads x head_dim); v (kd); SDPA's output, which o_proj
    keeps as its input (qd), and a log-sum-exp per head. SwiGLU: gate, silu(gate), up and
    their product (4 x intermediate). In bf16 each block also casts the rotary tables for q
    and k (4 x head_dim). seq_len: with an attention mask (left padding), SDPA keeps it as a
    float (one row of seq_len per token); 0 for plain causal attention.
    """
    H, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    qd, kd = nh * hd, nkv * hd
    fp32 = 2 * H + qd + kd + (2 + nh + nkv) + nh  # norm inputs, 1/rms per row, log-sum-exp
    compute = 4 * H + 3 * qd + 3 * kd + 4 * inter + seq_len
    if compute_bytes != 4:
        compute += 4 * hd  # the rotary tables cast to bf16 for q and for k
    return 4 * fp32 + compute_bytes * compute


def activation_bytes(cfg: Qwen3Config, tokens: int, compute_bytes: int,
                     checkpointing: bool = False, seq_len: int = 0) -> int:
    """What the update's backward pass holds for a micro-batch of `tokens` positions (rows x
    sequence length), at its peak.

    Without checkpointing every block's saved tensors (`block_activation_bytes`); with it
    (`Qwen3Model._block`) each block's input alone (H per token) plus one block's saved tensors
    while the backward pass recomputes it. Either way the rotary tables gathered per position
    (2 x head_dim, float32), the final norm's float32 input and 1 / rms, its normalised input,
    and the lm_head chunks' answer hidden states (H, counted for every position: an upper
    bound).
    """
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    block = block_activation_bytes(cfg, compute_bytes, seq_len)
    blocks = L * H * compute_bytes + block if checkpointing else L * block
    root = 4 * (2 * cfg.head_dim + H + 1) + 2 * H * compute_bytes
    return tokens * (blocks + root)


def logits_bytes(cfg: Qwen3Config, answer_tokens: int, chunk_size: int = 1024) -> int:
    """The lm_head's float32 logits of one chunk of answer positions (at most `chunk_size`),
    `LOGITS_COPIES` times: each chunk is checkpointed (`grpo.token_logprobs_and_entropy`), so
    only one is ever alive, recomputed in the backward pass."""
    return LOGITS_COPIES * min(answer_tokens, chunk_size) * cfg.vocab_size * 4


def unsharded_bytes(cfg: Qwen3Config, sharded: bool, compute_bytes: int,
                    master_bytes: int = 4) -> int:
    """FSDP's gathered weights during the update (0 when replicated, which holds them anyway).

    The root module keeps its all-gathered parameters from the forward to the backward pass
    (FSDP2 does not reshard the root after forward) and builds their whole gradient before the
    reduce-scatter, in the compute dtype, plus a copy in the master dtype to reduce when the
    two differ (bf16 compute, fp32 reduction); and two blocks are gathered at a time (the one
    computing and the one prefetched).
    """
    if not sharded:
        return 0
    root = root_parameters(cfg)
    cast = master_bytes * root if compute_bytes != master_bytes else 0
    return 2 * compute_bytes * root + cast + 2 * compute_bytes * block_parameters(cfg)


def optimizer_step_bytes(cfg: Qwen3Config, world_size: int, sharded: bool, master_bytes: int,
                         device: str = "cuda") -> int:
    """AdamW's temporaries while it steps (torch.optim.AdamW's defaults): on CUDA the
    multi-tensor ("foreach") form computes sqrt(exp_avg_sq) for every tensor at once, one more
    copy of all the weights it updates; on the CPU the per-tensor form holds two temporaries
    (the square root and its bias-corrected quotient) of one tensor at a time: the largest, the
    embedding (or its shard)."""
    share = world_size if sharded else 1
    if device == "cuda":
        return master_bytes * count_parameters(cfg) // share
    return 2 * master_bytes * cfg.vocab_size * cfg.hidden_size // share


# ----------------------------------------------------------------------------------------------
# The sum and the table
# ----------------------------------------------------------------------------------------------

def memory_per_process(cfg: Qwen3Config, world_size: int, sharded: bool, *,
                       device: str = "cuda", master_bytes: int = 4, reference: bool = True,
                       rollout_rows: int = 128, rollout_tokens: int = 1024,
                       micro_batch_rows: int = 4, sequence_tokens: int = 600,
                       answer_tokens: int | None = None, chunk_size: int = 1024,
                       activation_checkpointing: bool = False) -> dict[str, int]:
    """Bytes one of `world_size` processes holds at its peak in a GRPO run, term by term.

    rollout_rows x rollout_tokens: a step's rollouts (all processes together; each holds the
    KV cache of its share). micro_batch_rows x sequence_tokens: one micro-batch of the update
    (`--micro-batch-size` rows of prompt + answer); answer_tokens: of those, the answer
    positions the lm_head scores (default all). device: "cuda" or "cpu" (`run_dtypes`).
    "total" is the persistent terms (weights, gradients, AdamW, sampler, reference) plus the
    largest of the rollout phase (KV cache), the update's forward and backward passes
    (activations, logits, unsharded) and the optimizer step (its temporaries).
    """
    dt = run_dtypes(sharded, device, master_bytes)
    tokens = micro_batch_rows * sequence_tokens
    out = {
        "weights": weights_bytes(cfg, world_size, sharded, dt["master"]),
        "gradients": gradients_bytes(cfg, world_size, sharded, dt["master"]),
        "adamw": adamw_bytes(cfg, world_size, sharded, dt["master"]),
        "sampler": sampler_bytes(cfg, sharded, dt["sample"], dt["master"]),
        "reference": reference_bytes(cfg, dt["reference"], reference),
        "kv_cache": kv_cache_bytes(cfg, -(-rollout_rows // world_size), rollout_tokens,
                                   dt["sample"]),
        "activations": activation_bytes(cfg, tokens, dt["compute"], activation_checkpointing,
                                        sequence_tokens),
        "logits": logits_bytes(cfg, tokens if answer_tokens is None else answer_tokens,
                               chunk_size),
        "unsharded": unsharded_bytes(cfg, sharded, dt["compute"], dt["master"]),
        "optimizer_step": optimizer_step_bytes(cfg, world_size, sharded, dt["master"], device),
    }
    persistent = sum(out[k] for k in ("weights", "gradients", "adamw", "sampler", "reference"))
    update = out["activations"] + out["logits"] + out["unsharded"]
    out["total"] = persistent + max(out["kv_cache"], update, out["optimizer_step"])
    return out


def memory_table(world_sizes=(1, 2, 4, 8, 16), gpu_gb: float = 80.0, headroom_gb: float = 4.0,
                 **kwargs) -> str:
    """docs/data_parallel.md's table (markdown): GB per process on CUDA, replicated vs
    sharded, each Qwen3 size and process count, without and with activation checkpointing;
    `*` marks what fits a `gpu_gb` GPU with `headroom_gb` left for the allocator and CUDA's
    own memory. kwargs: `memory_per_process`'s run shape."""
    lines = ["| model | N | replicated GB | replicated, ckpt | FSDP GB | FSDP, ckpt "
             "| FSDP terms: shards / replica+ref / KV / act (ckpt) / root |",
             "|---|---|---|---|---|---|---|"]

    def cell(m):
        fits = m["total"] / GB <= gpu_gb - headroom_gb
        return f"{m['total'] / GB:.1f}{' *' if fits else ''}"

    for name, cfg in QWEN3_SIZES.items():
        for n in world_sizes:
            row = {(s, c): memory_per_process(cfg, n, s, activation_checkpointing=c, **kwargs)
                   for s in (False, True) for c in (False, True)}
            f, fc = row[True, False], row[True, True]
            terms = (f"{(f['weights'] + f['gradients'] + f['adamw']) / GB:.1f} / "
                     f"{(f['sampler'] + f['reference']) / GB:.1f} / {f['kv_cache'] / GB:.1f} / "
                     f"{f['activations'] / GB:.1f} ({fc['activations'] / GB:.1f}) / "
                     f"{f['unsharded'] / GB:.1f}")
            lines.append(f"| {name} | {n} | {cell(row[False, False])} | "
                         f"{cell(row[False, True])} | {cell(f)} | {cell(fc)} | {terms} |")
    return "\n".join(lines)
