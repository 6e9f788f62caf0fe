"""`tandem keys init DIR`, which the error for missing keys recommends, exists and is safe to repeat."""
from __future__ import annotations

import stat

import pytest

from tandem.launcher.cli import main
from tandem.services.protocol import ExpDir, load_keys


def test_keys_init_creates_private_keys_once_and_keeps_them(tmp_path, capsys):
    exp = ExpDir(tmp_path / "exp")
    with pytest.raises(FileNotFoundError, match=f"tandem keys init {exp.root}"):
        load_keys(exp.keys)
    assert main(["keys", "init", str(exp.root)]) == 0
    first = load_keys(exp.keys)
    assert stat.S_IMODE(exp.keys.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in exp.keys.iterdir())
    assert main(["keys", "init", str(exp.root)]) == 0
    assert load_keys(exp.keys).secret == first.secret          # kept, not replaced
    assert "kept them" in capsys.readouterr().out
