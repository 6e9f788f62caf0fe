"""What `pip install .` puts in site-packages: the package `tandem` and its dist-info, nothing else
(five packages named launcher, services, trainer, rollout and reward there once shadowed a user's
own `reward.py`, and were shadowed by it). The wheel is built from a copy of the checkout's
tracked files with this environment's setuptools (no index) and installed with no dependencies
into a fresh virtual environment, whose files the test then reads."""
from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _copy_tracked(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dst / name)


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-index"],
                          cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_pip_install_puts_only_tandem_at_the_top_of_site_packages(tmp_path):
    src, wheels, env = tmp_path / "src", tmp_path / "wheels", tmp_path / "env"
    _copy_tracked(src)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), ".", cwd=src)
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    _pip("--python", str(python), "install", "--no-deps", *map(str, wheels.glob("tandem-*.whl")), cwd=tmp_path)

    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    top = sorted(p.name for p in site.iterdir() if p.name != "__pycache__")
    assert [n for n in top if not n.startswith("tandem-")] == ["tandem"], top
    assert [n for n in top if n.startswith("tandem-")] == ["tandem-0.1.0.dist-info"], top
    installed = site / "tandem"
    for module in ("launcher/cli.py", "services/protocol/codec.py", "trainer/loop.py", "rollout/worker.py",
                   "reward/extract.py", "experiment.py", "runs.py"):
        assert (installed / module).is_file(), module
    assert "tandem = tandem.launcher.cli:entry" in (site / "tandem-0.1.0.dist-info" / "entry_points.txt").read_text()

    # From another directory the old names are gone and the new ones are the installed files.
    probe = ("import importlib.util, tandem.reward.extract as e\n"
             "print(e.__file__)\n"
             "print([n for n in ('launcher', 'services', 'trainer', 'rollout', 'reward') if importlib.util.find_spec(n)])")
    out = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    where, old = out.splitlines()
    assert Path(where) == installed / "reward" / "extract.py" and old == "[]", out


def test_importing_a_role_module_does_not_load_the_api():
    """Every role imports tandem.<package>, which runs tandem/__init__.py first: the API (and the
    launcher under it) loads only when used, so a role starts as fast as before."""
    code = ("import sys, tandem.services.protocol, tandem.reward.extract\n"
            "print(sorted(m for m in sys.modules if m.startswith(('tandem.launcher', 'tandem.experiment'))))\n"
            "import tandem\n"
            "tandem.Experiment\n"
            "print('tandem.launcher.config' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "True"], out
