"""What the trainer's settings ask of the model it trains, checked from the model's config.json
before anything starts (the launcher's file checks, `tandem config check`): a mistake that would
otherwise surface minutes later, when a trainer rank builds the model, is refused with its key.

- LoRA (`trainer.lora.rank > 0`) on a mixture-of-experts model is refused: transformers 5 keeps a
  layer's experts as 3-D parameters (`experts.gate_up_proj`, `experts.down_proj`), not the linear
  modules peft's LoRA adapts, so only attention would train while the default targets name MLP
  modules the model no longer has; and the Megatron backend has no LoRA (trainer/config.py).
- Expert parallelism (`trainer.expert_parallel > 1`) needs experts, as many as a multiple of it.

A directory that cannot be read says nothing here: `model_problem` (launcher/preflight.py) names it.
"""
from __future__ import annotations

import json
from pathlib import Path

from tandem.services.protocol.trajectory import dense_layers


def num_experts(config: dict) -> int:
    """Experts per layer of a config.json (0: dense). The Hub's Qwen3-MoE files say `num_experts`;
    transformers 5 saves the same number as `num_local_experts`."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def model_fit_problems(tcfg, model_dir: str) -> list[tuple[str, str]]:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(config, dict):
        return []
    experts, kind = num_experts(config), config.get("model_type", "?")
    out = []
    if tcfg.lora.rank > 0 and experts:
        out.append(("trainer.lora.rank", f"LoRA on a mixture-of-experts model ({kind}, {experts} experts per layer) "
                                         f"is not supported: its experts are 3-D parameters that peft's LoRA does "
                                         f"not adapt, so only attention would train; set trainer.lora.rank: 0 to "
                                         f"train the whole model"))
    if getattr(tcfg, "records_routing", False):
        key = "trainer.routing_replay" if tcfg.routing_replay else "trainer.routing_agreement"
        if not experts:
            out.append((key, f"routed experts need a mixture-of-experts model; {model_dir} ({kind}) has no "
                             f"experts to route"))
        elif dense_layers(config):
            out.append((key, f"routed experts need every layer to route (SGLang returns one row per layer); "
                             f"{model_dir} has dense layers {dense_layers(config)}"))
    ep = tcfg.expert_parallel
    if ep > 1 and not experts:
        out.append(("trainer.expert_parallel", f"trainer.expert_parallel={ep} needs a mixture-of-experts model; "
                                               f"{model_dir} ({kind}) has no experts"))
    elif ep > 1 and experts % ep:
        out.append(("trainer.expert_parallel", f"trainer.expert_parallel={ep} must divide the {experts} experts "
                                               f"per layer of {model_dir}"))
    return out
