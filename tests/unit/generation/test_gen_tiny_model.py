"""The tiny model loads exactly like a real checkpoint, and its tokenizer is character-level."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.rollout.tiny_model import init_tiny


def test_loads_with_auto_classes(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert len(tok) == model.config.vocab_size
    text = "13*15-7=188 \\boxed{188}\ndef f(x): return x*x+9\t!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)                       # one token per character
    assert tok.decode(ids) == text
    # the tokenizers library alone gives the same ids (tokenizer.json is self-consistent)
    assert Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(text).ids == ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)


def test_chat_template_and_special_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "2+3"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids) == "<s><|user|>2+3<|assistant|>"
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert tok.decode(ids, skip_special_tokens=True) == "2+3"


def test_same_seed_same_weights_other_seed_differs(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    again = load_file(str(init_tiny(tmp_path / "a", seed=0) / "model.safetensors"))
    other = load_file(str(init_tiny(tmp_path / "b", seed=1) / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert all(torch.equal(base[k], again[k]) for k in base)
    assert not torch.equal(base["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_cli_init_tiny(tmp_path):
    out = tmp_path / "m"
    from tandem.launcher.cli import main
    assert main(["model", "init-tiny", str(out), "--layers", "2", "--hidden", "64", "--heads", "2",
                 "--kv-heads", "1", "--intermediate", "128"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.num_key_value_heads) == (2, 64, 1)


def test_the_moe_twin_is_a_qwen3_moe_with_the_same_tokenizer(tmp_path, tiny_model_dir):
    """`tandem model init-tiny --arch qwen3_moe`: every layer sparse, the experts and routers asked
    for, untied embeddings (as Qwen3-MoE checkpoints), one expert per tensor on disk (as the Hub's),
    the dense model's tokenizer; reproducible from its seed."""
    from safetensors.torch import load_file

    from tandem.launcher.cli import main
    from tandem.services.protocol.trajectory import dense_layers, routing_shape
    out = tmp_path / "moe"
    assert main(["model", "init-tiny", str(out), "--arch", "qwen3_moe", "--layers", "2", "--hidden", "64",
                 "--experts", "4", "--top-k", "2", "--moe-intermediate", "32"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    cfg = model.config
    assert cfg.model_type == "qwen3_moe" and not cfg.tie_word_embeddings and cfg.norm_topk_prob
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.head_dim) == (4, 2, 32, 16)
    assert routing_shape(cfg.to_dict()) == (2, 2, 4) and dense_layers(cfg.to_dict()) == []   # replay takes it
    assert {type(layer.mlp).__name__ for layer in model.model.layers} == {"Qwen3MoeSparseMoeBlock"}
    saved = load_file(out / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in saved and "model.layers.0.mlp.gate.weight" in saved
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
    again = load_file(init_tiny(tmp_path / "again", arch="qwen3_moe", layers=2, hidden=64, experts=4,
                                moe_intermediate=32) / "model.safetensors")
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
