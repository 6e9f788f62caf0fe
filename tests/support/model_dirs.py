"""A model directory as far as the launch check reads one (launcher/preflight.model_problem):
a config naming its model type, a weights file and a tokenizer, with no weights in them. For the
tests of configs and checks, which never load the model; the roles' tests use real tiny models
(tests/conftest.py: tiny_model_dir, small_model_dir)."""
from __future__ import annotations

import json
from pathlib import Path


def checked_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path
