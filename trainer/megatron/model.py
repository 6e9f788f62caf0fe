"""A Megatron-core `GPTModel` shaped like a Hugging Face decoder checkpoint, and its process groups.

Qwen2/Qwen3/Llama 3.x/Mistral are pre-norm decoders with RMSNorm, rotary embeddings,
grouped-query attention and a gated SiLU MLP; what differs between them (a q/k/v bias, q/k
norms, head_dim, llama3 rope scaling) is read from `config.json` by `shape.decoder_shape` and
maps onto a `TransformerConfig` / `GPTModel` switch each here.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tandem.trainer.megatron.shape import DecoderShape


def padded_vocab_size(vocab: int, multiple: int, tp: int) -> int:
    """Vocabulary rows after padding, so that each TP rank holds the same number of rows."""
    step = multiple * tp
    return int(math.ceil(vocab / step) * step)


def check_parallel_fits(shape: DecoderShape, tp: int, pp: int, ep: int = 1) -> None:
    """ValueError when the model cannot be split this way (named, before Megatron asserts)."""
    from tandem.trainer.megatron.moe import check_moe_fits

    check_moe_fits(shape, tp, ep)
    if shape.num_heads % tp:
        raise ValueError(f"trainer.tensor_parallel={tp} must divide num_attention_heads={shape.num_heads}")
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        raise ValueError(f"trainer.tensor_parallel={tp} and num_key_value_heads={shape.num_kv_heads}: "
                         "one must divide the other")
    if not shape.is_moe and shape.intermediate_size % tp:
        raise ValueError(f"trainer.tensor_parallel={tp} must divide intermediate_size={shape.intermediate_size}")
    if shape.num_layers % pp:
        raise ValueError(f"trainer.pipeline_parallel={pp} must divide num_hidden_layers={shape.num_layers}")


def init_parallel(tp: int, pp: int, ep: int = 1) -> None:
    """Megatron's TP/PP/DP groups over the already initialised default process group.

    A single-process job has no default group yet: one is made here (an in-memory store, so no
    port is needed). Data parallel takes world_size / (tp * pp) ranks; expert parallelism splits
    the experts over `ep` of them (megatron-core carves it out of data parallel: each expert
    rank routes its own tokens), so it must divide that data-parallel size.
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"trainer world size {world} is not a multiple of "
                         f"tensor_parallel*pipeline_parallel = {tp}*{pp}")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"trainer.expert_parallel={ep} must divide the data-parallel size "
                         f"{world // (tp * pp)} (trainer world {world} / tensor_parallel {tp} / pipeline_parallel {pp})")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size()) != (tp, pp, ep):
            raise RuntimeError("Megatron process groups already exist with a different layout")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)


def transformer_config(shape: DecoderShape, dtype: torch.dtype, on_gpu: bool, recompute: bool = False,
                       fused_activation: bool = False, mcfg=None):
    """The `TransformerConfig` equivalent of a HF decoder config (no dropout: RL needs r = 1 exactly
    at the start of a step, so proximal and first-update log-probs must be the same numbers).
    `recompute`: full activation recompute, one layer per unit (the layer's input is kept, the
    rest recomputed in the backward pass: the same numbers, less memory). `fused_activation`
    (trainer.compile): megatron-core's SwiGLU autograd function (`bias_activation_fusion`), which
    keeps only its input for the backward pass and runs its forward and backward under
    torch.compile (megatron-core 0.16.1's `jit_fuser` on torch >= 2.2): two generated kernels
    instead of the eager split, SiLU, product and their gradients. A mixture-of-experts shape
    adds the MoE fields (moe.py), with `mcfg`'s router-loss options (defaults: off)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from tandem.trainer.megatron.config import MegatronConfig
    from tandem.trainer.megatron.moe import transformer_config_fields

    tp = ps.get_tensor_model_parallel_world_size()
    moe = transformer_config_fields(shape, mcfg or MegatronConfig(), tp, ps.get_expert_model_parallel_world_size())

    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim, ffn_hidden_size=shape.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_qkv_bias=shape.qkv_bias, add_bias_linear=False,
        # Qwen3's q_norm/k_norm. Also read by `finalize_model_grads` (GPU path), which sums their
        # gradients over TP ranks: each rank normalises only its own heads with the shared weight.
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # Weights are always loaded from a checkpoint: skip the random init.
        perform_initialization=False, use_cpu_initialization=not on_gpu,
        # Gradients are summed over data-parallel ranks, not averaged: the loss is already
        # normalised by the global token count (see trainer/backend.py).
        calculate_per_token_loss=True,
        # The other fusions need Apex or TE kernels; the unfused paths are exact.
        persist_layer_norm=False, bias_activation_fusion=fused_activation, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        **({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
           if recompute else {}),
        **moe,
    )


def layer_spec(on_gpu: bool, qk_norm: bool = False, num_experts: int = 0):
    """TransformerEngine spec on GPUs when TE is installed (fused norms, THD packing), else the
    local spec with `VarlenCoreAttention` (THD packing too, one SDPA call per sequence).

    The two specs name the norm weights differently (`input_layernorm.weight` vs
    `linear_qkv.layer_norm_weight`); `convert.py` handles both. `qk_norm` (Qwen3) adds the
    per-head `self_attention.q_layernorm` / `k_layernorm`, named the same in both specs; the
    specs take it as an argument, not from the `TransformerConfig`. `num_experts` (Qwen3-MoE)
    makes the MLP megatron-core's `MoELayer` with `SequentialMLP` experts on both specs (moe.py);
    the TransformerEngine spec then keeps `pre_mlp_layernorm` as a module of its own.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if uses_transformer_engine(on_gpu):
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts or None, qk_layernorm=qk_norm)
    from tandem.trainer.megatron.varlen_attention import VarlenCoreAttention

    spec = get_gpt_layer_local_spec(num_experts=num_experts or None, qk_layernorm=qk_norm, normalization="RMSNorm")
    # padding-free attention without TE: one causal SDPA per packed sequence (varlen_attention.py)
    spec.submodules.self_attention.submodules.core_attention = VarlenCoreAttention
    if num_experts:
        # The local spec names its MLP norm as the TE spec's fused one in dist checkpoints
        # (`mlp.linear_fc1.layer_norm_weight`); with experts the TE spec keeps a separate
        # `pre_mlp_layernorm`, so the local one keeps its own name too: one checkpoint format.
        spec.submodules.sharded_state_dict_keys_map = {
            k: v for k, v in spec.submodules.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
    return spec


def uses_transformer_engine(on_gpu: bool) -> bool:
    """Whether `layer_spec` builds the TransformerEngine spec."""
    return on_gpu and has_transformer_engine()


def bounds_device(on_gpu: bool, device: torch.device) -> torch.device:
    """Where a pack's bounds (`cu_seqlens`) go. TE's kernels read them on the device. Without TE
    everything that reads them reads them on the host: megatron-core 0.16.1's unfused THD rotary
    embedding (`rope_utils._apply_rotary_pos_emb_thd`: `.tolist()` of the lengths, and a tensor
    tested in an `if`, for q and k) and VarlenCoreAttention's split. From a device copy each read
    waits for the GPU, about four times per layer per forward (tests/unit/trainer/test_host_reads.py)."""
    return device if uses_transformer_engine(on_gpu) else torch.device("cpu")


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_gpt_model(shape: DecoderShape, config, spec, padded_vocab: int):
    """This rank's stage of the model (pre/post process by pipeline position)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if shape.is_moe:
        from tandem.trainer.megatron.moe import define_te_gemm_when_absent

        define_te_gemm_when_absent()
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=padded_vocab,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        # Logits are gathered over TP ranks: the loss needs log_softmax over the true vocabulary.
        parallel_output=False,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=shape.rope_theta,
        # Llama 3.x: megatron-core's llama3 frequency scaling (its other constants are checked
        # against the checkpoint's in shape.py).
        rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,   # read only with rope_scaling
    )
    cast_parameters(model, config.params_dtype)
    return model


def cast_parameters(model, dtype: torch.dtype) -> None:
    """Every floating-point parameter in `dtype` (the config's `params_dtype`).

    Why: the local layer spec (used on GPUs without TransformerEngine) builds its norms with
    `torch.nn.RMSNorm(hidden)`, i.e. in float32 whatever `params_dtype` says, so a bf16 model
    held fp32 norm weights next to bf16 ones. megatron-core 0.16.1's optimizers assume one
    dtype (Megatron-LM casts the whole model with `Float16Module`), and with a mix both
    checkpoints broke (issue 31): `Float16OptimizerWithFloat16Params.sharded_state_dict` numbers
    the model's params over its float16 params only while the inner optimizer numbers all of
    them ("Optimizer shape (128,) does not match model shape (256,)": a norm's state against
    the q/k/v bias), and `DistributedOptimizer` puts each group's fp32 params first in the inner
    optimizer while `model_param_group_index_map` keeps model order, so
    `get_parameter_state_dp_zero` reads the wrong main param ("size of tensor a (256) must match
    b (128)"). Only parameters are cast: buffers and the rotary frequencies keep their dtype.
    """
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def layer_offset(shape: DecoderShape) -> int:
    """Global index of this pipeline stage's first layer (uniform split)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    return ps.get_pipeline_model_parallel_rank() * (shape.num_layers // pp)
