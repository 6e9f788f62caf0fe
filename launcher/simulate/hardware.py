"""Hardware and model descriptions the cost model is built from: datasheet numbers and shapes.

They live in `configs/hardware/*.yaml` (one file per GPU type, `models.yaml` for model shapes)
so a reader can check every number against its cited source; nothing here is fitted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem.launcher.config import ConfigError
from tandem.launcher.config_source import parse_yaml

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak (assumptions until calibrated; see the YAML comments)."""
    train_mfu: float
    prefill_mfu: float
    decode_bw: float
    decode_mfu: float
    decode_step_overhead_s: float
    allreduce_latency_s: float
    network: float


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    memory_bytes: float
    memory_bw: float
    nvlink_bw: float
    node_network_bw: float
    gpus_per_node: int
    eff: Efficiency


@dataclass(frozen=True)
class ModelShape:
    """A decoder of the Qwen2/Qwen3/Llama/Mistral kind (GQA, SwiGLU MLP, BF16 weights), dense or, with
    `experts`, a mixture of experts in every layer (Qwen3-MoE): each token through
    `experts_per_token` of them. Memory and weight sync count every parameter (`params`); compute
    counts the ones a token goes through (`matmul_params`)."""
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    # config.json's head_dim where it is not hidden/heads (Qwen3-0.6B/4B, Mistral-Nemo); 0: hidden/heads.
    explicit_head_dim: int = 0
    qkv_bias: bool = True   # Qwen2's q/k/v biases; Qwen3, Llama and Mistral have none
    qk_norm: bool = False   # Qwen3's per-head q/k RMSNorm weights
    # Mixture of experts (config.json's num_experts, num_experts_per_tok, moe_intermediate_size);
    # 0 experts: a dense MLP of `intermediate`.
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    def _attn_and_norms(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def expert_layer_params(self) -> int:
        """The routed experts' parameters of one layer (split over expert-parallel ranks); 0 dense."""
        return self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def layer_params(self) -> int:
        """Every parameter of one layer (with experts: all of them, and the router)."""
        if self.experts:
            return self._attn_and_norms() + self.experts * self.hidden + self.expert_layer_params
        return self._attn_and_norms() + 3 * self.hidden * self.intermediate

    @property
    def active_layer_params(self) -> int:
        """The parameters of one layer a token goes through (with experts: the router and k experts)."""
        if self.experts:
            return (self._attn_and_norms() + self.experts * self.hidden
                    + self.experts_per_token * 3 * self.hidden * self.moe_intermediate)
        return self.layer_params

    def experts_touched(self, tokens: int) -> float:
        """Expected fraction of a layer's experts that `tokens` tokens route to, if each token picks
        its k of E uniformly and independently (an assumption: a trained router is less even, and
        then touches fewer): 1 - (1 - k/E)^tokens; 1 for a dense model."""
        if not self.experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens

    @property
    def params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + emb * (1 if self.tied else 2) + self.hidden

    @property
    def weight_bytes(self) -> int:
        return 2 * self.params

    @property
    def matmul_params(self) -> int:
        """Parameters that cost 2 FLOPs per token (every weight a token goes through but the
        embedding lookup: with experts, the active ones)."""
        return self.layers * self.active_layer_params + self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def attn_flops_per_ctx(self) -> int:
        """FLOPs per (query token, context token) pair: QK^T and AV, 2 FLOPs per multiply-add."""
        return 4 * self.layers * self.heads * self.head_dim


def _read_yaml(path: Path) -> dict:
    try:
        data = parse_yaml(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML syntax error: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping")
    return data


def load_gpu(name_or_path: str) -> GPU:
    """`H800` -> configs/hardware/H800.yaml; anything with a '/' or '.yaml' is a path."""
    path = Path(name_or_path)
    if "/" not in name_or_path and not name_or_path.endswith((".yaml", ".yml")):
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            known = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml") if p.stem != "models")
            raise ConfigError(f"simulate.hardware={name_or_path!r}: unknown GPU type "
                              f"(known: {', '.join(known)}; or give a path to a YAML file)")
    d = _read_yaml(path)
    try:
        eff = Efficiency(**d["efficiency"])
        return GPU(name=str(d["name"]), bf16_flops=float(d["bf16_flops"]),
                   memory_bytes=float(d["memory_bytes"]), memory_bw=float(d["memory_bw"]),
                   nvlink_bw=float(d["nvlink_bw"]), node_network_bw=float(d["node_network_bw"]),
                   gpus_per_node=int(d["gpus_per_node"]), eff=eff)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: bad or missing hardware field: {e}") from None


def _named_shape(table: dict, name: str) -> ModelShape:
    d = {k: v for k, v in table[name].items() if k != "source"}
    return ModelShape(name=name, **d)


def shape_name_for(model: str, table: dict) -> str | None:
    """The models.yaml entry a model path names: its last component equals an entry's name or
    the last component of its Hub `source` (case-insensitive), e.g.
    `/shared/models/DeepSeek-R1-Distill-Qwen-1.5B` -> `R1-Distill-Qwen-1.5B`."""
    last = Path(str(model).rstrip("/")).name.lower()
    for key, entry in table.items():
        source = str((entry or {}).get("source", ""))
        if last and last in (key.lower(), source.rsplit("/", 1)[-1].lower()):
            return key
    return None


def _experts(c: dict) -> dict:
    """A MoE config.json's expert fields ({} for a dense model)."""
    from tandem.trainer.model_fit import num_experts

    experts = num_experts(c)
    if not experts:
        return {}
    return {"experts": int(experts), "experts_per_token": int(c["num_experts_per_tok"]),
            "moe_intermediate": int(c["moe_intermediate_size"])}


def load_model_shape(name: str, model_dir: str | None = None) -> ModelShape:
    """A named shape from configs/hardware/models.yaml; else the config.json of the experiment's
    model directory; else the models.yaml entry the directory's name matches (a cluster config
    names `/shared/models/DeepSeek-R1-Distill-Qwen-1.5B`, which this machine need not have)."""
    table = _read_yaml(HARDWARE_DIR / "models.yaml")
    if name:
        if name not in table:
            raise ConfigError(f"simulate.model_size={name!r}: not in {HARDWARE_DIR / 'models.yaml'} "
                              f"(known: {', '.join(table)})")
        return _named_shape(table, name)
    cfg_path = Path(model_dir or "") / "config.json"
    try:
        c = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError):
        known = shape_name_for(model_dir or "", table)
        if known:
            return _named_shape(table, known)
        raise ConfigError(f"simulate.model_size is empty, {cfg_path} is not readable and "
                          f"{Path(model_dir or '').name!r} names no model in configs/hardware/models.yaml; "
                          f"set simulate.model_size to one of: {', '.join(table)}") from None
    try:
        return ModelShape(name=Path(model_dir).name, layers=c["num_hidden_layers"],
                          hidden=c["hidden_size"], heads=c["num_attention_heads"],
                          kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
                          intermediate=c["intermediate_size"], vocab=c["vocab_size"],
                          tied=bool(c.get("tie_word_embeddings", False)),
                          explicit_head_dim=int(c.get("head_dim") or 0),
                          qkv_bias=c.get("model_type", "qwen2") == "qwen2",
                          qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"),
                          **_experts(c))
    except KeyError as e:
        raise ConfigError(f"{cfg_path}: missing {e}; set simulate.model_size instead") from None
