"""Every shell command of README.md and docs/*.md runs, as written, in a copy of the checkout.

The commands are read from the docs' fenced blocks (tests/support/doc_commands.py), so a doc
that drifts from the code fails here. They run in document order, README.md first, in one
scratch copy of the checkout (tracked files and the work in progress, no `.cache/`, no
`runs/`: what a fresh clone has) with the project's `.venv` linked in and first on `PATH`, as
after `source .venv/bin/activate`; `TANDEM_*` variables are cleared so configs resolve as on a
new machine. Each must exit 0.

What cannot run here is marked in the doc, next to the block, and listed by this test with the
reason (a real SLURM cluster, a package index, the whole suite); long runs are shortened by
marked arguments appended to the same command line (one training step of `make train-math`
instead of 200). The unit tier (tests/unit/foundation/test_doc_command_blocks.py) checks the
markers, that every `tandem` command line parses and every `make` target exists, skipped ones
included. docs/cluster.md's local-cluster block is run by tests/integration/slurm/test_slurm_e2e.py.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from doc_commands import REPO, command_blocks

pytestmark = pytest.mark.timeout(1200)
COMMAND_TIMEOUT_S = 600
READY_TIMEOUT_S = 180
# Not copied: what `make`, a run or a tool makes (a fresh clone has none of it).
LEFT_OUT = {".git", ".venv", ".cache", "runs", "build", ".pytest_cache", ".ruff_cache", ".hypothesis",
            ".wheelhouse", "__pycache__", "tandem.egg-info"}
DOCS = list(dict.fromkeys(b.path for b in command_blocks()))


def _copy_checkout(dst: Path) -> None:
    def ignore(directory, names):
        rel = Path(directory).relative_to(REPO)
        return [n for n in names if n in LEFT_OUT or n.endswith(".egg-info") or (rel / n).as_posix() == "benchmarks/runs"]
    shutil.copytree(REPO, dst, ignore=ignore, symlinks=True)
    (dst / ".venv").symlink_to(REPO / ".venv")
    # `make` targets depend on `install`, which reinstalls when setup.cfg is newer than the venv's
    # stamp: in this copy that would point the shared venv's editable install here.
    for name in ("setup.cfg", "pyproject.toml"):
        os.utime(dst / name, (0, 0))


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if not (REPO / ".venv" / ".tandem-installed").exists():
        pytest.skip("the .venv was not made by `make install`: `make` targets would reinstall it")
    dst = tmp_path_factory.mktemp("doc-commands") / "tandem"
    _copy_checkout(dst)
    return dst


def _env(clone: Path) -> dict:
    # MAKEFLAGS & co: under `make test PYTEST_ARGS=...` they carry the caller's variables into the
    # docs' own `make` commands (their `make test-gpu` ran with the caller's pytest arguments).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TANDEM_", "PYTEST_")) and k not in ("VIRTUAL_ENV", "PYTHONPATH", "MAKEFLAGS",
                                                                     "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    env["PATH"] = f"{clone / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


def _start_background(command: str, ready: str, clone: Path, log: Path) -> subprocess.Popen:
    out = log.open("w")
    proc = subprocess.Popen(["bash", "-c", command], cwd=clone, env=_env(clone), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"`{command}` never said {ready!r} (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def _run(command: str, clone: Path, where: str) -> None:
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=_env(clone), capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    assert proc.returncode == 0, (f"{where}: `{command}` exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_the_docs_commands_run_as_written(doc, clone, capsys):
    ran, skipped = [], []
    for block in (b for b in command_blocks() if b.path == doc):
        whole = next((r.arg for r in block.rules if r.kind == "skip" and r.prefix is None), None)
        background = []
        try:
            for i, cmd in enumerate(block.commands()):
                reason = whole or cmd.skip
                if reason:
                    skipped.append(f"{block.where}: `{cmd.text}`: {reason}")
                    continue
                form = cmd.run_form(block.rules)
                t0 = time.monotonic()
                if cmd.background:
                    log = clone.parent / f"{doc.stem}-{block.line}-{i}.log"
                    background.append(_start_background(form, cmd.background, clone, log))
                else:
                    _run(form, clone, block.where)
                ran.append(f"{block.where}: `{form}` ({time.monotonic() - t0:.0f} s)")
        finally:
            for proc in background:
                _stop(proc)
    with capsys.disabled():
        print(f"\n{doc.relative_to(REPO)}: ran {len(ran)}, skipped {len(skipped)}")
        for line in ran:
            print(f"  ran {line}")
        for line in skipped:
            print(f"  skipped {line}")
    assert ran or skipped
