"""Issue 37 on the Megatron backend: the peak memory of its log-prob step (trainer/megatron/
logprob_head.py: the output layer applied a chunk of tokens at a time from the last stage's
hidden states) at Qwen2.5's vocabulary (151,936) against the rows path it replaced (the output
layer's whole bf16 logits, the float32 log-softmax in chunks of rows) and the whole pass
("today's" in the issue). CPU tiers: tests/unit/megatron/test_megatron_logprob_head.py (values,
gradients, and no [tokens, vocab] tensor made, by a dispatch mode) and its TP=2 twin.

Shape: a Qwen2.5-1.5B-wide model (hidden 1,536, tied embeddings, 2 layers: the decoder is not
what is measured), bf16, an 8K-token pack with chunks of 256, so tokens / chunk is 32 as for a
32K-token pack at the default chunk of 1,024 (the whole pass at 32K does not fit an H100).
Each case runs in its own process (megatron_logprob_worker.py). Done when (issue 37): the
backend's step peaks at <= 1/4 of the whole pass; and below the rows path it replaced.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)
WORKER = Path(__file__).resolve().with_name("megatron_logprob_worker.py")
REPO = Path(__file__).resolve().parents[2]
VOCAB = 151_936


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, on_gpu) -> Path:
    """Random weights of a Qwen2 with Qwen2.5's vocabulary (hidden 1,536 on a GPU, 64 on the CPU
    rehearsal: bf16-shaped matrix products are slow on a CPU)."""
    import megatron_case as mc
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden = 1536 if on_gpu else 64
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=hidden // 128 if on_gpu else 4, num_key_value_heads=2,
                      max_position_embeddings=32768, tie_word_embeddings=True)
    return mc.save_random(Qwen2ForCausalLM(cfg), tmp_path_factory.mktemp("qwen2-152k"))


def _case(model: Path, mode: str, tokens: int, chunk: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "4", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(WORKER), str(model), mode, str(tokens), str(chunk), str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{mode}: worker failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    keep = os.environ.get("TANDEM_GPU_TIER_RECORDS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"megatron-logprob-{mode}.json").write_text(out.read_text())
    return json.loads(out.read_text())


def test_megatron_logprob_step_peaks_under_a_quarter_of_the_whole_pass(wide_model, tmp_path, on_gpu):
    tokens, chunk = (8192, 256) if on_gpu else (512, 16)
    cases = {m: _case(wide_model, m, tokens, chunk, tmp_path / f"{m}.json") for m in ("whole", "rows", "head")}
    for m, c in cases.items():
        gb = None if c["peak_bytes"] is None else round(c["peak_bytes"] / 1e9, 3)
        print(f"Megatron log-prob step, {tokens} tokens x {VOCAB} vocabulary, {m} (chunk {c['chunk']}): "
              f"peak {gb} GB, {c.get('seconds')} s on {c['device']} {c.get('gpu') or ''}")
    if not on_gpu:
        return   # the rehearsal checks the code runs; CPU resident-set peaks are not the claim
    whole, rows, head = (cases[m]["peak_bytes"] for m in ("whole", "rows", "head"))
    assert head is not None and rows is not None, cases
    if whole is not None:   # out of memory: the whole pass is larger than the device
        assert head <= whole / 4, cases
    assert head < rows, cases
