"""The rollout worker: many concurrent episodes, each a ticket from the controller to a group of
graded trajectories in the trainer's buffer.

The worker asks for tickets only for free episode slots, so the controller's admission rule is
the only throttle; every ticket ends in exactly one `GroupDone` (accepted, rejected or failed)
so no slot leaks; a heartbeat keeps the worker's leases alive and cancels groups the
controller revoked. A prompt is used up only when its group settles, and a failed group's
prompt is tried again (data_position.py): a restarted worker neither skips the prompts that were
in flight nor repeats the finished ones (one killed before it saved a group finished sends that
prompt again, and the trainer refuses it by its `prompt_key`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib

from tandem.services.protocol import (
    STOP_GRACE_S,
    AdmitRequest,
    ExpDir,
    GradeRequest,
    GroupDone,
    Heartbeat,
    MetricsWriter,
    PhaseTimer,
    RemoteError,
    RequestClient,
    Shutdown,
    Ticket,
    TrajectorySource,
    load_keys,
    read_service,
    worker_identity,
)

from .agent import episode_function
from .data_position import DataPosition
from .dataset import Prompt, PromptStream, load_prompts
from .heldout_curve import HeldOutCurve
from .workflow import EpisodeContext, RejectGroup

log = logging.getLogger(__name__)
# More characters than any tokenizer packs into one token: a problem longer than this many per
# token of rollout.max_prompt_tokens is rejected before the workflow tokenizes it on the event loop.
MAX_CHARS_PER_TOKEN = 64

# A shutdown's drain, all of it: inside the launcher's grace before SIGKILL, with room left for
# closing the trajectory socket. RECEIPTS_S of it is kept for the trainer's receipts.
DRAIN_S = STOP_GRACE_S - 5.0
RECEIPTS_S = 3.0


async def drain(running: dict[str, asyncio.Task], sink: TrajectorySource, budget_s: float = DRAIN_S) -> list[str]:
    """Let in-flight groups finish (they were admitted; dropping them would waste them), then wait
    for the trainer's receipts; returns the delivered groups still without them, whose prompts go
    out again. Within `budget_s` whatever the groups do: a group can hang (its server left paused
    by a trainer that died mid-update), and a worker SIGKILLed before it says which groups it
    returns leaves them unaccounted (`tandem audit`: lost). What is cancelled gives its prompt back."""
    deadline = time.monotonic() + budget_s
    if running:
        log.info("draining %d in-flight groups", len(running))
        _, pending = await asyncio.wait(list(running.values()), timeout=max(0.0, budget_s - RECEIPTS_S))
        if pending:
            log.warning("%d in-flight groups did not finish within the %.0f s drain; cancelled (their prompts "
                        "go out again)", len(pending), budget_s)
            for t in pending:
                t.cancel()
            # their reports to the controller get part of what is left, not the receipts' share
            await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic() - RECEIPTS_S / 2))
    return await sink.wait_receipts(timeout_s=max(0.1, deadline - time.monotonic()))


class RolloutWorker:
    def __init__(self, cfg, exp: ExpDir, rank: int, generator, controller: RequestClient, shutdown: Shutdown):
        """`controller` is the client the generator already routes through; one per process."""
        self.cfg, self.exp, self.rank = cfg, exp, rank
        self.rc = cfg.rollout
        self.worker_id = f"rollout-{rank}-{os.getpid()}"
        self.generator = generator
        self.controller = controller
        self.shutdown = shutdown
        self.keys = load_keys(exp.keys, worker_identity(rank))   # its own: it may speak for itself only
        self.metrics = MetricsWriter(exp, "rollout", rank)
        # Prompts are used up when their group settles (see data_position.py).
        self.data = DataPosition(exp.checkpoints / f"rollout-{rank}.json")
        self.workflow = episode_function(cfg)
        self.running: dict[str, asyncio.Task] = {}
        self.counts = {"accepted": 0, "rejected": 0, "failed": 0}
        self.version = 0

    def _resolver(self, role: str):
        """The service's whole announcement: the client sees a restart on the same address too."""
        return lambda: read_service(self.exp, role, timeout_s=30)

    def _load_stream(self) -> PromptStream:
        prompts = load_prompts(self.rc.dataset, self.cfg.reward.task, self.rc.synthetic_size,
                               self.cfg.experiment.seed, self.rc.columns, self.rc.system_prompt, self.rc.prompt_template)
        if self.data.position:
            log.info("resuming at data position %d (%d prompts past it already done)", self.data.position,
                     len(self.data.settled_ahead))
        # Each worker walks its own seeded order of the data set.
        return PromptStream(prompts, seed=self.cfg.experiment.seed + 1000 * self.rank)

    async def run(self) -> int:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.cfg.experiment.model)
        stream = self._load_stream()
        self.reward = RequestClient(self.keys, self._resolver("reward"), timeout_s=self.rc.reward_timeout_s)
        trainer = read_service(self.exp, "trainer", timeout_s=300)
        self.sink = TrajectorySource(self.keys, trainer["trajectory_address"])
        ctx = EpisodeContext(
            generate=self._seeded(self.generator.generate), grade=self._grade, tokenizer=tokenizer,
            n_samples=self.rc.n_samples, filter_all_equal=self.rc.filter_all_equal,
            max_turns=self.rc.max_turns, turn_discount=self.rc.turn_discount, feedback_chars=self.rc.feedback_chars,
            sampling_params={"temperature": self.rc.temperature, "top_p": self.rc.top_p,
                             "top_k": self.rc.top_k, "max_new_tokens": self.rc.max_new_tokens})
        heartbeat = asyncio.ensure_future(self._heartbeat())
        # Worker 0 alone scores the held-out curve (rollout.eval_every), beside its episodes.
        curve = HeldOutCurve(self.cfg, self.generator, self.reward, tokenizer, self.metrics, self.version) \
            if self.rank == 0 and self.rc.eval_every else None
        last_report = time.time()
        try:
            while not self.shutdown.requested:
                free = self.rc.concurrency - len(self.running)
                if free <= 0:
                    await asyncio.sleep(0.05)
                    continue
                try:
                    reply = await self.controller.request(AdmitRequest(self.worker_id, max_groups=free))
                except (TimeoutError, RemoteError) as e:
                    log.warning("admission failed (%s); retrying", e)
                    await asyncio.sleep(1.0)
                    continue
                self.version = reply.version
                if curve:
                    curve.poll(self.version)
                for ticket in reply.tickets:
                    index = self.data.issue()
                    task = asyncio.ensure_future(self._episode(ctx, index, stream.at(index), ticket))
                    self.running[ticket.group_id] = task
                if not reply.tickets:
                    await asyncio.sleep(max(0.02, min(reply.retry_after_s or 0.1, 1.0)))
                if time.time() - last_report > 10:
                    log.info("running %d groups; %s; version %d", len(self.running), self.counts, self.version)
                    last_report = time.time()
        finally:
            heartbeat.cancel()
            if curve:
                await curve.close()
            await self._drain()
        return 0

    def _seeded(self, generate):
        """With `gen.deterministic_inference`, SGLang samples every unseeded request with the same
        seed (42), so the n samples of a group would be identical: give each sample its own
        seed, derived from the experiment seed and the sample's sticky key."""
        if not getattr(self.cfg.gen, "deterministic_inference", False):
            return generate

        async def seeded(prompt_ids, params, sticky_key):
            seed = zlib.crc32(f"{self.cfg.experiment.seed}/{sticky_key}".encode())
            return await generate(prompt_ids, {**params, "sampling_seed": seed}, sticky_key)
        return seeded

    async def _drain(self) -> None:
        unreceipted = await drain(self.running, self.sink)
        if unreceipted:
            log.warning("%d delivered groups have no receipt from the trainer (it stopped or died); "
                        "their prompts will be generated again", len(unreceipted))
            self.metrics.log(event="unreceipted", group_ids=unreceipted)
        self.sink.close()

    async def _grade(self, items):
        reply = await self.reward.request(GradeRequest(items=items, deadline_s=self.rc.reward_timeout_s))
        return reply.verdicts

    async def _episode(self, ctx: EpisodeContext, index: int, prompt: Prompt, ticket: Ticket) -> None:
        """One ticket: run the workflow, push its trajectories, report the group — exactly once."""
        status, reason, timer = "failed", "", PhaseTimer()
        try:
            if len(prompt.text) > self.rc.max_prompt_tokens * MAX_CHARS_PER_TOKEN:   # not worth tokenizing
                raise RejectGroup(f"a problem of {len(prompt.text):,} characters cannot fit rollout.max_prompt_tokens="
                                  f"{self.rc.max_prompt_tokens}")
            trajectories = await self.workflow(ctx, prompt, ticket)
            longest = max((len(t.prompt_ids) for t in trajectories), default=0)
            if longest > self.rc.max_prompt_tokens:   # it could not fit trainer.max_tokens_per_mb
                raise RejectGroup(f"prompt of {longest} tokens is longer than rollout.max_prompt_tokens="
                                  f"{self.rc.max_prompt_tokens}")
            for t in trajectories:   # one group per prompt is trained (trainer/buffer.py)
                t.prompt_key = f"{self.rank}:{index}"
                t.ticket_mac = ticket.mac   # the trainer checks the group was admitted to this worker
            # The prompt is used up once the trainer holds the whole group (its receipts).
            await self.sink.send_group(trajectories, on_receipted=lambda: self.data.settle(index))
            status = "accepted"
            self._record_group(ticket, index, prompt, trajectories, timer.fields(total="seconds"))
        except RejectGroup as e:
            status, reason = "rejected", str(e)
        except asyncio.CancelledError:
            status, reason = "failed", "cancelled (revoked or shutting down)"
        except Exception as e:  # any episode failure fails the group visibly, never silently
            status, reason = "failed", f"{type(e).__name__}: {e}"
            log.warning("group %s failed: %s", ticket.group_id, reason)
        finally:
            self.running.pop(ticket.group_id, None)
            self.counts[status] += 1
            if status != "accepted":
                self.data.settle(index, failed=status == "failed")
            await self._report(GroupDone(self.worker_id, ticket.group_id, status, reason[:500]))

    def _record_group(self, ticket: Ticket, index: int, prompt: Prompt, trajectories, timing: dict) -> None:
        rewards = [t.reward for t in trajectories]
        # the grading's latency (the simulator's `reward_s`, calibrated from these)
        graded = [t.timings["grade_s"] for t in trajectories if "grade_s" in t.timings]
        # prompt_index: the prompt's place in this worker's data; issued again only when it did
        # not settle, so a later group with it says this one came back (launcher/audit.py)
        self.metrics.log(event="group", group_id=ticket.group_id, prompt_id=prompt.id, prompt_index=index,
                         admit_version=ticket.admit_version, reward_mean=sum(rewards) / len(rewards),
                         correct=sum(t.timings.get("correct", 0.0) for t in trajectories) / len(rewards),
                         tokens=int(sum(len(t.output_ids) for t in trajectories)),
                         # per sample: `simulate.output_lengths: empirical:EXP_DIR` reads these
                         output_tokens=[len(t.output_ids) for t in trajectories],
                         prompt_tokens=len(trajectories[0].prompt_ids) if trajectories else 0,
                         # samples whose tokens came from more than one policy version
                         multi_version=sum(len(set(t.output_versions.tolist())) > 1 for t in trajectories),
                         **({"grade_s": max(graded)} if graded else {}), **timing)

    async def _report(self, done: GroupDone) -> None:
        for attempt in range(5):
            try:
                await self.controller.request(done)
                return
            except TimeoutError:
                await asyncio.sleep(0.5 * (attempt + 1))
            except RemoteError as e:  # e.g. the lease already expired: the slot is released anyway
                log.info("group_done %s: %s", done.group_id, e)
                return
        log.error("could not report %s as %s; its lease will release the slot", done.group_id, done.status)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.rc.heartbeat_s)
            try:
                reply = await self.controller.request(Heartbeat(self.worker_id, list(self.running)))
            except (TimeoutError, RemoteError) as e:
                log.warning("heartbeat failed: %s", e)
                continue
            self.version = reply.version
            for gid in reply.revoked:
                task = self.running.get(gid)
                if task is not None:
                    log.warning("controller revoked group %s; cancelling it", gid)
                    task.cancel()

