"""The backend-neutral role list and how the lifecycle starts it (no process is started)."""
from __future__ import annotations

import itertools

import pytest

from tandem.launcher.backends.base import Announcement
from tandem.launcher.config import load_config
from tandem.launcher.roles import eval_role, experiment_roles, waves
from tandem.services.protocol import publish_service


def _cfg(exp, *overrides):
    return load_config(None, ["experiment.name=roles", f"experiment.exp_dir={exp.root}", "experiment.model=/m",
                              "gen.num_servers=3", "rollout.num_workers=2", *overrides])


def _args(role):
    return role.command[role.command.index("tandem.launcher.cli") + 1:]


def test_roles_start_in_dependency_order_and_servers_start_as_one_wave(exp):
    ports = itertools.count(5000)
    roles = experiment_roles(_cfg(exp), exp, False, host="{node}", pick_port=lambda: next(ports))
    assert [r.name for r in roles] == ["controller-0", "reward-0", "gen-0", "gen-1", "gen-2", "trainer-0",
                                       "rollout-0", "rollout-1"]
    assert [[r.name for r in w] for w in waves(roles)] == [
        ["controller-0", "reward-0"], ["gen-0", "gen-1", "gen-2", "trainer-0"], ["rollout-0", "rollout-1"]]
    by_name = {r.name: r for r in roles}
    # Servers bind what the backend says, each on its own port; each announces gen-<i>.
    gen = [by_name[f"gen-{i}"] for i in range(3)]
    assert [_args(g)[_args(g).index("--port") + 1] for g in gen] == ["5000", "5001", "5002"]
    assert all(_args(g)[_args(g).index("--host") + 1] == "{node}" for g in gen)
    assert [(g.index, g.ready_file) for g in gen] == [(0, "gen-0"), (1, "gen-1"), (2, "gen-2")]
    # What may be restarted: services that rejoin, not the trainer (it continues with --resume).
    assert {r.name for r in roles if r.restart} == set(by_name) - {"trainer-0"}
    assert by_name["rollout-1"].ready_file is None and _args(by_name["rollout-1"])[-2:] == ["--rank", "1"]
    assert "--resume" not in _args(by_name["trainer-0"])


def test_resume_reaches_the_trainer_only(exp):
    roles = experiment_roles(_cfg(exp), exp, True, pick_port=lambda: 0)
    assert [r.name for r in roles if "--resume" in r.command] == ["trainer-0"]
    # A resumed trainer publishes its checkpoint's weights before it is ready: servers first.
    assert [[r.name for r in w] for w in waves(roles)][1:] == [
        ["gen-0", "gen-1", "gen-2"], ["trainer-0"], ["rollout-0", "rollout-1"]]


def test_evaluation_role_writes_where_the_summary_reads(exp):
    role = eval_role(exp, "before")
    assert role.kind == "eval" and _args(role)[-4:] == ["--out", str(exp.root / "eval-before.json"), "--tag", "before"]


def test_a_role_is_ready_when_it_writes_its_announcement_again(exp):
    """The previous process's announcement stays (a restarted service reads its port there), so
    it must not count as readiness; only a write after the start does."""
    publish_service(exp, "controller", {"address": "tcp://127.0.0.1:5555"})
    ready = Announcement(exp.service_file("controller"))
    assert not ready.fresh()
    publish_service(exp, "controller", {"address": "tcp://127.0.0.1:5555"})
    assert ready.fresh()
    assert not Announcement(exp.service_file("reward")).fresh()   # nothing written yet


def test_a_lora_adapter_run_starts_every_server_on_version_0s_adapter(exp):
    """`trainer.lora.sync: adapter`: both server kinds get SGLang's `--lora-paths policy=<exp>/adapter-v0`;
    a merged-sync or full fine-tuning run gets none."""
    for backend in ("embedded", "sglang"):
        roles = experiment_roles(_cfg(exp, "trainer.lora.rank=8", f"gen.backend={backend}"),
                                 exp, False, pick_port=lambda: 0)
        gens = [_args(r) for r in roles if r.kind == "gen"]
        assert gens and all(a[a.index("--lora-paths") + 1:] == [f"policy={exp.initial_adapter}"]
                                      for a in gens), gens
    for overrides in (["trainer.lora.rank=8", "trainer.lora.sync=merged"], []):
        roles = experiment_roles(_cfg(exp, *overrides), exp, False, pick_port=lambda: 0)
        assert not any("--lora-paths" in _args(r) for r in roles)


@pytest.mark.parametrize(("value", "gpus"), [("0,1", ["0", "1"]), ("GPU-a1b2, GPU-c3d4", ["GPU-a1b2", "GPU-c3d4"]),
                                             ("3,-1,2", ["3"]), ("-1", []), ("", []), ("MIG-9f", ["MIG-9f"])])
def test_the_gpus_a_launcher_may_use_are_its_own_cuda_visible_devices(monkeypatch, value, gpus):
    """As CUDA reads the list: up to its first invalid entry."""
    from tandem.launcher.roles import visible_gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert visible_gpus() == gpus
