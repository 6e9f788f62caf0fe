"""`tandem controller --exp DIR`: the process that keeps generation and training in step.

It answers the control messages of `services.protocol.control` on one CURVE-secured ROUTER
socket (address in `<exp>/services/controller.json`):
  admit / group_done / heartbeat   rollout workers (admission.py: the staleness rule, leases)
  weights_on_disk / weights_broadcast / trainer_resumed
                                   the trainer (weight_sync.py and weights/: one message and one
                                   applier per weight-sync method; a resumed trainer's version wins)
  register_server / pick_server    generation servers and routing (registry.py)
  retire_server                    the launcher takes a server away (elastic split, `retire`)
  status                           anyone with the experiment's key
Background: lease expiry, health checks (which also catch lagging servers up), snapshots and
metrics. A health check never runs a generation: it reads `/model_info` (liveness and the
version the server holds) and `/v1/loads` (requests running + waiting); SGLang answers both
without the scheduler, so a server paused for a long update is not mistaken for a dead one.
State lives in `<exp>/checkpoints/controller/` (state.py); a restarted controller continues
from it and, when it can, on the same port, so clients reconnect by themselves.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp

from tandem.rollout.client import AdminClient, AdminError, parse_version, server_load
from tandem.services.config import ControllerConfig
from tandem.services.protocol import (
    AdmitReply,
    AdmitRequest,
    ExpDir,
    GroupDone,
    GroupsDropped,
    Heartbeat,
    HeartbeatReply,
    LaunchStarted,
    MetricsWriter,
    Ok,
    PickServer,
    RegisterServer,
    RequestServer,
    RetireServer,
    ServerChoice,
    Shutdown,
    StatusReply,
    StatusRequest,
    Ticket,
    TrainerResumed,
    WeightsAck,
    load_keys,
    publish_service,
    sender,
    serve_at_previous_address,
    setup_role_logging,
    ticket_mac,
)

from .admission import AdmissionLedger
from .pending_versions import PendingVersions
from .registry import RegisteredServer, ServerRegistry, learn_tp_size
from .retirement import retire
from .senders import MAX_FRAME_BYTES, SENDERS, require_own_id
from .state import StateStore
from .weight_sync import WeightSync
from .weights import SyncResult

log = logging.getLogger(__name__)


class Controller:
    def __init__(self, cfg: ControllerConfig, exp: ExpDir):
        self.cfg, self.exp = cfg, exp
        self.ledger = AdmissionLedger(cfg.groups_per_step, cfg.max_staleness, cfg.max_concurrent_groups)
        self.registry = ServerRegistry(cfg.sticky_entries)
        self.store = StateStore(exp.checkpoints / "controller")
        self.sync_lock = asyncio.Lock()
        self.pending = PendingVersions(self.sync_lock)
        self.syncer = WeightSync(self.registry, self._admin, cfg)
        # The last weights every server should hold: {"version", "method" (the message's op),
        # "message" (its fields when the method can replay it for a lagging server, else None)}.
        self.last_weights: dict = {"version": 0, "method": "initial", "message": None}
        self.last_sync: dict = {}
        self.server: RequestServer | None = None
        self.metrics: MetricsWriter | None = None
        self._http: aiohttp.ClientSession | None = None
        self._keys_cache: dict[str, str | None] = {}
        self._tasks: set[asyncio.Task] = set()
        self._catching_up: set[str] = set()
        # Servers being retired (retire_server): health checks and catch-ups leave them alone.
        self._retiring: set[str] = set()

    # ---- state --------------------------------------------------------------------------
    @property
    def requests(self) -> int:
        """Requests served so far (counted by the request server, not by each handler)."""
        return self.server.handled if self.server is not None else 0

    def restore(self) -> None:
        now = time.monotonic()
        snapshot, events = self.store.load()
        if snapshot is not None:
            self.ledger.load_state_dict(snapshot["ledger"], now)
            self.registry.load_state_dict(snapshot.get("registry", []))
            self.last_weights = _upgrade_last_weights(snapshot.get("last_weights", self.last_weights))
        for event in events:
            self.ledger.apply(event)
        self.ledger.restart_leases(now)
        if snapshot is not None or events:
            self.ledger.epoch += 1
            c = self.ledger.counters()
            log.info("resumed from %s (+%d journalled events): version %d, %d running, %d accepted, "
                     "%d rejected, %d failed, %d servers", self.store.dir, len(events), c["version"], c["running"],
                     c["accepted"], c["rejected"], c["failed"], len(self.registry.servers))
        self.store.open()
        self.snapshot()

    def state(self) -> dict:
        return {"ledger": self.ledger.state_dict(), "registry": self.registry.state_dict(),
                "last_weights": self.last_weights}

    def snapshot(self) -> None:
        self.store.snapshot(self.state())

    def _journal(self, event: dict | None) -> None:
        if event is not None:
            self.store.append(event)

    # ---- handlers: rollout workers -----------------------------------------------------
    def admit(self, req: AdmitRequest) -> AdmitReply:
        require_own_id(req.worker_id, "admit.worker_id")
        n = min(req.max_groups, self.cfg.max_tickets_per_request) if req.max_groups > 0 else req.max_groups
        granted, event = self.ledger.admit(req.worker_id, n, time.monotonic())
        self._journal(event)
        who = sender()   # each ticket signed for the worker it goes to: the trainer checks it
        return AdmitReply(tickets=[Ticket(gid, v, ticket_mac(self.exp.keys, gid, v, who)) for gid, v in granted],
                          version=self.ledger.version, retry_after_s=0.0 if granted else self.cfg.retry_after_s)

    def group_done(self, req: GroupDone) -> Ok:
        require_own_id(req.worker_id, "group_done.worker_id")
        outcome, event = self.ledger.finish(req.worker_id, req.group_id, req.status, time.monotonic())
        self._journal(event)
        if outcome == "late_accept":
            log.warning("group %s of %s reported accepted after it was released; counted accepted",
                        req.group_id, req.worker_id)
        return Ok(detail=outcome)

    def heartbeat(self, req: Heartbeat) -> HeartbeatReply:
        require_own_id(req.worker_id, "heartbeat.worker_id")
        revoked, event = self.ledger.heartbeat(req.worker_id, req.running, time.monotonic())
        self._journal(event)
        if event is not None:
            log.info("heartbeat of %s reconciled: %s", req.worker_id, event)
        return HeartbeatReply(version=self.ledger.version, revoked=revoked)

    # ---- handlers: trainer --------------------------------------------------------------
    async def weights_published(self, req) -> WeightsAck:
        """A published version, in any weight-sync method's message (weights_on_disk, ...)."""
        applier = self.syncer.applier(req)
        applier.check(req)
        op = req.OP
        if req.version < self.ledger.version:
            raise ValueError(f"{op}: version {req.version} is behind the controller's version "
                             f"{self.ledger.version}; versions never go backwards (a trainer resumed from a "
                             f"checkpoint must send trainer_resumed first)")
        # Coalesced versions (pending_versions.py): a replayable announcement still waiting when a
        # newer one arrives is answered superseded; a broadcast must be applied once sent.
        if applier.replayable:
            newer = await self.pending.acquire(req.version)
            if newer:
                log.info("%s v%d superseded by v%d before it was applied", op, req.version, newer)
                if self.metrics:
                    self.metrics.log(event="weights_superseded", version=req.version, superseded_by=newer)
                return WeightsAck(version=req.version, ok=True, failed_servers=[], timings={}, superseded_by=newer)
        else:
            await self.sync_lock.acquire()
        try:
            if req.version < self.ledger.version:   # another update won the race for the lock
                raise ValueError(f"{op}: version {req.version} is behind {self.ledger.version}")
            if req.version > self.ledger.version + 1:
                log.warning("%s jumps from version %d to %d", op, self.ledger.version, req.version)
            result = await self.syncer.apply(req)
            self._journal(self.ledger.set_version(req.version))
            self.last_weights = {"version": req.version, "method": op,
                                 "message": asdict(req) if applier.replayable else None}
            self.snapshot()
            self._record_sync(result, op)
        finally:
            self.sync_lock.release()
        return WeightsAck(version=req.version, ok=result.ok, failed_servers=sorted(result.failed),
                          timings={**{f"{k}_s": v for k, v in result.phases.items()}, "total_s": result.seconds})

    def groups_dropped(self, req: GroupsDropped) -> Ok:
        event = self.ledger.release_dropped(req.group_ids)
        self._journal(event)
        # Pending ones (dropped before their worker's report) are released when the report comes.
        released = len(event["groups"]) + len(event["pending"]) if event else 0
        if self.metrics and released:
            self.metrics.log(event="groups_dropped", released=released, reason=req.reason)
        return Ok(detail=f"released {released} slot(s)")

    async def trainer_resumed(self, req: TrainerResumed) -> Ok:
        async with self.sync_lock:
            before = self.ledger.counters()
            self._journal(self.ledger.rebase(req.version, req.groups_held))
            if self.last_weights["version"] > req.version:
                # An abandoned launch's weights: not what servers are caught up to any more (the
                # trainer republishes its version next).
                self.last_weights = {"version": req.version, "method": "resumed", "message": None}
            self.snapshot()
        log.warning("trainer resumed at version %d holding %d groups (controller had version %d, %d accepted)",
                    req.version, req.groups_held, before["version"], before["accepted"])
        if self.metrics:
            self.metrics.log(event="trainer_resumed", version=req.version, groups_held=req.groups_held,
                             previous_version=before["version"], previous_accepted=before["accepted"])
        return Ok(detail=f"version {req.version}, accepted {req.groups_held}")

    def _record_sync(self, result: SyncResult, method: str) -> None:
        self.last_sync = {"version": result.version, "method": method, "seconds": result.seconds,
                          "phases": result.phases, "failed": result.failed, "updated": result.updated,
                          **({"relay_fallback": result.relay_fallback} if result.relay_fallback else {})}
        log.info("weights v%d (%s) on %d servers in %.2fs %s%s", result.version, method, len(result.updated),
                 result.seconds, {k: round(v, 3) for k, v in result.phases.items()},
                 f"; FAILED {result.failed}" if result.failed else "")
        if self.metrics:
            self.metrics.log(event="weight_sync", **self.last_sync)

    def launch_started(self, req: LaunchStarted) -> Ok:
        gone = self.registry.forget_all()
        self.snapshot()
        if gone:
            log.warning("launch %s: forgot %d server(s) of an earlier launch: %s", req.launch_id, len(gone),
                        ", ".join(gone))
        return Ok(detail=f"forgot {len(gone)} server(s)")

    # ---- handlers: generation servers ---------------------------------------------------
    def register_server(self, req: RegisterServer) -> Ok:
        server, new = self.registry.register(req.address, req.api_key_ref, req.capacity, req.admin_key_ref,
                                             req.tp_size, req.relay, req.relay_node)
        self._keys_cache.pop(server.api_key_ref, None)
        self._keys_cache.pop(server.admin_key_ref, None)
        if new and self.ledger.version > 0:
            server.take_out(f"registered at version {self.ledger.version}; checking its weights")
        self.snapshot()
        log.info("%s generation server %s (capacity %d, tp_size %s)", "registered" if new else "re-registered",
                 server.address, server.capacity, server.tp_size or "to be asked")
        self._spawn(self._check(server))
        return Ok(detail="registered" if new else "updated")

    async def retire_server(self, req: RetireServer) -> Ok:
        """The launcher takes a server away (elastic split): retirement.py."""
        return await retire(self, req)

    def pick_server(self, req: PickServer) -> ServerChoice:
        try:
            server = self.registry.pick(req.sticky_key, req.exclude)
        except LookupError as e:   # none servable: the worker waits and asks again
            return ServerChoice(address="", wait_reason=str(e))
        return ServerChoice(address=server.address, api_key_ref=server.api_key_ref)

    def status(self, _req: StatusRequest) -> StatusReply:
        return StatusReply(state={"role": "controller", **self.ledger.counters(), "epoch": self.ledger.epoch,
                                  "servers": self.registry.summary(), "last_weights": self.last_weights,
                                  "last_sync": self.last_sync, "requests": self.requests,
                                  "syncing": self.sync_lock.locked(),
                                  "version_waiting": self.pending.newest_waiting(),
                                  "errors": self.server.errors if self.server else 0,
                                  "journal_seq": self.store.seq})

    # ---- generation server admin --------------------------------------------------------
    def _admin(self, server: RegisteredServer) -> AdminClient:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return AdminClient(server.address, self._api_key(server.api_key_ref), self.cfg.http_timeout_s,
                           session=self._http, admin_key=self._api_key(server.admin_key_ref))

    def _api_key(self, ref: str) -> str | None:
        if not ref:
            return None
        if ref not in self._keys_cache:
            path = self.exp.keys / ref
            try:
                self._keys_cache[ref] = path.read_text().strip() or None
            except OSError as e:
                log.error("key file %s unreadable (%s); calling without that key", path, e)
                return None
        return self._keys_cache[ref]

    async def _check(self, server: RegisteredServer, after_restart: bool = False) -> None:
        """One health check; a server holding other weights than the current ones is caught up.

        Liveness is an answer from `/model_info` within `http_timeout_s` (no generation probe:
        SGLang's `/health` runs one unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false, and it
        stalls while generation is paused). A failed check during a weight sync is not counted:
        the sync's own calls judge the servers it updates.

        `after_restart`: the previous controller may have died between pause and continue; a
        server found at the current version is told to continue (harmless if it was not paused).
        """
        if server.address in self._retiring or self.registry.servers.get(server.address) is not server:
            return   # being retired, or already gone: not to be resumed or caught up
        admin = self._admin(server)
        # The held version is judged against the version current when the server was asked: an
        # answer from before a sync, judged after it, would take out and catch up a server the
        # sync has just brought up to date (and, under a drain, pause it with requests running).
        asked_at = (self.ledger.version, self.sync_lock.locked())
        try:
            info = await admin.model_info(self.cfg.http_timeout_s)
        except AdminError as e:
            if self.sync_lock.locked():
                log.info("%s: /model_info failed during a weight sync (not counted): %s", server.address, e.detail)
                return
            server.failures += 1
            log.warning("%s: health check %d failed: %s", server.address, server.failures, e.detail)
            if server.failures >= self.cfg.health_failures and server.healthy:
                server.healthy = False
                server.reason = server.reason or f"failed {server.failures} health checks ({e.detail})"
                log.error("generation server %s is unhealthy (%d failed checks)", server.address, server.failures)
            return
        if not server.healthy:
            log.info("generation server %s is healthy again", server.address)
            if server.in_rotation:
                server.reason = ""
        server.failures, server.healthy = 0, True
        await self._poll_load(server, admin)
        if server.tp_size < 1:
            await learn_tp_size(server, admin, self.cfg.http_timeout_s)
        held = _version_of(info)
        if held is None or self.sync_lock.locked() or asked_at != (self.ledger.version, False):
            return  # a server that does not say, or versions in flux since it was asked: nothing to judge
        server.weight_version = held
        want = self.ledger.version
        if held == want:
            if (after_restart or not server.in_rotation) and server.address not in self._catching_up:
                await self._continue(server)
            return
        server.take_out(f"holds weights v{held}, the current version is v{want}")
        msg = self._replayable_weights(want)
        if msg is not None and server.address not in self._catching_up:
            self._spawn(self._catch_up(server, msg))
        elif msg is None and want > 0:
            log.warning("%s holds v%s but v%d was %s: it rejoins at the next update", server.address, held, want,
                        self.last_weights.get("method"))

    async def _poll_load(self, server: RegisteredServer, admin: AdminClient) -> None:
        """Requests running + waiting from `/v1/loads` (kept from the last poll if it fails)."""
        try:
            server.load = server_load(await admin.loads(self.cfg.http_timeout_s))
            server.routed_since_poll = 0
        except AdminError as e:
            log.warning("%s: /v1/loads failed (load unknown until the next poll): %s", server.address, e.detail)

    def _replayable_weights(self, version: int):
        """The message that can bring a lagging server to `version`, or None (e.g. broadcast)."""
        last = self.last_weights
        if last.get("version") != version or not last.get("message"):
            return None
        cls = self.syncer.appliers.get(last.get("method", ""))
        return cls.message(**last["message"]) if cls is not None and cls.replayable else None

    async def _continue(self, server: RegisteredServer) -> None:
        """A server found at the right version but out of rotation: resume it and bring it back."""
        try:
            await self._admin(server).continue_generation(self.cfg.http_timeout_s)
        except Exception as e:
            log.warning("%s: could not continue generation: %s", server.address, e)
            return
        server.bring_back(self.ledger.version)
        log.info("generation server %s back in rotation at v%d", server.address, self.ledger.version)

    async def _catch_up(self, server: RegisteredServer, msg) -> None:
        version = msg.version
        self._catching_up.add(server.address)
        try:
            async with self.sync_lock:
                if self.ledger.version != version:
                    return   # a newer update ran meanwhile; the next check decides again
                if self.registry.servers.get(server.address) is not server:
                    return   # retired meanwhile
                result = await self.syncer.catch_up(server, msg)
            log.info("catch-up of %s to v%d: %s", server.address, version,
                     "ok" if result.ok else result.failed.get(server.address))
            if self.metrics:
                self.metrics.log(event="catch_up", server=server.address, version=version, ok=result.ok,
                                 seconds=result.seconds)
        finally:
            self._catching_up.discard(server.address)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- background ---------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            servers = list(self.registry.servers.values())
            await asyncio.gather(*(self._check(s) for s in servers), return_exceptions=True)

    async def _housekeeping(self, shutdown: Shutdown) -> None:
        tick = max(0.02, min(0.5, self.cfg.lease_s / 4))
        last_snapshot = last_metrics = time.monotonic()
        last_admitted, last_requests = self.ledger.admitted, self.requests
        while not shutdown.requested:
            await asyncio.sleep(tick)
            now = time.monotonic()
            lost, event = self.ledger.expire(now, self.cfg.lease_s)
            self._journal(event)
            self.store.flush()   # (no reply follows to write it)
            for worker, gids in lost.items():
                log.warning("worker %s silent for over %.0fs: lease expired, %d groups released", worker,
                            self.cfg.lease_s, len(gids))
            if self.store.since_snapshot and now - last_snapshot >= self.cfg.snapshot_interval_s:
                self.snapshot()
                last_snapshot = now
            if now - last_metrics >= self.cfg.metrics_interval_s:
                dt = now - last_metrics
                self.metrics.log(event="admission", **self.ledger.counters(),
                                 admissions_per_s=(self.ledger.admitted - last_admitted) / dt,
                                 requests_per_s=(self.requests - last_requests) / dt,
                                 servers_in_rotation=len(self.registry.servable()),
                                 bad_requests=self.server.errors)
                last_metrics, last_admitted, last_requests = now, self.ledger.admitted, self.requests

    def _bind(self) -> RequestServer:
        handlers = {"admit": self.admit, "group_done": self.group_done, "heartbeat": self.heartbeat,
                    **dict.fromkeys(self.syncer.appliers, self.weights_published),
                    "trainer_resumed": self.trainer_resumed,
                    "groups_dropped": self.groups_dropped,
                    "register_server": self.register_server, "pick_server": self.pick_server,
                    "retire_server": self.retire_server,
                    "launch_started": self.launch_started,
                    "status": self.status}
        # A restart binds the announced port again: workers holding the address reach it at once.
        senders = {**SENDERS, **dict.fromkeys(self.syncer.appliers, ("trainer",))}
        return serve_at_previous_address(self.exp, "controller", load_keys(self.exp.keys), handlers,
                                         host=self.cfg.host, port=self.cfg.port, before_replies=self.store.flush,
                                         senders=senders, max_frame_bytes=MAX_FRAME_BYTES)

    async def run(self, shutdown: Shutdown) -> int:
        self.restore()
        self.metrics = MetricsWriter(self.exp, "controller")
        self.server = self._bind()
        publish_service(self.exp, "controller", {"address": self.server.address, "version": self.ledger.version,
                                                 "epoch": self.ledger.epoch})
        log.info("controller on %s: B=%d eta=%d max_concurrent=%d lease %.0fs, version %d", self.server.address,
                 self.cfg.groups_per_step, self.cfg.max_staleness, self.cfg.max_concurrent_groups,
                 self.cfg.lease_s, self.ledger.version)
        serving = asyncio.ensure_future(self.server.serve_forever())
        background = [asyncio.ensure_future(self._health_loop()),
                      asyncio.ensure_future(self._housekeeping(shutdown))]
        for s in list(self.registry.servers.values()):
            self._spawn(self._check(s, after_restart=True))
        try:
            while not shutdown.requested and not serving.done():
                await asyncio.sleep(0.1)
        finally:
            for t in background + list(self._tasks):
                t.cancel()
            self.server.close()
            serving.cancel()
            await asyncio.gather(serving, *background, *self._tasks, return_exceptions=True)
            self.snapshot()
            self.store.close()
            if self._http is not None:
                await self._http.close()
            self.metrics.close()
        if serving.done() and not serving.cancelled() and serving.exception():
            log.error("server loop failed: %s", serving.exception())
            return 1
        return 0


def _version_of(model_info: dict) -> int | None:
    """The policy version in a `/model_info` reply (its live `weight_version`), if it says one."""
    raw = model_info.get("weight_version")
    try:
        return None if raw is None else parse_version(raw)
    except Exception:   # not an integer policy version ("default", SGLang's start-up value, is 0)
        return None


def _upgrade_last_weights(last: dict) -> dict:
    """A snapshot written before weight messages were per method held {"version", "how", "path"}."""
    if "how" not in last:
        return last
    disk = last.get("how") == "disk" and last.get("path")
    return {"version": last.get("version", 0), "method": "weights_on_disk" if disk else last.get("how", "initial"),
            "message": {"version": last.get("version", 0), "path": last["path"]} if disk else None}


def run_controller(exp_root: str | Path, cfg: ControllerConfig) -> int:
    exp = ExpDir(exp_root)
    setup_role_logging(exp, "controller")
    shutdown = Shutdown().install()
    return asyncio.run(Controller(cfg, exp).run(shutdown))
