"""`tandem scale --exp DIR`: ask the running launcher for more or fewer generation servers.

The launcher owns the roles (the local supervisor, the SLURM jobs), so it alone may start or stop
one; this command only asks. A request travels as a file in the experiment's own directory,
which only the run's user may write (services/protocol/private.py), so a request works from any
shell of that user on the shared filesystem, wherever the launcher runs (a login node, a
`slurm/train.sbatch` job), with no socket to open and nothing another user can reach:

  1. `tandem scale` writes `<exp>/services/scale/request-<id>.json` (0600, atomically);
  2. the launcher, between two polls of its roles, claims it (renames it `*.taken`), refusing a
     file that is not its user's or a link, does it (launcher/scaling.py) and writes
     `answer-<id>.json`, rewritten with each thing it did (`lines`) until `done`;
  3. `tandem scale` prints each line as it comes and exits 0 when every change was made, 1 when
     one was refused or failed (the answer says which and why), 2 when no launcher took the
     request (none runs, or `--timeout` passed first: the request is then withdrawn).

A launcher takes requests once every role of its launch is up; a new launch clears the requests
an earlier one left.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.services.protocol import ExpDir, write_json_atomic
from tandem.services.protocol.private import open_private

from .exp_lock import last_launch

SCALE_DIR = "scale"          # under <exp>/services/
MAX_CHANGE = 64              # servers one request may add or remove
SERVER_NAME = re.compile(r"gen-\d+")
POLL_S = 0.3


def scale_dir(exp: ExpDir) -> Path:
    return exp.services / SCALE_DIR


@dataclass(frozen=True)
class ScaleRequest:
    """One change of the run's generation servers: add `add`, remove `remove` (the highest
    numbered) or remove the servers named in `servers`."""
    id: str = field(default_factory=lambda: f"{time.time_ns()}-{secrets.token_hex(3)}")
    add: int = 0
    remove: int = 0
    servers: tuple[str, ...] = ()
    cpus: str = ""                   # local backend: the CPUs of the servers added ("": the launcher picks)
    exclude: str = ""                # slurm backend: nodes the servers added must not run on (a hostlist)
    written: float = field(default_factory=time.time)

    def problems(self) -> list[str]:
        """What is wrong with the request itself (the launcher checks it against the run)."""
        out = []
        if not re.fullmatch(r"[0-9]+-[0-9a-f]+", self.id):
            out.append(f"id {self.id!r} is not one `tandem scale` writes")
        asked = [k for k, v in (("add", self.add), ("remove", self.remove), ("server", self.servers)) if v]
        if len(asked) != 1:
            out.append("say exactly one of --add N, --remove N or --server NAME"
                       + (f" (got {', '.join(asked)})" if asked else ""))
        for key in ("add", "remove"):
            n = getattr(self, key)
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_CHANGE:
                out.append(f"--{key} must be a whole number from 1 to {MAX_CHANGE}, got {n!r}")
        bad = [s for s in self.servers if not isinstance(s, str) or not SERVER_NAME.fullmatch(s)]
        if bad:
            out.append(f"--server takes generation server names such as gen-1, got {', '.join(map(repr, bad))}")
        if len(set(self.servers)) != len(self.servers):
            out.append(f"--server names a server twice: {', '.join(self.servers)}")
        if (self.cpus or self.exclude) and not self.add:
            out.append("--cpus and --exclude describe servers to add; they go with --add")
        if not isinstance(self.cpus, str) or not re.fullmatch(r"[0-9,\- ]*", self.cpus):
            out.append(f"--cpus must be a CPU list such as 4-7 or 0,2, got {self.cpus!r}")
        if not isinstance(self.exclude, str) or not re.fullmatch(r"[A-Za-z0-9._\-\[\],]*", self.exclude):
            out.append(f"--exclude takes node names or a SLURM hostlist such as gpu[01-04],gpu07, got {self.exclude!r}")
        return out

    def describe(self) -> str:
        if self.add:
            where = (f" on CPUs {self.cpus}" if self.cpus else "") + \
                    (f", not on {self.exclude}" if self.exclude else "")
            return f"add {self.add} generation server(s){where}"
        if self.remove:
            return f"remove {self.remove} generation server(s)"
        return f"remove {', '.join(self.servers)}"

    @classmethod
    def from_json(cls, data: dict) -> ScaleRequest:
        """ValueError naming the problems of a request file's content."""
        if not isinstance(data, dict):
            raise ValueError("a request is a JSON object")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        try:
            req = cls(**{**data, "servers": tuple(data.get("servers", ()))})
        except TypeError as e:
            raise ValueError(str(e)) from None
        if problems := req.problems():
            raise ValueError("; ".join(problems))
        return req


def write_request(exp: ExpDir, req: ScaleRequest) -> Path:
    path = scale_dir(exp) / f"request-{req.id}.json"
    write_json_atomic(path, {**asdict(req), "servers": list(req.servers)})
    return path


def read_private_json(path: Path) -> dict:
    """A file of this user's only, never through a link (what the launcher acts on must be its
    user's own request, whatever the directory's modes became)."""
    with os.fdopen(open_private(path, os.O_RDONLY), "r") as f:
        return json.load(f)


def answer_path(exp: ExpDir, req_id: str) -> Path:
    return scale_dir(exp) / f"answer-{req_id}.json"


def launch_running(exp: ExpDir) -> str | None:
    """Why no launcher can take a request (None: one may be running). A launch on another host
    (a SLURM job) cannot be seen from here: the request's timeout answers for it."""
    if not exp.config.exists():
        return f"{exp.root} holds no experiment (no config.yaml)"
    launch = last_launch(exp.root)
    if launch is None:
        return f"no launch of {exp.root} was recorded (launcher.lock): start it with tandem run"
    held, running = launch
    if running is False:
        return (f"the launch of {exp.root} (pid {held.get('pid')} on {held.get('host')}) is not running; "
                f"continue the run with tandem run FILE --resume first")
    return None


def wait_for_answer(exp: ExpDir, req: ScaleRequest, request: Path, timeout_s: float, out=sys.stdout) -> int:
    """Print the launcher's lines as they come; the exit code (module docstring)."""
    deadline, said, looked = time.monotonic() + timeout_s, 0, time.monotonic()
    path = answer_path(exp, req.id)
    while time.monotonic() < deadline:
        if time.monotonic() - looked > 2.0 and said == 0 and request.exists():
            looked = time.monotonic()
            if why := launch_running(exp):   # the launch ended before it took the request
                request.unlink(missing_ok=True)
                print(f"tandem scale: {why}; the request is withdrawn", file=sys.stderr, flush=True)
                return 2
        try:
            answer = read_private_json(path)
        except (FileNotFoundError, json.JSONDecodeError):
            answer = None
        if answer is not None:
            for line in answer.get("lines", [])[said:]:
                print(line, file=out, flush=True)
            said = len(answer.get("lines", []))
            if answer.get("done"):
                return 0 if answer.get("ok") else 1
        time.sleep(POLL_S)
    try:
        request.unlink()   # not taken yet: withdrawn, so no launcher acts on it later
        print(f"tandem scale: no launcher took the request within {timeout_s:.0f}s (it takes requests once "
              f"every role of its launch is up); withdrawn", file=sys.stderr, flush=True)
        return 2
    except FileNotFoundError:
        print(f"tandem scale: the launcher is still at it after {timeout_s:.0f}s; its lines go on in "
              f"{path} and the run's console", file=sys.stderr, flush=True)
        return 1


def cmd_scale(args) -> int:
    exp = ExpDir(args.exp_dir)
    req = ScaleRequest(add=args.add or 0, remove=args.remove or 0, servers=tuple(args.server or ()),
                       cpus=args.cpus or "", exclude=args.exclude or "")
    problems = req.problems()
    if problems:
        print("tandem scale: " + "; ".join(problems), file=sys.stderr)
        return 2
    if why := launch_running(exp):
        print(f"tandem scale: {why}", file=sys.stderr)
        return 2
    request = write_request(exp, req)
    print(f"asked the launcher of {exp.root} to {req.describe()} ...", flush=True)
    return wait_for_answer(exp, req, request, args.timeout)


def register(sub) -> None:
    p = sub.add_parser("scale", help="add or remove generation servers of a running experiment")
    p.add_argument("--exp", dest="exp_dir", required=True, help="experiment directory")
    p.add_argument("--add", type=int, metavar="N", help="start N more generation servers; each takes requests "
                                                         "once caught up to the current weights")
    p.add_argument("--remove", type=int, metavar="N", help="retire the N highest-numbered servers; their "
                                                            "requests go on elsewhere")
    p.add_argument("--server", action="append", metavar="NAME", help="retire this server (gen-<i>; repeatable)")
    p.add_argument("--cpus", metavar="LIST", help="local backend: the CPUs of the servers added (split "
                                                   "between them), e.g. 8-11")
    p.add_argument("--exclude", metavar="NODES", help="slurm backend: nodes the servers added must not run on "
                                                       "(comma-separated, or a SLURM hostlist)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the launcher (default 900)")
    p.set_defaults(func=cmd_scale)
