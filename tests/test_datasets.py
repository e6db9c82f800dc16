"""Tests for the dataset loaders: local files, the download cache (fetch monkeypatched), errors."""

import json

import pytest
import requests

from reasoning_from_scratch import datasets
from reasoning_from_scratch.datasets import (
    load_arith,
    load_dataset_by_name,
    load_gsm8k,
    load_math500,
    load_math_train,
    parse_gsm8k_answer,
)

MATH_ROWS = [
    {"problem": "What is $1+1$?", "answer": "2", "solution": "$\\boxed{2}$", "level": 1},
    {"problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}", "subject": "Algebra"},
    {"problem": "Compute $3 \\cdot 4$.", "answer": 12},
]
GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs 1,200 dollars twice. Total?", "answer": "2*1200=2400\n#### 2,400"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_math500_from_local_jsonl_and_json(tmp_path):
    expected = [
        {**MATH_ROWS[0]},
        {**MATH_ROWS[1]},
        {**MATH_ROWS[2], "answer": "12"},  # answers are always strings
    ]
    assert load_math500(path=write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)) == expected
    array = tmp_path / "m.json"
    array.write_text(json.dumps(MATH_ROWS, indent=2), encoding="utf-8")
    assert load_math_train(path=array) == expected


def test_gsm8k_answer_after_hashes_without_commas(tmp_path):
    assert parse_gsm8k_answer("so 5*2=10\n#### 1,010") == "1010"
    assert parse_gsm8k_answer("no final answer") is None
    rows = load_gsm8k("test", path=write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS))
    assert [r["answer"] for r in rows] == ["7", "2400"]
    assert rows[0]["problem"] == GSM8K_ROWS[0]["question"]
    assert rows[0]["solution"] == "3+4=<<3+4=7>>7"
    with pytest.raises(ValueError, match="split"):
        load_gsm8k("validation")


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MATH_ROWS[0]) + "\n\n{not json}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: invalid JSON"):
        load_math500(path=path)


def test_row_without_answer_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [MATH_ROWS[0], {"problem": "no answer here"}])
    with pytest.raises(ValueError, match=r"rows\.jsonl, line 2: row has no 'answer'"):
        load_math500(path=path)
    path = write_jsonl(tmp_path / "rows2.jsonl", [{"answer": "1"}])
    with pytest.raises(ValueError, match=r"line 1: row has no 'problem'"):
        load_math500(path=path)
    path = write_jsonl(tmp_path / "rows3.jsonl", [[1, 2]])
    with pytest.raises(ValueError, match=r"line 1: expected a JSON object"):
        load_math500(path=path)
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "no hashes"}])
    with pytest.raises(ValueError, match=r"g\.jsonl, line 1: GSM8K answer has no '####'"):
        load_gsm8k(path=path)


def test_bad_row_in_json_array_names_its_line(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps(MATH_ROWS[:2] + [{"problem": "x"}], indent=2), encoding="utf-8")
    line = path.read_text().splitlines().index("  {", 12) + 1  # the third object's first line
    with pytest.raises(ValueError, match=rf"arr\.json, line {line}: row has no 'answer'"):
        load_math_train(path=path)
    path.write_text('[\n{"problem": "a", "answer": "1"},\n{"problem": oops}\n]', encoding="utf-8")
    with pytest.raises(ValueError, match=r"arr\.json, line 3: invalid JSON"):
        load_math_train(path=path)


def test_missing_local_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_math500(path=tmp_path / "nope.jsonl")


def test_download_goes_to_cache_and_is_reused(tmp_path, monkeypatch):
    calls = []

    def fake_fetch(url, dest, sha256=None, **kwargs):
        calls.append(url)
        write_jsonl(dest, MATH_ROWS)
        return dest

    monkeypatch.setattr(datasets, "fetch_url", fake_fetch)
    monkeypatch.setitem(datasets.SOURCES, "math500", datasets.SOURCES["math500"].__class__(
        filename="math500_test.jsonl", urls=("https://example.invalid/test.jsonl",), num_rows=3,
    ))
    monkeypatch.setenv("RFS_CACHE_DIR", str(tmp_path / "cache"))
    first = load_math500()
    assert calls == ["https://example.invalid/test.jsonl"]
    assert (tmp_path / "cache" / "math500_test.jsonl").is_file()
    assert load_math500() == first  # cached: no second download
    assert calls == ["https://example.invalid/test.jsonl"]
    assert len(load_dataset_by_name("math500", n=2)) == 2


def test_download_with_wrong_row_count_is_removed(tmp_path, monkeypatch):
    def fake_fetch(url, dest, sha256=None, **kwargs):
        return write_jsonl(dest, MATH_ROWS)  # 3 rows, MATH-500 has 500

    monkeypatch.setattr(datasets, "fetch_url", fake_fetch)
    with pytest.raises(ValueError, match="expected 500"):
        load_math500(cache_dir=tmp_path)
    assert not (tmp_path / "math500_test.jsonl").exists()


def test_offline_without_cache_says_what_to_fetch(tmp_path, monkeypatch):
    def offline(url, dest, sha256=None, **kwargs):
        raise requests.ConnectionError("no network")

    monkeypatch.setattr(datasets, "fetch_url", offline)
    with pytest.raises(FileNotFoundError) as info:
        load_gsm8k("train", cache_dir=tmp_path)
    message = str(info.value)
    assert "https://raw.githubusercontent.com/openai/grade-school-math" in message
    assert str(tmp_path / "gsm8k_train.jsonl") in message


def test_arith_and_dispatch():
    examples = load_arith("test", n=5)
    assert len(examples) == 5
    assert all(set(ex) >= {"problem", "answer", "steps"} for ex in examples)
    assert load_dataset_by_name("arith", split="test", n=5) == examples
    assert load_arith("test", n=5, seed=7) == load_arith("test", n=5, seed=7)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset_by_name("mnist")
    with pytest.raises(ValueError, match="test"):
        load_dataset_by_name("math500", split="train")
