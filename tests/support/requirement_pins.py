"""Do the project's requirement pins contradict a dependency's own? (the `[gpu]` extra resolves)

`pip install -e '.[gpu]'` puts the project's requirements (setup.cfg `install_requires` and the
`gpu` extra) into one resolution with SGLang's: a project that pins `torch==2.13.0` next to a
release that requires `torch==2.14.1` cannot be installed, and nobody finds out before a GPU
node tries. The check here reads both sides as `packaging` requirements and asks, for every
package both name, whether their specifier sets have a version in common.

Whether two specifier sets intersect is decided on candidate versions: where either side pins
one (`==X`), X itself; otherwise every version either side mentions and its neighbours (each
release component one up and one down, a sub-release `.1` and `.0.1` under it, and `0`). For the
forms requirement files use (pins, half-open ranges, `~=`, `!=`, `==X.*`) a common version exists
exactly when one of these candidates is one. Pre-releases count (SGLang requires
`flash-attn-4>=4.0.0b18`).
"""
from __future__ import annotations

import configparser
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# Where the `[gpu]` extra is installed: Linux x86-64 GPU nodes (the lent H100/H200 run 3.12).
GPU_NODE_ENV = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                "os_name": "posix", "python_version": "3.12", "python_full_version": "3.12.3",
                "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def _lines(block: str) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.split("#", 1)[0].strip()]


def project_requirements(setup_cfg: Path, extras: tuple[str, ...] = ("gpu",)) -> list[Requirement]:
    """setup.cfg's install_requires plus the named extras, as requirements."""
    cp = configparser.ConfigParser()
    cp.read(setup_cfg)
    out = [Requirement(x) for x in _lines(cp["options"]["install_requires"])]
    for extra in extras:
        out += [Requirement(x) for x in _lines(cp["options.extras_require"][extra])]
    return out


@dataclass(frozen=True)
class Metadata:
    """A distribution's name, version, requirements and declared extras (from METADATA)."""
    name: str
    version: str
    requires: list[Requirement]
    extras: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> Metadata:
        msg = HeaderParser().parsestr(text)
        return cls(msg["Name"], msg["Version"], [Requirement(r) for r in msg.get_all("Requires-Dist") or []],
                   frozenset(canonicalize_name(e) for e in msg.get_all("Provides-Extra") or []))

    @classmethod
    def from_wheel(cls, wheel: Path) -> Metadata:
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            return cls.parse(z.read(name).decode())

    def requirements_for(self, env: dict, extras: frozenset[str] = frozenset()) -> list[Requirement]:
        """The requirements that apply in `env` with these extras of the distribution requested."""
        out = []
        for r in self.requires:
            if r.marker is None:
                out.append(r)
                continue
            if any(r.marker.evaluate({**env, "extra": e}) for e in ("", *sorted(extras))):
                out.append(r)
        return out


def _candidates(specs: SpecifierSet) -> set[Version]:
    out = {Version("0")}
    for s in specs:
        try:
            v = Version(s.version.removesuffix(".*"))
        except InvalidVersion:
            continue
        r = v.release
        out |= {v, Version(".".join(map(str, (*r, 1)))), Version(".".join(map(str, (*r, 0, 1))))}
        for i in range(len(r)):
            out.add(Version(".".join(map(str, (*r[:i], r[i] + 1)))))
            if r[i] > 0:
                out.add(Version(".".join(map(str, (*r[:i], r[i] - 1, 9999)))))
    return out


def specifiers_intersect(a: SpecifierSet, b: SpecifierSet) -> bool:
    """True when some version satisfies both sets (see the module docstring for how)."""
    both = SpecifierSet(f"{a},{b}".strip(","))
    pinned = [Version(s.version) for s in both if s.operator in ("==", "===") and not s.version.endswith("*")]
    cands = pinned or _candidates(both)
    return any(both.contains(v, prereleases=True) for v in cands)


def contradictions(ours: list[Requirement], theirs: list[Requirement], who: str) -> list[str]:
    """One line per package both sides name with specifier sets that have no version in common."""
    mine: dict[str, list[Requirement]] = {}
    for r in ours:
        mine.setdefault(canonicalize_name(r.name), []).append(r)
    out = []
    for t in theirs:
        for o in mine.get(canonicalize_name(t.name), []):
            if not specifiers_intersect(o.specifier, t.specifier):
                out.append(f"{t.name}: the project requires `{o}`, {who} requires `{t}`: no version satisfies both")
    return out


def self_contradictions(ours: list[Requirement], meta: Metadata) -> list[str]:
    """The project's requirement on the distribution itself: its version and its extras exist."""
    out = []
    for r in ours:
        if canonicalize_name(r.name) != canonicalize_name(meta.name):
            continue
        if not r.specifier.contains(meta.version, prereleases=True):
            out.append(f"`{r}` does not accept the release read, {meta.name} {meta.version}")
        missing = sorted(canonicalize_name(e) for e in r.extras if canonicalize_name(e) not in meta.extras)
        if missing:
            out.append(f"`{r}` asks for extras {missing} that {meta.name} {meta.version} does not provide "
                       f"(it provides {sorted(meta.extras)}): pip warns and installs without them")
    return out
