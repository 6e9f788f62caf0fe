"""An experiment composed in Python: a YAML file, overrides and edits, checked and launched as
`tandem run` checks and launches it.

Edits are kept as `key=value` overrides (the values written as JSON, which the config's YAML
reader reads back exactly), so an experiment composed here resolves through the one loader the
command line uses: the same defaults, presets, interpolation and checks, and every mistake names
the key it is about. A launch is the `tandem run` command in a child process: the launcher
installs signal handlers, redirects its output and starts process groups, none of which belongs
in the caller's interpreter (a notebook, a sweep script), and the caller keeps a handle on it
(`tandem.runs.Run`).
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tandem.launcher.config import ConfigError, ExperimentConfig, load_config_traced, to_yaml
from tandem.launcher.preflight import check_before_launch
from tandem.launcher.run import check_launch_target

from .runs import Run


class Experiment:
    """An experiment to check and run: `file` (an experiment YAML file, or None for the defaults)
    with `overrides` (`key=value` strings, as on the command line) and edits made with `set`."""

    def __init__(self, file: str | os.PathLike | None = None, overrides: Iterable[str] = ()):
        self.file = Path(file) if file is not None else None
        self.overrides: list[str] = list(overrides)

    def __repr__(self) -> str:
        return f"Experiment({str(self.file) if self.file else None!r}, {self.overrides!r})"

    def set(self, key: str, value: Any) -> Experiment:
        """Set one key (dotted, e.g. `trainer.total_steps`) to a Python value; returns the
        experiment, so edits chain. A later setting of the same key wins."""
        if not key or "=" in key or key != key.strip():
            raise ConfigError(f"Experiment.set: {key!r} is not a config key (dotted, e.g. trainer.total_steps)")
        self.overrides.append(f"{key}={json.dumps(value)}")
        return self

    @property
    def config(self) -> ExperimentConfig:
        """The resolved configuration (a copy: edit with `set`, not by assigning to it)."""
        return load_config_traced(self.file, self.overrides)[0]

    @property
    def exp_dir(self) -> Path:
        """Where the run writes everything (`experiment.exp_dir`)."""
        return Path(self.config.experiment.exp_dir)

    def yaml(self) -> str:
        """The resolved configuration as `tandem config show` prints it."""
        return to_yaml(self.config)

    def check(self, files: bool = True) -> list[str]:
        """What `tandem config check` checks: raises ConfigError naming every problem; returns
        what was found worth saying (each data set's format and rows). `files=False` checks the
        configuration alone (not the model, data sets or functions it names)."""
        unmerged: list[str] = []
        cfg, prov = load_config_traced(self.file, self.overrides, deferred=unmerged)
        return check_before_launch(cfg, prov, files=files, earlier=unmerged)

    def command(self, resume: bool = False) -> list[str]:
        """The `tandem run` command line that launches this experiment (what `start` runs)."""
        file = self.file if self.file is not None else os.devnull   # an empty file: the defaults
        return [sys.executable, "-m", "tandem.launcher.cli", "run", str(file), *self.overrides,
                *(["--resume"] if resume else [])]

    def start(self, resume: bool = False, output: str | os.PathLike | None = None) -> Run:
        """Launch the run in the background and return its handle. Everything `tandem run` refuses
        before starting (a config mistake, a directory that already holds an experiment without
        `resume`) raises ConfigError here, before any process starts. `output`: a file for the
        launcher's console (progress lines); None leaves it on this process's stdout."""
        unmerged: list[str] = []
        cfg, prov = load_config_traced(self.file, self.overrides, deferred=unmerged)
        check_before_launch(cfg, prov, earlier=unmerged)
        check_launch_target(cfg, resume)
        proc = Run.spawn(self.command(resume), output)
        return Run(Path(cfg.experiment.exp_dir), proc, cfg.trainer.total_steps)

    def run(self, resume: bool = False, output: str | os.PathLike | None = None) -> dict:
        """Launch the run and wait for it: its summary (`<exp>/summary.json`: steps, held-out
        accuracy before and after, staleness, throughput). Ctrl-C stops the run cleanly (the
        trainer saves a checkpoint) and raises KeyboardInterrupt; a failed run raises RunFailed."""
        return self.start(resume, output).wait()
