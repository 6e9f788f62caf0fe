"""An offline install bundle for GPU nodes: build it where a package index answers, install it where none does.

HPC compute nodes (and the lent GPU machines) often reach no package index, and already hold
torch (a CUDA build, matched to their driver) and much else. So the bundle holds the project's
own wheel and the wheels of its dependency closure for the node's Python and platform, minus
torch with everything only torch needs, minus what the node is declared to have:

    python slurm/wheelhouse.py build --out DIR --python-version 3.12 --platform manylinux_2_28_x86_64 \
        [--node-has FILE] [--extras trackers]
    python slurm/wheelhouse.py install --wheelhouse DIR [--python PY]     # on the node, no network

Resolution is pip's own (`pip install --dry-run --report` for the target's tags, `--only-binary`),
with torch replaced by a metadata-only stub wheel: resolving the real one would drag in its
CUDA closure (and needs tags pip cannot guess), and the node's torch is the one that runs.
Packages the node has are dropped after resolution, with whatever only they need; `--node-has`
is a file of names (`name` or `name==version`, `#` comments; pip freeze output works): with a
version, the package is dropped only if that version satisfies every requirement on it in the
closure. The install then lets pip resolve against what the node holds (`--no-index
--find-links`): a package the node lacks or holds in a version that does not fit fails the
install loudly, naming it, instead of failing later at import.

`build` replaces the `*.whl` files of `--out`. It needs `packaging` and pip (any venv has them);
`install` needs the standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = "tandem"
MANIFEST = "wheelhouse.json"
# Never bundled: the node's own CUDA build runs. Resolved as a stub of this version.
STUBBED = {"torch": "2.13.0"}


def platform_tags(platform: str) -> list[str]:
    """pip matches --platform exactly: manylinux_2_N_x86_64 (or manylinux2014_x86_64, = 2_17) means
    every manylinux tag a glibc-2.N machine accepts, from 2_N down to the legacy aliases."""
    legacy = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
    for name, glibc in legacy.items():
        if platform.startswith(name + "_"):
            platform = f"manylinux_2_{glibc}_{platform[len(name) + 1:]}"
    if not platform.startswith("manylinux_2_"):
        return [platform]
    minor, arch = platform[len("manylinux_2_"):].split("_", 1)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(int(minor), 4, -1)]
    return tags + [f"{name}_{arch}" for name, glibc in legacy.items() if glibc <= int(minor)]


def tag_args(python_version: str, platform: str) -> list[str]:
    nodot = python_version.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", "--abi", f"cp{nodot}"]
    for tag in platform_tags(platform):
        args += ["--platform", tag]
    return args


def _pip(python: str, args: list[str], env: dict | None = None) -> str:
    proc = subprocess.run([python, "-m", "pip", *args, "--disable-pip-version-check"], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"pip {' '.join(args[:2])} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc.stdout


def stub_wheel(name: str, version: str, out: Path) -> Path:
    """A wheel with metadata only (no requirements, no code): stands in for `name` in resolution."""
    dist = f"{name}-{version}.dist-info"
    path = out / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: tandem-wheelhouse\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def read_node_has(path: Path | None) -> dict[str, str | None]:
    from packaging.utils import canonicalize_name

    out: dict[str, str | None] = {}
    if path is None:
        return out
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name.strip())] = version.strip() or None
    return out


def target_env(python_version: str, platform: str) -> dict[str, str]:
    from packaging.markers import default_environment

    arch = "aarch64" if "aarch64" in platform else "x86_64"
    return {**default_environment(), "python_version": python_version, "python_full_version": f"{python_version}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": arch, "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def needed(report: dict, root_extras: list[str], env: dict, node_has: dict[str, str | None]
           ) -> tuple[dict[str, dict], dict[str, str]]:
    """(packages to bundle: name -> report item, left out: name -> why) from pip's install report:
    the closure of the project that does not pass through a stubbed or node-provided package."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    items = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    specs: dict[str, list] = {}
    for name, item in items.items():
        # Only requirements that apply: `datasets` pins transformers==4.30.1 for its own
        # benchmarks extra, which must not make the node's transformers look incompatible.
        extras = ("", *root_extras) if name == PROJECT else ("",)
        for r in map(Requirement, item["metadata"].get("requires_dist") or []):
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras):
                specs.setdefault(canonicalize_name(r.name), []).append(r.specifier)
    left_out: dict[str, str] = {}
    for name, version in node_has.items():
        if name not in items:
            continue
        if version is None or all(s.contains(version, prereleases=True) for s in specs.get(name, [])):
            left_out[name] = f"on the node ({version or 'any version'})"
    for name in STUBBED:
        left_out[name] = "the node's own build (stubbed in resolution)"
    keep: dict[str, dict] = {}
    todo = [(PROJECT, frozenset(root_extras))]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name in left_out:
            continue
        seen.add((name, extras))
        item = items[name]
        keep[name] = item
        for r in map(Requirement, item["metadata"].get("requires_dist") or []):
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
                todo.append((canonicalize_name(r.name), frozenset(r.extras)))
    return keep, left_out


def build(out: Path, python_version: str, platform: str, node_has: Path | None = None,
          extras: list[str] = (), python: str = sys.executable) -> dict:
    """Fill `out` with the bundle and write its manifest (wheelhouse.json); returns the manifest."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    tags = tag_args(python_version, platform)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        tmp = Path(tmp)
        _pip(python, ["wheel", "--quiet", "--no-deps", "--no-build-isolation", str(REPO), "--wheel-dir", str(out)])
        project = next(out.glob(f"{PROJECT}-*.whl"))
        stubs = tmp / "stubs"
        stubs.mkdir()
        pins = [f"{name}=={version}+wheelhouse.stub" for name, version in STUBBED.items()]
        for name, version in STUBBED.items():
            stub_wheel(name, f"{version}+wheelhouse.stub", stubs)
        (tmp / "constraints.txt").write_text("\n".join(pins) + "\n")
        extra = f"[{','.join(extras)}]" if extras else ""
        _pip(python, ["install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(tmp / "report.json"),
                      "--target", str(tmp / "target"), "--find-links", str(stubs), "--constraint",
                      str(tmp / "constraints.txt"), *tags, f"{PROJECT}{extra} @ {project.as_uri()}"])
        report = json.loads((tmp / "report.json").read_text())
    keep, left_out = needed(report, list(extras), target_env(python_version, platform), read_node_has(node_has))
    wanted = [f"{item['metadata']['name']}=={item['metadata']['version']}" for name, item in sorted(keep.items())
              if name != PROJECT]
    if wanted:
        _pip(python, ["download", "--quiet", "--no-deps", *tags, "--dest", str(out), *wanted])
    files = {p.name: p.stat().st_size for p in sorted(out.glob("*.whl"))}
    manifest = {"python_version": python_version, "platform": platform, "project": project.name,
                "requirements": sorted([*wanted, f"{PROJECT}{extra}"]), "left_out": dict(sorted(left_out.items())),
                "files": files, "total_bytes": sum(files.values())}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def bundled_extras(wheelhouse: Path) -> str:
    """The project's extras the bundle was built with (`[trackers]`, or "" for none), from its
    manifest: installing the bare project from a bundle built with `--extras` would leave the
    extras' wheels unused in the directory."""
    path = Path(wheelhouse) / MANIFEST
    reqs = json.loads(path.read_text()).get("requirements", []) if path.exists() else []
    return next((r[len(PROJECT):] for r in reqs if r.startswith(f"{PROJECT}[")), "")


def install(wheelhouse: Path, python: str = sys.executable, extras: str | None = None) -> None:
    """Install the project from the bundle with the index switched off (no network at all): pip
    resolves against what `python`'s environment already holds plus the bundle. `extras`: the
    bundle's own (its manifest) unless given."""
    extras = bundled_extras(wheelhouse) if extras is None else extras
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse), "--only-binary=:all:",
           "--no-cache-dir", "--quiet", f"{PROJECT}{extras}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"offline install from {wheelhouse} failed ({' '.join(cmd)}):\n"
                         f"{(proc.stdout + proc.stderr)[-6000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the bundle (needs a package index)")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--platform", default="manylinux_2_28_x86_64")
    b.add_argument("--node-has", type=Path, help="names (or name==version) the node already has")
    b.add_argument("--extras", default="", help="comma-separated extras of the project to bundle too")
    i = sub.add_parser("install", help="install from a bundle with no index")
    i.add_argument("--wheelhouse", type=Path, required=True)
    i.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        m = build(args.out, args.python_version, args.platform, args.node_has,
                  [e for e in args.extras.split(",") if e])
        print(f"{args.out}: {len(m['files'])} wheels, {m['total_bytes'] / 2**20:.1f} MiB "
              f"(left out: {', '.join(m['left_out']) or 'nothing'})")
    else:
        install(args.wheelhouse, args.python)
        print(f"installed {PROJECT}{bundled_extras(args.wheelhouse)} from {args.wheelhouse} (no index)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
