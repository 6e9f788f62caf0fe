"""The elastic split's moves as CPU-set arithmetic (launcher/elastic_moves.py) and the settings it
refuses. The placements here are computed for machines of 8 and 2 CPUs given by hand (physical
cores listed, so nothing is read from this machine): the arithmetic is what a real machine with
that many CPUs would get; this one has 2, where no move fits (a test says so)."""
from __future__ import annotations

import pytest

from tandem.launcher.config import load_config
from tandem.launcher.elastic_moves import (
    MoveRefused,
    elastic_problems,
    gen_to_train,
    possible_moves,
    train_to_gen,
)
from tandem.launcher.placement import CpuPlacement, place_cpus
from tandem.launcher.preflight import layout_problems


def eight_cpus(servers: int = 3) -> CpuPlacement:
    """8 CPUs as planned: services on 0; of the 7 left, 3:1 gives generation 5 (1-5), training 2 (6-7)."""
    p = place_cpus(range(8), num_servers=servers, cores=[(c,) for c in range(8)])
    assert p.services == (0,) and p.gen == (1, 2, 3, 4, 5) and p.train == (6, 7)
    return p


def pools(p: CpuPlacement) -> list[tuple[int, ...]]:
    return [*p.servers, *p.trainer_ranks]


def assert_disjoint(p: CpuPlacement) -> None:
    seen: set[int] = set()
    for pool in pools(p):
        assert pool and not seen & set(pool), pools(p)
        seen |= set(pool)
    assert set(p.gen) == {c for s in p.servers for c in s} and p.train == p.trainer_ranks[0]


def test_generation_to_training_gives_the_trainer_exactly_the_last_servers_cpus():
    p = eight_cpus()
    assert p.servers == ((1, 2), (3, 4), (5,))
    q = gen_to_train(p)
    assert q.servers == ((1, 2), (3, 4)) and q.trainer_ranks == ((5, 6, 7),)
    assert set(q.train) - set(p.train) == set(p.servers[-1])
    assert q.services == p.services and q.available == p.available and q.source == "elastic"
    assert_disjoint(q)
    r = gen_to_train(q)
    assert r.servers == ((1, 2),) and r.train == (3, 4, 5, 6, 7)
    assert_disjoint(r)
    with pytest.raises(MoveRefused, match="would leave none"):
        gen_to_train(r)


def test_training_to_generation_gives_back_the_last_retired_servers_set_first():
    p = eight_cpus()
    q = gen_to_train(gen_to_train(p))           # trainer 3-7: (5,) retired, then (3, 4)
    retired = [p.servers[2], p.servers[1]]
    r = train_to_gen(q, retired)
    assert r.servers == ((1, 2), (3, 4)) and r.train == (5, 6, 7)
    assert_disjoint(r)
    r2 = train_to_gen(r, retired[:1])
    assert pools(r2) == pools(p)
    mine = train_to_gen(p)                      # nothing retired: the trainer's own highest
    assert mine.servers[-1] == (7,) and mine.train == (6,)   # as many as the last server has (1)
    assert_disjoint(mine)
    with pytest.raises(MoveRefused, match="would leave it none"):
        train_to_gen(mine)


def test_a_new_server_takes_as_many_cpus_as_the_last_one_has():
    p = eight_cpus(servers=2)
    assert p.servers == ((1, 2, 3), (4, 5)) and p.train == (6, 7)
    with pytest.raises(MoveRefused, match="giving a server 2 would leave it none"):
        train_to_gen(p)                         # 2 of the trainer's 2 CPUs
    assert set(possible_moves(p)) == {"to_train"}


def test_a_round_trip_restores_the_starting_sets():
    p = eight_cpus()
    there_and_back = train_to_gen(gen_to_train(p), [p.servers[-1]])
    assert pools(there_and_back) == pools(p)
    assert set(possible_moves(p)) == {"to_train", "to_gen"}


def test_moves_with_several_trainer_ranks_are_refused():
    p = place_cpus(range(8), num_servers=2, trainer_ranks=2, cores=[(c,) for c in range(8)])
    with pytest.raises(MoveRefused, match="2 ranks"):
        gen_to_train(p)


def config(*overrides: str):
    return load_config(None, ["experiment.name=t", "experiment.model=m", "launcher.elastic=true", *overrides])


def test_two_cpus_fit_no_move():
    p = place_cpus([0, 1], num_servers=1, cores=[(0,), (1,)])
    assert possible_moves(p) == {}
    ((key, msg),) = elastic_problems(config(), p)
    assert key == "launcher.elastic" and "no move fits" in msg and "CPUs 0" in msg and "on 1" in msg


def test_settings_the_elastic_split_refuses():
    p = eight_cpus()
    assert elastic_problems(config("launcher.elastic=false", "launcher.backend=slurm"), None) == []
    ((key, msg),) = elastic_problems(config("launcher.backend=slurm"), None)
    assert key == "launcher.elastic" and "elastic trainer world" in msg and "not built" in msg
    ((key, msg),) = elastic_problems(config("gen.backend=sglang"), p)
    assert key == "launcher.elastic" and "not built" in msg
    ((key, msg),) = elastic_problems(config("trainer.weight_sync=broadcast"), p)
    assert key == "trainer.weight_sync" and "replay" in msg
    ((key, msg),) = elastic_problems(config("launcher.cpus.trainer_ranks=2"), p)
    assert key == "launcher.cpus.trainer_ranks"
    ((key, msg),) = elastic_problems(config("launcher.cpus.pin=false"), None)
    assert key == "launcher.cpus.pin"
    assert elastic_problems(config(), p) == []


def test_preflight_reports_them_with_the_layout():
    """Through `layout_problems` (what `tandem run` and `tandem config check` run): CPUs 0 and 1
    exist on every machine, and one server on 0 with the trainer on 1 fit no move."""
    problems = layout_problems(config("launcher.cpus.gen=0", "launcher.cpus.train=1"))
    assert [k for k, _ in problems] == ["launcher.elastic"], problems
    assert layout_problems(config("launcher.backend=slurm"))[-1][0] == "launcher.elastic"
