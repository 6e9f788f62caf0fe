"""The embedded server's LoRA adapter routes (rollout/server/lora_routes.py), as a real
`tandem gen serve --lora-paths policy=<version 0>` process driven over HTTP: the swap the
controller runs for `trainer.lora.sync: adapter` (services/controller/weights/adapter.py), the
refusals SGLang 0.5.23 gives, and the two behaviours of SGLang's registry that make the
controller swap only under an abort pause (an unload waits for the requests using the adapter;
a request naming an unloaded adapter reloads its old path).

The adapters are peft directories: version 0 from `trainer.lora.write_initial_adapter` (zeros),
and "trained" ones made from it with random B (and A) tensors; the reference is the merged
model peft computes (`merge_and_unload`) run by transformers."""
from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch
from gen_support import ServerProcess
from safetensors.torch import load_file, save_file

from tandem.trainer.config import LoraConfig
from tandem.trainer.lora import lora_settings, write_initial_adapter

pytest.importorskip("peft")
PROMPT = [5, 9, 14, 3, 27, 8]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


def _trained(v0, out, seed: int, rank: int | None = None):
    """An adapter like v0 with random A and B (a different policy); `rank` rewrites its rank."""
    shutil.copytree(v0, out)
    g = torch.Generator().manual_seed(seed)
    state = load_file(out / "adapter_model.safetensors")
    cfg = json.loads((out / "adapter_config.json").read_text())
    r = rank or cfg["r"]
    new = {}
    for k, t in state.items():
        shape = (r, t.shape[1]) if ".lora_A." in k else (t.shape[0], r)
        new[k] = torch.randn(shape, generator=g) * 0.2
    save_file(new, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "r": r}))
    return out


def _merged_logprobs(model_dir, adapter_dir, prompt, output) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter_dir).merge_and_unload()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    v0 = write_initial_adapter(lora_settings(LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])),
                               tiny_model_dir, root / "v0")
    return {"v0": v0, "v1": _trained(v0, root / "v1", 1), "v2": _trained(v0, root / "v2", 2),
            "wide": _trained(v0, root / "wide", 3, rank=8)}


@pytest.fixture
def server(tiny_model_dir, adapters, tmp_path):
    s = ServerProcess(tiny_model_dir, tmp_path, extra=("--lora-paths", f"policy={adapters['v0']}"))
    yield s
    s.stop()


def _gen(api, lora_path="policy", **params):
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, **params}, "return_logprob": True}
    if lora_path is not None:
        body["lora_path"] = lora_path
    return api.post("/generate", body)


def _swap(admin, path: str, version: int) -> None:
    """The controller's adapter update, route by route."""
    for route, body in (("/pause_generation", {"mode": "abort"}), ("/unload_lora_adapter", {"lora_name": "policy"}),
                        ("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(path)}),
                        ("/update_weight_version", {"new_version": str(version), "abort_all_requests": False}),
                        ("/continue_generation", {})):
        status, out = admin.post(route, body)
        assert status == 200, (route, out)


def test_requests_name_the_adapter_and_a_swap_serves_the_new_one(server, adapters, tiny_model_dir):
    status, out = _gen(server.api)
    assert status == 200, out
    tokens = out["output_ids"]
    got = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
    # version 0 is all zeros: the base model itself
    assert got == pytest.approx(_merged_logprobs(tiny_model_dir, adapters["v0"], PROMPT, tokens), abs=1e-4)
    assert out["meta_info"]["weight_version"] == "0"

    _swap(server.admin, adapters["v1"], 1)
    status, out = _gen(server.api)
    assert status == 200, out
    assert out["meta_info"]["weight_version"] == "1"
    want = _merged_logprobs(tiny_model_dir, adapters["v1"], PROMPT, out["output_ids"])
    assert [p[0] for p in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=1e-4)
    assert want != pytest.approx(_merged_logprobs(tiny_model_dir, adapters["v0"], PROMPT, out["output_ids"]),
                                 abs=1e-3), "the trained adapter must change the model for this test to mean much"

    _swap(server.admin, adapters["v2"], 2)       # v2 merges onto the base, not onto v1
    status, out = _gen(server.api)
    want = _merged_logprobs(tiny_model_dir, adapters["v2"], PROMPT, out["output_ids"])
    assert [p[0] for p in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=1e-4)
    status, info = server.api.get("/model_info")
    assert info["weight_version"] == "2"


def test_the_refusals_are_sglangs(server, adapters):
    admin = server.admin
    status, out = admin.post("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(adapters["v1"])})
    assert status == 400 and not out["success"] and "already loaded" in out["error_message"]
    assert out["loaded_adapters"] == {"policy": str(adapters["v0"])}
    status, out = admin.post("/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 400 and "LoRA with name nope does not exist" in out["error_message"]
    status, out = _gen(server.api, lora_path="nope")
    assert status == 400 and "never been loaded: nope" in json.dumps(out)
    # embedded differences: one adapter at a time, and no base model beside it
    status, out = admin.post("/load_lora_adapter", {"lora_name": "other", "lora_path": str(adapters["v1"])})
    assert status == 400 and "one LoRA adapter at a time" in out["error_message"]
    status, out = _gen(server.api, lora_path=None)
    assert status == 400 and "name the adapter in lora_path" in json.dumps(out)
    # an adapter directory is not a model
    status, out = admin.post("/update_weights_from_disk", {"model_path": str(adapters["v1"])})
    assert status == 400 and "load it with /load_lora_adapter" in out["message"]
    # a rank above the one the server was started with does not fit (SGLang's memory pool)
    assert admin.post("/unload_lora_adapter", {"lora_name": "policy"})[0] == 200
    status, out = admin.post("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(adapters["wide"])})
    assert status == 400 and "incompatible with the current LoRA memory pool" in out["error_message"]
    assert out["loaded_adapters"] == {}
    # nothing loaded now: the base model is served again
    assert _gen(server.api, lora_path=None)[0] == 200


def test_without_lora_the_routes_and_lora_path_are_refused(tiny_model_dir, tmp_path):
    s = ServerProcess(tiny_model_dir, tmp_path)
    try:
        status, out = s.admin.post("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(tmp_path)})
        assert status == 400 and "LoRA is not enabled" in out["error_message"]
        status, out = _gen(s.api)
        assert status == 400 and "LoRA is not enabled" in json.dumps(out)
    finally:
        s.stop()


def test_an_unpaused_unload_waits_for_requests_using_the_adapter_and_a_request_reloads_it(server, adapters):
    """Why the controller swaps only under an abort pause: without one, the unload returns only
    after the requests holding the adapter finish, and a request arriving meanwhile (or after)
    brings the *old* adapter back under the name, so the new one cannot be loaded."""
    done = {}

    def long_request():
        done["reply"] = _gen(server.api, max_new_tokens=200, ignore_eos=True)
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    while server.api.get("/v1/loads")[1]["loads"][0]["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.is_alive(), "the request finished before the unload could be tried"
    status, out = server.admin.post("/unload_lora_adapter", {"lora_name": "policy"})
    # The server's own count, not the client threads' clocks: the two replies leave the server
    # together, and which client thread reads its reply first is the OS scheduler's choice.
    running_after_unload = server.api.get("/v1/loads")[1]["loads"][0]["num_running_reqs"]
    t.join(60)
    assert status == 200 and out["loaded_adapters"] == {}, out
    assert running_after_unload == 0, "the unload returned while a request was still using the adapter"
    status, reply = done["reply"]
    assert status == 200 and reply["meta_info"]["finish_reason"]["type"] == "length", reply

    assert _gen(server.api)[0] == 200        # reloads v0 from its path, as SGLang's lora_ref_cache does
    status, out = server.admin.post("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(adapters["v1"])})
    assert status == 400 and "already loaded" in out["error_message"]
