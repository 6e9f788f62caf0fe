"""The contract between the RL algorithm and whatever holds the model (torch or Megatron-core).

The loop (buffer, advantages, PPO loss, micro-batching, publishing, checkpoints) must not care
whether the parameters live in one `transformers` module on a CPU or are sharded by Megatron
over tensor/pipeline/data parallel ranks. So a backend does only what needs the model:

- log-probs of a packed micro-batch, with the temperature applied as the generation server
  does (`log_softmax(logits / T)`), with or without autograd;
- one optimizer update over several micro-batches, given a loss function of those log-probs;
- state for checkpoints, an exported Hugging Face directory, and full tensors for broadcast.

Token alignment (the same for every backend): `PackedBatch.input_ids` is the concatenation of
whole sequences (prompt + output). The log-prob returned at flat position `i` is
`log p(input_ids[i] | the tokens before i in the same sequence)`; the first position of every
sequence has no prediction and gets 0. Per-token training fields (`loss_mask`, behaviour
log-probs, advantages ...) use the same positions, so the loss never shifts anything.

Loss scaling: `loss_fn` returns a micro-batch's share of the minibatch loss, already divided by
the number of valid tokens of the *whole* minibatch over *all* data-parallel ranks. A backend
therefore SUMS gradients over micro-batches and over data-parallel ranks (no averaging), then
clips and steps. With that rule, any split of a minibatch into micro-batches and ranks gives
the same gradient as one big batch (a test checks it).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.services.protocol import collectives
from tandem.trainer.objectives import LOSS_TERMS


@dataclass
class PackedBatch:
    """Variable-length sequences concatenated without padding (one micro-batch)."""
    # int64 [N]: the tokens of all sequences, back to back.
    input_ids: torch.Tensor
    # int64 [N]: position within its own sequence (restarts at 0 for every sequence).
    position_ids: torch.Tensor
    # int32 [S+1]: sequence boundaries, cu_seqlens[s]..cu_seqlens[s+1] is sequence s.
    cu_seqlens: torch.Tensor
    # Per-token tensors aligned with input_ids, e.g. loss_mask (bool), behav_logp, prox_logp,
    # advantages (float32), versions (int64). Backends pass them through untouched.
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    # Index of each packed sequence in the step's batch (to scatter results back).
    seq_index: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def n_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def seqlens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def on(self, device: torch.device) -> PackedBatch:
        """This micro-batch with its tokens, positions and fields on `device` (`to_device`), its
        bounds left where the packer made them, on the host (model.bounds_device says why)."""
        return PackedBatch(to_device(self.input_ids, device), to_device(self.position_ids, device), self.cu_seqlens,
                           {k: to_device(v, device) for k, v in self.fields.items()}, self.seq_index)


@dataclass
class TokenOutputs:
    """What a forward pass gives the loss: both float32 [N], aligned with input_ids."""
    logp: torch.Tensor
    # Entropy of softmax(logits / T) at the position that predicts each token (no gradient);
    # None when not asked for.
    entropy: torch.Tensor | None = None


# loss_fn(micro_batch, outputs) -> (scalar loss with grad, {stat name: sum over tokens}), each stat a
# float or a 0-d tensor left on the device: the backend reads them all once per step (add_stats,
# stats_on_host), so no micro-batch makes the host wait for the GPU.
LossFn = Callable[[PackedBatch, TokenOutputs], tuple[torch.Tensor, dict[str, "float | torch.Tensor"]]]


@dataclass
class StepResult:
    """What one optimizer update reports (identical on every rank)."""
    grad_norm: float
    lr: float
    # Sums of the stats returned by loss_fn over this rank's micro-batches ("*_max" keys: maxima).
    # The loop SUMS them over all ranks of the job, so when several ranks see the same tokens
    # (tensor/pipeline parallel) exactly one of them reports the sums, the others zeros.
    stats: dict[str, float] = field(default_factory=dict)
    # False when the gradient was not finite and the update was skipped.
    applied: bool = True
    # Loss terms that were NaN or inf on any rank: {term: micro-batches}; the update was not
    # applied and the loop stops the step (agreed_nonfinite).
    nonfinite: dict[str, int] = field(default_factory=dict)


def packed_sequences(cu_seqlens: torch.Tensor, dim: int, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each packed sequence's part of every tensor along `dim` (bounds `cu_seqlens`, from 0 to the
    row's end), as one tuple per sequence. The bounds are read to the host once for all tensors
    (on a GPU each read waits for the device), and each tensor is taken apart by one `split`: its
    backward writes each sequence's gradient into one tensor of the row's size. Slicing each
    sequence instead (`x[a:b]`) makes a row-sized zero gradient per sequence and adds them all
    up, work in the number of sequences times the row's length: on an H200, at 0.5B and 32K-token
    packs of 1K-token sequences, most of the step's 5,167 `fill_` and 5,830 `add_` kernels, 50
    and 112 ms of its 1,244 ms (benchmarks/results/gpu_speed.json)."""
    bounds = cu_seqlens.tolist()
    for x in tensors:
        if bounds[0] != 0 or bounds[-1] != x.size(dim):
            raise ValueError(f"cu_seqlens {bounds[:3]}...{bounds[-1:]} does not cover the packed row of "
                             f"{x.size(dim)} tokens")
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return list(zip(*(x.split(sizes, dim=dim) for x in tensors), strict=True))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. To a GPU from the host through pinned memory without blocking: a plain
    copy from pageable memory synchronises the GPU's stream first (PyTorch waits for it), so every
    micro-batch's tensors would make the host wait for the previous micro-batch's kernels."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def add_stats(total: dict, stats: dict) -> None:
    """Adds one micro-batch's loss statistics into the step's, in place: sums, the maximum for the
    `*_max` keys. Device tensors stay on the device (float64 from the first micro-batch on, as
    Python floats summed before) until `stats_on_host` reads them all at once."""
    for k, v in stats.items():
        if isinstance(v, torch.Tensor):
            v = v.detach()
        if k not in total:   # later micro-batches' values promote to the total's float64
            total[k] = v.to(torch.float64) if isinstance(v, torch.Tensor) else v
        elif not k.endswith("_max"):
            total[k] = total[k] + v
        elif isinstance(v, torch.Tensor) or isinstance(total[k], torch.Tensor):
            total[k] = torch.maximum(torch.as_tensor(total[k], dtype=torch.float64), torch.as_tensor(v))
        else:
            total[k] = max(total[k], v)


def stats_on_host(stats: dict) -> dict[str, float]:
    """The step's statistics as Python floats: the device tensors among them read in one transfer,
    the step's one wait for the GPU on their account."""
    on_device = {k: v for k, v in stats.items() if isinstance(v, torch.Tensor)}
    read = {}
    if on_device:
        first = next(iter(on_device.values()))
        values = torch.stack([v.reshape(()).to(first.device, torch.float64) for v in on_device.values()])
        read = dict(zip(on_device, values.tolist(), strict=True))
    return {k: read[k] if k in read else float(v) for k, v in stats.items()}


def agreed_nonfinite(stats: dict[str, float]) -> dict[str, int]:
    """{term: micro-batches} of the loss terms (trainer/objectives.py LOSS_TERMS) that were NaN or inf
    on any rank in this update, from the `nonfinite_<term>` stats: the same dict on every rank
    (one all-reduce when a process group is up), so every rank refuses the update together and
    no collective is left waiting. Called by every backend between the backward passes and the
    optimizer step: a non-finite loss must stop the update explicitly, not by hoping its NaN
    reaches the gradient norm (Megatron's bf16 optimizer, with no loss scaler, would apply it).
    Stats must be counted once per token (Megatron's _count_once) before this call."""
    counts = torch.tensor([stats.get(f"nonfinite_{t}", 0.0) for t in LOSS_TERMS], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        collectives.all_reduce(counts)
    return {t: int(c) for t, c in zip(LOSS_TERMS, counts.tolist(), strict=True) if c > 0}


class TrainBackend(ABC):
    """One instance per trainer rank. Collective methods must be called on every rank."""

    # Global rank and size of the trainer job; rank 0 owns the buffer and publishes.
    rank: int = 0
    world_size: int = 1
    # Data-parallel coordinates: micro-batches are split over dp_size groups of ranks.
    dp_rank: int = 0
    dp_size: int = 1
    # True: train_step's `outputs.entropy` carries a gradient (an entropy bonus in the loss);
    # False (default): detached.
    entropy_grad: bool = False

    @abstractmethod
    def forward_logprobs(self, mb: PackedBatch, temperature: float, *, with_entropy: bool = False
                         ) -> TokenOutputs:
        """Log-probs under the current parameters, without autograd (proximal recompute).

        Called with this rank's micro-batches only; with pipeline parallelism every stage
        must return the same tensors (broadcast from the last stage).
        """

    def forward_ref_logprobs(self, mb: PackedBatch, temperature: float) -> TokenOutputs:
        """Log-probs under the *initial* policy (experiment.model), no grad: for a KL penalty to
        it. Optional: a backend that keeps no frozen copy of the initial weights refuses."""
        raise NotImplementedError(f"{type(self).__name__} keeps no copy of the initial policy: a KL "
                                  f"penalty (trainer.kl_coef > 0) is not available on this backend")

    @abstractmethod
    def train_step(self, mbs: list[PackedBatch], loss_fn: LossFn, temperature: float) -> StepResult:
        """One optimizer update: forward + backward every micro-batch (gradients summed), sum
        over data-parallel ranks, clip to `optim.grad_clip`, step the optimizer and LR schedule.
        `outputs.entropy` is filled for loss_fn (detached). Every DP rank gets the same number
        of micro-batches (the allocator guarantees it; an empty one may be a zero-token batch).
        """

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the backend's own for the step's record, over the updates since the last call
        (the Megatron backend's MoE routing: expert load and dropped tokens per layer). Collective:
        the loop calls it on every rank once per step. Default: none."""
        return {}

    @abstractmethod
    def state_dict(self) -> dict:
        """Everything to resume bit-exactly: model, optimizer, LR schedule (this rank's share).
        Torch tensors and plain Python values only, so `torch.save` can write it."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Inverse of state_dict (same world layout)."""

    # True when the loop's checkpoints hold this backend's state as one sharded directory
    # written by save_checkpoint (collective, reloadable into another parallel layout, e.g.
    # Megatron's dist checkpointing) instead of every rank's state_dict() (same layout only).
    sharded_checkpoint: bool = False

    def save_checkpoint(self, ckpt_dir: Path) -> None:
        """Collective: write model and optimizer into `ckpt_dir` (sharded backends only)."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints through state_dict()")

    def load_checkpoint(self, ckpt_dir: Path) -> None:
        """Collective: inverse of save_checkpoint, in any parallel layout."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints through state_dict()")

    @abstractmethod
    def export_hf(self, out_dir: Path) -> None:
        """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files) that
        `AutoModelForCausalLM.from_pretrained` loads. Collective; only rank 0 writes."""

    @abstractmethod
    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, full unsharded tensor) in a fixed order, for weight broadcast.
        Collective (TP shards are gathered); meaningful on rank 0, others may yield nothing."""

    def close(self) -> None:
        """Free process groups and memory (optional)."""
        return None

