"""What a graded program can see of the host, written from the attacks (issue 22).

A policy optimises whatever the reward lets through: a program that finds its tests' expected
outputs on the host passes without solving anything. These run programs in the real sandbox
(bubblewrap) and check what they saw, not how the sandbox is built."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from grader_users import USERS, run_as, why_not

from tandem.reward.code_grader import grade_code
from tandem.reward.config import RewardConfig
from tandem.reward.sandbox import Sandbox
from tandem.reward.sandbox_root import library_stage, shared_libraries

CFG = RewardConfig(code_test_timeout_s=5.0, code_total_timeout_s=10.0)
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or Sandbox(CFG).isolation != "bwrap",
                                reason="bubblewrap not installed or not permitted here")

WALK = r'''
import os, sys
seen = []
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/dev") or root.startswith(("/proc/", "/dev/")):
        dirs[:] = []
        continue
    seen += [os.path.join(root, f) for f in files]
# Its verdict in one short line (the harness keeps 200 characters): the standard library is
# there, site-packages is empty, and no file outside the prefix but the libraries on stdin.
libraries = set(sys.stdin.read().split())
inside = [p for p in seen if p.startswith(sys.base_prefix + "/")]
others = [p for p in seen if not p.startswith(sys.base_prefix + "/") and p not in libraries]
print("stdlib", any(p.endswith("/json/__init__.py") for p in inside),
      "site-packages", sum("/site-packages/" in p for p in inside), "others", len(others), others[:3])
'''


CFG_ARGS = {"code_test_timeout_s": 5.0, "code_total_timeout_s": 10.0}


@pytest.fixture(params=USERS)
def user(request):
    """The grader as root and as an ordinary user (tests/support/grader_users.py)."""
    if why_not(request.param):
        pytest.skip(why_not(request.param))
    return request.param


def _stdout(user: str, program: str, stdin: str = "") -> str:
    result = run_as(user, [{"program": program, "inputs": [stdin], "outputs": ["unused"]}], CFG_ARGS)[0]
    assert result["error"] is None, result["error"]
    return result["tests"][0]["got"]


def test_a_program_sees_the_standard_library_and_its_libraries_and_nothing_else_of_the_host(user):
    libraries = "\n".join(inside for _, inside in shared_libraries())
    assert _stdout(user, WALK, libraries).strip() == "stdlib True site-packages 0 others 0 []"


def test_searching_the_filesystem_for_the_expected_output_finds_nothing(tmp_path, user):
    """The attack: the grader's tests sit in a file on the host (a dataset, an experiment
    directory); the program looks for a JSON holding its own input and prints the answer stored
    with it. Under `--ro-bind / /` it passed every test."""
    marker = "7319 2468"
    (tmp_path / "tests.json").write_text(json.dumps({"inputs": [marker + "\n"], "outputs": ["424242\n"]}))
    (tmp_path / "tests.json").chmod(0o644)
    tmp_path.chmod(0o755)
    thief = r'''
import json, os, sys
want = sys.stdin.read()
for root, dirs, files in os.walk("/"):
    if root.startswith(("/proc", "/dev")):
        dirs[:] = []
        continue
    for f in files:
        try:
            data = json.load(open(os.path.join(root, f)))
            print(data["outputs"][data["inputs"].index(want)])
            sys.exit(0)
        except Exception:
            pass
print("not found")
'''
    verdict = run_as(user, [{"response": f"```python\n{thief}\n```",
                             "tests": {"inputs": [marker + "\n"], "outputs": ["424242\n"]}}], CFG_ARGS)[0]
    assert not verdict["correct"], verdict["details"]
    assert verdict["details"]["tests"][0]["got"].strip() == "not found"


def test_the_harness_source_and_the_service_code_are_not_readable(user):
    probe = r'''
import os
for p in ["/work", "/home", "/srv", "/opt", "/var", "/etc/passwd", os.path.expanduser("~")]:
    print(p, os.path.exists(p))
'''
    lines = _stdout(user, probe).split("\n")
    assert all(line.endswith("False") for line in lines if line.strip() and not line.startswith("/tmp")), lines


def test_allowed_packages_are_importable_and_no_others():
    program = "import msgpack\nprint(msgpack.unpackb(msgpack.packb([1, 2])))"
    blocked = Sandbox(CFG).run(program, [""], ["[1, 2]"])
    assert blocked.tests[0]["passed"] is False and "ModuleNotFoundError" in blocked.tests[0]["stderr"]
    cfg = RewardConfig(code_test_timeout_s=5.0, code_total_timeout_s=10.0, sandbox_packages=["msgpack"])
    allowed = Sandbox(cfg).run(program, [""], ["[1, 2]"])
    assert allowed.tests[0]["passed"] is True, allowed.tests


def test_without_isolation_code_is_not_graded_unless_the_experiment_allows_it():
    program = "```python\nprint(input())\n```"
    tests = {"inputs": ["5\n"], "outputs": ["5\n"]}
    refused = grade_code(program, tests, RewardConfig(sandbox="rlimits"))
    assert not refused.correct and refused.details["reason"].startswith("refused: no filesystem"), refused.details
    assert "reward.allow_unisolated" in refused.details["reason"]
    allowed = grade_code(program, tests, RewardConfig(sandbox="rlimits", allow_unisolated=True))
    assert allowed.correct and allowed.details["isolation"] == "rlimits-only"


def test_libraries_are_gathered_once_per_library_set(tmp_path, monkeypatch):
    """Binding each library alone cost a mount each (~7.6 ms of every start); they are gathered
    once into a cache folder whose `lib*` folders are bound whole. That folder must hold exactly
    the libraries, readable by the sandbox's user, and be reused, not rebuilt."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    stage = library_stage.__wrapped__()
    assert stage is not None and stage.startswith(str(tmp_path))
    gathered = {str(p)[len(stage):] for p in Path(stage).rglob("*") if p.is_file()}
    libraries = shared_libraries()
    assert gathered == {inside for _, inside in libraries}
    for host, inside in libraries:
        assert Path(stage + inside).read_bytes() == Path(host).read_bytes()
    assert all(p.stat().st_mode & 0o755 == 0o755 for p in [Path(stage), *Path(stage).rglob("*")] if p.is_dir())
    built = Path(stage).stat().st_mtime_ns
    assert library_stage.__wrapped__() == stage and Path(stage).stat().st_mtime_ns == built
