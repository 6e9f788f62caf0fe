"""Sub-commands this package adds to `tandem` (see launcher.cli).

`tandem trainer --exp DIR [--resume]` runs one trainer rank (every rank runs the same command;
with several ranks, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT come from the launcher). Heavy
imports (torch, transformers) happen inside the handler so `tandem --help` stays fast.
"""
from __future__ import annotations

import os


def _trainer(args) -> int:
    import torch

    from services.protocol import ExpDir, setup_role_logging
    from trainer.loop import run_trainer

    threads = args.threads or int(os.environ.get("TANDEM_THREADS", "0")) or args.cfg.trainer.threads
    torch.set_num_threads(threads)
    rank = int(os.environ.get("RANK", "0"))
    setup_role_logging(ExpDir(args.exp), "trainer", rank)
    try:
        return run_trainer(args.cfg, args.exp, resume=args.resume)
    except SystemExit as e:  # a clear refusal (e.g. checkpoints exist without --resume)
        if isinstance(e.code, str):
            import logging
            logging.getLogger("trainer").error(e.code)
            return 2
        raise


def register(sub) -> None:
    """Add this package's sub-commands to the `tandem` parser."""
    p = sub.add_parser("trainer", help="run a trainer rank (replay buffer, decoupled PPO, weight publishing)")
    p.add_argument("--exp", required=True, help="experiment directory (holds config.yaml)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in <exp>/checkpoints (version, buffer, "
                        "optimizer); without one, start at version 0")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: $TANDEM_THREADS, else trainer.threads)")
    p.set_defaults(func=_trainer)
