"""How the embedded server reads the adapter a request names and the adapters it starts with
(rollout/server/lora_routes.py), in SGLang 0.5.23's forms: `lora_path` a name or one per prompt,
`--lora-paths NAME=PATH | PATH` (arg_groups/lora_hook.py)."""
from __future__ import annotations

import pytest

from tandem.rollout.server.lora_routes import parse_lora_paths, request_adapter
from tandem.rollout.server.sampling import BadRequest


def test_lora_path_is_taken_off_the_body_and_must_name_one_adapter():
    body = {"input_ids": [1], "lora_path": "policy"}
    assert request_adapter(body) == "policy" and "lora_path" not in body
    assert request_adapter({"lora_path": ["policy", "policy"]}) == "policy"
    assert request_adapter({"input_ids": [1]}) is None and request_adapter({"lora_path": [None]}) is None
    with pytest.raises(BadRequest, match="names 2 adapters; the embedded server serves one"):
        request_adapter({"lora_path": ["a", "b"]})
    for bad in ([{"a": 1}], 3):
        with pytest.raises(BadRequest, match=r"/generate\.lora_path must"):
            request_adapter({"lora_path": bad})


def test_lora_paths_take_sglangs_forms():
    assert parse_lora_paths(["policy=/exp/adapter-v0", "/a/b"]) == {"policy": "/exp/adapter-v0", "/a/b": "/a/b"}
    assert parse_lora_paths(None) == {}
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        parse_lora_paths(["=/x"])
