"""A pool of grader worker processes that answers every item, whatever the workers do.

Each worker (reward.worker) grades one item at a time. One asyncio driver per worker slot feeds
it jobs from a shared queue and enforces a hard time limit per item. A worker that dies or
overruns is killed with its whole session and replaced; the item it held gets an error verdict
(it is not retried: it may be what kills workers). A worker that dies while idle is replaced
before it takes a job, so no item is charged for it. Identical items are graded once
(reward/verdict_cache.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import struct
import sys
import time
from dataclasses import dataclass, field

import msgpack

from tandem.reward.config import RewardConfig
from tandem.reward.sandbox import REPORT_GRACE_S
from tandem.reward.verdict_cache import VerdictCache, item_key
from tandem.services.protocol import GradeItem, Verdict

log = logging.getLogger(__name__)
_LEN = struct.Struct(">I")
STARTUP_TIMEOUT_S = 120.0
EXPIRED = "request deadline passed before grading"


@dataclass
class _Job:
    id: int
    item: GradeItem
    future: asyncio.Future
    deadline: float  # time.monotonic() after which nobody waits for the verdict (the latest of its requests)


@dataclass
class PoolStats:
    graded: int = 0
    errors: int = 0
    restarts: int = 0
    expired: int = 0
    cached: int = 0   # items answered by an identical item's grading
    user_graded: int = 0    # items scored by reward.function / reward.url
    user_refused: int = 0   # of those, items it could not score (raised, timed out, NaN, out of range ...)
    isolation: str = "unknown"
    pids: list[int] = field(default_factory=list)


def _frame(obj: dict) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _unsendable(e: Exception) -> str:
    """Why an item cannot travel to a grader worker (a lone surrogate, an integer past 64 bits,
    nesting past msgpack's limit): that item's verdict, no other's."""
    return f"the item cannot be sent to a grader ({type(e).__name__}: {str(e)[:200]})"


def error_verdict(cfg: RewardConfig, task: str, why: str) -> Verdict:
    return Verdict(cfg.wrong_reward, False, {"task": task, "error": why, "reason": f"not graded: {why}"})


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def send(self, frame: bytes | dict) -> None:
        self.proc.stdin.write(frame if isinstance(frame, bytes) else _frame(frame))
        await self.proc.stdin.drain()

    async def recv(self) -> dict:
        head = await self.proc.stdout.readexactly(_LEN.size)
        return msgpack.unpackb(await self.proc.stdout.readexactly(_LEN.unpack(head)[0]), raw=False)

    async def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await self.proc.wait()


class GraderPool:
    """`await pool.grade(items, deadline_s)` → one Verdict per item, in order, always."""

    def __init__(self, cfg: RewardConfig, size: int | None = None):
        self.cfg = cfg
        self.size = size or cfg.num_workers
        self.stats = PoolStats()
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._drivers: list[asyncio.Task] = []
        self._workers: dict[int, _Worker] = {}
        self._ids = 0
        self._cache: VerdictCache[_Job] = VerdictCache(cfg.verdict_cache)

    def hard_limit_s(self, task: str) -> float:
        """Seconds a worker may hold one item before it is deemed hung and killed."""
        if task == "run":   # an agent's program: the sandbox, whatever grades the answers
            return self.cfg.code_total_timeout_s + REPORT_GRACE_S + 5.0
        if self.cfg.url:
            from tandem.reward.remote_reward import budget_s
            return budget_s(self.cfg) + 5.0
        if self.cfg.function:
            return self.cfg.function_timeout_s + 5.0
        if task == "code":
            return self.cfg.code_total_timeout_s + REPORT_GRACE_S + 5.0
        return 2 * self.cfg.math_timeout_s + 5.0

    async def start(self) -> None:
        started = await asyncio.gather(*(self._spawn() for _ in range(self.size)), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:   # none is left running: the caller gets the first reason
            await asyncio.gather(*(w.kill() for w in started if isinstance(w, _Worker)))
            raise failed[0]
        workers = started
        for slot, w in enumerate(workers):
            self._workers[slot] = w
            self._drivers.append(asyncio.ensure_future(self._drive(slot)))
        self.stats.pids = self.pids()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers.values()]

    async def _spawn(self) -> _Worker:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tandem.reward.worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, start_new_session=True, env=env)
        w = _Worker(proc)
        try:
            await w.send(dataclasses.asdict(self.cfg))
            hello = await asyncio.wait_for(w.recv(), STARTUP_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            await w.kill()
            raise RuntimeError(f"grader worker did not start: {type(e).__name__}: {e}") from e
        if "error" in hello:      # e.g. reward.function does not import in the worker
            await w.kill()
            raise RuntimeError(f"grader worker did not start: {hello['error']}")
        self.stats.isolation = hello.get("isolation", "unknown")
        return w

    async def _replace(self, slot: int, why: str) -> None:
        log.warning("grader worker %d (pid %d) %s; replacing it", slot, self._workers[slot].proc.pid, why)
        await self._workers[slot].kill()
        self.stats.restarts += 1
        while True:
            try:
                self._workers[slot] = await self._spawn()
                break
            except RuntimeError as e:
                log.error("%s; retrying in 1s", e)
                await asyncio.sleep(1.0)
        self.stats.pids = self.pids()

    async def _drive(self, slot: int) -> None:
        while True:
            worker = self._workers[slot]
            get = asyncio.ensure_future(self._queue.get())
            died = asyncio.ensure_future(worker.proc.wait())
            await asyncio.wait({get, died}, return_when=asyncio.FIRST_COMPLETED)
            if died.done():
                if get.done():
                    self._queue.put_nowait(get.result())  # not this job's fault: give it back
                else:
                    get.cancel()
                await self._replace(slot, f"exited while idle (status {worker.proc.returncode})")
                continue
            died.cancel()
            job = get.result()
            if time.monotonic() >= job.deadline:   # counted by the requests that waited for it
                job.future.set_result(error_verdict(self.cfg, job.item.task, EXPIRED))
                continue
            await self._run(slot, worker, job)

    async def _run(self, slot: int, worker: _Worker, job: _Job) -> None:
        item = job.item
        limit = self.hard_limit_s(item.task)
        try:
            frame = _frame({"id": job.id, "task": item.task, "response": item.response, "answer": item.answer,
                            "tests": item.tests, "question": item.question, "row": item.row})
        except (TypeError, ValueError, OverflowError) as e:
            self._finish(job, error_verdict(self.cfg, item.task, _unsendable(e)))
            return
        try:
            await worker.send(frame)
            reply = await asyncio.wait_for(worker.recv(), limit)
        except TimeoutError:
            verdict = error_verdict(self.cfg, item.task, f"grader hung: killed after {limit:.0f}s")
            await self._replace(slot, f"held one item over {limit:.0f}s")
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError) as e:
            await worker.proc.wait()
            why = f"grader worker crashed (exit status {worker.proc.returncode})"
            verdict = error_verdict(self.cfg, item.task, why)
            await self._replace(slot, f"crashed ({type(e).__name__})")
        else:
            if reply.get("id") != job.id:
                verdict = error_verdict(self.cfg, item.task, "grader worker answered out of turn")
                await self._replace(slot, "answered out of turn")
            else:
                verdict = Verdict(float(reply["reward"]), bool(reply["correct"]), dict(reply["details"]))
        self._finish(job, verdict)

    def _finish(self, job: _Job, verdict: Verdict) -> None:
        """Count `verdict` and give it to whoever waits for `job`."""
        if "error" in verdict.details:
            self.stats.errors += 1
        if verdict.details.get("grader") in ("function", "url"):
            self.stats.user_graded += 1
            self.stats.user_refused += bool(verdict.details.get("refused"))
        self.stats.graded += 1
        if not job.future.done():
            job.future.set_result(verdict)

    def _submit(self, item: GradeItem, deadline: float) -> asyncio.Future:
        """The future of `item`'s verdict: an identical item's, graded or under way, else a new job."""
        try:
            key = item_key(item, with_row=bool(self.cfg.function or self.cfg.url)) if self._cache.size else None
        except (TypeError, ValueError, OverflowError) as e:      # what msgpack cannot write
            future = asyncio.get_running_loop().create_future()
            future.set_result(error_verdict(self.cfg, item.task, _unsendable(e)))
            return future
        job = self._cache.get(key) if key is not None else None
        if job is not None:
            self.stats.cached += 1
            job.deadline = max(job.deadline, deadline)
            return job.future
        self._ids += 1
        job = _Job(self._ids, item, asyncio.get_running_loop().create_future(), deadline)
        self._queue.put_nowait(job)
        if key is not None:
            self._cache.put(key, job, job.future)
        return job.future

    async def grade(self, items: list[GradeItem], deadline_s: float) -> list[Verdict]:
        """Verdicts for `items` within `deadline_s` (items still waiting then get error verdicts)."""
        # Leave a little of the caller's budget for the reply to travel back.
        deadline = time.monotonic() + max(0.05, deadline_s - min(1.0, deadline_s * 0.1))
        futures = [self._submit(item, deadline) for item in items]
        if futures:
            await asyncio.wait(set(futures), timeout=max(0.0, deadline - time.monotonic()))
        out = []
        for item, future in zip(items, futures, strict=True):
            # A future shared with a later request keeps running for it: this request answers alone.
            verdict = future.result() if future.done() else \
                error_verdict(self.cfg, item.task, f"request deadline of {deadline_s:g}s passed")
            if not future.done() or verdict.details.get("error") == EXPIRED:
                self.stats.expired += 1
            out.append(verdict)
        return out

    async def close(self) -> None:
        for d in self._drivers:
            d.cancel()
        await asyncio.gather(*self._drivers, return_exceptions=True)
        await asyncio.gather(*(w.kill() for w in self._workers.values()))
