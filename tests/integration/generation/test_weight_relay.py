"""The weight relay (rollout/server/relay.py) over real TCP: a chain of relays, each in its own
directory as on its own node, fetching one version from a directory and from each other.

The relays run in this process (threads, as in a server) except in the process test; the
pipelining test holds the upstream itself (a TCP server in the test speaking the stream format)
so that "the next relay has the first chunk while this one still waits for the rest" is observed
without timing anything."""
from __future__ import annotations

import asyncio
import filecmp
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.rollout.client.relay import CHUNK_BYTES, RelayError, encode_frame, recv_frame, relay_fetch
from tandem.rollout.server.relay import KEEP, ServerRelay, WeightRelay, relay_root

pytestmark = pytest.mark.timeout(120)
KEY = "relay-key-for-tests"


def version_dir(root: Path, version: int, mb: int = 9) -> Path:
    d = root / "weights" / f"v{version}"
    (d / "tokenizer").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(mb << 20))
    (d / "config.json").write_text(f'{{"v": {version}}}')
    (d / "tokenizer" / "vocab.txt").write_text("a b c")
    return d


def same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    return not (cmp.diff_files or cmp.left_only or cmp.right_only) and all(
        same_tree(a / d, b / d) for d in cmp.common_dirs) and all(
        filecmp.cmp(a / f, b / f, shallow=False) for f in cmp.common_files)


@pytest.fixture
def relays(tmp_path):
    made = []

    def make(n: int) -> list[WeightRelay]:
        out = [WeightRelay(tmp_path / f"node{len(made) + i}", KEY, host="127.0.0.1").start() for i in range(n)]
        made.extend(out)
        return out
    yield make
    for r in made:
        r.close()


def addr(r: WeightRelay) -> str:
    return f"127.0.0.1:{r.port}"


def chain_fetch(relays: list[WeightRelay], version: int, source: Path, chain: str = "c1") -> list:
    async def main():
        sources = [str(source), *(addr(r) for r in relays[:-1])]
        return await asyncio.gather(*(relay_fetch(addr(r), KEY, version, s, 30, chain)
                                      for r, s in zip(relays, sources, strict=True)), return_exceptions=True)
    return asyncio.run(main())


def test_a_chain_of_relays_gives_every_node_the_exact_version_reading_the_source_once(tmp_path, relays, monkeypatch):
    src = version_dir(tmp_path, 3)
    reads = []
    original = WeightRelay._copy_from_dir
    monkeypatch.setattr(WeightRelay, "_copy_from_dir", lambda self, copy, s: reads.append(s) or original(self, copy, s))
    chain = relays(4)
    outs = chain_fetch(chain, 3, src)
    assert reads == [src]                      # only the first node read the shared directory
    for r, out in zip(chain, outs, strict=True):
        assert out["copied"] and Path(out["path"]) == r.root / "v3"
        assert same_tree(src, Path(out["path"]))
        assert not [p for p in r.root.iterdir() if p.name.startswith(".v")]   # no partial left


def test_the_next_relay_gets_each_chunk_while_this_one_still_receives(tmp_path, relays):
    """A hand-held upstream sends the file list and one chunk, then waits: the second relay must
    already have that chunk on its disk while the first has not got the rest (pipelining)."""
    size = 3 * CHUNK_BYTES
    payload = os.urandom(size)
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def upstream():
        conn, _ = listener.accept()
        with conn:
            assert recv_frame(conn)["op"] == "stream"
            conn.sendall(encode_frame({"ok": True, "files": [["model.safetensors", size]]}))
            conn.sendall(payload[:CHUNK_BYTES])
            release.wait(30)
            conn.sendall(payload[CHUNK_BYTES:])
    threading.Thread(target=upstream, daemon=True).start()
    first, second = relays(2)
    results = {}
    fetches = [threading.Thread(target=lambda r=r, s=s: results.__setitem__(
        r.port, asyncio.run(relay_fetch(addr(r), KEY, 5, s, 30, "c"))))
        for r, s in ((first, f"127.0.0.1:{listener.getsockname()[1]}"), (second, addr(first)))]
    for t in fetches:
        t.start()

    def partial_size(r: WeightRelay) -> int:
        files = list(r.root.glob(".v5.partial-*/model.safetensors"))
        return files[0].stat().st_size if files else -1
    deadline = time.monotonic() + 30
    while partial_size(second) < CHUNK_BYTES and time.monotonic() < deadline:
        time.sleep(0.01)
    assert partial_size(second) == CHUNK_BYTES and partial_size(first) == CHUNK_BYTES
    assert not (first.root / "v5").exists()     # the first relay is still waiting for the rest
    release.set()
    for t in fetches:
        t.join(30)
    for r in (first, second):
        assert (r.root / "v5" / "model.safetensors").read_bytes() == payload
    listener.close()


def test_an_upstream_naming_a_file_outside_the_version_is_refused(tmp_path, relays):
    listener = socket.create_server(("127.0.0.1", 0))

    def upstream():
        conn, _ = listener.accept()
        with conn:
            recv_frame(conn)
            conn.sendall(encode_frame({"ok": True, "files": [["../../escaped", 4]]}))
            conn.sendall(b"evil")
    threading.Thread(target=upstream, daemon=True).start()
    (r,) = relays(1)
    with pytest.raises(RelayError, match="leaves the version's directory"):
        asyncio.run(relay_fetch(addr(r), KEY, 1, f"127.0.0.1:{listener.getsockname()[1]}", 10))
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.rglob("escaped"))
    listener.close()


def test_a_version_larger_than_the_free_space_is_refused_before_it_is_written(tmp_path, relays, monkeypatch):
    import shutil
    from collections import namedtuple

    src = version_dir(tmp_path, 1, mb=2)
    (r,) = relays(1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 0, 1 << 20))   # 1 MiB free
    (out,) = chain_fetch([r], 1, src)
    assert isinstance(out, RelayError) and "has 0.00105 GB free, v1 needs 0.0021 GB" in str(out)
    assert not list(r.root.iterdir())


def test_a_wrong_key_gets_nothing(tmp_path, relays):
    src = version_dir(tmp_path, 1, mb=1)
    (r,) = relays(1)
    chain_fetch([r], 1, src)
    with pytest.raises(RelayError, match="wrong or missing key"):
        asyncio.run(relay_fetch(addr(r), "not-the-key", 1, str(src), 10))
    with socket.create_connection(("127.0.0.1", r.port)) as s:   # a stream request with a wrong key
        s.sendall(encode_frame({"op": "stream", "key": "x", "version": 1}))
        assert recv_frame(s) == {"ok": False, "error": "wrong or missing key"}


def test_a_failure_reaches_the_next_relay_at_once_with_its_cause(tmp_path, relays):
    """The first relay's source does not exist: the second, streaming from it in the same chain,
    fails at once with that cause instead of waiting out its timeout."""
    first, second = relays(2)
    t0 = time.monotonic()
    outs = chain_fetch([first, second], 2, tmp_path / "missing")
    assert time.monotonic() - t0 < 20          # not the 30 s timeout
    assert "is not a directory" in str(outs[0])
    assert "is not a directory" in str(outs[1]) and "relay 127.0.0.1" in str(outs[1])
    # A new chain for the same version (the controller's retry) is not answered by the old failure.
    src = version_dir(tmp_path, 2, mb=1)
    assert all(o["copied"] for o in chain_fetch([first, second], 2, src, chain="c2"))


def test_relays_of_one_node_share_one_copy_and_keep_the_newest_versions(tmp_path):
    shared = tmp_path / "node"
    a, b = (WeightRelay(shared, KEY, host="127.0.0.1").start() for _ in range(2))
    try:
        for v in range(1, 5):
            src = version_dir(tmp_path / f"s{v}", v, mb=1)
            assert chain_fetch([a], v, src)[0]["copied"]
            again = chain_fetch([b], v, src)[0]          # the node already holds it
            assert not again["copied"] and again["path"] == str(shared / f"v{v}")
        assert sorted(p.name for p in shared.iterdir() if p.name.startswith("v")) == \
            [f"v{v}" for v in range(5 - KEEP, 5)]
    finally:
        a.close()
        b.close()


def test_server_relays_remove_the_node_copy_when_the_last_stops(tmp_path):
    relay_dir = str(tmp_path / "relay")
    a = ServerRelay(relay_dir, 0, tmp_path / "exp", KEY, "127.0.0.1")
    b = ServerRelay(relay_dir, 1, tmp_path / "exp", KEY, "127.0.0.1")
    assert a.node == b.node and a.relay.root == relay_root(relay_dir, 0, tmp_path / "exp")
    chain_fetch([a.relay], 1, version_dir(tmp_path / "exp", 1, mb=1))
    a.close()
    assert (b.relay.root / "v1").is_dir()      # b still serves from it
    b.close()
    assert not b.relay.root.exists()
    own = ServerRelay(str(tmp_path / "r-{rank}"), 3, tmp_path / "exp", KEY, "127.0.0.1")
    assert str(tmp_path / "r-3") in own.node   # {rank}: a node of its own
    own.close()



def test_the_default_relay_directory_goes_with_the_last_experiment_using_it(tmp_path, monkeypatch):
    """Without gen.relay_dir the copies live under /dev/shm/tandem-relay-<uid> (here a stand-in
    directory): it stays while another experiment's copies are in it, and goes with the last."""
    import tandem.rollout.server.relay as relay_mod
    base = tmp_path / "shm" / "tandem-relay-test"
    monkeypatch.setattr(relay_mod, "default_relay_dir", lambda: base)
    first = ServerRelay("", 0, tmp_path / "exp-a", KEY, "127.0.0.1")
    second = ServerRelay("", 0, tmp_path / "exp-b", KEY, "127.0.0.1")
    assert first.relay.root.parent == base == second.relay.root.parent != first.relay.root
    first.close()
    assert not first.relay.root.exists() and second.relay.root.is_dir()
    second.close()
    assert not base.exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    ServerRelay(str(kept), 0, tmp_path / "exp-a", KEY, "127.0.0.1").close()
    assert kept.is_dir() and not list(kept.iterdir())   # a directory the user named is left, empty

def test_a_server_relay_copies_the_runs_weights_only(tmp_path):
    """A holder of the admin key asks a server's relay to fetch a directory outside the run's
    `weights/` (the user's home, another run): refused, nothing copied."""
    relay = ServerRelay(str(tmp_path / "relay"), 0, tmp_path / "exp", KEY, "127.0.0.1")
    try:
        elsewhere = version_dir(tmp_path / "other-run", 1, mb=1)
        with pytest.raises(RelayError, match="is not under .*exp/weights: a relay copies the run's weights only"):
            asyncio.run(relay_fetch(f"127.0.0.1:{relay.relay.port}", KEY, 1, str(elsewhere), 30))
        with pytest.raises(RelayError, match="not under"):   # nor through .. out of it
            asyncio.run(relay_fetch(f"127.0.0.1:{relay.relay.port}", KEY, 1,
                                    str(tmp_path / "exp" / "weights" / ".." / ".." / "other-run" / "weights" / "v1"), 30))
        assert not (relay.relay.root / "v1").exists()
        chain_fetch([relay.relay], 1, version_dir(tmp_path / "exp", 1, mb=1))   # the run's own: copied
    finally:
        relay.close()


def test_the_relay_directory_is_private_and_its_experiments_own(tmp_path):
    """/dev/shm is every user's: a relay directory open to others is refused (someone could put
    "versions" in it that would be served as already copied), and a new experiment at the path of
    an old one (new keys) gets a directory of its own, not the old one's leftover copies."""
    from tandem.services.protocol import generate_keys
    from tandem.services.protocol.private import NotPrivate

    shared = tmp_path / "shm"
    shared.mkdir()
    os.chmod(shared, 0o777)   # world-writable and not sticky: anyone may swap what is in it
    with pytest.raises(NotPrivate, match="may be written by others and is not sticky"):
        ServerRelay(str(shared / "relay"), 0, tmp_path / "exp", KEY, "127.0.0.1")
    open_base = tmp_path / "open"
    open_base.mkdir()
    os.chmod(open_base, 0o755)
    (open_base / "r").mkdir(mode=0o755)
    os.chmod(open_base / "r", 0o755)
    first = relay_root(str(open_base / "r"), 0, tmp_path / "exp")
    first.mkdir(mode=0o755)
    os.chmod(first, 0o755)
    with pytest.raises(NotPrivate, match="open to other users"):
        ServerRelay(str(open_base / "r"), 0, tmp_path / "exp", KEY, "127.0.0.1")

    exp = tmp_path / "exp2"
    generate_keys(exp / "keys")
    old = relay_root("/dev/shm/x", 0, exp)
    import shutil
    shutil.rmtree(exp)
    generate_keys(exp / "keys")   # the same path, another experiment
    assert relay_root("/dev/shm/x", 0, exp) != old


def test_a_chain_across_processes(tmp_path):
    """Three relays in three processes (as on three nodes), chained by the test."""
    code = ("import sys, time\nfrom tandem.rollout.server.relay import WeightRelay\n"
            "r = WeightRelay(sys.argv[1], sys.argv[2], host='127.0.0.1').start()\n"
            "print(r.port, flush=True)\ntime.sleep(600)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"p{i}"), KEY], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parents[3]) for i in range(3)]
    try:
        ports = [int(p.stdout.readline()) for p in procs]
        src = version_dir(tmp_path, 7)

        async def main():
            sources = [str(src), *(f"127.0.0.1:{port}" for port in ports[:-1])]
            return await asyncio.gather(*(relay_fetch(f"127.0.0.1:{port}", KEY, 7, s, 60, "x")
                                          for port, s in zip(ports, sources, strict=True)))
        for out in asyncio.run(main()):
            assert same_tree(src, Path(out["path"]))
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_relay_benchmark_runs_its_quick_size():
    """benchmarks/weight_relay.py --quick: both paths complete for 1 and 2 nodes through real relay
    processes, the "filesystem" one throttled (no timing is asserted)."""
    from benchmarks import weight_relay

    out = weight_relay.main(quick=True)
    assert set(out["results"]) == {"1", "2"}
    assert all(r["direct"] > 0 and r["relay"] > 0 for r in out["results"].values())


def test_an_oversized_or_silent_request_is_dropped_and_the_relay_goes_on(tmp_path, relays, monkeypatch):
    import struct

    from tandem.rollout.server import relay as relay_module

    monkeypatch.setattr(relay_module, "REQUEST_TIMEOUT_S", 0.5)
    src = version_dir(tmp_path, 1, mb=1)
    (r,) = relays(1)
    with socket.create_connection(("127.0.0.1", r.port)) as s:   # says 2 GiB are coming
        s.sendall(struct.pack(">I", 2 << 30))
        assert s.recv(1) == b""                                    # closed without reading them
    with socket.create_connection(("127.0.0.1", r.port)) as s:   # says nothing
        s.settimeout(10)
        assert s.recv(1) == b""
    assert chain_fetch([r], 1, src)[0]["copied"]
