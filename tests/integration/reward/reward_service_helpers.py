"""Helpers of the reward tests: a real reward service process and a scan for sandbox leftovers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.launcher.config import load_config, save_resolved
from tandem.services.protocol import ExpDir, SyncRequestClient, generate_keys, load_keys, read_service

SECRET = "tandem-test-secret-6f1c"
SANDBOX_UID_BASE = 200000


class RunningService:
    def __init__(self, exp: ExpDir, proc: subprocess.Popen):
        self.exp, self.proc = exp, proc
        self.keys = load_keys(exp.keys)
        self.address = read_service(exp, "reward", timeout_s=60)["address"]

    def client(self, timeout_s: float = 60.0) -> SyncRequestClient:
        return SyncRequestClient(self.keys, self.address, timeout_s)

    def status(self) -> dict:
        from tandem.services.protocol import StatusRequest
        c = self.client(10)
        try:
            return c.request(StatusRequest()).state
        finally:
            c.close()


def start_service(root: Path, overrides: list[str], prefix: list[str] = (),
                  env: dict[str, str] | None = None, owner: int | None = None) -> RunningService:
    """`tandem reward serve` on a new experiment directory; `prefix` runs it under another
    command (grader_users.user_prefix: a grader that is not root), as `owner` of the directory
    (a user id) where given; `env` adds variables."""
    exp = ExpDir(root)
    exp.root.mkdir(parents=True, exist_ok=True)
    generate_keys(exp.keys)
    cfg = load_config(None, ["experiment.name=reward-test", "experiment.model=none",
                             f"experiment.exp_dir={root}", *overrides])
    save_resolved(cfg, root)
    if owner is not None:
        for p in [root, *root.rglob("*")]:
            os.chown(p, owner, owner)
    env = {**os.environ, "TANDEM_TEST_SECRET": SECRET, **(env or {})}
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.Popen([*prefix, str(tandem), "reward", "serve", "--exp", str(root)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not exp.service_file("reward").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log = exp.log_file("reward")
            raise RuntimeError(f"reward service did not start: {log.read_text() if log.exists() else ''}")
        time.sleep(0.05)
    return RunningService(exp, proc)


def stop_service(svc: RunningService) -> None:
    svc.proc.send_signal(signal.SIGTERM)
    try:
        svc.proc.wait(20)
    except subprocess.TimeoutExpired:
        svc.proc.kill()
        svc.proc.wait()


def sandbox_processes() -> list[str]:
    """Processes a sandbox of this test could leave behind: its harness or anything run as a
    sandbox user, under this test's process (its reward service's sandboxes) or orphaned (a
    sandbox tree whose every ancestor up to init is a sandbox process: a leak). The sandboxes of
    a run on another pytest worker (e2e code runs) live under that worker: not this test's."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            uid = int(Path(f"/proc/{name}/status").read_text().split("Uid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        harness = "no harness" in cmd   # the sandbox's boot code (reward/sandbox.py _BOOT)
        if harness or os.path.basename(cmd.split(" ")[0]) == "bwrap" or "tandem-sbx" in cmd \
                or SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + 10000:
            found[int(name)] = f"{name} uid={uid} {cmd[:120]}"
    return [desc for pid, desc in found.items() if _ours_or_orphaned(pid, set(found))]


def _ours_or_orphaned(pid: int, sandboxed: set[int]) -> bool:
    only_sandboxes = True
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False   # gone meanwhile
        if pid == os.getpid():
            return True
        if pid > 1 and pid not in sandboxed:
            only_sandboxes = False
    return only_sandboxes


def wait_no_sandbox_processes(timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def slow_item(k: int):
    """An item that holds a grader worker for its whole limit: a program that sleeps through its
    test's time limit (`reward.code_test_timeout_s`, 1 s here), then a verdict ("timeout"), not an
    error. `k` makes items distinct (identical ones are graded once). No math answer does any more:
    the answer contract refuses what would be slow (issue 61; `(x+y+z+1)^{40}` served here before)."""
    from tandem.services.protocol import GradeItem
    return GradeItem(task="code", response="```python\nimport time\ntime.sleep(60)\n```",
                     tests={"inputs": [str(k)], "outputs": ["never"]})


REWARD_OVERRIDES = ["reward.num_workers=2", "reward.math_timeout_s=2.0", "reward.code_test_timeout_s=1.0",
                    "reward.code_total_timeout_s=4.0", "reward.code_memory_mb=256"]


def scan_own_memory(pattern: str) -> str:
    """Program text that makes itself dumpable again and searches every readable mapping of its
    own memory (inherited from the harness by fork) for `pattern` (a bytes regex); it leaves the
    first match, decoded, or "none" in `found`."""
    return rf"""
import ctypes, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
found = "none"
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if "r" not in perms or end - start > 1 << 26:
            continue
        try:
            mem.seek(start)
            m = re.search(rb"{pattern}", mem.read(end - start))
        except (OSError, ValueError, OverflowError):
            continue
        if m:
            found = m.group(0).decode()
            break
"""
