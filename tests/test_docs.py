"""The README and docs/*.md against the repository: links resolve, documented commands parse.

- Every relative link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`, outside code)
  points to an existing file, and every `#anchor` into a markdown file to one of its headings,
  slugged as GitHub slugs them (lower case, punctuation dropped, spaces to dashes, `-1`, `-2`
  for repeated headings).
- Every `python chapters/X.py ...` or `python benchmarks/X.py ...` command the pages show (in a
  code block or inline code, `torchrun ... X.py ...` included) is accepted by that script's own
  argparse: the flags exist and their values pass the flags' types and choices. The script runs
  only up to its argument parsing. Placeholders (RUN_DIR, S, LR, ...) get a value of their kind;
  commands with an elided part (`...`) or a shell variable are skipped.
"""

import argparse
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```.*?```", re.S)
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\(([^)\s]+)")
SCRIPT_COMMAND = re.compile(r"(?:python|torchrun)\b[^\n]*?\s((?:chapters|benchmarks)/\w+\.py)(.*)")
# a placeholder of the docs' commands -> a value of its kind
PLACEHOLDERS = {"RUN_DIR": "runs/x", "RUN_DIR/final": "runs/x/final", "RUN_DIR...": "runs/x",
                "DIR": "runs/x", "PATH": "runs/x", "S": "0", "K": "1", "LR": "1e-4", "P": "16",
                "G": "8", "N": "10", "W": "1,1,2,2,2"}


def _blank(match):
    """The match with every character but newlines made a space (line numbers stay right)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def slug(heading):
    """GitHub's anchor of a markdown heading: lower case, inline markup and punctuation dropped
    (underscores and dashes kept), spaces to dashes."""
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text):
    """The anchors of a markdown text's headings (outside code blocks), repeats numbered -1, -2."""
    found, seen = set(), {}
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            found.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return found


def relative_links(text):
    """(line number, target) of every link outside code that is not a URL (scheme:...)."""
    prose = INLINE_CODE.sub(_blank, FENCE.sub(_blank, text))
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(prose)
            if not re.match(r"[a-z][a-z+.-]*:", m.group(1))]


def broken_links(page):
    """'page:line: target (why)' for each relative link of `page` that does not resolve."""
    problems = []
    for line, target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}:{line}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{page.name}:{line}: {target} (no such heading)")
    return problems


def script_commands(text):
    """(script, argument string) of every chapters/ or benchmarks/ command in the code of a
    markdown text: its fenced blocks, line by line (continuation backslashes joined, comments
    dropped), and its inline code spans."""
    blocks = [re.sub(r"\\\n\s*", " ", b) for b in FENCE.findall(text)]
    spans = [s.replace("\n", " ") for s in INLINE_CODE.findall(FENCE.sub("", text))]
    commands = []
    for line in (ln for chunk in blocks + spans for ln in chunk.splitlines()):
        line = line.strip().strip("`").split(" #")[0]
        m = SCRIPT_COMMAND.search(line)
        if m and not line.startswith("#"):
            arguments = re.split(r"&&|\||;", m.group(2))[0]
            commands.append((m.group(1), " ".join(arguments.split())))
    return commands


def command_argv(arguments):
    """The argument list of a documented command, placeholders filled in and optional `[...]`
    brackets dropped; None when a part is elided (`...`) or a shell variable."""
    unbracketed = arguments.replace("[", " ").replace("]", " ")
    argv = [PLACEHOLDERS.get(a, a) for a in shlex.split(unbracketed)]
    return None if any("..." in a or "$" in a or "<" in a for a in argv) else argv


class _Parsed(Exception):
    """Raised instead of running the script once its arguments parsed."""


def parse_error(script, argv, monkeypatch, capsys):
    """None if `script` (a path under ROOT) accepts `argv`, else argparse's message."""
    parse_known = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(parser, args=None, namespace=None):
        namespace, extras = parse_known(parser, args, namespace)
        raise _Parsed(extras)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *argv])
    monkeypatch.syspath_prepend(str((ROOT / script).parent))  # benchmarks import each other
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except _Parsed as parsed:
        extras = parsed.args[0]
        return f"unrecognized arguments: {' '.join(extras)}" if extras else None
    except SystemExit:
        return capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        monkeypatch.undo()
    return "the script returned without parsing its arguments"


def test_slug_and_anchors_by_hand():
    assert slug("Distillation (`ch09_distill.py`)") == "distillation-ch09_distillpy"
    assert slug("Stopping inside a phase") == "stopping-inside-a-phase"
    assert slug("4-5 inference-time scaling: pass@k") == "4-5-inference-time-scaling-passk"
    text = "# Top\n## Notes\n```\n# not a heading\n```\n### Notes\n"
    assert anchors(text) == {"top", "notes", "notes-1"}


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n## A part\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[ok](other.md#a-part) [here](#page) [web](https://x.org/none)\n"
                    "[gone](missing.md) [bad](other.md#nothing)\n"
                    "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n[self](#nope)\n")
    assert broken_links(page) == ["page.md:3: missing.md (no such file)",
                                  "page.md:3: other.md#nothing (no such heading)",
                                  "page.md:8: #nope (no such heading)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_pages_have_links():
    """The link check above reads something: the README alone links docs/ over 20 times."""
    assert len(relative_links((ROOT / "README.md").read_text())) > 20
    assert sum(len(relative_links(p.read_text())) for p in PAGES) > 60


def test_commands_are_found_and_filled_in():
    text = ("Run `python chapters/a.py --steps\nN --lr LR` or:\n```bash\n"
            "torchrun --standalone --nproc-per-node 2 benchmarks/b.py --x 1 \\\n    --y 2  # note\n"
            "# python chapters/c.py --commented-out\npython chapters/d.py ... --z\n```\n")
    commands = script_commands(text)
    assert commands == [("benchmarks/b.py", "--x 1 --y 2"), ("chapters/d.py", "... --z"),
                        ("chapters/a.py", "--steps N --lr LR")]
    assert command_argv(commands[2][1]) == ["--steps", "10", "--lr", "1e-4"]
    assert command_argv("--seed S [--no-check-steps]") == ["--seed", "0", "--no-check-steps"]
    assert command_argv(commands[1][1]) is None and command_argv('"${ARGS[@]}"') is None


def test_parse_error_reports_argparse(monkeypatch, capsys):
    script = "chapters/ch03_evaluate.py"
    assert parse_error(script, ["--limit", "4"], monkeypatch, capsys) is None
    assert "unrecognized arguments: --no-such-flag" in parse_error(
        script, ["--no-such-flag"], monkeypatch, capsys)
    assert "--limit" in parse_error(script, ["--limit", "many"], monkeypatch, capsys)


def test_documented_commands_parse(monkeypatch, capsys):
    """Every runnable command of the pages passes its script's argument parsing."""
    failures, parsed = [], 0
    for page in PAGES:
        for script, arguments in script_commands(page.read_text()):
            argv = command_argv(arguments)
            if argv is None:
                continue
            error = parse_error(script, argv, monkeypatch, capsys)
            parsed += error is None
            if error:
                failures.append(f"{page.name}: {script} {arguments}: {error}")
    assert failures == []
    assert parsed > 80, parsed  # the README and docs show about 90 such commands


def _table_row(text, first_cell):
    """The cells of the first markdown table row of `text` whose first cell is `first_cell`."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row {first_cell!r}")


def _mean_sd(cell):
    """'0.423 ± 0.015' (bold or not) -> (0.423, 0.015)."""
    mean, sd = cell.strip("*").split("±")
    return float(mean), float(sd)


def test_grpo_results_json_matches_the_tables():
    """docs/grpo_results.json (read by the chapter 7 and 8 notebooks) holds the figures of the
    tables of docs/grpo_variants.md and docs/grpo.md, transcribed: the two cannot drift."""
    runs = json.loads((ROOT / "docs" / "grpo_results.json").read_text())["runs"]
    for name, page, base_row, run_row, column, budget in (
        ("grpo_variants_chapter7_default", "grpo_variants.md", "base model",
         "chapter 7 default (grpo loss)", 2, r"(\d+) steps x (\d+) prompts x (\d+) rollouts"),
        ("ch07_train_default", "grpo.md", "base model", "**mean ± sd**", 1,
         r"(\d+) steps × (\d+) prompts × (\d+) rollouts"),
    ):
        run, text = runs[name], (ROOT / "docs" / page).read_text()
        assert page in run["source"]
        assert float(_table_row(text, base_row)[column]) == run["base_accuracy"]
        assert _mean_sd(_table_row(text, run_row)[column]) == (run["accuracy"],
                                                               run["accuracy_sd"])
        steps, prompts, rollouts = map(int, re.search(budget, text).groups())
        assert (steps, prompts, rollouts) == (run["steps"], run["prompts_per_step"],
                                              run["rollouts"])
        assert re.search(rf"\b{run['held_out_problems']} (?:held-out )?(?:test )?problems",
                         text)
        assert run["command"].split(" --")[0] in text
    train = runs["ch07_train_default"]
    assert [int(_table_row(text, s)[0].split()[0])
            for s in ("123 (default)", "1", "2")] == train["seeds"]
    readme = (ROOT / "README.md").read_text()
    assert (f"{train['base_accuracy']:.3f} -> **{train['accuracy']:.3f} ± "
            f"{train['accuracy_sd']:.3f}**") in readme
