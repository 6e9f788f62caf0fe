"""`make train-math-moe`'s experiment file end to end: `tandem run configs/math-moe-tiny.yaml` (every
role a real process) on a tiny, untrained Qwen3-MoE (`tandem model init-tiny --arch qwen3_moe`:
8 experts, top 2, 4 layers), shortened to two small steps, with the file's routing replay on.

What it shows beyond the unit tier (tests/unit/trainer/test_torch_routing_replay.py, the server's
and the client's tests): the embedded server returns each position's experts with its samples, the
workers carry them in the trajectories, the trainer's buffer takes every one (it refuses a sample
with none, or with experts that do not fit it or the model), and the trainer's routers, replaying
them in every forward (the updates' too), chose the recorded experts at (nearly) every position:
`moe_router_agreement` at least AGREEMENT in both steps (1.0 in every run so far; a token whose
second and third experts' router scores tie within float32 rounding may go either way between the
server's cached decode and the trainer's packed forward, so exactly 1.0 is not asserted). The
experts must line up with the packed tokens for that: a record shifted by one position, another
layer's, or another sample's would disagree at most positions. Synchronous (eta 0), so each step trains tokens its own weights
sampled, float32 on both sides (the server's default `gen.dtype` and the torch backend's).
Learning is `benchmarks/train_math_moe.py`'s. The second test runs the file with an agent whose
episodes are two completions each (routing replay for agent episodes)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_run import finish, leftovers, steps, tandem

from tandem.services.protocol import ExpDir

CONFIG = Path(__file__).parents[3] / "configs" / "math-moe-tiny.yaml"
LAYERS, TOP_K, EXPERTS = 4, 2, 8
AGREEMENT = 0.995   # module docstring: a misaligned record agrees at a fraction of the positions


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from tandem.rollout.tiny_model import init_tiny
    return init_tiny(tmp_path_factory.mktemp("tiny-moe"), arch="qwen3_moe", layers=LAYERS, experts=EXPERTS,
                     top_k=TOP_K, seed=0)


# Two synchronous steps of two groups of two samples, nothing else.
SHORT = ["trainer.total_steps=2", "trainer.groups_per_step=2", "rollout.n_samples=2", "rollout.concurrency=4",
         "rollout.max_new_tokens=16", "rollout.eval_size=0", "rollout.eval_every=0", "controller.max_staleness=0",
         "trainer.checkpoint_every=0", "experiment.trackers=[jsonl]",
         # The untrained model answers everything wrong: with the group baseline every
         # advantage would be 0 and the updates (replayed too) would move nothing.
         "trainer.group_baseline=false", "trainer.normalize_advantages=false"]


def test_the_tiny_moe_config_trains_with_routing_replay(tmp_path, tiny_moe_dir):
    exp = ExpDir(tmp_path / "moe")
    out = finish(tandem("run", CONFIG, f"experiment.model={tiny_moe_dir}", f"experiment.exp_dir={exp.root}", *SHORT))
    assert "step 2/2" in out, out[-3000:]
    resolved = (exp.root / "config.yaml").read_text()
    assert "routing_replay: true" in resolved and "backend: torch" in resolved
    records = steps(exp)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert set(r["token_staleness_hist"]) == {"0"}, r    # every token sampled by the weights it trains
        assert r["moe_router_agreement"] >= AGREEMENT, r
        assert r["grad_norm"] > 0 and r["mismatch_tokens"] > 0 and r["mismatch_k3"] < 1e-6, r

    # The buffer refuses a sample without experts while replay is on, or whose experts do not fit
    # it (one row per prompt and output position but the last) or the model (layers, top k, expert
    # ids): it refused none, and every step trained whole groups.
    last = records[-1]
    assert last["buffer_taken"] == 2 * 2 and last["buffer_received"] >= 2 * 2 * 2, last   # groups; samples
    assert not [k for k in last if k.startswith(("buffer_rejected", "buffer_refused"))], last
    summary = json.loads((exp.root / "summary.json").read_text())
    assert summary["steps"] == 2
    assert leftovers(exp) == []


def test_agent_episodes_of_several_completions_train_with_routing_replay(tmp_path, tiny_moe_dir):
    """The same file with an agent (rollout.agent): the shipped code agent, whose untrained model
    never passes the visible examples, so every episode is two completions with the sandbox's
    feedback between them. Each completion's request returns the experts of the positions it fed;
    the episode joins them (each position from the first completion that fed it, the feedback
    from the second's prefill). The buffer took every episode (a record of the wrong length, or
    none, is refused), and router agreement at (nearly) every replayed position means the joined record
    lines up with the packed episode: the second completion's part shifted by one position fails
    it. Which completion's experts a position keeps is the unit tier's (test_agent_routing.py):
    here both completions ran under the same weights and route the shared prefix alike."""
    exp = ExpDir(tmp_path / "moe-agent")
    out = finish(tandem("run", CONFIG, f"experiment.model={tiny_moe_dir}", f"experiment.exp_dir={exp.root}", *SHORT,
                        "rollout.dataset=synthetic:code", "reward.task=code", "reward.allow_unisolated=true",
                        "rollout.agent=tandem.rollout.agents.code_feedback:solve", "rollout.max_turns=2"))
    assert "step 2/2" in out, out[-3000:]
    records = steps(exp)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["turns_mean"] == 2.0, r      # every episode: a completion, the feedback, a completion
        assert r["moe_router_agreement"] >= AGREEMENT, r
        assert r["grad_norm"] > 0 and r["mismatch_tokens"] > 0 and r["mismatch_k3"] < 1e-6, r
    last = records[-1]
    assert last["buffer_taken"] == 2 * 2, last
    assert not [k for k in last if k.startswith(("buffer_rejected", "buffer_refused"))], last
    assert leftovers(exp) == []
