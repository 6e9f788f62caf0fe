"""The elastic split's lifecycle in a real local run: a generation -> training move, then the
reverse, while the run trains, and the audit shows every group trained once and none lost.

What is real: `run_experiment` on the local backend with every role a process (controller,
reward service, two embedded generation servers, the trainer, rollout workers), real ZeroMQ and
HTTP; the moves are `ElasticSplit`'s own (the controller retires gen-1 over `RetireServer` and
its requests go on elsewhere, the supervisor stops it, the trainer re-pins its threads to the
file the launcher writes; then the trainer shrinks, says so, and a new gen-1 starts, registers
and is caught up from disk), and the run's config has `launcher.elastic: true`.

What is not: WHEN to move. The decisions are scripted (`decide`: first a move that cannot be made
— a third server out of the trainer's one CPU: refused, logged, the run goes on — then to one
server, back to two, then the real simulator-based prediction, computed on the run's own metrics
and logged but not acted on): the tiny model's predictions would rarely ask for both moves in one short run.
And this machine has 2 CPUs, so the pools cannot be disjoint: the placement is given by hand,
both servers on the first CPU and the trainer on the last; the gen -> train move gives the trainer
both CPUs, the reverse gives it back the last one alone. The CPU sets change for real (the test
reads the trainer's and the new server's threads in /proc); that they stay disjoint on a machine
with enough CPUs is the unit tests' (tests/unit/launcher/test_elastic_moves.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from local_run import leftovers, write_config

from tandem.launcher.audit import audit
from tandem.launcher.backends.local import LocalBackend, LocalSupervisor
from tandem.launcher.config import load_config, save_resolved
from tandem.launcher.elastic import Decision, ElasticSplit, simulated_decision
from tandem.launcher.lifecycle import run_experiment
from tandem.launcher.placement import CpuPlacement
from tandem.launcher.run import write_gen_keys
from tandem.services.protocol import ExpDir, generate_keys, read_metrics

pytestmark = pytest.mark.timeout(900)
# Long enough that the last split trains a window of its own after the move back. A new server
# started fresh took 16 s on a loaded 2-core machine while the trainer went on (with 48 steps the
# run once ended before that move did); forked (the default, launcher/backends/role_forks.py) the
# whole move took 1.9 s, done by step 20 of 80.
STEPS = 48


def thread_cpus(pid: int) -> set[str]:
    """The Cpus_allowed_list of every thread of process `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        out |= {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Cpus_allowed_list")}
    return out


def test_a_run_moves_a_server_to_training_and_back_and_loses_nothing(tmp_path, tiny_model_dir):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: one for generation, one for training")
    first, last = cpus[0], cpus[-1]
    path = write_config(tmp_path / "exp.yaml", tiny_model_dir, "elastic")
    cfg = load_config(path, ["gen.num_servers=2", "launcher.elastic=true", "launcher.elastic_every_steps=3",
                             f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=5"])
    exp = ExpDir(cfg.experiment.exp_dir)
    exp.root.mkdir(parents=True)
    save_resolved(cfg, exp.root)
    generate_keys(exp.keys)
    write_gen_keys(exp)
    placement = CpuPlacement(available=tuple(cpus), gen=(first,), train=(last,), services=(first,),
                             servers=((first,), (first,)), trainer_ranks=((last,),), source="test",
                             notes=("2 CPUs: both servers share the first (not disjoint)",))
    backend = LocalBackend(cfg, exp, LocalSupervisor(exp, placement, cfg.launcher.fork_roles))
    seen: list[tuple] = []   # what each decision point found, checked after the run

    def decide(split: ElasticSplit) -> Decision:
        trainer = backend.sup.children["trainer-0"].proc.pid
        servers = {r.name: backend.sup.children[r.name].proc.pid for r in split.servers}
        seen.append(("at", len(split.servers), thread_cpus(trainer), {n: thread_cpus(p) for n, p in servers.items()}))
        if len(seen) == 1:   # refused: the trainer's one CPU cannot make a server
            return Decision(3, why="test: a move that cannot be made")
        if len(seen) == 2:
            return Decision(1, why="test: to training")
        if len(seen) == 3:
            return Decision(2, why="test: back to generation")
        try:
            real = simulated_decision(split)
        except Exception as e:   # recorded, so the assertion below says why
            seen.append(("prediction failed", repr(e)))
            raise
        seen.append(("prediction", real))
        return Decision(None, real.speeds, f"test: not acted on ({real.why})")

    def elastic(cfg, exp, backend, roles, join):
        return ElasticSplit(cfg, exp, backend, roles, join, decide=decide)

    rc = run_experiment(cfg, exp, False, backend, elastic=elastic)
    assert rc == 0, (exp.logs / "trainer-0.console").read_text()[-3000:]

    moves = read_metrics(exp, "launcher", "elastic_move")
    assert [(m["direction"], m["ok"]) for m in moves] == [("to_gen", False), ("to_train", True),
                                                          ("to_gen", True)], moves
    assert "would leave it none" in moves[0]["detail"]   # refused, logged, and the run went on
    moves = moves[1:]
    # Decision 3 saw the trainer on both CPUs (it re-pinned every thread after the first move), one server.
    (_, n1, trainer1, _), (_, n2, trainer2, gens2) = [s for s in seen if s[0] == "at"][1:3]
    span = f"{first}-{last}" if last == first + 1 else f"{first},{last}"
    assert n1 == 2 and trainer1 == {str(last)}
    assert n2 == 1 and trainer2 == {span} and set(gens2) == {"gen-0"}
    applied = read_metrics(exp, "trainer", "trainer_cpus")
    assert [(r["seq"], r["cpus"]) for r in applied] == [(1, [first, last]), (2, [last])], applied
    # Decision 3 (if the run reached it): the trainer back on its CPU, the new gen-1 on the first.
    later = [s for s in seen if s[0] == "at"][3:]
    if later:
        _, n3, trainer3, gens3 = later[0]
        assert n3 == 2 and trainer3 == {str(last)} and gens3["gen-1"] == {str(first)}
        kinds = [s[0] for s in seen]
        assert "prediction" in kinds, seen
        prediction = next(s[1] for s in seen if s[0] == "prediction")
        assert set(prediction.speeds) == {1, 2} and all(v and v > 0 for v in prediction.speeds.values()), prediction
    decisions = read_metrics(exp, "launcher", "elastic_decision")
    assert [d["target"] for d in decisions[:3]] == [3, 1, 2]
    # The real prediction on the finished run's last split (2 servers, the trainer on one CPU:
    # only a move to training fits), whether or not the run reached a third decision.
    final = SimpleNamespace(cfg=cfg, exp=exp, since=moves[1]["time"], servers=[None, None], trainer_cpus=(last,),
                            placement=placement, retired=[])
    after = [r for r in read_metrics(exp, "trainer", "step") if r["time"] >= final.since]
    assert len(after) >= 3, f"only {len(after)} training steps after the move back: raise STEPS"
    prediction = simulated_decision(final)
    assert set(prediction.speeds) == {1, 2} and all(v > 0 for v in prediction.speeds.values()), prediction
    assert prediction.target in (None, 1) and "calibrated on" in prediction.why

    # The controller retired the first gen-1 and caught the new one up to the version of the day.
    retired = read_metrics(exp, "controller", "server_retired")
    assert len(retired) == 1 and "paused (abort)" in retired[0]["detail"]
    new_url = json.loads(exp.service_file("gen-1").read_text())["url"]
    assert new_url.rstrip("/") != retired[0]["server"]
    # It registered out of rotation at version 0, and the first thing the controller did to it
    # brought it to the current version: its health check's catch-up, or, when a version was
    # published first, that version's sync (which takes every healthy server along).
    url = new_url.rstrip("/")
    first = next((r for r in read_metrics(exp, "controller")
                  if (r.get("event") == "catch_up" and r["server"] == url)
                  or (r.get("event") == "weight_sync" and url in [*r["updated"], *r["failed"]])), None)
    assert first is not None, "the controller never updated the new gen-1"
    assert (first["ok"] if first["event"] == "catch_up" else url in first["updated"]), first
    back = moves[1]["time"]
    served = [r for r in read_metrics(exp, "gen") if r.get("rank") == 1 and r["time"] > back and r.get("gen_requests")]
    assert served, "the new gen-1 served no request"

    # Nothing lost, nothing trained twice.
    result = audit(exp)
    assert result.steps == STEPS and result.trained == STEPS * cfg.trainer.groups_per_step
    assert result.lost == [] and result.trained_twice == [] and result.prompts_trained_twice == [], result.as_dict()
    assert json.loads((exp.root / "summary.json").read_text())["steps"] == STEPS
    assert leftovers(exp) == []
