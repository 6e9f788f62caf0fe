"""A STAND-IN trainer rank (not the trainer) for the local backend's supervision tests.

`python standin_rank.py EXP_DIR MODE`: records its pid and torch.distributed variables in
`EXP_DIR/ranks/<RANK>.json`, rank 0 announces `services/trainer.json` as the trainer does once
its process group is up, then, by MODE:
- finish: rank 0 exits 0 at once, the others exit 0 a second after rank 0 announced (so the run
  is seen to wait for every rank, not for the first);
- die: rank 1 exits 3 once rank 0 has announced; the others wait for a signal, as ranks blocked
  in a collective with a dead peer;
- wait: every rank waits for a signal (Ctrl-C of the launcher);
- save:SECONDS: as wait, but SIGTERM starts a stop that takes SECONDS (the trainer finishing its
  step and writing its last checkpoint): `saving`, then `saved`.
Each rank records how it ended in `EXP_DIR/ranks/<RANK>.end`.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tandem.services.protocol import write_json_atomic


def main(exp_root: str, mode: str) -> int:
    exp = Path(exp_root)
    rank = int(os.environ.get("RANK", "0"))
    ranks = exp / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TANDEM_STORE_FILE",
             "GLOO_SOCKET_IFNAME", "TANDEM_IPC_DIR")
    write_json_atomic(ranks / f"{rank}.json", {"pid": os.getpid(), **{k: os.environ.get(k) for k in names}})

    def end(how: str, code: int):
        write_json_atomic(ranks / f"{rank}.end", how)
        sys.exit(code)

    def save(seconds: float):
        write_json_atomic(ranks / f"{rank}.end", "saving")
        time.sleep(seconds)
        end("saved", 0)

    signal.signal(signal.SIGTERM, (lambda *_: save(float(mode.split(":")[1]))) if mode.startswith("save:")
                  else (lambda *_: end("SIGTERM", 143)))
    announcement = exp / "services" / "trainer.json"
    if rank == 0:
        announcement.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(announcement, {"pid": os.getpid()})
    else:
        while not announcement.exists():
            time.sleep(0.05)
    if mode == "finish":
        if rank:
            time.sleep(1.0)
        end("finished", 0)
    if mode == "die" and rank == 1:
        end("died", 3)
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
