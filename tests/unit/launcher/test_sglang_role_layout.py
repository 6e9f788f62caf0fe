"""`gen.backend: sglang` on the local backend: GPU layouts it cannot start as planned are refused
before anything starts, naming the problem. Starting the role against a stand-in SGLang is in
tests/integration/launcher/test_sglang_role.py.
"""
from __future__ import annotations

import pytest
from model_dirs import checked_model_dir

from tandem.launcher.config import ConfigError
from tandem.launcher.run import prepare

pytestmark = pytest.mark.timeout(240)
CONFIG = """\
experiment: {{name: sgl, exp_dir: {exp_dir}, model: {model}}}
launcher: {{backend: local, nodes: 1, gpus_per_node: 2, gen_train_ratio: "1:1"}}
gen: {{backend: sglang, tp_size: 1, mem_fraction_static: 0.7, seed: 5}}
"""


def _experiment(tmp_path, *overrides):
    model = checked_model_dir(tmp_path / "model")
    cfg_file = tmp_path / "sgl.yaml"
    cfg_file.write_text(CONFIG.format(exp_dir=tmp_path / "run", model=model))
    return prepare(str(cfg_file), list(overrides), False)


def test_local_backend_refuses_a_gpu_layout_of_several_nodes(tmp_path):
    with pytest.raises(ConfigError, match="launcher.nodes=2: the local backend runs on this machine only"):
        _experiment(tmp_path, "launcher.nodes=2")


def test_local_backend_starts_a_trainer_of_several_gpus(tmp_path):
    """4 GPUs at 1:1: two servers and a two-rank trainer on one machine (unpinned: this test's
    machine need not have CPUs for two servers' pools)."""
    cfg, _ = _experiment(tmp_path, "launcher.gpus_per_node=4", "launcher.cpus.pin=false")
    assert cfg.gen.num_servers == 2
