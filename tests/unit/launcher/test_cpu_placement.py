"""CPU placement of the local backend: pools for 2, 16 and 64 CPUs, overrides and their errors.

The CPU list is passed in, so these run the same on any machine. Starting a real role and reading
its pinning back from /proc is in tests/integration/launcher/test_cpu_pinning.py.
"""
from __future__ import annotations

import pytest

from tandem.launcher.cli import main
from tandem.launcher.config import ConfigError, load_config, parse_cpus
from tandem.launcher.placement import (
    CpuPlacement,
    PlacementError,
    format_ranges,
    physical_cores,
    place_cpus,
)
from tandem.launcher.plan import cpu_placement_for


def _disjoint_cover(p: CpuPlacement) -> None:
    """Every server and rank gets its own CPUs; the compute pools never overlap."""
    assert not set(p.gen) & set(p.train)
    server_cpus = [c for s in p.servers for c in s]
    assert sorted(server_cpus) == list(p.gen) and len(set(server_cpus)) == len(server_cpus)
    assert sorted(c for r in p.trainer_ranks for c in r) == list(p.train)


def test_two_cpus_gen_one_train_the_other_services_with_generation():
    p = place_cpus([0, 1])
    assert (p.gen, p.train, p.services) == ((0,), (1,), (0,))
    assert p.cpus_for("gen-0") == (0,) and p.cpus_for("trainer-0") == (1,)
    for role in ("controller-0", "reward-0", "rollout-3", "eval-before"):
        assert p.cpus_for(role) == (0,) and p.threads_for(role) == 1
    assert p.threads_for("gen-0") == p.threads_for("trainer-0") == 1
    assert p.shared_pools() == ["light services share the generation pool"]
    _disjoint_cover(p)


def test_sixteen_cpus_reserve_services_then_three_to_one():
    p = place_cpus(range(16))
    assert p.services == tuple(range(0, 4))
    assert p.gen == tuple(range(4, 13)) and p.train == tuple(range(13, 16))
    assert len(p.gen) == 3 * len(p.train)
    assert p.threads_for("gen-0") == 9 and p.threads_for("trainer-0") == 3
    assert p.shared_pools() == []
    _disjoint_cover(p)


def test_sixty_four_cpus_several_servers():
    p = place_cpus(range(64), num_servers=4)
    assert p.services == tuple(range(4))
    assert (len(p.gen), len(p.train)) == (45, 15)
    assert [len(s) for s in p.servers] == [12, 11, 11, 11]
    assert p.servers[1] == tuple(range(16, 27))
    assert p.cpus_for("gen-3") == p.servers[3] and p.threads_for("gen-3") == 11
    _disjoint_cover(p)


def test_other_ratio_and_odd_sizes():
    p = place_cpus(range(16), ratio=(1, 1))
    assert (len(p.services), len(p.gen), len(p.train)) == (2, 7, 7)
    p = place_cpus(range(3))
    assert (p.services, p.gen, p.train) == ((0,), (1,), (2,))
    p = place_cpus([2, 5, 7, 9])  # whatever CPUs the process was given, in order
    assert (p.services, p.gen, p.train) == ((2,), (5, 7), (9,))


def test_hyperthread_siblings_stay_in_one_pool():
    cores = [(c, c + 8) for c in range(8)]  # 8 cores x 2 threads, siblings c and c + 8
    p = place_cpus(range(16), cores=cores)
    assert p.services == (0, 8)
    for pool in (p.gen, p.train):
        for c in pool:
            sibling = c + 8 if c < 8 else c - 8
            assert sibling in pool
    assert (len(p.gen), len(p.train)) == (10, 4)
    _disjoint_cover(p)


def test_physical_cores_from_sysfs(tmp_path):
    for cpu, sib in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    assert physical_cores([0, 1, 2, 3], sysfs=tmp_path) == [(0, 2), (1, 3)]
    assert physical_cores([1, 2, 3], sysfs=tmp_path) == [(1, 3), (2,)]
    assert physical_cores([5], sysfs=tmp_path) == [(5,)]  # no topology: one CPU per core


def test_one_cpu_is_shared_and_says_so():
    p = place_cpus([0])
    assert p.gen == p.train == p.services == (0,)
    assert "not a faithful miniature" in p.notes[0]
    assert "generation and training share CPUs" in p.shared_pools()


def test_cpu_list_syntax():
    assert parse_cpus("0-3,6, 8-9") == (0, 1, 2, 3, 6, 8, 9)
    assert format_ranges((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"
    for bad in ("a", "3-1", "", "-1"):
        with pytest.raises(ConfigError, match="launcher.cpus"):
            parse_cpus(bad)


def test_override_is_used_and_services_default_to_leftover():
    p = place_cpus(range(8), gen="0-5", train="6")
    assert (p.gen, p.train, p.services, p.source) == (tuple(range(6)), (6,), (7,), "launcher.cpus")
    p = place_cpus(range(8), gen="0-5", train="6-7")
    assert p.services == tuple(range(6)) and "generation pool" in p.notes[0]
    p = place_cpus(range(8), gen="0-3", train="4-5", services="5-7", num_servers=2)
    assert p.servers == ((0, 1), (2, 3)) and p.shared_pools() == ["light services share the training pool"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(gen="0-4", train="4-7"), r"overlap on CPU\(s\) 4"),
    (dict(gen="0-5", train="6-9"), r"CPU\(s\) 8-9 are not available .*0-7"),
    (dict(gen="0-5", train="6", services="12"), r"launcher.cpus.services=12: CPU\(s\) 12 are not available"),
    (dict(gen="0-1", train="6", num_servers=3), r"gen.num_servers=3 needs at least 3 CPUs .*has 2 \(0-1"),
    (dict(gen="0-5", train="6", trainer_ranks=2), r"2 trainer rank\(s\) need at least 2 CPUs"),
    (dict(gen="0-5"), r"set both gen and train"),
    (dict(gen="x", train="1"), r"launcher.cpus.gen='x'"),
])
def test_override_errors_name_the_problem(kwargs, message):
    with pytest.raises(ConfigError, match=message):  # PlacementError or a cpu-list syntax error
        place_cpus(range(8), **kwargs)


def test_default_that_does_not_fit_the_machine_is_a_clear_error():
    with pytest.raises(PlacementError, match=r"gen.num_servers=2 needs at least 2 CPUs .*may use 2 CPU\(s\): 0-1"):
        place_cpus([0, 1], num_servers=2)


def test_config_section_validates_and_selects():
    with pytest.raises(ConfigError, match=r"launcher.cpus.gen: '0-x': expected CPU ids"):
        load_config("configs/math-tiny.yaml", ["launcher.cpus.gen=0-x", "launcher.cpus.train=1"])
    with pytest.raises(ConfigError, match=r"launcher.cpus.train: .*needs both gen and train"):
        load_config("configs/math-tiny.yaml", ["launcher.cpus.gen=0"])
    cfg = load_config("configs/math-tiny.yaml", ["gen.num_servers=3"])
    p = cpu_placement_for(cfg, available=range(16))
    assert len(p.servers) == 3 and len(p.trainer_ranks) == 1
    assert cpu_placement_for(load_config("configs/math-tiny.yaml", ["launcher.cpus.pin=false"])) is None
    assert cpu_placement_for(load_config("configs/math-tiny.yaml", ["launcher.backend=slurm"])) is None
    ov = ["launcher.cpus.gen=0-9", "launcher.cpus.train=10-15", "launcher.cpus.services=0"]
    p = cpu_placement_for(load_config("configs/math-tiny.yaml", ov), available=range(16))
    assert (len(p.gen), len(p.train), p.services) == (10, 6, (0,))


def test_tandem_plan_prints_the_cpu_placement(capsys):
    assert main(["plan", "configs/math-tiny.yaml"]) == 0
    out = capsys.readouterr().out
    assert "CPU placement (planned)" in out and "generation server 0" in out and "trainer rank 0" in out
    assert "light services" in out
    assert main(["plan", "configs/math-tiny.yaml", "launcher.cpus.gen=0", "launcher.cpus.train=0"]) == 2
    assert "overlap on CPU(s) 0" in capsys.readouterr().err


def test_role_cpu_sums_a_process_group_from_proc(tmp_path):
    """Fake /proc entries (the layout of proc(5)): a role's CPU is its whole process group's."""
    from tandem.launcher.role_cpu import _TICK, RoleCpuMeter, group_cpu_seconds

    def stat(pid: int, comm: str, pgrp: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0):
        d = tmp_path / str(pid)
        d.mkdir()
        rest = ["S", "1", str(pgrp)] + ["0"] * 8 + [str(utime), str(stime), str(cutime), str(cstime)] + ["0"] * 5
        (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(rest) + "\n")

    stat(100, "python", 100, 2 * _TICK, _TICK, cutime=_TICK)   # the reward service: 4 s
    stat(101, "reward worker (1)", 100, _TICK, 0)               # its grader: 1 s
    stat(200, "python", 200, 3 * _TICK, 0)                      # another role
    (tmp_path / "self").mkdir()                                 # non-pid entries are skipped
    assert group_cpu_seconds({100, 200}, proc=tmp_path) == {100: 5.0, 200: 3.0}
    assert group_cpu_seconds({999}, proc=tmp_path) == {}
    meter = RoleCpuMeter(proc=tmp_path)
    meter.sample({"reward-0": 100, "trainer-0": 200, "gone-0": 999}, force=True)
    assert meter.seconds() == {"reward-0": 5.0, "trainer-0": 3.0}
    # Restarted under the same name (a new group): both lives count; a group's total never drops.
    stat(300, "python", 300, _TICK, 0)
    (tmp_path / "101" / "stat").unlink()
    meter.sample({"reward-0": 300, "trainer-0": 200}, force=True)
    meter.sample({"reward-0": 100}, force=True)
    assert meter.seconds() == {"reward-0": 6.0, "trainer-0": 3.0}
