"""`tandem rollout --exp DIR [--rank R]` (a rollout worker) and `tandem eval --exp DIR --out F`
(greedy accuracy of the policy the generation servers hold now, on held-out problems; with
`--checkpoint vN`, of a trainer checkpoint on a server of its own: rollout/checkpoint_eval.py).

`tandem eval --exp` on a run whose servers are gone (it ended) first asks its controller, for a
few seconds at most, whether it is there; if not, it evaluates the run's final policy on a
server of its own (`--checkpoint final`) instead of waiting on a controller that will never
answer."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from tandem.services.protocol import (
    POLICY_ADAPTER,
    ExpDir,
    MetricsWriter,
    PickServer,
    RequestClient,
    Shutdown,
    StatusRequest,
    SyncRequestClient,
    load_keys,
    read_service,
    setup_role_logging,
    worker_identity,
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
        from tandem.rollout.client import ServerRef
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


def _routed(cfg) -> tuple[int, int] | None:
    """(layers, top_k) to ask the servers for when the run replays or measures routes
    (trainer.routing_replay, trainer.routing_agreement)."""
    if not getattr(cfg.trainer, "records_routing", False):
        return None
    import json
    from pathlib import Path

    from tandem.services.protocol.trajectory import routing_shape
    shape = routing_shape(json.loads((Path(cfg.experiment.model) / "config.json").read_text()))
    if shape is None:
        raise SystemExit(f"trainer.routing_replay/routing_agreement: {cfg.experiment.model} has no experts to route")
    return shape[:2]


def _services(cfg, exp: ExpDir, worker_id: str, routing: bool = True):
    from tandem.rollout.client import GenerationClient
    keys = load_keys(exp.keys, worker_id)   # its own identity: it may speak for itself only (keys.py)
    controller = RequestClient(keys, lambda: read_service(exp, "controller", timeout_s=30))
    # A run whose servers serve the trained LoRA adapter by name: every request names it.
    adapter = POLICY_ADAPTER if cfg.trainer.lora.adapter_sync else None
    generator = GenerationClient(ControllerRouting(exp, controller, worker_id), adapter=adapter,
                                 chunk_tokens=cfg.rollout.new_tokens_per_chunk,
                                 routed_experts=_routed(cfg) if routing else None)
    return keys, controller, generator


def cmd_rollout(args) -> int:
    from tandem.rollout.worker import RolloutWorker

    exp = ExpDir(args.exp)
    setup_role_logging(exp, "rollout", args.rank)
    shutdown = Shutdown().install()

    async def main():
        worker_id = worker_identity(args.rank)
        _, controller, generator = _services(args.cfg, exp, worker_id)
        worker = RolloutWorker(args.cfg, exp, args.rank, generator, controller, shutdown)
        try:
            return await worker.run()
        finally:
            await generator.close()

    return asyncio.run(main())


async def evaluate(cfg, exp: ExpDir, n: int) -> dict:
    from tandem.rollout.evaluation import evaluate_prompts, held_out_prompts

    keys, _, generator = _services(cfg, exp, "eval", routing=False)   # nothing trains on eval samples
    reward = RequestClient(keys, lambda: read_service(exp, "reward", timeout_s=30), timeout_s=300)
    try:
        return await evaluate_prompts(cfg, held_out_prompts(cfg, n), generator, reward)
    finally:
        await generator.close()


# Seconds `tandem eval` waits for the run's controller to answer before taking the run as ended.
PROBE_S = 3.0


def controller_answers(exp: ExpDir, timeout_s: float = PROBE_S) -> bool:
    """Whether the run's controller is up (a status request answered): no announcement, or a
    controller on this machine whose process is gone, is known without waiting."""
    try:
        info = read_service(exp, "controller")
    except TimeoutError:
        return False
    address, pid = str(info.get("address", "")), info.get("pid")
    if pid and address.startswith(("tcp://127.0.0.1:", "tcp://localhost:", "ipc://")):
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError):
            pass
    try:
        client = SyncRequestClient(load_keys(exp.keys), address, timeout_s=timeout_s)
    except Exception:   # keys or address unreadable: nothing to ask
        return False
    try:
        client.request(StatusRequest())
        return True
    except Exception:   # no reply in time, or a reply that is not one
        return False
    finally:
        with contextlib.suppress(Exception):
            client.close()


def cmd_eval(args) -> int:
    from tandem.rollout.checkpoint_eval import FINAL, cmd_eval_checkpoint
    if args.dataset:   # a held-out set the run was not given (its own, or another)
        args.cfg.rollout.eval_dataset = args.dataset
    if args.checkpoint:
        return cmd_eval_checkpoint(args)
    exp = ExpDir(args.exp)
    if not controller_answers(exp):
        if args.tag:   # the launcher's before/after: its servers must be up; a private one is not that figure
            print(f"tandem eval: the run's controller ({exp.service_file('controller')}) does not answer",
                  file=sys.stderr)
            return 1
        print("tandem eval: the run's generation servers are not running (the run has ended): evaluating "
              "its final policy on a server of its own", file=sys.stderr, flush=True)
        args.checkpoint = FINAL
        return cmd_eval_checkpoint(args)
    if not args.out:
        print("tandem eval: --out is required while the run is going (without --checkpoint)", file=sys.stderr)
        return 2
    setup_role_logging(exp, "eval", 0)
    try:
        result = asyncio.run(evaluate(args.cfg, exp, args.n or args.cfg.rollout.eval_size or 100))
    except TimeoutError as e:   # the run ended (or its controller died) while this waited
        print(f"tandem eval: the run stopped answering ({e})", file=sys.stderr)
        return 1
    write_json_atomic(Path(args.out), result)
    if args.tag:   # the run's before/after figures: also a record, for the report and trackers
        from tandem.rollout.evaluation import eval_record
        writer = MetricsWriter(exp, "eval")
        writer.log(**eval_record(result, tag=args.tag))
        writer.close()
    print(json.dumps(result))
    return 0


def register(sub) -> None:
    p = sub.add_parser("rollout", help="run a rollout worker (role)")
    p.add_argument("--exp", required=True, help="experiment directory")
    p.add_argument("--rank", type=int, default=0)
    p.set_defaults(func=cmd_rollout)
    p = sub.add_parser("eval", help="greedy accuracy on held-out problems: of the policy the run's servers "
                                     "hold now, or of a checkpoint (--checkpoint)")
    p.add_argument("--exp", required=True, help="experiment directory")
    p.add_argument("--out", default=None, help="JSON file for the result (with --checkpoint: default "
                                               "<exp>/eval-v<N>.json)")
    p.add_argument("--tag", default="", help="without --checkpoint: also log the result as an `eval` record "
                                             "of metrics.jsonl with this tag (the launcher's before/after)")
    p.add_argument("--n", type=int, default=0, help="problems (default: rollout.eval_size, else 100)")
    p.add_argument("--checkpoint", default=None, metavar="vN|N|latest|final",
                   help="evaluate this trainer checkpoint (<exp>/checkpoints/step-N) on a generation server of "
                        "its own, through its OpenAI-compatible API; final: the run's last policy (its newest "
                        "published weights, else checkpoint), what a run that has ended is evaluated on")
    p.add_argument("--dataset", default=None, metavar="FILE",
                   help="held-out problems to ask (a data set as rollout.eval_dataset reads them, through "
                        "rollout.eval_columns or rollout.columns); default: the run's rollout.eval_dataset, else "
                        "problems of rollout.dataset it never trained on (a synthetic task's other seed)")
    p.add_argument("--threads", type=int, default=0, help="with --checkpoint: torch threads of its server")
    p.add_argument("--answers", default=None, help="with --checkpoint: also write every problem, response and "
                                                   "verdict to this JSONL file")
    p.set_defaults(func=cmd_eval)
