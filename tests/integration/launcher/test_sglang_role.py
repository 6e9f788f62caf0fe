"""`gen.backend: sglang` on this machine: the launcher's real code path with a STAND-IN for SGLang.

SGLang needs CUDA, so these tests put `tests/integration/launcher/standin_sglang/` first on PYTHONPATH: the
launch runs, unchanged, `python -m sglang.launch_server ...`, which there is a small script (NOT
SGLang; see its docstring) that parses the flags, reads `--config`, records its argv and
environment and serves `/ready`, `/health`, `/model_info`, `/v1/loads` over real HTTP. Everything
else is real: `tandem run`'s prepare and role specs, the local supervisor, the `tandem gen sglang`
role process, the controller (ZeroMQ) that registers the server and health-checks it with the
experiment's keys. The GPUs are the only thing mocked: CUDA_VISIBLE_DEVICES is checked as the
value the plan hands to the server, nothing uses a device.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from model_dirs import checked_model_dir
from polling import until

from tandem.launcher.backends.local import LocalBackend
from tandem.launcher.config import ConfigError
from tandem.launcher.launcher_watch import launcher_env
from tandem.launcher.lifecycle import register_server
from tandem.launcher.roles import GEN_ADMIN_KEY, GEN_API_KEY, experiment_roles
from tandem.launcher.run import prepare
from tandem.services.protocol import StatusRequest, SyncRequestClient, load_keys, read_service

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[3]
STANDIN = Path(__file__).with_name("standin_sglang")
# fork_roles off: where SGLang runs, torch is a CUDA build and the launcher never forks its roles
# (launcher/backends/role_forks.py); here the preloading server only cost each launch the import
# of torch and transformers (~5 CPU-s), and forked the role as it is never started with SGLang.
CONFIG = """\
experiment: {{name: sgl, exp_dir: {exp_dir}, model: {model}}}
launcher: {{backend: local, nodes: 1, gpus_per_node: 2, gen_train_ratio: "1:1", fork_roles: false}}
gen: {{backend: sglang, tp_size: 1, mem_fraction_static: 0.7, seed: 5}}
"""


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _records(d: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in d.glob("*.json")), key=lambda r: r["pid"]) if d.exists() else []


def _servers(exp) -> list[dict]:
    controller = read_service(exp, "controller", timeout_s=10)
    client = SyncRequestClient(load_keys(exp.keys), controller["address"], timeout_s=30)
    try:
        return client.request(StatusRequest()).state["servers"]
    finally:
        client.close()


@pytest.fixture
def standin(monkeypatch, tmp_path) -> Path:
    records = tmp_path / "standin-records"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(STANDIN), str(REPO),
                                                                 os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("TANDEM_STANDIN_SGLANG_RECORDS", str(records))
    return records


def _experiment(tmp_path, *overrides):
    model = checked_model_dir(tmp_path / "model")
    cfg_file = tmp_path / "sgl.yaml"
    cfg_file.write_text(CONFIG.format(exp_dir=tmp_path / "run", model=model))
    return prepare(str(cfg_file), list(overrides), False)


def test_keys_are_random_private_and_both_referenced(tmp_path):
    cfg, exp = _experiment(tmp_path)
    keys = [(exp.keys / n).read_text().strip() for n in (GEN_API_KEY, GEN_ADMIN_KEY)]
    assert keys[0] != keys[1] and all(len(k) >= 40 for k in keys)
    for name in (GEN_API_KEY, GEN_ADMIN_KEY):
        assert stat.S_IMODE((exp.keys / name).stat().st_mode) == 0o600
    backend = LocalBackend(cfg, exp)
    backend.sup.close()   # nothing is started here; the launcher's own CPUs back (conftest checks)
    specs = {s.name: s for s in experiment_roles(cfg, exp, False)}
    argv = _tandem_args(specs["gen-0"])
    assert argv[:2] == ["gen", "sglang"]
    assert _flag(argv, "--api-key-file") == str(exp.keys / GEN_API_KEY)
    assert _flag(argv, "--admin-api-key-file") == str(exp.keys / GEN_ADMIN_KEY)
    assert not any(k in " ".join(argv) for k in keys)
    # The plan's GPUs: server 0 on GPU 0, the (single) trainer rank on GPU 1.
    assert backend._env(specs["gen-0"]) == {"CUDA_VISIBLE_DEVICES": "0"}
    # ... and the trainer, stopping because the launcher is gone, its grace (launcher_watch.py).
    assert backend._env(specs["trainer-0"]) == {"CUDA_VISIBLE_DEVICES": "1",
                                                **launcher_env("trainer", cfg.launcher.trainer_stop_s)}
    assert backend._env(specs["controller-0"]) == {}
    # The embedded server gets the same two key files.
    cfg.gen.backend = "embedded"
    argv = _tandem_args({s.name: s for s in experiment_roles(cfg, exp, False)}["gen-0"])
    assert argv[:2] == ["gen", "serve"] and _flag(argv, "--admin-api-key-file") == str(exp.keys / GEN_ADMIN_KEY)


def test_the_plans_gpus_are_those_the_launcher_was_given(tmp_path, monkeypatch):
    """A launcher given part of a machine (CUDA_VISIBLE_DEVICES=5,2: a shared box's share, a SLURM
    allocation's GPUs) puts the plan's GPU i on the i-th of them, never on one it was not given;
    one given fewer than the plan needs is refused before anything starts, saying how many."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    cfg, exp = _experiment(tmp_path)
    backend = LocalBackend(cfg, exp)
    backend.sup.close()
    specs = {s.name: s for s in experiment_roles(cfg, exp, False)}
    assert backend._env(specs["gen-0"]) == {"CUDA_VISIBLE_DEVICES": "5"}
    assert backend._env(specs["trainer-0"])["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(ConfigError, match=r"launcher.gpus_per_node=2: the plan places the roles on 2 GPUs, but "
                                          r"this launcher sees 1 \(CUDA_VISIBLE_DEVICES=5\); set "
                                          r"launcher.gpus_per_node=1"):
        (tmp_path / "fewer").mkdir()
        _experiment(tmp_path / "fewer")


def test_launch_readiness_registration_restart_and_stop(tmp_path, standin):
    cfg, exp = _experiment(tmp_path)
    api_key, admin_key = ((exp.keys / n).read_text().strip() for n in (GEN_API_KEY, GEN_ADMIN_KEY))
    specs = {s.name: s for s in experiment_roles(cfg, exp, False)}
    backend = LocalBackend(cfg, exp)
    sup = backend.sup
    try:
        backend.start([specs["controller-0"]])
        backend.start([specs["gen-0"]])          # returns once gen-0.json is written
        register_server(exp, specs["gen-0"])     # what the lifecycle does next
        (first,) = _records(standin)
        info = json.loads(exp.service_file("gen-0").read_text())

        # The argv: SGLang's launcher with the plan's settings; no key anywhere on a command line.
        argv = first["argv"]
        assert _flag(argv, "--model-path") == cfg.experiment.model
        assert _flag(argv, "--host") == "127.0.0.1" and _flag(argv, "--port") == str(info["port"])
        assert (_flag(argv, "--tp-size"), _flag(argv, "--base-gpu-id")) == ("1", "0")
        assert _flag(argv, "--mem-fraction-static") == "0.7" and _flag(argv, "--random-seed") == "5"
        assert _flag(argv, "--weight-version") == "0" and int(_flag(argv, "--nccl-port")) > 0
        assert "--api-key" not in argv and "--admin-api-key" not in argv
        assert "--enable-deterministic-inference" not in argv
        cmdline = Path(f"/proc/{first['pid']}/cmdline").read_bytes().decode()
        assert api_key not in cmdline and admin_key not in cmdline
        # ... the keys reached SGLang through its --config file, which only the owner can read.
        assert (first["api_key"], first["admin_api_key"]) == (api_key, admin_key)
        assert stat.S_IMODE(Path(_flag(argv, "--config")).stat().st_mode) == 0o600
        # The environment: the plan's GPU, and a /health that runs no generation.
        assert first["cuda_visible_devices"] == "0"
        assert first["sglang_env"] == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}

        # Readiness: /ready was polled until 200, and only then the server was announced.
        events = [json.loads(x) for x in (standin / f"{first['pid']}.events").read_text().splitlines()]
        ready = [e for e in events if e["path"] == "/ready" and e["status"] == 200]
        assert ready and info["published_at"] >= ready[0]["t"]
        assert (info["backend"], info["url"], info["server_pid"]) == ("sglang", f"http://127.0.0.1:{info['port']}",
                                                                      first["pid"])

        # Registration: the controller holds it and its health check (with the key files) passes.
        def healthy():
            return [s for s in _servers(exp) if s["address"] == info["url"] and s["healthy"] and s["in_rotation"]]
        (server,) = until("the controller seeing the server healthy", healthy)
        assert server["tp_size"] == 1

        # Restart: SGLang dies -> the role exits non-zero -> the supervisor restarts the role, which
        # starts a new SGLang and re-announces; its old workers are gone with the process group.
        os.kill(first["pid"], signal.SIGKILL)
        (ended,) = until("the supervisor noticing gen-0's exit",
                         lambda: [e for e in backend.ended() if e.role.name == "gen-0"])
        assert ended.restarted and not ended.ok
        register_server(exp, ended.role)         # the lifecycle re-registers a restarted server
        second = until("a second SGLang", lambda: _records(standin)[1:])[0]
        assert second["pid"] != first["pid"] and sup.children["gen-0"].restarts == 1
        assert not _alive(first["worker_pid"])
        assert json.loads(exp.service_file("gen-0").read_text())["server_pid"] == second["pid"]
        until("re-registration", healthy)

        # Stop: the role takes SGLang and its workers down.
        role_pid = sup.children["gen-0"].proc.pid
        sup.stop(["gen-0"])
        for pid in (role_pid, second["pid"], second["worker_pid"]):
            assert not _alive(pid), pid
    finally:
        backend.close("test")


def _tandem_args(role) -> list[str]:
    return role.command[role.command.index("tandem.launcher.cli") + 1:]


def test_missing_sglang_is_a_clear_error(tmp_path):
    """Without the stand-in (and without SGLang in this venv) the role refuses at once."""
    if subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode == 0:
        pytest.skip("sglang is installed in this interpreter")
    cfg, exp = _experiment(tmp_path)
    out = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "gen", "sglang", "--exp", str(exp.root),
                          "--model", cfg.experiment.model], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2
    assert "sglang" in out.stderr and "tandem[gpu]" in out.stderr and "sglang==0.5.23" in out.stderr


def test_the_sglang_role_runs_the_weight_relay_beside_sglang(tmp_path, standin):
    """gen.weight_relay with SGLang: the role (not SGLang) runs the relay, announces it, the
    launcher registers it, it serves a version with the admin key, and the node's copies go when
    the role stops."""
    import asyncio

    from tandem.rollout.client.relay import relay_fetch

    cfg, exp = _experiment(tmp_path, "gen.weight_relay=true", f"gen.relay_dir={tmp_path / 'relay'}")
    admin_key = (exp.keys / GEN_ADMIN_KEY).read_text().strip()
    specs = {s.name: s for s in experiment_roles(cfg, exp, False)}
    backend = LocalBackend(cfg, exp)
    try:
        backend.start([specs["controller-0"]])
        backend.start([specs["gen-0"]])
        register_server(exp, specs["gen-0"])
        info = json.loads(exp.service_file("gen-0").read_text())
        assert info["relay"].startswith("127.0.0.1:") and str(tmp_path / "relay") in info["relay_node"]
        src = exp.weights / "v1"   # a relay copies from the run's weights/ only
        src.mkdir(parents=True)
        (src / "model.safetensors").write_bytes(b"w" * 1000)
        out = asyncio.run(relay_fetch(info["relay"], admin_key, 1, str(src), 30))
        assert Path(out["path"]).parent.parent == tmp_path / "relay"
        assert (Path(out["path"]) / "model.safetensors").read_bytes() == b"w" * 1000
        backend.sup.stop(["gen-0"])
        assert not Path(out["path"]).exists() and not list((tmp_path / "relay").iterdir())
    finally:
        backend.close("test")
