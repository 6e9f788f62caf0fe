"""Generation servers joining and leaving a running experiment (`tandem scale`, scale_requests.py).

Clusters free nodes and take them back during a run (backfill, preemptible partitions), and a run
that lasts days should use what it is given. The launcher, between two polls of its roles, takes
each request and changes the run one server at a time:

  add     a new `gen-<i>` (the lowest free number) starts as any server does (a SLURM job of the
          plan's size, `--exclude` honoured; a local process pinned to `--cpus`, else to the CPUs
          of the slot it takes back, else to CPUs no pool uses), registers, and the controller
          keeps it out of rotation until it holds the current version, catching it up from disk
          (services/controller/server.py `_check`); the request is answered once it is in
          rotation (or, after CATCH_UP_WAIT_S, with the controller's reason why not yet).
  remove  the controller retires the server (services/controller/retirement.py: out of
          rotation, paused in abort mode, its requests resumed on the others with their tokens;
          requests still at its door fail over when it stops), then the launcher stops it. The
          last server is never removed.

What is not changed: the trainer, the staleness bound (the controller's admission does not
depend on how many servers there are), the audit's accounting (no group is lost: see above).
A continuation (`--resume`, `launcher.slurm.auto_resume`) starts `gen.num_servers` servers again.

Refused, with the reason, before anything is touched: a run with `launcher.elastic` on (the
elastic split owns the number of servers), an add under `trainer.weight_sync: broadcast` (a
broadcast cannot be replayed for a server that missed it, and its group's size is fixed by the
trainer), an add of SGLang servers on the local backend (the plan fixed the machine's GPUs),
`--exclude` locally and `--cpus` on SLURM.

Every change is a `scale` record in metrics.jsonl (the report marks it on the timeline, the
audit lists it) and a console line.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tandem.services.protocol import ExpDir, MetricsWriter, RemoteError, write_json_atomic

from .config import ConfigError, ExperimentConfig, parse_cpus
from .controller_calls import registered, retire_quietly, retire_server, server_address, servers
from .placement import CpuPlacement, format_ranges, split_cpus
from .roles import Role, gen_role
from .scale_requests import ScaleRequest, answer_path, read_private_json, scale_dir

log = logging.getLogger(__name__)

CATCH_UP_WAIT_S = 120.0   # a new server loads the current version from disk: seconds here, a minute at 70B


class Refused(ValueError):
    """The request cannot be carried out in this run; the message says why."""


def refusal(cfg: ExperimentConfig, req: ScaleRequest) -> str | None:
    """Why `req` cannot be carried out in a run of `cfg` (None: it can be tried)."""
    if getattr(cfg.launcher, "elastic", False):
        return ("this run has launcher.elastic on: its elastic split decides how many generation servers run "
                "(it moves their CPUs to and from the trainer); turn it off to scale by hand")
    if not req.add:
        return None
    slurm = cfg.launcher.backend == "slurm"
    if cfg.trainer.weight_sync == "broadcast":
        return ("trainer.weight_sync is broadcast: a server joining mid-run is caught up by replaying the current "
                "version from disk, and a broadcast cannot be replayed (its group's size is fixed by the trainer); "
                "use trainer.weight_sync: disk to add servers")
    if not slurm and cfg.gen.backend == "sglang":
        return ("gen.backend is sglang on the local backend: the plan gave this machine's GPUs to the servers and "
                "the trainer at launch; there is no GPU for another server")
    if req.exclude and not slurm:
        return "--exclude names SLURM nodes; this run is on the local backend (one machine)"
    if req.cpus and slurm:
        return "--cpus places local servers; on SLURM a server gets the GPUs and CPUs of its job"
    return None


def placement_with(p: CpuPlacement, index: int, cpus: tuple[int, ...], running: set[int]) -> CpuPlacement:
    """The placement once server `index` runs on `cpus` (beside the `running` ones)."""
    servers = list(p.servers) + [()] * (index + 1 - len(p.servers))
    servers[index] = cpus
    return _with_servers(p, servers, running | {index})


def _with_servers(p: CpuPlacement, servers: list[tuple[int, ...]], running: set[int]) -> CpuPlacement:
    gen = tuple(sorted({c for i in running for c in servers[i]}))
    return replace(p, servers=tuple(servers), gen=gen, source="tandem scale")


def cpus_for_new(p: CpuPlacement, index: int, asked: tuple[int, ...], running: set[int]) -> tuple[tuple[int, ...], str]:
    """The CPU set of a server added as `gen-<index>`, and a note when it shares a pool: `asked`
    (its share of --cpus) when given, else the set its slot had (a removed server's), else CPUs no
    pool uses."""
    if asked:
        cpus = asked
        outside = sorted(set(cpus) - set(p.available))
        if outside:
            raise Refused(f"--cpus {format_ranges(asked)}: CPU(s) {format_ranges(outside)} are not the run's "
                          f"(it may use {format_ranges(p.available)})")
    elif index < len(p.servers) and p.servers[index]:
        cpus = p.servers[index]
    else:
        used = {c for i in running for c in p.servers[i]} | set(p.train) | set(p.services)
        cpus = tuple(c for c in p.available if c not in used)
        if not cpus:
            raise Refused(f"every CPU of the run is in a pool (generation {format_ranges(p.gen)}, training "
                          f"{format_ranges(p.train)}, services {format_ranges(p.services)}); name the new "
                          f"server's CPUs with --cpus (they may overlap a pool, which it then shares)")
    shared = [name for name, pool in [(f"gen-{i}", p.servers[i]) for i in sorted(running)]
              + [("the trainer", p.train)] if set(cpus) & set(pool)]
    return cpus, (f"; it shares CPUs with {', '.join(shared)}" if shared else "")


class Scaler:
    """The launcher's side: takes the requests in `<exp>/services/scale/` and carries them out."""

    def __init__(self, cfg: ExperimentConfig, exp: ExpDir, backend, roles: list[Role],
                 join: Callable[[ExpDir, Role, bool], None], since: float = 0.0,
                 step: Callable[[], int] = lambda: 0):
        """`since`: this launch's start (older requests are an earlier launch's); `step`: the
        trainer's last step (the lifecycle's Progress), for the records."""
        self.cfg, self.exp, self.backend, self.join, self.step = cfg, exp, backend, join, step
        self.servers: dict[int, Role] = {r.index: r for r in roles if r.kind == "gen"}
        self.dir = scale_dir(exp)
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.iterdir():   # an earlier launch's requests and answers (written before `since`)
            try:
                if old.lstat().st_mtime < since:
                    old.unlink()
            except FileNotFoundError:
                pass
        self.metrics = MetricsWriter(exp, "launcher")

    @property
    def placement(self) -> CpuPlacement | None:
        return getattr(getattr(self.backend, "sup", None), "placement", None)

    def tick(self) -> None:
        """Between two polls of the roles: every request waiting, oldest first."""
        for path in sorted(self.dir.glob("request-*.json")):
            taken = path.with_name(path.name + ".taken")
            try:
                os.rename(path, taken)
            except FileNotFoundError:   # withdrawn by its `tandem scale` meanwhile
                continue
            answer = Answer(answer_path(self.exp, _request_id(path)))
            try:
                self.handle(taken, answer)
            except Exception as e:   # a request must never end the run
                log.exception("scale request %s", path.name)
                answer.end(False, f"failed: {type(e).__name__}: {e}")

    def handle(self, path: Path, answer: Answer) -> bool:
        req_id = _request_id(path)
        try:
            req = ScaleRequest.from_json(read_private_json(path))
            if req.id != req_id:
                raise ValueError(f"its id {req.id!r} is not its file's")
        except (OSError, ValueError) as e:   # another user's file, a link, a file not from `tandem scale`
            log.warning("scale request %s refused: %s", path.name, e)
            return answer.end(False, f"refused: {e}")
        print(f"tandem scale: asked to {req.describe()}", flush=True)
        if why := refusal(self.cfg, req):
            return answer.end(False, f"refused: {why}")
        if req.add:
            try:
                asked = parse_cpus(req.cpus, "--cpus") if req.cpus else ()
            except ConfigError as e:
                return answer.end(False, f"refused: {e}")
            if req.cpus and len(asked) < req.add:
                return answer.end(False, f"refused: --cpus {req.cpus} has fewer CPUs than the {req.add} servers to add")
            shares = split_cpus(asked, req.add) if asked else ((),) * req.add
            done = sum(self.add_one(req, answer, share) for share in shares)
            return answer.end(done == req.add, f"{done} of {req.add} server(s) added; "
                                               f"{len(self.servers)} running: {self._names()}")
        names = list(req.servers) or [self.servers[i].name for i in sorted(self.servers)[::-1][:req.remove]]
        unknown = [n for n in names if n not in {r.name for r in self.servers.values()}]
        if unknown:
            return answer.end(False, f"refused: {', '.join(unknown)} is not running (running: {self._names()})")
        if len(names) >= len(self.servers):
            return answer.end(False, f"refused: removing {len(names)} of the {len(self.servers)} server(s) would "
                                     f"leave generation with none")
        done = sum(self.remove_one(name, answer) for name in names)
        return answer.end(done == len(names), f"{done} of {len(names)} server(s) removed; "
                                              f"{len(self.servers)} running: {self._names()}")

    # ---- the changes ------------------------------------------------------------------------
    def add_one(self, req: ScaleRequest, answer: Answer, cpus_asked: tuple[int, ...] = ()) -> bool:
        t0, index = time.monotonic(), min(set(range(len(self.servers) + 1)) - set(self.servers))
        role = gen_role(self.cfg, self.exp, index, self.backend.gen_host, self.backend.pick_port)
        old, note = self.placement, ""
        try:
            if old is not None:
                cpus, note = cpus_for_new(old, index, cpus_asked, set(self.servers))
                self._apply(placement_with(old, index, cpus, set(self.servers)))
                note = f" on CPUs {format_ranges(cpus)}{note}"
            answer.say(f"starting {role.name}{note} ...")
            self.backend.start([role], **({"exclude": req.exclude} if req.exclude else {}))
            self.join(self.exp, role, False)
        except Exception as e:   # refused, did not start, or could not register: undo
            if not isinstance(e, Refused):
                retire_quietly(self.exp, role)
                self.backend.stop([role.name])
            if old is not None:
                self._apply(old)
            return self._record(answer, "add", role, False, str(e) if isinstance(e, Refused) else
                                f"{type(e).__name__}: {e}", t0)
        self.servers[index] = role
        address = server_address(self.exp, role)
        answer.say(f"{role.name} is up at {address}; the controller catches it up to the current weights ...")
        why = self._wait_in_rotation(address)
        detail = f"{address}{note}" + (f"; not in rotation after {CATCH_UP_WAIT_S:.0f}s: {why}" if why else
                                       "; in rotation")
        return self._record(answer, "add", role, True, detail, t0)

    def remove_one(self, name: str, answer: Answer) -> bool:
        t0, address = time.monotonic(), None
        index, role = next((i, r) for i, r in self.servers.items() if r.name == name)
        try:
            address = server_address(self.exp, role)
            answer.say(f"retiring {name} ({address}): its requests go on on the other servers ...")
            reply = retire_server(self.exp, address)
        except TimeoutError as e:   # no answer: it may have been retired all the same
            if address is None or registered(self.exp, address) is not False:
                return self._record(answer, "remove", role, False, f"{type(e).__name__}: {e}", t0)
            reply = None
        except (RemoteError, OSError, KeyError, json.JSONDecodeError) as e:
            return self._record(answer, "remove", role, False, f"{type(e).__name__}: {e}", t0)
        self.backend.stop([name])
        del self.servers[index]
        if self.placement is not None:
            self._apply(_with_servers(self.placement, list(self.placement.servers), set(self.servers)))
        return self._record(answer, "remove", role, True, reply.detail if reply else f"{address} retired", t0)

    def _wait_in_rotation(self, address: str) -> str:
        """'' once the controller routes to `address`; else its last reason why not."""
        deadline, why = time.monotonic() + CATCH_UP_WAIT_S, "the controller did not answer"
        while time.monotonic() < deadline:
            known = servers(self.exp)
            if known is not None:
                mine = next((s for s in known if s.get("address", "").rstrip("/") == address), None)
                if mine is not None and mine.get("in_rotation"):
                    return ""
                why = (mine.get("reason") or "out of rotation") if mine else "not registered"
            time.sleep(0.5)
        return why

    # ---- records ------------------------------------------------------------------------
    def _apply(self, placement: CpuPlacement) -> None:
        self.backend.sup.placement = placement   # the supervisor starts (and restarts) roles on it
        self.metrics.log(**placement.record())

    def _names(self) -> str:
        return ", ".join(self.servers[i].name for i in sorted(self.servers))

    def _record(self, answer: Answer, op: str, role: Role, ok: bool, detail: str, t0: float) -> bool:
        seconds = time.monotonic() - t0
        step = self.step()
        self.metrics.log(event="scale", op=op, server=role.name, ok=ok, detail=detail, step=step,
                         servers=len(self.servers), seconds=seconds)
        verb = {"add": "joined", "remove": "left"}[op] if ok else f"could not {'join' if op == 'add' else 'leave'}"
        answer.say(f"{role.name} {verb} the run at step {step} ({seconds:.1f}s): {detail}")
        if not ok:
            log.warning("tandem scale: %s %s failed: %s", op, role.name, detail)
        return ok


class Answer:
    """`answer-<id>.json`, rewritten with each line (also printed on the launcher's console)."""

    def __init__(self, path: Path):
        self.path, self.lines = path, []

    def say(self, line: str, done: bool = False, ok: bool | None = None) -> None:
        self.lines.append(line)
        print(f"tandem scale: {line}", flush=True)
        write_json_atomic(self.path, {"lines": self.lines, "done": done, "ok": ok, "time": time.time()})

    def end(self, ok: bool, line: str) -> bool:
        self.say(line, done=True, ok=ok)
        return ok


def _request_id(path: Path) -> str:
    """The id in `request-<id>.json` (or its claimed `.taken` name)."""
    return path.name.removeprefix("request-").split(".")[0]
