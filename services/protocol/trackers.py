"""Tracking sinks (TensorBoard, W&B) fed from `<exp>/metrics.jsonl`, the run's record.

Why a follower and not a second writer: every role already appends its records to
`metrics.jsonl`, and the report, `summary.json` and `tandem audit` read only that file. Feeding the
trackers from the same file gives the same metric names and values everywhere, and lets one
process (the trainer's rank 0) own the trackers without any other role knowing they exist: the
rollout worker's held-out evaluation reaches W&B through the file like the trainer's steps.

Why a thread that reads a file: no role may wait on a slow sink (a W&B server that stalls, a
full disk under `<exp>/tb/`). The trainer only starts and stops the follower; the follower's
daemon thread reads what was appended since its byte offset and is the only caller of the
sinks. A sink that raises is logged once and disabled; the others and the run go on.

Why a persisted offset: a resumed trainer must neither log the earlier launch's records twice
nor lose the ones it had not forwarded yet. After the sinks flushed, the follower writes the
offset it has forwarded up to in `<exp>/trackers/offset.json` (atomically); a new follower
starts there. A last line without its newline is being written and waits for the next poll.
A resumed trainer trains the steps after its checkpoint again; the first such step record tells
the sinks to `rewind` (TensorBoard drops the abandoned launch's points from that step on, as
`launcher.progress.run_steps` does for the summary).

The trainer's `samples` records (trainer/samples.py: a few prompts and responses with their
reward and versions) go to a sink's `samples(rows, step)`: a W&B table, TensorBoard text.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

from .expdir import ExpDir, write_json_atomic

log = logging.getLogger(__name__)

# `jsonl` is `<exp>/metrics.jsonl`, always written; naming it in `experiment.trackers` is allowed.
TRACKERS = ("jsonl", "tensorboard", "wandb")
# The Python package each optional tracker needs, all in the `trackers` extra.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",)}
WANDB_MODES = ("offline", "online")
# Bookkeeping fields of every record, not metrics: `step` is the x axis, `time` the wall clock.
NOT_METRICS = frozenset({"step", "time", "rank"})
# Cheap byte test before parsing: most lines are rollout records no tracker shows (MetricsWriter
# writes json.dumps's default separators; the parsed record is checked again).
_WANTED = (b'"event": "step"', b'"event": "eval"', b'"event": "samples"')


@dataclass
class WandbConfig:
    """W&B settings of `experiment.trackers: [..., wandb]`. The API key comes from the
    environment (WANDB_API_KEY) or an earlier `wandb login`, never from the experiment file."""
    # offline: the run goes to <exp>/wandb/offline-run-* with no network (upload it later with
    # `wandb sync`); online: streamed to the W&B server.
    mode: str = "offline"
    # W&B project the run is filed under.
    project: str = "tandem"
    # W&B user or team; null = the account's default.
    entity: str | None = None
    # The run's display name; null = experiment.name.
    name: str | None = None

    def problems(self) -> list[tuple[str, str]]:
        if self.mode not in WANDB_MODES:
            return [("mode", f"must be one of {', '.join(WANDB_MODES)}, got {self.mode!r}")]
        return []


def tracker_problems(trackers: list[str], wandb: WandbConfig) -> list[tuple[str, str]]:
    """Config errors of `experiment.trackers` / `experiment.wandb`, by key: an unknown tracker,
    or one whose package is not installed (caught before any role starts)."""
    out = []
    for i, name in enumerate(trackers):
        if name not in TRACKERS:
            out.append((f"trackers[{i}]", f"unknown tracker {name!r}; choose from {', '.join(TRACKERS)}"))
        elif any(importlib.util.find_spec(pkg) is None for pkg in TRACKER_PACKAGES.get(name, ())):
            out.append((f"trackers[{i}]", f"{name} is not installed: pip install 'tandem[trackers]' (offline: "
                                          f"`make wheelhouse EXTRAS=trackers`), or leave {name} out of the list"))
    if "wandb" in trackers:
        out += [(f"wandb.{k}", m) for k, m in wandb.problems()]
    return out


def tracked(rec: dict) -> tuple[int, dict[str, float]] | None:
    """(x, {metric: value}) of a record the trackers show, else None: the trainer's step
    records and held-out evaluations, with their finite numeric fields under their jsonl names
    (bools, strings, lists, histograms, NaN and infinities are left out)."""
    event = rec.get("event")
    if not (event == "eval" or (event == "step" and rec.get("role") == "trainer")):
        return None
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    values = {k: v for k, v in rec.items()
              if k not in NOT_METRICS and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
    return step, values


def sample_rows(rec: dict) -> list[list]:
    """The rows (tracker_sinks.SAMPLE_COLUMNS) of a trainer's `samples` record; [] for any other."""
    step = rec.get("step")
    if rec.get("event") != "samples" or rec.get("role") != "trainer" or isinstance(step, bool) \
            or not isinstance(step, int) or not isinstance(rec.get("samples"), list):
        return []
    rows = []
    for r in rec["samples"]:
        lo, hi = r.get("version_min"), r.get("version_max")
        rows.append([step, f"{r.get('group_id')}/{r.get('sample_idx')}", r.get("reward"),
                     f"v{lo}" if lo == hi else f"v{lo}-v{hi}", r.get("prompt", ""), r.get("response", "")])
    return rows


class TrackerFollower:
    """Follows `<exp>/metrics.jsonl` from its persisted offset and forwards tracked records.

    A sink is any object with `name`, `open(config)`, `log(values, step, wall_time)`, `flush()`
    and `close()`, and optionally `rewind(step)` and `samples(rows, step)` (rows of
    tracker_sinks.SAMPLE_COLUMNS, from the trainer's `samples` records). `start()`/`stop()`
    run it in a daemon thread; `open()`, `poll()` and `close()` are the same steps, callable
    directly (tests).
    """

    def __init__(self, exp: ExpDir, sinks: list, config: dict | None = None, poll_s: float = 2.0,
                 chunk_bytes: int = 1 << 22):
        self.exp, self.sinks, self.config, self.poll_s = exp, list(sinks), config, poll_s
        self.chunk_bytes = chunk_bytes
        self.state_path = exp.root / "trackers" / "offset.json"
        state = _read_json(self.state_path)
        self.offset = int(state.get("offset", 0))
        self.last_step: int | None = state.get("last_step")   # highest trainer step forwarded
        self.disabled: dict[str, str] = {}                    # sink name -> why
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- in a thread --------------------------------------------------------------------------
    def start(self) -> TrackerFollower:
        self._thread = threading.Thread(target=self._run, name="trackers", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Forward what is left, flush and close the sinks; wait at most `timeout_s` (a stalled
        sink must not hold the process). True when the thread finished."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("trackers did not finish within %.0f s; the last records may be missing from %s",
                        timeout_s, ", ".join(s.name for s in self._active()))
            return False
        return True

    def _run(self) -> None:
        try:
            self.open()
            while not self._stop.wait(self.poll_s):
                self.poll()
            self.poll()   # the records written just before stop()
        except Exception:
            log.exception("the tracker follower failed; metrics.jsonl is unaffected")
        finally:
            self.close()

    # ---- the steps ----------------------------------------------------------------------------
    def open(self) -> None:
        config = self.config if self.config is not None else _read_config(self.exp.root / "config.yaml")
        self._each("open", config)

    def poll(self) -> int:
        """Forward the complete lines appended since the offset, flush the sinks, persist the
        offset; returns the number of records forwarded."""
        start, forwarded = self.offset, 0
        try:
            f = open(self.exp.metrics, "rb")
        except FileNotFoundError:
            return 0
        with f:
            if f.seek(0, 2) < self.offset:
                log.warning("%s is shorter than the trackers' offset %d; following it from the start",
                            self.exp.metrics, self.offset)
                self.offset = start = 0
            f.seek(self.offset)
            pending = b""
            while block := f.read(self.chunk_bytes):
                data = pending + block
                end = data.rfind(b"\n") + 1
                for line in data[:end].splitlines():
                    forwarded += self._forward(line)
                self.offset += end
                pending = data[end:]
        if self.offset != start:
            self._each("flush")
            write_json_atomic(self.state_path, {"offset": self.offset, "last_step": self.last_step})
        return forwarded

    def close(self) -> None:
        self._each("close")

    # ---- internals ----------------------------------------------------------------------------
    def _forward(self, line: bytes) -> int:
        if not any(marker in line for marker in _WANTED):
            return 0
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return 0   # a line cut by a crash mid-write
        if isinstance(rec, dict) and (rows := sample_rows(rec)):
            self._each("samples", rows, rec["step"])
            return 1
        point = tracked(rec) if isinstance(rec, dict) else None
        if point is None:
            return 0
        step, values = point
        if rec.get("event") == "step":
            if self.last_step is not None and step <= self.last_step:
                self._each("rewind", step)   # a resumed trainer trains this step again
            self.last_step = step
        if values:
            self._each("log", values, step, rec.get("time"))
        return 1

    def _active(self) -> list:
        return [s for s in self.sinks if s.name not in self.disabled]

    def _each(self, method: str, *args) -> None:
        for sink in self._active():
            call = getattr(sink, method, None)
            if call is None:
                continue
            try:
                call(*args)
            except Exception as e:
                self.disabled[sink.name] = f"{type(e).__name__}: {e}"
                log.warning("tracker %s failed (%s: %s: %s); it is off for the rest of this run, "
                            "metrics.jsonl and the other trackers go on", sink.name, method, type(e).__name__, e)
                if method != "close":
                    try:
                        sink.close()
                    except Exception:
                        pass


def build_sinks(names: list[str], exp: ExpDir, wandb: WandbConfig | None = None,
                run_name: str | None = None) -> list:
    """The sinks of `experiment.trackers` (jsonl needs none: it is the followed file itself)."""
    from . import tracker_sinks

    wandb = wandb or WandbConfig()
    sinks = []
    if "tensorboard" in names:
        sinks.append(tracker_sinks.TensorBoardSink(exp.root / "tb"))
    if "wandb" in names:
        sinks.append(tracker_sinks.WandbSink(exp.root, mode=wandb.mode, project=wandb.project,
                                             entity=wandb.entity, name=wandb.name or run_name,
                                             id_file=exp.root / "trackers" / "wandb.json"))
    return sinks


def _follower(cfg, exp: ExpDir, poll_s: float = 2.0) -> TrackerFollower | None:
    section = getattr(cfg, "experiment", None)
    names = [n for n in (getattr(section, "trackers", None) or ()) if n != "jsonl"]
    if not names:
        return None
    sinks = build_sinks(names, exp, getattr(section, "wandb", None), getattr(section, "name", None))
    return TrackerFollower(exp, sinks, poll_s=poll_s)


def start_trackers(cfg, exp: ExpDir, poll_s: float = 2.0) -> TrackerFollower | None:
    """Start following for the trackers `cfg.experiment.trackers` names; None when there are
    none besides jsonl. Called once per launch, by the trainer's rank 0."""
    follower = _follower(cfg, exp, poll_s)
    if follower:
        log.info("trackers: %s (fed from %s)", ", ".join(s.name for s in follower.sinks), exp.metrics)
        follower.start()
    return follower


def finish_trackers(cfg, exp: ExpDir) -> int:
    """Forward what the run logged after its trainer stopped (the evaluation of the trained
    policy), from the trainer's persisted offset. Called by the launcher once the trainer is
    gone, so the trackers still have one writer at a time. Returns the records forwarded."""
    follower = _follower(cfg, exp)
    if follower is None:
        return 0
    follower.open()
    try:
        return follower.poll()
    finally:
        follower.close()


def tracker_hints(trackers: list[str], wandb: WandbConfig | None, exp_root: str | Path) -> list[str]:
    """Where a finished run's trackers are, as lines for the user."""
    root = Path(exp_root)
    out = []
    if "tensorboard" in trackers:
        out.append(f"tensorboard: tensorboard --logdir {root / 'tb'}  (all runs: --logdir {root.parent})")
    if "wandb" in trackers:
        if (wandb or WandbConfig()).mode == "offline":
            out.append(f"wandb (offline): wandb sync {root / 'wandb'}/offline-run-*")
        else:
            out.append(f"wandb: streamed online to project {(wandb or WandbConfig()).project}")
    return out


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _read_config(path: Path) -> dict:
    try:
        obj = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return obj if isinstance(obj, dict) else {}
