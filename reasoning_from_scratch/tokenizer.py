"""Qwen3 tokenizer: a thin wrapper over the Hugging Face `tokenizers` library.

It loads a checkpoint's `tokenizer.json` (byte-level BPE), looks special tokens up by string,
reads EOS / PAD / BOS from the checkpoint's config files (generation_config.json, config.json,
tokenizer_config.json; never guessed from a file name), renders the Qwen3 chat template, returns
character offsets per token (used to map reasoning steps onto tokens), and saves itself in the
layout `transformers.AutoTokenizer` loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .files import atomic_write_json, atomic_write_text, read_json

# Token ids of <think> / </think> in the real Qwen3 vocabulary (151,669 tokens). Code that works
# with any tokenizer (e.g. the tiny bundled one) should use `tokenizer.think_token_id` instead.
THINK_TOKEN_ID = 151667
END_THINK_TOKEN_ID = 151668

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
END_THINK = "</think>"

# Empty reasoning block Qwen3 prepends to the answer when thinking is switched off.
EMPTY_THINK_BLOCK = "<think>\n\n</think>\n\n"

# Jinja version of `render_chat` (what transformers' `apply_chat_template` runs). It is the real
# Qwen3 template without the tool-calling branches; for system/user/assistant messages both give the
# same text (checked in tests/test_tokenizer.py).
QWEN3_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
    " and not (message.content.startswith('<tool_response>')"
    " and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

Messages = str | Sequence[dict]


def pad_id_of(tokenizer) -> int:
    """The id that pads packed sequences (never attended to, never scored): the tokenizer's pad
    id, else its EOS id, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def _token_string(value: Any) -> str | None:
    """A token entry of tokenizer_config.json: a string, {"content": ...} or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _is_tool_response(content: Any) -> bool:
    return (
        isinstance(content, str)
        and content.startswith("<tool_response>")
        and content.endswith("</tool_response>")
    )


def render_chat(
    messages: Sequence[dict], add_generation_prompt: bool = True, enable_thinking: bool = True
) -> str:
    """Render system/user/assistant messages with the Qwen3 chat template (no tools)."""
    if not messages:
        raise ValueError("apply_chat_template needs at least one message")
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "user", "assistant"):
            raise ValueError(
                f"message {i}: role {m.get('role')!r} is not supported "
                "(use 'system', 'user' or 'assistant')"
            )
    parts = []
    if messages[0]["role"] == "system":
        parts.append(f"{IM_START}system\n{messages[0]['content']}{IM_END}\n")
    # Reasoning of assistant turns is only kept after the last real user query (Qwen3 drops the
    # <think> blocks of earlier turns from the context).
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m["role"] == "user" and isinstance(m.get("content"), str):
            if not _is_tool_response(m["content"]):
                last_query = i
                break
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m.get("content"), str) else ""
        role = m["role"]
        if role == "user" or (role == "system" and i > 0):
            parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        elif role == "assistant":
            reasoning = m.get("reasoning_content")
            if not isinstance(reasoning, str):
                reasoning = ""
                if END_THINK in content:
                    reasoning = content.split(END_THINK)[0].rstrip("\n").split(THINK)[-1]
                    reasoning = reasoning.lstrip("\n")
                    content = content.split(END_THINK)[-1].lstrip("\n")
            if i > last_query and (i == len(messages) - 1 or reasoning):
                parts.append(
                    f"{IM_START}assistant\n{THINK}\n{reasoning.strip(chr(10))}\n{END_THINK}\n\n"
                    f"{content.lstrip(chr(10))}"
                )
            else:
                parts.append(f"{IM_START}assistant\n{content}")
            parts.append(f"{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
        if not enable_thinking:
            parts.append(EMPTY_THINK_BLOCK)
    return "".join(parts)


class Qwen3Tokenizer:
    """Qwen3 byte-level BPE tokenizer: special tokens, EOS from config files, chat template."""

    def __init__(
        self,
        tokenizer_json_path: str | Path | None = None,
        tokenizer_config_path: str | Path | None = None,
        generation_config_path: str | Path | None = None,
        config_path: str | Path | None = None,
        *,
        tokenizer_file_path: str | Path | None = None,
        apply_chat_template: bool = False,
        add_generation_prompt: bool = False,
        add_thinking: bool = False,
    ):
        """`tokenizer_file_path` and the three flags are the book's form: `encode` then wraps
        text in the chat template (one user message; `add_thinking=False` adds the empty think
        block), and without config files the EOS follows the book's two files (a name with
        'base' -> <|endoftext|>, else <|im_end|>)."""
        book_form = tokenizer_file_path is not None
        if tokenizer_json_path is None:
            tokenizer_json_path = tokenizer_file_path
        if tokenizer_json_path is None:
            raise TypeError("Qwen3Tokenizer needs the path of a tokenizer.json")
        self.chat_wrap = apply_chat_template  # the book's flag (its name is a method here)
        self.add_generation_prompt = add_generation_prompt
        self.add_thinking = add_thinking
        self.path = Path(tokenizer_json_path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"tokenizer.json not found at {self.path}: copy tokenizer.json from the model's "
                "Hugging Face repository (https://huggingface.co/<repo>/tree/main) into that "
                "directory, or write one with Qwen3Tokenizer.save()"
            )
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as err:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{self.path}: not a valid tokenizer.json ({err})") from None

        tok_cfg = read_json(tokenizer_config_path) if tokenizer_config_path else {}
        gen_cfg = read_json(generation_config_path) if generation_config_path else {}
        model_cfg = read_json(config_path) if config_path else {}
        # Fields we do not interpret (e.g. the original chat template) survive a save().
        self.tokenizer_config = tok_cfg

        self.eos_token_ids, self.eos_source = self._find_eos(tok_cfg, gen_cfg, model_cfg)
        if book_form and not self.eos_token_ids:
            name = self.path.name.lower()
            book_eos = ENDOFTEXT if "base" in name and "reasoning" not in name else IM_END
            self.eos_token_ids, self.eos_source = [self.token_to_id(book_eos)], "book file name"
        self.bos_token_id = self._first_id(
            gen_cfg.get("bos_token_id"), model_cfg.get("bos_token_id")
        )
        if self.bos_token_id is None and _token_string(tok_cfg.get("bos_token")):
            self.bos_token_id = self.token_to_id(_token_string(tok_cfg["bos_token"]))
        self.pad_token_id = self._find_pad(tok_cfg, gen_cfg)
        self.model_max_length = int(
            tok_cfg.get("model_max_length") or model_cfg.get("max_position_embeddings") or 131072
        )
        template = tok_cfg.get("chat_template")
        self.chat_template = template if isinstance(template, str) else QWEN3_CHAT_TEMPLATE

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Qwen3Tokenizer:
        """Load tokenizer.json plus whichever of the config files the directory holds."""
        model_dir = Path(model_dir)

        def opt(name):
            return model_dir / name if (model_dir / name).is_file() else None

        return cls(
            model_dir / "tokenizer.json",
            tokenizer_config_path=opt("tokenizer_config.json"),
            generation_config_path=opt("generation_config.json"),
            config_path=opt("config.json"),
        )

    # ----- config-file lookups -------------------------------------------------------------
    @staticmethod
    def _first_id(*values) -> int | None:
        for v in values:
            if isinstance(v, list):
                v = v[0] if v else None
            if v is not None:
                return int(v)
        return None

    def _find_eos(self, tok_cfg: dict, gen_cfg: dict, model_cfg: dict):
        """EOS ids in priority generation_config.json > config.json > tokenizer_config.json."""
        for source, cfg in (("generation_config.json", gen_cfg), ("config.json", model_cfg)):
            value = cfg.get("eos_token_id")
            if value is not None:
                ids = value if isinstance(value, list) else [value]
                return [int(i) for i in ids], source
        name = _token_string(tok_cfg.get("eos_token"))
        if name:
            return [self.token_to_id(name)], "tokenizer_config.json"
        return [], None

    def _find_pad(self, tok_cfg: dict, gen_cfg: dict) -> int | None:
        name = _token_string(tok_cfg.get("pad_token"))
        if name:
            return self.token_to_id(name)
        if gen_cfg.get("pad_token_id") is not None:
            return int(gen_cfg["pad_token_id"])
        if self._tok.token_to_id(ENDOFTEXT) is not None:
            return self._tok.token_to_id(ENDOFTEXT)
        return self.eos_token_id

    # ----- vocabulary ----------------------------------------------------------------------
    def token_to_id(self, token: str) -> int:
        """Id of a token string; KeyError naming the tokenizer file when absent."""
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise KeyError(f"token {token!r} is not in the vocabulary of {self.path}")
        return idx

    def id_to_token(self, idx: int) -> str:
        """Token string of an id (byte-level form, e.g. 'Ġthe')."""
        token = self._tok.id_to_token(int(idx))
        if token is None:
            raise KeyError(f"token id {idx} is out of range for {self.path}")
        return token

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added special tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        """First EOS id from the checkpoint's config files (None if none of them names one)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return None if self.pad_token_id is None else self.id_to_token(self.pad_token_id)

    @property
    def think_token_id(self) -> int:
        return self.token_to_id(THINK)

    @property
    def end_think_token_id(self) -> int:
        return self.token_to_id(END_THINK)

    @property
    def im_start_token_id(self) -> int:
        return self.token_to_id(IM_START)

    @property
    def im_end_token_id(self) -> int:
        return self.token_to_id(IM_END)

    @property
    def endoftext_token_id(self) -> int:
        return self.token_to_id(ENDOFTEXT)

    # ----- encode / decode -----------------------------------------------------------------
    def encode(self, text: str, chat_wrapped: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. '<think>') map to their ids.

        `chat_wrapped` (default: the book's `apply_chat_template` flag) first renders `text` as
        one user message of the chat template.
        """
        if self.chat_wrap if chat_wrapped is None else chat_wrapped:
            text = render_chat([{"role": "user", "content": text}], self.add_generation_prompt,
                               enable_thinking=self.add_thinking)
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and (start, end) character offsets into `text` for each token.

        A character split over several byte tokens (rare CJK, emoji) gives each of those tokens
        the span of the whole character. Gaps left by NFC normalization (a combining accent merged
        into the previous character) are closed by extending the previous token's end, so the
        spans cover `text` from the first token's start to len(text) without holes.
        """
        enc = self._tok.encode(text, add_special_tokens=False)
        offsets = [tuple(o) for o in enc.offsets]
        for i in range(len(offsets)):
            nxt = offsets[i + 1][0] if i + 1 < len(offsets) else len(text)
            span = offsets[i]
            if span[1] < nxt:
                # Also widen the earlier byte tokens of the same character (identical span).
                j = i
                while j >= 0 and offsets[j] == span:
                    offsets[j] = (span[0], nxt)
                    j -= 1
        return enc.ids, offsets

    def decode(self, ids: Iterable[int] | int, skip_special_tokens: bool = False) -> str:
        """Text of token ids; accepts a list, a tensor or one id (the book decodes
        ``token.tolist()`` of a one-element tensor, an int)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages_or_text: Messages,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
    ) -> str:
        """Qwen3 chat text; a plain string is treated as one user message."""
        if isinstance(messages_or_text, str):
            messages_or_text = [{"role": "user", "content": messages_or_text}]
        return render_chat(messages_or_text, add_generation_prompt, enable_thinking)

    # ----- saving --------------------------------------------------------------------------
    def added_tokens_decoder(self) -> dict:
        """The `added_tokens_decoder` block of tokenizer_config.json."""
        out = {}
        for idx, tok in sorted(self._tok.get_added_tokens_decoder().items()):
            out[str(idx)] = {
                "content": tok.content,
                "lstrip": tok.lstrip,
                "normalized": tok.normalized,
                "rstrip": tok.rstrip,
                "single_word": tok.single_word,
                "special": tok.special,
            }
        return out

    def tokenizer_config_dict(self) -> dict:
        """tokenizer_config.json content that transformers' AutoTokenizer understands."""
        cfg = dict(self.tokenizer_config)
        decoder = self.added_tokens_decoder()
        cfg.update(
            {
                "add_bos_token": False,
                "add_prefix_space": False,
                "added_tokens_decoder": decoder,
                "additional_special_tokens": [
                    t["content"]
                    for t in decoder.values()
                    if t["special"] and t["content"] not in (self.eos_token, self.pad_token)
                ],
                "bos_token": None,
                "chat_template": self.chat_template,
                "clean_up_tokenization_spaces": False,
                "eos_token": self.eos_token,
                "errors": "replace",
                "model_max_length": self.model_max_length,
                "pad_token": self.pad_token,
                "split_special_tokens": False,
                "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None,
            }
        )
        return cfg

    def save(self, out_dir: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into out_dir (atomically)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "tokenizer.json", self._tok.to_str(pretty=True))
        atomic_write_json(out_dir / "tokenizer_config.json", self.tokenizer_config_dict())
