"""The two tracking sinks `trackers.TrackerFollower` feeds: TensorBoard event files and W&B.

Both are called from the follower's thread only. Their packages (the `trackers` extra) are
imported when a sink opens, so nothing else pays for them and a missing one disables only its
sink (config loading already refuses a tracker whose package is missing).
"""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

import yaml

from .expdir import write_json_atomic

# The columns of a sample as the sinks show it (trackers.sample_rows makes the rows).
SAMPLE_COLUMNS = ("step", "group", "reward", "version", "prompt", "response")


class TensorBoardSink:
    """Scalars under `<exp>/tb/` (one event file per trainer launch; TensorBoard reads the
    directory as one run), the resolved config as text at step 0, and each step's sample
    completions as text (`samples`, in the TEXT tab)."""
    name = "tensorboard"

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.writer = None

    def open(self, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        if config:
            # Indented by four spaces: TensorBoard's text plugin renders it as a code block.
            text = yaml.safe_dump(config, sort_keys=False)
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step, walltime=wall_time)

    def samples(self, rows: list[list], step: int) -> None:
        """One markdown text per step: each sample's reward and versions as a heading, its prompt
        and response indented (a code block: their newlines kept, nothing read as markdown)."""
        parts = []
        for _step, group, reward, version, prompt, response in rows:
            parts.append(f"**{group}**: reward {reward}, {version}\n\n" + _indent(prompt) + "\n\n" + _indent(response))
        self.writer.add_text("samples", "\n\n---\n\n".join(parts), step)

    def rewind(self, step: int) -> None:
        """Points from `step` on belong to an abandoned launch: a SessionLog START at `step` makes
        TensorBoard drop them (what `SummaryWriter(purge_step=...)` writes)."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.writer._get_file_writer().add_event(
            Event(step=step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START)))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbSink:
    """A W&B run: offline by default (`<exp>/wandb/offline-run-*`, no network, no login; `wandb
    sync` uploads it), online on request. Every metric is charted against the record's `step`
    (`define_metric(..., step_metric="step")`), so a held-out evaluation that lands after later
    trainer steps is still drawn at its own step. A resumed trainer continues the same run id
    (`<exp>/trackers/wandb.json`); `wandb sync` uploads the offline pieces of one id in order.
    W&B cannot forget points, so a step a resumed trainer trains again appears twice there."""
    name = "wandb"

    def __init__(self, exp_root: str | Path, mode: str = "offline", project: str = "tandem",
                 entity: str | None = None, name: str | None = None, id_file: str | Path | None = None):
        self.exp_root, self.mode, self.project, self.entity, self.run_name = Path(exp_root), mode, project, entity, name
        self.id_file = Path(id_file) if id_file else self.exp_root / "trackers" / "wandb.json"
        self.run = None
        self._defined: set[str] = set()

    def open(self, config: dict) -> None:
        import wandb

        if self.mode == "online" and not wandb.login(prompt=False, verify=False):
            raise RuntimeError("W&B online mode needs WANDB_API_KEY in the environment (or `wandb login` "
                               "on this machine); use experiment.wandb.mode=offline to log without it")
        # W&B otherwise advertises its LLM tracer on the console when an LLM client library
        # (openai, ...) happens to be imported in the process; nothing here uses it.
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        settings = wandb.Settings(
            mode=self.mode, silent=True, console="off",   # never wrap the trainer's stdout/stderr
            x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
            disable_git=True, disable_code=True, save_code=False, x_save_requirements=False)
        self.run = wandb.init(project=self.project, entity=self.entity, name=self.run_name, id=self._run_id(),
                              resume="allow", dir=str(self.exp_root), config=config, settings=settings)
        self.run.define_metric("step")

    def _run_id(self) -> str:
        try:
            return json.loads(self.id_file.read_text())["id"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
            run_id = secrets.token_hex(4)
            write_json_atomic(self.id_file, {"id": run_id})
            return run_id

    def log(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        for key in values.keys() - self._defined:
            self.run.define_metric(key, step_metric="step")
            self._defined.add(key)
        self.run.log({**values, "step": step})

    def samples(self, rows: list[list], step: int) -> None:
        """A table per step under `samples` (W&B's Tables; the UI steps through them)."""
        import wandb

        if "samples" not in self._defined:
            self.run.define_metric("samples", step_metric="step")
            self._defined.add("samples")
        self.run.log({"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows), "step": step})

    def flush(self) -> None:
        pass   # the run's service process writes (or sends) what it was given

    def close(self) -> None:
        if self.run is not None:
            import wandb

            run, self.run = self.run, None
            try:
                run.finish()
            finally:
                # Stops W&B's service process now rather than in an atexit hook, which would
                # print a traceback at the trainer's exit if that process was already gone
                # (SIGTERM reaches the trainer's whole process group).
                wandb.teardown()


def _indent(text: str) -> str:
    """Markdown's indented code block (TensorBoard's text plugin renders it as written)."""
    return "\n".join("    " + line for line in (text or " ").splitlines() or [" "])
