"""Where benchmarks write (benchmarks/common.py): a run never touches the committed figures.

The docs cite `benchmarks/results/*.json` (test_doc_figures.py), so a benchmark that rewrote
them would turn the suite red on any machine that measured itself (`make bench` then `make
test`). By default a run writes into its own directory under `benchmarks/runs/` (ignored by
git); only `--record` writes the committed directory. These tests call the real write path with
`RUNS`/`RESULTS` pointed at temporary directories where a test needs it; the committed files are
snapshotted and put back whatever happens, so a regression fails here without damaging them.
tests/integration/foundation/test_bench_git_clean.py runs a real benchmark and checks `git status`.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

import benchmarks.common as common

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "benchmarks" / "results"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Module state as a new process has it, with this run's directories under tmp_path.
    `machine()` is replaced (the one stand-in here): platform.platform() runs `uname -p` as a
    process, which the unit tier forbids; what it returns is not under test."""
    monkeypatch.setattr(common, "machine", lambda: {"cpus": 2})
    monkeypatch.setattr(common, "RUNS", tmp_path / "runs", raising=False)
    monkeypatch.setattr(common, "_run_dir", None, raising=False)
    monkeypatch.setattr(common, "_record", False, raising=False)
    monkeypatch.setattr(common, "_printed", [])
    return tmp_path


@pytest.fixture
def committed_snapshot():
    """Every committed result file's bytes; restored after the test if anything changed them."""
    before = {p: p.read_bytes() for p in COMMITTED.iterdir() if p.is_file()}
    yield before
    for p in COMMITTED.iterdir():
        if p.is_file() and p not in before:
            p.unlink()
    for p, data in before.items():
        if not p.exists() or p.read_bytes() != data:
            p.write_bytes(data)


def test_an_unrecorded_run_writes_its_own_directory_and_leaves_the_committed_files(fresh, committed_snapshot):
    common.print_table("t", ["measure", "value"], [["x", 1.5]])
    out = common.write_results("protocol", {"encode_decode_mb_s": -1.0})
    assert not out.resolve().is_relative_to(COMMITTED.resolve()), out
    assert out.resolve().is_relative_to((fresh / "runs").resolve()), out
    written = json.loads(out.read_text())
    assert written["encode_decode_mb_s"] == -1.0 and written["tables"][0]["rows"] == [["x", 1.5]]
    after = {p: p.read_bytes() for p in COMMITTED.iterdir() if p.is_file()}
    assert after == committed_snapshot, "a run without --record changed benchmarks/results/"
    # A second benchmark of the same run lands beside the first (one directory per run).
    assert common.write_results("trainer", {"a": 1}).parent == out.parent


def test_plots_and_reports_go_where_the_json_goes(fresh, committed_snapshot):
    png = common.output_path("staleness_ablation.png")
    assert png.parent == common.write_results("staleness_ablation", {}).parent
    assert not png.resolve().is_relative_to(COMMITTED.resolve())


def test_record_writes_the_committed_directory(fresh, monkeypatch):
    fake_committed = fresh / "results"
    monkeypatch.setattr(common, "RESULTS", fake_committed)
    common.set_recording(True)
    out = common.write_results("protocol", {"v": 2})
    assert out == fake_committed / "protocol.json" and json.loads(out.read_text())["v"] == 2
    assert common.output_path("train_math_report.png").parent == fake_committed
    assert not (fresh / "runs").exists()


def test_a_benchmark_reads_this_runs_figures_before_the_committed_ones(fresh, monkeypatch):
    fake_committed = fresh / "results"
    fake_committed.mkdir()
    monkeypatch.setattr(common, "RESULTS", fake_committed)
    (fake_committed / "async_vs_sync.json").write_text(json.dumps({"date": "committed"}))
    assert common.read_results("async_vs_sync")[0]["date"] == "committed"
    common.write_results("async_vs_sync", {"speedup": 1.0})
    figures, path = common.read_results("async_vs_sync")
    assert figures["speedup"] == 1.0 and path.parent == common.output_dir()
    assert common.read_results("nothing_like_it") is None


def _demo_main(quick: bool = False) -> None:
    _demo_main.calls.append((quick, common._record))


@pytest.mark.parametrize(("argv", "expected"), [([], (False, False)), (["--record"], (False, True)),
                                                (["--quick"], (True, False))])
def test_each_benchmarks_cli_records_only_when_asked(fresh, monkeypatch, argv, expected):
    _demo_main.calls = []
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    common.cli(_demo_main)
    assert _demo_main.calls == [expected]


def test_quick_and_record_together_are_refused(fresh, monkeypatch, capsys):
    _demo_main.calls = []
    monkeypatch.setattr(sys, "argv", ["bench", "--quick", "--record"])
    with pytest.raises(SystemExit) as e:
        common.cli(_demo_main)
    assert e.value.code == 2 and _demo_main.calls == []
    assert "nothing to record" in capsys.readouterr().err


def test_the_run_directories_are_ignored_by_git():
    ignored = [line.strip() for line in (REPO / ".gitignore").read_text().splitlines()]
    assert common.RUNS.relative_to(REPO).as_posix() + "/" in ignored


def test_no_benchmark_writes_the_committed_directory_on_its_own():
    """Every file a benchmark keeps goes through write_results/output_path, which route it: a
    module naming RESULTS itself would bypass --record (as plots and reports once did)."""
    offenders = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        if path.name == "common.py":
            continue
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        if "RESULTS" in names:
            offenders.append(path.name)
    assert offenders == []


def test_a_quick_run_leaves_no_trace(fresh, monkeypatch):
    """--quick records nothing: a benchmark that only reads figures (the simulator reads
    async_vs_sync's) makes no run directory either."""
    def quick_main(quick: bool = False) -> None:
        assert quick
        common.read_results("async_vs_sync")
    monkeypatch.setattr(sys, "argv", ["bench", "--quick"])
    common.cli(quick_main)
    assert not (fresh / "runs").exists()
