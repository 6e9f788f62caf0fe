"""`tandem run` end to end on the local backend: every role a real process, real sockets, real
HTTP, a real (untrained) tiny model. These runs check the mechanics — staleness bound,
interrupts, clean shutdown — not learning, which `make train-math` shows. Crashes, Ctrl-C and
`--resume` are tests/integration/test_faults.py's, in one run."""
from __future__ import annotations

import json

import pytest
import tracker_check
from local_run import finish, leftovers, steps, tandem, write_config

from tandem.services.protocol import ExpDir, read_metrics


@pytest.mark.parametrize("eta", [0, 2])
def test_run_respects_the_staleness_bound(tmp_path, tiny_model_dir, eta, monkeypatch):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, f"eta{eta}")
    # Long enough answers that a weight update lands while some are being generated.
    # eta=2 also draws the held-out curve: 2 problems before, at every version, and after; and
    # writes it, with the steps, to TensorBoard and an offline W&B run (tracker_check). Small
    # and early, so a point is scored before the 4-step run ends: a stopping worker cancels a
    # point still being scored, and one due only at version 2 was cut off three times on a
    # loaded machine.
    # eta=2 also records sample completions every 2 steps (trainer.samples), which reach the
    # report and the trackers.
    curve = ["rollout.eval_size=2", "rollout.eval_every=1", "trainer.samples.every=2"] if eta else []
    # eta=0's roles start as fresh interpreters, eta=2's as forks of the preloading server (the default).
    # The untrained model is wrong on everything, so no group has a reward signal: eta=0 warns
    # after every 2 such steps (trainer.signals.no_signal_steps).
    forks = [] if eta else ["launcher.fork_roles=false", "trainer.signals.no_signal_steps=2"]
    trackers = eta and tracker_check.INSTALLED
    if trackers:
        tracker_check.offline_wandb(monkeypatch, tmp_path)
        curve.append(tracker_check.OVERRIDE)
    out = finish(tandem("run", cfg, f"controller.max_staleness={eta}", "rollout.max_new_tokens=192", *curve, *forks))
    exp = ExpDir(tmp_path / f"eta{eta}")
    assert "step 4/4" in out, out[-3000:]
    summary = json.loads((exp.root / "summary.json").read_text())
    assert summary["steps"] == 4
    trained = steps(exp)
    hist = trained[-1]["staleness_hist_total"]
    assert sum(hist.values()) == 4 * 2  # B groups per step, each trained once
    assert max(int(k) for k in hist) <= eta  # stale_policy: drop (the default) keeps the bound strict
    dropped = trained[-1].get("buffer_dropped_stale", 0)
    released = sum(r.get("released", 0) for r in read_metrics(exp, "controller") if r.get("event") == "groups_dropped")
    assert released == dropped  # every drop gave its admission slot back
    groups = [r for r in read_metrics(exp, "rollout") if r.get("event") == "group"]
    if eta == 0:  # synchronous: every token of every trained group came from the version it trains
        assert set(trained[-1]["token_staleness_hist_total"]) == {"0"}
    else:  # updates land while groups generate: some samples carry tokens of two versions
        assert sum(g["multi_version"] for g in groups) > 0
    # What `tandem simulate --calibrate` needs is logged, and fits positive costs.
    from tandem.launcher.simulate.calibrate import calibrate
    cal = calibrate(exp.root)
    assert cal.d0 + cal.d1 > 0 and cal.t0 + cal.t1 > 0 and cal.prefill_per_request + cal.prefill_per_token > 0
    assert cal.publish_s > 0 and cal.load_s > 0 and cal.checkpoint_s > 0 and cal.train_world == 1
    assert cal.samples["gen windows"] >= 1 and cal.samples["trainer steps"] == 4
    assert all(len(g["output_tokens"]) == 2 and g["prompt_tokens"] > 0 for g in groups)
    # the grading latency the simulator takes as reward_s: within each episode's own time
    assert all(0 < g["grade_s"] < g["seconds"] for g in groups) and 0 < cal.grade_s
    # Each trained group carries its prompt's key (its worker's rank, the prompt's place in that
    # worker's data), by which the trainer trains a prompt once.
    keys = {g["group_id"]: f"{g['rank']}:{g['prompt_index']}" for g in groups}
    trained_keys = [(keys[gid], key) for r in trained for gid, key in zip(r["group_ids"], r["prompt_keys"], strict=True)]
    assert len(trained_keys) == 4 * 2 and all(a == b for a, b in trained_keys), trained_keys
    assert (exp.weights / "v4").is_dir()
    assert (exp.report / "report.png").stat().st_size > 10_000 and (exp.report / "report.html").exists()
    if eta:   # rollout worker 0 scored the held-out problems during the run, as versions passed
        evals = read_metrics(exp, "rollout", "eval")
        assert evals and all(0 < e["step"] <= 4 and e["eval_n"] == 2 for e in evals), evals
        assert all(0 <= e["eval_accuracy"] <= 1 and e["version_min"] <= e["version_max"] for e in evals)
        assert summary["eval"]["before"] is not None and summary["eval"]["after"] is not None
    assert summary["throughput"]["trajectories_per_s"] > 0 and summary["weight_sync"]["mean_s"] > 0
    if not eta:   # warned after steps 2 and 4, on the console between the progress lines and in the summary
        said = [line for line in out.splitlines() if line.startswith(("step ", "warning: "))]
        assert [line.split(":")[0].split(" |")[0] for line in said] == \
            ["step 1/4", "step 2/4", "warning", "step 3/4", "step 4/4", "warning"], said
        assert [(w["kind"], w["step"]) for w in summary["warnings"]] == [("no_reward_signal", 2), ("no_reward_signal", 4)]
        assert all(r["signal_groups"] == 0 for r in trained) and trained[-1]["no_signal_steps"] == 4
    if eta:   # the trained samples, decoded, every 2 steps: in the records and on the report's page
        sampled = [r for r in read_metrics(exp, "trainer") if r.get("event") == "samples"]
        assert [r["step"] for r in sampled] == [2, 4] and all(len(r["samples"]) == 2 for r in sampled)
        assert all(s["prompt"] and s["response_chars"] >= 0 and s["version_min"] <= s["version_max"] <= s["admit_version"] + 2
                   for r in sampled for s in r["samples"])
        assert "<h3>step 4</h3>" in (exp.report / "report.html").read_text()
    if trackers:
        tracker_check.assert_trackers_hold_the_run(exp, out)
    assert ("roles start as forks" in out) == bool(eta) and (exp.logs / "role-forks.console").exists() == bool(eta)
    assert leftovers(exp) == []
