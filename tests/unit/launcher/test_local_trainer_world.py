"""How many trainer ranks the local backend starts, where each runs, and what the run hears of
them (no process is started: the supervision of real processes is in
tests/integration/launcher/test_trainer_rank_supervision.py)."""
from __future__ import annotations

import pytest

from tandem.launcher.backends.base import Ended
from tandem.launcher.backends.local_ranks import TrainerRanks, rank_env, rank_roles
from tandem.launcher.config import ConfigError, load_config
from tandem.launcher.placement import format_ranges
from tandem.launcher.plan import PlanError, cpu_placement_for, local_trainer_world, plan_for
from tandem.launcher.roles import Role, gpu_layout

CPU = ["experiment.name=ranks", "experiment.exp_dir=/tmp/unused", "experiment.model=/m"]
ONE_NODE = [*CPU, "launcher.backend=local", "gen.backend=sglang", "launcher.nodes=1",
            "launcher.gpus_per_node=8", "launcher.gen_train_ratio='6:2'"]


def test_the_local_backend_plans_a_trainer_of_several_gpus_and_still_refuses_several_nodes():
    cfg = load_config(None, ONE_NODE)
    plan = gpu_layout(cfg)
    assert (plan.num_servers, plan.trainer_world) == (6, 2) and cfg.gen.num_servers == 6
    assert local_trainer_world(cfg) == 2
    # every rank sees the training GPUs and picks its own with LOCAL_RANK (torchrun's convention)
    assert [plan.trainer_devices(r) for r in (0, 1)] == ["6,7", "6,7"]
    assert plan.cuda_visible_devices("gen", 5) == "5"
    with pytest.raises(ConfigError, match="launcher.nodes=2: the local backend runs on this machine only"):
        gpu_layout(load_config(None, [*ONE_NODE, "launcher.nodes=2"]))


def test_on_gpus_the_plan_decides_the_world_and_the_cpu_key_is_named_as_ignored():
    cfg = load_config(None, [*ONE_NODE, "launcher.cpus.trainer_ranks=3"])
    assert local_trainer_world(cfg) == 2
    assert any("launcher.cpus.trainer_ranks=3 is ignored" in n for n in plan_for(cfg, place_cpus=False).notes)


def test_the_cpu_miniature_starts_the_ranks_its_key_asks_for_on_disjoint_cpu_sets():
    assert local_trainer_world(load_config(None, CPU)) == 1
    cfg = load_config(None, [*CPU, "launcher.cpus.trainer_ranks=2"])
    assert local_trainer_world(cfg) == 2
    p = cpu_placement_for(cfg, available=range(16))
    a, b = p.trainer_ranks
    assert a and b and not set(a) & set(b) and set(a) | set(b) == set(p.train)
    assert p.cpus_for("trainer-0") == a and p.cpus_for("trainer-1") == b and p.threads_for("trainer-1") == len(b)
    assert p.record()["trainer_ranks"] == [format_ranges(a), format_ranges(b)]


def test_a_world_the_machine_or_the_model_layout_cannot_take_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"launcher.cpus.trainer_ranks: must be >= 1, got 0"):
        load_config(None, [*CPU, "launcher.cpus.trainer_ranks=0"])
    cfg = load_config(None, [*CPU, "launcher.cpus.trainer_ranks=3", "trainer.backend=megatron",
                             "trainer.pipeline_parallel=2"])
    with pytest.raises(PlanError, match=r"launcher.cpus.trainer_ranks=3 is not divisible by .* = 1 x 2"):
        local_trainer_world(cfg)
    # Two CPUs: one for generation, one for training, which cannot hold two ranks.
    with pytest.raises(ConfigError, match=r"2 trainer rank\(s\) need at least 2 CPUs .*launcher.cpus.trainer_ranks"):
        cpu_placement_for(load_config(None, [*CPU, "launcher.cpus.trainer_ranks=2"]), available=[0, 1])


def test_ranks_are_named_as_slurm_names_them_and_get_torch_distributed_variables():
    role = Role("trainer-0", ["tandem", "trainer"], kind="trainer", threads=4, ready_file="trainer")
    ranks = rank_roles(role, 3)
    assert [(r.name, r.index, r.ready_file, r.kind, r.threads) for r in ranks] == [
        ("trainer-0", 0, "trainer", "trainer", 4), ("trainer-1", 1, None, "trainer", 4),
        ("trainer-2", 2, None, "trainer", 4)]
    assert all(r.command == role.command and r.stage == role.stage and not r.restart for r in ranks)
    # The rendezvous is a file in the launch's private directory (no TCP store anyone could write
    # into), the ranks' own connections on loopback.
    assert rank_env(2, 3, "/run/x/store") == {
        "TANDEM_STORE_FILE": "/run/x/store", "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert rank_env(0, 1, "/run/x/store") == {}   # one rank: no process group, as before


def test_the_run_hears_a_failure_at_once_and_the_end_only_when_every_rank_ended():
    role = Role("trainer-0", ["t"], kind="trainer", ready_file="trainer")
    trainer = TrainerRanks(role, 3)
    r0, r1, r2 = trainer.ranks
    assert trainer.heard(Ended(r0, ok=True)) is None
    assert trainer.heard(Ended(r2, ok=True)) is None
    done = trainer.heard(Ended(r1, ok=True, why="trainer-1 exited with status 0"))
    assert done.ok and done.role is role
    failing = TrainerRanks(role, 2)
    dead = Ended(failing.ranks[1], ok=False, why="trainer-1 exited with status 3")
    assert failing.heard(dead) is dead
