"""Per-experiment CURVE keys: one keypair per role, so a role can speak only for itself.

Every socket is CURVE-encrypted, and a server admits only the public keys in its experiment's
`keys/` (ZAP authentication): a peer from another experiment, or with no key, gets nothing
through. Servers (the controller, the reward service, the trainer's trajectory sink) present the
experiment's `service` keypair, which every client checks them by. As a client, each role has a
keypair of its own, named by its identity — `launcher`, `trainer`, `eval`, `rollout-<rank>` — and
loads only its own secret. A server learns the identity of every message's sender from its key
(senders.sender(), set for the handler), so it can refuse what that role may not do (a worker
announcing weights, registering a server, speaking for another worker: RequestServer's
`senders`). The `launcher` identity is the user's own (the launcher, `tandem status`): it may do
everything.

A holder of one role's secret — a leaked worker key, a compromised worker — can therefore act as
that worker only. Every role runs as the experiment's user, so this separates roles, not users:
against other users the keys' files are private (0600 in a 0700 directory, private.py).

`tickets.secret` is the controller's and the trainer's only: the controller signs each admission
ticket for the worker it grants it to (`ticket_mac`), and the trainer refuses a trajectory whose
ticket was not signed for the worker that sent it (a group the controller never admitted, or
another worker's).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ADMIN = "launcher"
SERVICE = "service"    # the keypair every server presents
BASE_IDENTITIES = (SERVICE, ADMIN, "trainer", "eval")
TICKETS = "tickets.secret"


def worker_identity(rank: int) -> str:
    return f"rollout-{rank}"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    directory: Path
    identity: str = ADMIN
    server_public: bytes = b""   # the servers' (the `service` keypair's): what a client checks them by


def generate_keys(keys_dir: str | os.PathLike, identities: tuple[str, ...] | list[str] = ()) -> CurveKeys:
    """Create the keypairs of the base roles and of `identities` that do not exist yet (each 0600,
    from its first instant), and the ticket secret; return the `launcher`'s keys."""
    d = Path(keys_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)   # never the group's, whatever experiment.group_access says
    old = os.umask(0o077)
    try:
        for name in dict.fromkeys((*BASE_IDENTITIES, *identities)):
            if not (d / f"{name}.key_secret").exists():
                zmq.auth.create_certificates(str(d), name)
        if not (d / TICKETS).exists():
            (d / TICKETS).write_bytes(secrets.token_bytes(32))
    finally:
        os.umask(old)
    return load_keys(d)


def experiment_identity(keys_dir: str | os.PathLike) -> bytes:
    """What tells this experiment from another made at the same path: the launcher's public key,
    made once per experiment (b"" before there is one)."""
    try:
        return (Path(keys_dir) / f"{ADMIN}.key").read_bytes()
    except OSError:
        return b""


def load_keys(keys_dir: str | os.PathLike, identity: str = ADMIN) -> CurveKeys:
    """The keypair of `identity` (and the servers' public key)."""
    d = Path(keys_dir)
    secret_file = d / f"{identity}.key_secret"
    if not secret_file.exists():
        raise FileNotFoundError(f"no key for {identity!r} in {d}; create the experiment with `tandem run` "
                                f"or `tandem keys init {d.parent}`")
    pub, sec = zmq.auth.load_certificate(str(secret_file))
    server = pub if identity == SERVICE else zmq.auth.load_certificate(str(d / f"{SERVICE}.key"))[0]
    return CurveKeys(pub, sec, d, identity, server)


def ticket_mac(keys_dir: str | os.PathLike, group_id: str, admit_version: int, identity: str) -> str:
    """The controller's signature of ticket (`group_id`, `admit_version`) granted to `identity`."""
    key = _ticket_key(Path(keys_dir))
    return hmac.new(key, f"{group_id}\n{admit_version}\n{identity}".encode(), hashlib.sha256).hexdigest()[:32]


_ticket_keys: dict[Path, bytes] = {}


def _ticket_key(d: Path) -> bytes:
    if d not in _ticket_keys:
        _ticket_keys[d] = (d / TICKETS).read_bytes()
    return _ticket_keys[d]


class _AllowedKeys:
    """ZAP credentials provider: admits the public keys in the `keys/` directories of the
    experiments this process serves (one in production; tests host servers of several
    experiments in one process), and names each key's identity. A key it does not know makes it
    read the directories again (at most once a second): a role added during the run (a new
    rollout worker) is admitted without a restart."""

    RESCAN_S = 1.0

    def __init__(self):
        self.directories: set[Path] = set()
        self.identities: dict[str, str] = {}    # z85 public key -> identity
        self._scanned = 0.0
        self._lock = threading.Lock()

    def add(self, keys: CurveKeys) -> None:
        with self._lock:
            self.directories.add(keys.directory)
            self.identities[keys.public.decode()] = keys.identity
            self._scan()

    def _scan(self) -> None:
        for d in self.directories:
            for public in d.glob("*.key"):
                if public.stem == SERVICE:
                    continue
                try:
                    self.identities[zmq.auth.load_certificate(str(public))[0].decode()] = public.stem
                except (OSError, ValueError):
                    continue
        self._scanned = time.monotonic()

    def callback(self, domain: str, z85_key: bytes) -> bool:
        key = z85_key.decode()
        if key in self.identities:
            return True
        with self._lock:
            if time.monotonic() - self._scanned >= self.RESCAN_S:
                self._scan()
            return key in self.identities


_authenticators: dict[int, tuple[ThreadAuthenticator, _AllowedKeys]] = {}
_allowed = _AllowedKeys()


def ensure_authenticator(ctx: zmq.Context, keys: CurveKeys) -> None:
    """Start (once per context) the ZAP handler, and admit this experiment's keys."""
    if id(ctx) not in _authenticators:
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_allowed)
        _authenticators[id(ctx)] = (auth, _allowed)
    _allowed.add(keys)


def identity_of(user_id: str | None) -> str | None:
    """The identity of a message's sender, from its ZAP User-Id (the z85 public key)."""
    return _allowed.identities.get(user_id) if user_id else None


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """A server socket presenting the experiment's `service` keypair (whichever role's keys were given)."""
    server = keys if keys.identity == SERVICE else load_keys(keys.directory, SERVICE)
    sock.curve_server = True
    sock.curve_publickey = server.public
    sock.curve_secretkey = server.secret


def make_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """A client socket of `keys`' identity, checking the server by the `service` public key."""
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.curve_serverkey = keys.server_public
