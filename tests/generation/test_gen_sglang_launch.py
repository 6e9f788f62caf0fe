"""The SGLang command line for GPU nodes (SGLang cannot run here; its argv is what we can check)."""
from __future__ import annotations

import pytest

from rollout.sglang_launch import SGLangServerSpec, servers_for_node, sglang_argv, shell_command


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_argv_has_every_setting():
    spec = SGLangServerSpec(model_path="/ckpt/qwen", host="10.0.0.5", port=31000, tp_size=2, base_gpu_id=4,
                            mem_fraction_static=0.7, api_key="s3cret", weight_version=3, context_length=8192,
                            max_running_requests=128, nccl_port=32000, extra_args=["--disable-radix-cache"],
                            python="/venv/bin/python")
    argv = sglang_argv(spec)
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/ckpt/qwen"
    assert flag(argv, "--host") == "10.0.0.5" and flag(argv, "--port") == "31000"
    assert flag(argv, "--tp-size") == "2" and flag(argv, "--base-gpu-id") == "4"
    assert flag(argv, "--mem-fraction-static") == "0.7"
    assert flag(argv, "--api-key") == "s3cret"
    assert flag(argv, "--weight-version") == "3"
    assert flag(argv, "--context-length") == "8192"
    assert flag(argv, "--max-running-requests") == "128"
    assert flag(argv, "--nccl-port") == "32000"
    assert argv[-1] == "--disable-radix-cache"


def test_optional_flags_are_left_out():
    argv = sglang_argv(SGLangServerSpec(model_path="/m"))
    for absent in ("--api-key", "--context-length", "--max-running-requests", "--nccl-port", "--trust-remote-code"):
        assert absent not in argv
    assert flag(argv, "--weight-version") == "0"


@pytest.mark.parametrize("kw, needle", [({"tp_size": 0}, "tp_size"), ({"mem_fraction_static": 1.5}, "mem_fraction"),
                                        ({"base_gpu_id": -1}, "base_gpu_id"), ({"port": 0}, "port")])
def test_bad_spec_names_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        sglang_argv(SGLangServerSpec(model_path="/m", **kw))


def test_node_split_into_tp_groups_and_key_masked():
    specs = servers_for_node("/m", [0, 1, 2, 3, 4, 5], 2, host="h", base_port=30000, api_key="k")
    assert [(s.base_gpu_id, s.port, s.tp_size) for s in specs] == [(0, 30000, 2), (2, 30001, 2), (4, 30002, 2)]
    assert len({s.nccl_port for s in specs}) == 3
    line = shell_command(specs[0])
    assert "$TANDEM_GEN_API_KEY" in line and " k" not in line.split("--api-key")[1][:3]
    with pytest.raises(ValueError, match="tensor-parallel"):
        servers_for_node("/m", [0, 1, 2], 2, host="h", base_port=30000)
