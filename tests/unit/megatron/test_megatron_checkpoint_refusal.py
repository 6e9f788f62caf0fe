"""A checkpoint written by the other backend is refused by name, before anything is loaded. The
Megatron loop's dist checkpoints and resharding resume (real processes) are in
tests/integration/megatron/test_megatron_loop_checkpoint.py.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def test_checkpoints_of_the_other_backend_are_refused_by_name(tmp_path):
    """A per-rank (torch backend) checkpoint has no dist/: a sharded backend refuses it, naming
    it; a sharded checkpoint read by a job with more ranks than the writer keeps fresh RNG."""
    from tandem.trainer import checkpoint

    checkpoint.save(tmp_path, 1, 0, {"backend": {"w": torch.zeros(1)}}, {"version": 1}, keep=1)
    with pytest.raises(ValueError, match=r"step-1: holds no sharded checkpoint"):
        checkpoint.load(tmp_path / "step-1", 0, sharded=True)
    written = []
    checkpoint.save(tmp_path, 2, 0, {}, {"version": 2}, keep=2, write_sharded=written.append)
    assert written == [tmp_path / ".step-2.tmp" / "dist"]  # inside the temp dir, renamed with it
    (tmp_path / "step-2" / "dist").mkdir()  # stands in for what write_sharded would have written
    assert checkpoint.sharded_dir(tmp_path / "step-2") == tmp_path / "step-2" / "dist"
    rank_state, loop_state = checkpoint.load(tmp_path / "step-2", 3, sharded=True)
    assert rank_state == {} and loop_state == {"version": 2}
