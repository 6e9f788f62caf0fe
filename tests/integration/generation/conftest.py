"""Generation tests: the embedded server runs as a real `tandem gen serve` subprocess.

Set TANDEM_GEN_URL (and TANDEM_GEN_API_KEY) to run the API conformance tests against another
server, e.g. a real SGLang on a GPU machine; tests that need the embedded server's model files
or internals are skipped then.
"""
from __future__ import annotations

import pytest
from gen_support import API_KEY, EXTERNAL_URL, SHARED_MAX_RUNNING, SHARED_RANK, Api, ServerProcess


@pytest.fixture(scope="session")
def model_v1(tmp_path_factory):
    """Same architecture as the tiny model, different weights (the 'next policy')."""
    from tandem.rollout.tiny_model import init_tiny
    return init_tiny(tmp_path_factory.mktemp("tiny-v1"), seed=1)


@pytest.fixture(scope="session")
def shared_exp(tiny_model_dir, tmp_path_factory):
    """An experiment directory whose `gen` section the shared server reads (via --exp)."""
    from tandem.launcher.config import load_config, save_resolved
    from tandem.services.protocol import ExpDir
    exp = ExpDir(tmp_path_factory.mktemp("gen-exp") / "exp")
    cfg = load_config(None, ["experiment.name=gen-test", f"experiment.model={tiny_model_dir}",
                             f"experiment.exp_dir={exp.root}", f"gen.max_running_requests={SHARED_MAX_RUNNING}"])
    save_resolved(cfg, exp.root)
    return exp


@pytest.fixture(scope="session")
def shared_process(tiny_model_dir, shared_exp, tmp_path_factory):
    """One embedded server (tiny model, API key, started as an experiment role with --exp) for the
    tests that leave its weights alone. Server start-up is the slow part of these tests."""
    if EXTERNAL_URL:
        yield None
        return
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("gen-shared"),
                           extra=("--exp", str(shared_exp.root), "--rank", str(SHARED_RANK)))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_server(shared_process):
    return Api(EXTERNAL_URL, API_KEY) if shared_process is None else shared_process.api


@pytest.fixture(scope="module")
def own_server(tiny_model_dir, tmp_path_factory):
    """An embedded server for one test module, whose weights its tests may change."""
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("gen-own"))
    yield server
    server.stop()


@pytest.fixture
def embedded_only():
    if EXTERNAL_URL:
        pytest.skip("needs the embedded server (TANDEM_GEN_URL points elsewhere)")
