"""When the elastic split decides and what it records (launcher/elastic.py), without processes: the
backend is a stand-in holding a placement, the decisions are scripted. The moves themselves, with
real roles, are tests/integration/e2e/test_elastic_run.py's."""
from __future__ import annotations

import json
from types import SimpleNamespace

from tandem.launcher.config import load_config
from tandem.launcher.elastic import Decision, ElasticSplit, MetricsTail
from tandem.launcher.placement import place_cpus
from tandem.launcher.roles import Role
from tandem.services.protocol import MetricsWriter, read_metrics
from tandem.trainer.elastic_cpus import CPUS_FILE


def make_split(exp, decide, every: int = 2) -> ElasticSplit:
    cfg = load_config(None, ["experiment.name=t", "experiment.model=m", "launcher.elastic=true",
                             f"launcher.elastic_every_steps={every}"])
    placement = place_cpus(range(8), num_servers=3, cores=[(c,) for c in range(8)])
    backend = SimpleNamespace(sup=SimpleNamespace(placement=placement, children={}), gen_host="127.0.0.1",
                              pick_port=lambda: 0)
    roles = [Role(f"gen-{i}", ["x"], kind="gen", index=i, ready_file=f"gen-{i}") for i in range(3)]
    return ElasticSplit(cfg, exp, backend, roles, join=lambda *a: None, decide=decide)


def steps(exp, n: int, start: int = 1) -> None:
    trainer, other = MetricsWriter(exp, "trainer"), MetricsWriter(exp, "controller")
    for s in range(start, start + n):
        trainer.log(event="step", step=s)
        other.log(event="step", step=s)   # another role's record of the same name does not count
    trainer.close()
    other.close()


def test_decides_every_n_trainer_steps_and_records_why(exp, capsys):
    asked = []

    def decide(split):
        asked.append(split.step)
        return Decision(3, {2: 10.0, 3: 11.0, 4: 9.0}, "scripted: stay")
    split = make_split(exp, decide)
    steps(exp, 1)
    split.tick()
    assert asked == []
    steps(exp, 1, start=2)
    split.tick()
    assert asked == [2]
    split.tick()                      # no new step: nothing
    assert asked == [2]
    (rec,) = read_metrics(exp, "launcher", "elastic_decision")
    assert rec["step"] == 2 and rec["servers"] == 3 and rec["target"] == 3 and rec["why"] == "scripted: stay"
    assert rec["speeds_steps_per_h"] == {"2": 10.0, "3": 11.0, "4": 9.0} and rec["trainer_cpus"] == "6-7"
    assert read_metrics(exp, "launcher", "elastic_move") == []   # the target is the current split
    assert "elastic split at step 2: 3 server(s)" in capsys.readouterr().out


def test_a_prediction_that_fails_is_a_decision_to_stay(exp):
    def decide(split):
        raise ValueError("no trainer step in the window")
    split = make_split(exp, decide, every=1)
    steps(exp, 1)
    split.tick()
    (rec,) = read_metrics(exp, "launcher", "elastic_decision")
    assert rec["target"] is None and rec["why"] == "no prediction: ValueError: no trainer step in the window"
    assert read_metrics(exp, "launcher", "elastic_move") == []


def test_a_move_the_trainer_does_not_confirm_is_undone(exp):
    """Training -> generation waits for the trainer to take its smaller set; here no trainer runs,
    so the move fails, the trainer's file is set back to its CPUs, and no server starts."""
    split = make_split(exp, lambda s: Decision(4, why="scripted"), every=1)
    before = split.placement
    steps(exp, 1)
    split.tick()
    (move,) = read_metrics(exp, "launcher", "elastic_move")
    assert move["direction"] == "to_gen" and move["ok"] is False and "the trainer is not running" in move["detail"]
    assert split.placement is before and len(split.servers) == 3
    spec = json.loads(exp.service_file(CPUS_FILE).read_text())
    assert spec["seq"] == 2 and spec["cpus"] == [6, 7]   # seq 1 asked for [6]; seq 2 takes it back


def test_metrics_tail_leaves_a_half_written_line_for_the_next_read(exp):
    tail = MetricsTail(exp)
    with open(exp.metrics, "a") as f:
        f.write('{"a": 1}\n{"b":')
    assert tail.read() == [{"a": 1}]
    with open(exp.metrics, "a") as f:
        f.write(' 2}\n')
    assert tail.read() == [{"b": 2}]
