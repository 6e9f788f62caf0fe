"""The offline install path of docs/cluster.md works: a bundle built here installs with no index.

A GPU node is played by a fresh virtual environment that sees this environment's packages
through a path file (as a node's venv sees the node's torch stack), except a handful that a node
typically lacks: the small pure and binary wheels below. `slurm/wheelhouse.py build` (this
interpreter's version and platform, the node's package list as `--node-has`) must bundle what
is missing and nothing big; `slurm/wheelhouse.py install` then runs with the index switched off
— no pip configuration, `PIP_NO_INDEX`, and a proxy that refuses every connection, so any
network access fails the install — and the project must import from the new environment, not
from this checkout. Downloads: about 2 MB (and the index's metadata for the resolution).
Skipped only when the package index cannot be reached at all.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
import venv
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[3]
WHEELHOUSE = REPO / "slurm" / "wheelhouse.py"
# What the pretend node lacks (the project's small dependencies a CUDA image does not ship).
MISSING = {"omegaconf", "antlr4-python3-runtime", "submitit", "math-verify", "latex2sympy2-extended", "msgpack",
           "pyzmq"}
# Never in a bundle: the node's own (torch) or big and on the node here.
NEVER = {"torch", "numpy", "transformers", "matplotlib", "sympy"}
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "HTTP_PROXY": "http://127.0.0.1:9",
           "HTTPS_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


def _node_site(root: Path) -> tuple[Path, list[str]]:
    """A directory of links to this environment's distributions minus MISSING and the project
    (the node's site-packages), and its `name==version` list."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    view = root / "node-site"
    view.mkdir()
    have = []
    for dist in md.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in MISSING or name == "tandem" or Path(dist.locate_file("")).resolve() != site:
            continue
        have.append(f"{name}=={dist.version}")
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            if (site / top).exists() and not (view / top).exists() and not top.endswith(".pth"):
                (view / top).symlink_to(site / top)
    return view, sorted(have)


def _platform() -> str:
    glibc = os.confstr("CS_GNU_LIBC_VERSION").split()[1]
    return f"manylinux_2_{glibc.split('.')[1]}_{os.uname().machine}"


def _index_unreachable() -> str | None:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/"
    try:
        with urllib.request.urlopen(url, timeout=20):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as e:
        return f"{url}: {getattr(e, 'reason', e)}"


def test_a_bundle_built_here_installs_and_imports_with_no_index(tmp_path):
    view, have = _node_site(tmp_path)
    (tmp_path / "node-has.txt").write_text("\n".join(have) + "\n")
    wh = tmp_path / "wheelhouse"
    py_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run([sys.executable, str(WHEELHOUSE), "build", "--out", str(wh), "--python-version", py_version,
                            "--platform", _platform(), "--node-has", str(tmp_path / "node-has.txt")],
                           capture_output=True, text=True, timeout=500)
    if built.returncode != 0:
        why = _index_unreachable()
        if why:
            pytest.skip(f"no package index to build the bundle from: {why}")
        pytest.fail(f"wheelhouse build failed:\n{built.stdout}{built.stderr[-4000:]}")
    manifest = json.loads((wh / "wheelhouse.json").read_text())
    bundled = {canonicalize_name(f.split("-")[0]) for f in manifest["files"]}
    assert MISSING | {"tandem"} <= bundled, manifest
    assert not bundled & NEVER, manifest
    assert manifest["total_bytes"] < 10 * 2**20, manifest

    node = tmp_path / "node-venv"
    venv.create(node, with_pip=True, symlinks=True)
    node_py = node / "bin" / "python"
    # ensurepip's own setuptools (3.11) would shadow the node's, which torch's requirements need.
    subprocess.run([node_py, "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools"], capture_output=True,
                   env={**os.environ, **OFFLINE}, timeout=120)
    node_site = subprocess.run([node_py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    (Path(node_site) / "node-packages.pth").write_text(f"{view}\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, **OFFLINE}
    lacks = subprocess.run([node_py, "-c", "import omegaconf"], capture_output=True, text=True, cwd=tmp_path)
    assert lacks.returncode != 0, "the pretend node already has omegaconf: the test would prove nothing"

    inst = subprocess.run([node_py, str(WHEELHOUSE), "install", "--wheelhouse", str(wh)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert inst.returncode == 0, inst.stdout + inst.stderr[-4000:]
    probe = ("import tandem.launcher.cli, tandem.services.protocol, tandem.rollout, tandem.reward, omegaconf, zmq, "
             "math_verify, submitit, msgpack, torch; import tandem.trainer as trainer; print(trainer.__file__); "
             "print(omegaconf.__file__); print(torch.__file__)")
    out = subprocess.run([node_py, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    trainer_at, omegaconf_at, torch_at = out.stdout.split()
    assert trainer_at.startswith(node_site) and omegaconf_at.startswith(node_site), out.stdout
    assert torch_at.startswith(str(view)), out.stdout          # the node's torch, not a bundled one
    cli = subprocess.run([node / "bin" / "tandem", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert cli.returncode == 0 and "run" in cli.stdout, cli.stderr[-2000:]


def test_install_asks_pip_for_the_extras_the_bundle_was_built_with(tmp_path):
    """`slurm/wheelhouse.py install` on a bundle built with `--extras trackers` (its manifest says
    so) installs `tandem[trackers]`, with the index off. pip is played by a script that records its
    command line and environment: the real install of a bundle is the test above, and a bundle
    with the trackers' wheels (TensorBoard, W&B and their closure) is tens of MiB to download."""
    wh = tmp_path / "wh"
    wh.mkdir()
    (wh / "wheelhouse.json").write_text(json.dumps({"requirements": ["msgpack==1.1.0", "tandem[trackers]"]}))
    seen = tmp_path / "seen.json"
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'no_index': os.environ.get('PIP_NO_INDEX')}}, open({str(seen)!r}, 'w'))\n")
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, str(WHEELHOUSE), "install", "--wheelhouse", str(wh), "--python", str(fake)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "installed tandem[trackers]" in out.stdout, out.stdout + out.stderr
    call = json.loads(seen.read_text())
    assert call["argv"][:2] == ["-m", "pip"] and call["argv"][-1] == "tandem[trackers]" and call["no_index"] == "1", call
    assert "--no-index" in call["argv"] and str(wh) in call["argv"], call
