"""Tiny random checkpoints of the decoder families the Megatron backend takes besides Qwen2
(which is megatron_case.py's): Llama 3.x, Qwen3 and Mistral, built with transformers.

Each has what makes its family differ, at the sizes of megatron_case's Qwen2 (vocab 61, hidden
64, 2 layers, 4 query heads over 2 KV groups):
- llama: tied embeddings (as Llama 3.2 1B/3B) and Llama 3.2's "llama3" rope scaling (factor 32,
  rope_theta 500000; with head_dim 16 its frequencies fall in all three bands of the scaling:
  kept, interpolated and divided by the factor);
- qwen3: q_norm/k_norm, no q/k/v bias, head_dim 24 (not hidden/heads = 16), tied;
- mistral: no bias, untied, no sliding window.
"""
from __future__ import annotations

from pathlib import Path

from megatron_case import VOCAB, save_random

FAMILIES = ("llama", "qwen3", "mistral")

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def family_model(family: str):
    """An untrained transformers model of `family` (random init, replaced by make_family_dir)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6)
    if family == "llama":   # Llama 3.2's context: the scaled rope's 8192 is below it
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common | {"max_position_embeddings": 131072},
                                                  tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE)))
    if family == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=24, tie_word_embeddings=True,
                                                  rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 1000000.0}))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None,
                                                      rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 10000.0}))
    raise ValueError(f"unknown family {family!r}")


def make_family_dir(out: Path, family: str, seed: int = 0) -> Path:
    """A HF directory (safetensors) with non-trivial random weights (norms around 1)."""
    return save_random(family_model(family), out, seed)
