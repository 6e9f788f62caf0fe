"""The weight relay's wire format, and the call the controller makes on a relay (a published
interface, like the rest of the generation client; the relay itself is rollout/server/relay.py).

One TCP connection carries one request: a frame (4-byte big-endian length + a msgpack map) from
the caller, then either one reply frame (`fetch`), or a reply frame holding the version's file
list followed by every file's bytes in that order (`stream`, what one relay asks of the next).
Every request carries the servers' admin key; a relay answers nothing else.

- `{"op": "fetch", "key", "version", "source", "timeout_s", "chain"}`: make version `version` a
  complete directory on this node, read from `source` (a directory on the shared filesystem, or
  another relay's "host:port", asked for its copy of the same `chain`: the controller's id for
  one chain of one sync); reply `{"ok": true, "path", "bytes", "seconds", "copied"}` (`copied`
  false when the node already held it) or `{"ok": false, "error"}`.
- `{"op": "stream", "key", "version", "chain", "timeout_s"}`: reply `{"ok": true, "files": [[name,
  size], ...]}` and the bytes, sent as they arrive here (a relay forwards a version while it is
  still receiving it), or `{"ok": false, "error"}`.
"""
from __future__ import annotations

import asyncio
import socket
import struct

import msgpack

# Bytes per read and send: the unit a relay forwards as soon as it has it (so a chain of N
# relays delivers the last copy about (N - 1) chunks after the first, not N whole copies).
CHUNK_BYTES = 4 << 20
_LEN = struct.Struct(">I")
# A frame is a request or a file list: a larger length is refused before anything is allocated
# (the frame comes before the key is checked).
MAX_FRAME = 1 << 20


class RelayError(RuntimeError):
    """A relay refused or failed a request; the message names the relay and why."""


def encode_frame(obj: dict) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), CHUNK_BYTES))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes (at most {MAX_FRAME})")
    obj = msgpack.unpackb(recv_exact(sock, n), raw=False)
    if not isinstance(obj, dict):
        raise ConnectionError(f"frame is a {type(obj).__name__}, not a map")
    return obj


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"relay address must be host:port, got {address!r}")
    return host, int(port)


async def relay_fetch(address: str, key: str, version: int, source: str, timeout_s: float,
                      chain: str = "") -> dict:
    """Ask the relay at `address` to hold `version`, read from `source` (in chain `chain`: the
    id the relays of one chain share); its reply (ok only).
    Raises RelayError naming the relay on a refusal, a failure or no answer in `timeout_s`."""
    host, port = split_address(address)
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(encode_frame({"op": "fetch", "key": key, "version": version, "source": source,
                                           "timeout_s": timeout_s, "chain": chain}))
                await writer.drain()
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                reply = msgpack.unpackb(await reader.readexactly(n), raw=False)
            finally:
                writer.close()
    except TimeoutError:
        raise RelayError(f"relay {address}: no answer to fetch v{version} within {timeout_s:.0f} s") from None
    except (OSError, asyncio.IncompleteReadError) as e:
        raise RelayError(f"relay {address}: {type(e).__name__}: {e}") from e
    if not reply.get("ok"):
        raise RelayError(f"relay {address}: {reply.get('error', 'refused')}")
    return reply
