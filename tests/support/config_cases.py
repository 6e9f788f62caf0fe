"""Small experiment files shared by the unit and integration tiers (the in-process checks and
the CLI/subprocess ones read the same text)."""
from __future__ import annotations

# A valid experiment file for config validation tests; cases derive broken ones from it.
GOOD_EXPERIMENT = """\
experiment:
  name: demo
  model: /models/tiny
trainer:
  groups_per_step: 8
  ppo_n_minibatches: 2
  optim:
    lr: 1.0e-5
"""

# A small cluster experiment the simulator prices in well under a second.
SMALL_SIMULATION = """\
experiment: {name: small, model: none}
launcher: {backend: slurm, nodes: 1, gpus_per_node: 8, gen_train_ratio: "3:1"}
controller: {max_staleness: 2, max_concurrent_groups: 100000}
gen: {backend: sglang}
rollout: {n_samples: 4, max_new_tokens: 2048, max_prompt_tokens: 512}
trainer: {groups_per_step: 16, max_tokens_per_mb: 2560}
simulate: {model_size: R1-Distill-Qwen-1.5B, output_median: 1024, steps: 4, warmup_steps: 1}
"""
