"""Who sent the request being handled, and what that role may send (services/protocol/keys.py).

A request server learns each message's sender from its CURVE key and sets it here for the
handler; `may_send` is the rule its `senders` table is read by, `speaks_for` the rule for the
worker ids a sender may use.
"""
from __future__ import annotations

import contextvars

from .keys import ADMIN

# The identity of the sender of the request being handled (keys.py), for the handler to check
# what the sender may speak for (a worker id of its own, a group admitted to it).
_SENDER: contextvars.ContextVar[str] = contextvars.ContextVar("sender", default=ADMIN)


def sender() -> str:
    """The identity of the sender of the request being handled (`launcher` outside a handler)."""
    return _SENDER.get()


def may_send(identity: str | None, allowed: tuple[str, ...] | None) -> bool:
    """Whether `identity` may send an op open to `allowed`: identities, or prefixes ending in
    "-" (`rollout-`: every worker); None: every member. The launcher may send anything."""
    if allowed is None or identity == ADMIN:
        return True
    return identity is not None and any(identity == a or (a.endswith("-") and identity.startswith(a))
                                        for a in allowed)


def speaks_for(identity: str, worker_id: str) -> bool:
    """Whether `identity` may use `worker_id` (`rollout-<rank>-<pid>`: worker `rollout-<rank>`'s)."""
    return identity == ADMIN or worker_id == identity or worker_id.startswith(identity + "-")
