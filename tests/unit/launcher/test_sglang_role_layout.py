"""`gen.backend: sglang` on the local backend: GPU layouts it cannot start as planned are refused
before anything starts, naming the problem. Starting the role against a stand-in SGLang is in
tests/integration/launcher/test_sglang_role.py.
"""
from __future__ import annotations

import pytest

from launcher.config import ConfigError
from launcher.run import prepare

pytestmark = pytest.mark.timeout(240)
CONFIG = """\
experiment: {{name: sgl, exp_dir: {exp_dir}, model: {model}}}
launcher: {{backend: local, nodes: 1, gpus_per_node: 2, gen_train_ratio: "1:1"}}
gen: {{backend: sglang, tp_size: 1, mem_fraction_static: 0.7, seed: 5}}
"""


def _experiment(tmp_path, *overrides):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    cfg_file = tmp_path / "sgl.yaml"
    cfg_file.write_text(CONFIG.format(exp_dir=tmp_path / "run", model=model))
    return prepare(str(cfg_file), list(overrides), False)


@pytest.mark.parametrize("overrides, needle", [(["launcher.gpus_per_node=4"], "one trainer process"),
                                               (["launcher.nodes=2"], "launcher.backend: slurm")])
def test_local_backend_refuses_a_gpu_layout_it_cannot_start(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        _experiment(tmp_path, *overrides)
