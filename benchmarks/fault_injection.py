"""The faults `benchmarks/faults.py` and `tests/integration/test_faults.py` inject into a run.

Each works on a running `tandem run` (local backend) from outside, as a user or a broken peer
would: SIGKILL of one role; bad input on every port the run has open; Ctrl-C of the launcher;
SIGKILL of the launcher (its roles stop themselves: launcher/launcher_watch.py).
`inject()` returns whether the fault ended the launch, so the caller continues it with
`--resume`, as a user would.
"""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import zmq

from tandem.services.protocol import ExpDir, ProtocolError, decode, load_keys, read_service
from tandem.services.protocol.codec import MAX_FRAME_BYTES
from tandem.services.protocol.keys import make_client

ROLES = ("gen", "controller", "reward", "rollout", "trainer")
KINDS = ROLES + ("bad-input", "ctrl-c", "launcher")


def role_pid(exp_root: Path, role: str) -> int:
    """The pid of a running role: from its announcement, or (a rollout worker) its command line."""
    if role == "rollout":
        for pid in os.listdir("/proc"):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"rollout" in cmd and str(exp_root).encode() in cmd and b"tandem.launcher.cli" in cmd:
                return int(pid)
        raise LookupError("no rollout worker running")
    name = {"gen": "gen-0"}.get(role, role)
    return int(json.loads((exp_root / "services" / f"{name}.json").read_text())["pid"])


def inject(kind: str, exp_root: Path, launcher_pid: int) -> tuple[bool, dict]:
    """Inject one fault; (whether the launch ends, what was observed)."""
    if kind in ROLES:
        os.kill(role_pid(exp_root, kind), signal.SIGKILL)
        return kind == "trainer", {}       # a dead trainer ends the launch; the rest restart
    if kind == "ctrl-c":                   # a terminal sends SIGINT to the whole foreground group
        os.killpg(launcher_pid, signal.SIGINT)
        return True, {}
    if kind == "launcher":                 # the launcher alone, with no chance to stop its roles
        os.kill(launcher_pid, signal.SIGKILL)
        return True, {}
    if kind == "bad-input":
        return False, bad_input_everywhere(ExpDir(exp_root))
    raise ValueError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")


SEND_TIMEOUT_MS = 10_000
# How long every frame sent has to be answered. The frames go out together, each on a connection
# of its own, and are waited for together: the answers that come (error replies) come in
# milliseconds, and the silences (a stranger, an oversized frame, the trainer's one-way channel)
# are each waited out in the same window, not one after another (13 s one after another before).
REPLY_WINDOW_S = 3.0


def bad_input_everywhere(exp: ExpDir) -> dict:
    """Every ZeroMQ port (controller, reward service, the trainer's trajectory channel): a peer
    without the experiment's keys, then members sending garbage, a msgpack value of the wrong
    shape and a frame over the size limit. The generation server's HTTP port: no API key,
    garbage JSON, a body over the size limit, a text too long to tokenize. Returns what each
    answered (error replies and HTTP statuses; None where nothing answers, by design)."""
    keys = load_keys(exp.keys)
    seen: dict = {}
    ctx = zmq.Context.instance()
    sent: dict[str, zmq.Socket] = {}   # what was sent -> the connection it went on, alone
    oversized = b"\0" * (MAX_FRAME_BYTES + 1)
    try:
        for role, field in (("controller", "address"), ("reward", "address"), ("trainer", "trajectory_address")):
            address = read_service(exp, role, timeout_s=30)[field]
            stranger = _dealer(ctx, address, None)   # no CURVE keys: the handshake never completes
            try:
                stranger.send(b"hello?")
                sent[f"{role}: stranger"] = stranger
            except zmq.Again:                   # not even queued: nothing got through either
                seen[f"{role}: stranger"] = None
                stranger.close(0)
            for name, frame in (("garbage", os.urandom(512)), ("wrong shape", msgpack.packb({"op": 7, "v": []})),
                                ("oversized", oversized)):
                member = _dealer(ctx, address, keys)
                sent[f"{role}: {name}"] = member
                try:
                    member.send(frame, copy=frame is not oversized)
                except zmq.Again:
                    raise RuntimeError(f"bad input: {role} at {address} took no {name} frame from a member "
                                       f"in {SEND_TIMEOUT_MS / 1000:.0f}s") from None
        answers = _replies(sent, REPLY_WINDOW_S)
    finally:
        for sock in sent.values():
            sock.close(0)
    for role in ("controller", "reward", "trainer"):
        for name in ("stranger", "garbage", "wrong shape", "oversized"):
            key = f"{role}: {name}"
            seen[key] = seen[key] if key in seen else answers.get(key)
    gen = read_service(exp, "gen-0", timeout_s=30)
    api_key = (exp.keys / "gen-api-key").read_text().strip()
    url = f"{gen['url']}/generate"
    for name, body, key in (("no key", b'{"text": "1+1="}', None), ("garbage JSON", b"{not json", api_key),
                            ("oversized body", b" " * (64 * 2**20 + 1), api_key),
                            ("overlong text", json.dumps({"text": "x" * 10_000_000}).encode(), api_key)):
        seen[f"gen http: {name}"] = _http_status(url, body, key)
    return seen


def _dealer(ctx: zmq.Context, address: str, keys) -> zmq.Socket:
    """A DEALER connected to `address`, a member's (CURVE with `keys`) or a stranger's (None).
    A send with no peer to queue on blocks for good (seen once: the stranger's hello held the
    driver while the run trained out its room): nothing here may wait without a limit."""
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        make_client(sock, keys)
    sock.linger, sock.sndtimeo = 0, SEND_TIMEOUT_MS
    sock.connect(address)
    return sock


def _replies(sent: dict[str, zmq.Socket], window_s: float) -> dict[str, str]:
    """{what: the error code a server answered with (its op if not an error)} of the connections
    answered within `window_s` of now; the others answered nothing."""
    poller = zmq.Poller()
    waiting = {}
    for what, sock in sent.items():
        poller.register(sock, zmq.POLLIN)
        waiting[sock] = what
    answers = {}
    deadline = time.monotonic() + window_s
    while waiting and (left := deadline - time.monotonic()) > 0:
        for sock, _ in poller.poll(int(left * 1000) + 1):
            msg = decode(sock.recv())
            body = getattr(msg, "body", msg)
            answers[waiting.pop(sock)] = body.code if isinstance(body, ProtocolError) else msg.op
            poller.unregister(sock)
    return answers


def _http_status(url: str, body: bytes, key: str | None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError) as e:   # the server cut an oversized body off
        return -1 if "reset" in str(e).lower() or "broken" in str(e).lower() else -2
