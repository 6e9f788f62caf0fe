"""The trainer's part of the experiment config (section `trainer`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import II

from tandem.trainer.learning_signals import SignalsConfig
from tandem.trainer.lr_schedule import schedule_problems
from tandem.trainer.megatron.config import RECOMPUTE, MegatronConfig
from tandem.trainer.presets import objective_problems
from tandem.trainer.samples import SamplesConfig
from tandem.trainer.weights import METHODS as WEIGHT_SYNC_METHODS


@dataclass
class OptimConfig:
    """AdamW with a warm-up and a learning-rate schedule (trainer/lr_schedule.py), as every
    trainer backend builds it."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Global gradient-norm clip (over all parameters and ranks); 0 disables clipping.
    grad_clip: float = 1.0
    # Optimizer updates over which the learning rate ramps linearly from lr/warmup_steps to lr.
    warmup_steps: int = 0
    # After the warm-up: constant (lr), linear or cosine decay from lr to lr * min_lr_ratio over
    # the run's optimizer updates (total_steps x ppo_n_minibatches, or decay_steps). A resumed run
    # continues it (the update count is checkpointed).
    schedule: str = "constant"
    # The decay's floor as a fraction of lr (linear and cosine), reached at the decay's last update.
    min_lr_ratio: float = 0.0
    # Optimizer updates the decay ends at, warm-up included (0 = every update of the run); the
    # learning rate stays at lr * min_lr_ratio after it.
    decay_steps: int = 0


# Qwen2's and Llama's names for every linear projection of a decoder layer (attention and MLP).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_SYNC = ("adapter", "merged")


@dataclass
class LoraConfig:
    """Low-rank adapters (peft's LoRA) on the torch backend: only the adapters train; the base
    model's weights stay frozen and serve as the KL penalty's reference (trainer/lora.py)."""
    # Adapter rank r (0 = off: the whole model trains).
    rank: int = 0
    # The adapter's output is scaled by alpha / rank.
    alpha: float = 32.0
    # Must stay 0: the trainer runs the model without dropout, so that the proximal and the first
    # update's log-probs are the same numbers (r = 1 exactly at a step's start).
    dropout: float = 0.0
    # Module names (the last part of the name) that get an adapter; every one must exist in
    # the model. The default: every linear projection of a Qwen2/Llama decoder layer.
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # What a weight publication writes to <exp>/weights/v<N>/ (trainer.weight_sync: disk):
    # adapter: peft's adapter directory (a few MB), which every server (SGLang or embedded)
    # loads over /load_lora_adapter and serves under one name each request gives; merged: the
    # whole merged model as a plain HF directory (what the broadcast needs).
    sync: str = "adapter"

    @property
    def adapter_sync(self) -> bool:
        """The servers serve the trained adapter by name (services/controller/weights/adapter.py)."""
        return self.rank > 0 and self.sync == "adapter"

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.sync not in LORA_SYNC:
            out.append(("sync", f"must be one of {list(LORA_SYNC)}, got {self.sync!r}"))
        if self.rank < 0:
            out.append(("rank", f"must be >= 0 (0 = off), got {self.rank}"))
        if self.alpha <= 0:
            out.append(("alpha", f"must be > 0, got {self.alpha}"))
        if self.dropout != 0:
            out.append(("dropout", f"must be 0, got {self.dropout}: the trainer runs the model without dropout so "
                                   f"that the proximal and the first update's log-probs agree exactly (r = 1 at a "
                                   f"step's start)"))
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            out.append(("target_modules", f"must name at least one module, got {self.target_modules!r}"))
        return out


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
    # The objective's recipe (docs/algorithms.md): areal (decoupled PPO, the defaults below), grpo,
    # dapo, dr_grpo, gspo or tis set every objective and data-shaping key below (and
    # rollout.filter_all_equal); a key set in the experiment file or on the command line wins.
    algorithm: str = "areal"
    # PPO clip range: the ratio is clipped to [1 - eps_clip, 1 + eps_clip].
    eps_clip: float = 0.2
    # Asymmetric clip: [1 - eps_clip_low, 1 + eps_clip_high] (DAPO's clip-higher); null = eps_clip.
    eps_clip_low: float | None = None
    # Upper side of the asymmetric clip (DAPO: 0.28); null = eps_clip.
    eps_clip_high: float | None = None
    # Dual clip (c > 1): for A < 0 the objective is at least c * A; null = off.
    dual_clip_c: float | None = None
    # Decoupled PPO (proximal policy recomputed at the start of each step, behaviour importance
    # weight); false = standard PPO against the behaviour log-probs from the generation server.
    use_decoupled_loss: bool = True
    # Proximal log-probs: recompute (a no-grad forward at the step's start parameters), loglinear
    # (interpolated by version between the behaviour and the current log-probs: no extra forward),
    # behaviour (prox = behaviour: standard PPO, as use_decoupled_loss: false).
    proximal: str = "recompute"
    # Behaviour weight w = exp(prox - behav): cap-mask (w > behav_imp_weight_cap masked), truncate
    # (w = min(w, behav_imp_weight_cap): TIS), mask (w outside [behav_imp_weight_low,
    # behav_imp_weight_cap] masked: MIS, IcePop). Masked tokens still count in the averages.
    behav_weight: str = "cap-mask"
    # Upper bound of the behaviour weight (cap-mask, truncate, mask); null = no cap (cap-mask at
    # token or seq-mean level only). 5.0 with cap-mask is AReaL v1.0.3's default (token_mask).
    behav_imp_weight_cap: float | None = 5.0
    # Lower bound of the behaviour weight (mask only).
    behav_imp_weight_low: float = 0.0
    # token: one weight per token; seq-mean: the geometric mean of the sequence's token weights;
    # seq-product: their product (the sequence's likelihood ratio), for every token of it.
    behav_weight_level: str = "token"
    # token: r = exp(logp - prox) per token (PPO); sequence: GSPO's length-normalised sequence ratio.
    ratio_level: str = "token"
    # token-mean: over the minibatch's valid tokens; seq-mean-token-sum: token sums averaged over
    # sequences; seq-mean-token-mean: per-sequence token means averaged over sequences.
    loss_agg: str = "token-mean"
    # seq-mean-token-sum only: divide each token sum by this constant (Dr. GRPO: max_new_tokens).
    loss_agg_norm: float | None = None
    # Subtract the mean reward of the prompt group from each sample's reward (GRPO-style).
    group_baseline: bool = True
    # With group_baseline: the baseline of a sample is the mean of the *other* samples (RLOO).
    leave_one_out: bool = False
    # Normalise advantages to mean 0, std 1 over the valid tokens of the global batch.
    normalize_advantages: bool = True
    # batch: normalise over the global batch (above); group: divide by the std of the prompt
    # group's rewards (GRPO). normalize_advantages: false = no normalisation (Dr. GRPO).
    adv_norm_scope: str = "batch"
    # The standard deviation both scopes divide by: sample (ddof 1: AReaL v1.0.3's std_unbiased
    # default, verl's and TRL's torch.std) or population (ddof 0).
    adv_norm_std: str = "sample"
    # Multi-turn episodes whose trajectories carry turn_rewards: each model turn is credited with
    # its own reward, baselined on the same turn of its group (docs/algorithms.md); false = every
    # token of an episode gets the episode's reward.
    turn_credit: bool = True
    # KL penalty to the initial policy (a frozen copy of experiment.model, on either backend),
    # added as kl_coef * KL estimate (k1, k2 or k3), aggregated like the loss; 0 = off.
    kl_coef: float = 0.0
    # k1 = logp - ref, k2 = (ref - logp)^2 / 2, k3 = exp(ref - logp) - 1 - (ref - logp) (GRPO's).
    kl_estimator: str = "k3"
    # Entropy bonus: entropy_coef * entropy (aggregated like the loss) is subtracted; 0 = off.
    entropy_coef: float = 0.0
    # Every log-ratio is clamped to [-log_ratio_clamp, log_ratio_clamp] before exp: the policy
    # ratio, the behaviour weight at every level (a sequence's sum too) and k3 (verl v0.7.0: 20);
    # in (0, 30], so no product of a weight and a ratio overflows float32.
    log_ratio_clamp: float = 20.0
    # The per-token KL estimate is clamped to [-kl_clamp, kl_clamp] (verl v0.7.0, AReaL v1.0.3: 10).
    kl_clamp: float = 10.0
    # DAPO's soft overlong penalty: outputs longer than overlong_max_len - overlong_buffer tokens
    # lose up to overlong_penalty reward, linearly; 0 = off.
    overlong_buffer: int = 0
    # L_max of the overlong penalty: outputs of this length get the full penalty.
    overlong_max_len: int = II("rollout.max_new_tokens")
    # Reward lost at overlong_max_len tokens (DAPO: 1 for rewards of +-1).
    overlong_penalty: float = 1.0
    # Mask samples that hit the length limit without EOS (finish_reason "length") out of the loss.
    mask_truncated: bool = False
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
    # Published weight versions kept under <exp>/weights/ (oldest removed first). With coalesced
    # versions it also bounds how far the trainer publishes ahead of the controller: never a
    # version that would remove one still being loaded.
    keep_weights: int = 3
    # Wait for the controller's weights_ack before the next step (false = overlap the update
    # with the next step's training; the next publish still waits for the previous ack, except
    # with controller.interruptible false and disk weights: coalesced versions).
    wait_for_ack: bool = True
    # Seconds to wait for the controller's weights_ack before giving up on that version.
    ack_timeout_s: float = 600.0
    # Port of the weight-broadcast rendezvous (0 = pick a free one).
    broadcast_port: int = 0
    # Run the model on all sequences of a micro-batch at once (block-diagonal attention via
    # per-sequence position ids); false = one forward per sequence (slower, same numbers).
    packed_forward: bool = True
    # Torch backend: the dtype of the model's matrix products (torch.autocast). bfloat16 runs them
    # at a GPU's bf16 speed while weights, gradients and AdamW's moments stay float32 (mixed
    # precision, as TRL and verl's FSDP train); float32 multiplies without a GPU's bf16 tensor
    # cores. The Megatron backend's is trainer.megatron.params_dtype.
    compute_dtype: str = "float32"
    # Torch backend: activation recompute, one decoder layer per unit (transformers' gradient
    # checkpointing): a layer keeps only its input and recomputes the rest in the backward pass,
    # about a third more compute for a fraction of the activation memory. auto: on when the
    # rank's predicted peak without it (`tandem plan`'s estimate, from the model's shape,
    # max_tokens_per_mb and compute_dtype) exceeds the device's memory less 10%, decided at the
    # trainer's start (free GPU memory; the CPU has no limit unless TANDEM_DEVICE_MEMORY_BYTES
    # sets one) and logged. The Megatron backend's is trainer.megatron.recompute.
    recompute: bool | str = "auto"
    # torch.compile where it fuses the eager model's elementwise kernels (trainer/compiled.py).
    # Torch backend: each decoder layer and the log-prob chunks. Megatron backend: megatron-core's
    # fused SwiGLU (its kernels under torch.compile) and, with tensor_parallel 1, the log-prob
    # chunks. The first step of each trainer process compiles (seconds to a minute); values
    # agree with eager within float32 rounding.
    compile: bool = False
    # Tokens per chunk of the float32 log-softmax over the vocabulary, both backends (0 = the
    # whole micro-batch at once). Each chunk is recomputed in the backward pass, so the float32
    # copies of the logits (about 20 bytes per token per vocabulary entry) exist for one chunk
    # only: 3 GB at 1024 tokens and a 152K vocabulary, instead of 100 GB for a 34K-token pack.
    # Both backends make each chunk's logits from the hidden states (the output layer chunked
    # too; on the Megatron backend vocabulary-parallel over TP, `trainer/megatron/logprob_head.py`):
    # on an H200, 2.5 GB instead of 70 GB at 32K tokens for the torch backend's path, and
    # 1.4 GB instead of 17.4 GB at 8K tokens for the Megatron backend's (hidden 1,536).
    logprob_chunk: int = 1024
    # Megatron backend: tensor- and pipeline-parallel sizes (data parallel takes the rest).
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # Megatron backend, mixture-of-experts models: each layer's experts are split over this many
    # data-parallel ranks (expert parallelism; tokens travel to their experts' ranks). It must
    # divide the number of experts and the data-parallel size (trainer ranks / TP / PP).
    expert_parallel: int = 1
    # Rollout routing replay (R3), mixture-of-experts models: the generation servers return the
    # experts each sampled sequence was routed to, they travel with the trajectory, and every
    # trainer forward over it (policy, proximal, reference) routes those tokens through the same
    # experts, so the trainer's log-probs are the sampler's model's, not another routing's
    # (docs/megatron.md, "Routing replay"). Both backends; refused on a dense model.
    routing_replay: bool = False
    # Record the sampler's routed experts without replaying them: the step's record then has
    # moe_router_agreement (how often the trainer's own routers choose the sampler's experts), to
    # see what replay would change before turning it on. Implied by routing_replay.
    routing_agreement: bool = False
    # Torch threads of one trainer rank. The local launcher with launcher.cpus.pin gives each
    # rank as many threads as its CPU set instead (OMP/MKL threads follow).
    threads: int = 1
    # Interface the trajectory socket binds (rollout workers connect to it).
    host: str = "127.0.0.1"
    # 0 = pick a free port and publish it in <exp>/services/trainer.json.
    port: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    # LoRA adapters instead of full fine-tuning (torch backend only); rank 0 = off.
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Warnings when nothing is being learned, and the cap on groups dynamic sampling drops in a row.
    signals: SignalsConfig = field(default_factory=SignalsConfig)
    # A few trained samples (prompt, response, reward, version), decoded, every few steps.
    samples: SamplesConfig = field(default_factory=SamplesConfig)

    @property
    def records_routing(self) -> bool:
        """The workers ask for the sampler's routed experts and samples carry them (MoE models)."""
        return self.routing_replay or self.routing_agreement

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
        if self.compute_dtype not in ("float32", "bfloat16"):
            out.append(("compute_dtype", f"must be float32 or bfloat16, got {self.compute_dtype!r}"))
        elif self.compute_dtype != "float32" and self.backend != "torch":
            out.append(("compute_dtype", f"applies to the torch backend; trainer.backend: {self.backend} takes "
                                         f"trainer.megatron.params_dtype"))
        if self.recompute not in RECOMPUTE:
            out.append(("recompute", f"must be true, false or auto, got {self.recompute!r}"))
        elif self.recompute is True and self.backend != "torch":
            out.append(("recompute", f"applies to the torch backend; trainer.backend: {self.backend} takes "
                                     f"trainer.megatron.recompute"))
        if self.logprob_chunk < 0:
            out.append(("logprob_chunk", f"must be >= 0 (0 = the whole micro-batch), got {self.logprob_chunk}"))
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
        if self.expert_parallel < 1:
            out.append(("expert_parallel", "must be >= 1"))
        elif self.expert_parallel > 1 and self.backend != "megatron":
            out.append(("expert_parallel", f"expert parallelism (trainer.expert_parallel={self.expert_parallel}) is "
                                           f"the Megatron backend's; trainer.backend is {self.backend!r}"))
        elif self.expert_parallel > 1 and self.megatron.moe_token_dispatcher != "alltoall":
            out.append(("megatron.moe_token_dispatcher",
                        f"{self.megatron.moe_token_dispatcher!r} needs equal token counts on every "
                        f"expert-parallel rank (megatron-core 0.16.1), and packed micro-batches differ: "
                        f"use alltoall with trainer.expert_parallel={self.expert_parallel}"))
        if self.threads < 1:
            out.append(("threads", "must be >= 1"))
        if self.optim.lr <= 0:
            out.append(("optim.lr", "must be > 0"))
        if self.optim.grad_clip < 0:
            out.append(("optim.grad_clip", "must be >= 0 (0 disables clipping)"))
        if self.optim.warmup_steps < 0:
            out.append(("optim.warmup_steps", "must be >= 0"))
        out += [(f"optim.{k}", m) for k, m in schedule_problems(self.optim)]
        out += [(f"megatron.{k}", m) for k, m in self.megatron.problems()]
        out += [(f"lora.{k}", m) for k, m in self.lora.problems()]
        out += [(f"signals.{k}", m) for k, m in self.signals.problems()]
        out += [(f"samples.{k}", m) for k, m in self.samples.problems()]
        if self.lora.rank > 0 and self.backend != "torch":
            out.append(("lora.rank", f"LoRA (trainer.lora.rank={self.lora.rank}) is implemented on the torch backend "
                                     f"only, and trainer.backend is {self.backend!r}: set trainer.backend: torch, or "
                                     f"trainer.lora.rank: 0"))
        if self.lora.rank > 0 and self.lora.sync == "adapter" and self.weight_sync != "disk":
            out.append(("lora.sync", f"trainer.lora.sync: adapter publishes adapter directories on disk, and "
                                     f"trainer.weight_sync is {self.weight_sync!r} (it sends the whole merged "
                                     f"model): set trainer.lora.sync: merged, or trainer.weight_sync: disk"))
        out += objective_problems(self)
        return out
