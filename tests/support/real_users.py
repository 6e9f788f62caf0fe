"""Commands run as real, ordinary local users: a cluster's other users, and a victim who is not root.

Root starts each command in a mount namespace of its own, where it makes what the user needs
reachable, then drops to the user with setpriv: real, effective and saved uid and gid all the
user's, no supplementary groups but those given, no capabilities. Nothing of the host changes:
- the interpreter lives under /root (pyenv), which only root may enter: /root is covered by an
  empty tmpfs and the pyenv tree bound back into it, in this namespace only;
- with `cgroup=False` a tmpfs covers /sys/fs/cgroup, so the user has no cgroup it could write
  (as a cluster user without delegation; `unshare --map-user` alone keeps real uid 0, which can
  still write the host's cgroup files).
Needs root, unshare(1) and setpriv(1) (util-linux); `why_not()` says what is missing.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

VICTIM, OTHER = 23001, 23002   # no passwd entries needed: files and processes carry numbers

_SETUP = r"""
set -e
if [ -d /root/.pyenv ]; then
  keep=$(mktemp -d /tmp/.tandem-user-pyenv-XXXXXX)
  mount --bind /root/.pyenv "$keep"
  mount -t tmpfs -o mode=0755,size=1m tandem-user-root /root
  mkdir /root/.pyenv
  mount --bind "$keep" /root/.pyenv
  umount "$keep"; rmdir "$keep"
fi
if [ "$TANDEM_USER_CGROUP" = no ]; then mount -t tmpfs -o mode=0755,size=1m tandem-no-cgroup /sys/fs/cgroup; fi
umask "$TANDEM_USER_UMASK"
exec setpriv --reuid "$TANDEM_USER_UID" --regid "$TANDEM_USER_GID" $TANDEM_USER_GROUPS --inh-caps=-all -- "$@"
"""


def why_not() -> str | None:
    """Why commands cannot run as other users here (None: they can)."""
    if os.geteuid() != 0:
        return "the tests do not run as root (needed to start processes as other users)"
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"no {tool}(1)"
    r = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    return None if r.returncode == 0 else f"no mount namespace: {r.stderr.decode()[-200:]}"


def as_user(argv: list[str], uid: int, gid: int | None = None, groups: tuple[int, ...] = (), umask: int = 0o022,
            cgroup: bool = True) -> list[str]:
    """`argv` as user `uid` (group `gid`, default the same number; supplementary `groups`)."""
    env = {"TANDEM_USER_UID": str(uid), "TANDEM_USER_GID": str(uid if gid is None else gid),
           "TANDEM_USER_GROUPS": f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
           "TANDEM_USER_UMASK": f"{umask:03o}", "TANDEM_USER_CGROUP": "yes" if cgroup else "no"}
    return ["env", *(f"{k}={v}" for k, v in env.items()),
            "unshare", "--mount", "--propagation", "private", "sh", "-c", _SETUP, "sh", *map(str, argv)]


def user_home(root: Path, uid: int) -> Path:
    """A home directory of the user's own under `root` (caches, configs)."""
    home = root / f"home-{uid}"
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, uid, uid)
    return home


def run_as(argv: list[str], uid: int, home: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run `argv` as `uid` (as_user's options in `kw`, the rest to subprocess.run) and capture it."""
    opts = {k: kw.pop(k) for k in ("gid", "groups", "umask", "cgroup") if k in kw}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           **kw.pop("env", {})}
    return subprocess.run(as_user(argv, uid, **opts), env=env, capture_output=True, text=True, timeout=timeout, **kw)
