"""`tandem sft`: the warm-up writes a loadable model, reports accuracy, and is cached; one
stopped before its steps is not, and the next run continues it."""
from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading


def sft(out, *extra):
    args = extra or ("--steps", "3", "--eval-n", "4")
    return subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "sft", "--task", "math", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=300)


def test_warm_up_writes_a_model_and_reuses_it(tmp_path):
    out = tmp_path / "cache" / "warm"   # as make train-math's .cache/ in a fresh clone: not there yet
    first = sft(out)
    assert first.returncode == 0, first.stderr[-2000:]
    meta = json.loads((out / "sft.json").read_text())
    assert meta["steps"] == 3 and meta["task"] == "math" and 0.0 <= meta["greedy_accuracy"] <= 1.0
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template
    again = sft(out)
    assert again.returncode == 0 and "using cached warm-up model" in again.stdout
    bad = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "sft", "--task", "poetry", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--task must be one of math, code, code-agent, agent-math" in bad.stderr


def _until(proc: subprocess.Popen, *needles: str, timeout_s: float = 300) -> str:
    """The process's output up to the first line holding the last needle, each needle in turn
    (read by a thread: a pipe's buffered lines are invisible to select)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(proc.stdout.readline, "")] + [lines.put("")],
                     daemon=True).start()
    seen, want = [], list(needles)
    while want:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            break
        if not line:
            break
        seen.append(line)
        if want[0] in line:
            want.pop(0)
    assert not want, f"never printed {want}:\n{''.join(seen)[-3000:]}"
    proc.reader = lines
    return "".join(seen)


def _rest(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    """What the process printed after `_until`, once it has exited."""
    proc.wait(timeout=timeout_s)
    out = []
    while (line := proc.reader.get(timeout=timeout_s)) != "":
        out.append(line)
    return "".join(out)


def test_a_warm_up_stopped_early_is_not_cached_and_continues(tmp_path):
    """Issue 63: the time cap, Ctrl-C and SIGTERM each stop the warm-up with a non-zero status,
    write no model and say so; the next run continues from the step where it stopped."""
    out = tmp_path / "warm"
    partial = tmp_path / "warm.partial.pt"
    capped = sft(out, "--steps", "50", "--eval-n", "0", "--seconds", "0.001")   # 50 steps never fit 1 ms
    assert capped.returncode == 3, capped.stdout[-2000:] + capped.stderr[-2000:]
    found = re.search(r"warm-up stopped at step (\d+) of 50 by its time cap \(0.001 s\): not cached as done",
                      capped.stdout)
    assert found, capped.stdout[-2000:]
    assert not out.exists() and partial.exists()

    def run(*extra):
        cmd = [sys.executable, "-m", "tandem.launcher.cli", "sft", "--task", "math", "--out", str(out),
               "--steps", "50", "--eval-n", "0", *extra]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    stopped = {"at": int(found.group(1))}
    for sig, code, name in ((signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")):
        proc = run()
        start = stopped["at"]
        said = _until(proc, f"continuing the unfinished warm-up from step {start} of 50", "sft math: step")
        proc.send_signal(sig)
        rest = _rest(proc)
        assert proc.returncode == code, said + rest
        assert f"{name}: stopping the warm-up after this step" in rest
        found = re.search(r"warm-up stopped at step (\d+) of 50 by a stop request: not cached as done", rest)
        assert found, rest
        stopped["at"] = int(found.group(1))
        assert start < stopped["at"] < 50 and not out.exists() and partial.exists()
