"""LiveCodeBench rows (the lite release's JSONL) read into Tandem code prompts.

The rows here have the release's shape: tests as JSON strings, private tests compressed
(base64 of zlib of a pickled JSON string), LeetCode arguments as JSON lines."""
from __future__ import annotations

import base64
import json
import pickle
import zlib

import pytest

from tandem.rollout.dataset import load_file
from tandem.rollout.livecodebench import LiveCodeBenchRowError, livecodebench_prompt


def _compressed(cases) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


def _row(**over):
    row = {"question_title": "Two Sum", "question_content": "Return the indices of two numbers adding to target.",
           "platform": "leetcode", "question_id": "1", "contest_id": "w1", "contest_date": "2024-01-01T00:00:00",
           "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
           "difficulty": "easy",
           "public_test_cases": json.dumps([{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"}]),
           "private_test_cases": _compressed([{"input": "[3,3]\n6", "output": "[0, 1]", "testtype": "functional"}]),
           "metadata": json.dumps({"func_name": "twoSum"})}
    return {**row, **over}


def test_a_functional_row_decodes_its_json_lines_and_compressed_private_tests():
    rid, text, tests = livecodebench_prompt(_row())
    assert rid == "1" and "starter code" in text and "def twoSum" in text
    assert tests == {"convention": "livecodebench", "fn_name": "twoSum",
                     "inputs": [[[2, 7, 11, 15], 9], [[3, 3], 6]], "outputs": [[0, 1], [0, 1]]}


def test_a_stdin_row_keeps_its_texts():
    cases = [{"input": "3\n1 2 3\n", "output": "6\n", "testtype": "stdin"}]
    _, text, tests = livecodebench_prompt(_row(starter_code="", metadata="{}", public_test_cases=json.dumps(cases),
                                               private_test_cases=json.dumps(cases * 2)))
    assert "starter code" not in text
    assert tests == {"convention": "livecodebench", "inputs": ["3\n1 2 3\n"] * 3, "outputs": ["6\n"] * 3}


def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))
    payload = base64.b64encode(zlib.compress(pickle.dumps(Exploit()))).decode()
    with pytest.raises(LiveCodeBenchRowError, match="refusing"):
        livecodebench_prompt(_row(private_test_cases=payload))
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("over, why", [
    ({"private_test_cases": "not json, not base64!"}, "neither JSON nor"),
    ({"metadata": "{func_name"}, "metadata is not JSON"),
    ({"public_test_cases": json.dumps([{"input": "[1]\n", "output": "oops", "testtype": "functional"}])},
     "not JSON lines"),
    ({"public_test_cases": json.dumps([{"input": 1}])}, "text 'input' and 'output'"),
])
def test_a_broken_row_says_what_is_wrong(over, why):
    with pytest.raises(LiveCodeBenchRowError, match=why):
        livecodebench_prompt(_row(**over))


def test_the_loader_reads_livecodebench_rows_and_skips_broken_ones_with_their_line(tmp_path, caplog):
    path = tmp_path / "lcb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [_row(), _row(metadata="{func_name"), _row(question_id="2")]))
    prompts = load_file(path, "code")
    assert [p.id for p in prompts] == ["1", "2"]
    assert prompts[0].reference["tests"]["convention"] == "livecodebench"
    assert f"{path}:2: LiveCodeBench row: metadata is not JSON" in caplog.text
