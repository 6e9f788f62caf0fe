"""A tiny, randomly initialised Qwen2 checkpoint with a character-level tokenizer (or, with
`arch="qwen3_moe"`, a tiny Qwen3-MoE with the same tokenizer).

Tests, benchmarks and the embedded default need a model that loads through exactly the same
code path as a real checkpoint (`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`), yet
costs nothing to create and runs fast on one CPU core. A character vocabulary (one token per
ASCII character) keeps the embedding matrix small and lets the synthetic math and code tasks be
learnt character by character.

The MoE twin exercises what only mixture-of-experts models have (routers, experts, routing
replay) end to end on a CPU: every layer sparse, `experts` experts of `moe_intermediate` each,
`top_k` per token renormalised (`norm_topk_prob`) and untied embeddings, as Qwen3-30B-A3B has
them; its defaults activate as many MLP weights per token (2 x 256) as the dense model's 512.
"""
from __future__ import annotations

import json
from pathlib import Path

# Special tokens first so their ids are stable whatever the character set: 0 pad, 1 bos, 2 eos.
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)
# transformers maps every qwen2 checkpoint to `Qwen2Tokenizer`, which rebuilds the pipeline as
# NFC -> Qwen's split regex -> byte-level, and silently drops tokens missing from the vocab.
# So the vocabulary is the 256 byte-level symbols with no merges: every printable ASCII
# character (digits, letters, punctuation, space, newline) is exactly one token, and any other
# text is still encodable, one token per UTF-8 byte. tokenizer.json spells the same pipeline, so
# `tokenizers.Tokenizer.from_file` and `AutoTokenizer` give identical ids.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def byte_symbols() -> list[str]:
    """The byte-level alphabet (GPT-2's printable stand-in for each byte), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# The chat template: one role token opens each message; assistant turns end with EOS, so a
# model tuned on `apply_chat_template` output learns to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_vocab(min_size: int = 0) -> dict[str, int]:
    """Token -> id; padded with reserved special tokens up to `min_size` (for --vocab)."""
    tokens = list(SPECIAL_TOKENS) + byte_symbols()
    while len(tokens) < min_size:
        tokens.append(f"<|reserved_{len(tokens)}|>")
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer(vocab: dict[str, int]):
    """A `tokenizers.Tokenizer`: one token per byte, plus the special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _specials(vocab)])
    return tok


def _specials(vocab: dict[str, int]) -> list[str]:
    return [t for t in vocab if len(t) > 2 and t.startswith("<") and t.endswith(">")]


def _tokenizer_config(vocab: dict[str, int]) -> dict:
    specials = _specials(vocab)
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "additional_special_tokens": [t for t in specials if t not in (PAD, BOS, EOS, UNK)],
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": None,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


ARCHS = ("qwen2", "qwen3_moe")


def _config(arch: str, token_ids: dict[str, int], *, layers: int, hidden: int, heads: int, kv_heads: int,
            intermediate: int, max_position: int, experts: int, top_k: int, moe_intermediate: int):
    import transformers as tf

    common = dict(vocab_size=len(token_ids), hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position,
                  bos_token_id=token_ids[BOS], eos_token_id=token_ids[EOS], pad_token_id=token_ids[PAD],
                  rope_theta=10000.0, torch_dtype="float32")
    if arch == "qwen2":
        return tf.Qwen2Config(intermediate_size=intermediate, tie_word_embeddings=True, **common), tf.Qwen2ForCausalLM
    if not 0 < top_k <= experts:
        raise ValueError(f"init_tiny: top_k ({top_k}) must be in 1..experts ({experts})")
    # router_aux_loss_coef: the Switch load-balancing loss's weight where a forward asks for the
    # router logits (the warm-up does: trainer/sft.py), Switch Transformer's 0.01.
    return tf.Qwen3MoeConfig(intermediate_size=intermediate, head_dim=hidden // heads, num_experts=experts,
                             num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate, norm_topk_prob=True,
                             router_aux_loss_coef=0.01, tie_word_embeddings=False, **common), tf.Qwen3MoeForCausalLM


def init_tiny(out_dir, *, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
              intermediate: int = 512, max_position: int = 512, vocab: int = 0, seed: int = 0,
              arch: str = "qwen2", experts: int = 8, top_k: int = 2, moe_intermediate: int = 256) -> Path:
    """Write a loadable Hugging Face directory to `out_dir` and return its path.

    Same seed and sizes give byte-identical weights, so tests can recreate a model instead of
    shipping one. `arch`: "qwen2" (dense) or "qwen3_moe" (`experts`, `top_k`, `moe_intermediate`
    shape its experts; `intermediate` is then unused by any layer, all of them being sparse).
    """
    import torch

    if arch not in ARCHS:
        raise ValueError(f"init_tiny: arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if hidden % heads:
        raise ValueError(f"init_tiny: hidden ({hidden}) must be a multiple of heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"init_tiny: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    token_ids = build_vocab(vocab)
    config, model_class = _config(arch, token_ids, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                  intermediate=intermediate, max_position=max_position, experts=experts,
                                  top_k=top_k, moe_intermediate=moe_intermediate)
    gen = torch.Generator().manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        # Our own generator (not the global RNG) so the weights depend on `seed` alone.
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * config.initializer_range)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(token_ids).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(token_ids), indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, indent=2))
    return out
