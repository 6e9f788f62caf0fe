"""The embedded generation server on a CUDA device (`gen.device: cuda`): it reports the device,
generates with a seed reproducibly, reports the log-probs of a transformers forward of the same
tokens on the same device, and how fast it generates.

The server is a real `tandem gen serve --exp DIR` subprocess (the generation tests' ServerProcess),
one per dtype, with the tiny model (4 layers). Tolerances, server vs reference forward:
- float32: 1e-4 absolute, as the CPU test (test_gen_sampling_logprobs.py). TF32 is off for
  matmuls by default, so both sides are fp32 and differ only in the order of sums (cached
  decode steps vs one forward over the sequence): ~1e-6 on a model this small. A token or
  position out of place moves log-probs by O(1).
- bfloat16: both sides are bf16 on the same device, two roundings of one function: the bounds of
  tests/gpu/tolerances.py for bf16 vs fp32 (mean 2 s, largest 8 s, s = sqrt(43) 2^-8 rms(logits)),
  the mean doubled for two noisy sides, as that module says of packed vs per-sequence forwards.
On the CPU (TANDEM_GPU_TIER_REHEARSAL=1) the same checks run with the server on device cpu.
"""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tolerances as tol
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "generation"))
from gen_support import ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(600)
LAYERS = 4            # rollout.tiny_model's default
PROMPT = [1, 6, 57, 50, 58]
FP32_ATOL = 1e-4


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def server(request, tiny_model_dir, tmp_path_factory, on_gpu):
    """(dtype, the server, the device it must report) with gen.device and gen.dtype from --exp."""
    from tandem.launcher.config import load_config, save_resolved
    from tandem.services.protocol import ExpDir
    dtype = request.param
    device = "cuda" if on_gpu else "cpu"
    tmp = tmp_path_factory.mktemp(f"gpu-gen-{dtype}")
    exp = ExpDir(tmp / "exp")
    cfg = load_config(None, ["experiment.name=gpu-gen", f"experiment.model={tiny_model_dir}",
                             f"experiment.exp_dir={exp.root}", f"gen.dtype={dtype}", f"gen.device={device}"])
    save_resolved(cfg, exp.root)
    proc = ServerProcess(tiny_model_dir, tmp, extra=("--exp", str(exp.root), "--rank", "0"))
    yield dtype, proc, device
    proc.stop()
    log = exp.root / "logs" / "gen-0.log"
    if log.exists():
        print(log.read_text()[-2000:])


def _reference(model_dir, dtype: str, device: str, prompt: list[int], output: list[int], temperature: float):
    """log_softmax(logits / T) of each output token from one transformers forward, and rms(logits)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor([prompt + output], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = list(range(len(prompt) - 1, len(prompt) + len(output) - 1))
    got = logp[positions, output].cpu()
    return got, float(logits.double().pow(2).mean().sqrt())


def test_server_reports_its_device(server):
    dtype, proc, device = server
    status, info = proc.api.get("/server_info")
    assert status == 200, info
    # the device type, as SGLang's server_args.device ("cuda": the first GPU the process sees)
    assert info["device"] == device, info
    assert info["dtype"] == dtype


def test_seeded_generation_matches_a_transformers_forward(server, tiny_model_dir):
    dtype, proc, device = server
    params = dict(max_new_tokens=48, temperature=1.0, ignore_eos=True, sampling_seed=1234)
    a = proc.api.generate(PROMPT, **params)
    b = proc.api.generate(PROMPT, **params)
    assert len(a["output_ids"]) == 48 and all(isinstance(t, int) for t in a["output_ids"])
    assert a["output_ids"] == b["output_ids"]   # seeded: the same tokens again
    got = torch.tensor([lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]])
    want, rms = _reference(tiny_model_dir, dtype, "cuda:0" if device == "cuda" else "cpu",
                           PROMPT, a["output_ids"], 1.0)
    err = (got - want).abs()
    if dtype == "float32":
        assert float(err.max()) <= FP32_ATOL, (float(err.max()), got, want)
    else:
        mean_tol, max_tol = tol.logp_bounds(LAYERS, rms)
        assert float(err.mean()) <= 2 * mean_tol and float(err.max()) <= max_tol, (
            float(err.mean()), float(err.max()), mean_tol, max_tol)


def test_generation_throughput(server):
    """Tokens/s of 16 concurrent requests x 128 tokens (printed and, with
    TANDEM_GPU_TIER_RECORDS, recorded): a number to watch, not a bound."""
    dtype, proc, device = server
    n, new = 16, 128
    params = dict(max_new_tokens=new, temperature=1.0, ignore_eos=True)
    proc.api.generate(PROMPT, **{**params, "max_new_tokens": 8})   # warm-up (kernels, allocator)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda i: proc.api.generate(PROMPT + [10 + i], **params), range(n)))
    seconds = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    assert tokens == n * new
    record = {"device": device, "dtype": dtype, "requests": n, "new_tokens": new, "seconds": round(seconds, 3),
              "tokens_per_s": round(tokens / seconds, 1),
              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    print(f"embedded server generation: {json.dumps(record)}")
    keep = os.environ.get("TANDEM_GPU_TIER_RECORDS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"gen_throughput_{dtype}.json").write_text(json.dumps(record, indent=1) + "\n")


def test_a_lora_adapter_swapped_in_over_the_routes_serves_peft_merge(tiny_model_dir, tmp_path, on_gpu):
    """A LoRA run's serving on the GPU (`trainer.lora.sync: adapter`, docs/generation.md "LoRA
    adapters"): the server starts on version 0's zero adapter, the controller's swap (unload,
    load, version) brings a trained one in, merged on the device where the weights live; greedy
    tokens' log-probs match peft's own merge run by transformers on the same device, in bf16."""
    from safetensors.torch import load_file, save_file

    from tandem.launcher.config import load_config, save_resolved
    from tandem.services.protocol import ExpDir
    from tandem.trainer.config import LoraConfig
    from tandem.trainer.lora import lora_settings, write_initial_adapter
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = "cuda" if on_gpu else "cpu"
    v0 = write_initial_adapter(lora_settings(LoraConfig(rank=8)), tiny_model_dir, tmp_path / "v0")
    v1 = tmp_path / "v1"
    v1.mkdir()
    for f in v0.iterdir():
        (v1 / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(3)
    state = load_file(v1 / "adapter_model.safetensors")
    save_file({k: torch.randn(t.shape, generator=g) * 0.2 for k, t in state.items()}, v1 / "adapter_model.safetensors")
    exp = ExpDir(tmp_path / "exp")
    save_resolved(load_config(None, ["experiment.name=gpu-lora", f"experiment.model={tiny_model_dir}",
                                     f"experiment.exp_dir={exp.root}", "gen.dtype=bfloat16",
                                     f"gen.device={device}"]), exp.root)
    proc = ServerProcess(tiny_model_dir, tmp_path, extra=("--exp", str(exp.root), "--rank", "0",
                                                          "--lora-paths", f"policy={v0}"))
    try:
        for route, body in (("/pause_generation", {"mode": "abort"}), ("/unload_lora_adapter", {"lora_name": "policy"}),
                            ("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(v1)}),
                            ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
                            ("/continue_generation", {})):
            status, out = proc.admin.post(route, body)
            assert status == 200, (route, out)
        status, out = proc.api.post("/generate", {"input_ids": PROMPT, "lora_path": "policy", "return_logprob": True,
                                                  "sampling_params": {"temperature": 0.0, "max_new_tokens": 24,
                                                                      "ignore_eos": True}})
        assert status == 200 and out["meta_info"]["weight_version"] == "1", out
    finally:
        proc.stop()
    where = "cuda:0" if on_gpu else "cpu"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, v1).merge_and_unload().to(where).eval()
    tokens = out["output_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + tokens], device=where)).logits[0].float()
    logp = torch.log_softmax(logits, -1)[list(range(len(PROMPT) - 1, len(PROMPT) + len(tokens) - 1)), tokens].cpu()
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    mean_tol, max_tol = tol.logp_bounds(LAYERS, float(logits.double().pow(2).mean().sqrt()))
    err = (got - logp).abs()
    assert float(err.mean()) <= 2 * mean_tol and float(err.max()) <= max_tol, (
        float(err.mean()), float(err.max()), mean_tol, max_tol)
