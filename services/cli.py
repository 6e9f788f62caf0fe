"""Sub-commands this package adds to `tandem` (see launcher.cli).

`tandem controller --exp DIR` runs the controller of an experiment; with `--status` it prints
the running controller's state instead. Imports happen inside the handlers so `tandem --help`
stays fast.
"""
from __future__ import annotations


def _controller(args) -> int:
    if args.status:
        return _status(args)
    from services.controller.server import run_controller
    return run_controller(args.exp, args.cfg.controller)


def _status(args) -> int:
    import json

    from services.protocol import ExpDir, StatusRequest, SyncRequestClient, load_keys, read_service
    exp = ExpDir(args.exp)
    try:
        address = read_service(exp, "controller", timeout_s=args.timeout)["address"]
    except TimeoutError as e:
        print(f"tandem controller --status: {e}")
        return 1
    client = SyncRequestClient(load_keys(exp.keys), address, timeout_s=args.timeout)
    try:
        reply = client.request(StatusRequest())
    except TimeoutError as e:
        print(f"tandem controller --status: {e}")
        return 1
    finally:
        client.close()
    print(json.dumps(reply.state, indent=1, sort_keys=True))
    return 0


def register(sub) -> None:
    """Add this package's sub-commands to the `tandem` parser."""
    p = sub.add_parser("controller", help="run the controller of an experiment (role)")
    p.add_argument("--exp", required=True, help="experiment directory (reads its `controller` config)")
    p.add_argument("--status", action="store_true", help="print the running controller's state and exit")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait with --status")
    p.set_defaults(func=_controller)
