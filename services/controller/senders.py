"""What the controller takes from whom: the ops each role sends, the worker ids a sender may use,
and the size of a frame (services/protocol/keys.py, senders.py)."""
from __future__ import annotations

from tandem.services.protocol import sender, speaks_for


def require_own_id(value: str, where: str) -> None:
    """A worker id: one line of at most 200 characters, and the sender's own (a worker speaks
    for itself only: keys.py)."""
    if not value or len(value) > 200:
        raise ValueError(f"{where} must be a non-empty string of at most 200 characters")
    if not speaks_for(sender(), value):
        raise ValueError(f"{where} {value!r} is not {sender()}'s: a worker speaks for itself only")


# Who may send what (protocol senders.may_send; the launcher may send everything, `status` anyone):
# workers run groups, the trainer announces versions, the launcher manages servers and launches.
SENDERS = {"admit": ("rollout-",), "group_done": ("rollout-",), "heartbeat": ("rollout-",),
           "pick_server": ("rollout-", "eval"), "trainer_resumed": ("trainer",), "groups_dropped": ("trainer",),
           "register_server": (), "retire_server": (), "launch_started": ()}
# Frames larger than this are cut off by the socket (a 56 MiB heartbeat once froze the controller
# for 25 s): the largest a controller is sent is a broadcast's tensor list, about 2 MB for a
# mixture-of-experts model of 18,000 tensors.
MAX_FRAME_BYTES = 4 << 20
