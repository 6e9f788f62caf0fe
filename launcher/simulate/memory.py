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
The torch backend holds float32 replicas (weights 4P, gradients 4P, AdamW 8P); its logits are
float32, or bf16 with `trainer.compute_dtype: bfloat16` (the same terms with 2 bytes); its layer's
activations are transformers' own, counted tensor by tensor (`_layer_activation_bytes`), plus,
under autocast, the bf16 copies of each layer's weights its backward pass keeps (2 bytes per
layer parameter); `trainer.recompute` keeps a layer's float32 input only (4h), and one whole layer.

Activation recompute (`trainer.recompute`, `trainer.megatron.recompute`: true, false or auto):
`choose_recompute` is the one decision, shown by `tandem plan` against `simulate.hardware` and
taken by the trainer at its start against its device's memory (trainer/recompute.py). Auto turns
it on when the rank's total without it exceeds the usable memory, and the table shows both totals.

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
    # A trainer rank: whether it recomputes activations, and its peak either way.
    recompute: RecomputeChoice | None = None

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


def _layer_activation_bytes(m: ModelShape, tp: int, s: int, torch_layer: bool = False, replica: int = 4) -> float:
    """Bytes autograd keeps per token for one decoder layer, `s` bytes per product (2: bf16).

    Megatron-core's layer (the module docstring's terms): s * (4h + (3h + 3kv + 4ffn) / t), every
    tensor in the parameters' dtype. An assumption read from the layer's code, not counted. Against
    the lent H200's peaks (benchmarks/results/gpu_speed.json, max_memory_allocated, bf16, no
    recompute), the whole Megatron estimate (`trainer_parts`) gives 55.1 GB for the 1.5B shape at
    8K tokens (measured 57.1: -3.5%), 24.0 GB for the 0.5B shape at 8K (23.9: +0.3%) and 54.8 GB at
    32K (62.0: -12%: where activations dominate, about 18% more per token and layer than this
    counts, likely the norms' float32 copies, as on the torch backend); the 1.5B shape at 32K was
    not measured. Read Megatron's figures at long packs as up to ~15% low.

    The torch backend's layer (transformers' Qwen2/Llama decoder layer on its float32 replica,
    `replica` = 4 bytes; products in s bytes: 2 under `trainer.compute_dtype: bfloat16`'s autocast,
    4 in float32) is counted, not assumed: tests/unit/trainer/test_recompute_torch_layers.py sums
    the tensors autograd saves (storage by storage) in the backend's own forward, for a layer whose
    sizes all differ, and gets these bytes exactly, in float32, under autocast and with bf16
    parameters. Per token: each RMSNorm keeps its float32 input, 1/rms and its normalised input
    before the weight (2 x (4h + 4 + replica * h)); the projections keep the norms' outputs, shared
    when products and replica agree (2 x replica * h), else one cast per projection (q, k, v; gate,
    up: 5 * s * h); attention keeps the rotated q, k and v, its output and o_proj's input
    (s * (3q + 2kv)) and a float32 log-sum-exp per head; the MLP its 4 ffn. For the 1.5B shape
    (h 1,536, kv 256, ffn 8,960, 12 heads): 121,912 bytes under autocast (what a run trains with),
    200,760 in float32, 106,552 with bf16 parameters (replica = 2, no autocast), counted so too.
    Assumed: the attention kernel keeps what the CPU's SDPA keeps (q, k, v, output, log-sum-exp:
    flash and memory-efficient attention on a GPU keep the same tensors).

    The one measured point of the question "does a 32K pack of the 1.5B model fit": the torch
    case of gpu_speed.json at a 32K pack without recompute (bf16 parameters and AdamW: replica =
    s = 2), peak 113.1 GB. This estimate of it: 8P = 12.4 GB of weights, gradients and bf16 AdamW,
    97.8 GB of activations (106,552 bytes x 28 layers x 32,768 tokens) and 5.6 GB of logits:
    115.7 GB, 2.3% above the measurement (Megatron's formula for the same layer, 94,720 bytes,
    would give 104.9 GB, 7.3% under). The other torch rows: 1.5B at 8K 42.4 GB (39.4 measured:
    +7.6%), 0.5B at 32K 55.3 (53.1: +4.2%) and at 8K 20.4 (18.0: +13%); above at every point,
    the safe side for a decision. A mixture-of-experts layer counts Megatron's expert terms, and
    Qwen3's q/k norms are left out: neither was counted."""
    kv = m.kv_heads * m.head_dim
    mlp = (m.experts_per_token * (4 * m.moe_intermediate + 2 * m.hidden) if m.experts
           else 4 * m.intermediate / tp)
    if not torch_layer:
        return s * (4 * m.hidden + (3 * m.hidden + 3 * kv) / tp + mlp)
    h, q = m.hidden, m.heads * m.head_dim
    norms = 2 * (4 * h + 4 + replica * h)
    inputs = 2 * replica * h if s == replica else 5 * s * h
    attention = s * (3 * q + 2 * kv) + 4 * m.heads
    return norms + inputs + attention + s * mlp


def alive_micro_batches(cfg, dp: int) -> int:
    """GPipe: the micro-batches of one minibatch on one DP rank, all alive until their backward."""
    sim, r, t = cfg.simulate, cfg.rollout, cfg.trainer
    mean_len = sim.prompt_tokens + min(sim.output_median, r.max_new_tokens)
    tokens = t.groups_per_step / t.ppo_n_minibatches * r.n_samples * mean_len / dp
    return max(1, math.ceil(tokens / t.max_tokens_per_mb))


def recompute_setting(t) -> tuple[bool | str, str]:
    """The recompute setting of the backend `t` (a TrainerConfig) runs, and its key."""
    if t.backend == "megatron":
        return t.megatron.recompute, "trainer.megatron.recompute"
    return t.recompute, "trainer.recompute"


def trainer_parts(t, m: ModelShape, train_dp: int, recompute: bool, alive: int = 1) -> dict[str, float]:
    """One trainer rank's bytes by part (the module docstring's terms) for the TrainerConfig `t`,
    with or without activation recompute; `alive`: the micro-batches a pipeline keeps at once."""
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
    per_layer = _layer_activation_bytes(m, tp, a, torch_layer=not megatron)
    # A recomputed layer keeps its input, the residual stream: float32 on the torch backend's replica.
    kept = (s if megatron else 4) * m.hidden
    # Autocast's bf16 copies of a layer's weight matrices, kept for its backward pass (torch
    # backend, bf16 products; the norms' weights and the biases are not kept as copies).
    vectors = 2 * m.hidden + ((m.heads + 2 * m.kv_heads) * m.head_dim if m.qkv_bias else 0) + \
        (2 * m.head_dim if m.qk_norm else 0)
    copies = 2 * (m.layer_params - vectors) if not megatron and a < 4 else 0
    chunked = t.logprob_chunk > 0
    chunk = min(n, t.logprob_chunk) if chunked else n
    act = n * (layers * kept + per_layer) + copies if recompute else layers * (n * per_layer + copies)
    v = m.vocab / tp   # each rank's share of the vocabulary (the padding rows are cut off)
    logits = chunk * v * (2 * a + LOGSOFTMAX_BYTES) + (HEAD_GRAD_COPIES * s * v * m.hidden if chunked else 0)
    if pp > 1:
        earlier = alive - 1
        act += earlier * n * layers * (kept if recompute else per_layer)
        # what an earlier micro-batch's graph keeps: its hidden states (the chunks' checkpointed
        # inputs), or its float32 log-softmax when not chunked
        logits += earlier * n * (a * m.hidden if chunked else 4 * v)
    parts["activations"], parts["logits"] = act, logits
    return parts


@dataclass(frozen=True)
class RecomputeChoice:
    """Whether a trainer rank recomputes activations, and why: `trainer.recompute` (torch backend)
    or `trainer.megatron.recompute` is true, false or auto; auto turns it on when the rank's
    predicted peak without it (`trainer_parts`, what `tandem plan` prints) exceeds the usable
    memory, `capacity` less `RESERVED_FRACTION`. None for a figure not known (a model without a
    shape) or memory that is not finite (the CPU)."""
    key: str
    setting: bool | str
    on: bool
    without: float | None
    with_: float | None
    capacity: float | None
    source: str

    @property
    def usable(self) -> float | None:
        return None if self.capacity is None else self.capacity * (1 - RESERVED_FRACTION)

    @property
    def reason(self) -> str:
        state = "on" if self.on else "off"
        head = f"{self.key}: {str(self.setting).lower()}" + (f" -> {state}" if self.setting == "auto" else "")
        if self.without is None:
            return f"{head} (no model shape to predict its memory with)"
        figures = f"{self.without / GB:.1f} GB predicted without recompute, {self.with_ / GB:.1f} GB with"
        if self.capacity is None:
            return f"{head}: {figures}; no finite device memory ({self.source})"
        cmp = ">" if self.without > self.usable else "<="
        return (f"{head}: {figures}; without {cmp} {self.usable / GB:.1f} GB usable of {self.capacity / GB:.1f} GB "
                f"({self.source})")

    def record(self) -> dict:
        """The fields of the trainer's start record (bytes)."""
        return {"key": self.key, "setting": self.setting, "on": self.on, "without_bytes": self.without,
                "with_bytes": self.with_, "capacity_bytes": self.capacity, "usable_bytes": self.usable,
                "source": self.source, "reason": self.reason}


def choose_recompute(t, m: ModelShape, train_dp: int, capacity: float | None, source: str,
                     alive: int = 1) -> RecomputeChoice:
    """The decision `tandem plan` shows and the trainer takes at its start (trainer/recompute.py):
    true and false stand; auto is on when the peak without recompute exceeds the usable memory,
    and off when it fits or when `capacity` is None (nothing finite: the CPU)."""
    setting, key = recompute_setting(t)
    without, with_ = (sum(trainer_parts(t, m, train_dp, r, alive).values()) for r in (False, True))
    on = setting is True or (setting == "auto" and capacity is not None
                             and without > capacity * (1 - RESERVED_FRACTION))
    return RecomputeChoice(key, setting, on, without, with_, capacity, source)


def trainer_memory(cfg, m: ModelShape, gpu: GPU, train_dp: int) -> RoleMemory:
    t = cfg.trainer
    megatron = t.backend == "megatron"
    tp, pp, ep = (t.tensor_parallel, t.pipeline_parallel, t.expert_parallel) if megatron else (1, 1, 1)
    alive = alive_micro_batches(cfg, train_dp) if pp > 1 else 1
    choice = choose_recompute(t, m, train_dp, gpu.memory_bytes, f"simulate.hardware={cfg.simulate.hardware}",
                              alive)
    parts = trainer_parts(t, m, train_dp, choice.on, alive)
    notes = []
    if pp > 1:
        notes.append(f"pipeline_parallel={pp}: {alive} micro-batches of a minibatch alive at once "
                     f"(GPipe), from simulate.prompt_tokens + simulate.output_median")
    where = f"TP {tp} x PP {pp}, DP {train_dp}" + (f", EP {ep}" if ep > 1 else "") if megatron else \
        f"torch backend, float32 replica, {t.compute_dtype} products"
    unset = [k for k, on in ((f"{choice.key}: true", choice.on),
                             ("trainer.compute_dtype: bfloat16", megatron or t.compute_dtype == "bfloat16"),
                             ("trainer.logprob_chunk: 1024", t.logprob_chunk)) if not on]
    advice = (f"set {' and '.join(unset)}, " if unset else "") + \
        ("lower trainer.pipeline_parallel (this schedule keeps a minibatch's micro-batches), " if pp > 1 else "") + \
        ("raise trainer.expert_parallel, " if megatron and m.experts else "") + \
        ("raise trainer.tensor_parallel, " if megatron else "use trainer.backend: megatron, ") + \
        "or lower trainer.max_tokens_per_mb (and rollout.max_new_tokens)"
    return RoleMemory(f"trainer rank ({where})", parts, gpu.memory_bytes, notes, advice=advice, recompute=choice)


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


def _recompute_cell(choice: RecomputeChoice | None) -> str:
    if choice is None:
        return "-"
    return ("on" if choice.on else "off") + (" (auto)" if choice.setting == "auto" else "")


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
    if any(r.recompute for r in est.roles):   # the trainer's choice, and its peak either way
        table.add_row("recompute", *(_recompute_cell(r.recompute) for r in est.roles))
        for label, attr in (("  total without", "without"), ("  total with", "with_")):
            table.add_row(label, *(f"{getattr(r.recompute, attr) / GB:.1f}" if r.recompute else "-"
                                   for r in est.roles))
    console.print(table)
    for r in est.roles:
        console.print(f"note: {r.role}")
        for note in r.notes:
            console.print(f"note: {note}")
        if r.recompute:
            console.print(f"note: {r.recompute.reason}")
    console.print(f"note: GB = 10^9 bytes; {RESERVED_FRACTION:.0%} of each GPU is left for the CUDA context, "
                  f"NCCL and fragmentation (docs/plan.md)")
