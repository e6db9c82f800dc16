"""Text generation with a KV cache: one batched entry point (`generate`) and book-style wrappers.

- `generate`: batched decoding; greedy at temperature 0, otherwise temperature / top-k / top-p
  (nucleus) sampling with an optional `torch.Generator`; per-row stop at EOS; G samples of one
  prompt share one prefill (`num_return_sequences`, via `KVCache.expand`). Two speed knobs:
  `preallocate` (default on: the KV cache is allocated once for prompt + max_new_tokens and
  written in place, see `KVCache`) and `compile` (off by default: one static decode step, with
  the sampler inside, through `torch.compile`, see `_generate_static`).
  benchmarks/bench_generation.py times both.
- `sample_next_token` / `pick_token`: the sampler, and the same choice given its uniforms.
- `sample_response`: the book's single-sample contract `(full_token_ids, prompt_len, text)`.
- `sample_rollouts` / `sample_rollouts_batch`: G completions of one prompt (or of each of N
  prompts) decoded as one batch (GRPO rollouts).
- `generate_batch`: different prompts, left padded (evaluation).
- `TextStreamer`: a `generate` callback that prints the text of row 0 as it is produced.
- `ChatState` / `new_chat` / `chat_turn`: multi-turn chat in the tokenizer's chat template whose
  KV cache is kept between turns (each turn prefills only what the cache does not hold yet).

`tokenizer` is anything with `encode(str) -> list[int]`, `decode(ids, skip_special_tokens=...)`,
`eos_token_id` and `pad_token_id`.

Generation runs under `torch.no_grad()` rather than `torch.inference_mode()`: the returned ids are
fed to training forward passes (GRPO), and inference-mode tensors cannot be saved for backward.

Both decode loops call `interrupts.poll_for_stop()` every STOP_CHECK_EVERY tokens: inside a
training run's rollout or evaluation phase that is where a stop signal agreed by every process
abandons the phase (distributed.AgreedStop); anywhere else it does nothing.

`generate`'s arguments in detail:

- Rows stop independently at EOS (kept in the completion); later slots hold `pad_token_id`
  (default: the first EOS id, else 0) and are masked. Decoding ends when every row has
  finished or after `max_new_tokens`.
- `num_return_sequences=G`: the prompt is prefilled once and the cache expanded to G rows per
  prompt (rows b*G..b*G+G-1 belong to prompt b). `generator`: one torch.Generator, or B of
  them, generator b drawing for prompt b's G rows (`row_uniforms`).
- `callback(new_tokens (B*,), is_real (B*,))`, if given, is called after every step (used for
  streaming). `return_logprobs` records log softmax(logits / T) of every chosen token (T =
  temperature, 1 for greedy; before top-p/top-k, the distribution the trainer sees).
- `cache`: continue an existing KVCache (multi-turn chat): `input_ids` are then only the new
  tokens, prefilled on top of what it holds; on return it also holds every generated token but
  the last (which is never fed back). None (default): a fresh cache per call.
- `preallocate`: the fresh cache allocates its keys/values once, for P + max_new_tokens slots,
  and each step writes in place (`KVCache(max_len=...)`) instead of concatenating (O(T^2)
  copying); identical tokens. On a CPU both ran at the same speed within noise
  (benchmarks/bench_generation.py, tiny and 0.6B size, up to 416 cached positions); it is the
  default for its one allocation per call instead of one per step and layer. A given
  preallocated `cache` is grown once, up front, to hold this call's tokens too.
- `compile`: decode with one static, compiled step (`_generate_static`: fixed-shape cache
  buckets, sampling inside the step, EOS checked by the host every CHECK_EVERY tokens): the
  same tokens as eager under the same uniforms (the logits agree up to float rounding of fused
  kernels), faster steps once compiled, but each new shape bucket compiles first (seconds on a
  CPU). A given `cache` then holds the prompt only; a `callback` decodes eagerly.
  `compile_decoding(None, device)` turns it on for CUDA (launch-bound decode steps: the step's
  kernels run as one CUDA graph) and off elsewhere (on a CPU the small matmuls, the same
  compiled or not, dominate a step; see docs/speed.md for the measurements).

The sampler (`pick_token`) samples by inverse transform: the first token whose cumulative mass
reaches u ~ U(0, total], one random number per row (cheaper than torch.multinomial on a CPU);
u > 0 guarantees the chosen token has non-zero probability, and it works on unnormalised,
filtered probabilities. With top-p it samples in sorted order and maps the index back (the
filter of `top_p_filter` without its scatter and renormalisation), and skips the sort when
top_p is 1.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .interrupts import poll_for_stop
from .qwen3 import KVCache, StaticKVCache

__all__ = [
    "GenerationOutput",
    "Rollouts",
    "top_p_filter",
    "row_uniforms",
    "sample_next_token",
    "pick_token",
    "compile_decoding",
    "warm_up_decoding",
    "reserve_decoding",
    "generate",
    "sample_response",
    "sample_rollouts",
    "sample_rollouts_batch",
    "generate_batch",
    "left_pad",
    "Branches",
    "prefill_rows",
    "gather_cache_rows",
    "branch_continuations",
    "TextStreamer",
    "stop_token_ids",
    "chat_stop_ids",
    "ChatState",
    "ChatReply",
    "new_chat",
    "chat_turn",
]


@dataclass
class GenerationOutput:
    """Result of `generate`; B* = batch size * num_return_sequences."""

    sequences: torch.Tensor  # (B*, T_prompt + T_new) prompt (with its padding) + completion
    completion_ids: torch.Tensor  # (B*, T_new) padded after EOS with the pad id
    completion_mask: torch.Tensor  # (B*, T_new) bool, True for generated tokens incl. EOS
    lengths: torch.Tensor  # (B*,) number of real completion tokens
    truncated: torch.Tensor  # (B*,) bool, True if no EOS before max_new_tokens
    # (B*, T_new) log-prob of each sampled token under softmax(logits / T), the sampler's own
    # record (for truncated importance sampling); None unless return_logprobs
    logprobs: torch.Tensor | None = None


@dataclass
class Rollouts:
    """G sampled completions of one prompt (see `sample_rollouts`)."""

    prompt_ids: torch.Tensor  # (P,)
    completion_ids: torch.Tensor  # (G, T)
    completion_mask: torch.Tensor  # (G, T) bool, incl. EOS
    texts: list[str]  # decoded completions, special tokens kept, EOS stripped
    lengths: torch.Tensor  # (G,)
    truncated: torch.Tensor  # (G,) bool
    logprobs: torch.Tensor | None = None  # (G, T) sampler log-probs (return_logprobs), else None

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.numel()  # P

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def full_ids(self, i: int) -> torch.Tensor:
        """1-D prompt + completion i (incl. EOS, no padding), as `sample_response` returns."""
        completion = self.completion_ids[i, : int(self.lengths[i])]
        return torch.cat([self.prompt_ids, completion])


def _nucleus_keep(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask over descending-sorted probs: the smallest prefix with mass >= top_p."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of better tokens
    keep = mass_before < top_p  # the token that crosses top_p is still kept
    keep[..., 0] = True  # the most likely token always survives
    return keep


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens with total probability >= top_p; renormalise.

    Nucleus sampling (Holtzman et al., 2019, "The Curious Case of Neural Text Degeneration").
    probs: (B, V). The most likely token is always kept.
    """
    if top_p is None or top_p >= 1.0:
        return probs
    sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)  # (B, V)
    kept = sorted_probs * _nucleus_keep(sorted_probs, top_p)
    filtered = torch.zeros_like(probs).scatter(-1, sorted_idx, kept)
    return filtered / filtered.sum(dim=-1, keepdim=True)


# One torch.Generator for a whole batch, or a sequence of k generators where generator i draws
# the random numbers of rows i*B/k .. (i+1)*B/k - 1 (e.g. one per prompt of a GRPO step, so a
# group's samples do not depend on which other prompts share its batch).
Generators = torch.Generator | Sequence[torch.Generator] | None


def row_uniforms(n: int, generator: Generators, device) -> torch.Tensor:
    """(n, 1) uniform numbers in [0, 1): from one generator, or row blocks from a list of them."""
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        return torch.rand(n, 1, generator=generator, device=gen_device).to(device)
    k = len(generator)
    if k == 0 or n % k:
        raise ValueError(f"{k} generators cannot share {n} rows evenly")
    per = n // k  # rows drawn by each generator, in order
    return torch.cat([torch.rand(per, 1, generator=g, device=g.device).to(device)
                      for g in generator])


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int | None = None, generator: Generators = None) -> torch.Tensor:
    """One token per row (B,) of logits (B, V): argmax if temperature == 0, else sampled;
    `generator`: one torch.Generator, or k of them for B/k rows each (see `row_uniforms`)."""
    if _greedy(temperature):
        return logits.argmax(dim=-1)
    r = row_uniforms(logits.shape[0], generator, logits.device)  # (B, 1)
    return pick_token(logits, r, temperature, top_p, top_k)


def _greedy(temperature: float | None) -> bool:
    """Temperature 0 (or None) means argmax."""
    return temperature is None or temperature <= 0.0


def pick_token(logits: torch.Tensor, r: torch.Tensor | None, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """The token (B,) that `sample_next_token` picks from logits (B, V) given its uniforms r
    (B, 1) in [0, 1) (None when greedy): a pure function, so that the compiled decode step runs
    it with the uniforms drawn outside, and both paths agree (module notes: the sampler)."""
    if _greedy(temperature):
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature  # (B, V)
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    sorted_idx = None
    if top_p is not None and top_p < 1.0:  # top_p_filter's filter, in sorted order
        probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        probs = probs * _nucleus_keep(probs, top_p)
    # Inverse transform: the first token whose cumulative mass reaches u ~ U(0, total].
    cdf = probs.cumsum(dim=-1)  # (B, V)
    u = (1.0 - r) * cdf[:, -1:]  # (B, 1)
    choice = torch.searchsorted(cdf, u)  # (B, 1)
    if sorted_idx is not None:
        choice = sorted_idx.gather(-1, choice)
    return choice[:, 0]  # (B,)


def _token_logprob(logits: torch.Tensor, nxt: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[nxt] (B,), T = 1 when greedy: the sampler's own record."""
    scaled = logits.float() / (1 if _greedy(temperature) else temperature)
    return torch.log_softmax(scaled, -1).gather(-1, nxt[:, None])[:, 0]


def _decode_logits(model, token_ids: torch.Tensor, is_real: torch.Tensor, cache: KVCache):
    """Next-token logits (B, V) after feeding one token per row, token_ids/is_real (B, 1)."""
    return model(token_ids, is_real, cache, last_only=True)[:, -1]


# ----------------------------------------------------------------------------- compiled decoding

# The host looks at "has every row finished?" (a device sync) once per this many tokens; the
# steps in between run on rows that may all have finished, masked like any finished row.
CHECK_EVERY = 16
# Both decode loops look at the run's stop (`interrupts.poll_for_stop`: in a data-parallel run
# one small all-reduce, a host sync, that every process answers) once per this many tokens,
# from the first: a phase of minutes stops within this many tokens of a stop signal.
STOP_CHECK_EVERY = CHECK_EVERY


@dataclass
class _DecodeState:
    """What the static decode step reads and writes in place, R (bucketed) rows, N new tokens."""

    token: torch.Tensor  # (R,) long, the last token chosen (fed next)
    real: torch.Tensor  # (R,) bool, whether it is a real token (its row had not finished)
    finished: torch.Tensor  # (R,) bool, the row has produced an EOS
    col: torch.Tensor  # (1,) long, the output column the next token goes to
    ids: torch.Tensor  # (R, N) long, the chosen tokens (padding after EOS)
    mask: torch.Tensor  # (R, N) bool, real tokens
    logps: torch.Tensor  # (R, N) float, sampler log-probs (zeros unless recorded)
    uniforms: torch.Tensor  # (R, 1) float, this token's draws (zeros for empty rows)

    def tensors(self) -> list[torch.Tensor]:
        return [self.token, self.real, self.finished, self.col, self.ids, self.mask, self.logps,
                self.uniforms]

    def reset(self, pad_token_id: int, rows: int) -> None:
        """A fresh start for `rows` real rows; the others are empty, finished from the start."""
        self.token.fill_(pad_token_id)
        self.real.zero_()
        self.finished.copy_(torch.arange(self.finished.shape[0], device=self.finished.device)
                            >= rows)
        self.col.zero_()
        self.ids.fill_(pad_token_id)
        self.mask.zero_()
        self.logps.zero_()
        self.uniforms.zero_()


def _record(state: _DecodeState, logits, r, temperature, top_p, top_k, eos, pad_token_id,
            return_logprobs: bool) -> None:
    """Choose each row's next token from logits (R, V) and record it at column `state.col`;
    a row that had finished gets the pad id, masked. Same rule as the eager loop."""
    nxt = pick_token(logits, r, temperature, top_p, top_k)  # (R,)
    if return_logprobs:
        state.logps.index_copy_(1, state.col, _token_logprob(logits, nxt, temperature)[:, None])
    is_real = ~state.finished
    nxt = torch.where(is_real, nxt, torch.full_like(nxt, pad_token_id))
    if eos is not None:
        state.finished.copy_(state.finished | torch.isin(nxt, eos))
    state.ids.index_copy_(1, state.col, nxt[:, None])
    state.mask.index_copy_(1, state.col, is_real[:, None])
    state.token.copy_(nxt)
    state.real.copy_(is_real)
    state.col.add_(1)


def _static_step(model, cache: StaticKVCache, state: _DecodeState, r, temperature, top_p, top_k,
                 eos, pad_token_id, return_logprobs: bool) -> None:
    """One decode step on fixed shapes: feed the last token, choose and record the next one.
    Everything is written in place and nothing is returned, so the step makes no host sync and
    (under CUDA graphs) no output is overwritten by the next replay."""
    logits = model.decode_static(state.token, state.real, cache)  # (R, V)
    _record(state, logits, r, temperature, top_p, top_k, eos, pad_token_id, return_logprobs)


# torch.compile of `_static_step` per compile mode, made on first use (building it imports the
# compiler). One compiled function serves every model (the model is an argument, guarded):
# each model, shape bucket and sampling setting compiles once.
_COMPILED: dict = {}
# model -> why compiling its decode step failed; its later steps run eagerly, without retrying.
_COMPILE_FAILURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Compiled graphs one process may keep for the decode step (torch's default limit is 8): a run
# has a few row buckets x prompt buckets x sampling settings (rollouts, evaluation, scorers).
RECOMPILE_LIMIT = 64


def _compiled_step(model, device: torch.device) -> Callable[..., None]:
    """`_static_step` through `torch.compile(fullgraph=True, dynamic=False)` (and CUDA graphs,
    mode="reduce-overhead", on CUDA), or eagerly, with one warning per model, if compiling
    fails. With fullgraph a failure is raised while tracing, before the step ran, so the state
    is untouched and the same step runs eagerly."""
    mode = "reduce-overhead" if device.type == "cuda" else None

    def step(*args) -> None:
        if model not in _COMPILE_FAILURES:
            try:
                if mode not in _COMPILED:
                    _COMPILED[mode] = torch.compile(_static_step, fullgraph=True, dynamic=False,
                                                    mode=mode)
                limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
                with torch._dynamo.config.patch(recompile_limit=limit):
                    return _COMPILED[mode](model, *args)
            except Exception as e:  # compiler missing, unsupported op, recompile limit hit
                why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                _COMPILE_FAILURES[model] = why
                warnings.warn(f"torch.compile of the decode step failed ({why}); decoding "
                              "eagerly", RuntimeWarning, stacklevel=3)
        return _static_step(model, *args)

    return step


def compile_decoding(compile: bool | None, device) -> bool:
    """Whether to decode with the compiled step: `compile`, or for None on CUDA only (module
    notes: `compile`)."""
    return torch.device(device).type == "cuda" if compile is None else bool(compile)


def _bucket(n: int, smallest: int) -> int:
    """The power of two >= max(n, smallest): the shape a compiled graph is made for."""
    return 1 << (max(n, smallest) - 1).bit_length()


def _generator_list(generator: Generators, device: torch.device) -> list[torch.Generator]:
    """The generators `row_uniforms` draws from (the device's default one for None)."""
    if generator is None:
        if device.type == "cuda":
            return [torch.cuda.default_generators[device.index or torch.cuda.current_device()]]
        return [torch.default_generator]
    return [generator] if isinstance(generator, torch.Generator) else list(generator)


@dataclass
class _KVStorage:
    """The key/value memory of one row bucket R: per layer one flat tensor with room for
    `slots` slots, which every length bucket of those rows views from its start (each view
    `(R, H_kv, L, D)` contiguous, at the storage's own address). Decode calls run one at a time
    and each fills its view anew (`StaticKVCache.fill`), so the length buckets can share it:
    one allocation per row bucket instead of one per shape, and every shape's addresses stay
    the same for as long as the storage does (a CUDA graph replays only at the addresses it
    was recorded with)."""

    keys: list[torch.Tensor]  # per layer (R * H_kv * slots * D,)
    values: list[torch.Tensor]
    rows: int
    heads: int
    head_dim: int
    slots: int

    @classmethod
    def allocate(cls, layers: int, rows: int, heads: int, slots: int, head_dim: int, dtype,
                 device) -> _KVStorage:
        n = rows * heads * slots * head_dim
        new = [torch.zeros(n, dtype=dtype, device=device) for _ in range(2 * layers)]
        return cls(new[:layers], new[layers:], rows, heads, head_dim, slots)

    def views(self, slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(keys, values) per layer as (R, H_kv, slots, D) views of the first elements."""
        n, shape = self.rows * self.heads * slots * self.head_dim, \
            (self.rows, self.heads, slots, self.head_dim)
        return [t[:n].view(shape) for t in self.keys], [t[:n].view(shape) for t in self.values]


@dataclass
class _DecodeBuffers:
    """Everything the compiled decode step of one model reads and writes, kept between calls:
    the KV storage of each row bucket and, per shape (rows, slots, new tokens), its
    StaticKVCache (views of that storage and its own masks and positions) and _DecodeState.
    A shape's tensors are allocated once, when first met, and reused by every later call (and
    with a larger storage, made when a longer shape of the same rows comes, once more)."""

    # (R, layers, H_kv, D, dtype, device) -> _KVStorage
    storage: dict = field(default_factory=dict)
    # (L, N, *storage key) -> (StaticKVCache, _DecodeState, the _KVStorage it views)
    shapes: dict = field(default_factory=dict)
    allocations: int = 0  # shapes given new tensors so far (a pointer-stability check counts them)


# model -> _DecodeBuffers. Weak: a model's buffers go with it.
_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Shapes whose small tensors (masks, positions, token records) a model keeps; a run meets a few
# (rollouts, evaluation batches) and the Monte-Carlo scorers a few more. The KV memory is per
# row bucket and not counted here.
_SHAPES_PER_MODEL = 64


def _kv_storage(buffers: _DecodeBuffers, skey, layers, R, H, L, D, dtype, dev) -> _KVStorage:
    """The row bucket's storage, made (or made larger, dropping the shapes that viewed the old
    one) when it has fewer than L slots."""
    old = buffers.storage.get(skey)
    if old is not None and old.slots >= L:
        return old
    for key in [k for k, (_, _, held) in buffers.shapes.items() if held is old]:
        del buffers.shapes[key]  # views of the storage about to be freed
    buffers.storage[skey] = _KVStorage.allocate(layers, R, H, L, D, dtype, dev)
    return buffers.storage[skey]


def _mark_fixed_addresses(tensors: Sequence[torch.Tensor]) -> None:
    """Tell torch.compile that these inputs of the decode step keep their addresses across
    calls (`torch._dynamo.mark_static_address`), on CUDA: the step's CUDA graph then reads and
    writes them where they are, instead of copying them into its own memory before every
    replay, and a graph that writes an input not so marked would not be a CUDA graph at all.
    Elsewhere nothing is recorded, so nothing is marked."""
    for t in tensors:
        if t.device.type == "cuda":
            torch._dynamo.mark_static_address(t)


def _storage_key(R, layers, H, D, dtype, dev) -> tuple:
    return (R, layers, H, D, dtype, torch.device(dev))


def reserve_decoding(model, shapes: Sequence[tuple[int, int, int]]) -> None:
    """Give each row bucket of `shapes` ((rows, prompt length, new tokens) of the compiled
    decode calls to come) its KV storage now, at the most slots any of them needs, so that no
    later call makes it larger (a larger storage gives that bucket's shapes new addresses,
    which a CUDA graph has to record again). The training loop's warm-up calls it with every
    rollout and evaluation shape of the run."""
    cfg, buffers = model.cfg, _BUFFERS.setdefault(model, _DecodeBuffers())
    most: dict[int, int] = {}
    for rows, length, new_tokens in shapes:
        R = _bucket(rows, 1)
        most[R] = max(most.get(R, 0), _bucket(length, 16) + _bucket(new_tokens, 16))
    for R, L in most.items():
        skey = _storage_key(R, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                            model.dtype, model.device)
        _kv_storage(buffers, skey, cfg.num_hidden_layers, R, cfg.num_key_value_heads, L,
                    cfg.head_dim, model.dtype, model.device)


def _buffers(model, prefill: KVCache, R: int, L: int, N: int):
    """The (StaticKVCache, _DecodeState) for R rows, L slots and N new tokens: the ones this
    model decoded the shape with before, else new ones (on CUDA marked as fixed addresses)."""
    k = prefill.keys[0]
    layers, H, D, dtype, dev = len(prefill.keys), k.shape[1], k.shape[3], k.dtype, k.device
    skey = _storage_key(R, layers, H, D, dtype, dev)
    key = (L, N, *skey)
    buffers = _BUFFERS.setdefault(model, _DecodeBuffers())
    store = _kv_storage(buffers, skey, layers, R, H, L, D, dtype, dev)
    if key in buffers.shapes:
        buffers.shapes[key] = buffers.shapes.pop(key)  # most recently used last
        return buffers.shapes[key][:2]
    keys, values = store.views(L)
    static = StaticKVCache(keys, values, torch.zeros(R, L, dtype=torch.bool, device=dev),
                           torch.zeros(R, dtype=torch.long, device=dev),
                           torch.zeros(1, dtype=torch.long, device=dev))
    state = _DecodeState(
        token=torch.zeros(R, dtype=torch.long, device=dev),
        real=torch.zeros(R, dtype=torch.bool, device=dev),
        finished=torch.zeros(R, dtype=torch.bool, device=dev),
        col=torch.zeros(1, dtype=torch.long, device=dev),
        ids=torch.zeros(R, N, dtype=torch.long, device=dev),
        mask=torch.zeros(R, N, dtype=torch.bool, device=dev),
        logps=torch.zeros(R, N, dtype=torch.float32, device=dev),
        uniforms=torch.zeros(R, 1, dtype=torch.float32, device=dev))
    _mark_fixed_addresses([*static.tensors(), *state.tensors()])
    while len(buffers.shapes) >= _SHAPES_PER_MODEL:
        buffers.shapes.pop(next(iter(buffers.shapes)))  # the least recently used shape
    buffers.shapes[key] = static, state, store
    buffers.allocations += 1
    return static, state


def _generate_static(model, input_ids, attention_mask, cache, G, max_new_tokens, temperature,
                     top_p, top_k, eos, pad_token_id, generator, return_logprobs,
                     steps: int | None = None):
    """`generate`'s compiled path -> (ids (B*, T), mask (B*, T), logps (B*, T), finished (B*,)).

    The prompt is prefilled eagerly (its length changes every call; on top of `cache` if one is
    given, which is not extended past the prompt), then copied into a StaticKVCache of a
    bucketed shape: rows padded to a power of two (empty rows, finished from the start) and
    length = prompt bucket + new-token bucket (powers of two >= 16), so calls with other prompt
    lengths or budgets in the same buckets reuse the compiled step; exactly `max_new_tokens`
    steps run. The uniforms are drawn on
    the host side exactly as the eager loop draws them (`row_uniforms`, one (B*, 1) per token);
    when every row has finished before the check, the generators are rewound to where the eager
    loop would have stopped drawing, so a generator shared by later calls sees the same state.
    `steps`: stop after this many tokens (a warm-up: `warm_up_decoding`).
    """
    dev = input_ids.device
    B, P = input_ids.shape
    BG, N = B * G, max_new_tokens
    prefill = KVCache(model.cfg.num_hidden_layers) if cache is None else cache
    P += prefill.seq_len  # slots the prompt's cache will hold
    R, P_bucket, N_bucket = _bucket(BG, 1), _bucket(P, 16), _bucket(N, 16)
    logits = model(input_ids, attention_mask, prefill, last_only=True)[:, -1]  # (B, V)
    if G > 1:
        prefill.expand(G)
        logits = logits.repeat_interleave(G, dim=0)  # (B*G, V)
    static, state = _buffers(model, prefill, R, P_bucket + N_bucket, N_bucket)
    static.fill(prefill, start=P_bucket - P)
    state.reset(pad_token_id, BG)
    del prefill, cache
    sampling = not _greedy(temperature)
    gens = _generator_list(generator, dev) if sampling else []

    def uniforms() -> torch.Tensor | None:  # (R, 1) this token's draws, zeros for empty rows
        if not sampling:
            return None
        state.uniforms[:BG].copy_(row_uniforms(BG, generator, dev))  # a fixed address
        return state.uniforms

    step = _compiled_step(model, dev)
    setting = (temperature, top_p, top_k, eos, pad_token_id, return_logprobs)
    last = N - 1  # the last step the eager loop runs
    for s in range(N if steps is None else min(N, steps)):
        if s % STOP_CHECK_EVERY == 0:
            poll_for_stop()
        if s % CHECK_EVERY == 0:
            window, saved = s, [g.get_state() for g in gens]
        r = uniforms()
        if s == 0:  # the first token comes from the prefill's logits
            first = logits if R == BG else torch.cat([logits, logits.new_zeros(R - BG,
                                                                              logits.shape[1])])
            _record(state, first, r, *setting)
        else:
            step(static, state, r, *setting)
        if eos is not None and (s % CHECK_EVERY == CHECK_EVERY - 1 or s == N - 1) \
                and bool(state.finished[:BG].all()):
            last = int(state.mask[:BG].sum(dim=1).max()) - 1  # where the eager loop stopped
            for g, st in zip(gens, saved):  # rewind; redraw what the eager loop drew
                g.set_state(st)
            for _ in range(window, last + 1):
                row_uniforms(BG, generator, dev)
            break
    T = last + 1
    return (state.ids[:BG, :T].clone(), state.mask[:BG, :T].clone(),
            state.logps[:BG, :T].clone(), state.finished[:BG].clone())


@torch.no_grad()
def warm_up_decoding(model, shapes: Sequence[tuple[int, int]], max_new_tokens: int,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = None,
                     eos_token_id: int | Sequence[int] | None = None,
                     return_logprobs: bool = False) -> int:
    """Compile `generate(compile=True)`'s decode step now for every (rows, prompt length) in
    `shapes` (each distinct bucket once), with the sampling settings that later calls will use,
    so that those calls make no new graph. Runs two tokens of a dummy prompt per bucket, on the
    model's current mode (call it as the decoding will run, e.g. in eval mode). Draws from its
    own generator: the caller's random state is untouched. Returns the buckets warmed up."""
    dev = model.device
    # the longest first: each row bucket's KV storage is then made once, at its largest
    buckets = sorted({(_bucket(rows, 1), _bucket(length, 16)) for rows, length in shapes},
                     key=lambda b: (b[0], -b[1]))
    eos = _eos_tensor(eos_token_id, dev)
    pad = int(eos[0]) if eos is not None else 0
    for rows, length in buckets:
        ids = torch.full((rows, length), pad, dtype=torch.long, device=dev)
        mask = torch.ones(rows, length, dtype=torch.bool, device=dev)
        _generate_static(model, ids, mask, None, 1, max_new_tokens, temperature, top_p, top_k,
                         eos, pad, torch.Generator(dev).manual_seed(0), return_logprobs,
                         steps=2)
    return len(buckets)


def _eos_tensor(eos_token_id, device) -> torch.Tensor | None:
    """The stop ids as a (K,) long tensor, None for no stop id."""
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int | None = None, eos_token_id: int | Sequence[int] | None = None,
             generator: Generators = None, num_return_sequences: int = 1,
             pad_token_id: int | None = None,
             callback: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
             return_logprobs: bool = False, cache: KVCache | None = None,
             preallocate: bool = True, compile: bool = False) -> GenerationOutput:
    """Batched KV-cache decoding of `input_ids` (B, P), left padded per `attention_mask`, G =
    `num_return_sequences` samples per prompt sharing one prefill -> B* = B*G rows; each row
    stops at its EOS. The arguments in detail: the module docstring."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty (B, P) tensor, got {input_ids.shape}")
    dev = input_ids.device
    eos = _eos_tensor(eos_token_id, dev)
    if pad_token_id is None:
        pad_token_id = int(eos[0]) if eos is not None else 0
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    attention_mask = attention_mask.to(device=dev, dtype=torch.bool)
    G = num_return_sequences
    prompts = input_ids.repeat_interleave(G, dim=0) if G > 1 else input_ids  # (B*, P)
    args = (model, input_ids, attention_mask, cache, G, max_new_tokens, temperature, top_p,
            top_k, eos, pad_token_id, generator, return_logprobs)
    if max_new_tokens <= 0:
        ids, mask, logps, finished = _no_new_tokens(prompts)
    elif compile and callback is None:  # the fast path: one compiled, fixed-shape decode step
        ids, mask, logps, finished = _generate_static(*args)
    else:
        ids, mask, logps, finished = _generate_eager(*args, callback, preallocate)
    return GenerationOutput(
        sequences=torch.cat([prompts, ids], dim=1),
        completion_ids=ids,
        completion_mask=mask,
        lengths=mask.sum(dim=1),
        truncated=~finished,
        logprobs=logps * mask if return_logprobs else None,
    )


def _no_new_tokens(prompts: torch.Tensor):
    """`generate`'s result for max_new_tokens <= 0: (ids, mask, logps) (B*, 0), finished (B*,)."""
    BG, dev = prompts.shape[0], prompts.device
    return (prompts.new_zeros(BG, 0), torch.zeros(BG, 0, dtype=torch.bool, device=dev),
            torch.zeros(BG, 0, device=dev), torch.zeros(BG, dtype=torch.bool, device=dev))


def _generate_eager(model, input_ids, attention_mask, cache, G, max_new_tokens, temperature,
                    top_p, top_k, eos, pad_token_id, generator, return_logprobs, callback,
                    preallocate):
    """`generate`'s plain loop -> (ids (B*, T), mask (B*, T), logps (B*, T), finished (B*,)):
    one forward per token over the filled part of `cache`, stopping as soon as every row has
    finished (checked after every token)."""
    if cache is None:
        cache = KVCache(model.cfg.num_hidden_layers, max_len=0 if preallocate else None)
    cache.reserve(cache.seq_len + input_ids.shape[1] + max_new_tokens)  # no step re-allocates
    logits = model(input_ids, attention_mask, cache, last_only=True)[:, -1]  # (B, V)
    if G > 1:
        cache.expand(G)  # G rollouts share this prefill
        logits = logits.repeat_interleave(G, dim=0)  # (B*, V)
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    tokens, real, logps = [], [], []  # per step (B*,)
    for step in range(max_new_tokens):
        if step % STOP_CHECK_EVERY == 0:
            poll_for_stop()  # a stop agreed by every process abandons the phase here
        nxt = sample_next_token(logits, temperature, top_p, top_k, generator)  # (B*,)
        if return_logprobs:
            logps.append(_token_logprob(logits, nxt, temperature))
        is_real = ~finished  # finished rows keep flowing through the batch as masked padding
        nxt = torch.where(is_real, nxt, torch.full_like(nxt, pad_token_id))
        tokens.append(nxt)
        real.append(is_real)
        if eos is not None:
            finished = finished | torch.isin(nxt, eos)
        if callback is not None:
            callback(nxt, is_real)
        if step == max_new_tokens - 1 or (eos is not None and bool(finished.all())):
            break
        logits = _decode_logits(model, nxt[:, None], is_real[:, None], cache)  # (B*, V)
    mask = torch.stack(real, dim=1)  # (B*, T)
    return (torch.stack(tokens, dim=1), mask,
            torch.stack(logps, dim=1) if logps else torch.zeros(mask.shape, device=mask.device),
            finished)


def stop_token_ids(tokenizer) -> list[int]:
    """All EOS ids of a tokenizer (Qwen3 instruct models stop at <|im_end|> or <|endoftext|>)."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return [int(i) for i in ids]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _encode(tokenizer, prompt: str, device) -> torch.Tensor:
    ids = tokenizer.encode(prompt)
    if len(ids) == 0:
        raise ValueError("the prompt encodes to zero tokens")
    return torch.tensor(ids, dtype=torch.long, device=device)


def _decode_completion(tokenizer, ids: torch.Tensor, mask: torch.Tensor, truncated: bool) -> str:
    """Decode the real tokens of one completion, special tokens kept, final EOS dropped."""
    ids = ids[mask].tolist()
    if not truncated and ids:
        ids = ids[:-1]  # the EOS that ended it
    return tokenizer.decode(ids, skip_special_tokens=False)


def sample_response(
    model,
    tokenizer,
    prompt: str,
    device,
    max_new_tokens: int = 512,
    temperature: float = 0.8,
    top_p: float = 0.9,
    generator: torch.Generator | None = None,
    top_k: int | None = None,
) -> tuple[torch.Tensor, int, str]:
    """One completion: (prompt + completion ids incl. EOS (1-D), prompt_len, text w/o EOS)."""
    prompt_ids = _encode(tokenizer, prompt, device)
    out = generate(
        model,
        prompt_ids[None],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_token_id=stop_token_ids(tokenizer),
        generator=generator,
    )
    completion = out.completion_ids[0, : int(out.lengths[0])]
    text = _decode_completion(
        tokenizer, out.completion_ids[0], out.completion_mask[0], bool(out.truncated[0])
    )
    return torch.cat([prompt_ids, completion]), prompt_ids.numel(), text


def left_pad(encoded: list[list[int]], pad_token_id: int | None):
    """Stack token lists flush right -> (input_ids (N, P), attention_mask (N, P) bool)."""
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompts[{i}] encodes to zero tokens")
    P = max(len(ids) for ids in encoded)
    pad = 0 if pad_token_id is None else pad_token_id  # any valid id: padded slots are masked
    input_ids = torch.full((len(encoded), P), pad, dtype=torch.long)
    attention_mask = torch.zeros(len(encoded), P, dtype=torch.bool)
    for i, ids in enumerate(encoded):
        input_ids[i, P - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, P - len(ids) :] = True
    return input_ids, attention_mask


def _generate_from_texts(model, tokenizer, prompts, device, num_return_sequences, **sampling):
    """Encode and left-pad `prompts`, `generate`, decode -> (encoded, GenerationOutput, texts);
    texts keep special tokens (so `<think>` stays visible) and drop the EOS that ended a row."""
    encoded = [tokenizer.encode(p) for p in prompts]
    input_ids, attention_mask = left_pad(encoded, getattr(tokenizer, "pad_token_id", None))
    out = generate(model, input_ids.to(device), attention_mask.to(device),
                   eos_token_id=stop_token_ids(tokenizer),
                   num_return_sequences=num_return_sequences, **sampling)
    texts = [_decode_completion(tokenizer, ids, m, bool(t))
             for ids, m, t in zip(out.completion_ids, out.completion_mask, out.truncated)]
    return encoded, out, texts


def sample_rollouts_batch(model, tokenizer, prompts: list[str], num_rollouts: int, device,
                          max_new_tokens: int = 512, temperature: float = 0.8,
                          top_p: float = 0.9, top_k: int | None = None,
                          generator: Generators = None, return_logprobs: bool = False,
                          compile: bool = False) -> list[Rollouts]:
    """G = num_rollouts completions of each of N prompts, decoded as one (N*G)-row batch: each
    prompt prefilled once (left padded among the N), its cache row repeated G times.
    `return_logprobs`: each Rollouts carries the sampler's token log-probs (see `generate`).
    `generator`: one for the whole batch, or N (one per prompt, drawing for its G rows): then a
    prompt's rollouts are the same whichever prompts share the batch (data-parallel GRPO).
    `compile`: `generate`'s compiled decode step (the same tokens)."""
    encoded, out, texts = _generate_from_texts(
        model, tokenizer, prompts, device, num_rollouts, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, generator=generator,
        return_logprobs=return_logprobs, compile=compile)
    groups = []
    for n, ids in enumerate(encoded):
        rows = slice(n * num_rollouts, (n + 1) * num_rollouts)  # prompt n's G rows
        lengths = out.lengths[rows]  # (G,)
        T = int(lengths.max()) if lengths.numel() else 0  # drop columns only other groups used
        completion_ids, mask = out.completion_ids[rows, :T], out.completion_mask[rows, :T]
        logprobs = None if out.logprobs is None else out.logprobs[rows, :T]  # (G, T)
        prompt_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (P,)
        groups.append(Rollouts(prompt_ids, completion_ids, mask, texts[rows], lengths,
                               out.truncated[rows], logprobs))
    return groups


def sample_rollouts(
    model,
    tokenizer,
    prompt: str,
    num_rollouts: int,
    device,
    max_new_tokens: int = 512,
    temperature: float = 0.8,
    top_p: float = 0.9,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Rollouts:
    """G = num_rollouts completions of one prompt: one prefill, decoded as one batch."""
    return sample_rollouts_batch(
        model,
        tokenizer,
        [prompt],
        num_rollouts,
        device,
        max_new_tokens,
        temperature,
        top_p,
        top_k,
        generator,
    )[0]


def generate_batch(
    model,
    tokenizer,
    prompts: list[str],
    device,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    compile: bool = False,
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Complete different prompts in one left-padded batch -> (texts, ids, mask); `compile`:
    `generate`'s compiled decode step."""
    _, out, texts = _generate_from_texts(
        model,
        tokenizer,
        prompts,
        device,
        1,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        generator=generator,
        compile=compile,
    )
    return texts, out.completion_ids, out.completion_mask


@dataclass
class Branches:
    """Continuations sampled by `branch_continuations`, one per requested (sequence, cut)."""

    ids: list[list[int]]  # generated tokens of each continuation (EOS kept, padding dropped)
    truncated: list[bool]  # True where a continuation used its whole budget without EOS
    generated_tokens: int  # tokens decoded, budgets' overrun included (the real work)
    prefill_tokens: int  # tokens run through the model to build the shared prefixes


@torch.no_grad()
def prefill_rows(model, sequences: Sequence[Sequence[int]], device=None) -> KVCache:
    """One forward pass over `sequences` (right padded) -> a grow-mode KVCache of all of them.

    Row b holds the keys/values of sequences[b] in its first len(sequences[b]) slots; the
    padding slots after them are masked and never read by `gather_cache_rows`.
    """
    device = device or next(model.parameters()).device
    S = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), S, dtype=torch.long)
    mask = torch.zeros(len(sequences), S, dtype=torch.bool)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[b, : len(seq)] = True
    cache = KVCache(model.cfg.num_hidden_layers)
    model.forward_hidden(ids.to(device), mask.to(device), cache)  # fills the cache
    return cache


def gather_cache_rows(cache: KVCache, rows: Sequence[int], lengths: Sequence[int]) -> KVCache:
    """A new left-padded cache whose row r holds the first lengths[r] slots of cache row rows[r].

    Keys keep the rotary positions they were computed at, and `next_pos` = lengths[r], so
    decoding from the new cache equals decoding from a prefill of those prefixes (tested).
    """
    dev = cache.key_mask.device
    S = max(lengths)  # R = len(rows) rows of S slots
    n = torch.tensor(list(lengths), dtype=torch.long, device=dev)  # (R,)
    src = torch.tensor(list(rows), dtype=torch.long, device=dev)  # (R,)
    slot = torch.arange(S, device=dev)[None, :] - (S - n)[:, None]  # (R, S) source slot
    real = slot >= 0  # left padding where negative
    slot = slot.clamp(min=0)
    out = KVCache(cache.num_layers)
    for i in range(cache.num_layers):
        for name in ("keys", "values"):
            x = getattr(cache, name)[i][src]  # (R, H_kv, S0, D)
            idx = slot[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
            y = x.gather(2, idx) * real[:, None, :, None]  # (R, H_kv, S, D), zero padding
            getattr(out, name)[i] = y
    out.key_mask = real  # (R, S)
    out.next_pos = n.clone()  # (R,) real tokens held = next position
    return out


@torch.no_grad()
def branch_continuations(
    model,
    sequences: Sequence[Sequence[int]],
    cuts: Sequence[tuple[int, int]],
    max_new_tokens: int | Sequence[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    batch_size: int = 64,
    compile: bool = False,
) -> Branches:
    """One sampled continuation of `sequences[i][:n]` for every `(i, n)` in `cuts`.

    Every sequence is prefilled once, up to its longest cut (`prefill_rows`); each continuation
    then starts from a copy of that cache cut to n - 1 slots (`gather_cache_rows`) and feeds the
    prefix's last token, so a prefix is never recomputed however many continuations or step
    boundaries share it (the tree of VinePPO's Monte-Carlo values, arXiv 2410.01679,
    branches from one computed trunk). `max_new_tokens`: one budget, or one per cut (rows are
    batched by budget, so a short budget does not wait for long ones). `compile`: `generate`'s
    compiled decode step (the same tokens). Returns `Branches`.
    """
    budgets = ([int(max_new_tokens)] * len(cuts) if isinstance(max_new_tokens, int)
               else [int(b) for b in max_new_tokens])
    if len(budgets) != len(cuts):
        raise ValueError(f"branch_continuations: {len(budgets)} budgets for {len(cuts)} cuts")
    for i, n in cuts:
        if not 1 <= n <= len(sequences[i]):
            raise ValueError(f"branch_continuations: cut {n} outside sequence {i} "
                             f"(length {len(sequences[i])})")
    out_ids: list[list[int]] = [[] for _ in cuts]
    out_trunc = [False] * len(cuts)
    if not cuts:
        return Branches(out_ids, out_trunc, 0, 0)
    used = sorted({i for i, _ in cuts})
    trunk = {i: max(n for j, n in cuts if j == i) - 1 for i in used}  # slots to prefill
    prefilled = [i for i in used if trunk[i] > 0]
    row_of = {i: r for r, i in enumerate(prefilled)}
    cache = prefill_rows(model, [sequences[i][: trunk[i]] for i in prefilled]) if prefilled \
        else None
    device = next(model.parameters()).device
    generated, order = 0, sorted(range(len(cuts)), key=lambda c: -budgets[c])
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        last = torch.tensor([[sequences[cuts[c][0]][cuts[c][1] - 1]] for c in chunk],
                            dtype=torch.long, device=device)  # (R, 1) each prefix's last token
        lengths = [cuts[c][1] - 1 for c in chunk]
        branch = None
        if max(lengths) > 0:
            # rows with an empty trunk (a one-token prefix) borrow any row, masked out entirely
            rows = [row_of.get(cuts[c][0], 0) for c in chunk]
            branch = gather_cache_rows(cache, rows, lengths)
        gen = generate(model, last, max_new_tokens=max(budgets[c] for c in chunk),
                       temperature=temperature, top_p=top_p, eos_token_id=eos_token_id,
                       generator=generator, cache=branch, preallocate=False, compile=compile)
        generated += int(gen.lengths.sum())
        for r, c in enumerate(chunk):
            ids = gen.completion_ids[r][gen.completion_mask[r]].tolist()
            out_trunc[c] = bool(gen.truncated[r]) or len(ids) > budgets[c]
            out_ids[c] = ids[: budgets[c]]
    prefill = sum(trunk[i] for i in prefilled) + len(cuts)
    return Branches(out_ids, out_trunc, generated, prefill)


class TextStreamer:
    """`generate` callback printing row 0's text as it grows (EOS and padding not shown)."""

    def __init__(
        self,
        tokenizer,
        write: Callable[[str], object] | None = None,
        stop_ids: Sequence[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.write = write or (lambda s: print(s, end="", flush=True))
        self.ids: list[int] = []
        self.printed = ""
        # The ids not shown; default: the tokenizer's EOS ids (chat passes `chat_stop_ids`).
        self.eos = set(stop_token_ids(tokenizer) if stop_ids is None else stop_ids)

    def __call__(self, new_tokens: torch.Tensor, is_real: torch.Tensor) -> None:
        token = int(new_tokens[0])
        if not bool(is_real[0]) or token in self.eos:
            return
        self.ids.append(token)
        # Re-decode everything: a multi-byte character may span several tokens.
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):  # incomplete UTF-8 sequence, wait for the next token
            return
        self.write(text[len(self.printed) :])
        self.printed = text


# ----------------------------------------------------------------------------- multi-turn chat


def chat_stop_ids(tokenizer) -> list[int]:
    """EOS ids plus <|im_end|>: a chat turn ends there even when the config's EOS is another id."""
    ids = stop_token_ids(tokenizer)
    try:
        im_end = int(tokenizer.im_end_token_id)
    except (AttributeError, KeyError):  # tokenizer without a chat vocabulary
        return ids
    return ids if im_end in ids else [*ids, im_end]


@dataclass
class ChatState:
    """One conversation: its messages and a KV cache (batch of one) of the tokens in `ids`."""

    cache: KVCache
    messages: list[dict] = field(default_factory=list)  # system/user/assistant, template input
    ids: list[int] = field(default_factory=list)  # tokens whose keys/values `cache` holds


@dataclass
class ChatReply:
    """What one `chat_turn` produced, and what it cost."""

    text: str  # the reply, special tokens (<think>) kept, the final stop token dropped
    completion_ids: list[int]  # generated ids, incl. the stop token that ended them
    truncated: bool  # True if max_new_tokens ran out before a stop token
    reused: int  # prompt tokens whose keys/values came from the cache
    prefilled: int  # prompt tokens fed to the model before decoding


def new_chat(model, system: str | None = None) -> ChatState:
    """An empty conversation (optionally with a system message) with an empty KV cache.

    The cache is preallocated with no room yet: each `chat_turn` grows it once, up front, to
    hold that turn (`KVCache.reserve`, via `generate`); cutting it keeps the buffers.
    """
    messages = [{"role": "system", "content": system}] if system else []
    return ChatState(cache=KVCache(model.cfg.num_hidden_layers, max_len=0), messages=messages)


def _cached_prefix(tokenizer, ids: list[int], text: str) -> tuple[int, int]:
    """(k, n): the first k of `ids` decode to text[:n]; k is the longest such prefix found.

    Compared as text, not as ids, so generated tokens are kept even where encoding the text
    afresh would split it differently (BPE need not reproduce a model's own tokenization).
    """

    def decoded(k: int) -> str:
        return tokenizer.decode(ids[:k], skip_special_tokens=False)

    full = decoded(len(ids))
    if text.startswith(full):  # the usual case: nothing the template re-renders differently
        return len(ids), len(full)
    # Binary search between a prefix that agrees (lo) and one that does not (hi). A cut inside a
    # multi-byte character decodes to U+FFFD and can stop the search a few tokens early: those
    # tokens are merely prefilled again.
    lo, hi = 0, len(ids)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(decoded(mid)):
            lo = mid
        else:
            hi = mid
    return lo, len(decoded(lo))


@torch.no_grad()
def chat_turn(
    model,
    tokenizer,
    state: ChatState,
    user_text: str,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    enable_thinking: bool = True,
    callback: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> ChatReply:
    """Answer `user_text` in the conversation `state`, updating it in place (messages, cache, ids).

    The model always sees exactly what the chat template renders for the whole conversation
    (`tokenizer.apply_chat_template(messages)`), but only the part of it the cache does not
    already hold is prefilled: the cache is kept up to the first token where the cached text and
    the newly rendered text differ, cut there, and the rest of the rendered text is encoded and
    prefilled. Usually that is just the end of the previous reply (its stop token, which is
    sampled but never fed back), the new user message and the assistant header.

    The cache and Qwen3's template disagree when a previous reply held a reasoning block: the
    template renders earlier assistant turns *without* their `<think>...</think>` (and without
    the empty think block that `enable_thinking=False` puts in the generation prompt), so the
    rendered history differs from the tokens generated, right after that turn's
    "<|im_start|>assistant\\n". Keeping those keys/values would show the model its old reasoning,
    at other positions than in the template's text, and the answer tokens after it have
    attended to that reasoning, so they cannot be reused either. We therefore cut the cache at
    that point and re-prefill the previous answer (without its reasoning) plus the new message:
    the same result as generating from scratch on the rendered conversation, at the cost of the
    previous answer's tokens, never the whole history. Replies without a think block (thinking
    models answering in non-thinking mode aside) cost nothing extra.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    messages = [*state.messages, {"role": "user", "content": user_text}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    keep, n_chars = _cached_prefix(tokenizer, state.ids, text)
    if n_chars == len(text) and keep > 0:
        # Everything is cached already, but the next token needs logits: feed the last one again.
        keep, n_chars = _cached_prefix(tokenizer, state.ids[: keep - 1], text)
    new_ids = tokenizer.encode(text[n_chars:])
    if not new_ids:
        raise ValueError("the chat template rendered an empty prompt")
    state.cache.truncate(keep)
    device = model.device
    out = generate(
        model,
        torch.tensor([new_ids], dtype=torch.long, device=device),  # (1, T_new)
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_token_id=chat_stop_ids(tokenizer),
        generator=generator,
        callback=callback,
        cache=state.cache,
    )
    completion = out.completion_ids[0, : int(out.lengths[0])].tolist()
    truncated = bool(out.truncated[0])
    reply_ids = completion if truncated else completion[:-1]  # without the stop token
    reply = tokenizer.decode(reply_ids, skip_special_tokens=False)
    # The last sampled token (the stop token, or the final one at max_new_tokens) is not cached.
    state.ids = [*state.ids[:keep], *new_ids, *completion[:-1]]
    state.messages = [*messages, {"role": "assistant", "content": reply}]
    return ChatReply(reply, completion, truncated, reused=keep, prefilled=len(new_ids))
