"""What the trainer checks of each trajectory before it is logged or buffered: that its sender may
send it, and that its tokens can be trained.

A rollout worker's key lets it speak for itself only (services/protocol/keys.py). So a sample is
refused, alone, when:
- its sender is not a rollout worker (or the launcher, the user's own key: tests, tools);
- its ticket was not signed by the controller for that worker: a group the controller never
  admitted, or another worker's (a holder of one worker's key once trained a group of its own
  making, and by squatting the next group ids with bad samples made the trainer refuse the real
  groups, which stalled the run);
- its prompt key names another worker's data.
Refused here, a sample costs only itself: it never reaches the group it names, the log, or a
resume. Token ids outside the model's vocabulary are the buffer's check (`validate`, which sees
the vocabulary through `vocab_size`): a trajectory holding one once entered the log and killed the
trainer at every resume.
"""
from __future__ import annotations

import hmac
from pathlib import Path

from tandem.services.protocol import ADMIN, Trajectory, ticket_mac


class TrajectoryCheck:
    def __init__(self, keys_dir: str | Path, vocab_size: int):
        self.keys_dir, self.vocab_size = Path(keys_dir), vocab_size

    def refusal(self, t: Trajectory, sender: str | None) -> str | None:
        """Why `t`, sent by `sender`, is refused before anything else looks at it (None: it is not)."""
        if sender == ADMIN:
            return None
        if sender is None or not sender.startswith("rollout-"):
            return f"{sender} does not send trajectories"
        if not hmac.compare_digest(t.ticket_mac, ticket_mac(self.keys_dir, t.group_id, t.admit_version, sender)):
            return f"group {t.group_id} (version {t.admit_version}) was not admitted to {sender}"
        rank = sender.removeprefix("rollout-")
        if t.prompt_key is not None and not t.prompt_key.startswith(f"{rank}:"):
            return f"prompt key {t.prompt_key!r} is not {sender}'s"
        return None


def model_vocab_size(model_dir: str | Path) -> int:
    """Rows of the model's token embedding: a token id must be below it (transformers' config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    return int(config.get_text_config().vocab_size)


def replay_routing(tcfg, model_dir: str | Path) -> tuple[int, int, int] | None:
    """(layers, top_k, experts) every sample's routed experts must have when the run replays
    routes or measures their agreement (trainer.records_routing), else None (the buffer then
    takes samples with or without)."""
    if not getattr(tcfg, "records_routing", False):
        return None
    import json

    from tandem.services.protocol.trajectory import routing_shape
    shape = routing_shape(json.loads((Path(model_dir) / "config.json").read_text()))
    if shape is None:
        raise SystemExit(f"trainer.routing_replay/routing_agreement: {model_dir} has no experts to route")
    return shape
