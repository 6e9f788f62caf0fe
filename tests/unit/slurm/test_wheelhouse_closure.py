"""Which packages an offline bundle carries (slurm/wheelhouse.py `needed`), from a pip install
report: what the project needs, minus what the GPU node already has in a version every applicable
requirement accepts. A pin under another package's unused extra is not such a requirement."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "slurm"))
import wheelhouse  # noqa: E402

ENV = wheelhouse.target_env("3.11", "manylinux_2_28_x86_64")


def item(name: str, version: str, *requires: str) -> dict:
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


def report(*items: dict) -> dict:
    return {"install": list(items)}


def test_a_pin_under_an_unused_extra_does_not_bundle_what_the_node_has():
    r = report(item("tandem", "0.1.0", "transformers<6,>=4.45", "datasets>=3"),
               item("datasets", "5.2.0", 'transformers==4.30.1; extra == "benchmarks"', "pyarrow>=15"),
               item("transformers", "5.24.0"), item("pyarrow", "20.0.0"))
    keep, left_out = wheelhouse.needed(r, [], ENV, {"transformers": "5.24.0"})
    assert set(keep) == {"tandem", "datasets", "pyarrow"}
    assert left_out["transformers"] == "on the node (5.24.0)"


def test_the_node_version_an_applicable_requirement_refuses_is_bundled():
    r = report(item("tandem", "0.1.0", "transformers<6,>=4.45", 'peft>=0.17; extra == "lora"'),
               item("transformers", "5.24.0"), item("peft", "0.17.1"))
    keep, _ = wheelhouse.needed(r, ["lora"], ENV, {"transformers": "4.40.0", "peft": "0.10.0"})
    assert set(keep) == {"tandem", "transformers", "peft"}   # peft via the project's own extra


def test_the_bundles_extras_come_from_its_manifest(tmp_path):
    """`install` installs the project with the extras the bundle was built with (EXTRAS=trackers),
    read from wheelhouse.json; a bundle without extras, or without a manifest, installs it bare."""
    assert wheelhouse.bundled_extras(tmp_path) == ""
    manifest = tmp_path / wheelhouse.MANIFEST
    manifest.write_text('{"requirements": ["omegaconf==2.3.0", "tandem[trackers]", "tandem-extra==1.0"]}')
    assert wheelhouse.bundled_extras(tmp_path) == "[trackers]"
    manifest.write_text('{"requirements": ["omegaconf==2.3.0", "tandem"]}')
    assert wheelhouse.bundled_extras(tmp_path) == ""
