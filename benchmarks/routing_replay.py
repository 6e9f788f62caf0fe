"""Rollout routing replay (issue 65): how close the trainer's log-probs of sampled tokens come to
the sampler's, with `trainer.routing_replay` off and on, side by side in one run.

A tiny random Qwen3-MoE (8 experts, top 2, 4 layers) generates on the embedded server's engine
(temperature 1, `return_routed_experts`), so the samples, their behaviour log-probs and their
routed experts are the generation path's own; the trainer (torch backend, float32) recomputes the
log-probs of the output tokens from the same weights, once routing by itself and once replaying
the recorded experts. Two ways the sampler differs from the trainer, as a GPU sampler does:

- `bf16 sampler`: the sampler runs the model in bfloat16 (SGLang serves bf16; the trainer's
  reference here is float32), so near-tied router logits flip some tokens to other experts;
- `perturbed router`: the sampler's router weights carry small noise (1% of their scale), a
  stand-in for other kernels' rounding that moves more tokens.

Figures: `mismatch_k3` (docs/algorithms.md: the mean of rho - 1 - log rho over output tokens,
rho = exp(logp_trainer - logp_sampler)), the largest |log rho|, and `moe_router_agreement` (the
fraction of recorded token-layer top-k sets the trainer's own routers chose). Replay cannot undo
the difference of the experts' weights and the rest of the network, only which experts a token
went to; the ratio off / on is what it buys.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import math
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.common import cli, print_table, write_results

EXPERTS, TOPK, LAYERS = 8, 2, 4


def _model_dir(out: Path, seed: int = 0) -> Path:
    import torch
    import transformers as tf
    cfg = tf.Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
                            max_position_embeddings=256, tie_word_embeddings=False)
    model = tf.Qwen3MoeForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model.save_pretrained(out)
    return out


def _sampler(model_dir: Path, case: str):
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.trainer.routing_replay import routers
    dtype = torch.bfloat16 if case == "bf16 sampler" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if case == "perturbed router":
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for r in routers(model):
                r.weight.add_(0.01 * torch.randn(r.weight.shape, generator=gen))
    return model


def _generate(model, prompts: list[list[int]], n: int, new_tokens: int) -> list[dict]:
    """The embedded server's engine: n samples of each prompt, with log-probs and routed experts."""
    import base64

    from tandem.rollout.server.engine import Engine, Request
    from tandem.rollout.server.sampling import SamplingParams

    tok = SimpleNamespace(eos_token_id=None, decode=lambda ids, **kw: "")
    done, finished = [], threading.Event()
    reqs = [Request(prompt_ids=list(p), params=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
                    on_done=None, return_logprob=True, return_routed_experts=True) for p in prompts for _ in range(n)]

    def on_done(reply):
        done.append(reply)
        if len(done) == len(reqs):
            finished.set()
    for r in reqs:
        r.on_done = on_done
    engine = Engine(model, tok, model_path="bench", seed=3, max_running=len(reqs))
    try:
        engine.submit(reqs).result(timeout=600)
        finished.wait(timeout=1800)
    finally:
        engine.stop()
    by_id = {d["meta_info"]["id"]: d for d in done}
    out = []
    for r in reqs:
        meta = by_id[r.rid]["meta_info"]
        routed = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4").reshape(-1, LAYERS, TOPK)
        out.append({"prompt": r.prompt_ids, "output": by_id[r.rid]["output_ids"], "routed": routed,
                    "logp": [lp for lp, _, _ in meta["output_token_logprobs"]]})
    return out


def _micro_batch(samples: list[dict]):
    from tandem.services.protocol import Trajectory
    from tandem.services.protocol.trajectory import compact_experts
    from tandem.trainer.batch import StepBatch, sequence_tensors
    from tandem.trainer.microbatch import pack

    trajs = [Trajectory(group_id="g", sample_idx=i, group_size=len(samples),
                        prompt_ids=np.asarray(s["prompt"], np.int32), output_ids=np.asarray(s["output"], np.int32),
                        output_logprobs=np.asarray(s["logp"], np.float32),
                        output_versions=np.zeros(len(s["output"]), np.int32), admit_version=0, reward=0.0,
                        finish_reason="length", task="math", timings={}, routed_experts=compact_experts(s["routed"]))
             for i, s in enumerate(samples)]
    batch = StepBatch.from_groups([SimpleNamespace(group_id="g", admit_version=0, samples=trajs)])
    tensors = [sequence_tensors(batch, i, 0.0) for i in range(len(trajs))]
    names = tensors[0][1].keys()
    return pack([t[0] for t in tensors], {k: [t[1][k] for t in tensors] for k in names})


def _measure(model_dir: Path, mb, replay: bool) -> dict:
    import torch

    from tandem.trainer.config import TrainerConfig
    from tandem.trainer.torch_backend import TorchBackend

    be = TorchBackend(TrainerConfig(routing_replay=replay, temperature=1.0), model_dir, seed=0)
    logp = be.forward_logprobs(mb, 1.0).logp
    mask = mb.fields["loss_mask"]
    d = (logp - mb.fields["behav_logp"])[mask].double()
    k3 = float((torch.exp(d) - 1 - d).mean())
    return {"mismatch_k3": k3, "max_abs_log_ratio": float(d.abs().max()),
            "moe_router_agreement": be.step_metrics().get("moe_router_agreement", math.nan)}


def main(quick: bool = False, prompts: int = 8, samples: int = 4, new_tokens: int = 32) -> dict:
    import torch
    torch.manual_seed(0)
    if quick:
        prompts, samples, new_tokens = 2, 2, 8
    rng = np.random.default_rng(0)
    prompt_ids = [rng.integers(3, 97, int(rng.integers(6, 16))).tolist() for _ in range(prompts)]
    rows, headline = [], {"prompts": prompts, "samples_per_prompt": samples, "new_tokens": new_tokens,
                          "model": f"Qwen3-MoE, {LAYERS} layers, {EXPERTS} experts, top {TOPK}", "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(Path(tmp) / "moe")
        for case in ("bf16 sampler", "perturbed router"):
            mb = _micro_batch(_generate(_sampler(model_dir, case), prompt_ids, samples, new_tokens))
            off, on = _measure(model_dir, mb, False), _measure(model_dir, mb, True)
            ratio = off["mismatch_k3"] / on["mismatch_k3"] if on["mismatch_k3"] > 0 else math.inf
            headline["cases"][case] = {"off": off, "on": on, "k3_off_over_on": ratio}
            rows.append([case, off["mismatch_k3"], on["mismatch_k3"], round(ratio, 2), off["max_abs_log_ratio"],
                         on["max_abs_log_ratio"], round(off["moe_router_agreement"], 4)])
    print_table(f"trainer (float32) vs sampler log-probs of {prompts * samples} samples x {new_tokens} tokens",
                ["sampler", "k3 replay off", "k3 replay on", "off / on", "max |log rho| off",
                 "max |log rho| on", "router agreement"], rows)
    if not quick:
        write_results("routing_replay", headline)
    return headline


if __name__ == "__main__":
    cli(main)
