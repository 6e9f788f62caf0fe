"""The controller process drives a real embedded generation server (`tandem gen serve`, started
with an API key and an admin key, as the launcher starts SGLang): after a weight update the
server generates with the new weights and stamps the new version; the controller reads that
version from /model_info, its load from /v1/loads, and runs broadcasts inside a weight-update
session (the embedded server, like SGLang 0.5.23, refuses a distributed update outside one)."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from controller_helpers import write_config
from process_starts import start
from safetensors.torch import load_file, save_file
from sync_support import settle

from tandem.services.config import ControllerConfig
from tandem.services.controller.server import Controller
from tandem.services.protocol import (
    RegisterServer,
    StatusRequest,
    SyncRequestClient,
    WeightsBroadcast,
    WeightsOnDisk,
    free_port,
    load_keys,
)
from tandem.services.protocol.weight_group import join_weight_group

pytestmark = pytest.mark.timeout(180)
KEY = "real-server-key"
ADMIN_KEY = "real-server-admin-key"


def http(url: str, path: str, body: dict | None = None, key: str = KEY):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
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
    admin_file = root / "gen-admin-api-key"
    admin_file.write_text(ADMIN_KEY + "\n")
    port = free_port()
    proc = start(["-m", "tandem.launcher.cli", "gen", "serve", "--model", str(tiny_model_dir), "--port", str(port),
                  "--api-key-file", str(key_file), "--admin-api-key-file", str(admin_file)], root / "gen.log")
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
    (exp.keys / "gen-admin-api-key").write_text(ADMIN_KEY + "\n")
    return real_gen


def register(client, url: str) -> None:
    client.request(RegisterServer(address=url, api_key_ref="gen-api-key", admin_key_ref="gen-admin-api-key"))


def flipped_weights(tiny_model_dir, out_dir):
    """A copy of the model whose final norm is negated: greedy decoding then picks other tokens."""
    shutil.copytree(tiny_model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    tensors["model.norm.weight"] = -tensors["model.norm.weight"]
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def test_disk_update_of_a_real_server(exp, controller_proc, gen_server, tiny_model_dir):
    write_config(exp, groups_per_step=2, max_staleness=0, broadcast_backend="gloo", update_timeout_s=120,
                 health_interval_s=0.2)
    address = controller_proc().start()
    client = SyncRequestClient(load_keys(exp.keys), address, timeout_s=120)
    try:
        register(client, gen_server)
        before, version = greedy(gen_server)
        assert version == "0"

        flipped_weights(tiny_model_dir, exp.weights / "v1")
        ack = client.request(WeightsOnDisk(version=1, path=str(exp.weights / "v1")))
        assert ack.ok and ack.failed_servers == [], ack
        after, version = greedy(gen_server)
        assert version == "1" and after != before
        assert http(gen_server, "/model_info")["weight_version"] == "1"
        state = client.request(StatusRequest()).state
        assert state["version"] == 1 and state["servers"][0]["in_rotation"]
        # Health checks after the update keep it in rotation (the version is read live) and
        # learn its TP size; the admin routes refused the API key all along.
        time.sleep(0.5)
        server = client.request(StatusRequest()).state["servers"][0]
        assert server["in_rotation"] and server["weight_version"] == 1 and server["tp_size"] == 1
        with pytest.raises(urllib.error.HTTPError) as info:
            http(gen_server, "/continue_generation", {})
        assert info.value.code == 401
    finally:
        client.close()


def test_broadcast_update_of_a_real_server(exp, controller_proc, gen_server, tiny_model_dir):
    """The test plays the trainer's rank 0 with the project's own rendezvous (`join_weight_group`)."""
    write_config(exp, groups_per_step=2, max_staleness=0, broadcast_backend="gloo", update_timeout_s=10)
    address = controller_proc().start()
    client = SyncRequestClient(load_keys(exp.keys), address, timeout_s=60)
    try:
        register(client, gen_server)
        original = load_file(str(tiny_model_dir / "model.safetensors"))
        names = sorted(original)
        port = free_port()
        ready = WeightsBroadcast(version=2, group_name="tandem-weights-v2", master_address="127.0.0.1",
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
        assert {"pause_s", "begin_s", "init_group_s", "update_s", "end_s", "continue_s"} <= set(ack.timings)
    finally:
        client.close()


def start_long_sample(url: str, reply: dict, tokens: int) -> threading.Thread:
    """A greedy sample of `tokens` tokens in a thread (its reply, or its error, into `reply`),
    returned once the server runs it."""
    def long_sample():
        reply.update(http(url, "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": {
            "temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}}))

    sampler = threading.Thread(target=lambda: _record_errors(long_sample, reply), daemon=True)
    sampler.start()
    deadline = time.monotonic() + 30
    while not any(r["num_running_reqs"] for r in http(url, "/v1/loads")["loads"]):
        assert time.monotonic() < deadline and sampler.is_alive(), "the sample never started"
        time.sleep(0.01)
    return sampler


def _record_errors(fn, box: dict) -> None:
    try:
        fn()
    except Exception as e:  # reported by the assertion in the test thread
        box["error"] = repr(e)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_pause_keeps_the_request_on_the_server_across_the_update(exp, controller_proc, gen_server,
                                                                   tiny_model_dir, mode):
    """`controller.interrupt_mode: retract` (re-prefilled) and `in_place` (KV cache kept; the
    update is sent with `flush_cache: false`, without which the embedded server, like SGLang,
    refuses it): a sample in flight during a disk update is not returned partial (nothing to
    resubmit); it finishes on the server, its tokens split between the two versions in
    `meta_info.weight_versions`."""
    write_config(exp, groups_per_step=2, max_staleness=0, update_timeout_s=120, interrupt_mode=mode)
    address = controller_proc().start()
    client = SyncRequestClient(load_keys(exp.keys), address, timeout_s=120)
    try:
        register(client, gen_server)
        flipped_weights(tiny_model_dir, exp.weights / "v1")
        reply: dict = {}
        sampler = start_long_sample(gen_server, reply, 480)
        # The server is shared by this module's tests: move it one version past what it holds.
        new = int(http(gen_server, "/model_info")["weight_version"]) + 1
        ack = client.request(WeightsOnDisk(version=new, path=str(exp.weights / "v1")))
        sampler.join(120)
        assert ack.ok, ack
        assert "error" not in reply, reply
        meta = reply["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and len(reply["output_ids"]) == 480
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == [str(new - 1), str(new)], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 480
    finally:
        client.close()


def test_non_interruptible_updates_coalesce_while_a_real_server_drains(exp, controller_proc, gen_server,
                                                                       tiny_model_dir):
    """`controller.interruptible: false` against the real embedded server: the first update waits
    for the sample in flight (a drain); of the two versions announced meanwhile, the older is
    answered superseded at once, and when the drain ends (the sample is aborted here, so the
    test decides when) the server loads the first and then jumps straight to the newest."""
    write_config(exp, groups_per_step=2, max_staleness=1, update_timeout_s=120, interruptible="false")
    address = controller_proc().start()
    keys = load_keys(exp.keys)
    client = SyncRequestClient(keys, address, timeout_s=120)
    try:
        register(client, gen_server)
        flipped_weights(tiny_model_dir, exp.weights / "v1")
        base = int(http(gen_server, "/model_info")["weight_version"])   # the module's server moves on
        reply: dict = {}
        sampler = start_long_sample(gen_server, reply, 500)
        acks: dict = {}

        def announce(version: int):
            c = SyncRequestClient(keys, address, timeout_s=120)   # one socket each, as the trainer's
            try:
                acks[version] = c.request(WeightsOnDisk(version=version, path=str(exp.weights / "v1")))
            finally:
                c.close()

        first, second, third = base + 1, base + 2, base + 3
        threads = {v: threading.Thread(target=_record_errors, args=(lambda v=v: announce(v), acks), daemon=True)
                   for v in (first, second, third)}
        def status() -> dict:
            return client.request(StatusRequest()).state

        def until(predicate) -> None:
            while not predicate():
                assert sampler.is_alive(), "the sample ended before the test could check the drain"
                time.sleep(0.02)

        threads[first].start()
        until(lambda: status()["syncing"])                         # v1 waits for the sample: a drain
        threads[second].start()
        until(lambda: status()["version_waiting"] == second)
        threads[third].start()
        threads[second].join(60)
        assert second in acks and acks[second].superseded_by == third, acks
        assert sampler.is_alive() and first not in acks, "the drain ended before the test could check it"
        http(gen_server, "/abort_request", {"abort_all": True}, key=ADMIN_KEY)   # the drain ends
        for v in (first, third):
            threads[v].join(120)
        assert acks[first].ok and acks[first].superseded_by == 0, acks
        assert acks[third].ok and acks[third].superseded_by == 0, acks
        assert http(gen_server, "/model_info")["weight_version"] == str(third)
        assert client.request(StatusRequest()).state["version"] == third
    finally:
        client.close()


def test_a_catch_up_with_interruptible_false_keeps_the_request_running(exp, gen_server, tiny_model_dir):
    """`interruptible: false` with the default `interrupt_mode: in_place`: a lagging server is
    still paused for its catch-up (it is out of rotation), in place, so the update must not ask
    for a flush, which the embedded server (like SGLang) refuses with requests held. Asking for
    one left the server paused and out of rotation, every later update refused the same way: a
    benchmark run hung so. Here the sample in flight finishes across the catch-up, its tokens split
    between the two versions, and the server is back in rotation at the controller's version.
    (An in-process controller, so the test can run the health check that finds the lag.)"""
    async def main():
        cfg = ControllerConfig(groups_per_step=2, max_staleness=0, health_interval_s=3600, http_timeout_s=30.0,
                               update_timeout_s=120.0, interruptible=False)
        c = Controller(cfg, exp)
        c.restore()
        reply: dict = {}
        sampler = None
        try:
            flipped_weights(tiny_model_dir, exp.weights / "v1")
            want = int(http(gen_server, "/model_info")["weight_version"]) + 1   # the module's server moves on
            c.register_server(RegisterServer(address=gen_server, api_key_ref="gen-api-key",
                                             admin_key_ref="gen-admin-api-key"))
            await settle(c)
            assert (await c.weights_published(WeightsOnDisk(version=want, path=str(exp.weights / "v1")))).ok
            # The server falls one version behind (as one restarted from its old weights would).
            http(gen_server, "/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                           "weight_version": str(want - 1)}, key=ADMIN_KEY)
            sampler = await asyncio.to_thread(start_long_sample, gen_server, reply, 480)
            server = c.registry.servers[gen_server]
            await c._check(server)                        # finds v{want - 1}: out of rotation, caught up
            await settle(c)
            assert server.servable and server.weight_version == want, server.reason
            await asyncio.to_thread(sampler.join, 120)
        finally:
            if sampler is not None and sampler.is_alive():   # leave the shared server serving
                http(gen_server, "/continue_generation", {}, key=ADMIN_KEY)
            if c._http is not None:
                await c._http.close()
        assert "error" not in reply, reply
        assert reply["meta_info"]["finish_reason"]["type"] == "length" and len(reply["output_ids"]) == 480
        spans = reply["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == [str(want - 1), str(want)], spans
        assert http(gen_server, "/model_info")["weight_version"] == str(want)

    asyncio.run(main())
