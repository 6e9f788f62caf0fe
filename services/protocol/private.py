"""Paths only the run's own user can reach, on filesystems other users share.

Clusters are shared: other users have accounts on the same nodes, the same scratch filesystem
and the same `/dev/shm`. A directory that another user made, or may write into, hands the run to
them: they can replace `config.yaml` between the launcher's write and a role's read, plant a
symlink where the launcher writes, put weights where a server loads them, or hold a lock. So
every directory a run writes into is its user's own and closed to others (`0700`; with
`experiment.group_access: true`, `0750`: the group may read, never write), every file the run
creates is too (the umask every `tandem` process sets: `0077`, or `0027`), and each existing
directory on the way to it is one that no one else can swap out (owned by root or the user, and
where others may write it, sticky: `/tmp`'s rule that only an entry's owner renames it).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK, GROUP_UMASK = 0o077, 0o027


class NotPrivate(PermissionError):
    """A path other users own, may write, or (without group access) may read."""


def set_umask(group_access: bool = False) -> None:
    """Files and directories this process creates are its user's only (the group's to read too)."""
    os.umask(GROUP_UMASK if group_access else PRIVATE_UMASK)


def _who(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_ancestors(path: str | os.PathLike) -> None:
    """Every existing directory above `path` is one no other user can swap out: owned by root or
    this user, and sticky where others may write it. Raise NotPrivate naming the first that is not."""
    me = os.geteuid()
    for parent in Path(os.path.abspath(path)).parents:
        try:
            st = os.stat(parent)   # a symlinked ancestor is judged by where it leads
        except FileNotFoundError:
            continue
        if st.st_uid not in (0, me):
            raise NotPrivate(f"{parent} belongs to {_who(st.st_uid)}, who could replace what is under it")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise NotPrivate(f"{parent} may be written by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                             f"and is not sticky (mode {stat.S_IMODE(st.st_mode):04o}): they could rename "
                             "what is under it")


def check_private_dir(path: str | os.PathLike, group_access: bool = False) -> None:
    """`path` is a real directory (not a symlink), this user's, closed to others (and, without
    group access, to the group). Raise NotPrivate naming what is wrong and the fix."""
    path = Path(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise NotPrivate(f"{path} is a symbolic link; give the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise NotPrivate(f"{path} belongs to {_who(st.st_uid)}, not to you ({_who(os.geteuid())}): "
                         "whoever owns it can change what the run reads; use a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    closed = 0o077 if not group_access else 0o027
    if mode & closed:
        want = 0o700 if not group_access else 0o750
        raise NotPrivate(f"{path} is open to {'other users' if mode & 0o007 else 'its group'} (mode {mode:04o}): "
                         f"chmod {want:o} {path}" + ("" if group_access else
                                                      ", or set experiment.group_access: true to share it "
                                                      "read-only with your group"))


def make_private_dir(path: str | os.PathLike, group_access: bool = False) -> Path:
    """Create `path` (and missing parents) as this user's own, or check the one that exists."""
    path = Path(path)
    check_ancestors(path)
    missing = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o750 if group_access else 0o700)
        except FileExistsError:   # made meanwhile (by us or by someone else): judged below
            pass
    check_private_dir(path, group_access)
    return path


def open_private(path: str | os.PathLike, flags: int, mode: int = 0o600) -> int:
    """os.open that never follows a symlink at the last component and refuses a file another
    user owns (a lock or record planted before the run's directory was closed)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise NotPrivate(f"{path} belongs to {_who(st.st_uid)}, not to you")
    return fd
