"""Answer extraction and grading: the verifier behind RL with verifiable rewards (RLVR).

The reward in GRPO training is only as good as this module: a grader that crashes, hangs or can be
fooled breaks a training run hours in. So grading is layered from cheap to expensive:

1. raw string / integer equality (microseconds: the common case during RL on integer answers);
2. equality after `normalize_text` (LaTeX clean-up: `\\dfrac`, `\\left`, `\\text{}`, degrees, ...);
3. exact rational arithmetic with `fractions.Fraction` on a tree from our own small parser
   (`0.5` = `\\frac12` = `2/4`), no sympy involved;
4. only then sympy (`\\frac{\\sqrt8}{2}` = `\\sqrt2`, `3+4i` = `4i+3`, and sets of reals:
   `(0,36)\\setminus\\{9\\}` = `(0,9)\\cup(9,36)`), in a separate worker process with a hard
   deadline (see `_SympyWorker`).

Answers with parts (tuples, intervals, matrices, `\\pm`, lists of solutions) are compared part by
part, so each part still takes the cheapest layer that decides it.

Safety: nothing here calls `eval`, `sympy.sympify` or `sympy.parse_expr` (they evaluate Python, so
`__import__('os').system(...)` inside `\\boxed{}` would run). Strings are parsed by the recursive
descent parser below into a tiny tree of numbers, symbols, + - * / ^ sqrt and \\sin-like nodes, then
turned into sympy objects directly. Size limits (input length, nesting depth, power size) reject
inputs like `9^{9^{9^{9}}}` before any arithmetic is attempted.
"""

import atexit
import json
import math
import operator
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction

# ---------------------------------------------------------------------------------------------
# Limits (module-level so that callers and tests can inspect or tune them)
# ---------------------------------------------------------------------------------------------
MAX_ANSWER_CHARS = 10_000  # longer predictions are wrong answers, not something to normalise
MAX_NORMALIZED_CHARS = 1_000  # whole normalised answer (tuples included)
MAX_PARSE_CHARS = 500  # one scalar expression handed to the parser
MAX_NESTING = 60  # parser recursion depth (parentheses, unary signs, exponents)
MAX_PARTS = 64  # elements of a tuple / interval / list
MAX_POWER_BITS = 100_000  # |exponent| * bits(base) allowed for exact integer powers
MAX_EXPONENT = 1_000  # |exponent| allowed when the base is symbolic or irrational
SYMPY_BUDGET_S = 1.0  # wall-clock budget of all sympy work inside one grade_answer call
WORKER_START_TIMEOUT_S = 60.0  # one-off: starting the worker and importing sympy


# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------
_BRACE_RE = re.compile(r"[{}]")
_UNBRACED_RE = re.compile(r"[^\s$}]+")
_RE_NUMBER = re.compile(
    r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+/\d+|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|\.\d+)"
)
_FALLBACKS = ("number_then_full", "number", "number_only", "full", "none")


def get_last_boxed(text):
    """Return the content of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed X`, else None."""
    if not text:
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start == -1:
        return None
    name_end = start + (6 if text.startswith("\\boxed", start) else 5)
    i = name_end
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        # `\boxed 5` / `\boxed5` (no braces): the answer runs until whitespace or a `$`.
        if i == name_end and not text[i].isdigit():
            return None  # `\boxedfoo` is some other command
        m = _UNBRACED_RE.match(text, i)
        return m.group(0) if m else None
    return braced_content(text, i)


def braced_content(text, i):
    """The text inside the brace group that opens at `text[i]` (a "{"), nested braces kept;
    None when it never closes (the answer was cut off)."""
    depth = 0
    for m in _BRACE_RE.finditer(text, i):  # nested braces, linear time even on huge texts
        depth += 1 if m.group(0) == "{" else -1
        if depth == 0:
            return text[i + 1 : m.start()]
    return None


def extract_final_candidate(text, fallback="number_then_full"):
    """Last boxed answer of `text`; if none, by `fallback`: last number, whole text, or "".

    `fallback=None` (the book's "require \\boxed{}") is "none".
    """
    if fallback is None:
        fallback = "none"
    if fallback not in _FALLBACKS:
        raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")
    if not text:
        return ""
    boxed = get_last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip().strip("$ ").strip()
    if fallback in ("number_then_full", "number", "number_only"):
        numbers = _RE_NUMBER.findall(text)
        if numbers:
            return numbers[-1]
        if fallback == "number_then_full":
            return text.strip()
        return ""
    if fallback == "full":
        return text.strip()
    return ""


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------
_SPECIAL_TOKEN_RE = re.compile(r"<\|[^>]{0,40}?\|>")
_UNIT_RE = re.compile(
    r"(?<=[\d}])\s*\\(?:text|mbox|mathrm)\s*\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\^\{?\d\}?)?\s*$"
)
_WRAPPER_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|mathit|boldsymbol|operatorname|boxed|fbox)"
    r"\s*\{([^{}]*)\}"
)
_SIMPLE_REPLACEMENTS = [
    ("\\\\", ";"),  # LaTeX line break (matrix rows), before single-backslash commands
    ("\\$", ""),
    ("$", ""),
    ("\\%", ""),
    ("%", ""),
    ("\\cdot", "*"),
    ("\\times", "*"),
    ("×", "*"),
    ("·", "*"),
    ("\\div", "/"),
    ("÷", "/"),
    ("**", "^"),
    ("−", "-"),
    ("∞", "\\infty"),
    ("π", "\\pi"),
    ("°", ""),
    ("\\degree", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("{,}", ","),
    ("±", "\\pm"),
    ("∓", "\\mp"),
    ("\\backslash", "\\setminus"),  # A \backslash B is also written for a set difference
]
_REGEX_REPLACEMENTS = [
    (re.compile(r"\\[()\[\]]"), ""),  # \( \) \[ \] math wrappers
    (re.compile(r"\\left\s*\.|\\right\s*\."), ""),  # invisible delimiters
    (re.compile(r"\\(?:left|right|[bB]igg?[lr]?|displaystyle)(?![a-zA-Z])"), ""),
    (re.compile(r"\\!"), ""),  # negative thin space, as in 10,\!000
    (re.compile(r"\\[,;: ]|\\q?quad(?![a-zA-Z])|~"), " "),  # spacing commands
    (re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![a-zA-Z])"), ""),  # degrees
    # mixed numbers: 2\frac{1}{2} and "2 1/2" mean 2 + 1/2 (MATH convention)
    (re.compile(r"(?<![\w.^/}])(\d+)\s*\\frac\s*\{(\d+)\}\s*\{(\d+)\}"), r"(\1+\2/\3)"),
    (re.compile(r"(?<![\w.^/}])(\d+)\s*\\frac\s*(\d)\s*(\d)(?!\d)"), r"(\1+\2/\3)"),
    (re.compile(r"(?<![\w.^/}])(\d+)\s+(\d+)/(\d+)(?![\w.])"), r"(\1+\2/\3)"),
]
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# 10{,}000, 10,\!000, 10\!000, 10\,000: explicit LaTeX digit grouping, removed even inside a tuple
_THOUSANDS_MARK_RE = re.compile(r"(?<=\d)(?:\{,\}|,?\\!|\\,)(?=\d{3}(?!\d))")
# 5.4cents, 12 sq ft: a bare word after a number is a unit. Words need 3+ letters (2x, 3xy, 2pi
# stay products) unless they are common short units; sqrt/infty are never units.
_BARE_UNIT_RE = re.compile(
    r"(?<=[\d}])(?!sqrt|infty)(?:[a-z]{3,}|cm|mm|km|kg|mg|ml|ft|in|yd|mi|hr|oz|lb)(?:\^\{?\d\}?)?$"
)
_CMD_SPACE_RE = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])")


def normalize_text(text):
    """Canonical form of an answer string: LaTeX noise removed, lower case, no spaces."""
    if not text:
        return ""
    s = _SPECIAL_TOKEN_RE.sub("", str(text)).strip()
    s = _THOUSANDS_MARK_RE.sub("", s)
    for old, new in _SIMPLE_REPLACEMENTS:
        s = s.replace(old, new)
    s = _UNIT_RE.sub("", s)
    for _ in range(3):  # \text{\textbf{x}}: unwrap innermost first
        s, count = _WRAPPER_RE.subn(r"\1", s)
        if not count:
            break
    for pattern, replacement in _REGEX_REPLACEMENTS:
        s = pattern.sub(replacement, s)
    s = s.strip()
    # 1,234 is a number unless the whole answer is a bracketed tuple/interval like (1,234)
    if not s.startswith(("(", "[", "\\{")):
        s = _THOUSANDS_RE.sub("", s)
    # drop whitespace, but keep one space where `\pi r` would otherwise become `\pir`
    s = _CMD_SPACE_RE.sub("\\1\x00", s)
    s = "".join(s.split()).replace("\x00", " ")
    return _BARE_UNIT_RE.sub("", s.rstrip(".").lower())


# ---------------------------------------------------------------------------------------------
# A small, safe expression parser: LaTeX subset -> tree of tuples
# ---------------------------------------------------------------------------------------------
class _ParseError(ValueError):
    """The string is not an expression this grader understands."""


class _TooBig(ValueError):
    """The expression would be enormous to evaluate (huge powers, towers)."""


_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
    "vartheta", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "phi", "varphi",
    "chi", "psi", "omega",
}  # fmt: skip
_LETTERS_RE = re.compile(r"[a-zA-Z]+")
# LaTeX function -> sympy function (a fixed table: no name taken from an answer reaches getattr)
_FUNCTIONS = {
    "sin": "sin", "cos": "cos", "tan": "tan", "cot": "cot", "sec": "sec", "csc": "csc",
    "arcsin": "asin", "arccos": "acos", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
    "tanh": "tanh", "log": "log", "ln": "log", "exp": "exp",
}  # fmt: skip
# longest first, so that `\sinhx` is sinh(x), not sin(h*x)
_FUNCTION_RE = re.compile("|".join(sorted(_FUNCTIONS, key=len, reverse=True)))
_CONSTANT_LETTERS = {"e": "e", "i": "i"}  # Euler's number and the imaginary unit


class _Parser:
    """Recursive descent: + - * / ^, implicit products, brackets, \\frac, \\sqrt, \\sin, pi, e."""

    def __init__(self, s):
        self.s = s
        self.i = 0
        self.depth = 0

    def parse(self):
        """Parse the whole string into a tree; raise _ParseError on anything unexpected."""
        node = self.expr()
        if self.peek():
            raise _ParseError(f"unexpected {self.peek()!r} at {self.i}")
        return node

    def peek(self):
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else ""

    def expect(self, char):
        if self.peek() != char:
            raise _ParseError(f"expected {char!r} at {self.i}")
        self.i += 1

    def enter(self):
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise _ParseError("expression nested too deeply")

    def expr(self):
        self.enter()
        node = self.term()
        while self.peek() in ("+", "-"):
            op = "add" if self.s[self.i] == "+" else "sub"
            self.i += 1
            node = (op, node, self.term())
        self.depth -= 1
        return node

    def term(self):
        node = self.unary()
        while True:
            c = self.peek()
            if c in ("*", "/"):
                self.i += 1
                node = ("mul" if c == "*" else "div", node, self.unary())
            elif c and (c.isalnum() or c in "({\\.") and not self.at_word_operator():
                node = ("mul", node, self.power())  # implicit product: 2x, 3\sqrt{2}, (a)(b)
            else:
                return node

    def at_word_operator(self):
        return self.s.startswith(("\\cup", "\\in"), self.i)

    def unary(self):
        self.enter()
        c = self.peek()
        if c in ("+", "-"):
            self.i += 1
            operand = self.unary()
            node = ("neg", operand) if c == "-" else operand
        else:
            node = self.power()
        self.depth -= 1
        return node

    def power(self):
        base = self.primary()
        if self.peek() == "^":
            self.i += 1
            return ("pow", base, self.unary())  # right associative: 10^10^10 = 10^(10^10)
        return base

    def primary(self):
        self.enter()
        node = self._primary()
        self.depth -= 1
        return node

    def _primary(self):
        c = self.peek()
        if c in ("(", "[", "{"):
            self.i += 1
            node = self.expr()
            self.expect({"(": ")", "[": "]", "{": "}"}[c])
            return node
        if c.isdigit() or c == ".":
            return self.number()
        if c == "\\":
            return self.command()
        if c.isalpha() and c.isascii():
            return self.word()
        raise _ParseError(f"unexpected {c!r} at {self.i}" if c else "unexpected end")

    def number(self):
        m = re.compile(r"\d*\.?\d+|\d+\.").match(self.s, self.i)
        if not m:
            raise _ParseError(f"bad number at {self.i}")
        self.i = m.end()
        value = Fraction(m.group(0))
        sci = re.compile(r"e([+-]?\d{1,4})(?![\d.])").match(self.s, self.i)  # 1.5e3
        if sci:
            exponent = int(sci.group(1))
            if abs(exponent) > MAX_EXPONENT:
                raise _TooBig("scientific exponent too large")
            self.i = sci.end()
            value *= Fraction(10) ** exponent
        return ("num", value)

    def command(self):
        m = re.compile(r"\\([a-zA-Z]+)").match(self.s, self.i)
        if not m:
            raise _ParseError(f"bad command at {self.i}")
        self.i = m.end()
        name = m.group(1)
        if name == "frac":
            return ("div", self.argument(), self.argument())
        if name == "sqrt":
            degree = ("num", Fraction(2))
            if self.peek() == "[":
                self.i += 1
                degree = self.expr()
                self.expect("]")
            return ("root", self.argument(), degree)
        if name == "pi":
            return ("const", "pi")
        if name in ("infty", "infinity"):
            return ("const", "oo")
        if name in _GREEK:
            return ("sym", name)
        function = _FUNCTION_RE.match(name)
        if function:
            self.i -= len(name) - function.end()  # `\cotx` is `\cot x`: x is the argument
            return self.function(function.group(0))
        raise _ParseError(f"unsupported command \\{name}")

    def function(self, name):
        """`\\sin x`, `\\sin{x}`, `\\sin(2x)`, `\\sin 2x`, `\\sin^2 x` after the name."""
        exponent = None
        if self.peek() == "^":
            self.i += 1
            exponent = self.unary()
        if self.peek() in ("(", "{"):
            argument = self.primary()
        else:  # `\sin 2x` is sin(2x): the argument runs over the implicit product that follows
            argument = self.power()
            while self.peek().isalnum():
                argument = ("mul", argument, self.power())
        node = ("func", name, argument)
        return node if exponent is None else ("pow", node, exponent)

    def argument(self):
        """A LaTeX macro argument: `{expr}` or a single character (`\\frac12`)."""
        c = self.peek()
        if c == "{":
            return self.primary()
        if c == "\\":
            return self.command()
        if c.isdigit():
            self.i += 1
            return ("num", Fraction(int(c)))
        if c.isalpha() and c.isascii():
            self.i += 1
            return self.letter(c)
        raise _ParseError(f"bad argument at {self.i}")

    def word(self):
        if self.s.startswith("sqrt", self.i):
            self.i += 4
            return ("root", self.argument_or_paren(), ("num", Fraction(2)))
        if self.s.startswith("pi", self.i):
            self.i += 2
            return ("const", "pi")
        if self.s.startswith("infty", self.i):
            self.i += 5
            return ("const", "oo")
        run = _LETTERS_RE.match(self.s, self.i).group(0)
        if len(run) >= 3:  # a word ("east", "yes"): text, not a product of symbols e*a*s*t
            raise _ParseError(f"word {run!r} is not an expression")
        self.i += 1
        return self.letter(run[0])  # "xy" is x*y through the implicit product in term()

    def argument_or_paren(self):
        return self.primary() if self.peek() == "(" else self.argument()

    @staticmethod
    def letter(c):
        return ("const", _CONSTANT_LETTERS[c]) if c in _CONSTANT_LETTERS else ("sym", c)


def _parse(s):
    """Parse a normalised scalar answer into a tree; raises _ParseError / _TooBig."""
    if len(s) > MAX_PARSE_CHARS:
        raise _TooBig("expression too long")
    return _Parser(s).parse()


# The four arithmetic node kinds of the parse tree; shared by exact and sympy evaluation.
_BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


def _exact_value(node):
    """Exact Fraction value of a tree, None if irrational/symbolic; raises _TooBig, ZeroDivision.

    All children are visited even when the result is None, so the power guard sees every `^`.
    """
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind in ("sym", "const"):
        return None
    if kind == "func":
        _exact_value(node[2])  # only for the power guards: sin(1) is not rational
        return None
    if kind == "neg":
        v = _exact_value(node[1])
        return None if v is None else -v
    a, b = _exact_value(node[1]), _exact_value(node[2])
    if kind == "pow":
        return _exact_power(a, b)
    if kind == "root":
        return _exact_root(a, b)
    if a is None or b is None:
        return None
    return _BINARY[kind](a, b)  # "div": ZeroDivisionError propagates; 1/0 is not an answer


def _exact_power(base, exponent):
    """base ** exponent when both are exact and the result is small; guards against towers."""
    if exponent is None:
        return None
    if abs(exponent.numerator) > MAX_POWER_BITS:
        raise _TooBig("exponent too large")
    if base is None:
        if abs(exponent) > MAX_EXPONENT:  # x^(10^6) or sqrt(2)^(10^6): sympy would expand it
            raise _TooBig("exponent too large for a symbolic base")
        return None
    if exponent.denominator != 1:
        if abs(exponent.numerator) > MAX_EXPONENT:
            raise _TooBig("fractional exponent too large")
        return None  # maybe irrational: leave it to sympy
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if base not in (0, 1, -1) and bits * abs(exponent.numerator) > MAX_POWER_BITS:
        raise _TooBig("power too large")
    return base ** int(exponent)


def _exact_root(value, degree):
    """Exact square root of a perfect-square Fraction, else None (sympy decides)."""
    if value is None or degree != 2 or value < 0:
        return None
    num, den = math.isqrt(value.numerator), math.isqrt(value.denominator)
    if num * num == value.numerator and den * den == value.denominator:
        return Fraction(num, den)
    return None


# ---------------------------------------------------------------------------------------------
# sympy comparison (runs inside the worker process)
# ---------------------------------------------------------------------------------------------
def _to_sympy(node, sp):
    """Build sympy objects from a parsed tree (no string is ever handed to sympy)."""
    kind = node[0]
    if kind == "num":
        return sp.Rational(node[1].numerator, node[1].denominator)
    if kind == "sym":
        return sp.Symbol(node[1])
    if kind == "const":
        return {"pi": sp.pi, "e": sp.E, "i": sp.I, "oo": sp.oo}[node[1]]
    if kind == "neg":
        return -_to_sympy(node[1], sp)
    if kind == "func":
        return getattr(sp, _FUNCTIONS[node[1]])(_to_sympy(node[2], sp))
    a, b = _to_sympy(node[1], sp), _to_sympy(node[2], sp)
    if kind in _BINARY:
        return _BINARY[kind](a, b)
    if kind == "pow":
        return a**b
    return a ** (sp.Integer(1) / b)  # "root"


def _sympy_value(s, sp):
    """sympy object of a normalised scalar answer, through the parser and its size guards."""
    tree = _parse(s)
    _exact_value(tree)  # re-run the size guards in this process too
    return _to_sympy(tree, sp)


def to_sympy(text, sp):
    """The `sp` (sympy module) object of a normalised scalar answer such as '2x+3x' or
    '\\frac{3}{4}', built by the safe parser above (never `eval`); None if it does not parse or
    is too big. Whitespace is ignored."""
    try:
        return _sympy_value("".join(str(text).split()), sp)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):  # _ParseError, _TooBig
        return None


def _sympy_set(s, sp, depth=0):
    """sympy set of a normalised answer: intervals, \\{...\\}, \\mathbb{R}, \\cup, \\setminus."""
    kind, parts = _structure(s)
    if depth > MAX_NESTING or len(parts) > MAX_PARTS:
        raise _TooBig("set expression too large")
    if kind == "union":
        return sp.Union(*(_sympy_set(p, sp, depth + 1) for p in parts))
    if kind == "minus":  # A \setminus B \setminus C = (A \setminus B) \setminus C
        result = _sympy_set(parts[0], sp, depth + 1)
        for part in parts[1:]:
            result = sp.Complement(result, _sympy_set(part, sp, depth + 1))
        return result
    if kind == "set":
        return sp.FiniteSet(*(_sympy_value(p, sp) for p in parts))
    if kind.startswith("seq") and len(parts) == 2:  # in set algebra (a,b) is an interval
        low, high = (_sympy_value(p, sp) for p in parts)
        return sp.Interval(low, high, s[0] == "(", s[-1] == ")")
    if s in _REALS:
        return sp.Reals
    if s in _EMPTY_SETS:
        return sp.EmptySet
    if kind == "scalar" and s.startswith("(") and _encloses_all(s):
        return _sympy_set(s[1:-1], sp, depth + 1)  # a group: ((0,1)\cup(2,3))\setminus\{2\}
    raise _ParseError(f"not a set: {s!r}")


def _sympy_compare(a, b, sp):
    """True iff the two normalised answers (scalars, or sets of reals) are symbolically equal."""
    if _structure(a)[0] in _SET_KINDS or _structure(b)[0] in _SET_KINDS:
        return _sympy_set(a, sp) == _sympy_set(b, sp)  # sympy puts sets in a canonical form
    ea, eb = _sympy_value(a, sp), _sympy_value(b, sp)
    if ea == eb:
        return True
    if any(x.has(sp.nan, sp.zoo) for x in (ea, eb)):
        return False
    return bool(sp.simplify(ea - eb) == 0)


def _worker_main():
    """Loop of the sympy worker process: one JSON request per stdin line, one reply per line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; we exit on EOF
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = 4 << 30  # a runaway simplification must not eat the machine's memory
        if hard == resource.RLIM_INFINITY or hard > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):
        pass
    import sympy

    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            if "sleep" in request:  # test hook: lets tests exercise the deadline and restart
                time.sleep(float(request["sleep"]))
            equal = _sympy_compare(request["a"], request["b"], sympy)
        except BaseException:  # noqa: B036 - any failure (MemoryError, RecursionError) = not equal
            equal = False
        out.write(json.dumps({"equal": bool(equal)}).encode() + b"\n")
        out.flush()


_WORKER_BOOT = (
    "import runpy, sys\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "runpy.run_path(sys.argv[1], run_name='__rfs_grading_worker__')['_worker_main']()\n"
)


class _SympyWorker:
    """A persistent `python` subprocess that runs sympy comparisons under a hard deadline.

    Why a process and not a thread or signal: a thread cannot be stopped, and SIGALRM only works
    on the main thread and cannot interrupt a long C-level operation. A process can always be
    killed. It is started lazily (first symbolic comparison), killed when a request overruns its
    deadline (and a fresh one is started right away, so it is warm for the next call), and
    restarted after a fork (each process owns its own worker). It runs this very file through
    `runpy` (stdlib + sympy only), so starting it does not import torch or the package.
    Works on Linux and macOS (POSIX `select` on the pipe).
    """

    def __init__(self):
        self.proc = None
        self.owner_pid = None
        self.ready = False
        self.started_once = False
        self.buf = b""
        self.lock = threading.Lock()

    def start(self):
        """Start the worker process without waiting for it (it imports sympy in the background)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.owner_pid = os.getpid()
        self.ready = False
        self.buf = b""

    def close(self):
        """Kill the worker (only if this process started it)."""
        proc, self.proc = self.proc, None
        if proc is None or self.owner_pid != os.getpid():
            return
        try:
            proc.kill()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def _readline(self, deadline):
        """One line from the worker, or None if the deadline passes first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("sympy worker exited")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def request(self, payload, deadline):
        """Send one request; the decoded reply, or None if `deadline` (monotonic) passes first.

        The very first start of a worker in a process may take longer than the deadline
        (importing sympy takes about a second); that one-off wait is not charged to the call.
        A restart after a kill is charged, so every later call keeps its time bound.
        """
        budget = deadline - time.monotonic()
        with self.lock:
            try:
                if (
                    self.proc is None
                    or self.owner_pid != os.getpid()
                    or self.proc.poll() is not None
                ):
                    self.close()  # after a fork this only forgets the parent's worker
                    self.start()
                if not self.ready:
                    first = not self.started_once
                    wait_until = time.monotonic() + WORKER_START_TIMEOUT_S if first else deadline
                    if self._readline(wait_until) is None:
                        return None  # still starting: keep it, it will be ready next time
                    self.ready = self.started_once = True
                    if first:  # the one-off start-up does not eat this call's budget
                        deadline = time.monotonic() + budget
                self.proc.stdin.write(json.dumps(payload).encode() + b"\n")
                self.proc.stdin.flush()
                line = self._readline(deadline)
                if line is not None:
                    return json.loads(line)
                self.close()  # overran: kill it, and start a fresh one for the next call
                self.start()
                return None
            except (OSError, EOFError, ValueError):
                self.close()
                return None


_WORKER = _SympyWorker()
atexit.register(_WORKER.close)


def _sympy_equal_in_process(a, b, budget_s):
    """Fallback without a worker (no POSIX pipes): SIGALRM timer on the main thread if possible."""
    import sympy

    use_timer = (
        hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    )
    if not use_timer:
        try:
            return _sympy_compare(a, b, sympy)
        except Exception:
            return False

    def on_alarm(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    try:
        return _sympy_compare(a, b, sympy)
    except Exception:
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _sympy_equal(a, b, deadline):
    """Symbolic equality of two normalised scalars within the call's remaining time budget."""
    budget = deadline - time.monotonic()
    if budget <= 0:
        return False
    if os.name != "posix":
        return _sympy_equal_in_process(a, b, budget)
    reply = _WORKER.request({"a": a, "b": b}, deadline)
    return bool(reply and reply.get("equal"))


# ---------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------
_INT_RE = re.compile(r"\s*[+-]?\d{1,1000}\s*")
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,1000}(?:\.\d{0,1000})?|\.\d{1,1000})(?:/\d{1,1000})?")
_LHS_RE = re.compile(r"^(?:[a-z]|\\[a-z]+)(?:=|\\in(?![a-z]))")
_OPEN, _CLOSE = "([{", ")]}"
# \begin{pmatrix}1;2\end{pmatrix} (rows were `\\`, now `;`); vmatrix is a determinant, not here
_MATRIX_RE = re.compile(r"\\begin\{([pb]?matrix)\}((?:(?!\\(?:begin|end)\{).)*)\\end\{\1\}")
_PM_RE = re.compile(r"\\(?:pm|mp)(?![a-z])")
# digits with an optional base subscript: 4210_5, 4210_{5}, a2b_{16}, or bare 4210
_BASED_RE = re.compile(r"([0-9a-z]{1,100})(?:_\{?(\d{1,2})\}?)?")
_SET_KINDS = ("union", "minus")  # set algebra: decided as sets of reals when the spelling differs
_REALS = ("\\mathbb{r}", "\\mathbb r")
_EMPTY_SETS = ("\\emptyset", "\\varnothing", "\\{\\}")


def _plain_fraction(s):
    """Fraction for plain numbers like -12, 0.5, 3/4 (fast path, no parser), else None."""
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    if "/" in s and "." in s:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _split_top_level(s, sep):
    """Split on `sep` outside any brackets."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            start = i + len(sep)
            i = start
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _encloses_all(s):
    """True if the bracket opened at s[0] closes exactly at s[-1]."""
    depth = 0
    for i, c in enumerate(s):
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                return i == len(s) - 1
    return False


def _matrix_structure(body):
    """("matrix" + shape, entries) of a matrix body like `1&2;3&4`, so shapes must match."""
    rows = _split_top_level(body, ";")
    if len(rows) > 1 and not rows[-1]:
        rows.pop()  # a trailing `\\` before \end{pmatrix}
    cells = [_split_top_level(row, "&") for row in rows]
    shape = ",".join(str(len(row)) for row in cells)
    return "matrix" + shape, [cell for row in cells for cell in row]


def _expand_pm(parts):
    """`1\\pm\\sqrt2` -> `1+\\sqrt2`, `1-\\sqrt2`: a part with one \\pm stands for both values."""
    expanded = []
    for part in parts:
        if len(_PM_RE.findall(part)) == 1:  # with two or more the intended set is ambiguous
            expanded += [_PM_RE.sub("+", part), _PM_RE.sub("-", part)]
        else:
            expanded.append(part)
    return expanded


def _structure(s):
    """Split an answer into (kind, parts): scalar, tuple/interval, matrix, list, set algebra."""
    matrix = _MATRIX_RE.fullmatch(s)
    if matrix:
        return _matrix_structure(matrix.group(2))
    for kind, op in zip(_SET_KINDS, ("\\cup", "\\setminus")):  # \cup binds loosest
        if op in s:
            pieces = _split_top_level(s, op)
            if len(pieces) > 1:
                return kind, pieces
    if s.startswith("\\{") and s.endswith("\\}") and len(s) > 4:
        return "set", _expand_pm(_split_top_level(s[2:-2], ","))
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _encloses_all(s):
        parts = _split_top_level(s[1:-1], ",")
        if len(parts) > 1:
            return "seq" + s[0] + s[-1], parts  # brackets must match: (1,2) != [1,2]
    parts = _expand_pm(_split_top_level(s, ","))
    if len(parts) > 1:
        return "set", parts  # "1, -2": a list of solutions, order does not matter
    return "scalar", parts


def _strip_lhs(s):
    """`x=3` -> `3`, `x\\in[1,2]` -> `[1,2]` (simple equations compare by their right side)."""
    m = _LHS_RE.match(s)
    return s[m.end() :] if m and "=" not in s[m.end() :] else s


def _based_equal(ref, pred):
    """Numbers with a base subscript (4210_5 = 4210_{5}); None if neither answer has one.

    A bare prediction is read in the reference's base (the question asked for that base); a bare
    reference is decimal, so 4210_5 does not equal a reference of 4210.
    """
    ref_m, pred_m = _BASED_RE.fullmatch(ref), _BASED_RE.fullmatch(pred)
    if not (ref_m and ref_m.group(2) or pred_m and pred_m.group(2)):
        return None
    if not (ref_m and pred_m):
        return False
    base = int(ref_m.group(2) or 10)
    if int(pred_m.group(2) or base) != base or not 2 <= base <= 36:
        return False
    try:
        return int(ref_m.group(1), base) == int(pred_m.group(1), base)
    except ValueError:  # a digit too large for the base, like 4210_3
        return False


def _scalar_equal(a, b, deadline):
    """Equality of two normalised scalar answers (a is the reference): exact first, sympy last."""
    if a == b:
        return True
    based = _based_equal(a, b)
    if based is not None:
        return based
    fa, fb = _plain_fraction(a), _plain_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    try:
        ta, tb = _parse(a), _parse(b)
        if ta == tb:
            return True
        ea, eb = _exact_value(ta), _exact_value(tb)
    except (_ParseError, _TooBig, ZeroDivisionError, ValueError, OverflowError):
        return False
    if ea is not None and eb is not None:
        return ea == eb
    return _sympy_equal(a, b, deadline)


def _grade_normalized(a, b, deadline, depth=0):
    """Compare normalised answers (a is the reference), element-wise where they have parts."""
    a, b = _strip_lhs(a), _strip_lhs(b)
    if a == b:
        return True
    if not a or not b or depth > 4:
        return False
    kind_a, parts_a = _structure(a)
    kind_b, parts_b = _structure(b)
    if kind_a == kind_b and len(parts_a) == len(parts_b) <= MAX_PARTS:
        if _parts_equal(kind_a, parts_a, parts_b, deadline, depth):
            return True
    # one set of reals has many spellings, (0,36)\setminus\{9\} = (0,9)\cup(9,36): sympy decides
    return (kind_a in _SET_KINDS or kind_b in _SET_KINDS) and _sympy_equal(a, b, deadline)


def _parts_equal(kind, parts_a, parts_b, deadline, depth):
    """Equal parts: in order for tuples, intervals, matrices and set algebra; any order for sets."""
    if kind == "scalar":
        return _scalar_equal(parts_a[0], parts_b[0], deadline)
    if kind != "set":
        return all(_grade_normalized(x, y, deadline, depth + 1) for x, y in zip(parts_a, parts_b))
    unused = list(parts_b)  # unordered: greedy matching is enough as equality is transitive
    for x in parts_a:
        match = next((y for y in unused if _grade_normalized(x, y, deadline, depth + 1)), None)
        if match is None:
            return False
        unused.remove(match)
    return True


def grade_answer(pred, gt):
    """True iff the predicted answer equals the ground truth (never hangs, never runs code)."""
    if pred is None or gt is None:
        return False
    pred, gt = str(pred), str(gt)
    if pred.strip() == gt.strip():
        return bool(pred.strip())
    if _INT_RE.fullmatch(pred) and _INT_RE.fullmatch(gt):
        return int(pred) == int(gt)  # the hot path of RL on arithmetic: microseconds
    if len(pred) > MAX_ANSWER_CHARS or len(gt) > MAX_ANSWER_CHARS:
        return False
    a, b = normalize_text(gt), normalize_text(pred)
    if len(a) > MAX_NORMALIZED_CHARS or len(b) > MAX_NORMALIZED_CHARS:
        return a == b
    return _grade_normalized(a, b, time.monotonic() + SYMPY_BUDGET_S)


def reward_rlvr(answer_text, ground_truth):
    """1.0 iff `answer_text` contains a boxed answer that grades equal to `ground_truth`."""
    extracted = extract_final_candidate(answer_text, fallback="none")
    return 1.0 if extracted and grade_answer(extracted, ground_truth) else 0.0
