"""Messages between rollout workers, generation servers, the trainer and the controller."""
from __future__ import annotations

from typing import Literal

from .codec import message


@message("ok")
class Ok:
    """Generic positive reply for requests whose answer carries nothing else."""
    detail: str = ""


@message("admit")
class AdmitRequest:
    """A worker asks for up to `max_groups` tickets (batched admission)."""
    worker_id: str
    max_groups: int = 1


@message("ticket")
class Ticket:
    group_id: str
    admit_version: int
    # The controller's signature of this ticket for the worker it was granted to (keys.ticket_mac):
    # the trainer trains a group only from the worker it was admitted to.
    mac: str = ""


@message("admit_reply")
class AdmitReply:
    tickets: list[Ticket]
    version: int
    # When no ticket was granted: how long to wait before asking again.
    retry_after_s: float = 0.0


@message("group_done")
class GroupDone:
    """A worker reports a group's end; rejected and failed release the slot."""
    worker_id: str
    group_id: str
    status: Literal["accepted", "rejected", "failed"]
    reason: str = ""


@message("heartbeat")
class Heartbeat:
    """Keeps a worker's lease alive; lists the groups it still runs (reconciled by the controller)."""
    worker_id: str
    running: list[str]


@message("heartbeat_reply")
class HeartbeatReply:
    version: int
    # Groups the controller no longer considers this worker's (lease expired, unknown): stop them.
    revoked: list[str]


# ---- weight sync: one message per method ---------------------------------------------------
# The trainer sends one of these after publishing a version; the controller's applier for that
# message (services/controller/weights/) brings the servers to it. A new method (CUDA IPC,
# bucketed NCCL) is one more message here, one publisher file in trainer/weights/ and one
# applier file in services/controller/weights/.


@message("weights_on_disk")
class WeightsOnDisk:
    """Version `version` is a Hugging Face directory at `path` (on a filesystem the servers see)."""
    version: int
    path: str


# The name generation servers serve the policy's LoRA adapter under (`trainer.lora.sync:
# adapter`): every /generate request of such a run names it (`lora_path`), each server starts
# with version 0's adapter under it (`--lora-paths`), and each update swaps what it names.
POLICY_ADAPTER = "policy"


@message("adapter_on_disk")
class AdapterOnDisk:
    """Version `version` is peft's LoRA adapter directory at `path` (adapter_config.json and
    adapter_model.safetensors, trained on the servers' base model): the servers serve it as
    `POLICY_ADAPTER` from then on."""
    version: int
    path: str


@message("weights_broadcast")
class WeightsBroadcast:
    """Version `version` will be broadcast tensor by tensor from the trainer (rank 0).

    `world_size` = 1 + the sum of the receiving servers' TP sizes: in SGLang every TP rank of a
    server joins the group, at rank `rank_offset + tp_rank` (the controller assigns the offsets).
    """
    version: int
    group_name: str
    master_address: str
    master_port: int
    world_size: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


@message("weights_ack")
class WeightsAck:
    version: int
    ok: bool
    # Servers that failed the update and were taken out of rotation.
    failed_servers: list[str]
    timings: dict[str, float]
    # Non-zero: this version was never applied; a newer one announced while it waited for the
    # previous update is applied instead (coalesced versions; 0 in acks of older controllers).
    superseded_by: int = 0


@message("register_server")
class RegisterServer:
    """A generation server joins the rotation."""
    address: str
    # Name of the key file under <exp>/keys/ holding its bearer API key ("" = no key): used for
    # the routes SGLang guards at its NORMAL level (/generate, /model_info, /v1/loads).
    api_key_ref: str = ""
    capacity: int = 64
    # Key file of its admin key (SGLang's --admin-api-key; "" = none): pause/continue, weight
    # updates and sessions, abort, flush. With an admin key set, SGLang refuses the API key there.
    admin_key_ref: str = ""
    # Tensor-parallel size (GPUs per server); 0 = ask the server (/server_info's `tp_size`).
    tp_size: int = 0
    # Its weight relay's "host:port" (gen.weight_relay; "" = none: it reads disk versions itself),
    # and the node whose copy it loads (servers with the same `relay_node` share one copy).
    relay: str = ""
    relay_node: str = ""


@message("retire_server")
class RetireServer:
    """The launcher takes generation server `address` away from the run (the elastic split gives
    its CPUs or GPUs to training). The controller takes it out of rotation, so nothing new is
    routed to it; waits up to `timeout_s` for a weight update in progress (the update would
    resume it); pauses it in abort mode, so its in-flight requests come back to their clients,
    which ask the controller again and are routed to the other servers with the tokens they have;
    then forgets it. Answered Ok once the server is forgotten (the launcher may then stop it),
    an error when the address is unknown, the last server, or the update outlasted `timeout_s`
    (the server then stays in the run as it was)."""
    address: str
    timeout_s: float = 60.0


@message("pick_server")
class PickServer:
    """A worker asks where to send a request; `sticky_key` keeps a resumed request in place."""
    worker_id: str
    sticky_key: str = ""
    # Servers that just failed for this worker: never chosen (unless no other is in rotation).
    exclude: list[str] | None = None


@message("server_choice")
class ServerChoice:
    """Where to send a generation request; `address` empty when no server is servable now (a
    normal state — all paused for a weight update, restarting — not an error), `wait_reason`
    then says why and the caller backs off and asks again."""
    address: str
    api_key_ref: str = ""
    wait_reason: str = ""


@message("trainer_resumed")
class TrainerResumed:
    """The trainer restarted from a checkpoint at `version` (sent before it takes data).

    The trainer is the authority on versions and on what it holds: the controller rebases its
    version to `version` and its accepted count to `groups_held` (groups consumed by training
    plus complete groups in the restored replay buffer; not dropped or refused ones), so the
    staleness bound is computed from what the trainer really has, not from groups lost with the
    crashed trainer. Weights an abandoned launch published past `version` stop being the ones
    servers are caught up to; the trainer publishes `version` again right after.
    """
    version: int
    groups_held: int


@message("launch_started")
class LaunchStarted:
    """The launcher started a new launch of the experiment (`tandem run`, `--resume` included),
    before any generation server registers: servers registered by an earlier launch are gone
    (its teardown stopped them) and are forgotten, not polled and updated for ever."""
    launch_id: str


@message("groups_dropped")
class GroupsDropped:
    """The trainer discarded these accepted groups as staler than eta (stale_policy: drop).

    Their admission slots are released, as for rejected groups; otherwise every drop would
    shrink the staleness budget for good and enough of them would stall the run.
    """
    group_ids: list[str]
    reason: str = ""


@message("status")
class StatusRequest:
    """Ask a service for its state (for `tandem status`, tests and the launcher)."""


@message("status_reply")
class StatusReply:
    state: dict
