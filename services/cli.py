"""Sub-commands this package adds to `tandem` (see launcher.cli).

`tandem controller --exp DIR` runs the controller of an experiment; with `--status` it prints
the running controller's state instead. `tandem keys init DIR` creates an experiment
directory's CURVE keys (kept if they exist), for roles started by hand. Imports happen inside the handlers so `tandem --help`
stays fast.
"""
from __future__ import annotations


def _controller(args) -> int:
    if args.status:
        return _status(args)
    from tandem.services.controller.server import run_controller
    return run_controller(args.exp, args.cfg.controller)


def _status(args) -> int:
    import json

    from tandem.services.protocol import ExpDir, StatusRequest, SyncRequestClient, load_keys, read_service
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


def _keys_init(args) -> int:
    from tandem.services.protocol import ExpDir, generate_keys, load_keys

    exp = ExpDir(args.dir)
    try:
        load_keys(exp.keys)
        print(f"{exp.keys}: experiment keys exist; kept them")
    except FileNotFoundError:
        generate_keys(exp.keys)
        print(f"{exp.keys}: created the experiment keys (readable by you only)")
    return 0


def register(sub) -> None:
    """Add this package's sub-commands to the `tandem` parser."""
    k = sub.add_parser("keys", help="the experiment's CURVE keys")
    ksub = k.add_subparsers(dest="keys_cmd", required=True, metavar="{init}")
    init = ksub.add_parser("init", help="create DIR/keys/ (kept if they exist)")
    init.add_argument("dir", help="experiment directory")
    init.set_defaults(func=_keys_init)
    p = sub.add_parser("controller", help="run the controller of an experiment (role)")
    p.add_argument("--exp", required=True, help="experiment directory (reads its `controller` config)")
    p.add_argument("--status", action="store_true", help="print the running controller's state and exit")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait with --status")
    p.set_defaults(func=_controller)
