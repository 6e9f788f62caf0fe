"""The SGLang command line for GPU nodes (SGLang cannot run here; its argv is what we can check)."""
from __future__ import annotations

import pytest

from tandem.rollout.sglang_launch import (
    SGLangServerSpec,
    key_config,
    servers_for_node,
    sglang_argv,
    sglang_env,
    shell_command,
    write_key_config,
)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_argv_has_every_setting():
    spec = SGLangServerSpec(model_path="/ckpt/qwen", host="10.0.0.5", port=31000, tp_size=2, base_gpu_id=4,
                            mem_fraction_static=0.7, key_config="/exp/keys/k.yaml", weight_version=3, context_length=8192,
                            max_running_requests=128, nccl_port=32000, extra_args=["--disable-radix-cache"],
                            python="/venv/bin/python")
    argv = sglang_argv(spec)
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/ckpt/qwen"
    assert flag(argv, "--host") == "10.0.0.5" and flag(argv, "--port") == "31000"
    assert flag(argv, "--tp-size") == "2" and flag(argv, "--base-gpu-id") == "4"
    assert flag(argv, "--mem-fraction-static") == "0.7"
    assert flag(argv, "--config") == "/exp/keys/k.yaml" and "--api-key" not in argv
    assert flag(argv, "--weight-version") == "3"
    assert flag(argv, "--context-length") == "8192"
    assert flag(argv, "--max-running-requests") == "128"
    assert flag(argv, "--nccl-port") == "32000"
    assert argv[-1] == "--disable-radix-cache"


def test_optional_flags_are_left_out():
    argv = sglang_argv(SGLangServerSpec(model_path="/m"))
    for absent in ("--api-key", "--config", "--dtype", "--context-length", "--max-running-requests", "--nccl-port",
                   "--trust-remote-code", "--enable-deterministic-inference"):
        assert absent not in argv
    assert flag(argv, "--weight-version") == "0"


@pytest.mark.parametrize("kw, needle", [({"tp_size": 0}, "tp_size"), ({"mem_fraction_static": 1.5}, "mem_fraction"),
                                        ({"base_gpu_id": -1}, "base_gpu_id"), ({"port": 0}, "port"),
                                        ({"extra_args": ["--api-key=k"]}, "never on the command line")])
def test_bad_spec_names_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        sglang_argv(SGLangServerSpec(model_path="/m", **kw))


def test_node_split_into_tp_groups():
    specs = servers_for_node("/m", [0, 1, 2, 3, 4, 5], 2, host="h", base_port=30000)
    assert [(s.base_gpu_id, s.port, s.tp_size) for s in specs] == [(0, 30000, 2), (2, 30001, 2), (4, 30002, 2)]
    assert len({s.nccl_port for s in specs}) == 3
    assert shell_command(specs[0]).split()[1:3] == ["-m", "sglang.launch_server"]
    with pytest.raises(ValueError, match="tensor-parallel"):
        servers_for_node("/m", [0, 1, 2], 2, host="h", base_port=30000)


def test_keys_travel_in_a_private_config_file(tmp_path):
    """SGLang 0.5.23 reads --api-key/--admin-api-key only as options; `--config FILE.yaml` turns
    the file's keys into those options inside the server process."""
    assert key_config("a", "b") == {"api-key": "a", "admin-api-key": "b"} and key_config(None, None) == {}
    path = write_key_config(tmp_path / "keys" / "gen-0.sglang.yaml", "a", "b")
    import stat

    import yaml
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {"api-key": "a", "admin-api-key": "b"}


def test_env_sets_gpus_and_turns_off_the_generating_health_probe():
    env = sglang_env({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "7"}, cuda_visible_devices="2,3")
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
    assert sglang_env({"CUDA_VISIBLE_DEVICES": "4"})["CUDA_VISIBLE_DEVICES"] == "4"   # SLURM's, inherited
    argv = sglang_argv(SGLangServerSpec(model_path="/m", deterministic_inference=True))
    assert "--enable-deterministic-inference" in argv
