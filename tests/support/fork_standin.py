"""A stand-in role for tests/integration/launcher/test_role_forks.py, run as `python -m
fork_standin REPORT MODE`: it writes what a role would see of its process (pid, session, CPUs,
argv, environment, the modules already imported, its parent) to REPORT, then acts out MODE: `exit:N`,
`sleep`, `raise`, `return`, or `atexit` (a callback and a buffered file never closed, which a
normal interpreter exit flushes)."""
from __future__ import annotations

import atexit
import json
import os
import sys
import time

if __name__ == "__main__":
    report, mode = sys.argv[1], sys.argv[2]
    with open(report, "w") as f:
        json.dump({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "argv": sys.argv,
                   "cpus": sorted(os.sched_getaffinity(0)), "env": dict(os.environ),
                   "torch_preloaded": "torch" in sys.modules, "modules": sorted(sys.modules),
                   "ppid": os.getppid(), "name": __name__}, f)
    print(f"stand-in {mode}", flush=True)
    if mode.startswith("exit:"):
        sys.exit(int(mode.split(":")[1]))
    if mode == "sleep":
        time.sleep(600)
    if mode == "raise":
        raise RuntimeError("the stand-in failed")
    if mode == "atexit":
        atexit.register(lambda: open(report + ".atexit", "w").write("ran"))
        leaked = open(report + ".buffered", "w")   # noqa: SIM115 - closed by the interpreter's exit
        leaked.write("flushed at exit")
