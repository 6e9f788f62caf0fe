"""A generation node's weight relay (`gen.weight_relay`): every version reaches the node once, and
is passed on while it arrives.

With disk weights every server reads every version from the shared filesystem, so the filesystem
carries (servers x model size) per version: at 48 generation nodes of 8 servers a 3 GB model is
1.2 TB a version. With the relay the controller orders the nodes into a chain
(services/controller/weights/relay.py): the first node's relay reads the trainer's directory, each
next one streams it from the one before, chunk by chunk as it arrives, and every server of a node
loads that node's copy from local memory. The filesystem carries one read per version; the chain
adds about one chunk's transfer time per node.

Every server runs a relay (the embedded server in its process, SGLang beside it in its role);
those of one node share a directory (`gen.relay_dir`, `/dev/shm` by default), so a version is
copied to a node once, whichever of its relays fetched it. A copy is written under a temporary
name and renamed into place: a directory named `v<N>` is complete. The newest `KEEP` versions
stay (a server may still be loading the one before). The wire format is rollout/client/relay.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import shutil
import socket
import socketserver
import threading
import time
from pathlib import Path

from tandem.rollout.client.relay import CHUNK_BYTES, encode_frame, recv_frame, split_address
from tandem.services.protocol.keys import experiment_identity
from tandem.services.protocol.private import make_private_dir

log = logging.getLogger(__name__)

KEEP = 2
# Seconds a connection has to send its request.
REQUEST_TIMEOUT_S = 30.0
_VERSION_DIR = re.compile(r"^v(\d+)$")


def default_relay_dir() -> Path:
    return Path("/dev/shm") / f"tandem-relay-{os.getuid()}"


class _Copy:
    """One version arriving on this node: its files and how many bytes of each are written, so
    a downstream relay can be sent every byte as soon as it is here."""

    def __init__(self, version: int, partial: Path, chain: str = ""):
        # chain: the controller's id for the chain this copy belongs to; the next relay asks for
        # the copy of its own chain, so a copy that failed in an earlier chain is not mistaken for it.
        self.version, self.dir, self.chain = version, partial, chain
        self.files: list[tuple[str, int]] | None = None
        self.written: dict[str, int] = {}
        self.done = False
        self.error: str | None = None
        self.cond = threading.Condition()

    def wait(self, ready, deadline: float) -> None:
        """Wait (holding `cond`) until `ready()` or an error; raise on error or at `deadline`."""
        while not ready():
            if self.error:
                raise ConnectionError(f"v{self.version} failed at the relay serving it: {self.error}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"v{self.version} did not progress in time")
            self.cond.wait(min(left, 1.0))
        if self.error:
            raise ConnectionError(f"v{self.version} failed at the relay serving it: {self.error}")


class _Server(socketserver.ThreadingTCPServer):
    """One thread per connection, at most MAX_CONNECTIONS at once: a relay listens on every
    interface (the next node must reach it) and checks the key only once a request arrives, so
    idle connections from anyone must not pile up threads and descriptors (one more is closed)."""
    allow_reuse_address = True
    daemon_threads = True
    MAX_CONNECTIONS = 64

    def server_activate(self) -> None:
        super().server_activate()
        self.active, self._counted = 0, threading.Lock()

    def verify_request(self, request, client_address) -> bool:
        with self._counted:
            if self.active >= self.MAX_CONNECTIONS:
                return False
            self.active += 1
            return True

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._counted:
                self.active -= 1


class WeightRelay:
    """This server's relay: a TCP service (one thread per connection) over the node's directory."""

    def __init__(self, root: str | Path, key: str, host: str = "0.0.0.0", port: int = 0,
                 sources: str | Path | None = None):
        if not key:
            raise ValueError("a weight relay needs the servers' admin key (it serves the model's weights)")
        self.root, self._key = Path(root), key.encode()
        # The only directory a fetch may read (the trainer's `<exp>/weights/`): a holder of the
        # key must not make the relay copy, and serve, whatever this server can read.
        self.sources = Path(sources).resolve() if sources is not None else None
        # /dev/shm is shared by every user of the node: a directory someone else made (or may
        # write) there could hold their "versions", which would be served as already copied.
        make_private_dir(self.root)
        self._copies: dict[int, _Copy] = {}
        self._lock = threading.Condition()
        relay = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                relay._handle(self.request)

        self._server = _Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="weight relay")

    def start(self) -> WeightRelay:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- the node's copies ---------------------------------------------------------------------

    def complete(self, version: int) -> Path | None:
        path = self.root / f"v{version}"
        return path if path.is_dir() else None

    def fetch(self, version: int, source: str, timeout_s: float, chain: str = "") -> dict:
        """Make `version` complete on this node from `source` (a directory, or "host:port" of the
        previous relay in chain `chain`); {"path", "bytes", "seconds", "copied"}. Raises with the
        cause."""
        t0 = time.monotonic()
        if (path := self.complete(version)) is not None:
            return {"path": str(path), "bytes": _size(path), "seconds": 0.0, "copied": False}
        partial = self.root / f".v{version}.partial-{os.getpid()}-{threading.get_ident()}"
        copy = _Copy(version, partial, chain)
        with self._lock:    # replaces a failed copy: a downstream relay asking now waits for this one
            self._copies[version] = copy
            self._lock.notify_all()
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(mode=0o700)
            if source.startswith("/"):
                total = self._copy_from_dir(copy, self._source_dir(source))
            else:
                total = self._copy_from_relay(copy, source, t0 + timeout_s)
            final = self.root / f"v{version}"
            with copy.cond:
                try:
                    os.rename(partial, final)
                except OSError:          # another relay of this node completed it first
                    if not final.is_dir():
                        raise
                    shutil.rmtree(partial, ignore_errors=True)
                copy.dir, copy.done = final, True
                copy.cond.notify_all()
        except BaseException as e:
            with copy.cond:
                copy.error = f"{type(e).__name__}: {e}"
                copy.cond.notify_all()
            shutil.rmtree(partial, ignore_errors=True)
            raise
        self._prune(version)
        return {"path": str(final), "bytes": total, "seconds": time.monotonic() - t0, "copied": True}

    def _source_dir(self, source: str) -> Path:
        path = Path(source).resolve()
        if self.sources is not None and not path.is_relative_to(self.sources):
            raise PermissionError(f"{source} is not under {self.sources}: a relay copies the run's weights only")
        return path

    def _copy_from_dir(self, copy: _Copy, src: Path) -> int:
        if not src.is_dir():
            raise FileNotFoundError(f"{src} is not a directory")
        files = [(str(p.relative_to(src)), p.stat().st_size) for p in sorted(src.rglob("*")) if p.is_file()]
        self._begin(copy, files)
        for name, _ in files:
            with open(src / name, "rb") as f:
                self._receive(copy, name, iter(lambda f=f: f.read(CHUNK_BYTES), b""))
        return sum(size for _, size in files)

    def _copy_from_relay(self, copy: _Copy, address: str, deadline: float) -> int:
        with socket.create_connection(split_address(address), timeout=max(1.0, deadline - time.monotonic())) as s:
            s.sendall(encode_frame({"op": "stream", "key": self._key.decode(), "version": copy.version,
                                    "chain": copy.chain, "timeout_s": max(1.0, deadline - time.monotonic())}))
            head = recv_frame(s)
            if not head.get("ok"):
                raise ConnectionError(f"relay {address}: {head.get('error', 'refused')}")
            files = [(str(n), int(size)) for n, size in head["files"]]
            self._begin(copy, files)
            for name, size in files:
                self._receive(copy, name, _chunks(s, size))
        return sum(size for _, size in files)

    def _begin(self, copy: _Copy, files: list[tuple[str, int]]) -> None:
        for name, _ in files:
            if name.startswith("/") or ".." in Path(name).parts:
                raise ValueError(f"file name {name!r} leaves the version's directory")
        need, free = sum(size for _, size in files), shutil.disk_usage(self.root).free
        if need > free:   # /dev/shm is memory: a full one fails writes half-way, or worse
            raise OSError(f"{self.root} has {free / 1e9:.3g} GB free, v{copy.version} needs {need / 1e9:.3g} GB "
                          f"(gen.relay_dir; the node's servers read the shared directory instead)")
        with copy.cond:
            copy.files = files
            copy.cond.notify_all()

    def _receive(self, copy: _Copy, name: str, chunks) -> None:
        path = copy.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as out:
            with copy.cond:     # only now may a downstream relay open it
                copy.written[name] = 0
            for chunk in chunks:
                out.write(chunk)
                out.flush()
                with copy.cond:
                    copy.written[name] += len(chunk)
                    copy.cond.notify_all()

    def _prune(self, newest: int) -> None:
        versions = sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _VERSION_DIR.match(p.name)))
        for v in versions:
            if v < newest and v not in versions[-KEEP:]:
                shutil.rmtree(self.root / f"v{v}", ignore_errors=True)
                with self._lock:
                    self._copies.pop(v, None)

    # --- serving -------------------------------------------------------------------------------

    def _handle(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(REQUEST_TIMEOUT_S)    # a connection that never sends its request ends
            req = recv_frame(sock)
            sock.settimeout(None)
            if not hmac.compare_digest(str(req.get("key", "")).encode(), self._key):
                sock.sendall(encode_frame({"ok": False, "error": "wrong or missing key"}))
                return
            version, timeout_s = int(req.get("version", -1)), float(req.get("timeout_s", 60.0))
            if req.get("op") == "fetch":
                try:
                    out = self.fetch(version, str(req.get("source", "")), timeout_s, str(req.get("chain", "")))
                except Exception as e:   # noqa: BLE001 - reported to the controller (it retries, then falls back)
                    log.warning("relay: fetch v%d from %s failed: %s: %s", version, req.get("source"),
                                type(e).__name__, e)
                    sock.sendall(encode_frame({"ok": False, "error": f"fetch v{version} from {req.get('source')}: "
                                                                    f"{type(e).__name__}: {e}"}))
                    return
                sock.sendall(encode_frame({"ok": True, **out}))
            elif req.get("op") == "stream":
                self._stream(sock, version, str(req.get("chain", "")), time.monotonic() + timeout_s)
            else:
                sock.sendall(encode_frame({"ok": False, "error": f"unknown op {req.get('op')!r}"}))
        except (OSError, ConnectionError, ValueError) as e:
            log.warning("relay: request ended: %s: %s", type(e).__name__, e)

    def _stream(self, sock: socket.socket, version: int, chain: str, deadline: float) -> None:
        """Send `version` to the next relay: from the complete copy, or from the copy of `chain`
        arriving now (waiting for it to start: the controller asks every node at once)."""
        copy = self._copy_to_serve(version, chain, deadline)
        if copy is None:
            sock.sendall(encode_frame({"ok": False, "error": f"v{version} is not on this node and not arriving"}))
            return
        try:
            with copy.cond:
                copy.wait(lambda: copy.files is not None, deadline)
                files = list(copy.files)
        except (ConnectionError, TimeoutError) as e:   # the copy here failed: say why, at once
            sock.sendall(encode_frame({"ok": False, "error": str(e)}))
            return
        sock.sendall(encode_frame({"ok": True, "files": [[n, size] for n, size in files]}))
        for name, size in files:
            with copy.cond:
                copy.wait(lambda name=name: name in copy.written or copy.done, deadline)
                f = open(copy.dir / name, "rb")   # under the lock: the rename to v<N> cannot interleave
            with f:
                sent = 0
                while sent < size:
                    with copy.cond:
                        copy.wait(lambda name=name, sent=sent: copy.done or copy.written.get(name, 0) > sent, deadline)
                        here = size if copy.done else copy.written[name]
                    # From the page cache to the socket in the kernel: no copy through this process.
                    n = sock.sendfile(f, sent, min(CHUNK_BYTES, here - sent))
                    if not n:
                        raise ConnectionError(f"{name} of v{version} ended at {sent} of {size} bytes")
                    sent += n

    def _copy_to_serve(self, version: int, chain: str, deadline: float) -> _Copy | None:
        with self._lock:
            while True:
                copy = self._copies.get(version)
                if copy is not None and (copy.chain == chain or copy.done):
                    return copy
                if (path := self.complete(version)) is not None:
                    done = _Copy(version, path)
                    done.files = [(str(p.relative_to(path)), p.stat().st_size)
                                  for p in sorted(path.rglob("*")) if p.is_file()]
                    done.done = True
                    return done
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(min(left, 0.5))


def _chunks(sock: socket.socket, size: int):
    """`size` bytes from `sock`, CHUNK_BYTES at a time, received into one reused buffer (each
    chunk is written out before the next is received)."""
    buf = memoryview(bytearray(min(CHUNK_BYTES, size)))
    left = size
    while left:
        want, got = min(CHUNK_BYTES, left), 0
        while got < want:
            n = sock.recv_into(buf[got:want])
            if not n:
                raise ConnectionError(f"connection closed with {left - got} of {size} bytes to come")
            got += n
        left -= want
        yield buf[:want]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def relay_root(relay_dir: str, rank: int, exp_root: str | Path) -> Path:
    """The directory a server's relay keeps the node's copies in: `gen.relay_dir` (`{rank}` in it
    gives each server a directory, and so a node, of its own: what a one-machine run uses to
    chain its servers as if each were a node), else /dev/shm's; one subdirectory per experiment,
    named by its path and its keys (made once per experiment): a new experiment at the path of
    an old one whose copies a crash left behind never takes them for its own versions."""
    base = Path(relay_dir.format(rank=rank)) if relay_dir else default_relay_dir()
    exp = Path(exp_root).resolve()
    return base / hashlib.sha256(str(exp).encode() + b"\0" + experiment_identity(exp / "keys")).hexdigest()[:12]


class ServerRelay:
    """The relay one server runs (`gen.weight_relay`), and what the server announces of it. The
    node's directory is removed when the last relay using it stops (a marker per live relay), so a
    finished run leaves no copy in /dev/shm."""

    def __init__(self, relay_dir: str, rank: int, exp_root: str | Path, key: str | None, host: str):
        if not key:
            raise ValueError("gen.weight_relay needs the servers' admin key file (--admin-api-key-file)")
        root = relay_root(relay_dir, rank, exp_root)
        self.own_base = None if relay_dir else root.parent   # /dev/shm's: ours to remove once empty
        self.relay = WeightRelay(root, key, host=host, sources=Path(exp_root) / "weights").start()
        self.marker = root / f".alive-{os.getpid()}-{self.relay.port}"
        self.marker.touch()
        self.address = f"{host}:{self.relay.port}"
        self.node = f"{socket.gethostname()}:{root}"

    def service_fields(self) -> dict:
        """Added to `<exp>/services/gen-<rank>.json`; the launcher registers them."""
        return {"relay": self.address, "relay_node": self.node}

    def close(self) -> None:
        self.relay.close()
        self.marker.unlink(missing_ok=True)
        alive = [m for m in self.relay.root.glob(".alive-*") if _pid_alive(m.name.split("-")[1])]
        if not alive:
            shutil.rmtree(self.relay.root, ignore_errors=True)
            if self.own_base is not None:
                with contextlib.suppress(OSError):   # another experiment's copies are still there
                    self.own_base.rmdir()


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
