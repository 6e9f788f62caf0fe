"""The unit that flows from rollout workers to the trainer's replay buffer."""
from __future__ import annotations

import numpy as np

from .codec import message


@message("trajectory")
class Trajectory:
    """One sample of a prompt group; token arrays travel as raw bytes (see codec)."""
    group_id: str
    sample_idx: int
    # n: samples in the group; the buffer holds a group until all n arrived.
    group_size: int
    prompt_ids: np.ndarray        # int32 [P]
    output_ids: np.ndarray        # int32 [T]
    output_logprobs: np.ndarray   # float32 [T], behaviour policy log-probs
    output_versions: np.ndarray   # int32 [T], policy version that sampled each token
    admit_version: int
    reward: float
    finish_reason: str
    task: str
    timings: dict[str, float]
    # uint8 [T]: 1 = a model token (trained), 0 = a token the environment wrote into the
    # context (a multi-turn episode's feedback): the model reads it but is never trained on it.
    # Absent = every output token is the model's. Environment tokens carry log-prob 0 and the
    # version of the model token before them.
    output_mask: np.ndarray | None = None
    # float32 [K]: the reward of each of the K model turns (the runs of output_mask 1), e.g. each
    # program's verdict in a multi-turn code episode; `reward` is the episode's. Absent = the
    # episode's reward is the only one. The trainer may credit each turn with its own
    # (trainer.turn_credit).
    turn_rewards: np.ndarray | None = None
    # "<worker rank>:<prompt index>": the prompt's place in its worker's data. A worker issues a
    # prompt again only when its group did not settle, so a second group with the same key is
    # the same prompt sent again (its worker died before the receipts were saved): the trainer
    # trains one group per key (trainer/buffer.py). Absent = no such check.
    prompt_key: str | None = None
    # Rollout routing replay (MoE models, trainer.routing_replay): uint8 (uint16 past 256 experts)
    # [P + T - 1, layers, top_k], the experts the sampler routed every position it fed to the
    # model to: the prompt's and the output's but the last token, which was never fed (SGLang's
    # `routed_experts` from start 0). The trainer's forwards route the same positions through
    # them. Absent = no replay (the trainer routes by itself).
    routed_experts: np.ndarray | None = None
    # The admission ticket's signature (Ticket.mac), which the worker copies from its ticket:
    # the trainer refuses a sample whose ticket was not granted to the worker that sent it.
    ticket_mac: str = ""


def routing_shape(config: dict) -> tuple[int, int, int] | None:
    """(layers, top_k, experts per layer) of a model's config.json, the shape of its routed
    experts; None for a dense model. One row per layer, `num_hidden_layers`, as SGLang 0.5.23's
    capturer sizes them (`state_capturer/routed_experts.py`); replay needs every layer to route
    (`dense_layers` says which do not)."""
    config = config.get("text_config", config)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return None
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"]), experts


def dense_layers(config: dict) -> list[int]:
    """The layers of a Qwen3-MoE config.json without experts (`mlp_only_layers`, and those
    `decoder_sparse_step` skips, as transformers builds the model)."""
    config = config.get("text_config", config)
    step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or [])
    return [i for i in range(int(config.get("num_hidden_layers") or 0)) if i in dense or (i + 1) % step]


def compact_experts(ids) -> np.ndarray | None:
    """Expert ids [positions, layers, top_k] as they travel: uint8 while every id fits (256
    experts; Qwen3-30B-A3B has 128), else uint16. None stays None."""
    if ids is None:
        return None
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**16):
        raise ValueError(f"expert ids outside [0, 65536): {ids.min()}..{ids.max()}")
    return ids.astype(np.uint8 if not ids.size or ids.max() < 256 else np.uint16)


@message("trajectory_receipt")
class TrajectoryReceipt:
    """The trainer holds this sample durably (in its log or a checkpoint): the worker that sent
    it may count its group delivered and its prompt used (see trajectory_channel.py)."""
    group_id: str
    sample_idx: int
