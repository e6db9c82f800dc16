"""Tests for process.py: step splitting, step-to-token mapping, DeepSeekMath process advantages."""

import math
import random

import pytest
import torch

from reasoning_from_scratch.process import (
    ANCHORED_VARIANTS,
    STEP_TAG_PATTERN,
    align_steps_to_tokens,
    anchored_credit,
    normalize_pool,
    process_advantages,
    split_steps,
    step_statistics,
    step_texts,
    step_token_ends,
    token_offsets_from_ids,
)
from reasoning_from_scratch.tokenizer import Qwen3Tokenizer
from reasoning_from_scratch.weights import BUNDLED_MODELS

REFERENCE = (
    " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\nStep 3: 126-8=118\n</think>\n\\boxed{118}"
)


def covers(text, spans):
    """Spans are contiguous, non-empty and cover the whole text."""
    if not text:
        return spans == []
    return (
        spans[0][0] == 0
        and spans[-1][1] == len(text)
        and all(s < e for s, e in spans)
        and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    )


# ---------------------------------------------------------------------------------------------
# split_steps
# ---------------------------------------------------------------------------------------------


def test_split_reference_format_tags():
    spans = split_steps(REFERENCE)
    assert covers(REFERENCE, spans)
    assert step_texts(REFERENCE, spans) == [
        " <think>\nStep 1: 17+25=42\n",  # the preamble joins the first step
        "Step 2: 42*3=126\n",
        "Step 3: 126-8=118\n",
        "</think>\n\\boxed{118}",  # the answer is its own final step
    ]


def test_split_newlines_and_blank_lines():
    assert step_texts(REFERENCE, split_steps(REFERENCE, "newlines")) == step_texts(
        REFERENCE, split_steps(REFERENCE)
    )
    text = "First 2+3=5.\n\nThen 5*2=10.\n  \n\nSo 10.\n\\boxed{10}"
    spans = split_steps(text, "blank_lines")
    assert covers(text, spans)
    assert step_texts(text, spans) == [
        "First 2+3=5.\n\n",
        "Then 5*2=10.\n  \n\n",
        "So 10.\n",
        "\\boxed{10}",  # no </think>: the last \boxed starts the answer step
    ]


def test_split_no_tags_is_one_step_plus_answer():
    text = "I add 17 and 25 and get 42, times 3 is 126 \\boxed{126}"
    assert step_texts(text, split_steps(text)) == [
        "I add 17 and 25 and get 42, times 3 is 126 ",
        "\\boxed{126}",
    ]
    assert split_steps("plain text") == [(0, 10)]
    assert split_steps("") == []
    assert split_steps("no answer", answer_patterns=()) == [(0, 9)]


def test_split_tags_inside_numbers():
    # "Step 10:" is one tag; a tag glued to a number ("=42Step 2:") still starts a step;
    # a tag glued to a letter is not a tag; "steps:" without a number is not a tag.
    text = "Step 1: 17+25=42Step 2: 42*3=126\nMyStep 3: no\nStep 10: 3 steps: 126-8=118\n</think>"
    assert step_texts(text, split_steps(text)) == [
        "Step 1: 17+25=42",
        "Step 2: 42*3=126\nMyStep 3: no\n",
        "Step 10: 3 steps: 126-8=118\n",
        "</think>",
    ]


def test_split_windows_newlines():
    text = "<think>\r\nStep 1: 1+1=2\r\nStep 2: 2+2=4\r\n</think>\r\n\\boxed{4}"
    for mode in ("tags", "newlines"):
        spans = split_steps(text, mode)
        assert covers(text, spans)
        pieces = step_texts(text, spans)
        assert pieces == [
            "<think>\r\nStep 1: 1+1=2\r\n", "Step 2: 2+2=4\r\n", "</think>\r\n\\boxed{4}"
        ]
        # "\r\n" is never cut in two
        assert not any(p.startswith("\n") for p in pieces)
    text2 = "a\r\n\r\nb\r\n"
    assert step_texts(text2, split_steps(text2, "blank_lines")) == ["a\r\n\r\n", "b\r\n"]


def test_split_empty_steps_are_merged():
    text = "Step 1:\nStep 2: 3+4=7\n\n\nStep 3:   \nStep 4: 7*2=14\nStep 5:\n</think>\\boxed{14}"
    pieces = step_texts(text, split_steps(text))
    # An empty first step merges forward; later empty steps merge into the step before them.
    assert pieces == [
        "Step 1:\nStep 2: 3+4=7\n\n\nStep 3:   \n",
        "Step 4: 7*2=14\nStep 5:\n",
        "</think>\\boxed{14}",
    ]
    # Only an empty step before the answer: it merges into the answer step.
    lone = "Step 1:\n</think>\\boxed{5}"
    assert step_texts(lone, split_steps(lone)) == [lone]
    # Empty lines in newline mode join the line before.
    assert step_texts("a\n\n\nb", split_steps("a\n\n\nb", "newlines")) == ["a\n\n\n", "b"]


def test_split_regex_mode_and_errors():
    text = "1. add\n2. multiply\n3. subtract"
    spans = split_steps(text, "regex", pattern=r"(?m)^\d+\.")
    assert step_texts(text, spans) == ["1. add\n", "2. multiply\n", "3. subtract"]
    with pytest.raises(ValueError, match="pattern"):
        split_steps(text, "regex")
    with pytest.raises(ValueError, match="mode"):
        split_steps(text, "words")
    assert STEP_TAG_PATTERN  # exported for users who build on it


def test_split_random_texts_always_cover():
    rng = random.Random(0)
    alphabet = ["Step ", "1", "2", "0", ":", "\n", "\r\n", " ", "x", "=", "<think>", "</think>",
                "\\boxed{", "}", "\n\n"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        for mode in ("tags", "newlines", "blank_lines"):
            assert covers(text, split_steps(text, mode)), (mode, text)


# ---------------------------------------------------------------------------------------------
# Mapping spans onto tokens
# ---------------------------------------------------------------------------------------------


def test_step_token_ends_straddling_and_tokenless_steps():
    # Token 1 covers characters 3..8 and so straddles the boundary at 5: it belongs to step 0,
    # the step of its first character.
    offsets = [(0, 3), (3, 9), (9, 12)]
    assert step_token_ends(offsets, [(0, 5), (5, 12)]) == [1, 2]
    # Step 1 = characters 4..5 lies inside token 1, so it has no token: merged away.
    spans = [(0, 4), (4, 6), (6, 12)]
    assert step_token_ends(offsets, spans) == [1, 2]
    merged, ends = align_steps_to_tokens(offsets, spans)
    assert merged == [(0, 6), (6, 12)] and ends == [1, 2]
    # A zero-width EOS at len(text) joins the last step.
    assert step_token_ends([(0, 3), (3, 9), (9, 12), (12, 12)], [(0, 5), (5, 12)]) == [1, 3]
    assert step_token_ends([], [(0, 5)]) == []
    with pytest.raises(ValueError, match="non-decreasing"):
        step_token_ends([(3, 4), (0, 3)], [(0, 5)])
    with pytest.raises(ValueError, match="contiguous"):
        step_token_ends([(0, 1)], [(0, 2), (3, 5)])


def _byte_level_bpe():
    """A real byte-level BPE tokenizer (the kind Qwen uses), trained in a blink on a toy corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<think>", "</think>", "<eos>"],
        show_progress=False,
    )
    corpus = [REFERENCE, "Step 1: 8*7=56\nStep 2: 56-9=47\n\n", "the answer is 47 \\boxed{47}"]
    tok.train_from_iterator(corpus * 20, trainer)
    return tok


def test_token_mapping_exact_against_offsets_real_bpe():
    tok = _byte_level_bpe()
    texts = [
        REFERENCE,
        " <think>\r\nStep 1: 8*7=56Step 2: 56-9=47 é\n\n</think>\n\\boxed{47}",
        "no steps at all, just 47",
    ]
    for text in texts:
        enc = tok.encode(text)
        offsets = enc.offsets
        for mode in ("tags", "newlines", "blank_lines"):
            spans, ends = align_steps_to_tokens(offsets, split_steps(text, mode))
            assert covers(text, spans) and len(spans) == len(ends)
            assert ends[-1] == len(offsets) - 1
            assert all(b > a for a, b in zip(ends, ends[1:]))
            first = 0
            for (s, e), last in zip(spans, ends):
                # Every token of step j starts inside span j, and the first token of the next
                # step starts exactly where its span does (tokens never cross a tag start here).
                for k in range(first, last + 1):
                    assert s <= offsets[k][0] < e or (offsets[k][0] == e == len(text))
                first = last + 1
            # Decoding each step's tokens gives back exactly that step's text.
            starts = [0, *[x + 1 for x in ends[:-1]]]
            decoded = [tok.decode(enc.ids[a : b + 1], skip_special_tokens=False)
                       for a, b in zip(starts, ends)]
            assert decoded == step_texts(text, spans), (mode, text)


def test_token_offsets_from_ids_non_canonical_tokenisation():
    tok = _byte_level_bpe()

    class Wrapper:
        def decode(self, ids):
            return tok.decode(ids, skip_special_tokens=False)

        def encode_with_offsets(self, text):
            enc = tok.encode(text)
            return enc.ids, enc.offsets

    text = "Step 1: 8*7=56\n</think>"
    canonical = tok.encode(text)
    assert token_offsets_from_ids(Wrapper(), canonical.ids, text) == canonical.offsets
    # One token per character: a valid but non-canonical tokenisation that re-encoding would
    # not reproduce; the prefix-decoding fallback still finds exact offsets.
    ids = [tok.token_to_id(c if c not in " \n" else {" ": "Ġ", "\n": "Ċ"}[c]) for c in text[:14]]
    ids.append(tok.token_to_id("Ċ"))
    ids.append(tok.token_to_id("</think>"))
    assert tok.decode(ids, skip_special_tokens=False) == text
    offsets = token_offsets_from_ids(Wrapper(), ids, text)
    assert offsets == [(i, i + 1) for i in range(15)] + [(15, 23)]


def _offsets_by_character_loop(tokenizer, ids, text):
    """The prefix-decoding offsets as first written (a character loop per prefix): the
    reference the faster common-prefix search must reproduce exactly."""
    starts = []
    for k in range(len(ids)):
        prefix = tokenizer.decode(ids[:k])
        n, limit = 0, min(len(prefix), len(text))
        while n < limit and prefix[n] == text[n]:
            n += 1
        starts.append(n)
    for k in range(len(starts) - 2, -1, -1):
        starts[k] = min(starts[k], starts[k + 1])
    return list(zip(starts, [*starts[1:], len(text)]))


def test_prefix_decoding_offsets_match_the_character_loop_on_the_bundled_tokenizer():
    tok = Qwen3Tokenizer.from_pretrained(BUNDLED_MODELS["tiny-arith"])

    class DecodeOnly:  # no encode_with_offsets: every call takes the prefix-decoding path
        def decode(self, ids):
            return tok.decode(ids)

    rng = random.Random(0)
    texts = [REFERENCE, " <think>\nStep 1: 8*7=56\n</think>\n\\boxed{56} é日🙂",
             "Stép 2: 3×4=12 — naïve ½ 🙂🙂"]
    cases = []
    for text in texts:  # canonical ids, and the same text one byte token at a time
        cases.append(tok.encode(text))
        cases.append([i for c in text for i in tok.encode(c)])
    for _ in range(300):  # random ids: half UTF-8 characters, special tokens, odd merges
        cases.append([rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))])
    for ids in cases:
        text = tok.decode(ids)
        for t in (text, text[: len(text) // 2]):  # also a text shorter than the tokens
            assert token_offsets_from_ids(DecodeOnly(), ids, t) == \
                _offsets_by_character_loop(DecodeOnly(), ids, t), (ids, t)


# ---------------------------------------------------------------------------------------------
# process_advantages
# ---------------------------------------------------------------------------------------------


def test_constant_rewards_give_zeros():
    adv = process_advantages([[0.7, 0.7], [0.7], [0.7, 0.7, 0.7]], [[1, 4], [2], [0, 1, 2]],
                             [5, 3, 3])
    assert adv.shape == (3, 5) and adv.dtype == torch.float32
    assert torch.equal(adv, torch.zeros(3, 5))
    # A pool of a single reward: zeros (torch's unbiased std would be NaN).
    assert torch.equal(process_advantages([[1.0]], [[3]], [4]), torch.zeros(1, 4))
    assert torch.equal(normalize_pool(torch.tensor([2.0])), torch.zeros(1))


def test_deepseekmath_hand_computed_example():
    # Two completions of one prompt.
    #   completion 0: 6 tokens, steps end at tokens 1, 3, 5, step rewards 1, 1, 0
    #   completion 1: 4 tokens, steps end at tokens 2, 3,    step rewards 1, 0
    # Pool = [1, 1, 0, 1, 0]: mean = 3/5 = 0.6,
    # unbiased variance = (3 * 0.4^2 + 2 * 0.6^2) / (5 - 1) = (0.48 + 0.72) / 4 = 0.3,
    # std = sqrt(0.3) = 0.5477226.
    # Normalised: a = (1 - 0.6) / (0.5477226 + 1e-4) = 0.4 / 0.5478226 = 0.7301634,
    #             b = (0 - 0.6) / (0.5477226 + 1e-4) = -0.6 / 0.5478226 = -1.0952452.
    # Token advantage = sum of the normalised rewards of the steps ending at or after it:
    #   completion 0: tokens 0-1 -> a+a+b = 0.3650817, tokens 2-3 -> a+b = -0.3650817,
    #                 tokens 4-5 -> b = -1.0952452
    #   completion 1: tokens 0-2 -> a+b = -0.3650817, token 3 -> b = -1.0952452, 4-5 -> 0
    a = 0.4 / (math.sqrt(0.3) + 1e-4)
    b = -0.6 / (math.sqrt(0.3) + 1e-4)
    assert a == pytest.approx(0.7301634, abs=1e-6) and b == pytest.approx(-1.0952452, abs=1e-6)
    adv = process_advantages([[1, 1, 0], [1, 0]], [[1, 3, 5], [2, 3]], torch.tensor([6, 4]))
    expected = torch.tensor([
        [0.3650817, 0.3650817, -0.3650817, -0.3650817, -1.0952452, -1.0952452],
        [-0.3650817, -0.3650817, -0.3650817, -1.0952452, 0.0, 0.0],
    ])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_better_step_raises_exactly_its_earlier_tokens():
    # Completions 0 and 1 share their step layout; completion 0's second step is better.
    ends = [[1, 4, 6], [1, 4, 6], [2, 6]]
    adv = process_advantages([[1, 1, 0], [1, 0, 0], [0, 1]], ends, [7, 7, 7])
    diff = adv[0] - adv[1]
    # Tokens 0..4 lead into the better step: raised by the same amount; later tokens are equal.
    assert torch.all(diff[:5] > 0)
    torch.testing.assert_close(diff[:5], diff[0].expand(5))
    assert torch.equal(diff[5:], torch.zeros(2))


def test_suffix_sum_structure():
    # All normalised rewards of completion 0 are positive (completion 1 is much worse), so its
    # advantage can only fall as fewer steps remain.
    adv = process_advantages([[1.0, 0.9, 0.8], [0.0, -1.0]], [[2, 3, 7], [0, 7]], [8, 8])
    row = adv[0]
    assert torch.all(row[:-1] >= row[1:])
    assert row[2] > row[3] > row[4]  # strict drops at step ends 2 and 3
    # In general: a[t] - a[t + 1] is the normalised reward of the step ending at t (0 inside a
    # step), and the last token's advantage is the last step's normalised reward.
    flat = torch.tensor([1.0, 0.9, 0.8, 0.0, -1.0])
    normed = (flat - flat.mean()) / (flat.std() + 1e-4)
    drops = row[:-1] - row[1:]
    torch.testing.assert_close(drops, torch.tensor([0, 0, normed[0], normed[1], 0, 0, 0]))
    torch.testing.assert_close(row[-1], normed[2])


def test_matches_naive_loop_on_random_groups():
    gen = random.Random(1)
    for _ in range(50):
        G = gen.randint(1, 5)
        lengths = [gen.randint(0, 9) for _ in range(G)]
        ends, rewards = [], []
        for n in lengths:
            inner = sorted(gen.sample(range(n - 1), gen.randint(0, max(0, n - 1)))) if n else []
            es = [*inner, n - 1] if n else []
            ends.append(es)
            rewards.append([gen.choice([0.0, 0.5, 1.0, -1.0]) for _ in es])
        if max(lengths) == 0:
            continue
        adv = process_advantages(rewards, ends, lengths)
        pool = [r for rs in rewards for r in rs]
        if len(pool) >= 2 and len(set(pool)) > 1:
            mean = sum(pool) / len(pool)
            std = math.sqrt(sum((r - mean) ** 2 for r in pool) / (len(pool) - 1))
            normed = [[(r - mean) / (std + 1e-4) for r in rs] for rs in rewards]
        else:
            normed = [[0.0] * len(rs) for rs in rewards]
        for i in range(G):
            for t in range(max(lengths)):
                want = sum(v for v, e in zip(normed[i], ends[i]) if e >= t) if t < lengths[i] else 0
                assert adv[i, t].item() == pytest.approx(want, abs=1e-5)


def test_zero_beyond_lengths():
    adv = process_advantages([[1, 0], [0], [1]], [[0, 2], [1], [4]], [3, 2, 5])
    assert adv.shape == (3, 5)
    assert torch.equal(adv[0, 3:], torch.zeros(2))
    assert torch.equal(adv[1, 2:], torch.zeros(3))
    # A completion of length 0 (no steps) is all zeros.
    adv = process_advantages([[1, 0], []], [[0, 2], []], [3, 0])
    assert torch.equal(adv[1], torch.zeros(3))


@pytest.mark.parametrize(
    "rewards, ends, lengths, match",
    [
        ([[1, 0], [1]], [[0, 2], [1]], [3], "must be equal"),
        ([[1, 0], [1]], [[0, 2], [1, 2]], [3, 3], "completion 1: 1 step rewards but 2"),
        ([[1, 0], [1, 1]], [[2, 2], [0, 2]], [3, 3], "completion 0: step_ends must be strictly"),
        ([[1, 0], [1, 1]], [[0, 2], [0, 1]], [3, 3], "completion 1: last step end"),
        ([[1, 0], [1]], [[0, 2], [3]], [3, 3], "completion 1: last step end"),
        ([[1, 0], [1, 1]], [[-1, 2], [0, 2]], [3, 3], "completion 0: step_ends must be"),
        ([[1, 0], []], [[0, 2], []], [3, 3], "completion 1: length 3 but no steps"),
        ([[1, float("nan")]], [[0, 2]], [3], "completion 0: step rewards must be finite"),
        ([[1]], [[0]], [-1], "completion 0: negative"),
        ([], [], [], "empty group"),
    ],
)
def test_bad_inputs_raise(rewards, ends, lengths, match):
    with pytest.raises(ValueError, match=match):
        process_advantages(rewards, ends, lengths)


def test_bad_variant_and_outcome_arguments():
    with pytest.raises(ValueError, match="variant"):
        process_advantages([[1]], [[0]], [1], variant="max")
    with pytest.raises(ValueError, match="outcome_advantages"):
        process_advantages([[1]], [[0]], [1], variant="process+outcome")
    with pytest.raises(ValueError, match="expected G = 1"):
        process_advantages([[1]], [[0]], [1], variant="process+outcome", outcome_advantages=[1, 2])


def test_variant_process_plus_outcome():
    rewards, ends, lengths = [[1, 1, 0], [1, 0]], [[1, 3, 5], [2, 3]], [6, 4]
    base = process_advantages(rewards, ends, lengths)
    adv = process_advantages(rewards, ends, lengths, variant="process+outcome",
                             outcome_advantages=torch.tensor([0.5, -0.5]))
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2])
    torch.testing.assert_close(adv, base + torch.tensor([[0.5], [-0.5]]) * mask)


def test_variant_min_form_credit():
    # Same group as the DeepSeekMath example: a = 0.7301634 (reward 1), b = -1.0952452 (reward 0).
    # Min-form: token t gets min of the normalised rewards of its remaining steps.
    #   completion 0: tokens 0-3 -> min(a, a, b) = min(a, b) = b; tokens 4-5 -> b
    #   completion 1: tokens 0-2 -> min(a, b) = b; token 3 -> b
    b = -0.6 / (math.sqrt(0.3) + 1e-4)
    adv = process_advantages([[1, 1, 0], [1, 0]], [[1, 3, 5], [2, 3]], [6, 4], variant="min")
    torch.testing.assert_close(adv, torch.tensor([[b] * 6, [b] * 4 + [0.0, 0.0]]))
    adv = process_advantages([[0, 1], [1, 1]], [[0, 1], [0, 1]], [2, 2], variant="min")
    # Pool [0, 1, 1, 1]: mean 0.75, std 0.5 -> 0 -> -1.4997, 1 -> 0.4999
    lo, hi = -0.75 / (0.5 + 1e-4), 0.25 / (0.5 + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([[lo, hi], [hi, hi]]))
    # Splitting a good step into more good steps cannot raise min-form credit (it raises "sum").
    one = process_advantages([[1], [0]], [[3], [3]], [4, 4], variant="min")
    two = process_advantages([[1, 1], [0]], [[1, 3], [3]], [4, 4], variant="min")
    assert two[0, 0] <= one[0, 0] + 1e-6


def test_variant_position_normalisation():
    # Step position 0: rewards [1, 0] -> mean 0.5, std sqrt(0.5) -> +-0.5 / (0.7071068 + 1e-4)
    # Step position 1: rewards [1] only (completion 1 has one step) -> 0.
    c = 0.5 / (math.sqrt(0.5) + 1e-4)
    adv = process_advantages([[1, 1], [0]], [[0, 2], [2]], [3, 3], variant="position")
    torch.testing.assert_close(adv, torch.tensor([[c, 0.0, 0.0], [-c, -c, -c]]))


def test_step_statistics():
    stats = step_statistics([[1, 1, 0], [1, 0], [1, 1]], [[1, 3, 5], [2, 3], [0, 4]])
    assert stats["steps_per_completion"] == pytest.approx(7 / 3)
    assert stats["steps_per_completion_max"] == 3
    # step lengths: 2, 2, 2 | 3, 1 | 1, 4 -> 15 / 7
    assert stats["tokens_per_step"] == pytest.approx(15 / 7)
    assert stats["step_reward_mean"] == pytest.approx(5 / 7)
    assert stats["step_reward_std"] == pytest.approx(math.sqrt(5 / 7 * 2 / 7))
    assert stats["step_correct_rate"] == pytest.approx(5 / 7)
    assert stats["first_error_step"] == pytest.approx((3 + 2) / 2)  # 1-based
    assert stats["error_free_rate"] == pytest.approx(1 / 3)
    signed = step_statistics([[1, -1], [1, 1]])
    assert signed["first_error_step"] == 2 and "tokens_per_step" not in signed
    assert math.isnan(step_statistics([[1, 1]])["first_error_step"])


def _expand_by_repeat_interleave(credit, step_ends, lengths, T):
    """Step credit spread over tokens as first written (a repeat_interleave per completion)."""
    adv = torch.zeros(len(lengths), T, dtype=torch.float32)
    for i, (cr, es, n) in enumerate(zip(credit, step_ends, lengths)):
        if n:
            step_len = torch.diff(torch.tensor(es), prepend=torch.tensor([-1]))
            adv[i, :n] = torch.repeat_interleave(torch.tensor(cr, dtype=torch.float32), step_len)
    return adv


@pytest.mark.parametrize("variant", ANCHORED_VARIANTS)
def test_anchored_token_advantages_bit_identical_to_repeat_interleave(variant):
    rng = random.Random(1)
    for _ in range(50):
        G = rng.randrange(2, 9)
        rewards, ends, lengths = [], [], []
        for _ in range(G):
            n = rng.choice([0, 1, rng.randrange(2, 60)])
            cuts = sorted(rng.sample(range(n - 1), min(rng.randrange(0, 5), n - 1))) if n else []
            ends.append([*cuts, n - 1] if n else [])
            rewards.append([rng.choice([0.0, 1.0, rng.random()]) for _ in ends[-1]])
            lengths.append(n)
        if not max(lengths):
            continue
        alpha, T = rng.choice([1.0, 0.3]), max(lengths)
        oa = torch.randn(G, generator=torch.Generator().manual_seed(G))
        expected = _expand_by_repeat_interleave(anchored_credit(rewards, variant), ends,
                                                lengths, T) * alpha
        expected = expected + oa[:, None] * (torch.arange(T)[None] < torch.tensor(lengths)[:, None])
        got = process_advantages(rewards, ends, lengths, variant, oa, alpha=alpha)
        assert torch.equal(got, expected), variant
