"""`tandem rollout --exp DIR [--rank R]` (a rollout worker) and `tandem eval --exp DIR --out F`
(greedy accuracy of the policy the generation servers hold now, on held-out problems)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from services.protocol import (
    ExpDir,
    GradeRequest,
    PickServer,
    RequestClient,
    Shutdown,
    load_keys,
    read_service,
    setup_role_logging,
    write_json_atomic,
)

log = logging.getLogger(__name__)

# Waiting for a generation server when none is in rotation.
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.1, 2.0


class ControllerRouting:
    """Routes each generation request through the controller (least outstanding, sticky)."""

    def __init__(self, exp: ExpDir, controller: RequestClient, worker_id: str):
        self.exp, self.controller, self.worker_id = exp, controller, worker_id
        self._keys: dict[str, str | None] = {}
        self._last_wait_log = -1e9

    def _api_key(self, ref: str) -> str | None:
        if ref not in self._keys:
            self._keys[ref] = (self.exp.keys / ref).read_text().strip() if ref else None
        return self._keys[ref]

    async def __call__(self, sticky_key: str, exclude: frozenset):
        """The server to use; while none is servable, waits (exponential backoff up to
        BACKOFF_MAX_S): the group keeps its prompt and its slot instead of failing, and the
        controller is asked a few times a second at most, however long the outage."""
        from rollout.client import ServerRef
        delay = BACKOFF_FIRST_S
        while True:
            choice = await self.controller.request(PickServer(self.worker_id, sticky_key, sorted(exclude)))
            if choice.address:
                return ServerRef(choice.address, self._api_key(choice.api_key_ref))
            now = time.monotonic()
            if now - self._last_wait_log > 30.0:
                log.warning("waiting for a generation server: %s", choice.wait_reason)
                self._last_wait_log = now
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)


def _services(exp: ExpDir, worker_id: str):
    from rollout.client import GenerationClient
    keys = load_keys(exp.keys)
    controller = RequestClient(keys, lambda: read_service(exp, "controller", timeout_s=30))
    generator = GenerationClient(ControllerRouting(exp, controller, worker_id))
    return keys, controller, generator


def cmd_rollout(args) -> int:
    from rollout.worker import RolloutWorker

    exp = ExpDir(args.exp)
    setup_role_logging(exp, "rollout", args.rank)
    shutdown = Shutdown().install()

    async def main():
        worker_id = f"rollout-{args.rank}"
        _, controller, generator = _services(exp, worker_id)
        worker = RolloutWorker(args.cfg, exp, args.rank, generator, controller, shutdown)
        try:
            return await worker.run()
        finally:
            await generator.close()

    return asyncio.run(main())


def held_out_prompts(cfg, n: int):
    """Problems never drawn for training: a separate synthetic seed, or `rollout.eval_dataset`."""
    from rollout.worker import load_prompts
    if cfg.rollout.eval_dataset:
        return load_prompts(cfg.rollout.eval_dataset, cfg.reward.task, n, cfg.experiment.seed)[:n]
    train = {p.text for p in load_prompts(cfg.rollout.dataset, cfg.reward.task, cfg.rollout.synthetic_size,
                                          cfg.experiment.seed)}
    pool = load_prompts(cfg.rollout.dataset, cfg.reward.task, 4 * n, cfg.experiment.seed + 10_000)
    return [p for p in pool if p.text not in train][:n]


async def evaluate(cfg, exp: ExpDir, n: int) -> dict:
    from transformers import AutoTokenizer

    from rollout.workflow import chat_prompt_ids, grade_item

    keys, _, generator = _services(exp, "eval")
    reward = RequestClient(keys, lambda: read_service(exp, "reward", timeout_s=30), timeout_s=300)
    tok = AutoTokenizer.from_pretrained(cfg.experiment.model)
    prompts = held_out_prompts(cfg, n)
    greedy = {"temperature": 0.0, "top_k": 1, "max_new_tokens": cfg.rollout.max_new_tokens}
    sem = asyncio.Semaphore(64)
    t0 = time.time()

    async def one(i, p):
        async with sem:
            res = await generator.generate(chat_prompt_ids(tok, p.text), greedy, f"eval/{i}")
            return tok.decode(res.output_ids, skip_special_tokens=True), min(res.output_versions or [0])

    outs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    verdicts = []
    for k in range(0, len(prompts), 64):
        items = [grade_item(p, o[0]) for p, o in zip(prompts[k:k + 64], outs[k:k + 64], strict=True)]
        verdicts += (await reward.request(GradeRequest(items=items, deadline_s=300))).verdicts
    await generator.close()
    correct = sum(v.correct for v in verdicts)
    return {"accuracy": correct / max(1, len(prompts)), "n": len(prompts), "correct": correct,
            "version": min((o[1] for o in outs), default=0), "seconds": round(time.time() - t0, 1)}


def cmd_eval(args) -> int:
    exp = ExpDir(args.exp)
    setup_role_logging(exp, "eval", 0)
    result = asyncio.run(evaluate(args.cfg, exp, args.n or args.cfg.rollout.eval_size))
    write_json_atomic(Path(args.out), result)
    print(json.dumps(result))
    return 0


def register(sub) -> None:
    p = sub.add_parser("rollout", help="run a rollout worker (role)")
    p.add_argument("--exp", required=True, help="experiment directory")
    p.add_argument("--rank", type=int, default=0)
    p.set_defaults(func=cmd_rollout)
    p = sub.add_parser("eval", help="greedy accuracy of the served policy on held-out problems")
    p.add_argument("--exp", required=True, help="experiment directory")
    p.add_argument("--out", required=True, help="JSON file for the result")
    p.add_argument("--n", type=int, default=0, help="problems (default: rollout.eval_size)")
    p.set_defaults(func=cmd_eval)
