"""ZeroMQ request/reply every role uses: a request server and request clients (the trajectory
channel is in trajectory_channel.py).

All sockets are CURVE-secured with the experiment's keys (see `keys`). The server loop drains
every ready message with NOBLOCK before yielding (the fastest asyncio shape measured on this
machine, see shared/BASELINES.md) and never dies on bad input: undecodable frames and failing
handlers become error replies.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from .codec import MAX_FRAME_BYTES, Envelope, ProtocolError, decode, encode
from .keys import ADMIN, CurveKeys, ensure_authenticator, identity_of, make_client, make_server
from .senders import _SENDER, may_send

log = logging.getLogger(__name__)

Handler = Callable[[Any], Any | Awaitable[Any]]
# The request server's per-frame calls go to pyzmq's compiled socket methods with plain int
# flags: its Python layer (`send_multipart`, `recv_multipart`, flag enums) cost about 5 us per
# reply and per request each, measured, a tenth of the controller's whole handling of an admission.
_send, _recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
# Replies are sent in batches of at most this many requests: a burst of admissions costs one
# journal write and one wake-up of ZeroMQ's I/O thread per batch, not one each, and the first
# request of a batch waits for at most this many others to be handled.
REPLY_BATCH = 64
# The lowest port free_port takes: above the ports services are usually configured on.
PORTS_FROM = 20000


class RemoteError(Exception):
    """The peer answered with an error reply."""

    def __init__(self, err: ProtocolError):
        super().__init__(f"{err.code}: {err.message}")
        self.code, self.message = err.code, err.message


def contexts() -> tuple[zmq.Context, zmq.asyncio.Context]:
    """The process's sync context and an asyncio shadow of it (one ZAP handler serves both)."""
    sync = zmq.Context.instance()
    return sync, zmq.asyncio.Context.shadow(sync.underlying)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now, for a listener that must be told its port up front
    (an HTTP server's command line, a torch.distributed rendezvous), which binds it seconds later.

    Taken below the kernel's ephemeral range (`ip_local_port_range`), which is where the kernel
    picks the ports of outgoing connections and of every bind to port 0, and below pyzmq's
    `bind_to_random_port` (49152 up): a port from there could be handed to such a socket of any
    program before the listener binds ("Address already in use", seen when a run's generation
    server started beside a busy test suite)."""
    low = _ephemeral_low()
    for port in random.sample(range(PORTS_FROM, low), min(64, max(0, low - PORTS_FROM))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:   # nothing free below the range: one the kernel picks
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


# Where the local launcher puts its roles' sockets (a directory only the run's user may enter):
# services on one machine talk over Unix sockets there, so another user of the machine cannot
# even connect to them, let alone hold connections open until a role runs out of descriptors.
IPC_DIR_ENV = "TANDEM_IPC_DIR"
# Longest Unix socket path (sun_path holds 108 bytes, the last a NUL).
IPC_PATH_MAX = 107
# A TCP peer that has not completed the CURVE handshake within this many seconds is dropped
# (ZeroMQ's default is 30 s): an idle connection from a stranger holds a descriptor no longer.
HANDSHAKE_S = 10


def bind(sock: zmq.Socket, host: str, port: int, name: str = "") -> str:
    """Bind to host:port (0 = any free port); return the address peers connect to.

    With `name` and TANDEM_IPC_DIR set (the local launcher sets it for its roles) a loopback
    service binds `ipc://<dir>/<name>` instead: the same path again after a restart, so clients
    holding the address reach the new process. On a cluster the SLURM task wrapper sets
    TANDEM_ADVERTISE_HOST to the node's name: a loopback or wildcard host then binds every
    interface and publishes that name, because roles on other nodes can reach neither 127.0.0.1
    nor 0.0.0.0.
    """
    ipc_dir = os.environ.get(IPC_DIR_ENV)
    if name and ipc_dir and host in ("127.0.0.1", "localhost") and len(path := f"{ipc_dir}/{name}") <= IPC_PATH_MAX:
        sock.bind(f"ipc://{path}")
        return f"ipc://{path}"
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_S * 1000)
    advertise = os.environ.get("TANDEM_ADVERTISE_HOST")
    shown = host
    if advertise and host in ("127.0.0.1", "localhost", "0.0.0.0", "*"):
        host, shown = "0.0.0.0", advertise
    elif host in ("0.0.0.0", "*"):
        shown = socket.gethostname()
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{shown}:{port}"


class RequestServer:
    """asyncio ROUTER: `handlers[op](body)` returns the reply body (sync or async).

    `senders[op]`: who may send `op` (see `may_send`; an op it does not name: every member of
    the experiment). A request from anyone else gets an error reply and reaches no handler; a
    handler reads the sender's identity with `sender()`."""

    def __init__(self, keys: CurveKeys, handlers: dict[str, Handler], host: str = "127.0.0.1",
                 port: int = 0, max_frame_bytes: int = MAX_FRAME_BYTES,
                 before_replies: Callable[[], None] | None = None, name: str = "",
                 senders: dict[str, tuple[str, ...]] | None = None):
        sync, actx = contexts()
        ensure_authenticator(sync, keys)
        self.sock = actx.socket(zmq.ROUTER)
        make_server(self.sock, keys)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.linger = 0
        self.address = bind(self.sock, host, port, name)
        # Non-blocking drains and sends go through a plain (sync) view of the same socket.
        self._raw = zmq.Socket.shadow(self.sock.underlying)
        self.handlers, self.senders = handlers, senders or {}
        self.errors = 0     # bad frames, unknown ops, refused or failing requests
        self.handled = 0    # requests that reached a handler (the service's request count)
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.before_replies = before_replies
        self._outbox: list[tuple[bytes, bytes]] = []

    async def serve_forever(self) -> None:
        while not self._closed:
            await self.sock.poll(1000, zmq.POLLIN)
            # Drain every ready message before yielding to the event loop again; the replies go
            # out together every REPLY_BATCH requests and when nothing more is ready.
            while not self._closed:
                try:
                    frames, user = self._recv_request()
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    if self._closed:
                        return
                    raise
                self._handle(frames, identity_of(user))
                if len(self._outbox) >= REPLY_BATCH:
                    self._send_replies()
            self._send_replies()

    def _recv_request(self) -> tuple[list[bytes], str | None]:
        """The next message's frames and its sender's ZAP User-Id, without blocking (zmq.Again
        when none is ready). A request is [identity, payload]: the payload comes as a Frame to
        read its `more` flag, which costs less than pyzmq's `recv_multipart` asking the socket
        for RCVMORE after every frame."""
        frames = [_recv(self._raw, _NOBLOCK)]
        frame = _recv(self._raw, _NOBLOCK, copy=False)
        user = frame.get("User-Id")
        frames.append(frame.bytes)
        while frame.more:
            frame = _recv(self._raw, _NOBLOCK, copy=False)
            frames.append(frame.bytes)
        return frames, user

    def _handle(self, frames: list[bytes], identity: str | None = ADMIN) -> None:
        if len(frames) != 2:
            self.errors += 1
            if frames:
                self._send(frames[0], encode(ProtocolError("bad_frame", "expected exactly one frame")))
            return
        ident, payload = frames
        msg = decode(payload)
        if isinstance(msg, ProtocolError):
            self.errors += 1
            log.warning("bad request: %s", msg.message)
            self._send(ident, encode(msg, msg.req_id or 0))
            return
        handler = self.handlers.get(msg.op)
        if handler is None:
            self.errors += 1
            self._send(ident, encode(ProtocolError("unsupported_op", f"this service does not handle "
                                                   f"{msg.op!r}"), msg.req_id))
            return
        if not may_send(identity, self.senders.get(msg.op)):
            self.errors += 1
            if self.errors <= 100 or self.errors % 1000 == 0:   # a sender repeating it must not fill the log
                log.warning("refused %s from %s: not a role that sends it (%d errors so far)", msg.op, identity,
                            self.errors)
            self._send(ident, encode(ProtocolError("forbidden", f"{msg.op} is not for {identity}"), msg.req_id))
            return
        self.handled += 1
        token = _SENDER.set(identity or "")
        try:
            result = handler(msg.body)
        except Exception as e:  # a failing handler answers with an error and the loop goes on
            self._reply_error(ident, msg, e)
            return
        finally:
            _SENDER.reset(token)
        # (a reply message is never awaitable: the slower check is left for the rest). A
        # coroutine handler runs in its task with the sender set, as it was at the call.
        if getattr(result, "OP", None) is None and inspect.isawaitable(result):
            context = contextvars.copy_context()
            context.run(_SENDER.set, identity or "")
            task = context.run(asyncio.ensure_future, self._finish(ident, msg, result))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._send(ident, encode(result, msg.req_id))

    async def _finish(self, ident: bytes, msg: Envelope, result: Awaitable) -> None:
        try:
            reply = await result
        except Exception as e:
            self._reply_error(ident, msg, e)
        else:
            self._send(ident, encode(reply, msg.req_id))
        self._send_replies()

    def _reply_error(self, ident: bytes, msg: Envelope, e: Exception) -> None:
        self.errors += 1
        if isinstance(e, (ValueError, KeyError, LookupError)):
            code = "rejected"
        else:
            code = "internal"
            log.exception("handler for %r failed", msg.op)
        self._send(ident, encode(ProtocolError(code, f"{msg.op}: {e}"), msg.req_id))

    def _send(self, ident: bytes, payload: bytes) -> None:
        self._outbox.append((ident, payload))

    def _send_replies(self) -> None:
        """Send the replies waiting in the outbox, after `before_replies` (the controller writes
        its journal there: one write for the batch, and never a reply before its record)."""
        if not self._outbox:
            return
        replies, self._outbox = self._outbox, []
        if self.before_replies is not None:
            try:
                self.before_replies()
            except Exception:   # not durable, so not acknowledged: the clients time out and retry
                log.exception("%d replies dropped: what must precede them failed", len(replies))
                return
        for ident, payload in replies:
            try:
                _send(self._raw, ident, _SNDMORE_NOBLOCK)
                _send(self._raw, payload, _NOBLOCK)
            except zmq.ZMQError as e:  # the peer is gone or its queue is full; its request times out
                log.debug("reply dropped: %s", e)

    def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        self.sock.close(0)


class RequestClient:
    """asyncio DEALER with request ids, per-request timeouts, and a service that may restart.

    `resolve()` returns the service's announcement: its address, or the whole
    `<exp>/services/<role>.json` (a dict with `address`; its `pid` and `published_at` change when
    the service restarts, even on the same address). While requests wait for replies the client
    looks at the announcement again every `WATCH_S`; when the service moved or restarted, it
    reconnects and sends every waiting request again — a request lost with the old process would
    otherwise wait out its whole timeout — and cancels none of them. Everything Tandem sends over
    this client is safe to repeat: a repeated `group_done` or drop is recognised as such, a
    heartbeat or grading is the same again, and tickets of an admission whose reply was lost are
    released by the heartbeat's reconciliation.
    """

    WATCH_S = 0.5

    def __init__(self, keys: CurveKeys, resolve: Callable[[], str | dict] | str, timeout_s: float = 10.0):
        self.keys = keys
        self.resolve = resolve if callable(resolve) else (lambda: resolve)
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, bytes]] = {}
        self._reader: asyncio.Task | None = None
        self._last_look = time.monotonic()
        self.resends = 0
        self.sock = None
        self.address = None
        self._incarnation = None
        self._connect(self.resolve())

    def _connect(self, announcement: str | dict) -> None:
        if self.sock is not None:
            self.sock.close(0)
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        _, actx = contexts()
        self.sock = actx.socket(zmq.DEALER)
        make_client(self.sock, self.keys)
        self.sock.linger = 0
        self.address, self._incarnation = _address_of(announcement), _incarnation_of(announcement)
        self.sock.connect(self.address)

    async def _read(self, sock) -> None:
        while True:
            msg = decode(await sock.recv())
            entry = self._pending.pop(msg.req_id, None) if msg.req_id is not None else None
            if entry is not None and not entry[0].done():
                entry[0].set_result(msg)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read(self.sock))

    async def request(self, body: Any, timeout_s: float | None = None) -> Any:
        """Send `body`, return the reply body; raise RemoteError or TimeoutError."""
        self._ensure_reader()
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        payload = encode(body, req_id)
        self._pending[req_id] = (fut, payload)
        timeout = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout
        try:
            await self._send(payload)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{type(body).__name__} to {self.address}: no reply within {timeout:.1f}s")
                try:
                    msg = await asyncio.wait_for(asyncio.shield(fut), min(left, self.WATCH_S))
                    break
                except TimeoutError:
                    await self._look_again()
        finally:
            self._pending.pop(req_id, None)
        if isinstance(msg, ProtocolError):
            raise RemoteError(msg)
        if isinstance(msg.body, ProtocolError):
            raise RemoteError(msg.body)
        return msg.body

    async def _look_again(self) -> None:
        """If the service moved or restarted, reconnect and send what waits again (once per
        WATCH_S however many requests wait)."""
        if time.monotonic() - self._last_look < self.WATCH_S:
            return
        self._last_look = time.monotonic()
        try:
            announcement = self.resolve()
        except Exception as e:  # the announcement is missing while the service restarts
            log.debug("resolve failed: %s", e)
            return
        if _address_of(announcement) == self.address and _incarnation_of(announcement) == self._incarnation:
            return
        log.info("service %s -> %s restarted or moved; reconnecting and resending %d request(s)",
                 self.address, _address_of(announcement), len(self._pending))
        self._connect(announcement)
        self._ensure_reader()
        for _, payload in list(self._pending.values()):
            self.resends += 1
            await self._send(payload)

    async def _send(self, payload: bytes) -> None:
        try:
            await self.sock.send(payload)
        except zmq.ZMQError as e:   # the socket was replaced meanwhile: the next look resends it
            log.debug("send failed (%s); will resend", e)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for fut, _ in self._pending.values():
            fut.cancel()
        self.sock.close(0)


def _address_of(announcement: str | dict) -> str:
    return announcement["address"] if isinstance(announcement, dict) else announcement


def _incarnation_of(announcement: str | dict):
    """What changes when the service restarts (a bare address: nothing but the address)."""
    if isinstance(announcement, dict):
        return announcement.get("pid"), announcement.get("published_at")
    return None


class SyncRequestClient:
    """Blocking request/reply for non-asyncio callers (the trainer's main loop, CLIs).

    With `resolve` (the service's announcement, as for RequestClient) it follows a restart as
    RequestClient does: while a request waits, it looks at the announcement every `WATCH_S` and,
    when the service moved or restarted, reconnects and sends the same request again — a request
    lost with the old process would otherwise wait out its whole timeout (the trainer's weight
    announcement: `trainer.ack_timeout_s`). A live service never sees it twice. With `stop`, a
    request is abandoned (TimeoutError) once `stop()` says so: a stopping trainer does not wait
    out a dead controller's timeout."""

    WATCH_S = 0.5

    def __init__(self, keys: CurveKeys, address: str, timeout_s: float = 10.0,
                 resolve: Callable[[], str | dict] | None = None):
        self.keys, self.address, self.timeout_s, self.resolve = keys, address, timeout_s, resolve
        self._ids = itertools.count(1)
        self.sock = None
        self._incarnation = None
        if resolve is not None:
            self._changed()        # remember the incarnation connected to
        self._connect()

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        sync, _ = contexts()
        self.sock = sync.socket(zmq.DEALER)
        make_client(self.sock, self.keys)
        self.sock.linger = 0
        self.sock.connect(self.address)

    def _changed(self) -> bool:
        """Whether the announcement names another address or process than the last one seen."""
        try:
            announcement = self.resolve()
            address, incarnation = _address_of(announcement), _incarnation_of(announcement)
        except Exception as e:  # missing or half-written while the service restarts: look later
            log.debug("resolve failed: %s", e)
            return False
        moved = (address, incarnation) != (self.address, self._incarnation)
        self.address, self._incarnation = address, incarnation
        return moved

    def request(self, body: Any, timeout_s: float | None = None, stop: Callable[[], bool] | None = None) -> Any:
        req_id = next(self._ids)
        payload = encode(body, req_id)
        self.sock.send(payload)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(min(left, self.WATCH_S) * 1000) + 1):
                if stop is not None and stop():
                    self._connect()   # as after a timeout: a late reply must not answer the next
                    raise TimeoutError(f"{type(body).__name__} to {self.address}: abandoned, stopping")
                if self.resolve is not None and self._changed():
                    log.info("service restarted or moved to %s; sending %s again", self.address,
                             type(body).__name__)
                    self._connect()
                    self.sock.send(payload)
                continue
            msg = decode(self.sock.recv())
            rid = msg.req_id
            if rid != req_id:
                continue  # a late reply to an earlier, timed-out request
            if isinstance(msg, ProtocolError):
                raise RemoteError(msg)
            if isinstance(msg.body, ProtocolError):
                raise RemoteError(msg.body)
            return msg.body
        # Drop the socket so a late reply cannot be mistaken for the next request's.
        self._connect()
        raise TimeoutError(f"{type(body).__name__} to {self.address}: no reply within "
                           f"{timeout_s or self.timeout_s:.1f}s")

    def close(self) -> None:
        self.sock.close(0)
