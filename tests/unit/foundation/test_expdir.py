"""The experiment directory in one process: service discovery files and private key files. The
concurrent-writer cases (real processes) are in tests/integration/foundation/test_expdir_concurrency.py.
"""
from __future__ import annotations

import os
import stat

from services.protocol import ExpDir, publish_service, read_service


def test_publish_and_read_service(tmp_path):
    exp = ExpDir(tmp_path)
    publish_service(exp, "controller", {"address": "tcp://127.0.0.1:5555"})
    info = read_service(exp, "controller")
    assert info["address"] == "tcp://127.0.0.1:5555" and info["pid"] == os.getpid()


def test_keys_are_private(exp):
    for p in exp.keys.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE(exp.keys.stat().st_mode) == 0o700
