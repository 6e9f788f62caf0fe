"""The published interface all roles share: message schemas, framing, transports, discovery.

Roles import from here and from the generation client (`rollout.client`) only, never from
each other's internals.
"""
from . import control, grading, trajectory  # noqa: F401  (registers the message schemas)
from .codec import PROTOCOL_VERSION, REGISTRY, Envelope, ProtocolError, decode, encode, message
from .control import (
    POLICY_ADAPTER,
    AdapterOnDisk,
    AdmitReply,
    AdmitRequest,
    GroupDone,
    GroupsDropped,
    Heartbeat,
    HeartbeatReply,
    LaunchStarted,
    Ok,
    PickServer,
    RegisterServer,
    RetireServer,
    ServerChoice,
    StatusReply,
    StatusRequest,
    Ticket,
    TrainerResumed,
    WeightsAck,
    WeightsBroadcast,
    WeightsOnDisk,
)
from .expdir import (
    ExpDir,
    numbered_dirs,
    previous_port,
    publish_service,
    read_service,
    remove_leftovers,
    write_json_atomic,
)
from .grading import GradeItem, GradeReply, GradeRequest, Verdict, code_tests_problem, item_row
from .keys import ADMIN, CurveKeys, generate_keys, load_keys, ticket_mac, worker_identity
from .runtime import (
    STOP_GRACE_S,
    MetricsWriter,
    PhaseTimer,
    Shutdown,
    attention_without_cudnn,
    exit_process,
    import_user_module,
    raise_descriptor_limit,
    read_metrics,
    setup_role_logging,
)
from .senders import sender, speaks_for
from .service_port import serve_at_previous_address
from .trajectory import Trajectory, TrajectoryReceipt
from .trajectory_channel import TrajectorySink, TrajectorySource
from .transport import (
    RemoteError,
    RequestClient,
    RequestServer,
    SyncRequestClient,
    free_port,
)

__all__ = [
    "PROTOCOL_VERSION", "REGISTRY", "Envelope", "ProtocolError", "decode", "encode", "message",
    "POLICY_ADAPTER", "AdapterOnDisk", "AdmitReply", "AdmitRequest", "GroupDone", "GroupsDropped", "Heartbeat", "HeartbeatReply", "LaunchStarted", "Ok", "PickServer",
    "RegisterServer", "RetireServer", "ServerChoice", "StatusReply", "StatusRequest", "Ticket", "TrainerResumed", "WeightsAck",
    "WeightsBroadcast", "WeightsOnDisk", "ExpDir", "numbered_dirs", "remove_leftovers", "previous_port", "publish_service", "read_service", "write_json_atomic", "GradeItem",
    "GradeReply", "GradeRequest", "Verdict", "code_tests_problem", "item_row", "ADMIN", "CurveKeys", "generate_keys", "load_keys", "ticket_mac", "worker_identity",
    "MetricsWriter", "PhaseTimer", "Shutdown", "STOP_GRACE_S", "attention_without_cudnn", "exit_process", "import_user_module", "raise_descriptor_limit", "read_metrics", "setup_role_logging", "Trajectory", "TrajectoryReceipt", "RemoteError",
    "RequestClient", "RequestServer", "SyncRequestClient", "TrajectorySink", "TrajectorySource", "free_port", "sender", "speaks_for",
    "serve_at_previous_address",
]
