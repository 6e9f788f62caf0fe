"""Megatron-core backend: a GPTModel (Qwen2, Qwen3, Qwen3-MoE, Llama 3.x, Mistral) with
tensor/pipeline/data parallelism, and expert parallelism for mixture-of-experts models.

Modules: `config` (the `megatron` config section), `cpu_compat` (the only place that bends
Megatron to run without a GPU), `shape` (which HF families, read from config.json), `model`
(shape -> TransformerConfig/GPTModel, process groups), `convert` (HF <-> Megatron weight
names, fused layouts and TP shards), `packing` (packed sequences: THD `PackedSeqParams`; the
block-diagonal mask, the reference in tests), `varlen_attention` (core attention without TE),
`pipeline` (the micro-batch schedule over pipeline stages),
`dist_ckpt` (resharding-capable checkpoints), `gpu` (Megatron DDP and optimizer, GPUs only),
`cpu_grads` (the CPU path's gradient sums and norm), `moe` (MoE layers: routing as the
checkpoint does, router losses, routing metrics), `moe_step` (a MoE update: expert-parallel ranks
in step, gradients over the expert groups), `convert_moe` (router and expert weights, EP shards)
and `backend` (the `TrainBackend` the loop drives). See docs/megatron.md.
"""
