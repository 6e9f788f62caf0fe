"""`tandem scale`'s parts that need no running experiment: the request and what is wrong with it,
the settings under which a run refuses it, the CPU set of a server added on the local backend,
the launcher refusing files it must not act on, the command's answers when no launcher takes the
request, and the sbatch options of a server that must avoid nodes. The whole path (a launcher
taking requests, servers joining and leaving a run) is tests/integration/e2e/test_scale_run.py
and tests/integration/slurm/test_slurm_scale.py."""
from __future__ import annotations

import json
import os
import time
from argparse import Namespace
from types import SimpleNamespace

import pytest

from tandem.launcher.backends.slurm import no_requeue
from tandem.launcher.backends.slurm_requests import excluding
from tandem.launcher.config import load_config
from tandem.launcher.placement import place_cpus
from tandem.launcher.roles import Role
from tandem.launcher.scale_requests import (
    ScaleRequest,
    answer_path,
    cmd_scale,
    scale_dir,
    wait_for_answer,
    write_request,
)
from tandem.launcher.scaling import Refused, Scaler, cpus_for_new, placement_with, refusal
from tandem.services.protocol import ExpDir


def eight_cpus(servers: int = 2):
    """8 CPUs given by hand: services 0, generation 1-5 (two servers: 1-3, 4-5), training 6-7."""
    return place_cpus(range(8), num_servers=servers, cores=[(c,) for c in range(8)])


@pytest.mark.parametrize(("fields", "said"), [
    ({}, "say exactly one of --add N, --remove N or --server NAME"),
    ({"add": 1, "remove": 1}, "(got add, remove)"),
    ({"add": 65}, "--add must be a whole number from 1 to 64"),
    ({"remove": -1}, "--remove must be a whole number"),
    ({"servers": ("trainer-0",)}, "--server takes generation server names such as gen-1"),
    ({"servers": ("gen-1", "gen-1")}, "names a server twice"),
    ({"remove": 1, "cpus": "3"}, "they go with --add"),
    ({"add": 1, "cpus": "3;rm"}, "--cpus must be a CPU list"),
    ({"add": 1, "exclude": "n1 n2"}, "--exclude takes node names"),
])
def test_a_request_names_what_is_wrong_with_it(fields, said):
    assert any(said in p for p in ScaleRequest(**fields).problems()), ScaleRequest(**fields).problems()


def test_a_request_file_round_trips_and_a_foreign_one_is_refused():
    req = ScaleRequest(add=2, cpus="4-7", exclude="gpu[01-02],gpu07")
    data = json.loads(json.dumps({**req.__dict__, "servers": []}))
    assert ScaleRequest.from_json(data) == req
    for bad, said in (({**data, "command": "rm -rf /"}, "unknown field(s) command"),
                      ({**data, "add": "2"}, "--add must be a whole number"), ([1], "a JSON object")):
        with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
            ScaleRequest.from_json(bad)


def test_runs_that_cannot_scale_say_why():
    def cfg(*overrides):
        return load_config(None, ["experiment.model=/m", "experiment.name=s", "experiment.exp_dir=/tmp/s", *overrides])
    assert refusal(cfg(), ScaleRequest(add=1)) is None
    assert refusal(cfg(), ScaleRequest(remove=1)) is None
    assert "launcher.elastic on" in refusal(cfg("launcher.elastic=true"), ScaleRequest(remove=1))
    assert "cannot be replayed" in refusal(cfg("trainer.weight_sync=broadcast"), ScaleRequest(add=1))
    assert refusal(cfg("trainer.weight_sync=broadcast"), ScaleRequest(remove=1)) is None   # leaving is fine
    assert "no GPU for another server" in refusal(cfg("gen.backend=sglang"), ScaleRequest(add=1))
    assert "names SLURM nodes" in refusal(cfg(), ScaleRequest(add=1, exclude="n1"))
    assert "places local servers" in refusal(cfg("launcher.backend=slurm"), ScaleRequest(add=1, cpus="1"))


def test_a_new_servers_cpus_come_from_the_request_its_slot_or_no_pool():
    p = eight_cpus()
    assert p.servers == ((1, 2, 3), (4, 5)) and p.train == (6, 7) and p.services == (0,)
    # Every CPU is in a pool: refused, naming --cpus.
    with pytest.raises(Refused, match="name the new server's CPUs with --cpus"):
        cpus_for_new(p, 2, (), {0, 1})
    # Asked: it may share a pool, and says with whom.
    cpus, note = cpus_for_new(p, 2, (5, 6), {0, 1})
    assert cpus == (5, 6) and note == "; it shares CPUs with gen-1, the trainer"
    with pytest.raises(Refused, match=r"CPU\(s\) 8-9 are not the run's"):
        cpus_for_new(p, 2, (8, 9), {0, 1})
    # gen-1 left: a server added takes slot 1 back with its CPUs, shared with nobody.
    assert cpus_for_new(p, 1, (), {0}) == ((4, 5), "")
    grown = placement_with(p, 2, (5, 6), {0, 1})
    assert grown.servers[2] == (5, 6) and grown.gen == (1, 2, 3, 4, 5, 6) and grown.cpus_for("gen-2") == (5, 6)
    # CPUs no pool uses are taken before asking (launcher.cpus left 7 out of every pool).
    spare = place_cpus(range(8), gen="1-5", train="6", services="0", cores=[(c,) for c in range(8)])
    assert cpus_for_new(spare, 1, (), {0}) == ((7,), "")


def _scaler(tmp_path, **cfg_overrides) -> Scaler:
    exp = ExpDir(tmp_path / "exp")
    cfg = load_config(None, ["experiment.model=/m", "experiment.name=s", "experiment.exp_dir=/tmp/s", *[f"{k}={v}" for k, v in cfg_overrides.items()]])
    roles = [Role(f"gen-{i}", ["x"], kind="gen", index=i, ready_file=f"gen-{i}") for i in range(2)]
    backend = SimpleNamespace(gen_host="127.0.0.1", pick_port=lambda: 1)
    return Scaler(cfg, exp, backend, roles, join=lambda *a: None, since=time.time())


def _answer(scaler: Scaler, req: ScaleRequest) -> dict:
    write_request(scaler.exp, req)
    scaler.tick()
    return json.loads(answer_path(scaler.exp, req.id).read_text())


def test_the_launcher_refuses_what_it_must_not_do_and_touches_nothing(tmp_path):
    """No controller and no backend here: every one of these requests is refused before either
    is used (a stand-in backend that cannot start anything proves it)."""
    scaler = _scaler(tmp_path)
    for req, said in ((ScaleRequest(servers=("gen-0", "gen-1")), "would leave generation with none"),
                      (ScaleRequest(servers=("gen-7",)), "gen-7 is not running (running: gen-0, gen-1)"),
                      (ScaleRequest(add=1, exclude="n1"), "names SLURM nodes"),
                      (ScaleRequest(add=3, cpus="1-2"), "fewer CPUs than the 3 servers")):
        answer = _answer(scaler, req)
        assert answer["done"] and answer["ok"] is False and said in answer["lines"][-1], answer
    assert sorted(scaler.servers) == [0, 1]
    # A link in place of a request (to a file the link's maker wrote) is not followed.
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"id": "1-ab", "remove": 1}))
    os.symlink(target, scale_dir(scaler.exp) / "request-1-ab.json")
    scaler.tick()
    answer = json.loads(answer_path(scaler.exp, "1-ab").read_text())
    assert answer["ok"] is False and "refused" in answer["lines"][-1] and sorted(scaler.servers) == [0, 1]


def test_an_earlier_launchs_requests_are_cleared_this_launchs_kept(tmp_path):
    exp = ExpDir(tmp_path / "exp")
    old, new = ScaleRequest(add=1), ScaleRequest(remove=1)
    old_path = write_request(exp, old)
    os.utime(old_path, (time.time() - 60, time.time() - 60))
    new_path = write_request(exp, new)
    Scaler(load_config(None, ["experiment.model=/m", "experiment.name=s", "experiment.exp_dir=/tmp/s"]), exp, SimpleNamespace(), [], join=lambda *a: None,
           since=time.time() - 30)
    assert not old_path.exists() and new_path.exists()


def test_the_command_refuses_without_a_launch_and_withdraws_an_untaken_request(tmp_path, capsys):
    exp = ExpDir(tmp_path / "exp")
    args = Namespace(exp_dir=str(exp.root), add=1, remove=None, server=None, cpus=None, exclude=None, timeout=5.0)
    assert cmd_scale(args) == 2 and "holds no experiment" in capsys.readouterr().err
    assert cmd_scale(Namespace(**{**vars(args), "remove": 1})) == 2
    assert "say exactly one of" in capsys.readouterr().err
    req = ScaleRequest(add=1)
    path = write_request(exp, req)
    assert wait_for_answer(exp, req, path, timeout_s=0.5) == 2 and not path.exists()
    assert "no launcher took the request" in capsys.readouterr().err


def test_a_server_that_must_avoid_nodes_says_so_to_sbatch():
    assert excluding("", "n1") == "n1" and excluding("gpu[01-02]", "n1", "") == "gpu[01-02],n1"
    assert no_requeue({}, "n1") == {"no_requeue": True, "exclude": "n1"}
    assert no_requeue({"exclude": "bad7"}, "n1") == {"no_requeue": True, "exclude": "bad7,n1"}
    assert no_requeue({"requeue": True}) == {"requeue": True}


def test_a_server_resubmitted_after_its_node_failed_avoids_that_node(tmp_path):
    """Stand-ins for SLURM (no cluster in the unit tier): the job's state as sacct would report a
    lost node, and a submit that records the request instead of calling sbatch. What is tested is
    the backend's decision: a restartable role's job that ended NODE_FAIL is resubmitted with that
    node excluded, on top of the nodes its request already avoided; another end is resubmitted as
    it was."""
    from tandem.launcher.backends.slurm import SlurmBackend, Submitted
    from tandem.launcher.backends.slurm_requests import JobRequest
    from tandem.launcher.slurm_jobs import JobState

    cfg = load_config(None, ["experiment.model=/m", "experiment.name=s", f"experiment.exp_dir={tmp_path / 'exp'}",
                             "launcher.backend=slurm", "launcher.slurm.on_failure=resubmit",
                             "launcher.slurm.launcher_lease_s=0"])
    backend = SlurmBackend(cfg, ExpDir(tmp_path / "exp"))
    role = Role("gen-0", ["x"], kind="gen", restart=True)
    submitted = []
    backend.run.submit = lambda req: submitted.append(req) or Submitted(req, "2")
    backend.run.wait_ready = lambda names: None
    for state, before, after in ((JobState("1", "NODE_FAIL", nodes="gpu-017"), "gpu-003", "gpu-003,gpu-017"),
                                 (JobState("1", "PREEMPTED", nodes="gpu-017"), "", "")):
        backend.run.jobs = {"gen-0": Submitted(JobRequest(role, exclude=before), "1")}
        backend.run.states = lambda names=None, s=state: {"gen-0": s}
        (end,) = backend.ended()
        assert end.restarted and submitted[-1].exclude == after, (state, submitted[-1])
