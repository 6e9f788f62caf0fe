"""How the slurm backend sizes each role's job from the plan (no cluster, no process). The SGLang
server jobs (whose role specs pick free ports) are in tests/integration/slurm/test_slurm_sglang_requests.py.
"""
from __future__ import annotations

import pickle

import pytest

from launcher.config import load_config
from launcher.local import LaunchError, RoleSpec
from launcher.plan import plan_for
from launcher.slurm_requests import SlurmPolicy, job_requests, policy_of, time_minutes
from launcher.slurm_task import RoleCommand, console_name


def _cfg(exp, *overrides):
    return load_config(None, ["experiment.name=req", f"experiment.exp_dir={exp.root}", "experiment.model=/m",
                              "launcher.backend=slurm", *overrides])


def _specs(cfg, n_servers):
    """The role list `launcher.run.role_specs` produces, in its order."""
    root = "/exp"
    specs = [RoleSpec("controller-0", ["controller", "--exp", root], ready_file="controller", restart=True),
             RoleSpec("reward-0", ["reward", "serve", "--exp", root], ready_file="reward", restart=True)]
    specs += [RoleSpec(f"gen-{i}", ["gen", "serve", "--model", "/m", "--host", "127.0.0.1", "--port", "4321",
                                    "--exp", root, "--rank", str(i)], threads=2, ready_file=f"gen-{i}",
                       restart=True) for i in range(n_servers)]
    specs.append(RoleSpec("trainer-0", ["trainer", "--exp", root], threads=3, ready_file="trainer"))
    specs.append(RoleSpec("rollout-0", ["rollout", "--exp", root, "--rank", "0"], restart=True))
    return specs


def _requests(exp, *overrides):
    cfg = _cfg(exp, *overrides)
    plan = plan_for(cfg)
    return cfg, plan, {r.name: r for r in job_requests(cfg, exp, False, plan, _specs(cfg, plan.num_servers))}


def test_whole_node_split_gives_the_trainer_whole_exclusive_nodes(exp):
    cfg, plan, reqs = _requests(exp, "launcher.nodes=16", "launcher.gpus_per_node=8", "gen.tp_size=2")
    trainer = reqs["trainer-0"]
    assert (trainer.nodes, trainer.tasks_per_node, trainer.gpus_per_node) == (4, 8, 8)
    assert trainer.distributed and trainer.exclusive and trainer.threads == 3
    gens = [r for n, r in reqs.items() if n.startswith("gen-")]
    assert len(gens) == 48 == plan.num_servers
    assert all(g.gpus_per_node == 2 and g.nodes == 1 and not g.exclusive for g in gens)
    # The server picks its port on its node and binds an interface other nodes reach.
    argv = gens[0].command
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--host") + 1] == "{node}"
    for cpu in ("controller-0", "reward-0", "rollout-0"):
        assert reqs[cpu].gpus_per_node == 0 and not reqs[cpu].exclusive and not reqs[cpu].distributed
    # The plan's server count reaches the roles through the saved config.
    assert "num_servers: 48" in exp.config.read_text()


def test_gpu_level_split_and_exclusive_only_for_whole_node_jobs(exp):
    _, _, reqs = _requests(exp, "launcher.nodes=2", "launcher.gpus_per_node=4", "gen.tp_size=1")
    t = reqs["trainer-0"]
    assert (t.nodes, t.tasks_per_node, t.gpus_per_node, t.exclusive) == (1, 2, 2, False)
    assert sum(n.startswith("gen-") for n in reqs) == 6
    _, _, reqs = _requests(exp, "launcher.nodes=4", "launcher.gpus_per_node=8", "gen.tp_size=8")
    assert all(r.exclusive for n, r in reqs.items() if n.startswith("gen-"))
    _, _, reqs = _requests(exp, "launcher.nodes=4", "launcher.gpus_per_node=8", "launcher.slurm.exclusive=false")
    assert not any(r.exclusive for r in reqs.values())


def test_trainer_ranks_spread_unevenly_over_nodes_is_a_clear_error(exp):
    with pytest.raises(LaunchError, match="unevenly"):
        _requests(exp, "launcher.nodes=5", "launcher.gpus_per_node=8")


@pytest.mark.parametrize("text,minutes", [("30", 30), ("24:00:00", 1440), ("1:30:00", 90), ("10:30", 11),
                                          ("2-00:00:00", 2880), ("1-12", 2160), ("0:00:59", 1)])
def test_time_limits_in_slurm_formats(text, minutes):
    assert time_minutes(text) == minutes


def test_bad_time_and_policy_are_named(exp):
    with pytest.raises(LaunchError, match="launcher.slurm.time"):
        time_minutes("tomorrow")
    cfg = _cfg(exp)
    assert policy_of(cfg) == SlurmPolicy()


def test_role_command_pickles_and_names_consoles():
    cmd = RoleCommand("trainer-0", ["true"], "/exp", 2, True)
    again = pickle.loads(pickle.dumps(cmd))
    assert (again.name, again.command, again.distributed) == ("trainer-0", ["true"], True)
    assert console_name("gen-3", None) == "gen-3.console"
    assert [console_name("trainer-0", r) for r in (0, 1)] == ["trainer-0.console", "trainer-1.console"]
