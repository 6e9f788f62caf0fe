"""`tandem gen serve`: load a model, start the engine thread and the HTTP API, publish the address.

With `--exp DIR` the server logs to `<exp>/logs/gen-<rank>.log`, takes its defaults from the
experiment's `gen` section and writes `<exp>/services/gen-<rank>.json` (`url`, `host`, `port`,
`pid`, `model`) once it accepts requests — the launcher waits for that file. Keys come from
files (`--api-key-file`, `--admin-api-key-file`), never from argv, where any user could read them.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

log = logging.getLogger(__name__)

# Connections the server holds at once (rollout workers keep one per request in flight), and the
# seconds a new one has to send its request: what idle connections from anyone who can reach
# the port may take (rollout/server/connection_guard.py).
MAX_CONNECTIONS = 4096
FIRST_REQUEST_S = 10.0


def resolve_threads(cli_value: int | None, cfg_value: int | None) -> int:
    """--threads, else $TANDEM_THREADS (the local launcher sizes it to the server's CPU pool),
    else gen.threads, else 1 (roles share few cores)."""
    for v in (cli_value, os.environ.get("TANDEM_THREADS"), cfg_value):
        if v not in (None, "", 0):
            return max(1, int(v))
    return 1


def read_key_file(flag: str, path) -> tuple[str | None, str | None]:
    """(key, error): a key comes from a file, never from argv (where `ps` shows it to everyone)."""
    if not path:
        return None, None
    try:
        key = Path(path).read_text().strip()
        mode = Path(path).stat().st_mode
    except OSError as e:
        return None, f"{flag}: {e}"
    if not key:
        return None, f"{flag} {path} is empty"
    if mode & 0o077:
        log.warning("%s %s is readable by other users (mode %o); keep keys in 0600 files", flag, path, mode & 0o777)
    return key, None


class DeviceError(ValueError):
    """gen.device names a device this process cannot use; the message names the field."""


def resolve_device(name: str, cuda_available: bool | None = None):
    """gen.device as a torch.device: auto = cuda when torch sees one, else cpu.

    CUDA means the first GPU this process sees (`cuda:<current device>`, normally cuda:0): the
    launcher picks the physical GPU with CUDA_VISIBLE_DEVICES, so the server never counts GPUs
    itself. The device is also made current, so an NCCL weight group (whose tensors live on
    the current device, services/protocol/collectives.py) receives where the model is.
    `cuda_available` is for tests (None: ask torch)."""
    import torch

    from tandem.rollout.config import DEVICES
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if name not in DEVICES:
        raise DeviceError(f"gen.device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu" or (name == "auto" and not cuda_available):
        return torch.device("cpu")
    if not cuda_available:
        raise DeviceError(f"gen.device=cuda but torch sees no CUDA device (torch {torch.__version__}, CUDA build "
                          f"{torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); use auto or cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def load_engine(model_path: str, *, max_running: int, prefill_tokens_per_step: int, dtype: str,
                weight_version: str, seed: int, metrics=None, metrics_interval_s: float = 5.0,
                device="cpu"):
    """The model on `device` (a torch.device or its name), its tokenizer, and the engine thread,
    which makes every tensor it feeds the model on the model's device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.services.protocol import attention_without_cudnn

    from .engine import Engine
    attention_without_cudnn()   # a graph build per decode step's new length (services/protocol/runtime.py)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.to(device)
    model.eval()
    return Engine(model, tokenizer, model_path=str(model_path), max_running=max_running,
                  prefill_tokens_per_step=prefill_tokens_per_step, weight_version=weight_version, seed=seed,
                  metrics=metrics, metrics_interval_s=metrics_interval_s)


async def serve(engine, *, host: str, port: int, api_key: str | None, server_args: dict,
                on_ready=None, stop_event: asyncio.Event | None = None, admin_api_key: str | None = None,
                lora_paths: dict[str, str] | None = None) -> None:
    """`lora_paths`: {name: adapter directory} served from the start (rollout/server/lora_routes.py)."""
    from aiohttp import web

    from .connection_guard import GuardedSite
    from .http_api import GenServer
    server = GenServer(engine, api_key=api_key, admin_api_key=admin_api_key, server_args=server_args)
    await server.load_initial_adapters(lora_paths or {})
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    site = GuardedSite(runner, sock, MAX_CONNECTIONS, FIRST_REQUEST_S)
    await site.start()
    bound = sock.getsockname()[1]
    server.server_args.update(host=host, port=bound)
    log.info("embedded generation server on http://%s:%d (model %s)", host, bound, engine.model_path)
    if on_ready:
        on_ready(host, bound)
    try:
        await (stop_event.wait() if stop_event else asyncio.Event().wait())
    finally:
        await runner.cleanup()


def serve_from_args(args) -> int:
    import torch

    from tandem.rollout.config import GenConfig
    cfg: GenConfig = args.cfg.gen if getattr(args, "cfg", None) is not None else GenConfig()
    exp = metrics = None
    if args.exp:
        from tandem.services.protocol import ExpDir, MetricsWriter, setup_role_logging
        exp = ExpDir(args.exp)
        setup_role_logging(exp, "gen", args.rank)
        metrics = MetricsWriter(exp, "gen", args.rank)
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not Path(args.model).is_dir():
        log.error("--model %s is not a directory", args.model)
        return 2
    threads = resolve_threads(args.threads, cfg.threads)
    torch.set_num_threads(threads)
    keys = {}
    for flag, attr in (("--api-key-file", "api_key_file"), ("--admin-api-key-file", "admin_api_key_file")):
        keys[attr], error = read_key_file(flag, getattr(args, attr, None))
        if error:
            log.error("%s", error)
            return 2
    api_key, admin_api_key = keys["api_key_file"], keys["admin_api_key_file"]
    try:
        device = resolve_device(getattr(args, "device", None) or cfg.device)
    except DeviceError as e:
        log.error("%s", e)
        return 2
    from .lora_routes import parse_lora_paths
    try:
        lora_paths = parse_lora_paths(getattr(args, "lora_paths", None))
    except ValueError as e:
        log.error("%s", e)
        return 2
    relay = None
    if cfg.weight_relay and exp is not None:
        from .relay import ServerRelay
        try:
            relay = ServerRelay(cfg.relay_dir, args.rank, exp.root, admin_api_key, args.host)
        except (OSError, ValueError) as e:
            log.error("gen.weight_relay: %s", e)
            return 2
    max_running = args.max_running or cfg.max_running_requests
    engine = load_engine(args.model, max_running=max_running, prefill_tokens_per_step=cfg.prefill_tokens_per_step,
                         dtype=cfg.dtype, weight_version=args.weight_version, seed=cfg.seed + args.rank,
                         metrics=metrics, metrics_interval_s=cfg.metrics_interval_s, device=device)
    log.info("model on %s (gen.device=%s, CUDA_VISIBLE_DEVICES=%s)", engine.device,
             getattr(args, "device", None) or cfg.device, os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"))
    server_args = {"model_path": str(args.model), "tokenizer_path": str(args.model), "dtype": cfg.dtype,
                   # SGLang's server_args.device is the device type ("cuda", "cpu"), no index
                   "device": engine.device.type, "threads": threads, "random_seed": cfg.seed + args.rank,
                   "prefill_tokens_per_step": cfg.prefill_tokens_per_step, "weight_version": args.weight_version,
                   "enable_deterministic_inference": False,
                   # as SGLang: --lora-paths turns LoRA on (arg_groups/lora_hook.py)
                   "enable_lora": bool(lora_paths or getattr(args, "enable_lora", False)),
                   "lora_paths": [f"{name}={path}" for name, path in lora_paths.items()]}

    def on_ready(host: str, port: int) -> None:
        if exp is not None:
            from tandem.services.protocol import publish_service
            publish_service(exp, f"gen-{args.rank}", {
                "url": f"http://{host}:{port}", "host": host, "port": port, "pid": os.getpid(),
                "model": str(args.model), "backend": "embedded", "weight_version": engine.weight_version,
                **(relay.service_fields() if relay else {})})
        print(f"serving on http://{host}:{port}", flush=True)

    async def main() -> None:
        import signal
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(engine, host=args.host, port=args.port, api_key=api_key, admin_api_key=admin_api_key,
                    server_args=server_args, on_ready=on_ready, stop_event=stop, lora_paths=lora_paths)

    try:
        asyncio.run(main())
    finally:
        engine.stop()
        if relay is not None:
            relay.close()
        if metrics is not None:
            metrics.close()
    return 0
