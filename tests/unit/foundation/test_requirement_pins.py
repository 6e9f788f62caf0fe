"""The pin checker behind test_gpu_extra_pins.py decides intersections correctly, and catches the
contradiction the first GPU run found (torch==2.13.0 here, torch==2.14.1 in sglang 0.5.23)."""
from __future__ import annotations

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from requirement_pins import Metadata, contradictions, self_contradictions, specifiers_intersect

META = """Metadata-Version: 2.1
Name: sglang
Version: 0.5.23
Provides-Extra: test
Requires-Dist: torch==2.14.1
Requires-Dist: transformers==5.19.0
Requires-Dist: pyzmq>=25.1.2
Requires-Dist: av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"
Requires-Dist: pytest; extra == "test"
"""
LINUX = {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.12"}


@pytest.mark.parametrize(("a", "b", "common"), [
    ("==2.13.0", "==2.14.1", False),
    (">=2.13,<2.15", "==2.14.1", True),
    ("==2.13.0", ">=2.13,<2.15", True),
    (">=4.45,<6", "==5.19.0", True),
    (">=2.9,<2.12", ">=2.9.0a0,<2.12.0", True),
    ("<2.12", ">=2.12", False),
    (">2.12", "<2.12.1", True),          # 2.12.0.1
    ("~=0.8", ">=0.9,<1", True),
    ("~=0.8", ">=1", False),
    ("==2.*", ">=2.5,!=2.5", True),
    ("<2", "", True),
    ("", "", True),
    (">=4.0.0b18", "<4.1", True),        # a pre-release is a version
    (">=4.0.0b18", "<4.0.0", False),     # PEP 440: <V excludes V's own pre-releases
])
def test_specifier_sets_intersect(a, b, common):
    assert specifiers_intersect(SpecifierSet(a), SpecifierSet(b)) is common
    assert specifiers_intersect(SpecifierSet(b), SpecifierSet(a)) is common


def test_the_old_torch_pin_contradicts_sglang_and_the_range_does_not():
    meta = Metadata.parse(META)
    theirs = meta.requirements_for(LINUX)
    assert [r.name for r in theirs] == ["torch", "transformers", "pyzmq"]     # no aarch64 av, no extra
    old = [Requirement("torch==2.13.0"), Requirement("transformers>=4.45,<6"), Requirement("pyzmq>=26,<28")]
    found = contradictions(old, theirs, "sglang 0.5.23")
    assert len(found) == 1 and found[0].startswith("torch:"), found
    new = [Requirement("torch>=2.13,<2.15"), *old[1:]]
    assert contradictions(new, theirs, "sglang 0.5.23") == []


def test_a_missing_extra_or_another_release_of_the_dependency_is_named():
    meta = Metadata.parse(META)
    assert self_contradictions([Requirement("sglang==0.5.23")], meta) == []
    assert "does not provide" in self_contradictions([Requirement("sglang[srt]==0.5.23")], meta)[0]
    assert "does not accept" in self_contradictions([Requirement("sglang==0.5.22")], meta)[0]
