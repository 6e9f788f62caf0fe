"""`tandem`: one command, a sub-command per role and per user action.

Each package registers its own sub-commands (`register(sub)` in its cli module), so the
launcher starts every role the same way (`tandem controller --exp DIR`, `tandem trainer ...`)
without knowing its internals. A sub-command with `--exp` receives the experiment's resolved
config as `args.cfg`.
"""
from __future__ import annotations

import argparse
import os
import sys

from tandem.launcher.config import ConfigError, load_config, load_config_traced, load_experiment, to_yaml
from tandem.launcher.launcher_watch import watch_launcher_from_env
from tandem.launcher.placement import pin_from_env
from tandem.services.protocol import exit_process, raise_descriptor_limit
from tandem.services.protocol.private import set_umask

# Modules whose `register(sub)` adds sub-commands: each role package's own, then the launcher's.
COMMAND_MODULES = tuple(f"tandem.{name}" for name in (
    "services.cli", "rollout.cli", "rollout.worker_cli", "reward.cli", "trainer.cli", "launcher.run",
    "launcher.warmup", "launcher.report", "launcher.commands", "launcher.slurm_cli", "launcher.scale_requests",
    "launcher.audit"))


def _config_show(args) -> int:
    applied: dict = {}
    cfg = load_config(args.file, args.overrides, applied=applied)
    # Where the objective's keys came from: the trainer.algorithm preset, or set explicitly.
    kept = [k for k, (how, _) in applied.items() if how == "explicit"]
    print(f"# trainer.algorithm: {cfg.trainer.algorithm} (docs/algorithms.md); "
          f"{len(applied) - len(kept)} keys from the preset"
          + (f", set explicitly (kept): {', '.join(kept)}" if kept else ""))
    print(to_yaml(cfg), end="")
    return 0


def _config_check(args) -> int:
    from tandem.launcher.preflight import check_before_launch
    unmerged: list[str] = []
    cfg, prov = load_config_traced(args.file, args.overrides, deferred=unmerged)
    notes = check_before_launch(cfg, prov, files=not args.skip_files, earlier=unmerged)   # what `tandem run` checks
    skipped = " (model, data sets and episode function not checked)" if args.skip_files else ""
    print(f"{args.file}: OK (experiment '{cfg.experiment.name}', exp_dir {cfg.experiment.exp_dir}){skipped}")
    for note in notes:
        print(f"  {note}")
    return 0


def _config_docs(args) -> int:
    from tandem.launcher.config_docs import render
    print(render(), end="")
    return 0


def _add_config_commands(sub) -> None:
    p = sub.add_parser("config", help="show, check or document experiment configs")
    csub = p.add_subparsers(dest="config_cmd", required=True, metavar="{show,check,docs}")
    for name, fn, text in (("show", _config_show, "print the resolved config"),
                           ("check", _config_check, "validate a config file and everything a launch would check first")):
        c = csub.add_parser(name, help=text)
        c.add_argument("file", help="experiment YAML file")
        c.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.optim.lr=1e-6")
        c.set_defaults(func=fn)
        if name == "check":
            c.add_argument("--skip-files", action="store_true",
                           help="check the config and the layout only, not that the model, data sets and "
                                "episode function exist (a cluster's file checked away from its filesystem)")
    c = csub.add_parser("docs", help="print docs/configuration.md from the config dataclasses")
    c.set_defaults(func=_config_docs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Asynchronous RL for reasoning LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config_commands(sub)
    for name in COMMAND_MODULES:
        __import__(name, fromlist=["register"]).register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with `key=value` overrides also after an option (`tandem run FILE --resume
    trainer.total_steps=80`), which argparse alone refuses once an option ends the positionals."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    try:
        # A role started by the local launcher runs on its CPU pool, from before any thread starts.
        pin_from_env()
        # ... and stops when that launcher is gone, even if it could not stop it (SIGKILL).
        watch_launcher_from_env()
        raise_descriptor_limit()
        if getattr(args, "exp", None):
            args.cfg = load_experiment(args.exp)
            # What the role writes into the run is its user's own (the group's to read with
            # experiment.group_access): services/protocol/private.py.
            set_umask(args.cfg.experiment.group_access)
        code = args.func(args)
    except ConfigError as e:
        print(f"tandem: config error: {e}" + (f"\n({e.hint})" if e.hint else ""), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


def entry() -> None:
    """`tandem` as a program: the console script, and `python -m tandem.launcher.cli` (how every role starts)."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`tandem audit | head`): what it wanted it has. Python's own recipe:
        # point stdout at /dev/null so the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    exit_process(code)


if __name__ == "__main__":
    entry()
