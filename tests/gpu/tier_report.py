"""gpu_tier.json: what a GPU tier run proves, in one file to commit (benchmarks/results/) and cite.

Reads the tier's JUnit XML and the environment it ran in: the device (name, memory, compute
capability), the versions that matter (Python, torch and its CUDA, megatron-core, transformers,
whether TransformerEngine and flash-attn were there), the offline install (the wheelhouse's
manifest, pip's exit status and time), and every check with its outcome (pass / fail / skip /
error), duration and, when it did not pass, the first lines of why.

    python tests/gpu/tier_report.py --junit J.xml [J2.xml ...] --out gpu_tier.json [--install-rc N --install-s S]
        [--wheelhouse DIR] [--pytest-rc N] [--wall-s S] [--timed-out FILE ...]

A test file killed at its time limit wrote no JUnit XML: `--timed-out` names it, and it is
reported as one check with the outcome `timeout` (its log says which tests finished first).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": None, "cuda": None, "device": "cpu",
           "megatron_core": _version("megatron-core"), "transformers": _version("transformers"),
           "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
           "flash_attn": _version("flash-attn") or _version("flash_attn")}
    try:
        import torch
    except ImportError as e:
        env["torch"] = f"not importable: {e}"
        return env
    env.update(torch=torch.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, device_memory_gib=round(p.total_memory / 2**30, 1),
                   compute_capability=f"{p.major}.{p.minor}", device_count=torch.cuda.device_count())
    return env


def checks(junit: Path) -> list[dict]:
    out = []
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):   # a pytest killed while writing it
        return out
    for case in root.iter("testcase"):
        outcome, why = "pass", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "fail", "error": "error", "skipped": "skip"}[tag]
                why = (el.get("message") or el.text or "").strip().splitlines()[:6]
                break
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        out.append({"check": name, "outcome": outcome, "duration_s": round(float(case.get("time") or 0), 2),
                    **({"why": why} if why else {})})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--junit", type=Path, nargs="+", required=True)
    ap.add_argument("--timed-out", nargs="*", default=[], metavar="FILE")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--wheelhouse", type=Path)
    ap.add_argument("--install-rc", type=int)
    ap.add_argument("--install-s", type=float)
    ap.add_argument("--pytest-rc", type=int)
    ap.add_argument("--wall-s", type=float)
    a = ap.parse_args()
    found = [c for j in a.junit for c in checks(j)]
    found += [{"check": f, "outcome": "timeout", "why": ["killed at its time limit (run_tier.sh)"]} for f in a.timed_out]
    counts = {k: sum(c["outcome"] == k for c in found) for k in ("pass", "fail", "error", "skip", "timeout")}
    manifest = a.wheelhouse / "wheelhouse.json" if a.wheelhouse else None
    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(),
              "install": {"from": str(a.wheelhouse) if a.wheelhouse else None, "exit": a.install_rc,
                          "seconds": a.install_s, "index": "none (pip --no-index)",
                          "bundle": json.loads(manifest.read_text()) if manifest and manifest.exists() else None},
              "pytest_exit": a.pytest_rc, "wall_s": a.wall_s, "counts": counts, "checks": found}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{a.out}: {counts} on {report['environment']['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
