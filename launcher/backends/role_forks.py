"""Local roles started as forks of one interpreter that has already imported torch and transformers.

Why: on a CPU machine a model role spends most of its start importing torch, transformers and
the machinery transformers' `from_pretrained` pulls in (torch.distributed.tensor, dynamo, sympy):
about 5 CPU-seconds each on 2 cores, before any work. A local run starts at least three such
roles (generation server, trainer, rollout worker), more with evaluations and ranks. A fork
of a process that imported them once starts in milliseconds, and the pages stay shared.

What stays as with a fresh interpreter: each role is its own process, in its own session, with
its own console file, environment and CPU set; its command line (`python -m tandem.launcher.cli <role>
...`) is run as the interpreter runs `-m` (runpy, as `__main__`), and it exits the same way
(`exit_process`: atexit callbacks, flushed files, the exit code). The supervisor sees a pid, a
`poll()` and a `wait()`, as from `subprocess.Popen`. What differs: a role's CPU time
(role_cpu.json) no longer includes the imports, and the preloaded modules' import-time state
(read from variables the role and the server share) is the server's.

When it is not used (a fresh interpreter, as before): `launcher.fork_roles: false`; a CUDA (or
ROCm) build of torch — a CUDA context cannot cross a fork, and on a GPU machine the model load,
not the imports, is what a role waits for; the light services (controller, reward: they never
import torch); a command that is not `python -m ...`; a role whose environment differs from the
server's in a variable read at start or import (PYTHON*, HF_*, TORCH*, ...); imports that leave a
thread running; and every role after the server failed (said once in the launcher's log).
"""
from __future__ import annotations

import ctypes
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from ..launcher_watch import stat_fields

log = logging.getLogger(__name__)

# What every model role imports before its first line of work.
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.masking_utils",
           "transformers.core_model_loading", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "tandem.launcher.cli")
# Kinds of role that import torch (all but the rollout worker load a model).
FORKED_KINDS = ("gen", "trainer", "rollout", "eval")
# Environment variables read when the interpreter starts or a preloaded library is imported: a
# role that needs another value than the server's is started fresh.
READ_AT_IMPORT = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "LD_", "MALLOC",
                  "OPENBLAS", "GOMP", "KMP", "CUDA", "NCCL", "TOKENIZERS", "TANDEM_EMULATE_NCCL")
READY_TIMEOUT_S = 180.0
# Bytes of the server's command line and environment that each fork overwrites with its own
# (what `ps` and /proc show, and what tools that find a role by its command line read).
SHOW_ROOM = 4096


def gpu_build_of_torch() -> bool:
    """Whether the installed torch is a CUDA or ROCm build, without importing it (its GPU library
    ships beside the CPU one)."""
    import importlib.util
    spec = importlib.util.find_spec("torch")
    lib = Path(next(iter(spec.submodule_search_locations or []), "")) / "lib" if spec else None
    return lib is not None and any((lib / name).exists() for name in ("libtorch_cuda.so", "libtorch_hip.so"))


def differs_at_import(env: dict[str, str], server_env: dict[str, str]) -> list[str]:
    """Variables read at start or import whose value in `env` is not the server's."""
    keys = {k for k in (*env, *server_env) if k.startswith(READ_AT_IMPORT)}
    return sorted(k for k in keys if env.get(k) != server_env.get(k))


class ForkedRole:
    """A role forked by the server, as the supervisor uses a `subprocess.Popen`."""

    def __init__(self, forks: RoleForks, pid: int, args: list[str]):
        self._forks, self.pid, self.args = forks, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._forks.collect(0)
        if self.returncode is None and self._forks.lost and not _alive(self.pid):
            self.returncode = 1   # its exit was the server's to hear, and the server is gone
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._forks.collect(0.1 if left is None else min(0.1, left))
        return self.returncode


class RoleForks:
    """The launcher's side: starts the server, hands it roles to fork, and hears their exits."""

    def __init__(self, console: Path, env: dict[str, str], also_preload: tuple[str, ...] = (),
                 cpus: set[int] | None = None):
        """`also_preload`: modules the roles to be forked import besides PRELOAD's; `cpus`: where
        the server imports them (default: this process's CPUs; each fork is pinned to its own)."""
        self.env = env
        self._lock = threading.RLock()
        self._roles: dict[int, ForkedRole] = {}      # pid -> a role not yet heard to exit
        self._asked: dict[int, list[str]] = {}       # request -> its argv, until forked
        self._forked: dict[int, ForkedRole] = {}     # request -> its role, until spawn returns it
        self._next_id = 0
        self._ready: bool | None = None   # None: not heard yet
        ours, theirs = _connection_pair()
        with open(console, "ab") as out:
            argv = [sys.executable, "-m", __name__, str(theirs.fileno()), str(console), "." * SHOW_ROOM,
                    *also_preload]
            self._server = subprocess.Popen(argv, env={**env, "TANDEM_FORK_ROOM": "." * SHOW_ROOM},
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            pass_fds=(theirs.fileno(),), start_new_session=True)
        if cpus:
            try:
                os.sched_setaffinity(self._server.pid, cpus)
            except ProcessLookupError:   # it died at once: _wait_ready says so
                pass
        theirs.close()
        self._conn: Connection | None = ours
        self.console = console

    def spawn(self, command: list[str], env: dict[str, str], console: Path) -> ForkedRole | None:
        """Fork `python -m MODULE ARGS` (`command` without the interpreter) with `env`, its output
        appended to `console`; None when the server cannot (the caller starts the role fresh)."""
        if command[:1] != ["-m"] or differs_at_import(env, self.env) or not self._wait_ready():
            return None
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            self._asked[rid] = command
            if not self._send(("fork", rid, command, env, str(console))):
                return None
            while rid not in self._forked:
                if self._conn is None:
                    return None
                self._receive(5.0)
            return self._forked.pop(rid)

    @property
    def lost(self) -> bool:
        """The server is gone (exits of the roles it forked can no longer be heard)."""
        return self._conn is None

    def collect(self, timeout: float) -> None:
        """Read what the server said within `timeout` seconds: exits, replies."""
        with self._lock:
            self._receive(timeout)

    def close(self) -> None:
        """Hang up: the server exits (the roles it forked are the supervisor's to stop)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        try:
            self._server.wait(10)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()

    def _wait_ready(self) -> bool:
        with self._lock:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while self._ready is None and self._conn is not None and time.monotonic() < deadline:
                self._receive(0.5)
            if self._ready is None:
                self._fail("no word from it in time" if self._conn is not None else "it exited")
            return bool(self._ready)

    def _send(self, message: tuple) -> bool:
        try:
            self._conn.send(message)
            return True
        except (OSError, AttributeError):
            self._fail("it stopped answering")
            return False

    def _receive(self, timeout: float) -> bool:
        """Handle the messages waiting (or arriving within `timeout`); False when none came."""
        got = False
        try:
            while self._conn is not None and self._conn.poll(timeout if not got else 0):
                got = True
                kind, *rest = self._conn.recv()
                if kind == "ready":
                    self._ready = True
                    log.info("roles start as forks of one interpreter (pid %d) that imported %s", self._server.pid,
                             ", ".join(PRELOAD[:2]))
                elif kind == "unavailable":
                    self._fail(rest[0])
                elif kind == "forked":
                    rid, pid = rest
                    self._roles[pid] = self._forked[rid] = ForkedRole(self, pid, self._asked.pop(rid))
                elif kind == "exited" and rest[0] in self._roles:
                    self._roles.pop(rest[0]).returncode = rest[1]
        except (EOFError, OSError):
            self._fail("it exited")
        return got

    def _fail(self, why: str) -> None:
        if self._ready is not False:
            log.info("roles start as fresh interpreters: the fork server cannot fork them (%s; see %s)", why,
                     self.console)
        self._ready = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _connection_pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    ours, theirs = Connection(a.detach()), Connection(b.detach())
    os.set_inheritable(theirs.fileno(), True)
    return ours, theirs


def _alive(pid: int) -> bool:
    """Running (a zombie whose new parent has not reaped it yet counts as ended)."""
    try:
        return stat_fields(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# The server: `python -m tandem.launcher.backends.role_forks FD CONSOLE ROOM [MODULE ...]` (ROOM: see
# SHOW_ROOM; MODULEs: also preloaded).

def serve(conn: Connection) -> tuple[list[str], dict[str, str], str] | None:
    """Fork each role asked for until the launcher hangs up, reporting every exit. Returns None in
    the server, and in each fork what that fork is to run."""
    children: set[int] = set()
    while True:
        try:
            if conn.poll(0.05):
                _, rid, command, env, console = conn.recv()
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    return command, env, console
                children.add(pid)
                conn.send(("forked", rid, pid))
        except (EOFError, OSError):
            return None
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            try:
                conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))
            except OSError:
                return None


def become(command: list[str], env: dict[str, str], console: str) -> None:
    """In the fork: what `subprocess.Popen([python, *command], start_new_session=True, ...)` would
    have given the role (its session, console, environment), then `python -m MODULE ARGS` itself,
    run as the interpreter runs it."""
    os.setsid()
    out = os.open(console, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.dup2(null, 0)
    os.close(out)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    import numpy as np
    import torch
    np.random.seed()   # a fresh interpreter's global generator is seeded from the OS, not shared
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))   # libgomp read the server's at import
    _, module, *args = command
    show_as([sys.executable, *command], env)
    sys.argv = [module, *args]
    # What `python -m MODULE` does (runpy's private _run_module_as_main): run it in a clean
    # __main__ (this server's names cleared from it, so a role's module-level objects are torn
    # down at exit as in a fresh interpreter). An interpreter without it: the public form.
    run_as_main = getattr(runpy, "_run_module_as_main", None)
    if run_as_main is None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    # Preloaded (launcher.cli is), the module would be in sys.modules, where `python -m` never has
    # the module it runs (and runpy warns in the role's console): its imports stay loaded.
    sys.modules.pop(module, None)
    namespace = sys.modules["__main__"].__dict__
    builtins = namespace["__builtins__"]
    namespace.clear()
    namespace.update(__name__="__main__", __builtins__=builtins)
    run_as_main(module, True)


def show_as(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Make /proc/<pid>/cmdline (so `ps`) read `argv`, and /proc/<pid>/environ `env`, each
    NUL-separated as the kernel gave them at exec: written over this process's own argument and
    environment strings, as setproctitle does, cut to their room. Only /proc reads that memory:
    the interpreter copied its argv at start, and libc's `environ` points elsewhere once
    `os.environ` was replaced."""
    try:
        fields = stat_fields("self")
        # fields 48-51 of proc(5): arg_start, arg_end, env_start, env_end
        areas = [(int(fields[45]), int(fields[46]), argv)]
        if env is not None:
            areas.append((int(fields[47]), int(fields[48]), [f"{k}={v}" for k, v in env.items()]))
    except (OSError, IndexError, ValueError):
        return
    for start, end, words in areas:
        room = end - start
        if room > 1:
            text = b"\0".join(w.encode(errors="replace") for w in words)[:room - 1]
            ctypes.memmove(start, text.ljust(room, b"\0"), room)


def _preload(also: list[str]) -> str | None:
    """Import what the roles import; why forking is not safe here, or None."""
    import torch
    if torch.version.cuda or getattr(torch.version, "hip", None):
        return f"torch {torch.__version__} is a GPU build: roles start fresh (a CUDA context cannot cross a fork)"
    import importlib
    for name in (*PRELOAD, *also):
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        return f"the imports started {threads - 1} thread(s), which a fork would not carry"
    return None


def main(fd: int, console: str, also_preload: list[str]) -> None:
    from tandem.services.protocol import exit_process
    show_as([sys.executable, "-m", __spec__.name, str(fd), console, *also_preload])   # without the room
    conn = Connection(fd)
    try:
        why = _preload(also_preload)
    except Exception as e:   # noqa: BLE001 - said to the launcher, which starts roles fresh
        why = f"preloading failed: {e!r}"
    conn.send(("unavailable", why) if why else ("ready",))
    if why:
        exit_process(0)
    work = serve(conn)
    if work is None:   # the launcher hung up; the server has no exit work of its own but a flush
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)    # (not a collection of everything the preloaded libraries hold: ~0.5 s)
    become(*work)   # a role that returns instead of exiting ends with 0, as under `python -m`
    exit_process(0)   # (a local name: in a fork, become() cleared this module's globals)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[4:])
