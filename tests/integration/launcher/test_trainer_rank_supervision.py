"""The local backend's supervision of a several-rank trainer, with STAND-IN ranks.

The ranks are `standin_rank.py` (not the trainer: it records its torch.distributed variables,
announces services/trainer.json from rank 0 and then finishes, dies or waits as told), so these
runs take seconds; everything else is real — the lifecycle (`run_experiment`), the local backend
and supervisor, one process group per rank, signals. The real trainer's ranks train in
tests/integration/e2e/test_multi_rank_run.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.faults import as_terminal_foreground
from tandem.launcher.backends.local import LocalBackend
from tandem.launcher.config import load_config
from tandem.launcher.launcher_watch import stat_fields
from tandem.launcher.lifecycle import run_experiment
from tandem.launcher.roles import Role
from tandem.services.protocol import ExpDir

pytestmark = pytest.mark.timeout(120)
STANDIN = Path(__file__).with_name("standin_rank.py")
REPO = Path(__file__).resolve().parents[3]
WORLD = 3


def _setup(tmp_path: Path, mode: str):
    exp = ExpDir(tmp_path / "exp")
    exp.root.mkdir(parents=True)
    # Unpinned: on a 2-CPU machine the plan has no 3 disjoint training CPUs (pinning is tested
    # by the real run); the ranks' count is the CPU miniature's key. No preloading server: a
    # stand-in is a script, not `python -m`, which it never forks (each rank starts fresh either
    # way), and its import of torch and transformers cost every launch here ~5 CPU-seconds. (DRIVER's
    # launches likewise.)
    cfg = load_config(None, ["experiment.name=ranks", f"experiment.exp_dir={exp.root}", "experiment.model=/m",
                             "launcher.cpus.pin=false", f"launcher.cpus.trainer_ranks={WORLD}",
                             "experiment.trackers=[jsonl]", "launcher.fork_roles=false"])
    role = Role("trainer-0", [sys.executable, str(STANDIN), str(exp.root), mode], kind="trainer",
                ready_file="trainer")
    return cfg, exp, role


def _ranks(exp: ExpDir) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in (exp.root / "ranks").glob("*.json")}


def _ends(exp: ExpDir) -> dict[int, str]:
    return {int(p.stem): json.loads(p.read_text()) for p in (exp.root / "ranks").glob("*.end")}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def test_the_run_waits_for_every_rank_and_each_gets_torch_distributed_variables(tmp_path):
    cfg, exp, role = _setup(tmp_path, "finish")
    assert run_experiment(cfg, exp, False, LocalBackend(cfg, exp), roles=[role], join=None) == 0
    # Finished only once every rank exited 0: rank 0 left at once, the others a second later.
    assert _ends(exp) == {r: "finished" for r in range(WORLD)}
    ranks = _ranks(exp)
    assert [ranks[r]["RANK"] for r in range(WORLD)] == ["0", "1", "2"]
    assert all(v["LOCAL_RANK"] == v["RANK"] and v["WORLD_SIZE"] == v["LOCAL_WORLD_SIZE"] == str(WORLD)
               for v in ranks.values())
    # One rendezvous file in the launch's private directory, not a TCP store anyone could reach;
    # the ranks' own connections on loopback.
    store = {v["TANDEM_STORE_FILE"] for v in ranks.values()}
    assert len(store) == 1 and Path(next(iter(store))).parent == Path(ranks[0]["TANDEM_IPC_DIR"])
    assert {v["MASTER_PORT"] for v in ranks.values()} == {None}
    assert {v["GLOO_SOCKET_IFNAME"] for v in ranks.values()} == {"lo"}
    # one console per rank, named as SLURM's tasks name theirs
    assert sorted(p.name for p in exp.logs.glob("trainer-*.console")) == [f"trainer-{r}.console" for r in range(WORLD)]


def test_one_rank_that_dies_fails_the_run_and_every_other_rank_is_stopped(tmp_path, capsys):
    cfg, exp, role = _setup(tmp_path, "die")
    assert run_experiment(cfg, exp, False, LocalBackend(cfg, exp), roles=[role], join=None) == 1
    err = capsys.readouterr().err
    assert "trainer-1 exited with status 3" in err, err
    assert _ends(exp) == {0: "SIGTERM", 1: "died", 2: "SIGTERM"}
    assert not any(_alive(v["pid"]) for v in _ranks(exp).values())


# The launcher of the Ctrl-C test: `_setup`'s run (mode wait) in a process of its own, as `tandem run` is.
DRIVER = """
import sys
from tandem.launcher.backends.local import LocalBackend
from tandem.launcher.config import load_config
from tandem.launcher.lifecycle import run_experiment
from tandem.launcher.roles import Role
from tandem.services.protocol import ExpDir
exp = ExpDir(sys.argv[1])
exp.root.mkdir(parents=True)
cfg = load_config(None, ["experiment.name=ranks", f"experiment.exp_dir={exp.root}", "experiment.model=/m",
                         "launcher.cpus.pin=false", f"launcher.cpus.trainer_ranks={sys.argv[3]}",
                         "experiment.trackers=[jsonl]", "launcher.fork_roles=false", *sys.argv[5:]])
role = Role("trainer-0", [sys.executable, sys.argv[2], str(exp.root), sys.argv[4]], kind="trainer", ready_file="trainer")
sys.exit(run_experiment(cfg, exp, False, LocalBackend(cfg, exp), roles=[role], join=None))
"""


_LAUNCHED: list[subprocess.Popen] = []   # the launchers the tests started


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """A test that fails before its launcher has stopped (one did, on a stand-in's half-written
    file) would leave the launcher and its waiting ranks (each in a session of its own) running
    for the rest of the suite: a launcher still running at the test's end is killed with all its
    descendants. (One already reaped is left alone: its pid may be another process's now.)"""
    yield
    while _LAUNCHED:
        launcher = _LAUNCHED.pop()
        if launcher.poll() is not None:
            continue
        parents = {}
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                parents[int(pid)] = int(stat_fields(pid)[1])
            except (OSError, IndexError, ValueError):
                pass
        tree = [launcher.pid]
        for pid in tree:
            tree += [child for child, parent in parents.items() if parent == pid]
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        launcher.wait()


def _launch_and_interrupt(tmp_path: Path, mode: str, *overrides: str) -> tuple[subprocess.Popen, ExpDir, Path]:
    """DRIVER's run in its own process; once every rank is up, Ctrl-C (SIGINT) of the launcher."""
    exp, log = ExpDir(tmp_path / "exp"), tmp_path / "launcher.out"
    tmp_path.mkdir(exist_ok=True)
    launcher = subprocess.Popen([sys.executable, "-c", DRIVER, str(exp.root), str(STANDIN), str(WORLD), mode,
                                 *overrides], cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, preexec_fn=as_terminal_foreground)
    _LAUNCHED.append(launcher)
    deadline = time.monotonic() + 60
    while len(_ranks(exp)) < WORLD or not exp.service_file("trainer").exists():
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    time.sleep(1.5)   # the run is up (the lifecycle's watch)
    os.kill(launcher.pid, signal.SIGINT)
    return launcher, exp, log


def test_ctrl_c_of_the_launcher_leaves_no_rank_behind(tmp_path):
    launcher, exp, log = _launch_and_interrupt(tmp_path, "wait")
    assert launcher.wait(timeout=60) == 130, log.read_text()
    assert _ends(exp) == {r: "SIGTERM" for r in range(WORLD)}
    assert not any(_alive(v["pid"]) for v in _ranks(exp).values())


def test_ctrl_c_gives_the_trainer_time_to_save_and_a_second_one_kills_at_once(tmp_path):
    """A trainer's stop (its step, its last checkpoint) outlasts the other roles' grace:
    `launcher.trainer_stop_s` is its own. Ranks that take 3 s to save all save within 60 s, and
    are killed mid-save with 1 s; ranks that would take ten minutes are killed by a second
    Ctrl-C, at once, and nothing is left running."""
    for stop_s, ended in ((60, "saved"), (1, "saving")):
        launcher, exp, log = _launch_and_interrupt(tmp_path / str(stop_s), "save:3", f"launcher.trainer_stop_s={stop_s}")
        assert launcher.wait(timeout=60) == 130, log.read_text()
        assert _ends(exp) == {r: ended for r in range(WORLD)}, log.read_text()
        assert "stopping the trainer: it saves a checkpoint first" in log.read_text()

    launcher, exp, log = _launch_and_interrupt(tmp_path / "hang", "save:600", "launcher.trainer_stop_s=600")
    deadline = time.monotonic() + 30
    while set(_ends(exp).values()) != {"saving"} or len(_ends(exp)) < WORLD:
        assert time.monotonic() < deadline, (_ends(exp), log.read_text())
        time.sleep(0.1)
    os.kill(launcher.pid, signal.SIGINT)
    assert launcher.wait(timeout=60) == 130, log.read_text()
    assert _ends(exp) == {r: "saving" for r in range(WORLD)}     # killed mid-save
    assert not any(_alive(v["pid"]) for v in _ranks(exp).values())
