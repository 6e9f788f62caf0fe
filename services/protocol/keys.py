"""Per-experiment CURVE keys: one keypair, shared by the experiment's members only.

Every socket is CURVE-encrypted; servers accept a client only if it proves possession of the
experiment's secret key (ZAP authentication), so a peer from another experiment or none at all
gets nothing through.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

KEY_NAME = "experiment"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    directory: Path


def generate_keys(keys_dir: str | os.PathLike) -> CurveKeys:
    """Create the experiment keypair (mode 0600) unless it exists; return it."""
    d = Path(keys_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)   # never the group's, whatever experiment.group_access says
    if not (d / f"{KEY_NAME}.key_secret").exists():
        old = os.umask(0o077)   # created 0600: not readable by others for an instant
        try:
            zmq.auth.create_certificates(str(d), KEY_NAME)
        finally:
            os.umask(old)
    return load_keys(d)


def experiment_identity(keys_dir: str | os.PathLike) -> bytes:
    """What tells this experiment from another made at the same path: its public key, made once
    per experiment (b"" before there is one)."""
    try:
        return (Path(keys_dir) / f"{KEY_NAME}.key").read_bytes()
    except OSError:
        return b""


def load_keys(keys_dir: str | os.PathLike) -> CurveKeys:
    d = Path(keys_dir)
    secret_file = d / f"{KEY_NAME}.key_secret"
    if not secret_file.exists():
        raise FileNotFoundError(f"no experiment keys in {d}; create the experiment with `tandem run` "
                                f"or `tandem keys init {d.parent}`")
    pub, sec = zmq.auth.load_certificate(str(secret_file))
    return CurveKeys(pub, sec, d)


class _AllowedKeys:
    """ZAP credentials provider: admits the public keys of the experiments this process serves
    (one in production; tests host servers of several experiments in one process)."""

    def __init__(self):
        self.keys: set[bytes] = set()

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return z85_key in self.keys


_authenticators: dict[int, tuple[ThreadAuthenticator, _AllowedKeys]] = {}


def ensure_authenticator(ctx: zmq.Context, keys: CurveKeys) -> None:
    """Start (once per context) the ZAP handler, and admit this experiment's public key."""
    entry = _authenticators.get(id(ctx))
    if entry is None:
        auth, allowed = ThreadAuthenticator(ctx), _AllowedKeys()
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=allowed)
        entry = _authenticators[id(ctx)] = (auth, allowed)
    entry[1].keys.add(keys.public)


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def make_client(sock: zmq.Socket, keys: CurveKeys, server_public: bytes | None = None) -> None:
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.curve_serverkey = server_public or keys.public
