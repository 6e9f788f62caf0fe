"""The elastic split at run time (`launcher.elastic: true`): move capacity between generation and training.

Output lengths grow during RL training, so the best generation:training split moves during a
run. Every `launcher.elastic_every_steps` training steps (the trainer's step records) the
launcher:
  1. predicts the speed of the current split and of its neighbours (one server fewer or more,
     the trainer with that server's CPUs more or fewer) by calibrating the simulator on the run:
     elastic_prediction.py, which states its assumption on how the trainer's cost scales;
  2. asks the decision rule (`launcher.elastic_policy.choose_split`) where to go;
  3. logs the decision (predicted steps/h of each split, the choice, why) as an
     `elastic_decision` record and a console line, and makes the move (elastic_moves.py says which
     CPUs go where):
     generation -> training: the controller retires the last server (`RetireServer`: out of
       rotation, paused in abort mode, its requests resumed on the others; retirement.py), the
       supervisor stops it, and the trainer is told its larger set;
     training -> generation: the trainer is told its smaller set and the move waits for its
       `trainer_cpus` record (it re-pins at a step boundary: trainer/elastic_cpus.py), so the pools
       stay disjoint; then a new server starts on the freed CPUs, registers, and the controller
       catches it up to the current version from disk.
     A move that fails (a retirement refused or late, a trainer that does not answer, a server
     that does not start) is logged as an `elastic_move` record with ok false, undone as far as
     it went, and the run goes on in the split it had. No group is lost either way: requests of
     a retired server are resumed elsewhere or fail over, and the audit shows it.

Everything runs on the launcher's thread between two polls of the roles, so the supervisor is
never used from two threads; a move blocks the watch loop for as long as it takes (a new
server's start: seconds in the miniature).

Only the local backend moves (CPU sets); elastic_moves.elastic_problems refuses the rest.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from tandem.services.protocol import ExpDir, MetricsWriter, RemoteError, write_json_atomic
from tandem.trainer.elastic_cpus import CPUS_FILE

from .backends.base import LaunchError
from .config import ExperimentConfig
from .controller_calls import registered, retire_quietly, retire_server, server_address
from .elastic_moves import MoveRefused, elastic_problems, gen_to_train, train_to_gen
from .elastic_prediction import Decision, simulated_decision
from .placement import CpuPlacement, format_ranges
from .roles import Role, gen_role

log = logging.getLogger(__name__)

TRAINER_ACK_TIMEOUT_S = 300.0  # the trainer re-pins at its next step boundary (or while it waits for data)
RETIRED_STOP_GRACE_S = 2.0     # SIGTERM -> SIGKILL for a retired server


Decide = Callable[["ElasticSplit"], Decision]


class MetricsTail:
    """The records appended to `<exp>/metrics.jsonl` since the last read (a half-written last
    line waits for the next)."""

    def __init__(self, exp: ExpDir, from_end: bool = True):
        self.path = exp.metrics
        self.offset = self.path.stat().st_size if from_end and self.path.exists() else 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


class ElasticSplit:
    """The run's split and its moves. `decide` (default `simulated_decision`) says where to go."""

    def __init__(self, cfg: ExperimentConfig, exp: ExpDir, backend, roles: list[Role],
                 join: Callable[[ExpDir, Role, bool], None], decide: Decide | None = None):
        self.cfg, self.exp, self.backend, self.join = cfg, exp, backend, join
        self.decide = decide or simulated_decision
        self.placement: CpuPlacement = backend.sup.placement
        self.retired: list[tuple[int, ...]] = []   # CPU sets of retired servers, the last on top
        self.servers = sorted((r for r in roles if r.kind == "gen"), key=lambda r: r.index)
        self.every = cfg.launcher.elastic_every_steps
        self.seq = 0
        self.since = time.time()                  # the current split's first moment
        self.steps_since = 0
        self.step = 0
        self.tail = MetricsTail(exp)   # this launch's steps only
        self.metrics = MetricsWriter(exp, "launcher")
        exp.service_file(CPUS_FILE).unlink(missing_ok=True)   # an earlier launch's

    @property
    def trainer_cpus(self) -> tuple[int, ...]:
        return self.placement.trainer_ranks[0]

    def tick(self) -> None:
        """Between two polls of the roles: decide (and move) once enough steps were trained."""
        for rec in self.tail.read():
            if rec.get("role") == "trainer" and rec.get("event") == "step":
                self.steps_since += 1
                self.step = rec.get("step", self.step)
        if self.steps_since < self.every:
            return
        self.steps_since = 0
        t0 = time.monotonic()
        try:
            decision = self.decide(self)
        except Exception as e:   # a prediction that cannot be made is no reason to stop the run
            decision = Decision(None, why=f"no prediction: {type(e).__name__}: {e}")
        self._record_decision(decision, time.monotonic() - t0)
        if decision.target is not None and decision.target != len(self.servers):
            moved = self.move_to_train() if decision.target < len(self.servers) else self.move_to_gen()
            # The next decision counts the steps trained after the move, and a new split is
            # measured from its end (a new server serves only once it is up).
            for rec in self.tail.read():
                if rec.get("role") == "trainer" and rec.get("event") == "step":
                    self.step = rec.get("step", self.step)
            if moved:
                self.since = time.time()

    # ---- the moves ------------------------------------------------------------------------
    def move_to_train(self) -> bool:
        """Retire the last server and give its CPUs to the trainer; True when it moved."""
        t0, role, address = time.monotonic(), self.servers[-1] if self.servers else None, None
        try:
            new = gen_to_train(self.placement)
            address = server_address(self.exp, role)
            retire_server(self.exp, address)
        except TimeoutError as e:   # no answer: the controller may have retired it all the same
            if address is None or registered(self.exp, address) is not False:
                return self._record_move("to_train", role, False, f"{type(e).__name__}: {e}", t0)
        except (MoveRefused, RemoteError, OSError, KeyError) as e:
            return self._record_move("to_train", role, False, f"{type(e).__name__}: {e}", t0)
        # Forgotten by the controller, its running requests resumed elsewhere. Requests the server
        # held at its door (arrived during an update's pause) wait there still: they fail over when
        # it dies, with their tokens, so a short grace is enough.
        self.backend.sup.stop([role.name], grace_s=RETIRED_STOP_GRACE_S)
        self.servers.pop()
        self.retired.append(self.placement.servers[-1])
        self._apply(new)
        self._tell_trainer()
        return self._record_move("to_train", role, True, f"{address} retired; the trainer has CPUs "
                                 f"{format_ranges(self.trainer_cpus)}", t0)

    def move_to_gen(self) -> bool:
        """Take one server's worth of CPUs from the trainer and start a server there; True when it moved."""
        t0, old = time.monotonic(), self.placement
        try:
            new = train_to_gen(old, self.retired)
        except MoveRefused as e:
            return self._record_move("to_gen", None, False, str(e), t0)
        role = gen_role(self.cfg, self.exp, len(self.servers), self.backend.gen_host, self.backend.pick_port)
        tail = MetricsTail(self.exp)   # before the file: the trainer's answer comes after it
        ack = self._trainer_applied(tail, self._tell_trainer(new.trainer_ranks[0]))
        if ack is not True:
            self._tell_trainer(old.trainer_ranks[0])   # whenever it looks again, it keeps its set
            return self._record_move("to_gen", role, False, f"the trainer did not take its smaller set: {ack}", t0)
        self._apply(new)
        try:
            self.backend.start([role])
            self.join(self.exp, role, False)
        except Exception as e:   # it did not start or could not register: undo
            retire_quietly(self.exp, role)
            self.backend.stop([role.name])
            self._apply(old)
            self._tell_trainer()
            return self._record_move("to_gen", role, False, f"{type(e).__name__}: {e}", t0)
        self.servers.append(role)
        if self.retired and self.retired[-1] == new.servers[-1]:
            self.retired.pop()
        return self._record_move("to_gen", role, True, f"{role.name} on CPUs {format_ranges(new.servers[-1])}; "
                                 f"the trainer has CPUs {format_ranges(self.trainer_cpus)}", t0)

    def _apply(self, placement: CpuPlacement) -> None:
        """The supervisor starts (and restarts) roles on the new sets from now on."""
        self.placement = self.backend.sup.placement = placement
        self.metrics.log(**placement.record())

    def _tell_trainer(self, cpus: tuple[int, ...] | None = None) -> int:
        self.seq += 1
        write_json_atomic(self.exp.service_file(CPUS_FILE), {"seq": self.seq, "cpus": list(cpus or self.trainer_cpus),
                                                             "written": time.time()})
        return self.seq

    def _trainer_applied(self, tail: MetricsTail, seq: int, timeout_s: float = TRAINER_ACK_TIMEOUT_S) -> bool | str:
        """True once the trainer logs `trainer_cpus` for `seq` (in `tail`); else why not (it
        refused, ended, or took longer than `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rec in tail.read():
                if rec.get("role") == "trainer" and rec.get("seq") == seq:
                    if rec.get("event") == "trainer_cpus":
                        return True
                    if rec.get("event") == "trainer_cpus_ignored":
                        return f"it ignored the file: {rec.get('reason')}"
            if not self._trainer_running():
                return "the trainer is not running"
            time.sleep(0.2)
        return f"no trainer_cpus record for seq {seq} within {timeout_s:.0f}s"

    def _trainer_running(self) -> bool:
        child = self.backend.sup.children.get("trainer-0")
        return child is not None and child.proc.poll() is None

    # ---- records ---------------------------------------------------------------------------
    def _record_decision(self, d: Decision, seconds: float) -> None:
        here = len(self.servers)
        speeds = {str(k): (round(v, 2) if v else v) for k, v in sorted(d.speeds.items())}
        self.metrics.log(event="elastic_decision", step=self.step, servers=here,
                         trainer_cpus=format_ranges(self.trainer_cpus), speeds_steps_per_h=speeds,
                         target=d.target, why=d.why, seconds=seconds)
        move = "stay" if d.target in (None, here) else f"move to {d.target} server(s)"
        print(f"elastic split at step {self.step}: {here} server(s), trainer on CPUs "
              f"{format_ranges(self.trainer_cpus)}; predicted steps/h {speeds}; {move} ({d.why})", flush=True)

    def _record_move(self, direction: str, role: Role | None, ok: bool, detail: str, t0: float) -> bool:
        seconds = time.monotonic() - t0
        self.metrics.log(event="elastic_move", step=self.step, direction=direction, ok=ok,
                         server=role.name if role else None, servers=len(self.servers),
                         trainer_cpus=format_ranges(self.trainer_cpus), detail=detail, seconds=seconds)
        what = "generation -> training" if direction == "to_train" else "training -> generation"
        print(f"elastic split: {what} {'done' if ok else 'FAILED, the split stays as it was'} in {seconds:.1f}s: "
              f"{detail}", flush=True)
        if not ok:
            log.warning("elastic move %s failed: %s", direction, detail)
        return ok


def elastic_for(cfg: ExperimentConfig, exp: ExpDir, backend, roles: list[Role],
                join: Callable[[ExpDir, Role, bool], None]) -> ElasticSplit | None:
    """The run's ElasticSplit when `launcher.elastic` is on (None otherwise); LaunchError when the
    backend's placement cannot move (checked again here: the placement is the backend's own)."""
    if not getattr(cfg.launcher, "elastic", False):
        return None
    placement = getattr(getattr(backend, "sup", None), "placement", None)
    problems = elastic_problems(cfg, placement)
    if problems:
        raise LaunchError("; ".join(f"{k}: {m}" for k, m in problems))
    return ElasticSplit(cfg, exp, backend, roles, join)
