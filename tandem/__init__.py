"""Tandem: fully asynchronous RL for reasoning language models — the Python API beside the
`tandem` command.

Compose an experiment from a YAML file, overrides and edits; check it; run it, waiting for it or
in the background; read any run's records as Python objects::

    import tandem

    exp = tandem.Experiment("configs/math-tiny.yaml", ["trainer.total_steps=20"])
    exp.set("experiment.exp_dir", "runs/from-python")
    exp.check()                     # what `tandem config check` checks; raises tandem.ConfigError
    run = exp.start()               # `tandem run` in the background: run.progress(), run.stop()
    summary = run.wait()            # summary.json: summary["eval"]["after"] is the held-out accuracy
    records = tandem.open_run("runs/from-python")
    records.steps(), records.eval_curve(), records.audit(), records.export("my-model")

An agent to train (`rollout.agent`, docs/agents.md) returns `tandem.AgentResult` and may run its
tools through `tandem.Toolbox`.

The roles import a reward function, workflow or agent named by `module:function` from the directory
the run was launched in, then from `PYTHONPATH` (docs/running.md, "Your own code").
"""
from __future__ import annotations

import importlib

# Loaded on first use: every role imports a `tandem.<package>` module, which runs this file
# first, and a role must not pay for (or depend on) the launcher's API it never calls.
_API = {"Experiment": "tandem.experiment", "Run": "tandem.runs", "RunFailed": "tandem.runs",
        "RunRecords": "tandem.runs", "open_run": "tandem.runs", "Audit": "tandem.launcher.audit",
        "ConfigError": "tandem.launcher.config", "ExperimentConfig": "tandem.launcher.config",
        # for agents (rollout.agent, docs/agents.md)
        "AgentResult": "tandem.rollout.agent", "EpisodeLimit": "tandem.rollout.agent_client",
        "Toolbox": "tandem.rollout.agent_tools", "ToolFailed": "tandem.rollout.agent_tools",
        "sandboxed_python": "tandem.rollout.agent_tools"}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
