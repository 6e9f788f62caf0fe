"""The experiment directory in one process: service discovery files and private key files. The
concurrent-writer cases (real processes) are in tests/integration/foundation/test_expdir_concurrency.py.
"""
from __future__ import annotations

import os
import stat

from tandem.services.protocol import ExpDir, numbered_dirs, publish_service, read_service


def test_publish_and_read_service(tmp_path):
    exp = ExpDir(tmp_path)
    publish_service(exp, "controller", {"address": "tcp://127.0.0.1:5555"})
    info = read_service(exp, "controller")
    assert info["address"] == "tcp://127.0.0.1:5555" and info["pid"] == os.getpid()


def test_keys_are_private(exp):
    for p in exp.keys.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE(exp.keys.stat().st_mode) == 0o700


def test_numbered_dirs_are_the_versions_of_directories_named_with_the_prefix(tmp_path):
    for name in ("v2", "v10", "v1", "step-3", "v7.tmp", ".v4.export-tmp", "vx", "v\u00b2"):
        (tmp_path / name).mkdir()
    (tmp_path / "v5").write_text("a file, not a version")
    assert numbered_dirs(tmp_path, "v") == [1, 2, 10]
    assert numbered_dirs(tmp_path, "step-") == [3]
    assert numbered_dirs(tmp_path / "absent", "v") == []
