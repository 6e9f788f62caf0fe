"""Allocation plans for the AReaL paper's cluster shapes, checked against tables computed by hand.

Shapes: H800 nodes with 8 GPUs, 16 and 48 nodes (and the paper's 24-node 7B run), split 3:1.
TP settings: 1.5B gen TP 1 / trainer TP 1; 7B gen TP 2 / trainer TP 2; 32B gen TP 4 / trainer
TP 8 x PP 2 (16 nodes) or PP 4 (48 nodes).
"""
from __future__ import annotations

import pytest

from tandem.launcher.cli import main
from tandem.launcher.config import load_config
from tandem.launcher.plan import PlanError, make_plan, plan_for

# nodes, gen_tp, train_tp, train_pp -> (gen GPUs, gen nodes, servers, train GPUs, train nodes, DP)
PAPER_SHAPES = {
    "1.5B x16": ((16, 1, 1, 1), (96, range(0, 12), 96, 32, range(12, 16), 32)),
    "7B x16": ((16, 2, 2, 1), (96, range(0, 12), 48, 32, range(12, 16), 16)),
    "32B x16": ((16, 4, 8, 2), (96, range(0, 12), 24, 32, range(12, 16), 2)),
    "7B x24": ((24, 2, 2, 1), (144, range(0, 18), 72, 48, range(18, 24), 24)),
    "1.5B x48": ((48, 1, 1, 1), (288, range(0, 36), 288, 96, range(36, 48), 96)),
    "7B x48": ((48, 2, 2, 1), (288, range(0, 36), 144, 96, range(36, 48), 48)),
    "32B x48": ((48, 4, 8, 4), (288, range(0, 36), 72, 96, range(36, 48), 3)),
}


@pytest.mark.parametrize("name", sorted(PAPER_SHAPES))
def test_paper_shapes_match_hand_computed_tables(name):
    (nodes, gtp, ttp, tpp), (gen, gen_nodes, servers, train, train_nodes, dp) = PAPER_SHAPES[name]
    p = make_plan(nodes, 8, "3:1", gen_tp=gtp, train_tp=ttp, train_pp=tpp)
    assert p.split == "whole-node"
    assert (p.gen_gpus, p.num_servers, p.train_gpus, p.trainer_world, p.train_dp) == (
        gen, servers, train, train, dp)
    assert p.gen_nodes == list(gen_nodes)
    assert p.train_nodes == list(train_nodes)
    assert not p.notes
    # Every GPU is used exactly once, by exactly one role.
    used = [(s.node, g) for s in p.servers for g in s.gpus] + [(r.node, r.gpu) for r in p.trainer_ranks]
    assert sorted(used) == [(n, g) for n in range(nodes) for g in range(8)]


def test_server_and_rank_placement():
    p = make_plan(16, 8, "3:1", gen_tp=2, train_tp=2)
    assert p.servers[3].node == 0 and p.servers[3].gpus == (6, 7)
    assert p.servers[4].node == 1 and p.servers[4].gpus == (0, 1)
    assert p.cuda_visible_devices("gen", 47) == "6,7"
    assert (p.trainer_ranks[0].node, p.trainer_ranks[0].gpu) == (12, 0)
    assert (p.trainer_ranks[31].node, p.trainer_ranks[31].gpu) == (15, 7)
    assert p.cuda_visible_devices("train", 9) == "1"


def test_gpu_level_split_when_nodes_do_not_divide():
    # 10 nodes at 3:1 = 7.5 generation nodes: node 7 is shared 4 generation / 4 training GPUs.
    p = make_plan(10, 8, "3:1", gen_tp=2, train_tp=2)
    assert p.split == "gpu-level"
    assert (p.gen_gpus, p.train_gpus, p.num_servers, p.train_dp) == (60, 20, 30, 10)
    assert p.node_roles()[7] == (7, 4, 4)
    assert p.servers[-1].node == 7 and p.servers[-1].gpus == (2, 3)
    assert (p.trainer_ranks[0].node, p.trainer_ranks[0].gpu) == (7, 4)
    # One node: 6 generation GPUs, 2 training GPUs.
    one = make_plan(1, 8, "3:1")
    assert (one.gen_gpus, one.train_gpus, one.split) == (6, 2, "gpu-level")


def test_rounding_to_tp_groups_is_reported():
    # 40 GPUs, ideal 30 for generation; whole TP groups of both roles (lcm(4, 8) = 8) -> 32 : 8.
    p = make_plan(5, 8, "3:1", gen_tp=4, train_tp=8)
    assert (p.gen_gpus, p.train_gpus, p.num_servers) == (32, 8, 8)
    assert any("got 32:8" in n for n in p.notes)


@pytest.mark.parametrize("kwargs, expect", [
    (dict(nodes=16, gpus_per_node=8, ratio="3:1", gen_tp=16), "gen.tp_size=16 is larger than a node"),
    (dict(nodes=16, gpus_per_node=8, ratio="3:1", gen_tp=3), "gen.tp_size=3 does not divide"),
    (dict(nodes=16, gpus_per_node=8, ratio="3:1", train_tp=16), "trainer.tensor_parallel=16 is larger"),
    (dict(nodes=16, gpus_per_node=8, ratio="3:1", train_pp=3), "not divisible by trainer.tensor_parallel x"),
    (dict(nodes=1, gpus_per_node=1, ratio="3:1"), "leaves training with no GPU"),
    (dict(nodes=1, gpus_per_node=8, ratio="3:1", gen_tp=8), "leaves training with no GPU"),
    (dict(nodes=1, gpus_per_node=8, ratio="1:7", gen_tp=4, train_tp=4), "leaves generation with no GPU"),
    (dict(nodes=2, gpus_per_node=0, ratio="3:1"), "no GPUs to split"),
    (dict(nodes=2, gpus_per_node=8, ratio="3:0"), "gen_train_ratio"),
    (dict(nodes=2, gpus_per_node=8, ratio="three"), "gen_train_ratio"),
])
def test_impossible_combinations_name_the_keys(kwargs, expect):
    with pytest.raises(PlanError, match=expect.replace(".", r"\.")):
        make_plan(**kwargs)


def _cfg(*overrides):
    return load_config(None, ["experiment.name=t", "experiment.model=m", *overrides])


def test_plan_for_reads_the_config_sections():
    p = plan_for(_cfg("launcher.backend=slurm", "launcher.nodes=48", "gen.tp_size=4",
                      "trainer.tensor_parallel=8", "trainer.pipeline_parallel=4"))
    assert (p.num_servers, p.train_dp) == (72, 3)
    assert all(v == "a CPU job (no GPUs)" for v in p.cpu_roles.values())


def test_cli_prints_the_plan_and_reports_errors(tmp_path, capsys):
    f = tmp_path / "exp.yaml"
    f.write_text("experiment: {name: t, model: m}\nlauncher: {nodes: 16, gpus_per_node: 8}\n")
    assert main(["plan", str(f)]) == 0
    out = capsys.readouterr().out
    assert "96 servers x TP 1" in out and "world 32 = TP 1 x PP 1 x DP 32" in out
    assert "0-11" in out and "12-15" in out
    assert main(["plan", str(f), "gen.tp_size=16"]) == 2
    assert "gen.tp_size=16 is larger than a node" in capsys.readouterr().err
