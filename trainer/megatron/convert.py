"""Hugging Face decoder (Qwen2, Qwen3, Llama, Mistral) <-> Megatron-core weights: names, fused
layouts, vocabulary padding, TP shards.

Layouts (checked against megatron-core 0.16.1's `SelfAttention.get_query_key_value_tensors` and
`MLP`):

- `linear_qkv` fuses q, k and v *per query group*: for each of the `num_kv_heads` groups, that
  group's `heads/kv_heads` query heads, then its key head, then its value head (rows; the bias
  the same way, for the families that have one: Qwen2). A TP rank holds a contiguous slice of
  those rows, i.e. whole groups.
- `linear_fc1` is `[gate; up]`, but per TP rank: rank r holds `[gate_r; up_r]`, so a TP split
  chunks gate and up separately (and a merge undoes that).
- `linear_proj` (HF o_proj) and `linear_fc2` (down_proj) are row-parallel: split on columns.
- The word embedding and output layer are split on vocabulary rows, after padding the
  vocabulary with zero rows (the padding is stripped on export).
- Norms are replicated. The local layer spec keeps them as `input_layernorm` /
  `pre_mlp_layernorm`; the TransformerEngine spec fuses them into the next linear layer as
  `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` (`te_norms=True`).
- Qwen3's per-head `q_norm` / `k_norm` ([head_dim] weights shared by every head) are
  `self_attention.q_layernorm` / `k_layernorm` in both specs, replicated over TP ranks.

Qwen3-MoE's router and experts are convert_moe.py's (with their expert-parallel shards).

A model stage of a pipeline holds a contiguous range of layers; `offset` maps its local layer
indices to the global ones of the HF checkpoint.
"""
from __future__ import annotations

import re

import torch

from tandem.trainer.megatron import convert_moe
from tandem.trainer.megatron.shape import DecoderShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron name -> HF name of Qwen3's per-head query/key RMSNorm weights (within a layer).
_QK_NORMS = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
             "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}


def _qkv_kinds(shape: DecoderShape) -> tuple[str, ...]:
    """The fused q/k/v tensors a family has: a bias only where it has one (Qwen2)."""
    return ("weight", "bias") if shape.qkv_bias else ("weight",)


def _norm_names(te_norms: bool) -> tuple[str, str]:
    if te_norms:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ValueError(f"vocabulary of {t.shape[0]} rows does not fit the padded size {rows}")
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: DecoderShape) -> torch.Tensor:
    """HF q/k/v projections (weights [out, hidden] or biases [out]) -> Megatron's per-group rows."""
    ng, per_group, hd = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    tail = q.shape[1:]
    return torch.cat([q.reshape(ng, per_group * hd, *tail), k.reshape(ng, hd, *tail),
                      v.reshape(ng, hd, *tail)], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, shape: DecoderShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    ng, per_group, hd = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per_group + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [per_group * hd, hd, hd], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: DecoderShape, padded_vocab: int, *,
                   te_norms: bool = False, layers: range | None = None, embedding: bool = True,
                   output: bool = True) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors of one pipeline stage from a HF state dict.

    `layers` are the global layer indices of the stage (local index = position in the range).
    `output` adds the final norm and `output_layer.weight`: lm_head for an untied checkpoint;
    for a tied one only on a last pipeline stage without the embedding, where Megatron keeps a
    copy of the embedding (a single stage reads the embedding itself).
    """
    layers = range(shape.num_layers) if layers is None else layers
    in_norm, mlp_norm = _norm_names(te_norms)

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"HF checkpoint has no tensor {name!r} (is it a {shape.model_type} model?)")
        return hf[name]

    out: dict[str, torch.Tensor] = {}
    if embedding:
        out["embedding.word_embeddings.weight"] = _pad_rows(get("model.embed_tokens.weight"), padded_vocab)
    for local, i in enumerate(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[m + in_norm] = get(h + "input_layernorm.weight")
        for kind in _qkv_kinds(shape):
            out[m + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(
                get(h + f"self_attn.q_proj.{kind}"), get(h + f"self_attn.k_proj.{kind}"),
                get(h + f"self_attn.v_proj.{kind}"), shape)
        if shape.qk_norm:
            for mg_name, hf_name in _QK_NORMS.items():
                out[m + mg_name] = get(h + hf_name)
        out[m + "self_attention.linear_proj.weight"] = get(h + "self_attn.o_proj.weight")
        if shape.is_moe:
            out |= {m + k: t for k, t in convert_moe.layer_to_megatron(get, h, shape).items()}
            continue
        out[m + mlp_norm] = get(h + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([get(h + "mlp.gate_proj.weight"),
                                                      get(h + "mlp.up_proj.weight")])
        out[m + "mlp.linear_fc2.weight"] = get(h + "mlp.down_proj.weight")
    if output:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight")
        if not shape.tie_word_embeddings:
            out["output_layer.weight"] = _pad_rows(get("lm_head.weight"), padded_vocab)
        elif not embedding:
            out["output_layer.weight"] = _pad_rows(get("model.embed_tokens.weight"), padded_vocab)
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(mg: dict[str, torch.Tensor], shape: DecoderShape, *, te_norms: bool = False,
                   offset: int = 0) -> dict[str, torch.Tensor]:
    """HF tensors from full (unsharded) Megatron tensors of one stage (all stages: offset 0).

    Unknown names raise: an export that silently dropped a tensor would publish a broken model.
    """
    in_norm, mlp_norm = _norm_names(te_norms)
    per_layer = {in_norm: "input_layernorm.weight", "self_attention.linear_proj.weight": "self_attn.o_proj.weight"}
    if not shape.is_moe:
        per_layer |= {mlp_norm: "post_attention_layernorm.weight", "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
    if shape.qk_norm:
        per_layer |= _QK_NORMS
    qkv = tuple(f"self_attention.linear_qkv.{kind}" for kind in _qkv_kinds(shape))
    v = shape.vocab_size
    out: dict[str, torch.Tensor] = {}
    for name, t in mg.items():
        if name.endswith("_extra_state"):
            continue
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[:v]
        elif name == "output_layer.weight":
            if not shape.tie_word_embeddings:
                out["lm_head.weight"] = t[:v]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif (match := _LAYER.match(name)) is not None:
            h = f"model.layers.{int(match.group(1)) + offset}."
            rest = match.group(2)
            if rest in per_layer:
                out[h + per_layer[rest]] = t
            elif rest in qkv:
                kind = rest.rsplit(".", 1)[1]
                q, k, vv = split_qkv(t, shape)
                out[h + f"self_attn.q_proj.{kind}"] = q
                out[h + f"self_attn.k_proj.{kind}"] = k
                out[h + f"self_attn.v_proj.{kind}"] = vv
            elif shape.is_moe and (moe := convert_moe.layer_to_hf(rest, t, h)) is not None:
                out |= moe
            elif rest == "mlp.linear_fc1.weight" and not shape.is_moe:
                gate, up = torch.chunk(t, 2, dim=0)
                out[h + "mlp.gate_proj.weight"] = gate
                out[h + "mlp.up_proj.weight"] = up
            else:
                raise KeyError(f"no HF name for Megatron tensor {name!r}")
        else:
            raise KeyError(f"no HF name for Megatron tensor {name!r}")
    return {k: t.contiguous() for k, t in out.items()}


# ---- tensor-parallel shards -------------------------------------------------------------------
_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight",
         "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
# The dense MLP's and every expert's (`mlp.experts.local_experts.<e>.linear_fc1.weight`) alike.
_COLS = ("self_attention.linear_proj.weight", ".linear_fc2.weight")
_GATED = ".linear_fc1.weight"


def tp_layout(name: str) -> tuple[int | None, bool]:
    """(dimension a TP rank slices, whether gate and up are sliced separately); None = replicated."""
    if name.endswith(_GATED):
        return 0, True
    if name.endswith(_ROWS):
        return 0, False
    if name.endswith(_COLS):
        return 1, False
    return None, False


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor."""
    dim, gated = tp_layout(name)
    if dim is None or size == 1:
        return full
    if full.shape[dim] % (2 * size if gated else size):
        raise ValueError(f"{name}: dimension {dim} of size {full.shape[dim]} does not split "
                         f"over tensor_parallel={size}")
    if gated:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]]).contiguous()
    return full.chunk(size, dim=dim)[rank].contiguous()


def merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard` over all TP ranks' slices (in rank order)."""
    dim, gated = tp_layout(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if gated:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)
