"""How long things take: decode steps, prefills, training steps and weight syncs.

The simulator asks only these questions, through the `Costs` interface, so the physical model
(roofline from datasheet numbers and model shapes) and a model fitted to a real run's metrics
(`calibrate.py`) are interchangeable. A decode step of a server running `n` sequences holding
`C` tokens of context costs `decode_fixed[n] + decode_per_ctx * C` seconds: reading the weights
(or, for big batches, multiplying by them) does not depend on context length, reading the KV
cache grows with it. Affine in C is what lets the engine jump from one event to the next in
closed form instead of stepping token by token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.launcher.config import ConfigError
from tandem.launcher.simulate.hardware import GPU, ModelShape
from tandem.trainer.weights import transfer_path


@dataclass
class Costs:
    """The per-operation times the engine uses (seconds). Subclasses fill them in."""
    # decode_fixed[n]: context-independent seconds of one decode step at batch n (index 0 unused).
    decode_fixed: list[float]
    # Seconds per step per token of context held in the KV cache.
    decode_per_ctx: float
    # Tokens of KV cache one server holds, and its concurrency cap.
    kv_capacity: float
    max_running: int
    # Trainer: seconds = train_fixed + train_per_token * tokens + train_per_sq * sum(len^2).
    train_fixed: float
    train_per_token: float
    train_per_sq: float
    # Prefill: seconds = prefill_per_token * tokens + prefill_per_sq * len^2 (per sequence).
    prefill_per_token: float
    prefill_per_sq: float
    # Weight sync: the trainer is busy publish_s; each server is paused load_s.
    publish_s: float
    load_s: float
    # Fixed seconds of one prefill call (a forward pass's launch and framework overhead).
    prefill_per_request: float = 0.0
    # Seconds the trainer spends saving one checkpoint.
    checkpoint_s: float = 0.0
    # Server seconds per request outside the forward passes (receiving, submitting, answering;
    # measured on the embedded server, where it shares the GIL; SGLang does it in other processes).
    request_s: float = 0.0
    # The decode cost's context is the padded KV entries (rows x the longest row) of a left-padded
    # batch (the embedded server), not the tokens held (a paged server: SGLang, the roofline).
    decode_padded: bool = False
    # Seconds of one more forward pass in a decode step (the embedded server's long rows apart).
    decode_pass_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def train_step_s(self, tokens: float, sum_sq: float) -> float:
        return self.train_fixed + self.train_per_token * tokens + self.train_per_sq * sum_sq

    def prefill_s(self, tokens: float) -> float:
        """One prefill call of a sequence of `tokens` tokens."""
        return self.prefill_per_request + self.prefill_per_token * tokens + self.prefill_per_sq * tokens * tokens

    def resume_s(self, tokens: float) -> float:
        """A request sent again at a chunk boundary whose prompt + output so far (`tokens`) is a
        radix-cache hit: one prefill call of the one token not in the cache, attending over
        them. (The scheduling round it takes, one forward pass, is the engine's: shared by the
        requests that resume together.)"""
        return self.prefill_per_request + self.prefill_per_token + self.prefill_per_sq * (2 * tokens - 1)

    def gen_capacity_tokens_s(self, min_ctx: float) -> float:
        """Upper bound on one server's decode tokens/s: best batch size, shortest context."""
        best = 0.0
        for n in range(1, self.max_running + 1):
            if n * min_ctx > self.kv_capacity:
                break
            best = max(best, n / (self.decode_fixed[n] + self.decode_per_ctx * n * min_ctx))
        return best

    def train_capacity_tokens_s(self) -> float:
        """Upper bound on trained tokens/s (infinitely large, infinitely short-sequence batches)."""
        return 1.0 / self.train_per_token


@dataclass(frozen=True)
class Layout:
    """The GPUs a configuration gives each pool (from the allocation plan)."""
    gen_tp: int
    num_servers: int
    train_gpus: int
    train_tp: int
    train_pp: int
    gpus_per_node: int
    # PPO minibatches per step and the micro-batch token budget (pipeline bubble, grad syncs).
    ppo_minibatches: int = 1
    tokens_per_mb: int = 32768
    # trainer.expert_parallel: a MoE model's experts over this many data-parallel ranks.
    train_ep: int = 1

    @property
    def gen_nodes(self) -> int:
        """Nodes the generation servers occupy (the plan packs them, a TP group inside one node)."""
        return max(1, math.ceil(self.num_servers * self.gen_tp / self.gpus_per_node))


def physical_costs(gpu: GPU, model: ModelShape, layout: Layout, *, mem_fraction: float,
                   max_running: int, weight_sync: str, disk_gbps: float, colocated: bool = False,
                   batch_tokens_hint: float = 0.0, relay: bool = False) -> Costs:
    """A roofline cost model: every term is bytes / bandwidth or FLOPs / (rate x efficiency).
    `relay`: gen.weight_relay (priced only with a filesystem weight path)."""
    e = gpu.eff
    t = layout.gen_tp
    w = model.weight_bytes
    mm = model.matmul_params
    peak = gpu.bf16_flops
    # One decode step: read all weights once (memory-bound) or multiply n tokens by them
    # (compute-bound), whichever is slower; plus a TP all-reduce pair per layer. A MoE model's
    # step reads its dense part and only the experts its n tokens route to (hardware.py,
    # `experts_touched`; every expert at a large batch), and multiplies by the active parameters.
    expert_w = 2 * model.layers * model.expert_layer_params   # bf16 bytes of the routed experts
    dense_w = w - expert_w

    def mem_s(n: int) -> float:
        return (dense_w + expert_w * model.experts_touched(n)) / t / (gpu.memory_bw * e.decode_bw)
    flop_per_seq = 2 * mm / (t * peak * e.decode_mfu)
    tp_s = 0.0 if t == 1 else 2 * model.layers * e.allreduce_latency_s
    tp_per_seq = 0.0 if t == 1 else (2 * model.layers * 2 * (t - 1) / t * model.hidden * 2
                                     / (gpu.nvlink_bw * e.network))
    decode_fixed = [0.0] + [max(mem_s(n), n * flop_per_seq) + e.decode_step_overhead_s + tp_s + n * tp_per_seq
                            for n in range(1, max_running + 1)]
    decode_per_ctx = (model.kv_bytes_per_token / (t * gpu.memory_bw * e.decode_bw)
                      + model.attn_flops_per_ctx / (t * peak * e.decode_mfu))
    kv_bytes = gpu.memory_bytes * t * mem_fraction - w
    if kv_bytes <= 0:
        raise ConfigError(f"{model.name} ({w / 1e9:.1f} GB of weights) does not fit in a generation "
                          f"server of {t} {gpu.name} GPU(s) at gen.mem_fraction_static={mem_fraction}; "
                          f"raise gen.tp_size")
    kv_capacity = kv_bytes / model.kv_bytes_per_token
    # Training: forward+backward (6 FLOPs/param/token) plus the proximal log-prob forward (2).
    g = layout.train_gpus
    train_rate = g * peak * e.train_mfu
    train_per_token = 8 * mm / train_rate
    # Causal attention: attn_flops_per_ctx * len^2 / 2 per forward, x4 for fwd+bwd+prox forward.
    train_per_sq = 4 * model.attn_flops_per_ctx / 2 / train_rate
    dp = g // (layout.train_tp * layout.train_pp)
    # A MoE model's experts are split over EP more, and their gradients reduced over the d / EP ranks
    # holding the same experts; the rest over DP.
    ep = layout.train_ep
    dense_shard = dense_w / (layout.train_tp * layout.train_pp)
    expert_shard = expert_w / (layout.train_tp * layout.train_pp * ep)
    shard_bytes = dense_shard + expert_shard
    dp_spans_nodes = g > layout.gpus_per_node
    dp_bw = (gpu.node_network_bw / gpu.gpus_per_node if dp_spans_nodes else gpu.nvlink_bw) * e.network
    edp = max(1, dp // ep)
    grad_sync = ((0.0 if dp == 1 else 2 * (dp - 1) / dp * dense_shard / dp_bw)
                 + (0.0 if edp == 1 else 2 * (edp - 1) / edp * expert_shard / dp_bw))
    if model.experts and ep > 1:
        # Expert parallelism's all-to-alls: per layer each of a token's k copies of its hidden state
        # (bf16) goes to its expert's rank and back, in the training forward, in the backward (the
        # two transposed) and in the proximal forward: 6 transfers, the (ep - 1) / ep of them that
        # leave the rank, over NVLink within a node (EP across nodes: a GPU's share of the
        # network); the data-parallel ranks exchange their tokens at the same time.
        a2a_bw = (gpu.node_network_bw / gpu.gpus_per_node if ep > layout.gpus_per_node else gpu.nvlink_bw) * e.network
        a2a_bytes = 6 * model.experts_per_token * model.hidden * 2 * model.layers * (ep - 1) / ep
        train_per_token += a2a_bytes / (dp * a2a_bw)
    # Mixed-precision Adam touches ~16 bytes of state per parameter of the shard.
    optim = 8 * shard_bytes / gpu.memory_bw
    train_fixed = layout.ppo_minibatches * (grad_sync + optim)
    notes = []
    if layout.train_pp > 1:
        # Pipeline bubble (pp - 1) / m with m micro-batches per minibatch per DP rank; priced at
        # the configured batch size, as a multiplier on the compute terms.
        mbs = max(1.0, batch_tokens_hint / max(1, dp * layout.ppo_minibatches * layout.tokens_per_mb))
        bubble = 1 + (layout.train_pp - 1) / mbs
        train_per_token *= bubble
        train_per_sq *= bubble
        notes.append(f"pipeline bubble x{bubble:.2f} ({mbs:.0f} micro-batches per minibatch per DP rank)")
    prefill_rate = t * peak * e.prefill_mfu
    prefill_per_token = 2 * mm / prefill_rate
    prefill_per_sq = model.attn_flops_per_ctx / 2 / prefill_rate
    # A checkpoint: bf16 weights, fp32 master weights and two Adam moments (14 bytes/param),
    # written by all trainer ranks through the shared filesystem.
    checkpoint = 14 * model.params / (disk_gbps * 1e9)
    if colocated:
        # Same GPUs: the new weights are resharded over NVLink, not shipped between pools.
        publish = load = w / (gpu.nvlink_bw * e.network)
    elif transfer_path(weight_sync) == "network":
        per_gpu_net = gpu.node_network_bw / gpu.gpus_per_node * e.network
        publish = load = w / per_gpu_net
        if relay:
            notes.append(f"gen.weight_relay ignored: trainer.weight_sync={weight_sync} does not go "
                         f"through the shared filesystem")
    elif relay:   # "filesystem", passed down a chain of generation nodes (gen.weight_relay)
        # Trainer writes one copy; the first node reads it once (at the filesystem's aggregate
        # rate, or its own NIC's if slower) and each node streams it to the next while receiving
        # it, CHUNK_BYTES at a time, so the last node holds it (nodes - 1) chunks after the first.
        # A relay stream has a whole node's NIC, not a GPU's share as broadcast is priced: a node
        # receives one stream and sends one (full duplex), and nothing else of the weight path
        # crosses its network. A node's servers share its one copy, so the cost follows the nodes,
        # not the servers. Not priced: each server's load of that copy from /dev/shm (memory
        # bandwidth, far faster than either network term).
        # Imported here: it brings the generation client (aiohttp), which no other price needs.
        from tandem.rollout.client.relay import CHUNK_BYTES
        node_net = gpu.node_network_bw * e.network
        publish = w / (disk_gbps * 1e9)
        chain = (layout.gen_nodes - 1) * CHUNK_BYTES / node_net
        load = max(publish, w / node_net) + chain
        notes.append(f"weight relay: one shared-filesystem read per version down a chain of "
                     f"{layout.gen_nodes} node(s); the chain adds {1e3 * chain:.2f} ms")
    else:   # "filesystem"
        # Trainer writes one copy; every server reads one copy through the shared filesystem.
        publish = w / (disk_gbps * 1e9)
        load = w * layout.num_servers / (disk_gbps * 1e9)
    return Costs(decode_fixed=decode_fixed, decode_per_ctx=decode_per_ctx, kv_capacity=kv_capacity,
                 max_running=max_running, train_fixed=train_fixed, train_per_token=train_per_token,
                 train_per_sq=train_per_sq, prefill_per_token=prefill_per_token,
                 prefill_per_sq=prefill_per_sq, publish_s=publish, load_s=load, checkpoint_s=checkpoint,
                 notes=notes)


def describe(costs: Costs) -> dict:
    """A few human-scale numbers for the report table."""
    n1 = costs.decode_fixed[1]
    return {"decode step at batch 1 (ms)": 1e3 * n1,
            "decode step at max batch (ms)": 1e3 * costs.decode_fixed[-1],
            "KV capacity per server (tokens)": costs.kv_capacity if math.isfinite(costs.kv_capacity) else "inf",
            "trainer tokens/s ceiling": costs.train_capacity_tokens_s(),
            "weight publish (s)": costs.publish_s, "weight load per server (s)": costs.load_s,
            "checkpoint (s)": costs.checkpoint_s}
