"""CPU pinning of started roles: the local supervisor pins a real role and sizes its threads, and
`tandem` pins itself from the environment (read back from /proc).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.launcher.config import load_config
from tandem.launcher.placement import (
    format_ranges,
    place_cpus,
)


def _status_field(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {name} in /proc/{pid}/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses sched_setaffinity")
@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "forked"])
def test_supervisor_pins_a_started_role_and_sizes_its_threads(tmp_path, forked):
    """Start a real role under the name of generation server 0 (the supervisor places by name; a
    controller starts in a second where a server would load a model): /proc shows it pinned to
    the generation pool — not the light services' CPU the launcher itself moved to, which it
    would inherit unpinned — every thread of it, with TANDEM_THREADS and OMP_NUM_THREADS to match;
    whether started fresh or forked from the preloading server (launcher/backends/role_forks.py)."""
    from tandem.launcher.backends.local import LocalSupervisor
    from tandem.launcher.config import save_resolved
    from tandem.launcher.roles import Role, tandem_argv
    from tandem.services.protocol import ExpDir, generate_keys

    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs 2 CPUs to tell a pinned process from an unpinned one")
    before = os.sched_getaffinity(0)
    exp = ExpDir(tmp_path / "exp")
    cfg = load_config("configs/math-tiny.yaml", [f"experiment.exp_dir={exp.root}"])
    save_resolved(cfg, exp.root)
    generate_keys(exp.keys)
    services = mine[-1]
    placement = place_cpus(mine, gen=format_ranges(mine[:-1]), train=str(mine[-1]), services=str(services))
    sup = LocalSupervisor(exp, placement, fork_roles=forked)
    try:
        assert os.sched_getaffinity(0) == {services}  # the launcher runs with the light services
        child = sup.start(Role("gen-0", tandem_argv("controller", "--exp", str(exp.root)), kind="gen", threads=7,
                               ready_file="controller", ready_timeout_s=120))
        pid = child.proc.pid
        assert isinstance(child.proc, subprocess.Popen) != forked
        gen = format_ranges(mine[:-1])
        assert _status_field(pid, "Cpus_allowed_list") == gen
        for task in Path(f"/proc/{pid}/task").iterdir():  # ZeroMQ's threads too
            assert (task / "status").read_text().count(f"Cpus_allowed_list:\t{gen}\n") == 1
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        # Threads follow the set, whatever the spec asked for; the set is named for `tandem`.
        n = str(len(mine) - 1)
        assert (env["TANDEM_THREADS"], env["OMP_NUM_THREADS"], env["TANDEM_CPUS"]) == (n, n, gen)
    finally:
        sup.stop()
    assert os.sched_getaffinity(0) == before  # given back
    report = json.loads((exp.root / "role_cpu.json").read_text())
    assert "gen-0" in report["cpu_seconds"] and report["placement"]["services"] == str(services)
    records = [json.loads(line) for line in exp.metrics.read_text().splitlines()]
    assert any(r.get("event") == "cpu_placement" and r["gen"] == format_ranges(mine[:-1]) for r in records)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses sched_setaffinity")
def test_tandem_pins_itself_from_the_environment(tmp_path):
    """`tandem` applies $TANDEM_CPUS before it runs a command (what a role does first)."""
    import subprocess
    cpu = sorted(os.sched_getaffinity(0))[-1]
    code = ("import os, sys; from tandem.launcher.placement import pin_from_env; pin_from_env(); "
            "print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TANDEM_CPUS": str(cpu)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{cpu}]"
    bad = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "config", "check", "configs/math-tiny.yaml"],
                         env={**os.environ, "TANDEM_CPUS": "4096"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot pin this process to CPU(s) 4096" in bad.stderr
