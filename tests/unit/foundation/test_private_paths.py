"""services/protocol/private.py: the directories a run writes into are its user's own, and no
existing directory on the way to them can be swapped out by someone else. Files only (no
processes): another user's ownership is played with chown, which needs root (skipped otherwise;
tests/integration/launcher/test_shared_cluster.py runs the launcher as two real users)."""
from __future__ import annotations

import os
import stat

import pytest

from tandem.services.protocol.private import (
    NotPrivate,
    check_ancestors,
    check_private_dir,
    make_private_dir,
    open_private,
    set_umask,
)

OTHER = 54321
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@pytest.fixture(autouse=True)
def loose_umask():
    """The umask a user's shell often has: what the helpers must not depend on."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_made_private_whatever_the_umask(tmp_path):
    run = make_private_dir(tmp_path / "runs" / "a")
    assert _mode(run) == 0o700 and _mode(tmp_path / "runs") == 0o700
    shared = make_private_dir(tmp_path / "shared", group_access=True)
    assert _mode(shared) == 0o750
    assert make_private_dir(run) == run   # an existing private one is fine


@pytest.mark.parametrize("mode, group_access, refused", [
    (0o700, False, None), (0o750, True, None),
    (0o755, False, "open to other users"), (0o750, False, "open to its group"),
    (0o770, True, "open to its group"), (0o705, True, "open to other users"),
])
def test_a_directory_open_to_others_is_refused_with_the_fix(tmp_path, mode, group_access, refused):
    d = tmp_path / "exp"
    d.mkdir()
    os.chmod(d, mode)
    if refused is None:
        check_private_dir(d, group_access)
        return
    with pytest.raises(NotPrivate, match=rf"{refused} \(mode 0{mode:o}\): chmod 7[05]0 "):
        check_private_dir(d, group_access)


def test_a_symlink_or_a_file_is_not_the_directory(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(NotPrivate, match="symbolic link"):
        check_private_dir(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotPrivate, match="not a directory"):
        check_private_dir(tmp_path / "file")


def test_ancestors_others_may_write_must_be_sticky(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o777)
    with pytest.raises(NotPrivate, match=r"scratch may be written by others and is not sticky \(mode 0777\)"):
        check_ancestors(scratch / "me" / "exp")
    os.chmod(scratch, 0o1777)   # /tmp's rule: only an entry's owner may rename it
    check_ancestors(scratch / "me" / "exp")
    os.chmod(scratch, 0o775)
    with pytest.raises(NotPrivate, match="written by its group"):
        make_private_dir(scratch / "me")


@needs_root
def test_a_directory_another_user_made_is_refused(tmp_path):
    os.chmod(tmp_path, 0o1777)
    theirs = tmp_path / "exp"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(NotPrivate, match=rf"belongs to uid {OTHER}, not to you"):
        make_private_dir(theirs)
    with pytest.raises(NotPrivate, match=rf"exp belongs to uid {OTHER}, who could replace"):
        check_ancestors(theirs / "run")


@needs_root
def test_open_private_refuses_a_symlink_and_another_users_file(tmp_path):
    target = tmp_path / "victims-file"
    target.write_text("precious")
    (tmp_path / "launcher.lock").symlink_to(target)
    with pytest.raises(OSError):   # ELOOP: never followed, never truncated
        open_private(tmp_path / "launcher.lock", os.O_RDWR | os.O_CREAT)
    assert target.read_text() == "precious"
    planted = tmp_path / "planted"
    planted.write_text("")
    os.chown(planted, OTHER, OTHER)
    with pytest.raises(NotPrivate, match=f"uid {OTHER}"):
        open_private(planted, os.O_RDWR)
    fd = open_private(tmp_path / "mine", os.O_RDWR | os.O_CREAT)
    os.close(fd)
    assert _mode(tmp_path / "mine") == 0o600 & ~0o022


def test_set_umask_makes_new_files_private(tmp_path):
    old = os.umask(0o022)
    try:
        set_umask()
        (tmp_path / "a").write_text("")
        set_umask(group_access=True)
        (tmp_path / "b").write_text("")
    finally:
        os.umask(old)
    assert (_mode(tmp_path / "a"), _mode(tmp_path / "b")) == (0o600, 0o640)
