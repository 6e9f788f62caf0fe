"""Removing a directory a program built, whatever it built: no recursion, no path length limit.

`shutil.rmtree` recurses once per level (a 1,200-deep tree raises RecursionError, which
`ignore_errors` does not catch, and the tree stays on the host) and fails on a directory the
program made unreadable or unsearchable. This walks the tree with an explicit stack of open
directory descriptors, relative to each other (so no path grows past PATH_MAX), gives each
directory back its owner's permissions before listing it, and never follows a symbolic link.
Used for the rlimits-only sandbox's host work directory; under bubblewrap the work directory is
a tmpfs that vanishes with the sandbox.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _open_dir(name: str, parent: int | None) -> int:
    if parent is not None:
        try:
            os.chmod(name, 0o700, dir_fd=parent, follow_symlinks=False)
        except (OSError, NotImplementedError):
            pass
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


def remove_tree(path: str) -> bool:
    """Remove `path` and everything under it; True when it is gone. Never raises."""
    try:
        os.chmod(path, 0o700)
        stack = [(os.open(path, _DIR_FLAGS), None)]   # (dir fd, name of the next level below)
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e)
        return False
    try:
        while stack:
            fd, _ = stack[-1]
            descended = False
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                        if not is_dir:
                            os.unlink(entry.name, dir_fd=fd)
                            continue
                        stack[-1] = (fd, entry.name)
                        stack.append((_open_dir(entry.name, fd), None))
                        descended = True
                        break
                    except FileNotFoundError:
                        continue
            if descended:
                continue
            os.close(fd)
            stack.pop()
            if stack:
                parent, name = stack[-1]
                os.rmdir(name, dir_fd=parent)
                stack[-1] = (parent, None)
        os.rmdir(path)
        return True
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e)
        for fd, _ in stack:
            os.close(fd)
        return False
