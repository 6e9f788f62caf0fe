"""The controller process drives a real embedded generation server (`tandem gen serve`): after a
weight update the server generates with the new weights and stamps the new version."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from controller_helpers import write_config
from safetensors.torch import load_file, save_file

from services.protocol import (
    RegisterServer,
    StatusRequest,
    SyncRequestClient,
    WeightsReady,
    free_port,
    load_keys,
)

pytestmark = pytest.mark.timeout(180)
KEY = "real-server-key"


def http(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"null")


def greedy(url: str) -> tuple[list[int], str]:
    out = http(url, "/generate", {"input_ids": [5, 6, 7, 8], "return_logprob": True,
                                  "sampling_params": {"temperature": 0.0, "max_new_tokens": 6}})
    return out["output_ids"], out["meta_info"]["weight_version"]


@pytest.fixture(scope="module")
def real_gen(tmp_path_factory, tiny_model_dir):
    """One `tandem gen serve` for the module (its start-up is the slow part)."""
    root = tmp_path_factory.mktemp("real-gen")
    key_file = root / "gen-api-key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    log = open(root / "gen.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "gen", "serve", "--model", str(tiny_model_dir),
                             "--port", str(port), "--api-key-file", str(key_file)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 150
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"gen server did not start:\n{(root / 'gen.log').read_text()[-3000:]}")
        time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def gen_server(exp, real_gen):
    (exp.keys / "gen-api-key").write_text(KEY + "\n")
    return real_gen


def flipped_weights(tiny_model_dir, out_dir):
    """A copy of the model whose final norm is negated: greedy decoding then picks other tokens."""
    shutil.copytree(tiny_model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    tensors["model.norm.weight"] = -tensors["model.norm.weight"]
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def test_disk_update_of_a_real_server(exp, controller_proc, gen_server, tiny_model_dir):
    write_config(exp, groups_per_step=2, max_staleness=0, broadcast_backend="gloo", update_timeout_s=120)
    address = controller_proc().start()
    client = SyncRequestClient(load_keys(exp.keys), address, timeout_s=120)
    try:
        client.request(RegisterServer(address=gen_server, api_key_ref="gen-api-key"))
        before, version = greedy(gen_server)
        assert version == "0"

        flipped_weights(tiny_model_dir, exp.weights / "v1")
        ack = client.request(WeightsReady(version=1, how="disk", path=str(exp.weights / "v1")))
        assert ack.ok and ack.failed_servers == [], ack
        after, version = greedy(gen_server)
        assert version == "1" and after != before
        assert http(gen_server, "/get_model_info")["weight_version"] == "1"
        state = client.request(StatusRequest()).state
        assert state["version"] == 1 and state["servers"][0]["in_rotation"]
    finally:
        client.close()


def test_broadcast_update_of_a_real_server(exp, controller_proc, gen_server, tiny_model_dir):
    """The test plays the trainer's rank 0 with the project's own `trainer.publish.join_weight_group`."""
    write_config(exp, groups_per_step=2, max_staleness=0, broadcast_backend="gloo", update_timeout_s=10)
    address = controller_proc().start()
    client = SyncRequestClient(load_keys(exp.keys), address, timeout_s=60)
    try:
        client.request(RegisterServer(address=gen_server, api_key_ref="gen-api-key"))
        from trainer.publish import join_weight_group
        original = load_file(str(tiny_model_dir / "model.safetensors"))
        names = sorted(original)
        port = free_port()
        ready = WeightsReady(version=2, how="broadcast", group_name="tandem-weights-v2", master_address="127.0.0.1",
                             master_port=port, world_size=2, names=names,
                             dtypes=[str(original[n].dtype).removeprefix("torch.") for n in names],
                             shapes=[list(original[n].shape) for n in names])
        sent = {}

        def trainer_side():
            pg = join_weight_group("127.0.0.1", port, 0, 2, ready.group_name, backend="gloo", timeout_s=10)
            try:
                for n in names:
                    torch.distributed.broadcast(original[n].contiguous(), src=0, group=pg)
                sent["ok"] = True
            finally:
                torch.distributed.destroy_process_group(pg)

        sender = threading.Thread(target=lambda: _record_errors(trainer_side, sent), daemon=True)
        sender.start()
        ack = client.request(ready)
        sender.join(30)
        assert sent.get("ok") and ack.ok, (ack, sent)
        restored, version = greedy(gen_server)
        assert version == "2"
        state = client.request(StatusRequest()).state
        assert state["version"] == 2 and state["servers"][0]["in_rotation"]
        assert {"pause_s", "init_group_s", "update_s", "continue_s"} <= set(ack.timings)
    finally:
        client.close()


def _record_errors(fn, box: dict) -> None:
    try:
        fn()
    except Exception as e:  # reported by the assertion in the test thread
        box["error"] = repr(e)
