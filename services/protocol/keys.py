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
    os.chmod(d, 0o700)
    if not (d / f"{KEY_NAME}.key_secret").exists():
        pub, sec = zmq.auth.create_certificates(str(d), KEY_NAME)
        os.chmod(pub, 0o600)
        os.chmod(sec, 0o600)
    return load_keys(d)


def load_keys(keys_dir: str | os.PathLike) -> CurveKeys:
    d = Path(keys_dir)
    secret_file = d / f"{KEY_NAME}.key_secret"
    if not secret_file.exists():
        raise FileNotFoundError(f"no experiment keys in {d}; create the experiment with `tandem run` "
                                f"or `tandem keys init {d.parent}`")
    pub, sec = zmq.auth.load_certificate(str(secret_file))
    return CurveKeys(pub, sec, d)


_authenticators: dict[int, ThreadAuthenticator] = {}


def ensure_authenticator(ctx: zmq.Context, keys: CurveKeys) -> None:
    """Start (once per context) the ZAP handler that admits only the experiment's public key."""
    if id(ctx) in _authenticators:
        return
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.directory))
    _authenticators[id(ctx)] = auth


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def make_client(sock: zmq.Socket, keys: CurveKeys, server_public: bytes | None = None) -> None:
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.curve_serverkey = server_public or keys.public
