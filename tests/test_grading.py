"""Tests for answer extraction and grading: equivalences, strictness, adversarial inputs."""

import time

import pytest

from reasoning_from_scratch import grading
from reasoning_from_scratch.grading import (
    extract_final_candidate,
    get_last_boxed,
    grade_answer,
    normalize_text,
    reward_rlvr,
)

# (prediction, ground truth) pairs that must grade equal
EQUAL = [
    ("42", "42"),
    (" 42 ", "42"),
    ("+7", "7"),
    ("-0", "0"),
    ("3/4", r"\frac{3}{4}"),
    ("(3)/(4)", "3/4"),
    (r"\frac{\sqrt{8}}{2}", "sqrt(2)"),
    (r"\( \frac{1}{2} + \frac{1}{6} \)", "2/3"),
    ("0.5", "1/2"),
    ("0.50", r"\frac12"),
    (".5", r"\dfrac{1}{2}"),
    (r"\tfrac{1}{2}", r"\frac{1}{2}"),
    (r"\frac{-1}{2}", r"-\frac{1}{2}"),
    (r"\frac1{2}", "0.5"),
    ("1,234/2", "617"),
    ("10,000", "10000"),
    (r"10,\!000", "10000"),
    ("1{,}000", "1000"),
    (r"\text{2/3}", "2/3"),
    (r"\textbf{7}", "7"),
    (r"2\cdot 3/4", "3/2"),
    (r"2 \times 3", "6"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    ("90°", "90"),
    (r"50\%", "50"),
    ("50%", "50"),
    (r"\$5.00", "5"),
    (r"\left(\frac{3}{4}\right)", "3/4"),
    (r"\sqrt{4}", "2"),
    (r"\sqrt{12}", r"2\sqrt{3}"),
    (r"\sqrt3", r"\sqrt{3}"),
    (r"\sqrt[3]{8}", "2"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
    ("x=3", "3"),
    ("3", "y = 3"),
    ("3+4i", "4i+3"),
    ("i^2", "-1"),
    (r"2\pi", r"\pi\cdot 2"),
    (r"\frac{\pi}{2}", "pi/2"),
    (r"e^{i\pi}", "-1"),
    (r"2\frac{1}{2}", "5/2"),
    ("2 1/2", "2.5"),
    (r"-1\frac{1}{4}", "-5/4"),
    ("x^2+2x+1", "(x+1)^2"),
    ("2(x+1)", "2x+2"),
    ("2^{10}", "1024"),
    ("10**3", "1000"),
    ("1.5e3", "1500"),
    ("(1, 2)", "(1,2)"),
    (r"\left(3, \frac{\pi}{2}\right)", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"(\frac12, 0.25)", "(0.5, 1/4)"),
    ("[1,2)", "[1, 2)"),
    (r"(-\infty, 3]", r"(-\infty,3]"),
    (r"(-\infty,0)\cup(1,\infty)", r"(-\infty, 0) \cup (1, \infty)"),
    (r"x \in [1,2]", "[1,2]"),
    ("1, -2", "-2, 1"),
    (r"\{1,2\}", r"\{2, 1\}"),
    (r"5\text{ cm}", "5"),
    (r"12 \text{ inches}^2", "12"),
    (r"\text{(C)}", "(c)"),
    (r"\text{Evelyn}", "Evelyn"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    (r"\boxed{5}", "5"),  # normalisation does not need to know about \boxed, but 5 == 5 after it
    # matrices and vectors: entries compared as numbers, any of pmatrix / bmatrix
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{bmatrix} 1 \\ 2 \end{bmatrix}"),
    (
        r"\begin{pmatrix}\frac{1}{3} \\ 0.5\end{pmatrix}",
        r"\begin{pmatrix}1/3 \\ \frac12\end{pmatrix}",
    ),
    (
        r"\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}",
        r"\begin{bmatrix}1 & 2 \\ 3 & 4 \\ \end{bmatrix}",
    ),
    (
        r"\begin{pmatrix}-\sqrt{8}/2 \\ 0\end{pmatrix}",
        r"\begin{pmatrix}-\sqrt{2} \\ 0\end{pmatrix}",
    ),
    # base subscripts
    ("4210_5", "4210_{5}"),
    ("4210_{10}", "4210"),
    # thousands separators
    ("10{,}000", "10000"),
    (r"10\!000", "10000"),
    (r"10\,000", "10000"),
    (r"10\,000\,000", "10,000,000"),
    ("(10{,}000, 5)", "(10000, 5)"),  # also inside a tuple, where 10,000 would be two entries
    (r"(10,\!000, 5)", "(10000, 5)"),
    # \pm: the set of both values
    (r"1 \pm \sqrt{2}", r"1+\sqrt{2}, 1-\sqrt{2}"),
    (r"1 \pm \sqrt{2}", r"1-\sqrt{2}, 1+\sqrt{2}"),
    (r"x = 1 \mp \sqrt{2}", r"1\pm\sqrt2"),
    (r"\pm 2", "2, -2"),
    ("1 ± 2", "3, -1"),
    # trailing units and text after a number
    (r"5.4 \text{ cents}", "5.4"),
    ("5.4cents", "5.4"),
    (r"5.4\text{cents}", "5.4"),
    ("5.4 cents.", "5.4"),
    ("12 sq ft", "12"),
    ("3 cm^2", "3"),
    # function names, with or without a space or braces
    (r"\cot x", r"\cotx"),
    (r"\cot{x}", r"\cot x"),
    (r"\cot(x)", r"\cotx"),
    (r"\sin x", r"\sinx"),
    (r"\cos{x}", r"\cosx"),
    (r"\tan x", r"\tan(x)"),
    (r"\sec x", r"\secx"),
    (r"\csc{x}", r"\cscx"),
    (r"\log x", r"\logx"),
    (r"\ln x", r"\lnx"),
    (r"\sin 2x", r"\sin(2x)"),
    (r"\sin 2x", r"2\sin x\cos x"),
    (r"\sin^2 x + \cos^2 x", "1"),
    (r"\sec x", r"\frac{1}{\cos x}"),
    (r"\sin\frac{\pi}{6}", r"\frac12"),
    # intervals and set algebra, compared as sets of reals
    (r"(0,36) \setminus \{9\}", r"(0,9) \cup (9,36)"),
    (r"x \in (0,36) \setminus \{9\}", r"(9,36) \cup (0,9)"),
    (r"(0, 36) \backslash \{9\}", r"(0,9) \cup (9,36)"),
    (r"(0,1] \cup (1,2)", "(0,2)"),
    (r"\mathbb{R} \setminus \{0\}", r"(-\infty,0)\cup(0,\infty)"),
    (r"(-\infty, \frac{1}{2}) \cup (1, \infty)", r"(-\infty, 0.5)\cup(1,\infty)"),
    (r"((0,1)\cup(2,3))\setminus\{2.5\}", r"(0,1)\cup(2,2.5)\cup(2.5,3)"),
    (r"\{1,2\}\cup\{3\}", r"\{3,2,1\}"),
]

# pairs that must NOT grade equal
NOT_EQUAL = [
    ("41", "42"),
    ("", "42"),
    ("42", ""),
    (None, "1"),
    ("(2, 1)", "(1, 2)"),
    ("(1, 2, 3)", "(1, 2)"),
    ("[1,2)", "(1,2)"),
    ("[1,2]", "[1,2)"),
    ("0.3333333333", "1/3"),
    ("50%", "1/2"),
    ("0.5", "50"),
    (r"\sqrt{2}", "1.41421356"),
    ("x+1", "x+2"),
    ("x", "y"),
    ("3+4i", "3-4i"),
    (r"\pi", "3.14159"),
    ("1/0", "1"),
    ("2", r"\frac{1}{0}"),
    (r"\frac{1}{2}", "2"),
    ("12", "1,2"),
    ("1, 2", "1, 2, 2"),
    (r"(-\infty,0)\cup(1,\infty)", r"(-\infty,0)\cup[1,\infty)"),
    (r"\text{(B)}", "(c)"),
    ("x^2", "2x"),
    ("e", "2.718281828"),
    (r"\text{east}", r"\text{seat}"),  # words are not products of letters
    ("abc", "cba"),
    # matrices: shape and order matter; a determinant (vmatrix) or a tuple is something else
    (r"\begin{pmatrix} 1 & 2 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 1 & 2 \end{pmatrix}"),
    (r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    (r"\begin{pmatrix} 1 \\ 2 \\ 3 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    (r"\begin{pmatrix}1 & 3 \\ 2 & 4\end{pmatrix}", r"\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}"),
    (r"\begin{pmatrix} 0.333 \\ 2 \end{pmatrix}", r"\begin{pmatrix} \frac13 \\ 2 \end{pmatrix}"),
    (r"\begin{vmatrix} 1 \\ 2 \end{vmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    ("(1,2)", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    # base subscripts
    ("4210_5", "4210_6"),
    ("4210_{6}", "4210_5"),
    ("4211", "4210_5"),
    ("555", "4210_5"),  # the decimal value is not the number written in base 5
    ("4210_5", "4210"),  # a bare reference is decimal
    ("4210_{3}", "4210_3"),  # 4 is not a base-3 digit
    ("10_{0}", "10_0"),
    ("x_{1}", "x_1"),
    ("1{,}00", "100"),
    # \pm needs both values
    (r"1+\sqrt{2}", r"1 \pm \sqrt{2}"),
    (r"1 \pm \sqrt{2}", r"1+\sqrt{2}"),
    (r"1+\sqrt{2}, 1-\sqrt{3}", r"1 \pm \sqrt{2}"),
    (r"1 \pm \sqrt{2}", r"1 \pm \sqrt{3}"),
    # only a word after a number is a unit
    ("x+1", "1"),
    ("2x", "2"),
    ("3xy", "3"),
    ("2pi", "2"),
    ("5 apples", "6"),
    ("5.4cents", "5.5"),
    # functions
    (r"\tan x", r"\cot x"),
    (r"\cot x", r"\cot y"),
    (r"\sin x", "x"),
    (r"\sinh x", r"\sin x"),
    (r"\sin 2x", r"2\sin x"),
    # set algebra: open and closed ends count
    (r"(0,9) \cup [9,36)", r"(0,36) \setminus \{9\}"),
    (r"(0,36) \setminus \{9\}", r"(0,9) \cup [9,36)"),
    (r"(0,36)", r"(0,36) \setminus \{9\}"),
    (r"(0,36) \setminus \{9\}", r"(0,36)"),
    (r"[0,1] \cup (1,2)", "(0,2)"),
    ("(0,2)", r"[0,1] \cup (1,2)"),
    ("5", r"(0,9)\cup(9,36)"),
    ("(0,9), (9,36)", r"(0,9)\cup(9,36)"),
    (r"\mathbb{R} \setminus \{1\}", r"(-\infty,0)\cup(0,\infty)"),
    (r"\{1,2,3\}\cup(4,5)", r"(1,2,3)\cup(4,5)"),  # a triple is not an interval or a set
]


@pytest.mark.parametrize("pred,gt", EQUAL)
def test_equivalent_answers(pred, gt):
    assert grade_answer(pred, gt) is True
    assert grade_answer(gt, pred) is True  # symmetric


@pytest.mark.parametrize("pred,gt", NOT_EQUAL)
def test_different_answers(pred, gt):
    assert grade_answer(pred, gt) is False


def test_base_subscript_direction():
    """A bare prediction is read in the reference's base; a bare reference is decimal."""
    assert grade_answer("4210", "4210_5") is True
    assert grade_answer("4210", "4210_{5}") is True
    assert grade_answer("a2b", "A2B_{16}") is True
    assert grade_answer("4210_5", "4210") is False
    assert grade_answer("4210_{10}", "4210") is True


def test_plain_numbers_never_need_sympy(monkeypatch):
    """Integers, decimals and simple fractions are settled by the exact fast path."""

    def fail(*args, **kwargs):
        raise AssertionError("sympy worker used for a plain number")

    monkeypatch.setattr(grading._WORKER, "request", fail)
    for pred, gt, expected in [
        ("118", "118", True),
        ("117", "118", False),
        ("-3", "-3", True),
        ("0.5", r"\frac{1}{2}", True),
        ("2/4", "0.5", True),
        (r"\frac{1}{3}", "0.333", False),
        ("1,000", "1000", True),
        ("(1,2)", "(1, 2)", True),
        (r"\sqrt{9}", "3", True),
        ("2^{10}", "1024", True),
        (r"\frac{\pi}{2}", r"\pi/2", True),  # same parse tree
        (r"\cot x", r"\cotx", True),
        (
            r"\begin{pmatrix}\frac{1}{3}\\0.5\end{pmatrix}",
            r"\begin{pmatrix}1/3\\2/4\end{pmatrix}",
            True,
        ),
        ("4210", "4210_{5}", True),
        ("4210_5", "4210_6", False),
        ("(10{,}000, 5)", "(10000, 5)", True),
        ("1 ± 2", "-1, 3", True),
        ("5.4cents", "5.4", True),
    ]:
        assert grade_answer(pred, gt) is expected, (pred, gt)


# ----------------------------------------------------------------------------------------------
# extraction
# ----------------------------------------------------------------------------------------------
def test_get_last_boxed():
    assert get_last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert get_last_boxed(r"\boxed{x^{2}+{y}}") == "x^{2}+{y}"  # nested braces
    assert get_last_boxed(r"\boxed {7}") == "7"
    assert get_last_boxed(r"$\boxed 5$") == "5"
    assert get_last_boxed(r"\boxed5") == "5"
    assert get_last_boxed(r"\fbox{3}") == "3"
    assert get_last_boxed(r"\boxed{12") is None  # cut off by max_new_tokens
    assert get_last_boxed("no box here") is None
    assert get_last_boxed("") is None
    assert get_last_boxed(None) is None
    assert get_last_boxed(r"\boxed") is None


def test_extract_final_candidate_fallbacks():
    text = "first 12 then 3/4 and finally 1,234 apples"
    assert extract_final_candidate(r"a \boxed{ $7$ } b 9") == "7"
    assert extract_final_candidate(text) == "1,234"
    assert extract_final_candidate(text, fallback="number") == "1,234"
    assert extract_final_candidate("x = 3/4", fallback="number") == "3/4"
    assert extract_final_candidate("no digits", fallback="number_then_full") == "no digits"
    assert extract_final_candidate("no digits", fallback="number") == ""
    assert extract_final_candidate(text, fallback="full") == text
    assert extract_final_candidate(text, fallback="none") == ""
    assert extract_final_candidate("", fallback="full") == ""
    with pytest.raises(ValueError, match="fallback"):
        extract_final_candidate(text, fallback="bogus")


def test_normalize_text():
    assert normalize_text(r"\left( \dfrac{1}{2}, 3 \right)") == r"(\frac{1}{2},3)"
    assert normalize_text(r"\text{ Yes }") == "yes"
    assert normalize_text(r"$10,\!000$") == "10000"
    assert normalize_text(r"45^\circ") == "45"
    assert normalize_text(r"\pi r^2") == r"\pi r^2"
    assert normalize_text(r"(10{,}000, 10\,000, 10,\!000, 10\!000)") == "(10000,10000,10000,10000)"
    assert normalize_text("5.4 cents") == "5.4"
    assert normalize_text("12 sq ft") == "12"
    assert normalize_text("2xy") == "2xy"  # short letter runs are variables, not units
    assert normalize_text(r"3\sqrt{x}") == r"3\sqrt{x}"
    assert normalize_text("<|im_end|>7.") == "7"
    assert normalize_text(None) == ""


def test_reward_rlvr_requires_a_boxed_answer():
    reference = " <think>\nStep 1: 17+25=42\nStep 2: 42*3=126\n</think>\n\\boxed{126}"
    assert reward_rlvr(reference, "126") == 1.0
    assert reward_rlvr(r"The answer is \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert reward_rlvr("The answer is 126", "126") == 0.0  # no box: strict
    assert reward_rlvr(r"\boxed{125}", "126") == 0.0
    assert reward_rlvr(r"\boxed{}", "126") == 0.0
    assert reward_rlvr("", "126") == 0.0
    assert reward_rlvr(None, "126") == 0.0


# ----------------------------------------------------------------------------------------------
# adversarial inputs: bounded time, no code execution
# ----------------------------------------------------------------------------------------------
ADVERSARIAL = [
    "9^{9^{9^{9}}}",
    "9^9^9^9",
    "10**10**10",
    "2^{2^{2^{2^{2^{2}}}}}",
    "x^{10^{10}}",
    r"\sqrt{2}^{10^{9}}",
    "(1+x)^{100000}",
    "1e99999",
    "(" * 10_000 + "1" + ")" * 10_000,
    "{" * 10_000 + "1" + "}" * 10_000,
    "-" * 10_000 + "1",
    "1+" * 5_000 + "1",
    "7" * 1_000_000,
    "a" * 1_000_000,
    r"\frac{" * 3_000 + "1" + "}{2}" * 3_000,
    "(1," * 2_000 + "1" + ")" * 2_000,
    ",".join(["1"] * 10_000),
    r"\sin" * 5_000 + "x",
    r"\sin^{" * 2_000 + "x" + "}" * 2_000,
    r"\begin{pmatrix}" + "1&" * 5_000 + r"1\end{pmatrix}",
    r"\begin{pmatrix}" + "1;" * 60 + r"1\end{pmatrix}",
    r"(0,1)\cup" * 60 + "(0,1)",
    r"(0,1)\cup" * 5_000 + "(0,1)",
    r"\mathbb{R}\setminus" * 60 + r"\{0\}",
    "(" * 100 + r"(0,1)\cup(2,3)" + ")" * 100,
    r"(0,9^{9^{9^{9}}})\cup(1,2)",
    r"\pm" * 5_000 + "1",
    "1" * 500 + "_5",
    "1" + r"\!000" * 3_000,
]


@pytest.mark.parametrize("payload", ADVERSARIAL, ids=lambda p: repr(p[:20]) + f"...{len(p)}")
def test_adversarial_inputs_are_fast_and_wrong(payload):
    for pred, gt in [(payload, "1"), ("1", payload), (payload, payload[:-1] + "2")]:
        start = time.perf_counter()
        assert grade_answer(pred, gt) is False
        assert time.perf_counter() - start < 2.0
    start = time.perf_counter()
    assert reward_rlvr(r"\boxed{" + payload + "}", "1") == 0.0
    assert time.perf_counter() - start < 2.0


def test_python_payloads_are_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [
        f"__import__('os').system('touch {marker}')",
        f"__import__('pathlib').Path('{marker}').touch()",
        f"exec(\"open('{marker}','w')\")",
        f"eval('open(\"{marker}\",\"w\")')",
        "lambda: 0",
        "().__class__.__bases__[0].__subclasses__()",
    ]
    for payload in payloads:
        start = time.perf_counter()
        assert grade_answer(payload, "0") is False
        assert grade_answer("0", payload) is False
        assert reward_rlvr(r"\boxed{" + payload + "}", "0") == 0.0
        assert time.perf_counter() - start < 2.0
    assert not marker.exists()


def test_sympy_worker_deadline_kills_and_restarts():
    """A request that overruns its deadline returns None in time; the next call still works."""
    worker = grading._WORKER
    assert worker.request({"a": "x+1", "b": "1+x"}, time.monotonic() + 30) == {"equal": True}
    pid = worker.proc.pid
    start = time.perf_counter()
    reply = worker.request({"sleep": 60, "a": "1", "b": "1"}, time.monotonic() + 0.3)
    assert reply is None
    assert time.perf_counter() - start < 2.0
    assert worker.proc is not None and worker.proc.pid != pid  # killed, fresh one started
    assert worker.request({"a": r"\sqrt{8}/2", "b": r"\sqrt{2}"}, time.monotonic() + 30) == {
        "equal": True
    }


def test_slow_symbolic_comparison_is_cut_off():
    grade_answer("x+1", "1+x")  # make sure the worker is up (its one-off start is not timed)
    start = time.perf_counter()
    assert grade_answer(r"(x+y+z+w+2)^{60}-(x+y+z+w+1)^{60}", "1") is False
    assert time.perf_counter() - start < 2.0
