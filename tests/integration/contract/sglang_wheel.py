"""The pinned SGLang release as a test oracle: find the pin, fetch the wheel, run the oracle on it.

The pin lives in one place, the `gpu` extra of `setup.cfg` (`sglang==X`). The wheel is
fetched with `pip download --no-deps sglang==X` into `.cache/sglang-wheel/` (gitignored) and
reused between runs. Nothing of it is unpacked: the oracle imports SGLang's pure-Python modules
straight from the wheel (a wheel is a zip; Python's zipimport reads `.py` files from it) and
reads the files it parses with `ast` from the zip too, so only the files an import or a check
touches are ever read.

Importing `sglang.srt.server_args` (the argv check) and `sglang.srt.utils` (auth, the msgspec →
pydantic schema bridge) pulls a few small pure-Python packages the project does not install;
they go into `.cache/sglang-wheel/deps-<X>/` with `pip install --no-deps --target` (about 5 MB,
a few seconds). The oracle runs in a process of its own so none of this — nor SGLang's Triton
import stub, see `sglang_oracle.py` — ever enters the test process.

Skips: only when the package registry cannot be reached (the index does not answer at all).
Any other failure — no such release, a corrupt download, pip refusing — fails the test.
"""
from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import process_starts

REPO = Path(__file__).resolve().parents[3]
CACHE = REPO / ".cache" / "sglang-wheel"
# Imported at module level by sglang.srt.utils.common / server_args and not in the project's
# own requirements (torch, numpy, pydantic, psutil, pyzmq, PIL, anyio, idna are). Pure Python or
# small binary wheels; SGLang's METADATA lists them (requests/starlette via fastapi) unpinned —
# pinned here so the oracle's environment is the same on every run.
LIGHT_DEPS = ("msgspec==0.22.0", "orjson==3.13.0", "pybase64==1.5.1", "requests==2.34.2", "urllib3==2.8.0",
              "certifi==2026.10.18", "charset_normalizer==3.5.2", "starlette==1.10.0")
PIP_TIMEOUT_S = 60


class RegistryUnreachable(RuntimeError):
    """The package index did not answer at all (no network, DNS failure, refused connection)."""


def pinned_version(setup_cfg: Path = REPO / "setup.cfg") -> str:
    """The exact SGLang release of the `gpu` extra; raises naming the line when it is not `==`."""
    cp = configparser.ConfigParser()
    cp.read(setup_cfg)
    try:
        gpu = cp["options.extras_require"]["gpu"]
    except KeyError:
        raise AssertionError(f"{setup_cfg}: no `gpu` extra under [options.extras_require]") from None
    for line in gpu.splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"sglang(\[[^\]]*\])?\s*(.*)$", line)
        if not m:
            continue
        exact = re.fullmatch(r"==\s*([0-9][0-9A-Za-z.+-]*)", m.group(2).strip())
        if not exact:
            raise AssertionError(f"{setup_cfg} [options.extras_require] gpu: `{line}` is not an exact pin "
                                 f"(sglang==X.Y.Z); the contract test checks one release")
        return exact.group(1)
    raise AssertionError(f"{setup_cfg} [options.extras_require] gpu: no sglang requirement")


def _pip(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--timeout", str(PIP_TIMEOUT_S),
           "--retries", "1"]
    return subprocess.run(cmd, capture_output=True, text=True)


def _index_urls(pip_output: str) -> list[str]:
    for line in pip_output.splitlines():
        if line.startswith("Looking in indexes:"):
            urls = [u.strip() for u in line.split(":", 1)[1].split(",")]
            return [u for u in urls if u.startswith(("http://", "https://"))]
    return ["https://pypi.org/simple"]


def _unreachable(urls: list[str], project: str) -> str | None:
    """A reason when none of the indexes answers at all; None when one answers (even 404)."""
    reasons = []
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/{project}/", timeout=20):
                return None
        except urllib.error.HTTPError:
            return None     # it answered: the registry is reachable
        except (urllib.error.URLError, OSError) as e:
            reasons.append(f"{url}: {getattr(e, 'reason', e)}")
    return "; ".join(reasons) or None


def _run_pip_or_explain(args: list[str], project: str, what: str) -> None:
    proc = _pip(args)
    if proc.returncode == 0:
        return
    out = proc.stdout + proc.stderr
    why = _unreachable(_index_urls(out), project)
    if why:
        raise RegistryUnreachable(f"cannot reach the package index to {what}: {why}")
    raise AssertionError(f"{what} failed (the index is reachable), pip said:\n{out[-3000:]}")


def fetch_wheel(version: str, cache: Path = CACHE) -> Path:
    """The cached wheel of sglang==version, downloaded on first use (into a scratch directory,
    then moved in whole, so a concurrent or interrupted run never sees half a file)."""
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.glob(f"sglang-{version}-*.whl"):
        if zipfile.is_zipfile(old):
            return old
        old.unlink()        # not a wheel: fetch it again
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        _run_pip_or_explain(["download", "--no-deps", "--only-binary=:all:", "--dest", tmp, f"sglang=={version}"],
                            "sglang", f"download sglang=={version}")
        found = sorted(p for p in Path(tmp).glob(f"sglang-{version}-*.whl") if zipfile.is_zipfile(p))
        if not found:
            raise AssertionError(f"pip download sglang=={version} succeeded but left no wheel in {tmp}")
        return Path(shutil.move(str(found[0]), cache / found[0].name))


def prepare_deps(version: str, cache: Path = CACHE) -> Path:
    """`LIGHT_DEPS` installed (no dependencies of theirs) into a cache directory of their own."""
    target = cache / f"deps-{version}"
    stamp = target / ".tandem-deps.json"
    if stamp.exists() and json.loads(stamp.read_text()) == list(LIGHT_DEPS):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".deps-"))
    try:
        _run_pip_or_explain(["install", "--quiet", "--no-deps", "--only-binary=:all:", "--target", str(tmp),
                             *LIGHT_DEPS], LIGHT_DEPS[0].split("==")[0],
                            f"install the oracle's light dependencies {', '.join(LIGHT_DEPS)}")
        (tmp / stamp.name).write_text(json.dumps(list(LIGHT_DEPS)))
        shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:     # another run put it there first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@dataclass(frozen=True)
class Wheel:
    version: str
    path: Path
    deps: Path

    @property
    def name(self) -> str:
        return self.path.name

    def ask(self, command: str, payload: dict | None = None, timeout_s: float = 240.0) -> dict:
        """Run one command of sglang_oracle.py on this wheel; its JSON answer."""
        return self.run("sglang_oracle", command, payload=payload, timeout_s=timeout_s)

    def run(self, oracle: str, *args: str, payload: dict | None = None, timeout_s: float = 240.0) -> dict:
        """Run the oracle module `oracle` (a module of this directory) on this wheel, in a process
        of its own started by tests/support/process_starts.py (forked from an interpreter that has
        imported torch, which SGLang's import stubs import: 3-4 CPU-seconds less per call); the
        request and the answer travel as JSON files."""
        with tempfile.TemporaryDirectory(prefix="sglang-oracle-") as tmp:
            request, answer, console = Path(tmp, "request.json"), Path(tmp, "answer.json"), Path(tmp, "console")
            request.write_text(json.dumps(payload or {}))
            proc = process_starts.start(["-m", oracle, "--wheel", str(self.path), "--deps", str(self.deps), *args,
                                         "--request", str(request), "--answer", str(answer)], console)
            code = proc.returncode if process_starts.wait_or_kill(proc, timeout_s) else None
            output = console.read_text(errors="replace")
            if code != 0 or not answer.exists():
                missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", output)
                hint = (f"\n(sglang=={self.version} needs `{missing.group(1)}` to import the modules the oracle "
                        f"uses: add its package to LIGHT_DEPS in {Path(__file__).name})" if missing else "")
                ended = "ran out of time" if code is None else f"exited {code}"
                raise AssertionError(f"the SGLang oracle {oracle} {' '.join(args)} {ended} on {self.name}:\n"
                                     f"{output[-4000:]}{hint}")
            return json.loads(answer.read_text())


def load_pinned_wheel() -> Wheel:
    version = pinned_version()
    return Wheel(version, fetch_wheel(version), prepare_deps(version))
