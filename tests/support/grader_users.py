"""The code sandbox as each kind of grader runs it: as root, and as an ordinary user.

Clusters run the reward service as an ordinary user; then bubblewrap builds the sandbox in a
user namespace and the program runs as the grader's own user, which sees (and may open) what
that user's processes hold. The red-team tests run every attack both ways: `root` in the test's
own process (when the tests run as root), `user` in a child process under `unshare --user
--map-user=1000 --map-group=1000` — not root there, no capabilities, exactly as on a cluster
node (the issue's reproduction), and with no cgroup of its own to write (`reward.sandbox_cgroup:
false`): the user namespace maps the files of the real root's cgroups to it, which a cluster
user's grader never owns, so it limits the sandbox with per-process limits and the harness's
watch, as there. The child runs `python -m grader_users` on a JSON batch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

USERS = ("root", "user")
UNSHARE = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
USER_CONFIG = {"sandbox_cgroup": False}    # see the module docstring


def why_not(user: str) -> str | None:
    """Why the sandbox cannot be run as `user` here (None: it can)."""
    from tandem.reward.config import RewardConfig
    from tandem.reward.sandbox import Sandbox

    if shutil.which("bwrap") is None or Sandbox(RewardConfig()).isolation != "bwrap":
        return "bubblewrap not installed or not permitted here"
    if user == "root":
        return None if os.getuid() == 0 else "the tests do not run as root"
    if shutil.which("unshare") is None:
        return "no unshare(1) to start an unprivileged grader"
    r = subprocess.run([*UNSHARE, "true"], capture_output=True)
    return None if r.returncode == 0 else f"no user namespace for an unprivileged grader: {r.stderr.decode()[-200:]}"


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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.getcwd()])}
    r = subprocess.run([*UNSHARE, sys.executable, "-m", "grader_users"],
                       input=json.dumps([cases, {**cfg, **USER_CONFIG}]),
                       capture_output=True, text=True, timeout=timeout_s, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"the unprivileged grader failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


if __name__ == "__main__":
    batch, config = json.loads(sys.stdin.read())
    print(json.dumps(_run_here(batch, config)))
