"""Running untrusted programs: bubblewrap when it works, rlimits and process groups otherwise.

One sandbox process per task runs `reward/harness.py` with the real interpreter (`-I -S`: no
site-packages, no user paths, ~8 ms instead of ~33 ms to start). Under bubblewrap the program
sees a fresh root holding only the interpreter, the libraries it loads and the allowed packages
(`sandbox_root.py`), a size-capped tmpfs `/tmp` holding its working directory (nothing reaches
the host's disk, and the directory vanishes with the sandbox's mount namespace whatever the
program built in it) and another at `/dev/shm`, its own PID, network, IPC and UTS namespaces (no
network at all), a seccomp filter that closes the ways to memory no limit counts (namespaces,
kernel queues and buffers: `sandbox_seccomp.py`), one cgroup for the memory (on cgroup v2 also
the process count) of the whole sandbox where one can be made (`sandbox_cgroup.py`), and an
unprivileged user id when the grader is root (so the process limit applies).

The grader and the harness talk on two pipes passed as extra descriptors (task frames in, the
report out); the sandbox's standard input and output are /dev/null, so bubblewrap's pid 1 —
which keeps only descriptors 0-2 and which a non-root grader's program could open through
/proc/1/fd — holds no channel (see harness.py). The task carries an absolute deadline: the
harness stops the program by it, and the grader kills the whole sandbox `REPORT_GRACE_S` after
it, so neither a closed pipe nor a stopped process can stretch a task past its limit.

Without bubblewrap only the rlimits, the stripped environment, a host temp dir and the
process-group cleanup remain: the program can then read the host's files and reach the network,
so such a sandbox grades nothing unless `reward.allow_unisolated` says so, and every verdict
says `isolation: "rlimits-only"`.
"""
from __future__ import annotations

import json
import logging
import marshal
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.reward import sandbox_cgroup
from tandem.reward.config import RewardConfig
from tandem.reward.harness_judge import _as_text
from tandem.reward.sandbox_cleanup import remove_tree
from tandem.reward.sandbox_root import PACKAGES_INSIDE, bwrap_root_args
from tandem.reward.sandbox_seccomp import filter_fd

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# One program from four files: the judge's rules, the program's processes, call mode, then the
# harness (its main last).
HARNESS = "\n".join((_HERE / name).read_text()
                     for name in ("harness_judge.py", "harness_procs.py", "harness_call.py", "harness.py"))
# The harness goes in compiled (compiling its source costs ~2.7 ms of every start), as the first
# frame on the task channel (the sandbox shows nothing of this checkout, and nothing of it is on
# a command line); the same interpreter runs it. `dont_inherit`: this module's `from __future__
# import annotations` would otherwise pass to the harness and from it to every program it
# compiles (`List[int]` unimported would then load).
_HARNESS_FRAME = marshal.dumps(compile(HARNESS, "reward/harness.py", "exec", dont_inherit=True))
# Reads the harness from the task channel (argv[1]) and runs it; argv[2] is the report channel.
_BOOT = ("import marshal, os, sys\n"
         "def read(n, fd=int(sys.argv[1])):\n"
         "    b = b''\n"
         "    while len(b) < n:\n"
         "        c = os.read(fd, n - len(b))\n"
         "        if not c:\n"
         "            raise EOFError('no harness')\n"
         "        b += c\n"
         "    return b\n"
         "exec(marshal.loads(read(int.from_bytes(read(4), 'big'))), {'__name__': '__main__'})")
INTERPRETER = os.path.realpath(sys.executable)
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
             "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
INSIDE_WORKDIR = "/tmp/work"
# MiB of the sandbox's /dev/shm (multiprocessing's semaphores take a page each).
SHM_MB = 16
# Why code is not graded without isolation unless reward.allow_unisolated says so.
UNISOLATED = ("refused: no filesystem or network isolation for generated code (bubblewrap is not usable "
              "here); a program could read its tests from the host. Install bubblewrap (`make "
              "sandbox-deps`) or set reward.allow_unisolated: true to grade anyway")
# Seconds past the task's deadline the grader waits for the report before killing the sandbox
# (the harness itself stops the program harness.REPORT_RESERVE_S before the deadline).
REPORT_GRACE_S = 0.08
# Seconds the probe and bubblewrap's own set-up may take before the sandbox counts as broken.
SETUP_TIMEOUT_S = 30.0
BWRAP_FLAGS = ["--dev", "/dev", "--proc", "/proc",
               "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


@dataclass
class SandboxResult:
    """The harness's per-test results, or why there are none (`error`)."""
    tests: list[dict]
    isolation: str
    error: str | None = None
    seconds: float = 0.0
    # What bounds memory and processes: "cgroup-v2", "cgroup-v1" (the whole sandbox) or
    # "rlimits" (each process alone).
    limits: str = "rlimits"


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


def _exchange(task_w: int, blob: bytes, report_r: int, err_r: int, deadline: float) -> tuple[bytes, bytes, bool]:
    """Write the task frames while reading the report and the harness's stderr, until the
    report channel closes or `deadline`: (report, stderr, finished in time)."""
    os.set_blocking(task_w, False)
    view, bufs = memoryview(blob), {report_r: bytearray(), err_r: bytearray()}
    reading, writing = [report_r, err_r], [task_w]
    while report_r in reading:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, writable, _ = select.select(reading, writing, [], left)
        if writable:
            try:
                view = view[os.write(task_w, view[:1 << 16]):]
            except BlockingIOError:
                pass
            except BrokenPipeError:
                view = view[:0]
            if not view:
                writing = []
        for fd in readable:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                bufs[fd] += chunk
                if fd == err_r and len(bufs[fd]) > 1 << 16:
                    del bufs[fd][:-4096]
            else:
                reading.remove(fd)
    return bytes(bufs[report_r]), bytes(bufs[err_r]), report_r not in reading


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
        self.limits = "rlimits"
        if self.isolation == "bwrap" and self.cfg.sandbox_cgroup and sandbox_cgroup.available():
            self.limits = f"cgroup-{sandbox_cgroup.layout()[0]}"
            sandbox_cgroup.remove_stale()

    def _cgroup(self) -> sandbox_cgroup.SandboxCgroup | None:
        """This task's cgroup, or None (per-process limits and the harness's watch) when it
        cannot be made now: said in the log, and in the result's `limits`."""
        if self.limits == "rlimits":
            return None
        try:
            # + bubblewrap's init and the harness
            return sandbox_cgroup.SandboxCgroup.create(self.cfg.code_memory_mb << 20, self.cfg.code_max_processes + 2)
        except OSError as e:
            log.warning("no cgroup for this sandbox (%s): per-process limits and the harness's watch", e)
            return None

    def _bwrap_command(self, extra: list[str], stdin_bytes: int = 0) -> list[str]:
        disk = (self.cfg.code_max_disk_mb << 20) + stdin_bytes   # + room for a test's stdin file
        args = ["bwrap", *BWRAP_FLAGS, *bwrap_root_args(tuple(self.cfg.sandbox_packages)),
                "--perms", "1777", "--size", str(disk), "--tmpfs", "/tmp",
                "--perms", "1777", "--dir", INSIDE_WORKDIR, "--chdir", INSIDE_WORKDIR,
                # POSIX semaphores and shared memory (multiprocessing's locks, queues, Pool)
                # live in /dev/shm: a tmpfs of its own, size-capped too.
                "--perms", "1777", "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
                # The fresh root and /dev are tmpfs too, with no size of their own: read-only,
                # so the size-capped /tmp and /dev/shm are the only places a program can write
                # files (a non-root grader's program owns them, and could fill memory there).
                "--remount-ro", "/dev", "--remount-ro", "/", *extra]
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
        seccomp = filter_fd()
        extra = ["--seccomp", str(seccomp)] if seccomp is not None else []
        try:
            r = subprocess.run([*self._bwrap_command(extra), INTERPRETER, "-I", "-S", "-c", "pass"],
                               capture_output=True, timeout=SETUP_TIMEOUT_S, env=CLEAN_ENV,
                               pass_fds=[seccomp] if seccomp is not None else [])
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{type(e).__name__}: {e}"
        finally:
            if seccomp is not None:
                os.close(seccomp)
        if r.returncode != 0:
            return f"bwrap exited {r.returncode}: {r.stderr.decode(errors='replace')[-300:].strip()}"
        return None

    def run(self, program: str, inputs: list, outputs: list, fn_name: str | None = None,
            convention: str = "tandem", shown_chars: int = 0) -> SandboxResult:
        """Run `program` on every test, judged by `convention` (the tests' benchmark: its implicit
        imports and comparison rules, `docs/reward.md`); never raises for anything the program does.
        A failed test's record keeps `shown_chars` characters of what it printed (0: the default 200)."""
        cfg = self.cfg
        t0 = time.monotonic()
        deadline = t0 + cfg.code_total_timeout_s
        bwrap = self.isolation == "bwrap"
        cgroup = self._cgroup() if bwrap else None
        limits = f"cgroup-{cgroup.kind}" if cgroup else "rlimits"
        frames = [marshal.dumps(x) for x in inputs] if fn_name else \
            [_as_text(x).encode() for x in inputs]
        task = {"program": program, "n": len(inputs), "fn_name": fn_name, "convention": convention,
                "shown_chars": shown_chars,
                "test_timeout": cfg.code_test_timeout_s, "total_timeout": cfg.code_total_timeout_s,
                "deadline": deadline, "max_output": cfg.code_max_output_bytes, "uid": self.uid,
                # Without a cgroup the harness itself watches the sandbox as a whole.
                "watch": {"memory_bytes": cfg.code_memory_mb << 20, "processes": cfg.code_max_processes}
                if bwrap and cgroup is None else None,
                "packages": PACKAGES_INSIDE if bwrap and cfg.sandbox_packages else None,
                "limits": {"as_bytes": cfg.code_memory_mb << 20, "fsize_bytes": cfg.code_max_file_mb << 20,
                           "stdin_bytes": 0 if fn_name else max(map(len, frames), default=0),
                           "nproc": self._nproc_limit()}}
        workdir = None if bwrap else tempfile.mkdtemp(prefix="tandem-sbx-")  # 0700, ours
        if workdir and self.uid is not None:
            os.chown(workdir, self.uid, self.uid)  # the program's user owns its working dir
        task["workdir"] = INSIDE_WORKDIR if bwrap else workdir
        blob = b"".join(_frame(f) for f in (_HARNESS_FRAME, marshal.dumps(task), *frames, marshal.dumps(outputs)))
        task_r, task_w = os.pipe()
        report_r, report_w = os.pipe()
        passed, ours = [task_r, report_w], [task_w, report_r]   # fds the sandbox gets / we keep
        proc = None
        try:
            cmd = [INTERPRETER, "-I", "-S", "-c", _BOOT, str(task_r), str(report_w)]
            if bwrap:
                extra = []
                seccomp = filter_fd()
                if seccomp is not None:
                    passed.append(seccomp)
                    extra += ["--seccomp", str(seccomp)]
                if cgroup is not None:
                    info_r, info_w = os.pipe()
                    block_r, block_w = os.pipe()
                    passed += [info_w, block_r]
                    ours += [info_r, block_w]
                    extra += ["--info-fd", str(info_w), "--block-fd", str(block_r)]
                cmd = [*self._bwrap_command(extra, task["limits"]["stdin_bytes"]), *cmd]
            # bwrap stays in our process group, so whoever kills our group (the pool killing a
            # hung worker) kills it too, and its PID namespace with it. Without bwrap the harness
            # gets its own session, the handle to kill everything it started. (No preexec_fn: it
            # would cost ~10 ms per start by forcing fork() of this big process, not vfork().)
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, env=CLEAN_ENV, cwd=workdir or "/",
                                    pass_fds=passed, start_new_session=not bwrap)
            for fd in passed:
                os.close(fd)
            passed = []
            if cgroup is not None:
                self._enter_cgroup(cgroup, info_r, block_w, deadline + REPORT_GRACE_S)
            report, err, finished = _exchange(task_w, blob, report_r, proc.stderr.fileno(),
                                              deadline + REPORT_GRACE_S)
        except OSError as e:
            return SandboxResult([], self.isolation, f"could not start the sandbox: {e}",
                                 time.monotonic() - t0, limits)
        finally:
            for fd in (*passed, *ours):
                os.close(fd)
            oom = cgroup.oom_killed() if cgroup is not None else False
            self._teardown(proc, cgroup)
            if workdir:
                remove_tree(workdir)
        seconds = time.monotonic() - t0
        if not finished:
            return SandboxResult([], self.isolation, "sandbox did not finish within the total time limit",
                                 seconds, limits)
        try:
            tests = marshal.loads(report)["tests"]  # written by the harness only, never by the program
        except (ValueError, EOFError, TypeError, KeyError):
            why = err.decode(errors="replace")[-500:].strip() or f"exit status {proc.returncode}"
            return SandboxResult([], self.isolation, f"no report from the harness: {why}", seconds, limits)
        if oom:
            for t in tests:
                if t.get("status") == "killed (SIGKILL)":
                    t["status"] = "memory limit (the sandbox's cgroup)"
        return SandboxResult(tests, self.isolation, None, seconds, limits)

    @staticmethod
    def _enter_cgroup(cgroup: sandbox_cgroup.SandboxCgroup, info_r: int, block_w: int, deadline: float) -> None:
        """Move bubblewrap's child (held on its block fd) into the task's cgroup, then free it."""
        info = b""
        while not info.rstrip().endswith(b"}"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([info_r], [], [], left)[0]:
                raise OSError("bubblewrap gave no child pid")
            chunk = os.read(info_r, 4096)
            if not chunk:
                raise OSError(f"bubblewrap gave no child pid: {info[-200:]!r}")
            info += chunk
        cgroup.add(int(json.loads(info)["child-pid"]))
        os.write(block_w, b"1")

    def _nproc_limit(self) -> int:
        """RLIMIT_NPROC counts every process of the user, not only the sandbox's: when the
        program keeps our (non-root) user, allow for the processes the user already runs."""
        if self.uid is not None or os.getuid() == 0:
            return self.cfg.code_max_processes
        return _count_processes(os.getuid()) + self.cfg.code_max_processes

    def _teardown(self, proc: subprocess.Popen | None, cgroup) -> None:
        """Leave nothing running: the sandbox's session (rlimits-only) or bwrap and its PID
        namespace (killing bwrap's init takes every process inside with it), and its cgroup."""
        if proc is not None:
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
            proc.stderr.close()
        if cgroup is not None:
            cgroup.close()
