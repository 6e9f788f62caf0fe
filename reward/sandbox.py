"""Running untrusted programs: bubblewrap when it works, rlimits and process groups otherwise.

One sandbox process per task runs `reward/harness.py` with the real interpreter (`-I -S`: no
site-packages, no user paths, ~8 ms instead of ~33 ms to start). Under bubblewrap the program
sees a fresh root holding only the interpreter, the libraries it loads and the allowed packages
(`sandbox_root.py`), a private /tmp whose `work/` is a fresh host temp dir (removed afterwards),
its own PID, network, IPC and UTS namespaces (no network at all), and runs as an unprivileged
user id when the grader is root (so the process limit applies). Without bubblewrap only the
rlimits, the stripped environment, the temp dir and the process-group cleanup remain: the
program can then read the host's files and reach the network, so such a sandbox grades nothing
unless `reward.allow_unisolated` says so, and every verdict says `isolation: "rlimits-only"`.
"""
from __future__ import annotations

import binascii
import logging
import marshal
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from reward.config import RewardConfig
from reward.sandbox_root import PACKAGES_INSIDE, bwrap_root_args

log = logging.getLogger(__name__)

HARNESS = (Path(__file__).parent / "harness.py").read_text()
# The harness goes in compiled (compiling its source costs ~2.7 ms of every start), as base64
# on the command line (the sandbox shows nothing of this checkout); the same interpreter runs it.
# `dont_inherit`: this module's `from __future__ import annotations` would otherwise pass to
# the harness and from it to every program it compiles (`List[int]` unimported would then load).
_HARNESS_CODE = binascii.b2a_base64(marshal.dumps(compile(HARNESS, "reward/harness.py", "exec", dont_inherit=True)),
                                    newline=False).decode()
_BOOT = ("import binascii, marshal, sys; "
         "exec(marshal.loads(binascii.a2b_base64(sys.argv[1])), {'__name__': '__main__'})")
INTERPRETER = os.path.realpath(sys.executable)
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
             "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
INSIDE_WORKDIR = "/tmp/work"
# Why code is not graded without isolation unless reward.allow_unisolated says so.
UNISOLATED = ("refused: no filesystem or network isolation for generated code (bubblewrap is not usable "
              "here); a program could read its tests from the host. Install bubblewrap (`make "
              "sandbox-deps`) or set reward.allow_unisolated: true to grade anyway")
# Seconds the outer runner waits beyond the task's total limit (interpreter start, teardown).
GRACE_S = 5.0
BWRAP_FLAGS = ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
               "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]


@dataclass
class SandboxResult:
    """The harness's per-test results, or why there are none (`error`)."""
    tests: list[dict]
    isolation: str
    error: str | None = None
    seconds: float = 0.0


def _message(obj) -> bytes:
    data = marshal.dumps(obj)
    return len(data).to_bytes(4, "big") + data


def _others_can_run_interpreter() -> bool:
    path = Path(sys.base_prefix)
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in [path, *path.parents])


def _count_processes(uid: int) -> int:
    """Processes (threads count too, as for RLIMIT_NPROC) whose real user is `uid`."""
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
            if int(status.split("Uid:")[1].split()[0]) == uid:
                n += int(status.split("Threads:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return n


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (what the rlimits-only mode leaves behind)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:
                os.kill(int(name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


class Sandbox:
    """Runs one task's tests in one sandboxed process (see module docstring)."""

    _probe: dict[str, str | None] = {}  # mode -> detected isolation, or the reason bwrap failed

    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self.isolation = self._detect()
        root = os.getuid() == 0
        if self.isolation == "bwrap":
            self.uid = self.cfg.sandbox_uid_base + os.getpid() % 10000 if root else None
        else:
            self.uid = (self.cfg.sandbox_uid_base + os.getpid() % 10000
                        if root and _others_can_run_interpreter() else None)

    def _bwrap_command(self, workdir: str) -> list[str]:
        args = ["bwrap", *BWRAP_FLAGS, *bwrap_root_args(tuple(self.cfg.sandbox_packages)),
                "--bind", workdir, INSIDE_WORKDIR, "--chdir", INSIDE_WORKDIR]
        for k, v in CLEAN_ENV.items():
            args += ["--setenv", k, v]
        if os.getuid() == 0:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        return args

    def _detect(self) -> str:
        mode = self.cfg.sandbox
        if mode == "rlimits":
            return "rlimits-only"
        if mode not in Sandbox._probe:
            Sandbox._probe[mode] = self._try_bwrap()
        failure = Sandbox._probe[mode]
        if failure is None:
            return "bwrap"
        if mode == "bwrap":
            raise RuntimeError(f"reward.sandbox is 'bwrap' but bubblewrap does not work here: {failure}")
        log.warning("CODE SANDBOX WITHOUT ISOLATION: bubblewrap unusable (%s); generated programs run "
                    "with rlimits, a process group and a temp dir only — they can read the host "
                    "filesystem and reach the network. Install bubblewrap (`make sandbox-deps`).", failure)
        return "rlimits-only"

    def _try_bwrap(self) -> str | None:
        if shutil.which("bwrap") is None:
            return "bwrap not installed"
        workdir = tempfile.mkdtemp(prefix="tandem-probe-")
        try:
            r = subprocess.run([*self._bwrap_command(workdir), INTERPRETER, "-I", "-S", "-c", "pass"],
                               capture_output=True, timeout=30, env=CLEAN_ENV)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{type(e).__name__}: {e}"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if r.returncode != 0:
            return f"bwrap exited {r.returncode}: {r.stderr.decode(errors='replace')[-300:].strip()}"
        return None

    def run(self, program: str, inputs: list, outputs: list, fn_name: str | None = None,
            convention: str = "tandem") -> SandboxResult:
        """Run `program` on every test, judged by `convention` (the tests' benchmark: its implicit
        imports and comparison rules, `docs/reward.md`); never raises for anything the program does."""
        cfg = self.cfg
        t0 = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="tandem-sbx-")  # 0700, ours
        if self.uid is not None:
            os.chown(workdir, self.uid, self.uid)  # the program's user owns its working dir
        task = {"program": program, "inputs": inputs, "fn_name": fn_name, "convention": convention,
                "test_timeout": cfg.code_test_timeout_s, "total_timeout": cfg.code_total_timeout_s,
                "max_output": cfg.code_max_output_bytes, "uid": self.uid,
                "workdir": INSIDE_WORKDIR if self.isolation == "bwrap" else workdir,
                "packages": PACKAGES_INSIDE if self.isolation == "bwrap" and cfg.sandbox_packages else None,
                "limits": {"as_bytes": cfg.code_memory_mb << 20, "fsize_bytes": cfg.code_max_file_mb << 20,
                           "nproc": self._nproc_limit()}}
        cmd = [INTERPRETER, "-I", "-S", "-c", _BOOT, _HARNESS_CODE]
        if self.isolation == "bwrap":
            cmd = [*self._bwrap_command(workdir), *cmd]
        # bwrap stays in our process group, so whoever kills our group (the pool killing a hung
        # worker) kills it too, and its PID namespace with it. Without bwrap the harness gets
        # its own session, the handle to kill everything it started. (No preexec_fn: it would
        # cost ~10 ms per start by forcing fork() of this big process instead of vfork().)
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=CLEAN_ENV, cwd=workdir,
                                    start_new_session=self.isolation != "bwrap")
        except OSError as e:
            shutil.rmtree(workdir, ignore_errors=True)
            return SandboxResult([], self.isolation, f"could not start the sandbox: {e}")
        try:
            # The expected outputs second: the harness reads them only once the program is gone.
            out, err = proc.communicate(_message(task) + _message(outputs), timeout=cfg.code_total_timeout_s + GRACE_S)
            error = None
        except subprocess.TimeoutExpired:
            out, err, error = b"", b"", "sandbox did not finish within the total time limit"
        finally:
            self._teardown(proc)
            shutil.rmtree(workdir, ignore_errors=True)
        seconds = time.monotonic() - t0
        if error:
            return SandboxResult([], self.isolation, error, seconds)
        try:
            report = marshal.loads(out)  # written by the harness only, never by the program
            return SandboxResult(report["tests"], self.isolation, None, seconds)
        except (ValueError, EOFError, TypeError, KeyError):
            why = err.decode(errors="replace")[-500:].strip() or f"exit status {proc.returncode}"
            return SandboxResult([], self.isolation, f"no report from the harness: {why}", seconds)

    def _nproc_limit(self) -> int:
        """RLIMIT_NPROC counts every process of the user, not only the sandbox's: when the
        program keeps our (non-root) user, allow for the processes the user already runs."""
        if self.uid is not None or os.getuid() == 0:
            return self.cfg.code_max_processes
        return _count_processes(os.getuid()) + self.cfg.code_max_processes

    def _teardown(self, proc: subprocess.Popen) -> None:
        """Leave nothing running: the sandbox's session (rlimits-only) or bwrap and its PID
        namespace (killing bwrap's init takes every process inside with it)."""
        try:
            if self.isolation == "bwrap":
                os.kill(proc.pid, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.isolation != "bwrap":
            _kill_session(proc.pid)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
