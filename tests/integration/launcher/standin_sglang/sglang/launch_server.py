"""STAND-IN for `python -m sglang.launch_server` (tests only; SGLang itself needs CUDA).

Runs the exact command the project builds for SGLang 0.5.23 and behaves, over real HTTP, like
the parts of that release the launch path relies on:
- accepts the flags the project passes (an unknown flag is an error, as in SGLang's parser) and
  `--config FILE.yaml`, whose keys become flags (so `api-key` / `admin-api-key` arrive in a file);
- `/ready` answers 503 during a short warm-up, then 200; `/health` 200 (the launch turns off
  SGLang's generation probe); both without a key, as SGLang's auth middleware allows;
- `/model_info`, `/server_info` and `/v1/loads` need the API key (401 otherwise), like SGLang's
  NORMAL-level routes, and report `weight_version` / `tp_size` from the command line;
- starts one worker subprocess in its process group (SGLang's scheduler), so a test can check
  that stopping the server takes its workers down too.

It records what it was given — argv, the keys read from --config, CUDA_VISIBLE_DEVICES and the
SGLANG_* environment, pids — in `$TANDEM_STANDIN_SGLANG_RECORDS/<pid>.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WARMUP_S = 0.5


def parse(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)")
    for flag in ("--model-path", "--host", "--port", "--tp-size", "--base-gpu-id", "--mem-fraction-static",
                 "--random-seed", "--weight-version", "--log-level", "--config", "--dtype", "--context-length",
                 "--max-running-requests", "--nccl-port", "--api-key", "--admin-api-key"):
        p.add_argument(flag)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    config = {}
    if "--config" in argv:
        import yaml

        path = argv[argv.index("--config") + 1]
        config = yaml.safe_load(Path(path).read_text()) or {}
        merged = []
        for k, v in config.items():
            merged += [f"--{k}", str(v)]
        argv = merged + argv
    return p.parse_args(argv), config


def main() -> int:
    args, config = parse(sys.argv[1:])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started = time.monotonic()
    record = {"argv": sys.argv[1:], "config": config, "pid": os.getpid(), "pgid": os.getpgid(0),
              "worker_pid": worker.pid, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "sglang_env": {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")},
              "api_key": args.api_key, "admin_api_key": args.admin_api_key}
    out = Path(os.environ["TANDEM_STANDIN_SGLANG_RECORDS"])
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{os.getpid()}.tmp"             # whole or absent: the test polls the folder
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"{os.getpid()}.json")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body: dict | None = None) -> None:
            data = json.dumps(body or {}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = self.path.split("?")[0]
            if path in ("/ready", "/health"):
                code = 200 if time.monotonic() - started >= WARMUP_S or path == "/health" else 503
                with open(out / f"{os.getpid()}.events", "a") as f:   # what the launch path asked, in order
                    f.write(json.dumps({"path": path, "status": code, "t": time.time()}) + "\n")
                return self._send(code)
            if args.api_key and self.headers.get("Authorization") != f"Bearer {args.api_key}":
                return self._send(401, {"error": "Unauthorized"})
            if path == "/model_info":
                return self._send(200, {"model_path": args.model_path, "weight_version": args.weight_version,
                                        "is_generation": True})
            if path == "/server_info":
                return self._send(200, {"tp_size": int(args.tp_size or 1), "weight_version": args.weight_version})
            if path == "/v1/loads":
                return self._send(200, {"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]})
            return self._send(404, {"detail": "Not Found"})

    server = ThreadingHTTPServer((args.host, int(args.port)), Handler)

    def stop(signum, frame):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"stand-in SGLang on {args.host}:{args.port} (pid {os.getpid()})", flush=True)
    server.serve_forever()
    worker.terminate()
    worker.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
