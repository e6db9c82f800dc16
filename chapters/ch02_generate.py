"""Chapter 2: generate text from a prompt with any loadable Qwen3 model, streaming the output.

Examples:
    python chapters/ch02_generate.py
    python chapters/ch02_generate.py --problem "What is 17+25?"
    python chapters/ch02_generate.py --model Qwen/Qwen3-0.6B --chat --prompt "Explain RoPE briefly."
    python chapters/ch02_generate.py --model Qwen/Qwen3-0.6B --chat

`--chat` with `--prompt` or `--problem` answers that one message. `--chat` alone starts a
multi-turn chat reading one user message per line from stdin: an empty line, "/exit" or EOF
(Ctrl-D) ends it, "/reset" starts a new conversation. The KV cache is kept between turns, so a
turn prefills only the new message (see `reasoning_from_scratch.generation.chat_turn`).
"""

import argparse
import time

import torch

from reasoning_from_scratch.cli.arguments import (
    add_device_argument,
    add_model_argument,
    add_sampling_arguments,
    add_seed_argument,
)
from reasoning_from_scratch.device import get_device
from reasoning_from_scratch.generation import (
    TextStreamer,
    chat_stop_ids,
    chat_turn,
    generate,
    new_chat,
    stop_token_ids,
)
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.weights import load_pretrained

DEFAULT_PROBLEM = "What is 17+25?"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_argument(p)
    p.add_argument("--prompt", default=None,
                   help="raw prompt text, sent as is (overrides --problem)")
    p.add_argument("--problem", default=None,
                   help=f"math problem wrapped in the standard prompt (render_prompt); "
                        f"None: {DEFAULT_PROBLEM!r}")
    p.add_argument("--chat", action="store_true",
                   help="wrap the text in the tokenizer's chat template (for instruct models); "
                        "without --prompt and --problem: an interactive multi-turn chat on stdin")
    p.add_argument("--system", default=None,
                   help="system message for --chat (None: no system message)")
    p.add_argument("--no-think", action="store_true",
                   help="--chat with enable_thinking=False (Qwen3's non-thinking mode)")
    add_sampling_arguments(p, max_new_tokens=128, temperature=0.0, top_p=1.0, top_k=None, helps={
        "max_new_tokens": "maximum number of tokens to generate (per turn in a chat)",
        "top_p": "nucleus sampling: keep the smallest token set with this total probability"})
    add_seed_argument(p, 123)
    add_device_argument(p)
    return p.parse_args(argv)


def chat_loop(model, tokenizer, args, generator: torch.Generator) -> None:
    """Read user turns from stdin and stream the replies until an empty line, /exit or EOF."""
    state = new_chat(model, args.system)
    print('chat: an empty line, "/exit" or EOF ends it; "/reset" starts a new conversation')
    while True:
        try:
            user = input("\n>>> ").strip()
        except EOFError:  # stdin closed (Ctrl-D, or the end of piped input)
            print()
            break
        if user in ("", "/exit"):
            break
        if user == "/reset":
            state = new_chat(model, args.system)  # a fresh, empty KV cache
            print("(conversation cleared)")
            continue
        start = time.perf_counter()
        reply = chat_turn(
            model,
            tokenizer,
            state,
            user,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            generator=generator,
            enable_thinking=not args.no_think,
            callback=TextStreamer(tokenizer, stop_ids=chat_stop_ids(tokenizer)),
        )
        seconds = time.perf_counter() - start
        n = len(reply.completion_ids)
        stop = "max_new_tokens reached" if reply.truncated else "EOS"
        print(f"\n--- {n} tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s), stopped by "
              f"{stop}; prefilled {reply.prefilled} new, reused {reply.reused} cached tokens")
        if len(state.ids) > model.cfg.max_position_embeddings:
            # RoPE tables grow on demand, so nothing fails, but the model was not trained there.
            print(f"(the conversation holds {len(state.ids)} tokens, more than the model's "
                  f"context of {model.cfg.max_position_embeddings}; /reset starts afresh)")


def main(argv=None):
    args = parse_args(argv)
    device = get_device(args.device)
    model, tokenizer = load_pretrained(args.model, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if args.chat and args.prompt is None and args.problem is None:
        print(f"model: {args.model} on {device} ({model.dtype})")
        try:
            chat_loop(model, tokenizer, args, generator)
        except KeyboardInterrupt:  # Ctrl-C ends a chat quietly; nothing is left to save
            print("\n(interrupted)")
        return
    text = args.prompt if args.prompt is not None else render_prompt(
        args.problem if args.problem is not None else DEFAULT_PROBLEM)
    if args.chat:
        text = tokenizer.apply_chat_template(text, enable_thinking=not args.no_think)
    input_ids = torch.tensor([tokenizer.encode(text)], device=device)

    print(f"model: {args.model} on {device} ({model.dtype})")
    print(f"--- prompt ---\n{text}\n--- output ---")
    start = time.perf_counter()
    out = generate(
        model,
        input_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        # a chat answer ends at <|im_end|>, which need not be the model's EOS
        eos_token_id=chat_stop_ids(tokenizer) if args.chat else stop_token_ids(tokenizer),
        generator=generator,
        callback=TextStreamer(tokenizer, stop_ids=chat_stop_ids(tokenizer) if args.chat else None),
    )
    seconds = time.perf_counter() - start
    n = int(out.lengths[0])
    stop = "max_new_tokens reached" if bool(out.truncated[0]) else "EOS"
    print(f"\n--- {n} tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s), stopped by {stop}")


if __name__ == "__main__":
    main()
