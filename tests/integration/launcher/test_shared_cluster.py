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
  writes nothing, and a non-member still reads nothing;
- holding idle connections to every port the run listens on (1,100 each, reopened as they are
  closed, for the whole run: once enough to use up a role's 1,024 descriptors): the run trains
  to its end. Nothing of the run listens beyond loopback, and its ZeroMQ services are Unix
  sockets in a directory the other user cannot enter.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from real_users import OTHER, VICTIM, as_user, run_as, user_home, why_not

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
def scratch():
    """A shared scratch directory (mode 1777, like /tmp) and a tiny model everyone may read: in
    /tmp itself, not in pytest's base directory, which only root may enter (and which another
    pytest session closes again as it starts)."""
    root = Path(tempfile.mkdtemp(prefix="tandem-shared-cluster-", dir="/tmp"))
    os.chmod(root, 0o755)
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


FLOOD = r"""
import os, resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
stop, ports_file, holding = sys.argv[1:4]
while not os.path.exists(ports_file):
    if os.path.exists(stop):
        sys.exit(0)
    time.sleep(0.05)
ports = [int(p) for p in open(ports_file).read().split()]
held = {p: [] for p in ports}
opened = most = 0
while not os.path.exists(stop):
    for p in ports:
        while len(held[p]) < 1100 and not os.path.exists(stop):
            try:
                held[p].append(socket.create_connection(("127.0.0.1", p), timeout=0.2))
                opened += 1
            except OSError:
                break
    most = max(most, sum(map(len, held.values())))
    if most and not os.path.exists(holding):
        open(holding, "w").close()
    time.sleep(0.2)
    for p in ports:   # what the server closed is opened again
        kept = []
        for c in held[p]:
            c.setblocking(False)
            try:
                gone = c.recv(1) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                c.close()
            else:
                kept.append(c)
        held[p] = kept
print(opened, most)
"""


def _listening(uid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the processes of `uid` listen on."""
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                addr, port = f[1].split(":")
                shown = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if width == 8 else addr
                out.add((shown, int(port, 16)))
    return out


STEPS = 12


def _pids(uid: int) -> list[str]:
    """The processes of `uid` that are `tandem` (python) roles."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid and b"tandem" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def test_a_run_is_its_users_alone_whatever_the_umask_and_its_sockets_out_of_reach(scratch):
    """One run of the victim's, under umask 002 (group-writable by default), with the other
    user's flood on its ports while it trains; once it has ended, nothing of it is anyone
    else's to read or write."""
    scratch, config = scratch
    run = scratch / "flooded-run"
    home = user_home(scratch.parent, VICTIM)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}
    launcher = subprocess.Popen(as_user([sys.executable, "-m", "tandem.launcher.cli", "run", str(config),
                                         f"experiment.exp_dir={run}", f"trainer.total_steps={STEPS}"], VICTIM,
                                        umask=0o002),
                                cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    other_home = user_home(scratch.parent, OTHER)
    stop, ports_file, holding = (other_home / name for name in ("stop-flood", "ports", "flood-holding"))
    flood = subprocess.Popen(as_user([sys.executable, "-c", FLOOD, str(stop), str(ports_file), str(holding)], OTHER),
                             env={**env, "HOME": str(other_home)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((run / "services" / f"{r}.json").exists() for r in ("trainer", "gen-0")):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()[-3000:]
            time.sleep(0.2)
        ports = _listening(VICTIM)
        assert ports and {a for a, _ in ports} == {"127.0.0.1"}, ports        # nothing beyond loopback
        ports_file.write_text(" ".join(str(p) for _, p in ports))
        os.chmod(ports_file, 0o644)
        addresses = [json.loads((run / "services" / f"{r}.json").read_text()) for r in ("controller", "reward")]
        assert all(a["address"].startswith("ipc://") for a in addresses), addresses
        ipc = Path(addresses[0]["address"].removeprefix("ipc://"))
        assert stat.S_IMODE(ipc.parent.stat().st_mode) == 0o700 and ipc.parent.stat().st_uid == VICTIM
        reach = run_as([sys.executable, "-c", "import socket, sys; s = socket.socket(socket.AF_UNIX); "
                        "s.connect(sys.argv[1])", str(ipc)], OTHER, user_home(scratch.parent, OTHER))
        assert reach.returncode != 0 and "PermissionError" in reach.stderr, reach.stderr
        while not holding.exists():   # the flood holds connections on every port before training starts
            assert flood.poll() is None and time.monotonic() < deadline, flood.stderr.read()[-2000:]
            time.sleep(0.05)
        # Whatever the flood holds, each role can open files up to its hard limit (not the 1,024
        # such a flood used up), and the server closes connections before that (its cap).
        for pid in _pids(VICTIM):
            limits = Path(f"/proc/{pid}/limits").read_text()
            soft, hard = next(line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files"))
            assert soft == hard, (pid, limits)
        out, _ = launcher.communicate(timeout=400)
    finally:
        stop.touch()
        if launcher.poll() is None:
            launcher.kill()
        opened, err = flood.communicate(timeout=60)
    assert launcher.returncode == 0, out[-4000:]
    assert f"step {STEPS}/{STEPS}" in out, out[-3000:]
    assert flood.returncode == 0 and int(opened.split()[0]) > 0, err[-2000:]

    # The run is its user's alone, whatever the umask.
    everything = [run, *run.rglob("*")]
    loose = [f"{p} {stat.S_IMODE(p.lstat().st_mode):04o}" for p in everything
             if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077]
    assert loose == [], loose
    assert {p.lstat().st_uid for p in everything} == {VICTIM}
    targets = [run / "config.yaml", run / "checkpoints" / f"step-{STEPS}" / "rank-0.pt", run / "metrics.jsonl",
               run / "logs", run / "launcher.lock", run / "keys"]
    assert all(p.exists() for p in targets), [p for p in targets if not p.exists()]
    assert set(probe(OTHER, scratch, READ_PROBE, targets).values()) == {"DENIED"}
    assert set(probe(OTHER, scratch, WRITE_PROBE, [run, *targets]).values()) == {"DENIED"}
