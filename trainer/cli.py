"""Sub-commands this package adds to `tandem` (see launcher.cli).

`tandem trainer --exp DIR [--resume]` runs one trainer rank (every rank runs the same command;
with several ranks, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT come from the launcher).
`tandem export --exp DIR [--version N] [--adapter] OUT` writes a run's policy as a Hugging Face
directory, or a LoRA run's adapters as peft's (trainer/hf_export.py: the trainer owns its
checkpoint formats). Heavy imports (torch, transformers) happen inside the handlers so
`tandem --help` stays fast.
"""
from __future__ import annotations

import os


def _trainer(args) -> int:
    import torch

    from tandem.services.protocol import ExpDir, setup_role_logging
    from tandem.trainer.loop import run_trainer

    threads = args.threads or int(os.environ.get("TANDEM_THREADS", "0")) or args.cfg.trainer.threads
    torch.set_num_threads(threads)
    rank = int(os.environ.get("RANK", "0"))
    setup_role_logging(ExpDir(args.exp), "trainer", rank)
    try:
        return run_trainer(args.cfg, args.exp, resume=args.resume)
    except SystemExit as e:  # a clear refusal (e.g. checkpoints exist without --resume)
        if isinstance(e.code, str):
            import logging
            logging.getLogger("tandem.trainer").error(e.code)
            return 2
        raise


def _export(args) -> int:
    import json
    import sys

    from tandem.trainer.hf_export import NoSuchCheckpoint, NotConvertible, export_run

    cfg = args.cfg
    try:
        done = export_run(args.exp, cfg.experiment.model, args.out, args.version, args.source,
                          cfg.trainer.megatron.vocab_multiple, adapter=args.adapter)
    except NoSuchCheckpoint as e:
        print(f"tandem export: {e}", file=sys.stderr)
        return 2
    except NotConvertible as e:
        print(f"tandem export: {e}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(done))
    else:
        final = " (the run's newest)" if done["final"] else ""
        loads = (f"PeftModel.from_pretrained(<{cfg.experiment.model}>, {done['out']!r})" if done["adapter"] else
                 f"AutoModelForCausalLM.from_pretrained({done['out']!r})")
        what = "the LoRA adapters of " if done["adapter"] else ""
        print(f"exported {what}v{done['version']}{final} from {done['from']} ({done['dtype']}) to {done['out']}: "
              f"{loads} loads it")
    return 0


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
    e = sub.add_parser("export", help="write a run's policy as a Hugging Face model directory (both backends)")
    e.add_argument("--exp", required=True, help="experiment directory")
    e.add_argument("--version", default=None,
                   help="vN or N (default: the newest version the run holds, its final one once it ended)")
    e.add_argument("--from", dest="source", choices=("auto", "weights", "checkpoint"), default="auto",
                   help="auto: <exp>/weights/vN when kept, else <exp>/checkpoints/step-N; or only one of them")
    e.add_argument("--adapter", action="store_true",
                   help="a trainer.lora run: write its LoRA adapters (peft's adapter_config.json and "
                        "adapter_model.safetensors, from a checkpoint or an adapter publication) instead "
                        "of the merged model")
    e.add_argument("--json", action="store_true", help="print what was exported as one JSON object")
    e.add_argument("out", help="output directory (new or empty)")
    e.set_defaults(func=_export)
