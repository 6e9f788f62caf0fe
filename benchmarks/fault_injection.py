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


def bad_input_everywhere(exp: ExpDir) -> dict:
    """Every ZeroMQ port (controller, reward service, the trainer's trajectory channel): a peer
    without the experiment's keys, then a member sending garbage, a msgpack value of the wrong
    shape and a frame over the size limit. The generation server's HTTP port: no API key,
    garbage JSON, a body over the size limit, a text too long to tokenize. Returns what each
    answered (error replies and HTTP statuses; None where nothing answers, by design)."""
    keys = load_keys(exp.keys)
    seen: dict = {}
    ctx = zmq.Context.instance()
    for role, field in (("controller", "address"), ("reward", "address"), ("trainer", "trajectory_address")):
        address = read_service(exp, role, timeout_s=30)[field]
        stranger = ctx.socket(zmq.DEALER)   # no CURVE keys: the handshake never completes
        # A send with no peer to queue on blocks for good (seen once: the stranger's hello held
        # the driver while the run trained out its room): nothing here may wait without a limit.
        stranger.linger, stranger.sndtimeo = 0, SEND_TIMEOUT_MS
        stranger.connect(address)
        try:
            stranger.send(b"hello?")
            seen[f"{role}: stranger"] = _reply(stranger, 1.0)
        except zmq.Again:                   # not even queued: nothing got through either
            seen[f"{role}: stranger"] = None
        stranger.close(0)
        member = ctx.socket(zmq.DEALER)
        make_client(member, keys)
        member.linger, member.sndtimeo = 0, SEND_TIMEOUT_MS
        member.connect(address)
        for name, frame in (("garbage", os.urandom(512)), ("wrong shape", msgpack.packb({"op": 7, "v": []})),
                            ("oversized", b"\0" * (MAX_FRAME_BYTES + 1))):
            try:
                member.send(frame)
            except zmq.Again:
                raise RuntimeError(f"bad input: {role} at {address} took no {name} frame from a member "
                                   f"in {SEND_TIMEOUT_MS / 1000:.0f}s") from None
            seen[f"{role}: {name}"] = _reply(member, 2.0)
        member.close(0)
    gen = read_service(exp, "gen-0", timeout_s=30)
    api_key = (exp.keys / "gen-api-key").read_text().strip()
    url = f"{gen['url']}/generate"
    for name, body, key in (("no key", b'{"text": "1+1="}', None), ("garbage JSON", b"{not json", api_key),
                            ("oversized body", b" " * (64 * 2**20 + 1), api_key),
                            ("overlong text", json.dumps({"text": "x" * 10_000_000}).encode(), api_key)):
        seen[f"gen http: {name}"] = _http_status(url, body, key)
    return seen


def _reply(sock: zmq.Socket, timeout_s: float) -> str | None:
    """The error code a server answered with (its op if not an error), or None: no answer."""
    if not sock.poll(int(timeout_s * 1000)):
        return None
    msg = decode(sock.recv())
    body = getattr(msg, "body", msg)
    return body.code if isinstance(body, ProtocolError) else msg.op


def _http_status(url: str, body: bytes, key: str | None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError) as e:   # the server cut an oversized body off
        return -1 if "reset" in str(e).lower() or "broken" in str(e).lower() else -2
