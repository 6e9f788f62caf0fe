"""The training-inference mismatch metrics against a real generator: trajectories sampled by the
embedded generation server (`tandem gen serve`, its own log-probs) with the weights the trainer
starts from. The same weights on both sides give ~0; a deliberate shift of the behaviour
log-probs shows up by the amount worked out by hand; tokens of other versions are not counted;
with the proximal pass skipped, the first update's forward measures the same thing."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.launcher.config import load_config
from tandem.services.protocol import ExpDir, Trajectory, generate_keys
from tandem.trainer.batch import StepBatch
from tandem.trainer.buffer import Group
from tandem.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "generation"))
from gen_support import ServerProcess  # noqa: E402  (the generation tests' server helper)

SHIFT = 0.3


@pytest.fixture(scope="module")
def generated(small_model_dir, tmp_path_factory):
    """4 groups x 2 samples of 12 tokens, sampled at T = 1 by the embedded server (version 0)."""
    server = ServerProcess(small_model_dir, tmp_path_factory.mktemp("gen-mismatch"))
    try:
        rng = np.random.default_rng(0)
        groups = []
        for g in range(4):
            prompt = rng.integers(7, 200, 5).tolist()
            samples = []
            for k in range(2):
                out = server.api.generate(prompt, max_new_tokens=12, temperature=1.0, ignore_eos=True,
                                          sampling_seed=10 * g + k)
                lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                samples.append(Trajectory(
                    group_id=f"g{g}", sample_idx=k, group_size=2, prompt_ids=np.asarray(prompt, np.int32),
                    output_ids=np.asarray(out["output_ids"], np.int32),
                    output_logprobs=np.asarray(lps, np.float32),
                    output_versions=np.zeros(len(lps), np.int32), admit_version=0, reward=float(k) * 10 - 5,
                    finish_reason="length", task="math", timings={}))
            groups.append(samples)
        return groups
    finally:
        server.stop()


def step(tmp_path, model_dir, groups, version=0, *overrides):
    exp = ExpDir(tmp_path / "exp")
    exp.root.mkdir(parents=True)
    generate_keys(exp.keys)
    cfg = load_config(None, ["experiment.name=mismatch", f"experiment.model={model_dir}",
                             f"experiment.exp_dir={exp.root}", "trainer.groups_per_step=4",
                             "controller.max_staleness=1", "trainer.optim.lr=0.01", *overrides])
    trainer = Trainer(cfg, exp)
    trainer.version = version
    try:
        return trainer.train_step(StepBatch.from_groups([Group(s[0].group_id, 0, i, s) for i, s in enumerate(groups)]))
    finally:
        trainer.close()


def shifted(groups, every=2, versions=None):
    """A copy whose behaviour log-probs are raised by SHIFT on every `every`-th token."""
    out = []
    for samples in groups:
        copies = []
        for t in samples:
            lp = t.output_logprobs.copy()
            lp[::every] += SHIFT
            v = t.output_versions if versions is None else versions(t)
            copies.append(Trajectory(**{**t.__dict__, "output_logprobs": lp, "output_versions": v}))
        out.append(copies)
    return out


@pytest.mark.parametrize("proximal", ["recompute", "behaviour"])
def test_same_weights_give_no_mismatch_and_a_shift_shows(tmp_path, small_model_dir, generated, proximal):
    opts = (f"trainer.proximal={proximal}",)
    same = step(tmp_path / "same", small_model_dir, generated, 0, *opts)
    n = sum(len(t.output_ids) for s in generated for t in s)
    assert same["mismatch_tokens"] == n == 96
    assert same["mismatch_k3"] < 1e-8
    assert same["mismatch_ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert same["mismatch_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert same["mismatch_source"] == ("proximal" if proximal == "recompute" else "first_update")
    # Raise the generator's log-prob of every other token by 0.3: on those tokens
    # log rho = trainer - generator = -0.3, rho = e^-0.3 = 0.7408, k3 = rho - 1 - log rho = 0.04082;
    # 6 of every 12 tokens: mean k3 = 0.04082 / 2, mean ratio = (1 + 0.7408) / 2.
    off = step(tmp_path / "off", small_model_dir, shifted(generated), 0, *opts)
    rho = math.exp(-SHIFT)
    assert off["mismatch_k3"] == pytest.approx((rho - 1 + SHIFT) / 2, abs=1e-4)
    assert off["mismatch_ratio_mean"] == pytest.approx((1 + rho) / 2, abs=1e-4)
    assert off["mismatch_ratio_max"] == pytest.approx(1.0, abs=1e-3)


def test_only_tokens_of_the_version_trained_count(tmp_path, small_model_dir, generated):
    """Trained at version 1: the shifted log-probs belong to tokens labelled version 0 (an older
    policy's, which may differ for good reasons) and are left out; the rest (version 1) agree.
    The one-version-old tokens are the per-version drift instead: k3 at log rho = -0.3 on each."""
    def versions(t):
        v = np.ones(len(t.output_ids), np.int32)
        v[::2] = 0
        return v
    rec = step(tmp_path, small_model_dir, shifted(generated, versions=versions), 1)
    assert rec["mismatch_tokens"] == 48
    assert rec["mismatch_k3"] < 1e-8 and rec["mismatch_ratio_max"] == pytest.approx(1.0, abs=1e-3)
    rho = math.exp(-SHIFT)
    assert rec["version_kl_tokens"] == 48
    assert rec["version_kl"] == pytest.approx(rho - 1 + SHIFT, abs=1e-4)
    same = step(tmp_path / "v0", small_model_dir, generated, 0)
    assert same["version_kl"] is None and same["version_kl_tokens"] == 0
