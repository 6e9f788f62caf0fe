"""A run as Python objects: the handle of one launched in the background (`Run`) and the records
of any run, running or finished, read from its experiment directory (`RunRecords`).

Both read only what every role writes for the command line too (`metrics.jsonl`,
`summary.json`, `eval-*.json`, the checkpoints), so what `tandem report`, `tandem audit` and
`tandem status` say and what these return are the same figures.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.launcher.audit import Audit, audit
from tandem.launcher.config import ExperimentConfig, load_experiment
from tandem.launcher.progress import run_steps
from tandem.services.protocol import ExpDir, read_metrics

PR_SET_PDEATHSIG = 1


class RunFailed(RuntimeError):
    """A run ended without finishing: `returncode` is the launcher's exit status (1 a role
    failed, or the trainer stopped the run at trainer.signals' cap: summary.json's `stopped`
    says why; 2 it could not start, 130 interrupted), `exp_dir` where its logs are."""

    def __init__(self, exp_dir: Path, returncode: int):
        self.exp_dir, self.returncode = exp_dir, returncode
        hint = " (continue it with resume=True)" if (exp_dir / "config.yaml").exists() else ""
        super().__init__(f"the run in {exp_dir} ended with exit status {returncode}; its logs are in "
                         f"{exp_dir / 'logs'}{hint}")


class RunRecords:
    """What a run has recorded so far, read from its experiment directory."""

    def __init__(self, exp_dir: str | os.PathLike):
        self.exp = ExpDir(exp_dir)
        if not self.exp.root.is_dir():
            raise FileNotFoundError(f"{self.exp.root}: no such experiment directory")

    def __repr__(self) -> str:
        return f"RunRecords({str(self.exp.root)!r})"

    @property
    def exp_dir(self) -> Path:
        return self.exp.root

    @property
    def config(self) -> ExperimentConfig:
        """The run's resolved configuration (`<exp>/config.yaml`, what every role read)."""
        return load_experiment(self.exp.root)

    def summary(self) -> dict | None:
        """`<exp>/summary.json` (None until the run has finished): steps, held-out accuracy
        before and after (`summary["eval"]`), staleness, throughput, weight-sync share."""
        try:
            return json.loads((self.exp.root / "summary.json").read_text())
        except FileNotFoundError:
            return None

    def metrics(self, role: str | None = None, event: str | None = None) -> list[dict]:
        """The records of `metrics.jsonl`, of one role and event if given (e.g. `"trainer",
        "step"`; docs/running.md lists them)."""
        return read_metrics(self.exp, role, event)

    def steps(self) -> list[dict]:
        """The trainer's step records, each step once (a resume's re-trained steps replace the
        abandoned ones): reward, staleness, tokens/s, the groups each step trained."""
        return run_steps(self.metrics("trainer"))

    def eval_curve(self) -> list[dict]:
        """Held-out accuracy by policy version: `{step, accuracy, se, n, source}` with source
        `before`, `during` (every `rollout.eval_every` versions) or `after`."""
        from tandem.launcher.report import held_out_points  # plotting code: only when asked

        steps = self.steps()
        return held_out_points(self.exp, self.metrics(), steps[-1]["step"] if steps else 0)

    def audit(self) -> Audit:
        """Every group's fate (`tandem audit`): delivered, trained, dropped, returned, and the ids
        of any lost or trained twice."""
        return audit(self.exp)

    def report(self) -> Path:
        """Write the run's report (`tandem report`) and return the HTML page's path."""
        from tandem.launcher.report import write_report

        return Path(write_report(self.exp)[1])

    def export(self, out: str | os.PathLike, version: int | None = None, adapter: bool = False) -> dict:
        """Write the run's policy (the newest, or `version`) as a Hugging Face directory at `out`
        (`tandem export`); returns what was written (version, source, dtype, path)."""
        from tandem.trainer.hf_export import export_run

        cfg = self.config
        return export_run(str(self.exp.root), cfg.experiment.model, str(out), None if version is None else str(version),
                          "auto", cfg.trainer.megatron.vocab_multiple, adapter=adapter)

    def evaluate(self, checkpoint: str | None = None, n: int | None = None) -> dict:
        """Greedy held-out accuracy of the run's final policy, or of `checkpoint` (`vN`, a weights
        or checkpoint directory), on a private generation server (`tandem eval`)."""
        cmd = [sys.executable, "-m", "tandem.launcher.cli", "eval", "--exp", str(self.exp.root)]
        cmd += [*(["--checkpoint", checkpoint] if checkpoint else []), *(["--n", str(n)] if n else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"tandem eval exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM (the launcher's clean stop) when the parent dies, so a
    script that is killed or exits does not leave a run going without a handle on it."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def open_run(exp_dir: str | os.PathLike) -> RunRecords:
    """The records of the run in `exp_dir` (running or finished): summary, metrics, steps,
    held-out curve, audit; and its evaluation and export."""
    return RunRecords(exp_dir)


class Run:
    """A run launched in the background by `Experiment.start`: the `tandem run` process and the
    records it writes. The run stops cleanly (SIGTERM: the trainer saves a checkpoint) when
    `stop` is called, on Ctrl-C during `wait`, and when the thread that started it ends."""

    POLL_S = 0.5

    def __init__(self, exp_dir: Path, process: subprocess.Popen, total_steps: int):
        self.exp_dir, self.process, self.total_steps = exp_dir, process, total_steps

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else f"exit {self.returncode}"
        return f"<tandem.Run {self.exp_dir} ({state})>"

    @staticmethod
    def spawn(command: list[str], output: str | os.PathLike | None) -> subprocess.Popen:
        """The launcher as a child in its own session (a Ctrl-C reaches this process, which stops
        the run once, with SIGTERM: a second signal would cut its teardown short)."""
        if output is not None:   # its missing folders made private: it may be the run's own directory
            for folder in reversed([p for p in Path(output).absolute().parents if not p.exists()]):
                folder.mkdir(mode=0o700, exist_ok=True)
        out = open(output, "ab") if output is not None else None   # noqa: SIM115 (the child holds it)
        try:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_stop_with_parent)
        finally:
            if out is not None:
                out.close()

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def running(self) -> bool:
        return self.returncode is None

    @property
    def records(self) -> RunRecords:
        return RunRecords(self.exp_dir)

    def progress(self) -> dict:
        """Where the run stands: `{step, total_steps, running, reward_mean, time}` of the last
        trained step (step 0 before the first)."""
        steps = read_metrics(ExpDir(self.exp_dir), "trainer", "step") if self.exp_dir.is_dir() else []
        last = run_steps(steps)[-1] if steps else {}
        return {"step": last.get("step", 0), "total_steps": self.total_steps, "running": self.running(),
                "reward_mean": last.get("reward_mean"), "time": last.get("time")}

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the run as Ctrl-C stops `tandem run` (workers first, the trainer saves a
        checkpoint, nothing left running) and wait up to `timeout` seconds (None: until it has).
        Returns the exit status, or None if it is still stopping. Resume with `start(resume=True)`."""
        if self.running():
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> dict:
        """Wait until the run ends and return its summary (`RunRecords.summary`). Raises
        RunFailed if it did not finish, TimeoutError if `timeout` seconds passed first (the run
        goes on). Ctrl-C stops the run, then raises KeyboardInterrupt."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self.running():
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"the run in {self.exp_dir} is still going after {timeout} s")
                time.sleep(self.POLL_S)
        except KeyboardInterrupt:
            self.stop()
            raise
        if self.returncode != 0:
            raise RunFailed(self.exp_dir, self.returncode)
        return self.records.summary() or {}
