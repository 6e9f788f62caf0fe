"""Data readers, resumable order, and the synthetic tasks' own correctness."""
from __future__ import annotations

import json
import re

import pytest

from tandem.rollout.dataset import DatasetError, PromptStream, load_file
from tandem.rollout.synthetic import generate, write_jsonl


def test_synthetic_math_solutions_are_right_and_lengths_long_tailed():
    rows = list(generate("math", 2000, seed=3))
    for r in rows[:300]:
        expr = r["prompt"].removesuffix("=?")
        assert str(eval(expr)) == r["answer"]  # Python's precedence is the task's precedence
        steps = r["solution"].split(" ")[0].split("=")
        assert steps[0] == expr and steps[-1] == r["answer"]
        assert all(str(eval(s)) == r["answer"] for s in steps)
        assert r["solution"].endswith(f"\\boxed{{{r['answer']}}}")
    lengths = sorted(len(r["solution"]) for r in rows)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p99 >= 2.5 * median  # a long tail, not a narrow band
    assert rows == list(generate("math", 2000, seed=3))  # deterministic
    assert rows != list(generate("math", 2000, seed=4))


def test_synthetic_code_tests_match_the_reference_solution():
    for r in generate("code", 200, seed=1):
        src = re.search(r"```python\n(.*)\n```", r["solution"], re.S).group(1)
        scope: dict = {}
        exec(src, scope)
        t = r["tests"]
        assert t["fn_name"] == "f" and len(t["inputs"]) == len(t["outputs"]) >= 8
        assert [scope["f"](*args) for args in t["inputs"]] == t["outputs"]
        for part in r["problem"].split(", "):  # the shown points are the first tests
            x, y = re.fullmatch(r"f\((-?\d+)\)=(-?\d+)", part).groups()
            assert scope["f"](int(x)) == int(y)


def test_jsonl_readers_accept_real_formats_and_report_bad_rows(tmp_path, caplog):
    math = write_jsonl(tmp_path / "m.jsonl", [
        {"problem": "1+1?", "answer": "2"},
        {"prompt": "2+2?", "answer": 4, "id": "x"},
        {"problem": "no answer"},
        {"answer": "3"},
    ])
    with open(math, "a") as f:
        f.write("{not json\n")
    prompts = load_file(math, "math")
    assert [(p.text, p.reference["answer"]) for p in prompts] == [("1+1?", "2"), ("2+2?", "4")]
    assert prompts[1].id == "x"
    assert "m.jsonl:3" in caplog.text and "no 'answer'" in caplog.text
    assert "m.jsonl:4" in caplog.text and "m.jsonl:5" in caplog.text
    tests = {"inputs": ["1\n"], "outputs": ["2\n"]}
    code = write_jsonl(tmp_path / "c.jsonl", [
        {"problem": "echo", "tests": json.dumps(tests)},            # TACO: a JSON string
        {"problem": "echo", "tests": [{"input": "1\n", "output": "2\n"}]},  # DeepCoder: a list
        {"problem": "bad", "tests": {"inputs": ["1"], "outputs": []}},
    ])
    got = load_file(code, "code")
    assert [p.reference["tests"] for p in got] == [tests, tests]
    assert "c.jsonl:3" in caplog.text
    with pytest.raises(DatasetError, match="no usable rows"):
        load_file(write_jsonl(tmp_path / "e.jsonl", [{"x": 1}]), "math")
    with pytest.raises(DatasetError, match="no such file or directory"):
        load_file(tmp_path / "missing.jsonl", "math")


def test_a_line_that_is_not_utf8_is_one_skipped_row_not_a_lost_file(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"problem": "1+1?", "answer": "2"}\n{"problem": "caf\xe9?", "answer": "1"}\n'
                     b'{"problem": "2+2?", "answer": "4"}\n')
    assert [p.text for p in load_file(path, "math")] == ["1+1?", "2+2?"]
    assert "m.jsonl:2: not UTF-8" in caplog.text and "2 usable rows, 1 skipped" in caplog.text


@pytest.mark.parametrize("tests, why", [
    ({"inputs": [1, 2], "outputs": ["1\n", "2\n"]}, "need text"),          # stdin must be text
    ({"inputs": [[1]], "outputs": [1], "fn_name": "not an identifier"}, "fn_name"),
    ({"inputs": ["1"], "outputs": ["1"], "timeout": 3}, "unknown key"),
    ({"inputs": [], "outputs": []}, "no test cases"),
])
def test_code_rows_the_grader_could_not_grade_are_skipped_at_load(tmp_path, caplog, tests, why):
    """Before, such rows loaded and every answer to them earned the wrong-answer reward."""
    good = {"inputs": ["1\n"], "outputs": ["1\n"]}
    path = write_jsonl(tmp_path / "c.jsonl", [{"problem": "ok", "tests": good}, {"problem": "bad", "tests": tests}])
    assert [p.text for p in load_file(path, "code")] == ["ok"]
    assert "c.jsonl:2: code row:" in caplog.text and why in caplog.text


def test_prompt_stream_is_deterministic_and_resumes_exactly():
    from tandem.rollout.dataset import Prompt
    prompts = [Prompt(str(i), f"p{i}", "math", {"answer": str(i)}) for i in range(7)]
    a = PromptStream(prompts, seed=5)
    first = [a.next().id for _ in range(20)]
    assert sorted(first[:7]) == sorted(p.id for p in prompts)  # each epoch is a permutation
    assert first[:7] != first[7:14]  # and epochs are reshuffled
    b = PromptStream(prompts, seed=5, position=11)
    assert [b.next().id for _ in range(9)] == first[11:]
