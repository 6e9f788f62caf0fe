"""A role's log set-up (services/protocol/runtime.py: setup_role_logging): each line to its file
and stderr, tagged with the role, and no progress bars, since a role's console is a file
(transformers drew a "Writing model shards" bar there at every publish)."""
from __future__ import annotations

import logging
import os

from transformers.utils import logging as hf_logging

from tandem.services.protocol import ExpDir, setup_role_logging


def test_a_roles_console_gets_its_lines_and_no_progress_bars(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)   # put back afterwards
    hf_logging.enable_progress_bar()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        path = setup_role_logging(ExpDir(tmp_path / "exp"), "trainer", 1)
        for _ in hf_logging.tqdm(range(3), desc="Writing model shards"):
            pass
        logging.getLogger("trainer.loop").info("step 1 published")
        err = capsys.readouterr().err
        assert "Writing model shards" not in err
        assert "trainer-1 INFO trainer.loop: step 1 published" in err
        assert "trainer-1 INFO trainer.loop: step 1 published" in path.read_text()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"   # for what the role imports later
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            if h not in handlers:
                h.close()
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        hf_logging.enable_progress_bar()
