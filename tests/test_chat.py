"""Multi-turn chat with a KV cache kept between turns (`chat_turn`) and the `--chat` loop of
chapters/ch02_generate.py: same tokens as generating from scratch, only new tokens prefilled."""

import importlib.util
import io
from pathlib import Path

import pytest
import torch

from reasoning_from_scratch.generation import (
    ChatState,
    chat_stop_ids,
    chat_turn,
    generate,
    new_chat,
)
from reasoning_from_scratch.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
TURNS = ["What is 17+25?", "What is 3+4?"]


@pytest.fixture(scope="module")
def bundled():
    """The bundled tiny-arith model (float32, CPU) and its tokenizer (with chat tokens)."""
    return load_pretrained("tiny-arith", device="cpu", dtype=torch.float32)


def from_scratch(model, tokenizer, messages, max_new_tokens, enable_thinking=True):
    """Greedy completion ids of the rendered conversation, with a fresh cache."""
    text = tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking)
    out = generate(model, torch.tensor([tokenizer.encode(text)]), max_new_tokens=max_new_tokens,
                   eos_token_id=chat_stop_ids(tokenizer))
    return out.completion_ids[0, : int(out.lengths[0])].tolist()


def count_forward_tokens(monkeypatch, model):
    """Record the number of new tokens of every forward call of `model`."""
    seen = []
    forward = model.forward

    def counting(input_ids, *args, **kwargs):
        seen.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    return seen


def assert_cache_matches(state: ChatState):
    """The cache holds exactly one key per id in `state.ids`."""
    assert state.cache.seq_len == len(state.ids) == int(state.cache.next_pos[0])


@pytest.mark.parametrize("max_new_tokens", [3, 30])  # 3: replies cut before their stop token
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_kept_cache_gives_the_tokens_of_generation_from_scratch(bundled, max_new_tokens,
                                                                enable_thinking):
    model, tok = bundled
    state = new_chat(model, system="You are a calculator.")
    for user in [*TURNS, "And 12*3?"]:
        cached = len(state.ids)
        reply = chat_turn(model, tok, state, user, max_new_tokens=max_new_tokens,
                          enable_thinking=enable_thinking)
        # Non-thinking mode: the history drops the empty think block the generation prompt had,
        # so the cache is cut there; otherwise all of it is reused.
        assert reply.reused == cached if enable_thinking else reply.reused < max(cached, 1)
        expected = from_scratch(model, tok, state.messages[:-1], max_new_tokens, enable_thinking)
        assert reply.completion_ids == expected
        assert reply.truncated or max_new_tokens > 3
        # The prompt the model saw is the rendered conversation, token for token.
        prompt = state.ids[: reply.reused + reply.prefilled]
        rendered = tok.apply_chat_template(state.messages[:-1], enable_thinking=enable_thinking)
        assert tok.decode(prompt) == rendered
        assert_cache_matches(state)
    assert [m["role"] for m in state.messages] == ["system"] + ["user", "assistant"] * 3


def test_second_turn_prefills_only_the_new_tokens(bundled, monkeypatch):
    model, tok = bundled
    state = new_chat(model)
    first = chat_turn(model, tok, state, TURNS[0], max_new_tokens=30)
    assert not first.truncated and first.reused == 0
    cached = len(state.ids)
    seen = count_forward_tokens(monkeypatch, model)
    second = chat_turn(model, tok, state, TURNS[1], max_new_tokens=30)
    # New: the end of the first reply (<|im_end|>, never fed back), the user turn, the header.
    new_text = f"<|im_end|>\n<|im_start|>user\n{TURNS[1]}<|im_end|>\n<|im_start|>assistant\n"
    assert second.reused == cached
    assert seen[0] == second.prefilled == len(tok.encode(new_text))
    # Then one token per decoding step; the final token is sampled but never fed.
    assert seen[1:] == [1] * (len(second.completion_ids) - 1)
    assert_cache_matches(state)


def test_think_block_of_an_earlier_reply_is_dropped_and_the_answer_reprefilled(bundled,
                                                                              monkeypatch):
    model, tok = bundled
    # A first turn whose reply reasoned in a <think> block, cached as the model would have it.
    reply = "<think>\nadd the tens, then the ones\n</think>\n\n\\boxed{42}"
    state = new_chat(model)
    first_prompt = tok.apply_chat_template(TURNS[0])
    generated = tok.encode(first_prompt + reply)
    with torch.no_grad():
        model(torch.tensor([generated]), cache=state.cache)
    state.ids = generated
    state.messages = [{"role": "user", "content": TURNS[0]},
                      {"role": "assistant", "content": reply}]

    seen = count_forward_tokens(monkeypatch, model)
    second = chat_turn(model, tok, state, TURNS[1], max_new_tokens=20)
    # Qwen3's template renders the earlier reply as "\\boxed{42}" only: the cache is cut right
    # after that turn's "<|im_start|>assistant\n" and only the rest is prefilled again.
    rendered = tok.apply_chat_template(state.messages[:-1])
    assert "<think>" not in rendered and "\\boxed{42}<|im_end|>" in rendered
    assert second.reused == len(tok.encode(first_prompt)) < len(generated)
    assert seen[0] == second.prefilled
    assert tok.decode(state.ids[: second.reused + second.prefilled]) == rendered
    assert second.completion_ids == from_scratch(model, tok, state.messages[:-1], 20)
    assert_cache_matches(state)


def test_chat_turn_refuses_zero_new_tokens(bundled):
    model, tok = bundled
    with pytest.raises(ValueError, match="max_new_tokens"):
        chat_turn(model, tok, new_chat(model), "hi", max_new_tokens=0)


# ----------------------------------------------------------------------------- the script


def _ch02():
    """chapters/ch02_generate.py as a module (chapters/ is not a package)."""
    spec = importlib.util.spec_from_file_location("ch02_generate", ROOT / "chapters" /
                                                  "ch02_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_chat(monkeypatch, capsys, stdin_text, *flags):
    """Run `--chat` on stdin_text; return what it printed."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin_text))
    _ch02().main(["--chat", "--max-new-tokens", "20", "--device", "cpu", *flags])
    return capsys.readouterr().out


def test_chat_loop_keeps_the_conversation_resets_and_ends_at_eof(bundled, monkeypatch, capsys):
    model, tok = bundled
    out = run_chat(monkeypatch, capsys, f"{TURNS[0]}\n{TURNS[1]}\n/reset\n{TURNS[1]}\n")
    assert out.count("stopped by") == 3 and "(conversation cleared)" in out
    # The second turn reuses the first one's cache; after /reset nothing is reused.
    reused = [int(line.split("reused ")[1].split()[0]) for line in out.splitlines()
              if "reused" in line]
    assert reused[0] == 0 and reused[1] > 0 and reused[2] == 0
    # The streamed replies are the ones chat_turn gives (greedy), stop token not shown.
    state = new_chat(model)
    replies = [chat_turn(model, tok, state, t, max_new_tokens=20).text for t in TURNS]
    assert all(r in out for r in replies)
    assert "<|im_end|>" not in out and "<|endoftext|>" not in out


@pytest.mark.parametrize("end", ["\n", "/exit\n"])
def test_chat_loop_ends_at_an_empty_line_or_exit(monkeypatch, capsys, end):
    out = run_chat(monkeypatch, capsys, f"{TURNS[0]}\n{end}{TURNS[1]}\n", "--no-think",
                   "--system", "Be brief.")
    assert out.count("stopped by") == 1


def test_chat_with_a_prompt_is_still_one_shot(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("must not be read\n"))
    _ch02().main(["--chat", "--prompt", TURNS[0], "--max-new-tokens", "10", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "<|im_start|>user\nWhat is 17+25?<|im_end|>" in out and ">>>" not in out
    assert out.count("stopped by") == 1


def test_help_lists_the_chat_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        _ch02().parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--chat" in out and "--system" in out and "--no-think" in out
