"""`tandem run FILE [overrides] [--resume]`: one experiment end to end on the chosen backend.

This module prepares the run — the resolved config, the experiment directory, fresh keys —
and hands it to the lifecycle (`launcher/lifecycle.py`), which is the same on every backend.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tandem.services.protocol import ExpDir, generate_keys, numbered_dirs, read_metrics
from tandem.services.protocol.private import (
    NotPrivate,
    check_ancestors,
    check_private_dir,
    make_private_dir,
    set_umask,
)

from .backends import backend_for
from .config import ConfigError, ExperimentConfig, load_config_traced, load_experiment, save_resolved
from .console import keep_output_going
from .continuation import keep_going, own_limit_reached, requeue_own_job
from .exp_lock import ExperimentInUse, hold_experiment
from .lifecycle import run_experiment
from .preflight import check_before_launch
from .roles import GEN_ADMIN_KEY, GEN_API_KEY
from .run_info import record_launch


def prepare(file: str | None, overrides: list[str], resume: bool,
            exclusive: bool = False) -> tuple[ExperimentConfig, ExpDir]:
    """Resolve the config and create (or reopen, with --resume) the experiment directory; with
    `exclusive` (a launch), hold it against a second launch before changing anything in it."""
    unmerged: list[str] = []   # said with the checks below: one mistake never hides another
    cfg, prov = load_config_traced(file, overrides, deferred=unmerged)
    # What `tandem config check` checks, before the directory exists or any job is submitted: the
    # layout (sets gen.num_servers from the plan with sglang), the data sets, the model, the
    # episode function.
    check_before_launch(cfg, prov, earlier=unmerged)
    exp = check_launch_target(cfg, resume)
    set_umask(cfg.experiment.group_access)   # what the launcher and the roles it starts create: private
    if exp.config.exists() and not resume:   # a launch that never trained (check_launch_target)
        set_aside(exp, exclusive)
    # Made before the directory, so an adapter that does not fit the model stops nothing half-made.
    adapter = initial_adapter(cfg) if cfg.trainer.lora.adapter_sync and not exp.initial_adapter.is_dir() else None
    try:
        make_private_dir(exp.root, cfg.experiment.group_access)
        if exclusive:
            hold_experiment(exp.root)
    except (ExperimentInUse, OSError) as e:
        if adapter is not None:
            shutil.rmtree(adapter.parent, ignore_errors=True)
        if isinstance(e, NotPrivate):
            raise ConfigError(f"experiment.exp_dir: {e}") from None
        if isinstance(e, OSError):
            raise ConfigError(f"experiment.exp_dir: cannot create {exp.root}: {e.strerror or e}") from None
        raise
    save_resolved(cfg, exp.root)
    record_launch(exp.root, file, resume)   # file, commit and time: the report's title
    generate_keys(exp.keys)   # the run's keys; each rollout worker's is made as it is started (lifecycle.py)
    write_gen_keys(exp)
    if adapter is not None:   # kept by a resume: its servers restart with it and are caught up
        shutil.move(str(adapter), exp.initial_adapter)
        shutil.rmtree(adapter.parent, ignore_errors=True)
    return cfg, exp


def check_launch_target(cfg: ExperimentConfig, resume: bool) -> ExpDir:
    """The experiment directory a launch would use, refused (ConfigError) when it cannot: a new
    launch into a directory that holds an experiment, a resume of one that holds none or of one
    whose groups per step or model architecture differ."""
    exp = ExpDir(cfg.experiment.exp_dir)
    group = cfg.experiment.group_access
    try:
        check_ancestors(exp.root)
        if exp.root.exists() or exp.root.is_symlink():
            check_private_dir(exp.root, group)
    except NotPrivate as e:
        raise ConfigError(f"experiment.exp_dir: {e}") from None
    if exp.config.exists():
        if not resume and trained(exp):
            raise ConfigError(f"{exp.root} already holds an experiment; pass --resume to continue it, "
                              f"or choose another experiment.name / experiment.exp_dir")
        if not resume:   # a launch that failed before it trained: set aside by `prepare`
            return exp
        previous = load_experiment(exp.root)
        if previous.trainer.groups_per_step != cfg.trainer.groups_per_step:
            raise ConfigError("trainer.groups_per_step differs from the run being resumed; "
                              "staleness accounting would not agree")
        check_same_architecture(previous.experiment.model, cfg.experiment.model)
    elif resume:
        raise ConfigError(f"--resume: {exp.root} holds no experiment to resume")
    return exp


def trained(exp: ExpDir) -> bool:
    """Whether the run in `exp` has trained a step (a checkpoint, or a step record)."""
    return bool(numbered_dirs(exp.checkpoints, "step-")) or bool(read_metrics(exp, "trainer", "step"))


def set_aside(exp: ExpDir, exclusive: bool) -> Path:
    """Move a launch that failed before it trained to `<exp>.failed-<time>` (its config and logs
    stay there to read), so the same command starts again: before, it was refused as a directory
    that "already holds an experiment", for a run that had never started. A launch holding it
    now (it may be starting) is refused as ever (the lock)."""
    if exclusive:
        hold_experiment(exp.root)
    aside = exp.root.with_name(f"{exp.root.name}.failed-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(exp.root, aside)
    print(f"{exp.root} held a launch that never trained; moved it to {aside} (its logs are there) "
          f"and starting again", flush=True)
    return aside


# What a checkpoint's tensors are shaped by: another value cannot load it.
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "vocab_size")


def check_same_architecture(before: str, now: str) -> None:
    """A resume may point experiment.model elsewhere (a moved directory, the same model's other
    copy) but not at another architecture: the checkpoint holds the first one's tensors, and the
    trainer would fail on its first shape after every role had started. Compared where both are
    local directories with a config.json (a hub id is not looked up here)."""
    if before == now:
        return
    configs = []
    for path in (before, now):
        try:
            configs.append(json.loads((Path(path) / "config.json").read_text()))
        except (OSError, ValueError):
            return
    differ = [f"{k} {configs[0].get(k)} -> {configs[1].get(k)}" for k in ARCHITECTURE_KEYS
              if configs[0].get(k) != configs[1].get(k)]
    if differ:
        raise ConfigError(f"experiment.model: {now} is another architecture than the run being resumed was "
                          f"started with ({before}: {', '.join(differ)}); its checkpoints hold that model's "
                          f"tensors. Resume with experiment.model={before}, or start a new experiment")


def initial_adapter(cfg: ExperimentConfig):
    """Version 0 of a LoRA run's adapter (zeros: the base model), which every generation server
    starts serving under the policy's adapter name, in a temporary directory; ConfigError when
    trainer.lora does not fit experiment.model."""
    from tandem.trainer.lora import lora_settings, write_initial_adapter

    tmp = Path(tempfile.mkdtemp(prefix="tandem-adapter-v0-"))
    try:
        return write_initial_adapter(lora_settings(cfg.trainer.lora), cfg.experiment.model, tmp / "adapter-v0")
    except (ValueError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"trainer.lora: cannot make version 0's adapter on {cfg.experiment.model}: {e}") from None


def write_gen_keys(exp: ExpDir) -> None:
    """Fresh random API and admin keys for this launch, each created 0600 (never world-readable,
    not even for an instant) and swapped in atomically."""
    for name in (GEN_API_KEY, GEN_ADMIN_KEY):
        path, tmp = exp.keys / name, exp.keys / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            # The prefix keeps a key from starting with "-": SGLang turns its --config file into
            # command-line options in-process, where such a value would parse as a flag.
            f.write(f"tandem-{secrets.token_urlsafe(32)}\n")
        os.replace(tmp, path)


def cmd_run(args) -> int:
    try:
        cfg, exp = prepare(args.file, args.overrides, args.resume, exclusive=True)
    except ExperimentInUse as e:
        print(f"tandem run: {e}", file=sys.stderr, flush=True)
        return 2
    keep_output_going(exp.logs)   # a closed pipe or a dropped terminal must not end the run
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s: %(message)s")
    if shutil.which("bwrap") is None and cfg.reward.task == "code":
        print("note: bubblewrap is missing; generated code runs with rlimits only", flush=True)
    backend = backend_for(cfg, exp)
    code = run_experiment(cfg, exp, args.resume, backend)
    if cfg.launcher.backend == "slurm":   # the cluster ended a job: go on as --resume would

        def resume():   # this launcher still holds the experiment's lock
            again_cfg, again_exp = prepare(args.file, args.overrides, True)
            again = backend_for(again_cfg, again_exp)
            return run_experiment(again_cfg, again_exp, True, again), again, again_exp

        s = cfg.launcher.slurm
        code = keep_going(code, backend, exp, s.auto_resume, s.auto_resume_backoff_s, resume)
        if code == 130 and own_limit_reached():   # slurm/train.sbatch's job nears its limit
            code = requeue_own_job(exp, s.auto_resume)
    if code in (1, 130) and exp.config.exists():   # stopped or failed: the run can go on
        again = shlex.join(["tandem", "run", args.file, *args.overrides, "--resume"])
        print(f"stopped; continue this run (from its last checkpoint, if any) with: {again}", flush=True)
    return code


def register(sub) -> None:
    p = sub.add_parser("run", help="run an experiment on the backend its launcher section names (local or slurm)")
    p.add_argument("file", help="experiment YAML file")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.total_steps=20")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.set_defaults(func=cmd_run)
