"""Shared test material for the Megatron tests (imported by the tests and by mp_worker.py).

A tiny Qwen2 built with transformers (vocab 61, deliberately not a multiple of anything, so
vocabulary padding is exercised), fixed packed micro-batches and a simple linear loss.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tandem.trainer.backend import PackedBatch, TokenOutputs
from tandem.trainer.batch import MinibatchPlan
from tandem.trainer.config import OptimConfig, TrainerConfig
from tandem.trainer.loss import PPOSettings

VOCAB = 61


def make_model_dir(out: Path, *, tied: bool = True, seed: int = 0) -> Path:
    """A HF directory with non-trivial random weights (biases and norms too)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tied, rms_norm_eps=1e-6, rope_theta=10000.0)
    return save_random(Qwen2ForCausalLM(cfg), out, seed)


def save_random(model, out: Path, seed: int = 0) -> Path:
    """`model` with non-trivial random weights (norms around 1, the rest ~0.15), saved as a HF
    directory (safetensors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)


def one_sequence(mb: PackedBatch, s: int) -> PackedBatch:
    """Sequence `s` of a packed micro-batch, alone."""
    a, b = int(mb.cu_seqlens[s]), int(mb.cu_seqlens[s + 1])
    return PackedBatch(mb.input_ids[a:b], torch.arange(b - a), torch.tensor([0, b - a], dtype=torch.int32))


def assert_logits_match(backend, hf, mb) -> list:
    """The backend's logits of each sequence of `mb` equal transformers' (float32, on the
    backend's device, compared on the CPU); returns transformers' logits per sequence."""
    refs = []
    for s in range(mb.n_seqs):
        one = one_sequence(mb, s)
        with torch.no_grad():
            ref = hf(input_ids=one.input_ids[None].to(backend.device)).logits[0].cpu()
            got = backend._logits(one).cpu()
        assert got.shape == ref.shape   # padded vocabulary rows are cut off
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
        refs.append(ref)
    return refs


def trainer_cfg(tp: int = 1, pp: int = 1, params_dtype: str = "bfloat16") -> TrainerConfig:
    """`params_dtype` matters on GPUs only (the CPU path is always float32)."""
    from tandem.trainer.megatron.config import MegatronConfig
    return TrainerConfig(backend="megatron", tensor_parallel=tp, pipeline_parallel=pp,
                         optim=OptimConfig(lr=1e-2, grad_clip=1.0, warmup_steps=2),
                         megatron=MegatronConfig(params_dtype=params_dtype))


def packed(seqs: list[torch.Tensor], seed: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    n = int(cu[-1])
    mask = torch.ones(n, dtype=torch.bool)
    mask[cu[:-1].long()] = False  # the first token of a sequence has no prediction
    return PackedBatch(input_ids=torch.cat(seqs), position_ids=pos, cu_seqlens=cu,
                       fields={"adv": torch.randn(n, generator=gen), "loss_mask": mask})


def micro_batches(seed: int = 0) -> list[PackedBatch]:
    """Two micro-batches of 3 sequences of lengths 3..14."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for m in range(2):
        seqs = [torch.randint(0, VOCAB, (int(torch.randint(3, 15, (1,), generator=gen)),), generator=gen)
                for _ in range(3)]
        out.append(packed(seqs, seed * 10 + m))
    return out


# The training loop's loss (trainer/objective_step.make_loss_fn) with sequence-level weights, a dual
# clip, a KL penalty and the mismatch sums: every statistic it has.
PPO_SETTINGS = PPOSettings(0.2, True, 2.0, behav_weight="truncate", behav_weight_level="seq-mean", dual_clip_c=3.0,
                           kl_coef=0.05, loss_agg="seq-mean-token-mean")


def ppo_minibatch(n: int = 3) -> MinibatchPlan:
    """`n` micro-batches with the fields PPO_SETTINGS's loss reads (behaviour, proximal and
    reference log-probs, advantages, versions 1..3)."""
    mbs = []
    for seed in range(n):
        mb = micro_batches(seed)[0]
        k, gen = mb.n_tokens, torch.Generator().manual_seed(seed)
        behav = -3 * torch.rand(k, generator=gen)
        fields = {"behav_logp": behav, "prox_logp": behav + 0.1 * torch.randn(k, generator=gen),
                  "ref_logp": behav - 0.05, "advantages": torch.randn(k, generator=gen),
                  "loss_mask": mb.fields["loss_mask"], "versions": torch.randint(1, 4, (k,), generator=gen)}
        mbs.append(PackedBatch(mb.input_ids, mb.position_ids, mb.cu_seqlens, fields))
    return MinibatchPlan(mbs, int(n_valid(mbs)), sum(mb.n_seqs for mb in mbs))


def n_valid(mbs: list[PackedBatch]) -> float:
    return float(sum(int(mb.fields["loss_mask"].sum()) for mb in mbs))


def make_loss_fn(total_valid: float, before_backward=None):
    """loss = -sum(adv * logp over valid tokens) / total_valid (a policy-gradient surrogate)."""
    def loss_fn(mb: PackedBatch, out: TokenOutputs):
        if before_backward is not None:
            before_backward()
        mask = mb.fields["loss_mask"]
        loss = -(mb.fields["adv"] * out.logp * mask).sum() / total_valid
        return loss, {"loss": float(loss.detach()), "valid": float(mask.sum())}
    return loss_fn


def logps(backend, mbs: list[PackedBatch]) -> torch.Tensor:
    return torch.cat([backend.forward_logprobs(mb, 1.0).logp for mb in mbs])


def in_process_backend(model_dir: Path, params_dtype: str = "float32", cfg: TrainerConfig | None = None):
    """Yields the in-process TP=1 backend, then closes it (Megatron's process-group state is
    global: one per process, torn down only if this created it).

    float32 parameters by default, on a GPU too: the unit tests check exact properties
    (conversion, packing, export) to float32 tolerances; bf16 is the GPU tier's, with tolerances
    derived for it. `cfg`: another trainer config (its own layout: one rank)."""
    import torch.distributed as dist

    from tandem.trainer.megatron.backend import MegatronBackend

    created_group = not dist.is_initialized()
    be = MegatronBackend(cfg or trainer_cfg(tp=1, params_dtype=params_dtype), model_dir, seed=0)
    try:
        yield be
    finally:   # also when the generator is closed rather than run to its end
        be.close()
        if created_group and dist.is_initialized():
            dist.destroy_process_group()
