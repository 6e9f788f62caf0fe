"""Process basics every role shares: its log file, the metrics stream, clean shutdown, the
attention kernels a GPU role may use."""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from .expdir import ExpDir


def raise_descriptor_limit() -> int:
    """Let this process open as many files as its hard limit allows (Linux's soft default is
    1,024): a role's descriptors are its connections, model shards and checkpoint files, and a
    stranger holding idle connections must not leave it none for its own work. Returns the limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def import_user_module(name: str):
    """A module of the user's code (a `reward.function` or `rollout.workflow`), imported as every
    role imports it: the directory the run was launched in first on the path (roles start there as
    `python -m ...`, which puts it first), then PYTHONPATH and the installed packages. The checks
    before a launch import it the same way, from a `tandem` console script whose path would not
    hold that directory at all."""
    import importlib

    here = os.getcwd()
    if here not in sys.path[:1] and "" not in sys.path[:1]:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def setup_role_logging(exp: ExpDir, role: str, rank: int = 0, level: int = logging.INFO) -> Path:
    """Log to `<exp>/logs/<role>-<rank>.log` and stderr, each line tagged with the role."""
    exp.logs.mkdir(parents=True, exist_ok=True)
    path = exp.log_file(role, rank)
    fmt = logging.Formatter(f"%(asctime)s {role}-{rank} %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in (logging.FileHandler(path), logging.StreamHandler(sys.stderr)):
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(level)
    quiet_progress_bars()
    return path


def quiet_progress_bars() -> None:
    """A role's console is a file, not a terminal: transformers' and the Hub's progress bars (a
    "Writing model shards" bar at every publish) would fill it. Off for this process and what it
    imports or starts later (the Hub reads the variable at import), and now where transformers is
    already loaded (a forked role's is)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def attention_without_cudnn() -> None:
    """Turn PyTorch's cuDNN attention backend off in this process; `scaled_dot_product_attention`
    then takes flash or memory-efficient attention, as on GPUs before Hopper.

    cuDNN attention (PyTorch's pick for bf16 on an H100/H200) builds an execution graph for each
    new shape, which costs tens to hundreds of milliseconds, and RL's shapes seldom repeat: every
    decode step attends over one more column, every trained sequence has its own length. On an
    H200 the embedded server decoded a bf16 model (cuDNN's) at 42 ms a step with one request
    running against 5.5 ms with nine in float32 (not cuDNN's): 185 tokens/s against 2,732 at 16
    requests (benchmarks/results/gpu_tier.json), most likely for this reason; not yet re-measured
    with it off. Called where a model is put on a device: the embedded server's engine and both
    trainer backends."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


def exit_process(code: int) -> NoReturn:
    """End a program (a role, a `tandem` command) with `code`, without the interpreter's last
    collection of every module's object cycles: torch and transformers leave hundreds of
    thousands, which cost over a CPU-second at the exit of each process that loaded a model (0.6 s
    this way, measured on 2 cores). What the program left behind is collected now, so objects in
    cycles close their files as usual; the modules are frozen out of the last collection and
    handed back with the process."""
    gc.collect()
    gc.freeze()
    sys.exit(code)


class MetricsWriter:
    """Appends one JSON object per line to `<exp>/metrics.jsonl`.

    Each record is written with a single `write` on an O_APPEND descriptor, so lines from
    several processes interleave whole and never mix.
    """

    def __init__(self, exp: ExpDir, role: str, rank: int = 0):
        exp.root.mkdir(parents=True, exist_ok=True)
        self.role, self.rank = role, rank
        self._fd = os.open(exp.metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def log(self, **fields) -> None:
        record = {"time": time.time(), "role": self.role, "rank": self.rank, **fields}
        line = (json.dumps(record, default=_jsonable) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        os.close(self._fd)


class PhaseTimer:
    """Wall-clock seconds of a loop iteration's phases, as `<phase>_s` fields of its metrics
    record, plus `total_s` / the name given: keeps the timing out of the loop's own lines.

        timer = PhaseTimer()
        with timer.phase("wait"):
            batch = collect()
        record |= timer.fields(total="step_s")
    """

    def __init__(self):
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"{name}_s"] = self.seconds.get(f"{name}_s", 0.0) + time.perf_counter() - t

    def fields(self, total: str = "total_s") -> dict[str, float]:
        return {**self.seconds, total: time.perf_counter() - self.t0}


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def read_metrics(exp: ExpDir, role: str | None = None, event: str | None = None) -> list[dict]:
    """The records of `role` (all roles: None), only those of `event` if given."""
    if not exp.metrics.exists():
        return []
    out = []
    for line in exp.metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write; the rest of the stream is intact
        if (role is None or rec.get("role") == role) and (event is None or rec.get("event") == event):
            out.append(rec)
    return out


# How long a launcher gives a role between SIGTERM and SIGKILL (launcher/backends/local.py; on
# SLURM, the cluster's KillWait, 30 s by default). A role's clean shutdown fits inside it: a
# rollout worker killed mid-drain never says which groups it returns (rollout/worker.py).
STOP_GRACE_S = 15.0


class Shutdown:
    """Set by SIGTERM/SIGINT; long-running loops poll `requested` and finish cleanly."""

    def __init__(self):
        self.event = threading.Event()
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def install(self) -> Shutdown:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C forces the way out
        self.signal = signum
        self.event.set()
        logging.getLogger(__name__).info("received %s; shutting down", signal.Signals(signum).name)
