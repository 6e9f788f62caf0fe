"""The trainer's side of its conversation with the controller: a published version (the weight
message of trainer.weight_sync's method) and trainer_resumed.

The controller may be restarting when the trainer calls, or die while the trainer waits for its
answer (it comes back on the same port and re-announces itself in
`<exp>/services/controller.json`): the client watches the announcement while it waits and sends
the request again to the new process (a weight announcement lost with the old one would
otherwise hold the trainer for `ack_timeout_s`); an unreachable controller is retried until the
deadline, or until the trainer is told to stop (a dead controller must not hold its last
checkpoint for `ack_timeout_s`: a slot released too late is set right by the resume). A refusal
(an error reply) is
final: retrying would get the same answer, so it is logged and the trainer carries on.
"""
from __future__ import annotations

import logging
import time

from tandem.services.protocol import (
    CurveKeys,
    ExpDir,
    Ok,
    RemoteError,
    Shutdown,
    StatusReply,
    StatusRequest,
    SyncRequestClient,
    WeightsAck,
    read_service,
)
from tandem.trainer.weights import BackgroundCall

log = logging.getLogger(__name__)


class ControllerLink:
    def __init__(self, exp: ExpDir, keys: CurveKeys, shutdown: Shutdown, timeout_s: float):
        self.exp, self.keys, self.shutdown, self.timeout_s = exp, keys, shutdown, timeout_s
        self._client: SyncRequestClient | None = None

    def request(self, body, what: str, timeout_s: float | None = None):
        """The controller's reply body; None when it refused (logged) or never answered (within
        `timeout_s`, default the link's ack timeout)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while (left := deadline - time.monotonic()) > 0:
            try:
                return self._connect(timeout_s=min(left, 30.0)).request(
                    body, timeout_s=left, stop=lambda: self.shutdown.requested)
            except RemoteError as e:
                log.error("%s refused by the controller: %s", what, e)
                return None
            except (TimeoutError, OSError) as e:  # unreachable or restarting: look again, retry
                self.close()
                if self.shutdown.requested:
                    log.warning("%s: %s; not retried, stopping", what, e)
                    return None
                log.warning("%s: %s; retrying", what, e)
                time.sleep(min(1.0, max(left, 0)))
        return None

    def weights_ready(self, ready, sender: BackgroundCall | None = None) -> dict:
        """Announce a published version (`ready`: its method's weight message) and wait for the
        ack (and for the transfer `sender`, e.g. a broadcast, which runs meanwhile); returns the
        timings and outcome for the step's metrics."""
        t0 = time.perf_counter()
        ack = self.request(ready, f"{ready.OP} v{ready.version}")
        out = {"ack_wait_s": time.perf_counter() - t0}
        if sender is not None:
            try:
                out.update(sender.result(timeout_s=self.timeout_s))
                out["transfer_ok"] = True
            except Exception as e:  # servers that missed it are the controller's to repair
                log.error("weights v%d: transfer failed: %s", ready.version, e)
                out["transfer_ok"] = False
        if isinstance(ack, WeightsAck) and ack.superseded_by:
            # Coalesced versions: never applied; the servers went straight to a newer one.
            log.info("weights v%d: superseded by v%d before the controller applied it", ack.version,
                     ack.superseded_by)
            out["ack_ok"] = True
            out["superseded_by"] = ack.superseded_by
        elif isinstance(ack, WeightsAck):
            if not ack.ok or ack.failed_servers:
                log.warning("weights v%d: controller reports failed servers %s", ack.version, ack.failed_servers)
            out["ack_ok"] = ack.ok
            out["failed_servers"] = len(ack.failed_servers)
            out.update({f"ack_{k}": v for k, v in ack.timings.items()})
        elif isinstance(ack, Ok):
            out["ack_ok"] = True
        elif self.shutdown.requested:
            log.warning("weights v%d: stopping without the controller's ack", ready.version)
            out["ack_ok"] = False
        else:
            log.error("weights v%d: no ack from the controller (refused, or nothing within %.0fs); "
                      "continuing", ready.version, self.timeout_s)
            out["ack_ok"] = False
        return out

    def admission(self, timeout_s: float = 5.0) -> dict | None:
        """The admission ledger's counters (services/controller/admission.py), among them
        `rejected` (groups their workflow rejected, RejectGroup: dynamic sampling's all-equal
        groups, since the run began) and `rejected_in_a_row`; None if the controller does not say."""
        reply = self.request(StatusRequest(), "status", timeout_s=timeout_s)
        if isinstance(reply, StatusReply) and isinstance(reply.state.get("rejected"), int):
            return reply.state
        return None

    def _connect(self, timeout_s: float) -> SyncRequestClient:
        info = read_service(self.exp, "controller", timeout_s=timeout_s)
        address = info.get("address")
        if not address:
            raise OSError(f"{self.exp.service_file('controller')} has no 'address'")
        if self._client is None or self._client.address != address:
            self.close()
            self._client = SyncRequestClient(self.keys, address, timeout_s=timeout_s, resolve=self._announcement)
        return self._client

    def _announcement(self) -> dict:
        return read_service(self.exp, "controller")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
