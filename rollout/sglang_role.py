"""`tandem gen sglang --exp DIR --rank N ...`: one generation server of an experiment as a real,
supervised SGLang process — what `gen.backend: sglang` starts instead of `tandem gen serve`.

The launcher starts this role exactly as it starts the embedded server (same flags, same
`<exp>/services/gen-<rank>.json`, same registration, same restart policy), so nothing else in the
system knows which engine answers. The role:

1. refuses at once (exit 2, naming the package and the extra) when this interpreter has no
   `sglang`;
2. writes the experiment's API and admin keys into a 0600 YAML file that SGLang reads through
   `--config` (SGLang 0.5.23 has no key file or key variable; on the command line the keys would
   be world-readable in `/proc`);
3. starts `python -m sglang.launch_server` (argv from `rollout.sglang_launch`) in its own process
   group, on the GPUs it was given (CUDA_VISIBLE_DEVICES: the local launcher's plan, or SLURM's
   allocation), with `/health` that does not run a generation;
4. polls `/ready` (which never generates) until SGLang has warmed up, then announces
   `<exp>/services/gen-<rank>.json` — the launcher registers the server with the controller;
5. stays SGLang's parent: when SGLang exits the role exits with its status (the launcher
   restarts it and re-registers); on SIGTERM/SIGINT it stops SGLang's whole process group
   (SIGTERM, then SIGKILL after a grace period). If the role itself is killed, the kernel kills
   SGLang (parent-death signal), whose own workers die with it (SGLang sets the same signal on
   its schedulers and detokenizer).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tandem.rollout.sglang_launch import (
    READY_PATH,
    SGLangServerSpec,
    sglang_argv,
    sglang_env,
    sglang_missing,
    write_key_config,
)

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the role (its parent) dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def _read_key(path: Path | None, flag: str) -> str | None:
    if path is None:
        return None
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"{flag} {path} is empty")
    return text


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "*") else host


def is_ready(url: str, timeout_s: float = 2.0) -> bool:
    """GET <url>/ready answers 200 (SGLang: warmed up and not paused; no generation runs)."""
    try:
        with urllib.request.urlopen(url + READY_PATH, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM SGLang's process group, SIGKILL whatever is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:   # the leader is gone; its workers may not be
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return


def server_spec(args, gen_cfg, port: int, nccl_port: int, key_config: Path | None,
                routed_experts: bool = False) -> SGLangServerSpec:
    """The launch of server `args.rank` from the experiment's `gen` section (`routed_experts`:
    trainer.routing_replay or routing_agreement)."""
    return SGLangServerSpec(
        model_path=str(args.model), host=args.host, port=port, tp_size=gen_cfg.tp_size, base_gpu_id=0,
        mem_fraction_static=gen_cfg.mem_fraction_static, key_config=str(key_config) if key_config else None,
        weight_version=args.weight_version, random_seed=gen_cfg.seed + args.rank, nccl_port=nccl_port,
        deterministic_inference=getattr(gen_cfg, "deterministic_inference", False),
        lora_paths=list(args.lora_paths or []), return_routed_experts=routed_experts,
        extra_args=list(gen_cfg.sglang_args))


def _check_gpus(tp_size: int) -> str | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    n = len([d for d in visible.split(",") if d.strip()])
    if n < tp_size:
        return (f"gen.tp_size={tp_size} but CUDA_VISIBLE_DEVICES={visible!r} gives this server {n} GPU(s); "
                f"the plan (tandem plan FILE) and the job's GPU request must agree")
    return None


def run_from_args(args) -> int:
    from tandem.services.protocol import ExpDir, free_port, publish_service, setup_role_logging

    exp = ExpDir(args.exp)
    setup_role_logging(exp, "gen", args.rank)
    missing = sglang_missing()
    if missing:
        log.error("%s", missing)
        return 2
    gen_cfg = args.cfg.gen
    bad_gpus = _check_gpus(gen_cfg.tp_size)
    if bad_gpus:
        log.error("%s", bad_gpus)
        return 2
    try:
        api_key = _read_key(args.api_key_file, "--api-key-file")
        admin_key = _read_key(args.admin_api_key_file, "--admin-api-key-file")
    except (OSError, ValueError) as e:
        log.error("%s", e)
        return 2
    key_config = None
    if api_key or admin_key:
        # Beside the key files it is made from (<exp>/keys/ is 0700), rewritten at every start.
        key_config = write_key_config(exp.keys / f"gen-{args.rank}.sglang.yaml", api_key, admin_key)
    port = args.port or free_port(_probe_host(args.host))
    nccl_port = args.nccl_port or free_port(_probe_host(args.host))
    try:
        spec = server_spec(args, gen_cfg, port, nccl_port, key_config,
                           routed_experts=getattr(args.cfg.trainer, "records_routing", False))
        argv = sglang_argv(spec)
    except ValueError as e:
        log.error("%s", e)
        return 2
    url = f"http://{args.host}:{port}"
    probe = f"http://{_probe_host(args.host)}:{port}"
    relay = None
    if gen_cfg.weight_relay:
        from tandem.rollout.server.relay import ServerRelay
        try:
            relay = ServerRelay(gen_cfg.relay_dir, args.rank, exp.root, admin_key, args.host)
        except (OSError, ValueError) as e:
            log.error("gen.weight_relay: %s", e)
            return 2

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    log.info("starting SGLang for gen-%d on CUDA_VISIBLE_DEVICES=%s: %s", args.rank,
             os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"), " ".join(argv))
    proc = subprocess.Popen(argv, env=sglang_env(), stdin=subprocess.DEVNULL, process_group=0,
                            preexec_fn=_die_with_parent)
    try:
        return _supervise(proc, stop, probe, on_ready=lambda: publish_service(exp, f"gen-{args.rank}", {
            "url": url, "host": args.host, "port": port, "model": str(args.model), "backend": "sglang",
            "weight_version": str(args.weight_version), "server_pid": proc.pid, "nccl_port": nccl_port,
            "tp_size": gen_cfg.tp_size, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            **(relay.service_fields() if relay else {})}))
    finally:
        _stop_group(proc, STOP_GRACE_S)
        if relay is not None:
            relay.close()


def _supervise(proc: subprocess.Popen, stop: threading.Event, probe: str, on_ready) -> int:
    """Wait for readiness, announce, then wait: SGLang's exit status, or 0 after a stop."""
    ready = False
    t0 = time.monotonic()
    while not stop.is_set():
        code = proc.poll()
        if code is not None:
            log.error("SGLang exited with status %s%s", code, "" if ready else " before it was ready")
            return code or 1   # a server never ends on its own: even status 0 is a failure here
        if not ready and is_ready(probe):
            ready = True
            log.info("SGLang ready at %s after %.0fs", probe, time.monotonic() - t0)
            on_ready()
            print(f"serving on {probe} (SGLang pid {proc.pid})", flush=True)
        stop.wait(0.5 if ready else 0.2)
    log.info("stopping SGLang (process group %d)", proc.pid)
    return 0


def add_parser(gsub) -> None:
    """`tandem gen sglang` (the `gen` sub-command group is rollout/cli.py's)."""
    c = gsub.add_parser("sglang", help="run one experiment's SGLang server (GPU), supervised: readiness, "
                                       "announcement, stop (the launcher's role for gen.backend: sglang)")
    c.add_argument("--exp", required=True, help="experiment directory (its `gen` section configures SGLang)")
    c.add_argument("--rank", type=int, default=0, help="server index within the experiment")
    c.add_argument("--model", required=True, help="Hugging Face model directory")
    c.add_argument("--host", default="127.0.0.1", help="address SGLang binds and the role publishes")
    c.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one on this node)")
    c.add_argument("--nccl-port", type=int, default=0,
                   help="SGLang's own NCCL rendezvous port (0: a free one on this node)")
    c.add_argument("--api-key-file", type=Path, default=None, help="file holding the API key")
    c.add_argument("--admin-api-key-file", type=Path, default=None,
                   help="file holding the admin key (pause, update, abort, flush need it)")
    c.add_argument("--weight-version", default="0", help="weight_version reported until the first update")
    c.add_argument("--lora-paths", nargs="*", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served from the start (SGLang's --lora-paths; turns --enable-lora on)")
    c.set_defaults(func=run_from_args)
