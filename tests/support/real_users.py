"""Commands run as real, ordinary local users: a cluster's other users, a victim who is not root,
a grader with no cgroup to write.

Root starts each command in a mount namespace of its own, where it makes what the user needs
reachable, then drops to the user with setpriv: real, effective and saved uid and gid all the
user's, only the supplementary groups given, no capabilities, no new privileges. Nothing of the
host changes:
- each folder on the way to what the command needs that others may not enter (`/root` of a
  pyenv install, 0700) is covered by an empty tmpfs, and what is needed below it bound back, in
  this namespace only;
- with `cgroup=False` a tmpfs covers /sys/fs/cgroup, so the user has no cgroup it could write (as
  a cluster user without delegation; `unshare --map-user` alone keeps real uid 0, which can still
  write the host's cgroup files and is never held to the kernel's per-user process limit).
Needs root, unshare(1) and setpriv(1) (util-linux); `why_not()` says what is missing.
"""
from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

VICTIM, OTHER = 23001, 23002   # no passwd entries needed: files and processes carry numbers
SUPPORT = str(Path(__file__).resolve().parent)
CHECKOUT = str(Path(__file__).resolve().parents[2])


def why_not() -> str | None:
    """Why commands cannot run as other users here (None: they can)."""
    if os.geteuid() != 0:
        return "the tests do not run as root (needed to start processes as other users)"
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"no {tool}(1)"
    r = subprocess.run([*user_prefix(OTHER), sys.executable, "-c", "import tandem"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"no ordinary user here: {r.stderr[-300:]}"


def _closed_ancestors(path: str) -> list[str]:
    """The folders leading to `path` that others may not enter (e.g. /root, 0700)."""
    out = []
    for p in reversed(Path(path).parents):
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                out.append(str(p))
        except OSError:
            break
    return out


def user_prefix(uid: int, gid: int | None = None, groups: tuple[int, ...] = (), umask: int | None = None,
                cgroup: bool = True, readable: tuple[str, ...] = ()) -> list[str]:
    """The command prefix that runs a command as user `uid` (group `gid`, default the same
    number; supplementary `groups`), with the interpreter, the checkout and `readable` reachable."""
    needed = [sys.base_prefix, sys.prefix, os.path.realpath(sys.executable), CHECKOUT, SUPPORT, *readable]
    script = ["set -e"]
    if not cgroup:
        script.append("mount -t tmpfs -o size=1m,mode=755 tandem-no-cgroup /sys/fs/cgroup")
    keep = Path(tempfile.gettempdir()) / ".tandem-user-keep"   # where each hidden folder stays reachable
    keep.mkdir(mode=0o700, exist_ok=True)
    for n, closed in enumerate(sorted({c for p in needed for c in _closed_ancestors(p)}, key=len)):
        inside = [p for p in needed if Path(p).is_relative_to(closed) and p != closed]
        script += [f"mkdir -p {keep}/{n}", f"mount --bind {shlex.quote(closed)} {keep}/{n}",
                   f"mount -t tmpfs -o size=1m,mode=755 tandem-hidden {shlex.quote(closed)}"]
        for p in inside:
            top = Path(closed) / Path(p).relative_to(closed).parts[0]
            kind = "touch" if os.path.isfile(top) else "mkdir -p"
            script += [f"[ -e {shlex.quote(str(top))} ] || {kind} {shlex.quote(str(top))}",
                       f"mountpoint -q {shlex.quote(str(top))} || mount --bind {keep}/{n}/{shlex.quote(top.name)} "
                       f"{shlex.quote(str(top))}"]
    if umask is not None:
        script.append(f"umask {umask:03o}")
    who = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    script.append(f'exec setpriv --reuid={uid} --regid={uid if gid is None else gid} {who} --inh-caps=-all '
                  f'--no-new-privs "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script), "as-user"]


def as_user(argv: list[str], uid: int, **options) -> list[str]:
    """`argv` as user `uid` (user_prefix's `options`)."""
    return [*user_prefix(uid, **options), *map(str, argv)]


def user_home(root: Path, uid: int) -> Path:
    """A home directory of the user's own under `root` (caches, configs)."""
    home = root / f"home-{uid}"
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, uid, uid)
    return home


def run_as(argv: list[str], uid: int, home: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run `argv` as `uid` (user_prefix's options in `kw`, the rest to subprocess.run) and capture it."""
    opts = {k: kw.pop(k) for k in ("gid", "groups", "umask", "cgroup", "readable") if k in kw}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           **kw.pop("env", {})}
    return subprocess.run(as_user(argv, uid, **opts), env=env, capture_output=True, text=True, timeout=timeout, **kw)
