"""The controller's part of the experiment config (section `controller`)."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import II


@dataclass
class ControllerConfig:
    """The controller: policy versions, staleness-bounded admission, weight-sync orchestration."""
    # eta: training data is never more than this many policy versions stale; 0 = synchronous RL.
    max_staleness: int = 4
    # B, prompt groups per training step; owned by the trainer, mirrored here for admission.
    groups_per_step: int = II("trainer.groups_per_step")
    # Upper bound on groups generating at once, whatever the staleness budget allows.
    max_concurrent_groups: int = 256
    # A group whose worker has not heartbeated for this long is failed and its slot released.
    lease_s: float = 30.0
    host: str = "127.0.0.1"
    # 0 = pick a free port and publish it in <exp>/services/controller.json.
    port: int = 0
    # Most tickets one admit request may receive, whatever it asks for.
    max_tickets_per_request: int = 256
    # Seconds a worker is told to wait before asking again when no ticket was free.
    retry_after_s: float = 0.2
    # Seconds between full state snapshots (each version change also snapshots at once; every
    # change in between is in the journal, so a killed controller loses nothing).
    snapshot_interval_s: float = 10.0
    # Seconds between two metrics records in <exp>/metrics.jsonl.
    metrics_interval_s: float = 5.0
    # Seconds between health checks of each registered generation server.
    health_interval_s: float = 5.0
    # Consecutive failed health checks after which a server gets no new requests.
    health_failures: int = 3
    # Timeout of one health check or information request to a generation server.
    http_timeout_s: float = 10.0
    # Timeout of pause/continue and of one weight update on one server (loading a large model
    # from disk or receiving a broadcast takes minutes).
    update_timeout_s: float = 600.0
    # Interruptible generation: a weight update pauses the servers (interrupt_mode) and in-flight
    # samples continue under the new weights (per-token versions). False: no pause; the update
    # waits for in-flight requests to finish under the old weights (the non-interruptible baseline);
    # with disk weights and trainer.wait_for_ack false the trainer publishes on meanwhile and the
    # servers go straight to the newest version, skipping those they never served (coalesced).
    interruptible: bool = True
    # How the pause treats in-flight requests (SGLang's /pause_generation modes). abort: they
    # return at once with their partial output and the generation client resubmits them as
    # prompt + partial output; retract: they stay queued on the server and are re-prefilled
    # under the new weights after the update (nothing is resubmitted; replies carry
    # weight_versions spans); in_place: they keep their KV cache, computed by the old weights, and
    # go on with the new ones (no re-prefill; updates are sent with flush_cache: false, as SGLang
    # requires for it). Behaviour log-probs are exact in every mode: they are the probabilities
    # the tokens were sampled with.
    interrupt_mode: str = "in_place"
    # Stickiness memory: sticky keys remembered (least recently used forgotten first).
    sticky_entries: int = 65536
    # torch.distributed backend the servers join a weight-broadcast group with; the embedded
    # server falls back to gloo without CUDA, so nccl suits GPU clusters and this machine alike.
    broadcast_backend: str = "nccl"

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.max_staleness < 0:
            out.append(("max_staleness", "must be >= 0 (0 means synchronous RL)"))
        if self.max_concurrent_groups < 1:
            out.append(("max_concurrent_groups", "must be >= 1"))
        if self.lease_s <= 0:
            out.append(("lease_s", "must be > 0"))
        if self.max_tickets_per_request < 1:
            out.append(("max_tickets_per_request", "must be >= 1"))
        for key in ("snapshot_interval_s", "metrics_interval_s", "health_interval_s", "http_timeout_s",
                    "update_timeout_s"):
            if getattr(self, key) <= 0:
                out.append((key, "must be > 0"))
        if self.retry_after_s < 0:
            out.append(("retry_after_s", "must be >= 0"))
        if self.health_failures < 1:
            out.append(("health_failures", "must be >= 1"))
        if self.sticky_entries < 0:
            out.append(("sticky_entries", "must be >= 0"))
        if self.interrupt_mode not in ("abort", "retract", "in_place"):
            out.append(("interrupt_mode", f"must be 'abort', 'retract' or 'in_place', got {self.interrupt_mode!r}"))
        if self.broadcast_backend not in ("gloo", "nccl"):
            out.append(("broadcast_backend", f"must be 'gloo' or 'nccl', got {self.broadcast_backend!r}"))
        return out
