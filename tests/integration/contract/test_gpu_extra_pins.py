"""The `[gpu]` extra resolves: the project's pins agree with the pinned SGLang wheel's own.

`pip install -e '.[gpu]'` resolves setup.cfg's `install_requires`, the `gpu` extra and SGLang's
`Requires-Dist` together. A first GPU run found them contradicting each other (`torch==2.13.0`
here, `torch==2.14.1` in sglang 0.5.23), so the extra could not be installed at all. This test
reads the wheel the contract tests already fetch (sglang_wheel.py, cached in .cache/) and the
installed megatron-core's metadata, and fails naming every package whose specifier sets have
no version in common (tests/support/requirement_pins.py says how that is decided). Skipped only
when the package index cannot be reached, like the other contract tests.
"""
from __future__ import annotations

from importlib.metadata import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from requirement_pins import GPU_NODE_ENV, Metadata, contradictions, project_requirements, self_contradictions
from sglang_wheel import RegistryUnreachable, fetch_wheel, pinned_version

SETUP_CFG = Path(__file__).resolve().parents[3] / "setup.cfg"


@pytest.fixture(scope="module")
def sglang_meta() -> Metadata:
    try:
        return Metadata.from_wheel(fetch_wheel(pinned_version()))
    except RegistryUnreachable as e:
        pytest.skip(f"the [gpu] pins not checked against SGLang's: {e}")


def test_project_pins_agree_with_the_pinned_sglang_release(sglang_meta):
    ours = project_requirements(SETUP_CFG, extras=("gpu",))
    sglang_req = next(r for r in ours if r.name == "sglang")
    theirs = sglang_meta.requirements_for(GPU_NODE_ENV, frozenset(sglang_req.extras))
    assert len(theirs) > 30, f"read only {len(theirs)} requirements from {sglang_meta.name} {sglang_meta.version}"
    problems = self_contradictions(ours, sglang_meta) + contradictions(
        ours, theirs, f"{sglang_meta.name} {sglang_meta.version}")
    assert problems == [], "setup.cfg contradicts the SGLang release it pins:\n" + "\n".join(problems)
    # What made the extra unresolvable once: SGLang pins torch and transformers exactly.
    shared = {r.name for r in theirs} & {r.name for r in ours}
    assert {"torch", "transformers", "tokenizers"} <= shared, shared


def test_project_pins_agree_with_megatron_core_and_its_transformer_engine_range():
    """megatron-core is pinned in install_requires; its `dev` extra names the TransformerEngine
    releases it was built against, which the `gpu` extra must overlap (read from the installed
    distribution: no download)."""
    ours = project_requirements(SETUP_CFG, extras=("gpu",))
    meta = Metadata.parse(str(metadata("megatron-core")))
    problems = self_contradictions(ours, meta) + contradictions(
        ours, meta.requirements_for(GPU_NODE_ENV), f"megatron-core {meta.version}")
    te = [r for r in meta.requirements_for(GPU_NODE_ENV, frozenset({"dev"})) if r.name == "transformer-engine"]
    assert te, "megatron-core's dev extra no longer names transformer-engine: re-derive the gpu extra's range"
    problems += contradictions(ours, te, f"megatron-core {meta.version}[dev]")
    assert problems == [], "\n".join(problems)
    ours_te = next(r for r in ours if r.name == "transformer-engine")
    assert set(Requirement(str(te[0])).extras) <= set(ours_te.extras), (ours_te, te[0])
