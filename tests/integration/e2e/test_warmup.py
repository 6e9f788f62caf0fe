"""`tandem sft`: the warm-up writes a loadable model, reports accuracy, and is cached."""
from __future__ import annotations

import json
import subprocess
import sys


def sft(out, *extra):
    return subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "sft", "--task", "math", "--out", str(out),
                           "--steps", "3", "--eval-n", "4", *extra], capture_output=True, text=True, timeout=300)


def test_warm_up_writes_a_model_and_reuses_it(tmp_path):
    out = tmp_path / "warm"
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
    assert bad.returncode == 2 and "--task must be math, code or code-agent" in bad.stderr
