"""A stand-in for a Tandem role inside a SLURM job (the real roles need the whole system).

`python standin_role.py EXP NAME [--ready FILE] [--sleep S] [--exit CODE] [--all-reduce]`
announces itself in `<exp>/services/<FILE>.json` with the SLURM and torch.distributed view it
got (CUDA_VISIBLE_DEVICES, RANK, node), optionally joins a gloo group and all-reduces its rank,
then sleeps and exits with CODE — enough to exercise submission, readiness, watching, teardown.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tandem.services.protocol import write_json_atomic

ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "SLURMD_NODENAME", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT",
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "TANDEM_ADVERTISE_HOST")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("exp", type=Path)
    p.add_argument("name")
    p.add_argument("--ready", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--all-reduce", action="store_true")
    p.add_argument("--host", default=None, help="recorded as given (the launcher fills in {node})")
    p.add_argument("--graceful", action="store_true", help="exit 0 on SIGTERM, as real roles do")
    p.add_argument("--stop-s", type=float, default=0.0,
                   help="with --graceful: SIGTERM takes this long (a trainer writing its checkpoint)")
    a = p.parse_args()
    if a.graceful:
        import signal
        import sys

        def stop(signum, frame):
            print(f"{a.name}: got {signal.Signals(signum).name}; exiting cleanly", flush=True)
            if a.stop_s:
                time.sleep(a.stop_s)
                print(f"{a.name}: saved after {a.stop_s:g} s", flush=True)
            sys.exit(0)

        signal.signal(signal.SIGTERM, stop)
    info = {k: os.environ.get(k) for k in ENV_KEYS}
    info["host_arg"] = a.host
    if a.all_reduce:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        info["all_reduce"] = t.item()
        dist.destroy_process_group()
    rank = os.environ.get("RANK", "0")
    write_json_atomic(a.exp / "standin" / f"{a.name}-{rank}.json", info)   # the test polls for it
    if a.ready and rank == "0":
        write_json_atomic(a.exp / "services" / f"{a.ready}.json", info)
    print(f"{a.name} rank {rank} up: {info}", flush=True)
    time.sleep(a.sleep)
    return a.exit


if __name__ == "__main__":
    raise SystemExit(main())
