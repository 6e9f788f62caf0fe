"""Per-GPU memory of a configuration, before anything runs: does it fit the GPUs it names?

`tandem plan` prints this for every GPU role and refuses a configuration whose trainer rank or
generation server does not fit (`simulate.hardware`: configs/hardware/*.yaml; the model shape as
the simulator finds it). It is an estimate of what this code allocates, term by term, so each
number can be checked against the code it describes:

Trainer rank (Megatron-core on GPUs, the worst pipeline stage; P = its parameters, t = TP, d = DP,
e = `trainer.expert_parallel`, s = bytes per parameter of `trainer.megatron.params_dtype`, N =
`trainer.max_tokens_per_mb`):
- weights: s * P (the embedding and output layer padded to `vocab_multiple * t` rows; a
  mixture-of-experts layer's routed experts over t * e: each rank holds E / e experts, each split
  over TP; its attention, norms and router over t only: every parameter counts, active or not);
- gradients: 4 * P (DDP's gradient buffer is float32: gpu.py, `grad_reduce_in_fp32`);
- optimizer: float32 main weights and two Adam moments, 12 * P (8 when the parameters are float32),
  over d with the distributed optimizer (the experts over d / e, the ranks holding the same ones);
- reference model: s * P more when `trainer.kl_coef > 0` (a frozen copy of the initial policy);
- activations: per token and layer, the tensors autograd keeps (bf16 with s = 2): both norms'
  inputs and outputs (4h, replicated over TP: no sequence parallelism), the fused q/k/v output,
  the rotated q and k, the attention output (3h + 3kv over t), the MLP's gate/up output, SiLU
  output and product (4 ffn over t) — s * (4h + (3h + 3kv + 4ffn) / t) bytes (a MoE layer: for
  each of the k experts a token goes to, the expert's 4 ffn and the dispatcher's permuted input and
  output, 2h; with t > 1 and no sequence parallelism every TP rank's tokens reach each expert's
  TP shard, so the k copies are not divided by t; tokens are counted as if evenly routed); with
  `trainer.megatron.recompute` a layer keeps only its input (s * h) and one layer at a time is
  whole during the backward pass. With pipeline parallelism every micro-batch of a minibatch stays
  alive until its backward (the GPipe schedule of pipeline.py), counted from the simulator's
  workload (`simulate.prompt_tokens`, `simulate.output_median`);
- logits (last stage), V = the vocabulary over t (Megatron's output layer is split along it and
  the log-softmax is vocabulary-parallel: trainer/megatron/logprob_head.py; the torch backend's
  whole): with `trainer.logprob_chunk` c > 0 the output layer runs on c tokens at a time from the
  hidden states and each chunk is recomputed in the backward pass (trainer/logprobs.py), so one
  chunk's logits and their gradient (2 * s * V per token) and the float32 log-softmax's copies
  (cast, scaled, normalised, the entropy's temporaries: 20 * V per token) are alive at once, plus
  `HEAD_GRAD_COPIES` weight-sized gradients (s * V * h each) that the backward adds chunk by
  chunk; with c = 0 the same per-token terms for the whole micro-batch. With pipeline parallelism
  each earlier micro-batch keeps its hidden states (s * h per token, chunked) or its float32
  log-softmax (4 * V) until its backward.
The torch backend holds float32 replicas (weights 4P, gradients 4P, AdamW 8P); its activations and
logits are float32, or bf16 with `trainer.compute_dtype: bfloat16` (the same terms with 2 bytes),
and `trainer.recompute` keeps a layer's input only, as Megatron's does.

Generation server GPU (SGLang): the weights over `gen.tp_size`, and the KV-cache pool SGLang
makes of the rest of `gen.mem_fraction_static`; it must hold at least one longest sequence
(`rollout.max_prompt_tokens` + the model turns' `rollout.max_new_tokens`), and the table says how
many it holds.

What is not counted: CUDA context, NCCL buffers, the allocator's fragmentation and TransformerEngine
workspaces — `RESERVED_FRACTION` of every GPU is kept for them (an assumption, not measured here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.launcher.config import ConfigError, longest_sequence
from tandem.launcher.simulate.hardware import GPU, ModelShape, load_gpu, load_model_shape

GB = 1e9
# Share of each GPU left for the CUDA context, NCCL, allocator fragmentation (an assumption).
RESERVED_FRACTION = 0.10
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Float32 bytes per logit of the log-softmax pass (copy, scaled copy, log-softmax, entropy's two;
# at temperature 1 no scaled copy is made, trainer/logprobs.py `scaled`: counted, on the safe side).
LOGSOFTMAX_BYTES = 20
# Output-layer weight gradients alive at the peak of a chunked backward (each chunk's share is
# added out of place): 3-4 measured by the live-bytes meter of
# tests/unit/megatron/test_megatron_logprob_head.py (on CPU); the upper end is counted.
HEAD_GRAD_COPIES = 4


@dataclass
class RoleMemory:
    """One GPU of one role: bytes by part, against the GPU's memory."""
    role: str
    parts: dict[str, float]
    capacity: float
    notes: list[str] = field(default_factory=list)
    # Generation: the KV-cache pool must hold this many bytes (one longest sequence).
    kv_needed: float = 0.0
    # The keys that would make it fit (named in a refusal).
    advice: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def usable(self) -> float:
        return self.capacity * (1 - RESERVED_FRACTION)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable and self.parts.get("KV cache", self.kv_needed) >= self.kv_needed


@dataclass
class MemoryEstimate:
    gpu: str
    model: str
    roles: list[RoleMemory] = field(default_factory=list)
    # Why nothing was estimated (no GPU roles, an unknown model shape), else None.
    skipped: str | None = None


def _padded(vocab: int, multiple: int, tp: int) -> int:
    step = multiple * tp
    return int(math.ceil(vocab / step) * step)


def _layer_activation_bytes(m: ModelShape, tp: int, s: int) -> float:
    """Bytes autograd keeps per token for one transformer layer (module docstring)."""
    kv = m.kv_heads * m.head_dim
    if m.experts:
        mlp = m.experts_per_token * (4 * m.moe_intermediate + 2 * m.hidden)
        return s * (4 * m.hidden + (3 * m.hidden + 3 * kv) / tp + mlp)
    return s * (4 * m.hidden + (3 * m.hidden + 3 * kv + 4 * m.intermediate) / tp)


def _alive_micro_batches(cfg, dp: int) -> int:
    """GPipe: the micro-batches of one minibatch on one DP rank, all alive until their backward."""
    sim, r, t = cfg.simulate, cfg.rollout, cfg.trainer
    mean_len = sim.prompt_tokens + min(sim.output_median, r.max_new_tokens)
    tokens = t.groups_per_step / t.ppo_n_minibatches * r.n_samples * mean_len / dp
    return max(1, math.ceil(tokens / t.max_tokens_per_mb))


def trainer_memory(cfg, m: ModelShape, gpu: GPU, train_dp: int) -> RoleMemory:
    t = cfg.trainer
    megatron = t.backend == "megatron"
    tp, pp = (t.tensor_parallel, t.pipeline_parallel) if megatron else (1, 1)
    mc = t.megatron
    s = DTYPE_BYTES[mc.params_dtype] if megatron else 4
    # bytes of an activation: the parameters' dtype on Megatron; on the torch backend float32, or
    # bf16 under trainer.compute_dtype: bfloat16 (autocast: float32 weights, bf16 products)
    a = s if megatron else DTYPE_BYTES[t.compute_dtype]
    vocab = _padded(m.vocab, mc.vocab_multiple, tp) if megatron else m.vocab
    ep = t.expert_parallel if megatron else 1
    layers = m.layers // pp
    experts = layers * m.expert_layer_params / (tp * ep)   # this rank's routed experts
    body = layers * (m.layer_params - m.expert_layer_params) / tp + experts
    emb = vocab * m.hidden / tp
    if pp == 1:
        params = body + emb * (1 if m.tied else 2) + m.hidden
    else:   # first stage: the embedding; last: the output layer (a copy when tied) and final norm
        params = body + emb + m.hidden
    notes = []
    parts = {"weights": s * params, "gradients": 4 * params}
    if megatron:
        shards = train_dp if mc.use_distributed_optimizer else 1
        expert_shards = max(1, shards // ep)   # the experts' optimizer: over the ranks holding them
        parts["optimizer"] = (12 if s < 4 else 8) * ((params - experts) / shards + experts / expert_shards)
    else:
        parts["optimizer"] = 8 * params
    if t.kl_coef > 0:
        parts["reference model"] = s * params
    n = t.max_tokens_per_mb
    per_layer = _layer_activation_bytes(m, tp, a)
    recompute = mc.recompute if megatron else t.recompute
    chunked = t.logprob_chunk > 0
    chunk = min(n, t.logprob_chunk) if chunked else n
    act = n * (layers * a * m.hidden + per_layer) if recompute else n * layers * per_layer
    v = m.vocab / tp   # each rank's share of the vocabulary (the padding rows are cut off)
    logits = chunk * v * (2 * a + LOGSOFTMAX_BYTES) + (HEAD_GRAD_COPIES * s * v * m.hidden if chunked else 0)
    if pp > 1:
        earlier = _alive_micro_batches(cfg, train_dp) - 1
        act += earlier * n * layers * (a * m.hidden if recompute else per_layer)
        # what an earlier micro-batch's graph keeps: its hidden states (the chunks' checkpointed
        # inputs), or its float32 log-softmax when not chunked
        logits += earlier * n * (a * m.hidden if chunked else 4 * v)
        notes.append(f"pipeline_parallel={pp}: {earlier + 1} micro-batches of a minibatch alive at once "
                     f"(GPipe), from simulate.prompt_tokens + simulate.output_median")
    parts["activations"], parts["logits"] = act, logits
    where = f"TP {tp} x PP {pp}, DP {train_dp}" + (f", EP {ep}" if ep > 1 else "") if megatron else \
        f"torch backend, float32 replica, {t.compute_dtype} products"
    unset = [k for k, on in (("trainer.megatron.recompute: true", mc.recompute or not megatron),
                             ("trainer.recompute: true", t.recompute or megatron),
                             ("trainer.compute_dtype: bfloat16", megatron or t.compute_dtype == "bfloat16"),
                             ("trainer.logprob_chunk: 1024", t.logprob_chunk)) if not on]
    advice = (f"set {' and '.join(unset)}, " if unset else "") + \
        ("lower trainer.pipeline_parallel (this schedule keeps a minibatch's micro-batches), " if pp > 1 else "") + \
        ("raise trainer.expert_parallel, " if megatron and m.experts else "") + \
        ("raise trainer.tensor_parallel, " if megatron else "use trainer.backend: megatron, ") + \
        "or lower trainer.max_tokens_per_mb (and rollout.max_new_tokens)"
    return RoleMemory(f"trainer rank ({where})", parts, gpu.memory_bytes, notes, advice=advice)


def generation_memory(cfg, m: ModelShape, gpu: GPU) -> RoleMemory:
    g = cfg.gen
    tp = g.tp_size
    weights = m.weight_bytes / tp
    kv_per_token = 2 * m.layers * max(1, m.kv_heads // tp) * m.head_dim * 2
    pool = g.mem_fraction_static * gpu.memory_bytes - weights
    longest = longest_sequence(cfg.rollout)
    role = RoleMemory(f"generation server GPU (TP {tp})", {"weights": weights, "KV cache": max(0.0, pool)},
                      gpu.memory_bytes, kv_needed=longest * kv_per_token,
                      advice="raise gen.tp_size or gen.mem_fraction_static, or lower rollout.max_new_tokens")
    if pool > 0:
        role.notes.append(f"KV cache: {pool / kv_per_token:,.0f} tokens = {pool / role.kv_needed:.1f} sequences "
                          f"of {longest:,} tokens (gen.mem_fraction_static={g.mem_fraction_static})")
    return role


def estimate(cfg, train_dp: int) -> MemoryEstimate:
    """Every GPU role of `cfg` (the plan's data-parallel size for the trainer)."""
    from tandem.launcher.plan import uses_gpus

    gpu = load_gpu(cfg.simulate.hardware)
    try:
        m = load_model_shape(cfg.simulate.model_size, cfg.experiment.model)
    except ConfigError as e:
        return MemoryEstimate(gpu.name, "?", skipped=f"no model shape ({e})")
    out = MemoryEstimate(gpu.name, m.name)
    if not uses_gpus(cfg):
        out.skipped = "no GPU roles (embedded servers and the torch trainer run on the CPUs)"
        return out
    out.roles.append(trainer_memory(cfg, m, gpu, train_dp))
    if cfg.gen.backend == "sglang":
        out.roles.append(generation_memory(cfg, m, gpu))
    return out


def refusal(est: MemoryEstimate) -> str | None:
    """The message naming every role that does not fit, with its numbers; None when all fit."""
    lines = []
    for r in est.roles:
        if r.fits:
            continue
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in r.parts.items())
        if r.total > r.usable:
            lines.append(f"{r.role} needs {r.total / GB:.1f} GB of a {est.gpu}'s {r.capacity / GB:.0f} GB "
                         f"({r.usable / GB:.0f} GB usable): {parts} GB")
        else:
            lines.append(f"{r.role}: the KV cache ({r.parts['KV cache'] / GB:.1f} GB) does not hold one "
                         f"longest sequence ({r.kv_needed / GB:.1f} GB)")
        lines[-1] += "; " + r.advice
    return "\n".join(lines) or None


PART_ORDER = ("weights", "gradients", "optimizer", "reference model", "activations", "logits", "KV cache")


def render(est: MemoryEstimate, console) -> None:
    """One column per GPU role, one row per part (GB), then the total against the usable memory."""
    from rich.table import Table

    if est.skipped:
        console.print(f"memory: not estimated: {est.skipped}")
        return
    table = Table(title=f"Memory per GPU (estimate, GB): {est.model} on {est.gpu}")
    table.add_column("part")
    for r in est.roles:
        table.add_column(r.role.split(" (")[0], justify="right")
    for part in PART_ORDER:
        if any(part in r.parts for r in est.roles):
            table.add_row(part, *(f"{r.parts[part] / GB:.1f}" if part in r.parts else "-" for r in est.roles))
    table.add_row("total", *(f"{r.total / GB:.1f}" for r in est.roles))
    table.add_row("usable", *(f"{r.usable / GB:.1f}" for r in est.roles))
    table.add_row("fits", *("yes" if r.fits else "NO" for r in est.roles))
    console.print(table)
    for r in est.roles:
        console.print(f"note: {r.role}")
        for note in r.notes:
            console.print(f"note: {note}")
    console.print(f"note: GB = 10^9 bytes; {RESERVED_FRACTION:.0%} of each GPU is left for the CUDA context, "
                  f"NCCL and fragmentation (docs/plan.md)")
