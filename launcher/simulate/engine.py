"""The discrete-event core: generation servers, the controller's admission rule, the trainer.

Events are sparse on purpose. A server's batch only changes when a sequence finishes, is
admitted, is retracted because the KV cache filled up, or is interrupted by a weight update; in
between, decode steps follow the affine cost model (costs.py), so the time of the next change is
computed in closed form. That keeps a 16-node, 8,192-sample-per-step run at a few events per
sample instead of one per token.

What is modelled: continuous batching with a concurrency cap and a KV-cache budget (with
SGLang-style retraction when it overflows), prefill and the re-prefill after an interrupt,
least-loaded dispatch of samples to servers, the admission rule
`admitted <= B * (version + eta + 1)` with a cap on groups in flight (the controller's version
moves once every server has loaded it; refused rollout workers poll again), grading latency, the
trainer taking the B oldest groups, publishing, waiting for the servers' loads or not
(trainer.wait_for_ack), checkpoints, and each server pausing to load new weights (interrupting
its requests, which come back as new requests, or draining them first when generation is not
interruptible). Syncs run one at a time, as the controller runs them; with coalesced versions
(trainer/announcements.py) the trainer publishes while one runs, as far ahead as
`trainer.keep_weights` allows, and the next sync goes straight to the newest version published.
Chunked generation (rollout.new_tokens_per_chunk): a request ends at every chunk boundary and
its client sends it again to the same server, so a drain waits for at most one chunk; the
resubmission finds its prefix in the radix cache unless a load flushed it (SimSetup).
"""
from __future__ import annotations

import heapq
import math
from collections import Counter

import numpy as np

from tandem.launcher.simulate.costs import Costs
from tandem.launcher.simulate.records import (
    GroupRecord,
    SampleRecord,
    ServerState,
    SimResult,
    SimSetup,
    SimulationError,
    samples_used,
)
from tandem.launcher.simulate.trainer_side import (
    GRADED,
    LOAD_DONE,
    PUBLISH_DONE,
    SERVER,
    TRAIN_DONE,
    TRAINER_FREE,
    TrainerSide,
)
from tandem.rollout.server.cohorts import rows_to_set_apart
from tandem.services.controller.admission import staleness_capacity

# Each running request keeps this fraction of max_new_tokens in reserve when new requests are
# admitted, so the KV cache rarely overflows (SGLang's new-token-ratio idea; its floor is 0.1).
KV_RESERVE_FRACTION = 0.1


class Simulation(TrainerSide):
    def __init__(self, setup: SimSetup, costs: Costs, lengths: np.ndarray):
        self.s = setup
        self.c = costs
        used = samples_used(setup)
        if len(lengths) < used:
            raise ValueError(f"need {used} output lengths, got {len(lengths)}")
        self.lengths = [int(x) for x in lengths[:used]]
        self.max_groups = used // setup.n_samples
        self.servers = [ServerState(i) for i in range(setup.num_servers)]
        self.fixed = costs.decode_fixed
        self.beta = costs.decode_per_ctx
        self.padded = costs.decode_padded
        self.pass_s = costs.decode_pass_s
        self.K = costs.kv_capacity
        self.reserve = KV_RESERVE_FRACTION * setup.max_new_tokens
        if setup.prompt_tokens + setup.max_new_tokens > self.K:
            raise SimulationError(
                f"a request of {setup.prompt_tokens} prompt + {setup.max_new_tokens} new tokens does "
                f"not fit one server's KV cache ({self.K:,.0f} tokens); raise gen.tp_size or "
                f"gen.mem_fraction_static, or lower rollout.max_new_tokens")
        self.events: list = []
        self.seq = 0
        self.sid = 0
        self.now = 0.0
        self.version = 0      # the trainer's newest published version
        self.ctl_version = 0  # the controller's: the newest every server has loaded
        self.target = 0       # the version the sync in progress brings every server to
        self.pending = 0      # coalescing: the newest version published during that sync (0 = none)
        self.syncs = 0
        self.admitted = 0
        self.in_flight = 0
        self.eta_blocked = False  # the last admission attempt stopped at the staleness bound
        self.groups: dict[int, list] = {}
        self.buffer: list = []
        self.trainer_busy = False
        # Servers that have not yet loaded the newest version (the trainer's ack waits for them),
        # and what the trainer does when the last one has: publish (its next version was
        # waiting) or finish the step (wait_for_ack).
        self.unacked: set[int] = set()
        self.on_ack: int | None = None
        self.steps_done = 0
        self.step_times: list[float] = [0.0]
        self.train_busy: list[float] = []
        self.load = [0] * setup.num_servers
        self.lb = [(0, i) for i in range(setup.num_servers)]
        self.decoded = 0.0
        self.trained_tokens: list[float] = []
        self.staleness: Counter = Counter()
        self.token_staleness: Counter = Counter()
        self.retractions = 0
        self.interrupts = 0
        self.drained = 0.0    # server-seconds spent draining before a load (non-interruptible)
        self.longest_drain = 0.0
        self.chunk = setup.chunk_tokens
        self.resumes = 0      # requests sent again at a chunk boundary
        self.n_events = 0
        self.snap = None

    # ---- event queue -------------------------------------------------------------------
    def _push(self, t: float, kind: int, arg: int = 0, token: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, arg, token))

    def run(self) -> SimResult:
        self._admit_groups(0.0)
        events, pop, servers = self.events, heapq.heappop, self.servers
        server_event, target = self._server_event, self.s.steps
        count = 0
        while events and self.steps_done < target:
            t, _, kind, arg, token = pop(events)
            self.now = t
            count += 1
            if kind == SERVER:
                srv = servers[arg]
                if token == srv.token:
                    server_event(srv, t)
            elif kind == LOAD_DONE:
                self._load_done(self.servers[arg], t)
            elif kind == GRADED:
                self._graded(arg, t)
            elif kind == TRAIN_DONE:
                self._train_done(t)
            elif kind == PUBLISH_DONE:
                self._publish_done(t)
            elif kind == TRAINER_FREE:
                self._trainer_free(t)
            else:
                self._admit_groups(t)
        self.n_events = count
        if self.steps_done < self.s.steps:
            raise SimulationError(f"the simulation stalled after {self.steps_done} training steps "
                                  f"(no event left); check max_concurrent_groups and groups_per_step")
        return self._result()

    # ---- decode arithmetic ---------------------------------------------------------------
    def _cost_context(self, srv: ServerState) -> tuple[float, float]:
        """What a decode step pays for now: (context, fixed seconds beyond one forward pass).
        The tokens held (a paged server), or for the embedded server's left-padded rectangles
        every row padded to the longest of its rectangle, plus a pass for the long rows set
        apart (rollout/server/cohorts.py). Either context grows by n per step, so the sums of
        _decode_time hold."""
        if not (self.padded and srv.n):
            return srv.base + srv.n * srv.clock, 0.0
        together = [rec.base for rec in srv.run.values() if not rec.apart]
        apart = [rec.base for rec in srv.run.values() if rec.apart]
        ctx = sum(len(rows) * (max(rows) + srv.clock) for rows in (together, apart) if rows)
        return ctx, (self.pass_s if together and apart else 0.0)

    def _decode_time(self, n: int, ctx: float, k: float, extra: float = 0.0) -> float:
        """Seconds for k decode steps at batch n starting from total context ctx."""
        return k * (self.fixed[n] + extra + self.beta * ctx) + self.beta * n * k * (k - 1) / 2

    def _steps_in(self, n: int, ctx: float, dt: float, extra: float = 0.0) -> float:
        a = self.beta * n / 2
        b = self.fixed[n] + extra + self.beta * ctx - a
        if a <= 0:
            return dt / b
        return (-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a)

    def _run_to(self, srv: ServerState, clock: float, t: float) -> None:
        if srv.n:
            self.decoded += srv.n * (clock - srv.clock)
            if t > srv.t_last:
                srv.busy += t - srv.t_last
                srv.area += srv.n * (t - srv.t_last)
        srv.clock = clock
        srv.t_last = max(srv.t_last, t)

    def _advance(self, srv: ServerState, now: float) -> None:
        if srv.paused or now <= srv.t_last:
            return
        if srv.n == 0:
            srv.t_last = now
            return
        ctx, extra = self._cost_context(srv)
        k = self._steps_in(srv.n, ctx, now - srv.t_last, extra)
        self._run_to(srv, min(srv.clock + k, srv.next_clock), now)

    # ---- servers -----------------------------------------------------------------------------
    def _schedule(self, srv: ServerState) -> None:
        srv.token += 1
        n = srv.n
        if srv.paused or n == 0:
            return
        heap, run, clock = srv.heap, srv.run, srv.clock
        while heap[0][1] not in run:
            heapq.heappop(heap)
        ctx = srv.base + n * clock
        k = heap[0][0] - clock
        k_full = (self.K - ctx) / n
        if k_full < k:
            k = k_full
        if k < 0:
            k = 0.0
        srv.next_clock = clock + k
        ctx, extra = self._cost_context(srv)
        dt = self._decode_time(n, ctx, k, extra)
        self.seq += 1
        heapq.heappush(self.events, (srv.t_last + dt, self.seq, SERVER, srv.idx, srv.token))

    def _admit(self, srv: ServerState, now: float) -> None:
        """Start queued requests while the concurrency cap and the KV budget allow."""
        queue = srv.queue
        if srv.paused or not queue or (srv.draining and not srv.drain_admits):
            return
        c = self.c
        n, base, clock, run, heap = srv.n, srv.base, srv.clock, srv.run, srv.heap
        cap, K, reserve = c.max_running, self.K, self.reserve
        pr, pt, psq, req = c.prefill_per_request, c.prefill_per_token, c.prefill_per_sq, c.request_s
        prefill = 0.0
        chunk, resumed = self.chunk, False
        shared = set()  # groups whose prompt this batch of admissions already prefilled
        joined = []     # this round's requests
        held = len(queue) - srv.drain_admits if srv.draining else 0  # wait for the load
        while len(queue) > held and n < cap:
            rec = queue[0]
            ctx = rec.prompt + rec.generated
            if n and base + n * clock + ctx + (n + 1) * reserve > K:
                break
            queue.popleft()
            # A fresh id per admission, so heap entries of a retracted or interrupted run never
            # match its next one.
            self.sid += 1
            sid = rec.sid = self.sid
            rec.start = clock
            rec.base = ctx - clock
            rec.apart = False
            joined.append(rec)
            if rec.first_version < 0:
                rec.first_version = srv.version
            base += ctx - clock
            n += 1
            run[sid] = rec
            left = rec.target - rec.generated
            if chunk and left > chunk:
                left = chunk  # this request asks for one chunk; it comes back at its end
            heapq.heappush(heap, (clock + left, sid))
            prefill += req
            if rec.cached == srv.version:
                # Back at a chunk boundary, its prefix still in this server's radix cache.
                rec.cached = -1
                resumed = True
                prefill += c.resume_s(ctx)
                continue
            if rec.generated == 0 and rec.gid in shared:
                continue  # a group's fresh samples share one prefill of their prompt
            shared.add(rec.gid)
            prefill += pr + pt * ctx + psq * ctx * ctx
        if resumed:
            prefill += self.fixed[1]  # their scheduling round: one forward pass
        srv.n, srv.base = n, base
        if srv.draining:
            srv.drain_admits -= len(joined)
        if self.padded and joined:
            # As the embedded server does when a round joins: rows grown long decode apart.
            fresh = {rec.sid for rec in joined}
            together = [rec for rec in run.values() if not rec.apart and rec.sid not in fresh]
            for i in rows_to_set_apart([rec.base + clock for rec in together],
                                       [rec.base + clock for rec in joined]):
                together[i].apart = True
        if prefill:
            srv.t_last = max(srv.t_last, now) + prefill
            srv.busy += prefill

    def _remove(self, srv: ServerState, sid: int) -> list:
        rec = srv.run.pop(sid)
        srv.n -= 1
        srv.base -= rec.base
        if srv.n == 0:
            srv.base = 0.0
        return rec

    def _server_event(self, srv: ServerState, t: float) -> None:
        n = srv.n
        clock = srv.next_clock
        self.decoded += n * (clock - srv.clock)
        if t > srv.t_last:
            srv.busy += t - srv.t_last
            srv.area += n * (t - srv.t_last)
            srv.t_last = t
        srv.clock = clock
        done = []
        heap, run = srv.heap, srv.run
        limit = clock + 1e-6
        base = srv.base
        chunk, again = self.chunk, []
        while heap and heap[0][0] <= limit:
            sid = heapq.heappop(heap)[1]
            rec = run.pop(sid, None)
            if rec is not None:
                n -= 1
                base -= rec.base
                if chunk and rec.generated + clock - rec.start < rec.target - 1e-3:
                    again.append(rec)   # a chunk ended, not the answer
                else:
                    done.append(rec)
        srv.n, srv.base = n, (base if n else 0.0)
        if again:
            # Sent again at once (first in line; a draining server admits them after its load,
            # which flushes the radix cache: then they are prefilled in full).
            cached = srv.version if self.s.chunk_prefix_cached else -1
            for rec in again:
                rec.generated += clock - rec.start
                rec.cached = cached
            if srv.draining:   # new requests to a draining server: behind those it still runs
                for i, rec in enumerate(again):
                    srv.queue.insert(srv.drain_admits + i, rec)
            else:
                srv.queue.extendleft(reversed(again))
            self.resumes += len(again)
        if not done and n and srv.base + n * clock >= self.K - 1e-6:
            # KV cache full: retract the newest request; it keeps its tokens and re-prefills.
            rec = self._remove(srv, next(reversed(run)))
            rec.generated += clock - rec.start
            srv.queue.appendleft(rec)
            self.retractions += 1
            if srv.draining:
                srv.drain_admits += 1
        if srv.draining and srv.n == 0 and not srv.drain_admits:
            self._start_load(srv, t)
        else:
            if srv.queue:
                self._admit(srv, t)
            self._schedule(srv)
        for rec in done:
            self._sample_done(rec, srv, t)

    def _start_load(self, srv: ServerState, now: float) -> None:
        if srv.draining:
            self.drained += now - srv.drain_from
            self.longest_drain = max(self.longest_drain, now - srv.drain_from)
        srv.paused = True
        srv.token += 1
        srv.loading_version = self.target
        start = max(srv.t_last, now)
        srv.t_last = start
        self._push(start + self.c.load_s, LOAD_DONE, srv.idx)

    def _load_done(self, srv: ServerState, t: float) -> None:
        srv.paused = False
        srv.draining = False
        srv.version = srv.loading_version
        srv.t_last = t
        if srv.n and self.s.reprefill_interrupted:
            c, clock = self.c, srv.clock
            prefill = 0.0
            # Each one is re-prefilled; resubmitted by its worker, it is also a new request.
            again = c.request_s if self.s.resubmit_interrupted else 0.0
            for rec in srv.run.values():
                prefill += again + c.prefill_s(rec.base + clock)
            srv.t_last += prefill
            srv.busy += prefill
        if srv.version < self.target:
            self._update_server(srv, t)
            return
        self._admit(srv, t)
        self._schedule(srv)
        self.unacked.discard(srv.idx)
        if not self.unacked and self.ctl_version < self.target:
            self._version_synced(t)

    def _update_server(self, srv: ServerState, now: float) -> None:
        """New weights are published: interrupt (or drain) and load them."""
        if srv.paused:
            return  # loading an older version; _load_done notices and loads again
        self._advance(srv, now)
        if self.s.interruptible:
            # Running requests stay on this server: they lose their KV cache and re-prefill
            # prompt + partial output after the load (priced in _load_done).
            self.interrupts += srv.n
            self._start_load(srv, now)
        elif srv.n == 0 and not srv.queue:
            self._start_load(srv, now)
        else:
            # The load waits for every request already submitted, queued ones included
            # (SGLang's update takes its model-update lock as a writer, after every request
            # holding it as a reader; the embedded server's `when_idle` waits the same way);
            # requests arriving meanwhile wait for the load.
            srv.draining = True
            srv.drain_from = now
            srv.drain_admits = len(srv.queue)
            if srv.n == 0:
                self._admit(srv, now)
                self._schedule(srv)

    # ---- controller -------------------------------------------------------------------------
    def _pick_server(self) -> int:
        lb, load = self.lb, self.load
        while True:
            ld, i = lb[0]
            if ld == load[i]:
                break
            heapq.heappop(lb)
        load[i] += 1
        heapq.heapreplace(lb, (ld + 1, i))
        return i

    def _capacity(self) -> int:
        """Groups the controller would admit now: its own rule, with every admitted group that
        is no longer in flight counted as accepted (the simulation drops none)."""
        s = self.s
        return staleness_capacity(s.groups_per_step, s.eta, self.ctl_version, accepted=self.admitted - self.in_flight,
                                  running=self.in_flight, max_concurrent=s.max_concurrent_groups)

    def _admit_groups(self, now: float) -> None:
        s = self.s
        touched = set()
        n, prompt, lengths, servers = s.n_samples, s.prompt_tokens, self.lengths, self.servers
        for _ in range(min(self._capacity(), self.max_groups - self.admitted)):
            gid = self.admitted
            self.admitted += 1
            self.in_flight += 1
            self.groups[gid] = GroupRecord(n, self.ctl_version)
            for j in range(n):
                rec = SampleRecord(gid, prompt, lengths[gid * n + j])
                i = self._pick_server()
                servers[i].queue.append(rec)
                touched.add(i)
        # Stopped by the staleness bound (or the run's last group), not by the concurrency cap.
        self.eta_blocked = self.in_flight < s.max_concurrent_groups and (
            self._capacity() == 0 or self.admitted >= self.max_groups)
        for i in touched:
            srv = servers[i]
            if not srv.paused and not srv.draining:
                self._advance(srv, now)
                self._admit(srv, now)
                self._schedule(srv)

    def _sample_done(self, rec: SampleRecord, srv: ServerState, t: float) -> None:
        i, load, lb = srv.idx, self.load, self.lb
        load[i] -= 1
        heapq.heappush(lb, (load[i], i))
        if len(lb) > 8 * len(load):
            self.lb = [(ld, j) for j, ld in enumerate(load)]
            heapq.heapify(self.lb)
        g = self.groups[rec.gid]
        total = rec.prompt + rec.target
        g.remaining -= 1
        g.tokens += total
        g.sum_sq += total * total
        if rec.first_version < g.min_version:
            g.min_version = rec.first_version
        if g.remaining == 0:
            self.in_flight -= 1
            if self.s.reward_s > 0:
                self._push(t + self.s.reward_s, GRADED, rec.gid)
            else:
                self._graded(rec.gid, t)
            self._admit_groups(t)

    # ---- results -----------------------------------------------------------------------------
    def _snapshot(self, t: float) -> None:
        for srv in self.servers:
            self._advance(srv, t)
        self.snap = (t, self.decoded, sum(x.busy for x in self.servers),
                     sum(x.area for x in self.servers), self.drained, self.syncs, self.resumes)

    def _result(self) -> SimResult:
        s, t_end = self.s, self.now
        for srv in self.servers:
            self._advance(srv, t_end)
        t0, dec0, busy0, area0, drained0, syncs0, resumes0 = self.snap or (0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
        window = t_end - t0
        measured = s.steps - s.warmup_steps
        busy = sum(x.busy for x in self.servers) - busy0
        area = sum(x.area for x in self.servers) - area0
        trained = sum(self.trained_tokens[s.warmup_steps:])
        train_busy = sum(self.train_busy[s.warmup_steps:])
        return SimResult(
            steps_per_hour=3600.0 * measured / window,
            trajectories_per_s=measured * s.groups_per_step * s.n_samples / window,
            gen_tokens_per_s=(self.decoded - dec0) / window,
            trained_tokens_per_s=trained / window,
            gen_utilization=min(1.0, busy / (window * len(self.servers))),
            train_utilization=min(1.0, train_busy / window),
            mean_batch=area / busy if busy else 0.0,
            step_times=self.step_times, staleness=self.staleness,
            token_staleness=self.token_staleness, retractions=self.retractions,
            interrupts=self.interrupts, events=self.n_events,
            drain_fraction=(self.drained - drained0) / (window * len(self.servers)),
            syncs_per_step=(self.syncs - syncs0) / measured, chunk_resumes=self.resumes - resumes0,
            longest_drain_s=self.longest_drain)
