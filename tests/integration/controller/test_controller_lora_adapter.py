"""The controller swaps LoRA adapters on a real embedded server (`trainer.lora.sync: adapter`,
services/controller/weights/adapter.py): the server starts serving version 0's zero adapter
under the policy's name, the trainer's `adapter_on_disk` makes it serve the new one — under an
abort pause whatever `controller.interrupt_mode` says (here the default, in_place), so a request
in flight comes back partial and its resubmission runs on the new adapter — and a server that
restarts (back on version 0) is caught up to the current adapter by the health check."""
from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from controller_helpers import write_config
from polling import until
from process_starts import start
from safetensors.torch import load_file, save_file

from tandem.services.protocol import (
    POLICY_ADAPTER,
    AdapterOnDisk,
    RegisterServer,
    StatusRequest,
    SyncRequestClient,
    free_port,
    load_keys,
)
from tandem.trainer.config import LoraConfig
from tandem.trainer.lora import lora_settings, write_initial_adapter

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("peft")
KEY, ADMIN_KEY = "lora-key", "lora-admin-key"


def http(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read() or b"null")


def generate(url: str, max_new_tokens: int = 6) -> dict:
    return http(url, "/generate", {"input_ids": [5, 6, 7, 8], "lora_path": POLICY_ADAPTER, "return_logprob": True,
                                   "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                       "ignore_eos": True}})


class Gen:
    """`tandem gen serve --lora-paths policy=<v0>` at a fixed port (so a restart comes back there)."""

    def __init__(self, root, model, v0):
        self.root, self.port = root, free_port()
        (root / "api").write_text(KEY + "\n")
        (root / "admin").write_text(ADMIN_KEY + "\n")
        self.argv = ["-m", "tandem.launcher.cli", "gen", "serve", "--model", str(model), "--port",
                     str(self.port), "--api-key-file", str(root / "api"), "--admin-api-key-file", str(root / "admin"),
                     "--lora-paths", f"{POLICY_ADAPTER}={v0}"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self):
        self.proc = start(self.argv, self.root / "gen.log")
        deadline = time.monotonic() + 150
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"gen server did not start:\n{(self.root / 'gen.log').read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(15)


def trained_adapter(v0, out, seed: int):
    shutil.copytree(v0, out)
    g = torch.Generator().manual_seed(seed)
    state = load_file(out / "adapter_model.safetensors")
    save_file({k: torch.randn(t.shape, generator=g) * 0.3 for k, t in state.items()}, out / "adapter_model.safetensors")
    return out


def test_adapter_updates_and_the_catch_up_of_a_restarted_server(exp, controller_proc, tiny_model_dir, tmp_path):
    v0 = write_initial_adapter(lora_settings(LoraConfig(rank=4)), tiny_model_dir, tmp_path / "adapter-v0")
    gen = Gen(tmp_path, tiny_model_dir, v0)
    gen.start()
    (exp.keys / "gen-api").write_text(KEY + "\n")
    (exp.keys / "gen-admin").write_text(ADMIN_KEY + "\n")
    write_config(exp, groups_per_step=2, max_staleness=0, update_timeout_s=120, health_interval_s=0.3)
    client = SyncRequestClient(load_keys(exp.keys), controller_proc().start(), timeout_s=180)
    try:
        client.request(RegisterServer(address=gen.url, api_key_ref="gen-api", admin_key_ref="gen-admin"))
        base = generate(gen.url)
        assert base["meta_info"]["weight_version"] == "0"

        # A request still decoding when the pause arrives is aborted (in_place would have kept it
        # running on the old adapter). On a loaded machine the tiny model can finish its 400
        # tokens before the controller's pause reaches the server: then the next version tries.
        for version in range(1, 5):
            in_flight: dict = {}
            t = threading.Thread(target=lambda d=in_flight: d.update(generate(gen.url, max_new_tokens=400)))
            t.start()
            until("the long request", lambda: http(gen.url, "/v1/loads")["loads"][0]["num_running_reqs"] > 0, 90)
            ack = client.request(AdapterOnDisk(version=version, path=str(
                trained_adapter(v0, exp.weights / f"v{version}", version))))
            t.join(120)
            assert ack.ok and ack.failed_servers == [], ack
            if in_flight["meta_info"]["finish_reason"]["type"] != "length":
                break
        assert in_flight["meta_info"]["finish_reason"]["type"] == "abort", in_flight["meta_info"]
        after = generate(gen.url)
        assert after["meta_info"]["weight_version"] == str(version) and after["output_ids"] != base["output_ids"]

        gen.stop()                       # the server dies and comes back serving version 0
        gen.start()
        until("the catch-up", lambda: http(gen.url, "/model_info")["weight_version"] == str(version), 90)
        until("back in rotation", lambda: client.request(StatusRequest()).state["servers"][0]["in_rotation"], 90)
        again = generate(gen.url)
        assert again["meta_info"]["weight_version"] == str(version) and again["output_ids"] == after["output_ids"]
    except urllib.error.HTTPError as e:
        pytest.fail(f"{e.code}: {e.read()[:500]}")
    finally:
        client.close()
        gen.stop()
