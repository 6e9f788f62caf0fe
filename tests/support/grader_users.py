"""The code sandbox as each kind of grader runs it: as root, and as an ordinary user.

Clusters run the reward service as an ordinary user with no cgroup of its own to write (no
delegated subtree); then bubblewrap builds the sandbox in a user namespace, the program runs as
the grader's own user, and only per-process limits and the harness's watch bound the sandbox as
a whole. The red-team tests run every attack both ways: `root` in the test's own process (when
the tests run as root), `user` in a child process that is really that ordinary user.

`unshare --user --map-user=1000` is not one: its real user id stays 0, so the kernel applies no
process limit to it and it can still write the host's cgroup directories (issue 61: the "user"
pass always had a cgroup and never exercised the watch). So the child is a real unprivileged
user with no cgroup to write (tests/support/real_users.py: a mount namespace hiding
/sys/fs/cgroup, then setpriv): every kernel limit of an ordinary user, whatever the host's layout. The user id is
one per test process, so the kernel's per-user process count is not shared with another pytest
worker. The child runs `python -m grader_users` on a JSON batch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import real_users
from real_users import CHECKOUT, SUPPORT

USERS = ("root", "user")
# One per test process (the kernel counts RLIMIT_NPROC per real user id).
GRADER_UID = 61000 + os.getpid() % 2000


def why_not(user: str) -> str | None:
    """Why the sandbox cannot be run as `user` here (None: it can)."""
    from tandem.reward.config import RewardConfig
    from tandem.reward.sandbox import Sandbox

    if shutil.which("bwrap") is None or Sandbox(RewardConfig()).isolation != "bwrap":
        return "bubblewrap not installed or not permitted here"
    if os.getuid() != 0:
        return "the tests do not run as root" if user == "root" else \
            "an ordinary grader is made from root (a mount namespace, then setpriv)"
    if user == "root":
        return None
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"no {tool}(1) to start an unprivileged grader"
    r = subprocess.run([*user_prefix(), sys.executable, "-c", "import tandem.reward.sandbox"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"no unprivileged grader here: {r.stderr[-300:]}"


def _home() -> str:
    """A home of the grader user's own (0700, theirs), kept for the test process."""
    home = Path(tempfile.gettempdir()) / f"tandem-grader-{GRADER_UID}"
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, GRADER_UID, GRADER_UID)
    return str(home)


def user_prefix(readable: tuple[str, ...] = ()) -> list[str]:
    """The command prefix that runs a command as the ordinary grader described above
    (real_users.py, with no cgroup to write); the interpreter, the checkout, the sandbox's
    gathered libraries and `readable` are reachable."""
    from tandem.reward.sandbox_root import _cache_root, library_stage

    library_stage()                     # gathered by root once, read by the user
    return [*real_users.user_prefix(GRADER_UID, cgroup=False, readable=(str(_cache_root()), *readable)),
            "env", f"HOME={_home()}", f"XDG_CACHE_HOME={_cache_root().parents[1]}"]


def _run_here(cases: list[dict], cfg: dict) -> list[dict]:
    from tandem.reward.code_grader import grade_code
    from tandem.reward.config import RewardConfig
    from tandem.reward.sandbox import Sandbox

    config = RewardConfig(**cfg)
    out = []
    for case in cases:
        if "response" in case:
            v = grade_code(case["response"], case["tests"], config)
            out.append({"reward": v.reward, "correct": v.correct, "details": v.details})
        else:
            sandbox = Sandbox(config)
            r = sandbox.run(case["program"], case["inputs"], case["outputs"], case.get("fn_name"))
            out.append({**dataclasses.asdict(r), "uid": os.getuid()})
    return out


def run_as(user: str, cases: list[dict], cfg: dict | None = None, timeout_s: float = 300) -> list[dict]:
    """Each case run by a grader of `user`: {"program", "inputs", "outputs", "fn_name"?} ->
    SandboxResult as a dict (+ the grader's uid); {"response", "tests"} -> the verdict."""
    cfg = cfg or {}
    if user == "root":
        return _run_here(cases, cfg)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SUPPORT, CHECKOUT])}
    r = subprocess.run([*user_prefix(), sys.executable, "-m", "grader_users"],
                       input=json.dumps([cases, cfg]), capture_output=True, text=True,
                       timeout=timeout_s, env=env, cwd="/")
    if r.returncode != 0:
        raise RuntimeError(f"the unprivileged grader failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


if __name__ == "__main__":
    batch, config = json.loads(sys.stdin.read())
    print(json.dumps(_run_here(batch, config)))
