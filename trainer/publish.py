"""Making a new policy version visible to the generation servers: on disk, or by broadcast.

Disk: `<exp>/weights/v<N>/` is written in a temp directory beside it and renamed into place, so
a server told to load v<N> never sees half a checkpoint; the last `keep` versions stay (a
server still loading v<N-1> must not find it deleted).

Broadcast: the trainer's rank 0 and the generation servers form a process group of their own
(not the trainer's world), with the rendezvous SGLang's `/init_weights_update_group` uses
(`services.protocol.weight_group.join_weight_group`, shared with the servers; trainer = rank 0).
Then every tensor is broadcast from rank 0 in the order of `WeightsReady.names`, one broadcast
per tensor, as SGLang's `/update_weights_from_distributed` receives them. `gloo` on CPU and
`nccl` on GPUs go through the same code, so the distributed path is tested here.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from services.protocol import WeightsReady, free_port
from services.protocol.weight_group import join_weight_group, leave_weight_group
from trainer.backend import TrainBackend

log = logging.getLogger(__name__)

VERSION_DIR = re.compile(r"^v(\d+)$")


def weights_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def published_versions(root: Path) -> list[int]:
    root = Path(root)
    if not root.exists():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := VERSION_DIR.match(p.name)) and p.is_dir())


def publish_to_disk(backend: TrainBackend, root: Path, version: int, keep: int) -> tuple[Path, dict]:
    """Export the model as `<root>/v<version>/` atomically; prune to the newest `keep` versions.

    Collective (every rank calls it; only rank 0 writes). Returns (path, timings in seconds).
    """
    root = Path(root)
    final = weights_dir(root, version)
    tmp = root / f".v{version}.tmp-{os.getpid()}"
    t0 = time.perf_counter()
    if backend.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    backend.export_hf(tmp)
    t1 = time.perf_counter()
    if backend.rank == 0:
        _fsync_tree(tmp)
        if final.exists():  # left by a run that crashed after publishing; this one replaces it
            stale = root / f".v{version}.old-{os.getpid()}"
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(root)
    t2 = time.perf_counter()
    if backend.rank == 0:
        for old in published_versions(root)[:-keep]:
            shutil.rmtree(weights_dir(root, old), ignore_errors=True)
    t3 = time.perf_counter()
    return final, {"export_s": t1 - t0, "rename_s": t2 - t1, "prune_s": t3 - t2}


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- broadcast ----------------------------------------------------------------------------------
class BroadcastPublisher:
    """Rank 0 of the trainer sends full tensors to the generation servers over a fresh group.

    `publish()` returns the WeightsReady to send and a callable that performs the rendezvous and
    the broadcasts (run it in a thread while the controller tells the servers to join; it
    returns the phase timings).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, n_receivers: int = 1,
                 timeout_s: float = 300.0, snapshot: bool = False):
        self.host, self.port = host, port
        # Copy the tensors first when training continues during the broadcast (overlap mode).
        self.snapshot = snapshot
        self.n_receivers = n_receivers
        self.timeout_s = timeout_s

    def prepare(self, backend: TrainBackend, version: int) -> tuple[WeightsReady, Callable[[], dict]]:
        params = [(n, t.clone() if self.snapshot else t) for n, t in backend.full_parameters()]
        port = self.port or free_port(self.host)
        world = 1 + self.n_receivers
        group_name = f"tandem-weights-v{version}"
        ready = WeightsReady(version=version, how="broadcast", group_name=group_name,
                             master_address=self.host, master_port=port, world_size=world,
                             names=[n for n, _ in params],
                             dtypes=[str(t.dtype).removeprefix("torch.") for _, t in params],
                             shapes=[list(t.shape) for _, t in params])

        def send() -> dict:
            t0 = time.perf_counter()
            pg = join_weight_group(self.host, port, 0, world, group_name, timeout_s=self.timeout_s)
            t1 = time.perf_counter()
            try:
                for _, t in params:
                    dist.broadcast(t.contiguous(), src=0, group=pg)
                t2 = time.perf_counter()
            finally:
                leave_weight_group(pg)
            n_bytes = sum(t.numel() * t.element_size() for _, t in params)
            return {"rendezvous_s": t1 - t0, "broadcast_s": t2 - t1, "bytes": n_bytes}

        return ready, send


class BackgroundCall:
    """Run a function in a thread; `result()` joins and re-raises its exception."""

    def __init__(self, fn: Callable[[], dict], name: str = "background call"):
        self.name = name
        self._out: dict = {}
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=name)
        self._thread.start()

    def _run(self, fn):
        try:
            self._out = fn()
        except BaseException as e:  # handed to the caller in result()
            self._err = e

    def result(self, timeout_s: float | None = None) -> dict:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name} did not finish in time")
        if self._err is not None:
            raise self._err
        return self._out
