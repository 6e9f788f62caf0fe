"""The trainer's part of the experiment config (section `trainer`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import II

from trainer.megatron.config import MegatronConfig
from trainer.weights import METHODS as WEIGHT_SYNC_METHODS


@dataclass
class OptimConfig:
    """AdamW with a linear warm-up, as every trainer backend builds it."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Global gradient-norm clip (over all parameters and ranks); 0 disables clipping.
    grad_clip: float = 1.0
    # Optimizer updates over which the learning rate ramps linearly from lr/warmup_steps to lr.
    warmup_steps: int = 0


@dataclass
class TrainerConfig:
    """The training role: replay buffer, decoupled PPO, micro-batching, weights, checkpoints."""
    # torch: a transformers model (CPU or one GPU per rank, data parallel); megatron: Megatron-core.
    backend: str = "torch"
    # B: prompt groups consumed per global training step (one policy version).
    groups_per_step: int = 16
    total_steps: int = 100
    # Optimizer updates per global step; each takes groups_per_step / ppo_n_minibatches groups.
    ppo_n_minibatches: int = 1
    # PPO clip range: the ratio is clipped to [1 - eps_clip, 1 + eps_clip].
    eps_clip: float = 0.2
    # Decoupled PPO (proximal policy recomputed at the start of each step, behaviour importance
    # weight); false = standard PPO against the behaviour log-probs from the generation server.
    use_decoupled_loss: bool = True
    # Tokens whose behaviour importance weight exp(prox - behav) exceeds this are masked out of
    # the loss (they still count in the token average); null = no cap.
    behav_imp_weight_cap: float | None = None
    # Subtract the mean reward of the prompt group from each sample's reward (GRPO-style).
    group_baseline: bool = True
    # Normalise advantages to mean 0, std 1 over the valid tokens of the global batch.
    normalize_advantages: bool = True
    # Token budget of one packed micro-batch; a sequence longer than this is dropped and counted.
    max_tokens_per_mb: int = 8192
    # Softmax temperature applied to the logits, log_softmax(logits / T), as the generation server.
    temperature: float = II("rollout.temperature")
    # eta: a group whose staleness (step - admit_version) exceeds this is handled by stale_policy.
    max_staleness: int = II("controller.max_staleness")
    # Admission bounds staleness, but a straggler group finishing after younger ones can still
    # exceed eta. drop: discard it (counted; its admission slot is released) so no trained group
    # is staler than eta; train: train it anyway (counted).
    stale_policy: str = "drop"
    # Save a checkpoint every this many global steps (and always on SIGTERM); 0 = only on SIGTERM.
    checkpoint_every: int = 10
    # Checkpoints kept on disk (oldest removed first).
    keep_checkpoints: int = 2
    # How new weights reach the generation servers (one publisher per method, trainer/weights/):
    # disk: write <exp>/weights/v<N>/ as a HF directory each server loads; broadcast: send the
    # tensors over a torch.distributed group joined by every TP rank of every server.
    weight_sync: str = "disk"
    # Published weight versions kept under <exp>/weights/ (oldest removed first).
    keep_weights: int = 3
    # Wait for the controller's weights_ack before the next step (false = overlap the update
    # with the next step's training; the next publish still waits for the previous ack).
    wait_for_ack: bool = True
    # Seconds to wait for the controller's weights_ack before giving up on that version.
    ack_timeout_s: float = 600.0
    # Port of the weight-broadcast rendezvous (0 = pick a free one).
    broadcast_port: int = 0
    # Run the model on all sequences of a micro-batch at once (block-diagonal attention via
    # per-sequence position ids); false = one forward per sequence (slower, same numbers).
    packed_forward: bool = True
    # Megatron backend: tensor- and pipeline-parallel sizes (data parallel takes the rest).
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # Torch threads of one trainer rank. The local launcher with launcher.cpus.pin gives each
    # rank as many threads as its CPU set instead (OMP/MKL threads follow).
    threads: int = 1
    # Interface the trajectory socket binds (rollout workers connect to it).
    host: str = "127.0.0.1"
    # 0 = pick a free port and publish it in <exp>/services/trainer.json.
    port: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.backend not in ("torch", "megatron"):
            out.append(("backend", f"must be 'torch' or 'megatron', got {self.backend!r}"))
        if self.groups_per_step < 1:
            out.append(("groups_per_step", "must be >= 1"))
        if self.ppo_n_minibatches < 1:
            out.append(("ppo_n_minibatches", "must be >= 1"))
        elif self.groups_per_step % self.ppo_n_minibatches:
            out.append(("ppo_n_minibatches",
                        f"groups_per_step={self.groups_per_step} is not divisible by "
                        f"ppo_n_minibatches={self.ppo_n_minibatches}"))
        if self.total_steps < 1:
            out.append(("total_steps", "must be >= 1"))
        if not (0 < self.eps_clip < 1):
            out.append(("eps_clip", f"must be in (0, 1), got {self.eps_clip}"))
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1:
            out.append(("behav_imp_weight_cap", f"must be > 1 or null, got {self.behav_imp_weight_cap}"))
        if self.max_tokens_per_mb < 16:
            out.append(("max_tokens_per_mb", f"must be >= 16, got {self.max_tokens_per_mb}"))
        if self.temperature <= 0:
            out.append(("temperature", "must be > 0"))
        if self.max_staleness < 0:
            out.append(("max_staleness", "must be >= 0"))
        if self.stale_policy not in ("train", "drop"):
            out.append(("stale_policy", f"must be 'train' or 'drop', got {self.stale_policy!r}"))
        if self.checkpoint_every < 0:
            out.append(("checkpoint_every", "must be >= 0 (0 = only on SIGTERM)"))
        if self.keep_checkpoints < 1:
            out.append(("keep_checkpoints", "must be >= 1"))
        if self.weight_sync not in WEIGHT_SYNC_METHODS:
            out.append(("weight_sync", f"must be one of {sorted(WEIGHT_SYNC_METHODS)}, got {self.weight_sync!r}"))
        if self.keep_weights < 1:
            out.append(("keep_weights", "must be >= 1"))
        if self.ack_timeout_s <= 0:
            out.append(("ack_timeout_s", "must be > 0"))
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            out.append(("tensor_parallel" if self.tensor_parallel < 1 else "pipeline_parallel",
                        "must be >= 1"))
        if self.threads < 1:
            out.append(("threads", "must be >= 1"))
        if self.optim.lr <= 0:
            out.append(("optim.lr", "must be > 0"))
        if self.optim.grad_clip < 0:
            out.append(("optim.grad_clip", "must be >= 0 (0 disables clipping)"))
        if self.optim.warmup_steps < 0:
            out.append(("optim.warmup_steps", "must be >= 0"))
        out += [(f"megatron.{k}", m) for k, m in self.megatron.problems()]
        return out
