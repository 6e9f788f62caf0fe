"""A run on a machine other users share (issue 68): two real local users, a victim who launches
runs and another user who tries to take one over or read it, as on a cluster's shared scratch.

Both are ordinary users (tests/support/real_users.py: real uids, no capabilities), in a scratch
directory that, like /tmp or /scratch, everyone may write and that is sticky. What the other
user tries, and what must hold:
- making the experiment directory first (with a symlinked `launcher.lock` to a file of the
  victim's and a `config.yaml` of their own in it): the launch is refused before it writes
  anything, naming the owner; the victim's file is untouched;
- reading a finished run (config, checkpoint, metrics, logs) or holding its lock: nothing opens,
  even though the victim's umask is 002 (group-writable by default);
- with `experiment.group_access: true`, a member of the victim's group reads the checkpoint but
  writes nothing, and a non-member still reads nothing.
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
from real_users import OTHER, VICTIM, run_as, user_home, why_not

from tandem.rollout.tiny_model import init_tiny

pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
READ_PROBE = r"""
import os, sys
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        print("READ", path)
    except PermissionError:
        print("DENIED", path)
"""
WRITE_PROBE = r"""
import os, sys
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            open(os.path.join(path, "planted"), "w").close()
        else:
            open(path, "ab").close()
        print("WROTE", path)
    except PermissionError:
        print("DENIED", path)
"""


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A shared scratch directory (mode 1777, like /tmp) and a tiny model everyone may read."""
    root = Path(tmp_path_factory.mktemp("shared-cluster", numbered=True))
    os.chmod(root, 0o755)
    for parent in root.parents:   # pytest's own base is root's alone: let the users through
        if parent == Path("/tmp"):
            break
        os.chmod(parent, os.stat(parent).st_mode | 0o011)
    scratch = root / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)
    model = root / "model"
    init_tiny(model, seed=0)
    for p in [model, *model.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    config = root / "exp.yaml"
    config.write_text(f"""
experiment: {{name: shared, model: {model}}}
controller: {{max_staleness: 1, lease_s: 20}}
gen: {{num_servers: 1, threads: 1}}
rollout: {{dataset: "synthetic:math", n_samples: 2, max_new_tokens: 16, concurrency: 4, heartbeat_s: 1.0}}
reward: {{task: math, num_workers: 1}}
trainer: {{groups_per_step: 2, total_steps: 1, checkpoint_every: 1, max_tokens_per_mb: 4096}}
""")
    os.chmod(config, 0o644)
    yield scratch, config
    shutil.rmtree(root, ignore_errors=True)


def tandem_as(uid: int, scratch: Path, *args: str, **kw):
    return run_as([sys.executable, "-m", "tandem.launcher.cli", *args], uid, user_home(scratch.parent, uid),
                  cwd=scratch, **kw)


def probe(uid: int, scratch: Path, script: str, paths: list[Path], **kw) -> dict[str, str]:
    out = run_as([sys.executable, "-c", script, *map(str, paths)], uid, user_home(scratch.parent, uid), **kw)
    assert out.returncode == 0, out.stderr[-2000:]
    return {line.split(" ", 1)[1]: line.split(" ", 1)[0] for line in out.stdout.splitlines()}


def test_a_directory_another_user_made_first_is_refused_before_anything_is_written(scratch):
    scratch, config = scratch
    victims = user_home(scratch.parent, VICTIM) / "notes.txt"
    victims.write_text("the victim's own file")
    os.chown(victims, VICTIM, VICTIM)
    trap = scratch / "trap"
    plant = (f"import os; os.mkdir({str(trap)!r}); os.chmod({str(trap)!r}, 0o777); "
             f"os.symlink({str(victims)!r}, {str(trap / 'launcher.lock')!r}); "
             f"open({str(trap / 'config.yaml')!r}, 'w').write('experiment: {{name: theirs}}')")
    made = run_as([sys.executable, "-c", plant], OTHER, user_home(scratch.parent, OTHER))
    assert made.returncode == 0, made.stderr
    out = tandem_as(VICTIM, scratch, "run", str(config), f"experiment.exp_dir={trap}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"experiment.exp_dir: {trap} belongs to uid {OTHER}, not to you (uid {VICTIM})" in out.stderr, out.stderr
    assert victims.read_text() == "the victim's own file"
    assert sorted(p.name for p in trap.iterdir()) == ["config.yaml", "launcher.lock"]   # nothing written

    open_dir = scratch / "open"   # the victim's own, but open to everyone
    opened = run_as([sys.executable, "-c", f"import os; os.mkdir({str(open_dir)!r}, 0o777); "
                                           f"os.chmod({str(open_dir)!r}, 0o777)"], VICTIM, victims.parent)
    assert opened.returncode == 0, opened.stderr
    out = tandem_as(VICTIM, scratch, "run", str(config), f"experiment.exp_dir={open_dir}")
    assert out.returncode == 2 and f"is open to other users (mode 0777): chmod 700 {open_dir}" in out.stderr, out.stderr


def test_a_run_is_its_users_alone_whatever_the_umask(scratch):
    scratch, config = scratch
    run = scratch / "private-run"
    out = tandem_as(VICTIM, scratch, "run", str(config), f"experiment.exp_dir={run}", umask=0o002)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    everything = [run, *run.rglob("*")]
    loose = [f"{p} {stat.S_IMODE(p.lstat().st_mode):04o}" for p in everything
             if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077]
    assert loose == [], loose
    assert {p.lstat().st_uid for p in everything} == {VICTIM}
    targets = [run / "config.yaml", run / "checkpoints" / "step-1" / "rank-0.pt", run / "metrics.jsonl",
               run / "logs", run / "launcher.lock", run / "keys"]
    assert all(p.exists() for p in targets), [p for p in targets if not p.exists()]
    assert set(probe(OTHER, scratch, READ_PROBE, targets).values()) == {"DENIED"}
    assert set(probe(OTHER, scratch, WRITE_PROBE, [run, *targets]).values()) == {"DENIED"}


def test_group_access_lets_the_group_read_and_nobody_else_write(scratch):
    scratch, config = scratch
    run = scratch / "group-run"
    out = tandem_as(VICTIM, scratch, "run", str(config), f"experiment.exp_dir={run}", "experiment.group_access=true",
                    umask=0o002)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    checkpoint = run / "checkpoints" / "step-1" / "rank-0.pt"
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o640 and stat.S_IMODE(run.stat().st_mode) == 0o750
    member = {"gid": OTHER, "groups": (VICTIM,)}
    assert probe(OTHER, scratch, READ_PROBE, [checkpoint, run / "metrics.jsonl"], **member) == \
        {str(checkpoint): "READ", str(run / "metrics.jsonl"): "READ"}
    assert set(probe(OTHER, scratch, WRITE_PROBE, [run, checkpoint, checkpoint.parent], **member).values()) == {"DENIED"}
    assert probe(OTHER, scratch, READ_PROBE, [run / "keys"], **member) == {str(run / "keys"): "DENIED"}
    assert set(probe(OTHER, scratch, READ_PROBE, [checkpoint, run / "config.yaml"]).values()) == {"DENIED"}
