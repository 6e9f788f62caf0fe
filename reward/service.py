"""`tandem reward serve --exp DIR`: the reward service (ZeroMQ ROUTER with CURVE + a grader pool).

Rollout workers send `GradeRequest`s (a batch of items and a deadline) and get one `Verdict` per
item, in order, always: items the pool could not grade in time, or whose grader crashed or hung,
come back as error verdicts (`details.error`) with the wrong-answer reward. The address is
published in `<exp>/services/reward.json`.
"""
from __future__ import annotations

import asyncio
import logging
import time

from tandem.reward.config import RewardConfig
from tandem.reward.pool import GraderPool
from tandem.reward.sandbox import UNISOLATED
from tandem.services.protocol import (
    ExpDir,
    GradeReply,
    GradeRequest,
    MetricsWriter,
    RequestServer,
    Shutdown,
    StatusReply,
    StatusRequest,
    load_keys,
    publish_service,
    serve_at_previous_address,
    setup_role_logging,
)

log = logging.getLogger(__name__)
METRICS_EVERY_S = 10.0


class RewardService:
    def __init__(self, exp: ExpDir, cfg: RewardConfig):
        self.exp, self.cfg = exp, cfg
        self.pool = GraderPool(cfg)
        self.server: RequestServer | None = None

    @property
    def requests(self) -> int:
        return self.server.handled if self.server is not None else 0

    async def grade(self, req: GradeRequest) -> GradeReply:
        if req.deadline_s <= 0:
            raise ValueError(f"grade: deadline_s must be > 0, got {req.deadline_s}")
        return GradeReply(verdicts=await self.pool.grade(req.items, req.deadline_s))

    def status(self, _req: StatusRequest) -> StatusReply:
        s = self.pool.stats
        return StatusReply(state={"role": "reward", "workers": self.pool.pids(), "graded": s.graded,
                                  "errors": s.errors, "restarts": s.restarts, "expired": s.expired,
                                  "cached": s.cached, "requests": self.requests, "isolation": s.isolation,
                                  "grader": self.grader, "user_graded": s.user_graded,
                                  "user_refused": s.user_refused})

    @property
    def grader(self) -> str:
        """Who scores the items: the built-in graders, or the user's function or endpoint."""
        return f"function {self.cfg.function}" if self.cfg.function else \
            f"url {self.cfg.url}" if self.cfg.url else "built-in"

    def _record(self, metrics: MetricsWriter) -> None:
        s = self.pool.stats
        metrics.log(event="reward", graded=s.graded, errors=s.errors, restarts=s.restarts, expired=s.expired,
                    cached=s.cached, requests=self.requests, user_graded=s.user_graded, user_refused=s.user_refused)

    async def run(self, shutdown: Shutdown) -> int:
        try:
            await self.pool.start()
        except RuntimeError as e:   # e.g. reward.function does not import in a worker
            log.error("%s", e)
            return 2
        builtin_code = self.cfg.task == "code" and not (self.cfg.function or self.cfg.url)
        if builtin_code and self.pool.stats.isolation != "bwrap" and not self.cfg.allow_unisolated:
            await self.pool.close()
            log.error("code isolation %s: %s", self.pool.stats.isolation, UNISOLATED)
            return 2
        # A restart binds the announced port again: workers holding the address reach it at once.
        # Graded for the workers and the evaluation only (keys.py: each role's own key).
        self.server = serve_at_previous_address(self.exp, "reward", load_keys(self.exp.keys),
                                                {"grade": self.grade, "status": self.status},
                                                host=self.cfg.host, port=self.cfg.port,
                                                senders={"grade": ("rollout-", "eval")})
        publish_service(self.exp, "reward", {"address": self.server.address, "workers": self.pool.size,
                                             "isolation": self.pool.stats.isolation, "grader": self.grader})
        log.info("reward service on %s: %d grader workers (%s), code isolation %s", self.server.address,
                 self.pool.size, self.grader, self.pool.stats.isolation)
        if self.pool.stats.isolation != "bwrap":
            log.warning("generated code runs WITHOUT bubblewrap (%s): no filesystem or network isolation "
                        "(reward.allow_unisolated); install bubblewrap (`make sandbox-deps`)",
                        self.pool.stats.isolation)
        metrics = MetricsWriter(self.exp, "reward")
        serving = asyncio.ensure_future(self.server.serve_forever())
        last = time.monotonic()
        try:
            while not shutdown.requested and not serving.done():
                await asyncio.sleep(0.2)
                if time.monotonic() - last >= METRICS_EVERY_S:
                    last = time.monotonic()
                    self._record(metrics)
        finally:
            self._record(metrics)    # the last counts, however short the run
            self.server.close()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await self.pool.close()
            metrics.close()
        if serving.done() and not serving.cancelled() and serving.exception():
            log.error("server loop failed: %s", serving.exception())
            return 1
        return 0


def serve(exp_root: str, cfg: RewardConfig) -> int:
    exp = ExpDir(exp_root)
    setup_role_logging(exp, "reward")
    shutdown = Shutdown().install()
    return asyncio.run(RewardService(exp, cfg).run(shutdown))
