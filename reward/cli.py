"""Sub-commands this package adds to `tandem` (see launcher.cli).

`tandem reward serve --exp DIR` runs the reward service; `tandem reward grade ...` grades a
JSONL file offline. Grader imports happen inside the handlers so `tandem --help` stays fast.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path


def _serve(args) -> int:
    from tandem.reward.service import serve
    return serve(args.exp, args.cfg.reward)


def _grade(args) -> int:
    from tandem.reward.config import RewardConfig
    from tandem.reward.offline import grade_file

    cfg = args.cfg.reward if getattr(args, "cfg", None) is not None else RewardConfig()
    if args.workers is not None:
        if args.workers < 1:
            print("tandem reward grade: --workers must be >= 1")
            return 2
        cfg = dataclasses.replace(cfg, num_workers=args.workers)
    return grade_file(args.task, args.input, args.output, cfg, quiet=args.quiet)


def register(sub) -> None:
    """Add this package's sub-commands to the `tandem` parser."""
    p = sub.add_parser("reward", help="the reward service and offline grading")
    rsub = p.add_subparsers(dest="reward_cmd", required=True, metavar="{serve,grade}")
    s = rsub.add_parser("serve", help="run the reward service of an experiment")
    s.add_argument("--exp", required=True, help="experiment directory (reads its `reward` config)")
    s.set_defaults(func=_serve)
    g = rsub.add_parser("grade", help="grade a JSONL file of responses (math or code)")
    g.add_argument("--task", required=True, choices=["math", "code"])
    g.add_argument("--input", required=True, type=Path,
                   help="JSONL rows {id, response, answer} (math) or {id, response, tests} (code)")
    g.add_argument("--output", required=True, type=Path, help="JSONL: each row plus reward, correct, details")
    g.add_argument("--exp", default=None, help="take the `reward` config (rewards, limits) from this experiment")
    g.add_argument("--workers", type=int, default=None, help="grader processes (default: reward.num_workers)")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    g.set_defaults(func=_grade)
