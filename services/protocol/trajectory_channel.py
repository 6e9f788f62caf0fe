"""The trajectory channel: rollout workers (DEALER) to trainer rank 0 (ROUTER), with receipts.

PUSH/PULL alone cannot tell a worker whether a trajectory arrived: what sits in a socket's
queues when the trainer dies is gone, and a worker that counted it delivered has used up its
prompt for nothing. So the trainer answers every trajectory with a `TrajectoryReceipt` once it
is durable (trainer/intake.py), and a worker counts a group delivered — its prompt settled —
only when every sample is receipted. A group that never gets its receipts (the trainer died)
gives its prompt back to be generated again. High-water marks make a slow trainer push back on
the workers, as before; a receipt that cannot be routed (its worker is gone) is dropped.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .codec import MAX_FRAME_BYTES, ProtocolError, decode, encode
from .keys import CurveKeys, ensure_authenticator, identity_of, make_client, make_server
from .trajectory import Trajectory, TrajectoryReceipt
from .transport import bind, contexts

log = logging.getLogger(__name__)


class TrajectorySink:
    """ROUTER side (the trainer binds); one thread uses it. Bad frames are counted and skipped."""

    def __init__(self, keys: CurveKeys, host: str = "127.0.0.1", port: int = 0, hwm: int = 1000, name: str = ""):
        sync, _ = contexts()
        ensure_authenticator(sync, keys)
        self.sock = sync.socket(zmq.ROUTER)
        make_server(self.sock, keys)
        self.sock.rcvhwm = hwm
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.linger = 0
        self.address = bind(self.sock, host, port, name)
        self.bad_frames = 0
        self._sender: bytes | None = None
        self.sender_identity: str | None = None

    def recv(self, timeout_s: float) -> Any | None:
        """One message body, or None when nothing valid arrived within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                return None
            frames = self.sock.recv_multipart(copy=False)
            msg = decode(frames[1].bytes) if len(frames) == 2 else \
                ProtocolError(f"{len(frames) - 1} frames, expected 1")
            if isinstance(msg, ProtocolError):
                self.bad_frames += 1
                log.warning("dropped bad trajectory frame: %s", msg.message)
                continue
            self._sender = frames[0].bytes
            # Who sent it (keys.py): the trainer checks a trajectory's ticket against its sender.
            self.sender_identity = identity_of(frames[1].get("User-Id"))
            return msg.body
        return None

    def confirm(self, t: Trajectory) -> None:
        """Receipt `t` to the worker that sent the last message received (never blocks)."""
        try:
            self.sock.send_multipart([self._sender, encode(TrajectoryReceipt(t.group_id, t.sample_idx))],
                                     zmq.NOBLOCK)
        except zmq.Again:   # that worker reads no receipts for now: it will send the group again
            log.debug("receipt for %s/%d not sent: the worker's queue is full", t.group_id, t.sample_idx)

    def close(self, linger_ms: int = 1000) -> None:
        """Receipts already queued get `linger_ms` to leave."""
        self.sock.close(linger_ms)


class TrajectorySource:
    """DEALER side (rollout workers connect). A full high-water mark makes `send` wait:
    backpressure. `send_group` calls back when the trainer has receipted every sample."""

    def __init__(self, keys: CurveKeys, address: str, hwm: int = 1000):
        _, actx = contexts()
        self.sock = actx.socket(zmq.DEALER)
        make_client(self.sock, keys)
        self.sock.sndhwm = hwm
        self.sock.linger = 5000  # let queued trajectories drain on close
        # Watched from before the connect, so the first event is the first connection.
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.address = address
        self._waiting: dict[str, tuple[set[int], Callable[[], None]]] = {}
        self._tasks: list[asyncio.Task] = []
        self._last_receipt = 0.0
        self._down_since: float | None = None   # the trainer's connection is down since then

    async def send(self, body: Any, timeout_s: float = 60.0) -> None:
        """Queue one message; raise TimeoutError if the trainer has not made room in time."""
        try:
            await asyncio.wait_for(self.sock.send(encode(body)), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"trainer at {self.address} accepted nothing for {timeout_s:.0f}s") from None

    async def send_group(self, trajectories: list[Trajectory], on_receipted: Callable[[], None],
                         timeout_s: float = 60.0) -> None:
        """Send a group's samples; `on_receipted()` runs once the trainer has receipted them all.
        If sending fails, the group is forgotten (no callback) and the error raised."""
        gid = trajectories[0].group_id
        self._waiting[gid] = ({t.sample_idx for t in trajectories}, on_receipted)
        if not self._tasks or any(t.done() for t in self._tasks):
            for t in self._tasks:
                t.cancel()
            self._tasks = [asyncio.ensure_future(self._read_receipts()), asyncio.ensure_future(self._watch())]
        try:
            for t in trajectories:
                await self.send(t, timeout_s)
        except BaseException:
            self._waiting.pop(gid, None)
            raise

    def unreceipted(self) -> list[str]:
        """Groups sent whose receipts have not all come back."""
        return list(self._waiting)

    async def wait_receipts(self, quiet_s: float = 2.0, timeout_s: float = 30.0, gone_s: float = 0.2) -> list[str]:
        """Wait for the outstanding receipts, until none came for `quiet_s` (a live trainer
        receipts within milliseconds), the trainer's connection has been down for `gone_s` (a
        trainer that has exited, at the end of a run or in a crash, sends nothing more; what it
        sent before it went is read meanwhile), or `timeout_s`; return the groups still without them."""
        start = time.monotonic()
        while self._waiting and time.monotonic() - start < timeout_s:
            now = time.monotonic()
            if now - max(start, self._last_receipt) >= quiet_s:
                break
            if self._down_since is not None and now - max(self._down_since, self._last_receipt) >= gone_s:
                break
            await asyncio.sleep(0.02)
        return self.unreceipted()

    async def _watch(self) -> None:
        """The trainer's connection, from the socket's monitor: up, or down since when."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self._down_since = None
            elif event == zmq.EVENT_DISCONNECTED and self._down_since is None:
                self._down_since = time.monotonic()

    async def _read_receipts(self) -> None:
        while True:
            msg = decode(await self.sock.recv())
            body = getattr(msg, "body", None)
            if not isinstance(body, TrajectoryReceipt):
                log.warning("ignored %s on the trajectory channel (expected receipts)", msg)
                continue
            self._last_receipt = time.monotonic()
            entry = self._waiting.get(body.group_id)
            if entry is None:
                continue
            entry[0].discard(body.sample_idx)
            if not entry[0]:
                del self._waiting[body.group_id]
                entry[1]()

    def close(self, linger_ms: int = 5000) -> None:
        for t in self._tasks:
            t.cancel()
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(linger_ms)
