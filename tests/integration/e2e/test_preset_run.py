"""A non-default preset end to end: `tandem run` with `trainer.algorithm: dapo` on the local
backend (every role a real process). Dynamic sampling drops the groups whose rewards are all
equal in the rollout workflow; the controller's ledger counts them and gives their slots back,
so the batches still fill, and each step records how many were dropped. The untrained tiny
model answers everything wrong, so a test workflow (tests/support/mixed_groups_workflow.py)
gives every other group one right answer. It also rarely stops before max_new_tokens, so the
run keeps the truncated samples (`trainer.mask_truncated=false`, a key set explicitly over the
preset's) and trains on them with the soft overlong penalty."""
from __future__ import annotations

import os
from pathlib import Path

from local_run import finish, leftovers, steps, tandem, write_config

from tandem.services.protocol import ExpDir

SUPPORT = Path(__file__).parents[2] / "support"


def test_dapo_run_filters_groups_and_logs_the_mismatch(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "dapo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))}
    out = finish(tandem("run", cfg, "trainer.algorithm=dapo", "trainer.total_steps=2", "trainer.mask_truncated=false",
                        "rollout.workflow=mixed_groups_workflow:alternating", env=env))
    exp = ExpDir(tmp_path / "dapo")
    assert "step 2/2" in out, out[-3000:]
    records = steps(exp)
    assert [r["step"] for r in records] == [1, 2]
    # Step 1 trains version-0 tokens only, so it measures the mismatch; step 2 measures it over
    # the tokens of version 1, which it may have none of (all generated before the update: the
    # timing decides, and a busy machine makes it so).
    assert records[0]["mismatch_tokens"] > 0, records[0]
    for r in records:
        # proximal: behaviour (the pass is skipped): the first update's forward measures the mismatch
        assert r["mismatch_source"] == "first_update"
        if r["mismatch_tokens"]:
            assert 0 <= r["mismatch_k3"] < 1e-3 and abs(r["mismatch_ratio_mean"] - 1) < 1e-2, r
        else:
            assert r["mismatch_k3"] is None and r["version_kl_tokens"] > 0, r
        assert isinstance(r["dynamic_filtered_groups"], int) and r["dynamic_filtered_groups"] >= 0
        assert r["overlong_penalty_mean"] <= 0 and "truncated_samples" in r
        assert r["sample_masked_fraction"] == 0 and r["grad_norm"] > 0
        # every trained group has a right and a wrong answer (the filtered ones never arrive)
        assert r["n_groups"] == 2
    # Odd tickets were filtered. Step 1 may close before the first of them is reported; by the
    # end of step 2's collection (a second wave of generations), earlier ones have been.
    assert sum(r["dynamic_filtered_groups"] for r in records) >= 1
    resolved = (exp.root / "config.yaml").read_text()
    assert "algorithm: dapo" in resolved and "mask_truncated: false" in resolved
    assert "filter_all_equal: true" in resolved and "eps_clip_high: 0.28" in resolved
    assert leftovers(exp) == []
