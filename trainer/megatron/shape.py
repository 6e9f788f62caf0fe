"""Which Hugging Face decoder families the Megatron backend trains, and their shape numbers.

Qwen2, Qwen3, Qwen3-MoE, Llama 3.x and Mistral are one architecture with switches: a pre-norm decoder with
RMSNorm, rotary embeddings, grouped-query attention and a gated SiLU MLP. What differs maps onto
a megatron-core 0.16.1 switch each:

- a bias on q/k/v (Qwen2 only): `TransformerConfig.add_qkv_bias`;
- RMSNorm on each query and key head before RoPE (Qwen3): `qk_layernorm=True`, the layer spec's
  `q_layernorm`/`k_layernorm` (the local and the TransformerEngine specs both build them);
- an explicit `head_dim` that is not hidden/heads (Qwen3, some Mistral): `kv_channels`;
- Qwen3-MoE (Qwen3's attention, a mixture-of-experts MLP in every layer): megatron-core's
  `MoELayer` (`num_moe_experts`, `moe_router_topk`, `moe_ffn_hidden_size`; moe.py). Qwen3-MoE's
  router takes the softmax over all experts, then the top k; with `norm_topk_prob` it renormalises
  those k, which is exactly a softmax over the k largest logits (`moe_router_pre_softmax=False`),
  without it the top k of the full softmax (`moe_router_pre_softmax=True`);
- Llama 3.1/3.2's "llama3" rope scaling: `GPTModel(rope_scaling=True, rope_scaling_factor=...)`.
  Megatron's `RotaryEmbedding._apply_scaling` takes only the factor; it hard-codes
  low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192 (Llama 3.1's),
  so a checkpoint with other values is refused rather than trained with different rotations.

`decoder_shape` reads `config.json` and refuses, naming the field, every feature this mapping
does not carry (another family, another rope scaling, sliding-window attention, biases on other
projections, another activation): a silently different architecture would train a different model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _Family:
    qkv_bias: bool               # q/k/v projections carry a bias (and nothing else does)
    qk_norm: bool                # q_norm / k_norm: RMSNorm over each head's channels
    rope_types: tuple[str, ...]  # accepted rope_type values


FAMILIES: dict[str, _Family] = {
    "qwen2": _Family(qkv_bias=True, qk_norm=False, rope_types=("default",)),
    "qwen3": _Family(qkv_bias=False, qk_norm=True, rope_types=("default",)),
    "llama": _Family(qkv_bias=False, qk_norm=False, rope_types=("default", "llama3")),
    "mistral": _Family(qkv_bias=False, qk_norm=False, rope_types=("default",)),
    "qwen3_moe": _Family(qkv_bias=False, qk_norm=True, rope_types=("default",)),
}

# The "llama3" rope-scaling constants megatron-core 0.16.1 hard-codes in
# `RotaryEmbedding._apply_scaling` (only `factor` is a parameter).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class DecoderShape:
    """The architecture numbers of a supported HF decoder checkpoint that the conversion and the
    `TransformerConfig` need. The defaults past `tie_word_embeddings` are Qwen2's."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str = "qwen2"
    qkv_bias: bool = True
    qk_norm: bool = False
    # Llama 3.x "llama3" rope scaling factor; None: no rope scaling.
    rope_scaling_factor: float | None = None
    # Mixture of experts (Qwen3-MoE; 0 experts: a dense MLP): experts per layer, experts each
    # token goes to, each expert's intermediate size, and whether the k routing weights are
    # renormalised to sum to 1 (Qwen3-MoE's norm_topk_prob).
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _unsupported(where: str, what: str, why: str = "") -> ValueError:
    return ValueError(f"{where}: {what} is not supported by the Megatron backend" + (f" ({why})" if why else ""))


def decoder_shape(model_dir: str | Path) -> DecoderShape:
    """Read config.json of a HF directory; ValueError naming the field when unsupported."""
    from transformers import AutoConfig

    where = f"{model_dir}/config.json"
    c = AutoConfig.from_pretrained(model_dir)
    family = FAMILIES.get(c.model_type)
    if family is None:
        raise _unsupported(where, f"model_type {c.model_type!r}", f"supported: {', '.join(sorted(FAMILIES))}")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise _unsupported(where, f"hidden_act {c.hidden_act!r}", "expected 'silu'")
    for field in ("attention_bias", "mlp_bias"):   # a bias on o_proj / the MLP too
        if getattr(c, field, False):
            raise _unsupported(where, f"{field}=true", "biases on o_proj or the MLP have no place in the conversion")
    _check_full_attention(c, where)
    factor = _rope_scaling(c, family, where)
    rope = _rope_dict(c)
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    moe = _moe_fields(c, where) if c.model_type == "qwen3_moe" else {}
    return DecoderShape(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=head_dim,
        intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(c.tie_word_embeddings), model_type=c.model_type,
        qkv_bias=family.qkv_bias, qk_norm=family.qk_norm, rope_scaling_factor=factor, **moe)


def _moe_fields(c, where: str) -> dict:
    """Qwen3-MoE's expert settings; refuses a checkpoint with dense layers among the MoE ones (every
    layer of the released Qwen3-MoE models is MoE; a mixed layout would need a second layer spec)."""
    if getattr(c, "mlp_only_layers", None):
        raise _unsupported(where, f"mlp_only_layers={list(c.mlp_only_layers)}", "every layer must be MoE")
    if getattr(c, "decoder_sparse_step", 1) != 1:
        raise _unsupported(where, f"decoder_sparse_step={c.decoder_sparse_step}", "every layer must be MoE")
    if not 0 < c.num_experts_per_tok <= c.num_experts:
        raise _unsupported(where, f"num_experts_per_tok={c.num_experts_per_tok}",
                           f"must be between 1 and num_experts={c.num_experts}")
    return {"num_experts": int(c.num_experts), "moe_topk": int(c.num_experts_per_tok),
            "moe_intermediate_size": int(c.moe_intermediate_size), "norm_topk_prob": bool(c.norm_topk_prob)}


def _rope_dict(c) -> dict:
    # transformers 5 keeps rope settings in `rope_parameters` (older: rope_theta/rope_scaling).
    return dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})


def _rope_field(where: str) -> str:
    """The name config.json itself uses for the rope settings (for the error message)."""
    try:
        raw = json.loads(Path(where).read_text())
    except (OSError, json.JSONDecodeError):
        return "rope_scaling"
    return "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"


def _rope_scaling(c, family: _Family, where: str) -> float | None:
    """The llama3 scaling factor, None without scaling; refuses what megatron-core cannot do."""
    rope = _rope_dict(c)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    field = _rope_field(where)
    if rope_type not in family.rope_types:
        raise _unsupported(where, f"{field}.rope_type {rope_type!r} for model_type {c.model_type!r}",
                           f"accepted: {', '.join(family.rope_types)}")
    partial = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise _unsupported(where, f"partial_rotary_factor={partial}")
    if rope_type != "llama3":
        return None
    for key, megatron_value in MEGATRON_LLAMA3_ROPE.items():
        value = rope.get(key)
        if value is None or float(value) != float(megatron_value):
            raise _unsupported(where, f"{field}.{key}={value}", f"megatron-core's llama3 rope scaling "
                                                               f"hard-codes {megatron_value}, Llama 3.1's value")
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise _unsupported(where, f"{field}.factor={factor!r}", "a positive number is needed")
    return float(factor)


def _check_full_attention(c, where: str) -> None:
    """Megatron's causal attention here sees the whole context: refuse sliding windows that bite."""
    if getattr(c, "use_sliding_window", False):
        raise _unsupported(where, "use_sliding_window=true")
    window = getattr(c, "sliding_window", None)
    if c.model_type == "mistral" and window is not None and window < c.max_position_embeddings:
        raise _unsupported(where, f"sliding_window={window}",
                           f"smaller than max_position_embeddings={c.max_position_embeddings}: Megatron "
                           "attends over the whole context; null or >= max_position_embeddings is accepted")
    layer_types = getattr(c, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise _unsupported(where, f"layer_types {sorted(set(layer_types))}", "only full_attention")
