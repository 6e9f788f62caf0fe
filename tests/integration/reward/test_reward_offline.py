"""`tandem reward grade` as users run it: a real process on JSONL files, invalid rows reported by
line and id while the rest are graded, and no grader process left afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TANDEM = str(Path(sys.executable).with_name("tandem"))


def run_grade(task: str, rows: list, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    src, out = tmp_path / f"{task}.jsonl", tmp_path / f"{task}.out.jsonl"
    src.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    proc = subprocess.run([TANDEM, "reward", "grade", "--task", task, "--input", str(src), "--output", str(out),
                           "--workers", "2", "--quiet"], capture_output=True, text=True, timeout=120)
    graded = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, graded


def worker_processes() -> list[int]:
    """Orphaned grader workers (re-parented to init). Workers of other, still-running tests on
    the same machine keep their parent, so they do not make this check flaky."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            if not name.isdigit() or b"tandem.reward.worker" not in Path(f"/proc/{name}/cmdline").read_bytes():
                continue
            status = Path(f"/proc/{name}/status").read_text()
            ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            if ppid == 1:
                pids.append(int(name))
        except (OSError, StopIteration, ValueError):
            continue
    return pids


def test_math_file_with_invalid_rows(tmp_path):
    before = set(worker_processes())
    rows = [{"id": "a", "response": "<think>\\boxed{1}</think>\\boxed{\\dfrac{1}{2}}", "answer": "0.5"},
            {"id": "b", "response": "\\boxed{3}", "answer": 4},
            "{not json",
            {"id": "c", "answer": "1"},
            {"response": "\\boxed{1}", "answer": "1"},
            {"id": "d", "response": "The final answer is 12.", "answer": "12"}]
    proc, graded = run_grade("math", rows, tmp_path)
    assert proc.returncode == 1, proc.stderr  # some rows were invalid
    assert [(g["id"], g["correct"], g["reward"]) for g in graded] == [("a", True, 5.0), ("b", False, -5.0),
                                                                      ("d", True, 5.0)]
    assert graded[0]["details"]["extracted"] == "\\frac{1}{2}"
    assert graded[0]["answer"] == "0.5"  # input fields are kept
    assert "line 3: not valid JSON" in proc.stderr
    assert "line 4 (id 'c'): missing 'response'" in proc.stderr
    assert "line 5 (id '?'): missing 'id'" in proc.stderr
    assert "3 graded, 2 correct" in proc.stdout
    assert set(worker_processes()) <= before


def test_code_file_both_formats(tmp_path):
    rows = [{"id": 1, "response": "```python\nprint(sum(map(int, input().split())))\n```",
             "tests": {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}},
            {"id": 2, "response": "```python\nclass Solution:\n    def twice(self, x):\n        return 2 * x\n```",
             "tests": json.dumps({"fn_name": "twice", "inputs": [[1], [4]], "outputs": [2, 8]})},
            {"id": 3, "response": "```python\nimport os\nos._exit(0)\n```",
             "tests": {"fn_name": "twice", "inputs": [[1]], "outputs": [2]}},
            {"id": 4, "response": "x", "tests": {"inputs": ["1"], "outputs": ["1", "2"]}}]
    proc, graded = run_grade("code", rows, tmp_path)
    assert proc.returncode == 1
    assert [(g["id"], g["correct"]) for g in graded] == [(1, True), (2, True), (3, False)]
    assert graded[1]["details"]["passed"] == 2 and graded[2]["details"]["passed"] == 0
    assert "line 4 (id 4): tests has 1 inputs but 2 outputs" in proc.stderr


def test_all_valid_rows_exit_zero(tmp_path):
    proc, graded = run_grade("math", [{"id": i, "response": f"\\boxed{{{i}}}", "answer": str(i)} for i in range(5)],
                             tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert all(g["correct"] for g in graded) and len(graded) == 5


def test_rewards_come_from_the_experiment_config(tmp_path):
    from tandem.launcher.config import load_config, save_resolved
    root = tmp_path / "exp"
    save_resolved(load_config(None, ["experiment.name=t", "experiment.model=none", f"experiment.exp_dir={root}",
                                     "reward.correct_reward=1.0", "reward.wrong_reward=0.0"]), root)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": 1, "response": "\\boxed{2}", "answer": "2"}) + "\n"
                   + json.dumps({"id": 2, "response": "\\boxed{3}", "answer": "2"}) + "\n")
    proc = subprocess.run([TANDEM, "reward", "grade", "--task", "math", "--input", str(src), "--output", str(out),
                           "--exp", str(root), "--workers", "1", "--quiet"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["reward"] for line in out.read_text().splitlines()] == [1.0, 0.0]


def test_a_row_that_cannot_be_graded_costs_that_row_only(tmp_path):
    """Issue 61: one lone surrogate (`"\\ud800"`, valid JSON, no valid text) stopped the whole
    evaluation with a traceback and no output. Now every other row is graded and that one is
    written wrong with its reason; so is a line that is not UTF-8, or that the JSON reader
    cannot take (nested too deep, an integer past Python's digit limit)."""
    good = [{"id": i, "response": f"\\boxed{{{i}}}", "answer": str(i)} for i in range(3)]
    lone = [json.dumps({"id": "lone", "response": "\\boxed{2}\ud800", "answer": "2"}),
            json.dumps({"id": "trail", "response": "\\boxed{2}", "answer": "2", "question": "\udfff"}),
            json.dumps({"id": "low", "response": "\\boxed{\udc80}", "answer": "2"})]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\n".join([json.dumps(good[0]).encode(), lone[0].encode(), b'{"id": "bytes", "response": "\xff"}',
                                json.dumps(good[1]).encode(), lone[1].encode(), b"[" * 100_000,
                                b'{"id": "big", "response": "x", "answer": ' + b"9" * 5000 + b"}", lone[2].encode(),
                                json.dumps(good[2]).encode()]) + b"\n")
    proc = subprocess.run([TANDEM, "reward", "grade", "--task", "math", "--input", str(src), "--output", str(out),
                           "--workers", "1", "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    graded = {g["id"]: g for g in map(json.loads, out.read_text().splitlines())}
    assert [i for i in graded] == [0, "lone", 1, "trail", "low", 2]
    assert all(graded[i]["correct"] for i in range(3))
    for rid, field in (("lone", "response"), ("trail", "question"), ("low", "response")):
        assert not graded[rid]["correct"] and graded[rid]["reward"] == -5.0
        assert graded[rid]["details"]["reason"].startswith(f"not graded: {field} holds a lone surrogate"), graded[rid]
    assert "line 3: not UTF-8 text" in proc.stderr
    assert "line 6: not readable JSON (RecursionError" in proc.stderr
    assert "line 7: not readable JSON (ValueError" in proc.stderr
    assert "6 graded, 3 correct" in proc.stdout and "3 not gradable" in proc.stdout


def test_a_code_row_no_grader_can_receive_costs_that_row_only(tmp_path):
    """An argument past 64 bits is valid JSON that the pool's frames (msgpack) cannot carry:
    that row's verdict says so; the next row is graded."""
    program = "```python\ndef f(x):\n    return x\n```"
    rows = [{"id": "big", "response": program, "tests": {"fn_name": "f", "inputs": [[10 ** 30]], "outputs": [10 ** 30]}},
            {"id": "surrogate", "response": program, "tests": {"fn_name": "f", "inputs": [["\ud800"]], "outputs": ["x"]}},
            {"id": "ok", "response": program, "tests": {"fn_name": "f", "inputs": [[1]], "outputs": [1]}}]
    proc, graded = run_grade("code", rows, tmp_path)
    assert [(g["id"], g["correct"]) for g in graded] == [("big", False), ("surrogate", False), ("ok", True)], proc.stderr
    assert "cannot be sent to a grader (OverflowError" in graded[0]["details"]["reason"]
    assert graded[1]["details"]["reason"].startswith("not graded: tests.inputs[0][0] holds a lone surrogate")
