"""How the slurm backend sizes each role's job from the plan (no cluster, no process): the
experiment's real role list, with the addressing the slurm backend gives generation servers
(the node's name, port 0: picked on the node)."""
from __future__ import annotations

import pickle

import pytest

from tandem.launcher.backends import LaunchError
from tandem.launcher.backends.slurm_requests import (
    SlurmPolicy,
    adopt_plan,
    job_requests,
    policy_of,
    time_minutes,
)
from tandem.launcher.config import load_config
from tandem.launcher.roles import experiment_roles
from tandem.launcher.slurm_task import RoleCommand, console_name


def _cfg(exp, *overrides):
    return load_config(None, ["experiment.name=req", f"experiment.exp_dir={exp.root}", "experiment.model=/m",
                              "launcher.backend=slurm", *overrides])


def _requests(exp, *overrides):
    cfg = _cfg(exp, *overrides)
    plan = adopt_plan(cfg, exp)
    roles = experiment_roles(cfg, exp, False, cfg.launcher.slurm.bind_host, pick_port=lambda: 0)
    return cfg, plan, {r.name: r for r in job_requests(cfg, roles, plan)}


def test_whole_node_split_gives_the_trainer_whole_exclusive_nodes(exp):
    cfg, plan, reqs = _requests(exp, "launcher.nodes=16", "launcher.gpus_per_node=8", "gen.tp_size=2")
    trainer = reqs["trainer-0"]
    assert (trainer.nodes, trainer.tasks_per_node, trainer.gpus_per_node) == (4, 8, 8)
    assert trainer.distributed and trainer.exclusive and trainer.role.threads == cfg.trainer.threads
    gens = [r for n, r in reqs.items() if n.startswith("gen-")]
    assert len(gens) == 48 == plan.num_servers
    assert all(g.gpus_per_node == 2 and g.nodes == 1 and not g.exclusive for g in gens)
    # The server picks its port on its node and binds an interface other nodes reach.
    argv = gens[0].role.command
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--host") + 1] == "{node}"
    assert [r.role.kind for r in reqs.values()][:3] == ["controller", "reward", "gen"]
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


def test_sglang_servers_are_sglang_jobs_on_their_gpus(exp):
    """gen.backend: sglang: each gen job runs `tandem gen sglang` (which starts SGLang's launcher)
    on gen.tp_size GPUs, picking its HTTP and NCCL ports on its node; no key is on the command."""
    from tandem.launcher.run import write_gen_keys

    write_gen_keys(exp)
    cfg = _cfg(exp, "launcher.nodes=2", "launcher.gpus_per_node=4", "gen.backend=sglang", "gen.tp_size=2")
    plan = adopt_plan(cfg, exp)
    roles = experiment_roles(cfg, exp, False, cfg.launcher.slurm.bind_host, pick_port=lambda: 0)
    reqs = {r.name: r for r in job_requests(cfg, roles, plan)}
    gens = [r for n, r in reqs.items() if n.startswith("gen-")]
    assert len(gens) == 3 and cfg.gen.num_servers == 3      # 6 of 8 GPUs at 3:1, TP 2
    for g in gens:
        cmd = g.role.command
        assert cmd[cmd.index("tandem.launcher.cli") + 1:][:2] == ["gen", "sglang"]
        assert (cmd[cmd.index("--port") + 1], cmd[cmd.index("--nccl-port") + 1]) == ("0", "0")
        assert cmd[cmd.index("--host") + 1] == "{node}" and g.gpus_per_node == 2 and g.role.kind == "gen"
        assert g.role.threads == 4       # CPUs for 2 schedulers, the tokenizer and the detokenizer
        assert cmd[cmd.index("--admin-api-key-file") + 1] == str(exp.keys / "gen-admin-api-key")
        keys = [(exp.keys / n).read_text().strip() for n in ("gen-api-key", "gen-admin-api-key")]
        assert not any(k in " ".join(cmd) for k in keys)


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
